//! Hand-made GGUF headers: one per fault.

use super::*;

fn gguf_fault(bytes: &[u8]) -> (CheckpointFault, Option<String>, String) {
    match gguf::parse(&bytes.to_vec(), "test.gguf") {
        Err(Error::Checkpoint {
            file,
            tensor,
            kind,
            reason,
        }) => {
            assert_eq!(file, "test.gguf");
            (kind, tensor, reason)
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn gguf_valid_header_versions_2_and_3() {
    for version in [2, 3] {
        let mut b = GgufBuilder::new();
        b.version = version;
        let bytes = b.bytes();
        let header = gguf::parse(&bytes, "t").unwrap();
        assert_eq!(header.version, version);
        assert_eq!(header.alignment, 32);
        assert_eq!(header.data_start % 32, 0);
        let t = &header.tensors[1];
        assert_eq!(t.name(), "blk.0.ffn_gate_exps.weight");
        assert_eq!((t.offset(), t.len()), (header.data_start + 32, 4 * 34));
        assert_eq!(t.offset() + t.len(), bytes.len() as u64);
    }
}

#[test]
fn gguf_wrong_magic_and_unknown_version() {
    let mut b = GgufBuilder::new();
    b.magic = *b"GGML";
    assert_eq!(gguf_fault(&b.bytes()).0, CheckpointFault::Header);
    for version in [1, 4] {
        let mut b = GgufBuilder::new();
        b.version = version;
        let (kind, _, reason) = gguf_fault(&b.bytes());
        assert_eq!(kind, CheckpointFault::Header);
        assert!(reason.contains(&format!("version {version}")), "{reason}");
    }
}

#[test]
fn gguf_string_and_array_lengths() {
    // A string length past the end, and one absurdly large.
    let mut bytes = GgufBuilder::new().bytes();
    let at = 4 + 4 + 8 + 8; // the first key's length
    let len = bytes.len() as u64;
    bytes[at..at + 8].copy_from_slice(&len.to_le_bytes());
    let (kind, _, reason) = gguf_fault(&bytes);
    assert_eq!(kind, CheckpointFault::Truncated, "{reason}");
    bytes[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let (kind, _, reason) = gguf_fault(&bytes);
    assert_eq!(kind, CheckpointFault::Header, "{reason}");
    assert!(reason.contains("absurdly large"), "{reason}");
    // An array claiming 2^60 u32 elements.
    let mut value = 4u32.to_le_bytes().to_vec();
    value.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let b = GgufBuilder::new().kv("big", 9, value);
    let ((kind, _, reason), largest) = largest_allocation_during(|| gguf_fault(&b.bytes()));
    assert_eq!(kind, CheckpointFault::Truncated, "{reason}");
    assert!(reason.contains("big"), "{reason}");
    assert!(largest <= b.bytes().len() * 8, "allocated {largest}");
}

#[test]
fn gguf_counts_beyond_the_file() {
    for (at, what) in [(8, "tensor count"), (16, "key/value count")] {
        let mut bytes = GgufBuilder::new().bytes();
        bytes[at..at + 8].copy_from_slice(&(u64::MAX / 3).to_le_bytes());
        let (kind, _, reason) = gguf_fault(&bytes);
        assert_eq!(kind, CheckpointFault::Header, "{reason}");
        assert!(reason.contains(what), "{reason}");
    }
    let mut b = GgufBuilder::new();
    b.tensors[0].1 = vec![1; 5];
    let (kind, tensor, reason) = gguf_fault(&b.bytes());
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Header, Some("norm"))
    );
    assert!(reason.contains("5 dimensions"), "{reason}");
}

#[test]
fn gguf_unknown_type_names_it() {
    let mut b = GgufBuilder::new();
    b.tensors[0].2 = 4; // Q4_2, retired
    let (kind, tensor, reason) = gguf_fault(&b.bytes());
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::UnknownType, Some("norm"))
    );
    assert!(reason.contains("type id 4"), "{reason}");
}

