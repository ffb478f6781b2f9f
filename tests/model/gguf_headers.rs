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
