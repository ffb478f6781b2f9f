//! Dense GGML blocks under a slice: a column slice keeps whole Q8_0 blocks, a cut through
//! one is an error naming the block size, and the TP preset cuts a GGUF file's attention
//! tensors as it does safetensors'.

use super::common;
use super::{base, options};
use numapin::model::{Checkpoint, SliceAxis, TensorSlice};
use numapin::store::StoreOptions;

/// A GGUF v3 file with two dense Q8_0 tensors `[8 rows, 64 columns]` (`ne` `[64, 8]`:
/// two 34-byte blocks of 32 elements a row), data a byte pattern; returns its path and
/// each tensor's bytes as written.
fn q8_0_gguf(dir: &std::path::Path) -> (std::path::PathBuf, Vec<(String, Vec<u8>)>) {
    const Q8_0: u32 = 8;
    let names = ["blk.0.attn_q.weight", "blk.0.attn_output.weight"];
    let bytes = 8 * 2 * 34;
    let gstr = |s: &str| {
        let mut out = (s.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(s.as_bytes());
        out
    };
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(names.len() as u64).to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    let mut at = 0u64;
    for name in names {
        out.extend_from_slice(&gstr(name));
        out.extend_from_slice(&2u32.to_le_bytes());
        for d in [64u64, 8] {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&Q8_0.to_le_bytes());
        out.extend_from_slice(&at.to_le_bytes());
        at = (at + bytes).next_multiple_of(32);
    }
    out.resize(out.len().next_multiple_of(32), 0);
    let mut tensors = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let data: Vec<u8> = (0..bytes).map(|b| (b * 7 + i as u64 * 3) as u8).collect();
        out.extend_from_slice(&data);
        out.resize(out.len().next_multiple_of(32), 0);
        tensors.push((name.to_string(), data));
    }
    let path = dir.join("q8_0.gguf");
    std::fs::write(&path, out).unwrap();
    (path, tensors)
}

/// Dense GGML blocks: a column slice keeps whole Q8_0 blocks (each rank one block a row,
/// its bytes the file's, cut here by index arithmetic), a cut through one is an error
/// naming the block size, and the TP preset cuts attn_q by rows and attn_output by
/// columns.
#[test]
fn dense_ggml_blocks_are_kept_whole_or_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("numapin-share-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (path, tensors) = q8_0_gguf(&dir);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let nodes = common::nodes();
    let (row, block) = (68usize, 34usize);
    for k in 0..2u64 {
        let plan = base(nodes).dense_slice(TensorSlice::part(SliceAxis::Columns, k, 2).unwrap());
        let model = checkpoint.place(&plan, options()).unwrap();
        for (name, bytes) in &tensors {
            let view = model.tensor(name).unwrap();
            assert_eq!(view.shape(), &[8, 32], "{name}");
            let want: Vec<u8> = bytes
                .chunks(row)
                .flat_map(|r| r[k as usize * block..(k as usize + 1) * block].to_vec())
                .collect();
            assert!(view.bytes().unwrap() == &want[..], "{name} rank {k}");
        }
        assert!(model.verify(&checkpoint).unwrap().verified());
        let plan = base(nodes).tensor_parallel(k, 2).unwrap();
        let model = checkpoint.place(&plan, options()).unwrap();
        let q = model.tensor("blk.0.attn_q.weight").unwrap();
        assert_eq!(q.shape(), &[4, 64]);
        let rows = &tensors[0].1[k as usize * 4 * row..(k as usize + 1) * 4 * row];
        assert!(q.bytes().unwrap() == rows, "attn_q rank {k}");
        let o = model.tensor("blk.0.attn_output.weight").unwrap();
        assert_eq!(o.shape(), &[8, 32]);
        assert_eq!(o.slice().unwrap().axis, SliceAxis::Columns);
    }
    let plan = base(nodes).dense_slice(TensorSlice::part(SliceAxis::Columns, 1, 4).unwrap());
    let text = checkpoint
        .placement_cost(&plan, &StoreOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("Q8_0 blocks of 32 elements") && text.contains("attn_q"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