#[test]
fn gguf_tensor_past_eof_misaligned_overlapping_and_partial_block() {
    let mut b = GgufBuilder::new();
    b.data -= 1;
    let (kind, tensor, reason) = gguf_fault(&b.bytes());
    assert_eq!(kind, CheckpointFault::Range, "{reason}");
    assert_eq!(tensor.as_deref(), Some("blk.0.ffn_gate_exps.weight"));
    assert!(reason.contains("past the end"), "{reason}");

    let mut b = GgufBuilder::new();
    b.tensors[1].3 = 16;
    let (kind, _, reason) = gguf_fault(&b.bytes());
    assert_eq!(kind, CheckpointFault::Range);
    assert!(
        reason.contains("not a multiple of the alignment 32"),
        "{reason}"
    );

    let mut b = GgufBuilder::new();
    b.tensors[0].1 = vec![16]; // 64 bytes of F32 from 0 reach into the next at 32
    let (kind, tensor, reason) = gguf_fault(&b.bytes());
    assert_eq!(kind, CheckpointFault::Range);
    assert_eq!(tensor.as_deref(), Some("blk.0.ffn_gate_exps.weight"));
    assert!(reason.contains("overlap"), "{reason}");

    let mut b = GgufBuilder::new();
    b.tensors[1].1 = vec![48, 2, 2];
    let (kind, _, reason) = gguf_fault(&b.bytes());
    assert_eq!(kind, CheckpointFault::Size);
    assert!(reason.contains("block size 32"), "{reason}");
}

#[test]
fn gguf_alignment_zero_or_not_a_power_of_two() {
    for bad in [0u32, 3, 48] {
        let b = GgufBuilder::new().kv("general.alignment", 4, bad.to_le_bytes().to_vec());
        let (kind, _, reason) = gguf_fault(&b.bytes());
        assert_eq!(kind, CheckpointFault::Header);
        assert!(reason.contains("power of two"), "{reason}");
    }
    let mut b = GgufBuilder::new().kv("general.alignment", 4, 64u32.to_le_bytes().to_vec());
    b.alignment = 64;
    b.tensors[1].3 = 64;
    b.data = 64 + 4 * 34;
    let header = gguf::parse(&b.bytes(), "t").unwrap();
    assert_eq!((header.alignment, header.data_start % 64), (64, 0));
}

fn split_part(no: u16, count: u16, tensors: i32, name: &str) -> Vec<u8> {
    let mut b = GgufBuilder::new()
        .kv("split.no", 2, no.to_le_bytes().to_vec())
        .kv("split.count", 2, count.to_le_bytes().to_vec())
        .kv("split.tensors.count", 5, tensors.to_le_bytes().to_vec());
    b.tensors = vec![(name.into(), vec![8], 0, 0)];
    b.data = 32;
    b.bytes()
}

#[test]
fn gguf_split_part_missing_or_disagreeing() {
    let dir = scratch("split");
    let first = dir.join("m-00001-of-00002.gguf");
    std::fs::write(&first, split_part(0, 2, 2, "a")).unwrap();
    let (_, kind, _, reason) = checkpoint_fault(Checkpoint::open(&first));
    assert_eq!(kind, CheckpointFault::Missing);
    assert!(reason.contains("m-00002-of-00002.gguf"), "{reason}");

    std::fs::write(dir.join("m-00002-of-00002.gguf"), split_part(1, 3, 2, "b")).unwrap();
    let (file, kind, _, reason) = checkpoint_fault(Checkpoint::open(&first));
    assert_eq!(kind, CheckpointFault::Split);
    assert!(file.ends_with("m-00002-of-00002.gguf"), "{file}");
    assert!(
        reason.contains("split.count is 3 but the first part says 2"),
        "{reason}"
    );

    let unkeyed = dir.join("u-00001-of-00002.gguf");
    std::fs::write(&unkeyed, GgufBuilder::new().bytes()).unwrap();
    let (_, kind, _, reason) = checkpoint_fault(Checkpoint::open(&unkeyed));
    assert_eq!(kind, CheckpointFault::Split);
    assert!(reason.contains("no split.count"), "{reason}");

    std::fs::write(dir.join("m-00002-of-00002.gguf"), split_part(1, 2, 2, "b")).unwrap();
    let checkpoint = Checkpoint::open(&first).unwrap();
    assert_eq!(checkpoint.files().len(), 2);
    assert_eq!(
        checkpoint
            .tensors()
            .iter()
            .map(|t| t.file())
            .collect::<Vec<_>>(),
        [0, 1]
    );
}

