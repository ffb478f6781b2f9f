//! Hand-made safetensors headers: one per fault.

use super::*;

fn st_fault(bytes: &[u8]) -> (CheckpointFault, Option<String>, String) {
    match safetensors::parse(&bytes.to_vec(), "test.safetensors") {
        Err(Error::Checkpoint {
            file,
            tensor,
            kind,
            reason,
        }) => {
            assert_eq!(file, "test.safetensors");
            (kind, tensor, reason)
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

const TWO: &str = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[16,24]}}"#;

#[test]
fn safetensors_valid_header_has_absolute_offsets() {
    let bytes = st_file(TWO.as_bytes(), 24);
    let tensors = safetensors::parse(&bytes, "t").unwrap();
    let header_end = 8 + TWO.len() as u64;
    let got: Vec<_> = tensors
        .iter()
        .map(|t| (t.name().to_owned(), t.offset(), t.len(), t.shape().to_vec()))
        .collect();
    assert_eq!(
        got,
        [
            ("a".to_owned(), header_end, 16, vec![2, 2]),
            ("b".to_owned(), header_end + 16, 8, vec![4])
        ]
    );
}

#[test]
fn safetensors_truncated_and_length_past_eof() {
    assert_eq!(st_fault(&[1, 2, 3]).0, CheckpointFault::Truncated);
    let mut bytes = st_file(TWO.as_bytes(), 24);
    let past = (bytes.len() as u64 - 8 + 1).to_le_bytes();
    bytes[..8].copy_from_slice(&past);
    let (kind, _, reason) = st_fault(&bytes);
    assert_eq!(kind, CheckpointFault::Truncated);
    assert!(reason.contains("past the end"), "{reason}");
}

#[test]
fn safetensors_not_utf8_and_not_json() {
    let (kind, _, reason) = st_fault(&st_file(b"{\"a\xff\":1}", 0));
    assert_eq!(kind, CheckpointFault::Header);
    assert!(reason.contains("UTF-8"), "{reason}");
    let (kind, _, reason) = st_fault(&st_file(b"{\"a\": [", 0));
    assert_eq!(kind, CheckpointFault::Header);
    assert!(reason.contains("JSON"), "{reason}");
}

fn one(dtype: &str, shape: &str, offsets: &str) -> String {
    format!(r#"{{"t":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}}}"#)
}

#[test]
fn safetensors_bad_ranges_name_the_tensor() {
    for (header, data, words) in [
        (one("F32", "[2]", "[8,0]"), 8, "reversed"),
        (one("F32", "[2]", "[0,8]"), 4, "past the 4 byte data section"),
        (
            r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#.to_owned(),
            12,
            "overlap",
        ),
    ] {
        let (kind, tensor, reason) = st_fault(&st_file(header.as_bytes(), data));
        assert_eq!(kind, CheckpointFault::Range, "{reason}");
        assert_eq!(tensor.as_deref(), Some("t"));
        assert!(reason.contains(words), "{reason}");
    }
}

#[test]
fn safetensors_size_mismatch_overflow_and_unknown_dtype() {
    let (kind, tensor, reason) = st_fault(&st_file(one("F16", "[3]", "[0,8]").as_bytes(), 8));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Size, Some("t"))
    );
    assert!(
        reason.contains("hold 8 bytes but F16 × [3] is 6"),
        "{reason}"
    );
    let huge = format!("[{},{}]", u64::MAX / 2, 4);
    let (kind, _, reason) = st_fault(&st_file(one("F32", &huge, "[0,8]").as_bytes(), 8));
    assert_eq!(kind, CheckpointFault::Size);
    assert!(reason.contains("overflows"), "{reason}");
    let (kind, tensor, reason) = st_fault(&st_file(one("F7", "[1]", "[0,1]").as_bytes(), 1));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::UnknownType, Some("t"))
    );
    assert!(reason.contains("\"F7\""), "{reason}");
}

#[test]
fn safetensors_name_twice_in_one_header() {
    let header = r#"{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    let (kind, tensor, _) = st_fault(&st_file(header.as_bytes(), 2));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Duplicate, Some("t"))
    );
}

#[test]
fn safetensors_name_twice_across_shards() {
    let dir = scratch("twice");
    let header = one("U8", "[1]", "[0,1]");
    std::fs::write(dir.join("a.safetensors"), st_file(header.as_bytes(), 1)).unwrap();
    std::fs::write(dir.join("b.safetensors"), st_file(header.as_bytes(), 1)).unwrap();
    let (file, kind, tensor, reason) = checkpoint_fault(Checkpoint::open(&dir));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Duplicate, Some("t"))
    );
    assert!(file.ends_with("b.safetensors"), "{file}");
    assert!(reason.contains("a.safetensors"), "{reason}");
}

#[test]
fn safetensors_index_naming_a_missing_shard() {
    let dir = scratch("missing-shard");
    std::fs::write(
        dir.join("s1.safetensors"),
        st_file(one("U8", "[1]", "[0,1]").as_bytes(), 1),
    )
    .unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"metadata":{},"weight_map":{"t":"s1.safetensors","u":"s2.safetensors"}}"#,
    )
    .unwrap();
    let (file, kind, tensor, reason) = checkpoint_fault(Checkpoint::open(&dir));
    assert_eq!(
        (kind, tensor.as_deref()),
        (CheckpointFault::Missing, Some("u"))
    );
    assert!(file.ends_with("model.safetensors.index.json"));
    assert!(reason.contains("\"s2.safetensors\""), "{reason}");
}