/// A sparse 1 TiB file (issue 31): a header claiming `tensors` tensor infos and `kvs`
/// key/values, `entries` written after it, the rest zeros; the typed error it gives.
fn sparse_tib(
    name: &str,
    tensors: u64,
    kvs: u64,
    entries: &[u8],
) -> (CheckpointFault, Option<String>, String) {
    let dir = std::env::temp_dir().join(format!("numapin-sparse-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sparse.gguf");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    let mut head = b"GGUF".to_vec();
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&tensors.to_le_bytes());
    head.extend_from_slice(&kvs.to_le_bytes());
    // The entries written out (zeros: key "" of type u8 = 0, or a tensor "" of no
    // dimensions, F32, offset 0); the rest of the TiB is a hole of zeros.
    head.extend_from_slice(entries);
    file.write_all_at(&head, 0).unwrap();
    file.set_len(1 << 40).unwrap();
    let out = gguf::parse(&file, "sparse.gguf");
    std::fs::remove_dir_all(&dir).unwrap();
    match out {
        Err(Error::Checkpoint {
            kind,
            tensor,
            reason,
            ..
        }) => (kind, tensor, reason),
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

/// Every key or name `""` (the file's zeros): refused at the second entry with the typed
/// error; before, the walk went on through the zeros (still running after 60 s).
#[test]
fn gguf_sparse_tib_of_empty_keys_refused_at_the_second() {
    let (kind, _, reason) = sparse_tib("keys", 0, 1 << 36, &[0; 4 * 24]);
    assert_eq!(kind, CheckpointFault::Header, "{reason}");
    assert_eq!(reason, r#"key "" appears twice"#);
    // Tensor infos alike (2^35 of 24 bytes fit the TiB): the name refused as read.
    let (kind, tensor, reason) = sparse_tib("tensors", 1 << 35, 0, &[0; 4 * 24]);
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Duplicate, Some(""))
    );
    assert!(reason.contains("appears twice"), "{reason}");
}

/// Each count fits the file alone, not both: refused before any entry is read, naming
/// both (before, each was checked against the whole file and the walk began).
#[test]
fn gguf_counts_that_fit_alone_but_not_together() {
    let mut bytes = GgufBuilder::new().bytes();
    let left = bytes.len() as u64 - 24;
    bytes[8..16].copy_from_slice(&(left / 24).to_le_bytes());
    bytes[16..24].copy_from_slice(&(left / 13).to_le_bytes());
    let (kind, _, reason) = gguf_fault(&bytes);
    assert_eq!(kind, CheckpointFault::Header, "{reason}");
    assert!(
        reason.contains(&format!("key/value count {}", left / 13))
            && reason.contains(&format!("tensor count {}", left / 24)),
        "{reason}"
    );
}

/// Zeros are valid array elements: one key/value claiming 2^39 `u8`s (they fit the sparse
/// TiB) is refused before its walk, at the header's ceiling; before, the walk read and
/// kept 512 GiB of zeros.
#[test]
fn gguf_sparse_tib_array_refused_at_the_header_ceiling() {
    let mut entry = gstr("a");
    entry.extend_from_slice(&9u32.to_le_bytes()); // array
    entry.extend_from_slice(&0u32.to_le_bytes()); // of u8
    entry.extend_from_slice(&(1u64 << 39).to_le_bytes());
    let (kind, _, reason) = sparse_tib("array", 0, 1, &entry);
    assert_eq!(kind, CheckpointFault::Header, "{reason}");
    assert!(
        reason.contains(r#"array of 549755813888 elements of "a""#)
            && reason.contains(&gguf::MAX_HEADER_BYTES.to_string()),
        "{reason}"
    );
}
