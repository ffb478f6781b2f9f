//! What a share's views say they are (issue 31): sub-byte column slices refused where a
//! row is not a whole number of packed units, and cut exactly where it is (the bytes
//! compared with the file's own, cut here by index arithmetic).
#![cfg(feature = "model")]

mod common;

use std::path::{Path, PathBuf};

use numapin::model::{Checkpoint, DenseLayout, PlacementPlan, Share, SliceAxis, TensorSlice};
use numapin::store::{Layout, PinStore, StoreOptions};
use numapin::{Error, Invalid};

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("share_views")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file of `tensors` (name, dtype, shape, bytes), in order; the bytes are
/// returned as written.
fn write_st(path: &Path, tensors: &[(&str, &str, &[u64], Vec<u8>)]) {
    let mut header = String::from("{");
    let mut data = Vec::new();
    for (i, (name, dtype, shape, bytes)) in tensors.iter().enumerate() {
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{},{}]}}"#,
            data.len(),
            data.len() + bytes.len()
        ));
        data.extend_from_slice(bytes);
    }
    header.push('}');
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
        .collect()
}

fn whole_plan() -> PlacementPlan {
    PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
}

/// `Error::InvalidArgument` with a `BadValue` whose text names every word of `words`.
fn assert_refused<T: std::fmt::Debug>(result: Result<T, Error>, words: &[&str]) {
    match result {
        Err(e @ Error::InvalidArgument { .. }) => {
            assert!(
                matches!(
                    &e,
                    Error::InvalidArgument {
                        reason: Invalid::BadValue { .. },
                        ..
                    }
                ),
                "{e:?}"
            );
            let text = e.to_string();
            for w in words {
                assert!(text.contains(w), "{w:?} not in {text}");
            }
        }
        other => panic!("expected a refusal naming {words:?}, got {other:?}"),
    }
}

const Q: &str = "model.layers.0.self_attn.q_proj.weight";

/// F4 `[2,3]` (3 elements a row: 1.5 bytes) cut `columns:0:2`, and F6_E2M3 `[2,6]` (6
/// elements a row: 4.5 bytes) cut `columns:0:4`: no row starts on a byte, so no byte
/// range holds the columns; refused naming the tensor and the dtype's packing.
#[test]
fn sub_byte_columns_of_rows_that_are_not_whole_units_are_refused() {
    let dir = scratch("sub_byte_columns_refused");
    for (dtype, shape, bytes, slice) in [
        ("F4", [2u64, 3], 3usize, "columns:0:2"),
        ("F6_E2M3", [2, 6], 9, "columns:0:4"),
    ] {
        let path = dir.join(format!("{dtype}.safetensors"));
        write_st(&path, &[(Q, dtype, &shape, pattern(bytes, 1))]);
        let checkpoint = Checkpoint::open(&path).unwrap();
        let plan = whole_plan().slice_pattern(Q, TensorSlice::parse(slice).unwrap());
        assert_refused(
            checkpoint.place(&plan, StoreOptions::default()),
            &[Q, dtype, "whole"],
        );
        assert_refused(
            checkpoint.placement_cost(&plan, &StoreOptions::default()),
            &[Q, dtype],
        );
    }
}

/// F4 `[2,4]` (2 bytes a row) cut `columns:0:2` is exact: the first byte of each row.
/// F6_E2M3 `[2,8]` (6 bytes a row) cut `columns:4:4`: the last 3 bytes of each row.
#[test]
fn sub_byte_columns_of_whole_units_are_cut_exactly() {
    let dir = scratch("sub_byte_columns_exact");
    for (dtype, shape, bytes, slice, row, keep) in [
        ("F4", [2u64, 4], 4usize, "columns:0:2", 2usize, 0..1usize),
        ("F6_E2M3", [2, 8], 12, "columns:4:4", 6, 3..6),
    ] {
        let path = dir.join(format!("{dtype}.safetensors"));
        let file = pattern(bytes, 7);
        write_st(&path, &[(Q, dtype, &shape, file.clone())]);
        let checkpoint = Checkpoint::open(&path).unwrap();
        let plan = whole_plan().slice_pattern(Q, TensorSlice::parse(slice).unwrap());
        let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();
        let want: Vec<u8> = file
            .chunks(row)
            .flat_map(|r| r[keep.clone()].to_vec())
            .collect();
        let view = model.tensor(Q).unwrap();
        assert_eq!(view.bytes().unwrap(), &want[..], "{dtype} {slice}");
        assert!(model.verify(&checkpoint).unwrap().verified(), "{dtype}");
    }
}

fn expert_name(e: usize, role: &str) -> String {
    format!("model.layers.0.mlp.experts.{e}.{role}_proj.weight")
}

/// Two experts, gate/up/down each `dtype` of `shape` and `bytes` bytes.
fn write_experts(path: &Path, dtype: &str, shape: &[u64], bytes: usize) -> Vec<(String, Vec<u8>)> {
    let names: Vec<(String, Vec<u8>)> = (0..2)
        .flat_map(|e| ["gate", "up", "down"].map(move |r| expert_name(e, r)))
        .enumerate()
        .map(|(i, n)| (n, pattern(bytes, i as u8 * 11)))
        .collect();
    let tensors: Vec<(&str, &str, &[u64], Vec<u8>)> = names
        .iter()
        .map(|(n, b)| (n.as_str(), dtype, shape, b.clone()))
        .collect();
    write_st(path, &tensors);
    names
}

/// `Share::slice(columns:0:2)` on F4 `[2,3]` experts is refused (it packed 9 bytes for
/// three `[2,2]` roles); on F4 `[2,4]` experts each role is the first byte of each row.
#[test]
fn sub_byte_expert_column_shares_are_refused_or_exact() {
    let dir = scratch("sub_byte_expert_shares");
    let share = Share::default().slice(TensorSlice::parse("columns:0:2").unwrap());
    let path = dir.join("f4x3.safetensors");
    write_experts(&path, "F4", &[2, 3], 3);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let store = PinStore::new(Layout::Unplaced, StoreOptions::default()).unwrap();
    assert_refused(checkpoint.pack_share(&store, &share), &["gate_proj", "F4"]);

    let path = dir.join("f4x4.safetensors");
    let names = write_experts(&path, "F4", &[2, 4], 4);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let store = PinStore::new(Layout::Unplaced, StoreOptions::default()).unwrap();
    checkpoint.pack_share(&store, &share).unwrap();
    for e in 0..2 {
        let want: Vec<u8> = names[e * 3..e * 3 + 3]
            .iter()
            .flat_map(|(_, b)| b.chunks(2).map(|r| r[0]).collect::<Vec<u8>>())
            .collect();
        assert_eq!(store.weights(0, e).unwrap(), &want[..], "expert {e}");
    }
    let verify = checkpoint.verify_share(&store, &share).unwrap();
    assert!(verify.verified(), "{verify}");
}

/// `Share::slice` and `Share::tensor_parallel` both say how to cut every expert tensor:
/// the pair is refused naming both (the preset silently won before), in either order and
/// through the whole-model plan.
#[test]
fn an_expert_slice_with_tensor_parallelism_is_refused_by_name() {
    let rows = TensorSlice::parse("rows:0/2").unwrap();
    let words = ["rows:0/2", "tp:0/2", "expert_slice", "tensor_parallel"];
    assert_refused(Share::default().slice(rows).tensor_parallel(0, 2), &words);
    assert_refused(
        whole_plan()
            .share(Share::default().slice(rows))
            .tensor_parallel(0, 2),
        &words,
    );
    let mut both = Share::default().tensor_parallel(0, 2).unwrap().slice(rows);
    assert_refused(both.exclusive_slices(), &words);
    both.tensor_slice = None;
    assert!(both.exclusive_slices().is_ok());
}

fn fixture_plan(nodes: numapin::NodeSet) -> PlacementPlan {
    PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes))
}

/// numpy's cut of a per-expert tensor `[a, b]`: `k`-th of `n` of its rows or of each
/// row's columns; with the cut's shape.
fn numpy_cut(
    bytes: &[u8],
    shape: &[u64],
    axis: SliceAxis,
    k: usize,
    n: usize,
) -> (Vec<u8>, Vec<u64>) {
    let (rows, cols) = (shape[0] as usize, shape[1] as usize);
    let row = bytes.len() / rows;
    match axis {
        SliceAxis::Rows => {
            let per = rows / n;
            let held = bytes[k * per * row..(k + 1) * per * row].to_vec();
            (held, vec![per as u64, cols as u64])
        }
        SliceAxis::Columns => {
            let per = row / n;
            let held = bytes
                .chunks(row)
                .flat_map(|r| r[k * per..(k + 1) * per].to_vec())
                .collect();
            (held, vec![rows as u64, (cols / n) as u64])
        }
    }
}

/// `…experts.{E}.{role}.…` → (E, role).
fn expert_of(tensor: &str) -> Option<(usize, &str)> {
    let words: Vec<&str> = tensor.split('.').collect();
    let at = words.iter().position(|w| *w == "experts")?;
    Some((words.get(at + 1)?.parse().ok()?, words.get(at + 2)?))
}

/// A per-expert tensor read by name under a share (issue 31): its (sliced) part where
/// the expert is held, as numpy cuts the file's tensor; `NotHeld` naming the layer and
/// expert where it is not. Under EP, TP (st-sharded's FP8 weights with their scale
/// grids: gate/up rows, down columns) and EP+TP, and a plain column slice of F16 experts.
#[test]
fn per_expert_tensors_by_name_under_a_share_are_their_held_part() {
    let Some(dir) =
        common::fixtures("per_expert_tensors_by_name_under_a_share_are_their_held_part")
    else {
        return;
    };
    let nodes = common::nodes();
    let n = 2usize;
    type Case = (&'static str, &'static str, Option<&'static str>);
    // (fixture, share, slice): EP alone, TP alone, EP+TP, EP + a column slice.
    let cases: [Case; 4] = [
        ("st-sharded", "ep", None),
        ("st-sharded", "tp", None),
        ("st-sharded", "ep+tp", None),
        ("fam-qwen35-moe", "ep", Some("columns")),
    ];
    for (name, how, slice) in cases {
        let checkpoint = common::open_fixture(&dir, name);
        let numpy = common::numpy_tensors(&dir.join(name));
        let (mut held, mut refused) = (0, 0);
        for k in 0..n {
            let mut share = Share::default();
            if how.starts_with("ep") {
                share = share.experts(numapin::model::ExpertShare::part(k, n).unwrap());
            }
            if let Some(axis) = slice {
                share = share.slice(TensorSlice::parse(&format!("{axis}:{k}/{n}")).unwrap());
            }
            let mut plan = fixture_plan(nodes).share(share);
            if how.ends_with("tp") {
                plan = plan.tensor_parallel(k as u64, n as u64).unwrap();
            }
            let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();
            let verify = model.verify(&checkpoint).unwrap();
            assert!(verify.verified(), "{name} {how} {k}: {verify}");
            // EP's part of 4 experts: rank k holds experts 2k and 2k + 1.
            let holds = |e: usize| !how.starts_with("ep") || e / 2 == k;
            for (tensor, shape, bytes) in &numpy {
                let Some((e, role)) = expert_of(tensor) else {
                    continue;
                };
                let result = model.tensor(tensor);
                if !holds(e) {
                    match result {
                        Err(Error::NotHeld { op, expert, .. }) => {
                            assert_eq!((op, expert), ("PlacedModel::tensor", e), "{tensor}");
                        }
                        other => panic!("{name} {how} {k} {tensor}: {other:?}"),
                    }
                    refused += 1;
                    continue;
                }
                let view = result.unwrap();
                // The axis the share cuts this role along (TP: the convention by role).
                let axis = match (how.ends_with("tp"), slice) {
                    (true, _) if role == "down_proj" => Some(SliceAxis::Columns),
                    (true, _) => Some(SliceAxis::Rows),
                    (false, Some(_)) => Some(SliceAxis::Columns),
                    (false, None) => None,
                };
                let (want, want_shape) = match axis {
                    Some(axis) => numpy_cut(bytes, shape, axis, k, n),
                    None => (bytes.clone(), shape.clone()),
                };
                assert_eq!(view.shape(), &want_shape[..], "{name} {how} {k} {tensor}");
                assert!(
                    view.held_bytes().unwrap() == &want[..],
                    "{name} {how} {k} {tensor}: not numpy's cut"
                );
                let s = view.slice();
                assert_eq!(s.map(|s| s.axis), axis, "{name} {how} {k} {tensor}");
                // The view is the piece expert(layer, e) gives.
                let pieces = model.expert(view.layer().unwrap(), e).unwrap();
                let piece = pieces.iter().find(|p| p.tensor == tensor).unwrap();
                assert_eq!(piece.bytes, view.held_bytes().unwrap(), "{tensor}");
                held += 1;
            }
        }
        assert!(held > 0, "{name} {how}: nothing held");
        assert_eq!(refused > 0, how.starts_with("ep"), "{name} {how}");
    }
}

/// A tensor holding every expert has no one run of bytes: `held_bytes` says so naming
/// the layer as a number (no `Some(..)`), and is not a `NotHeld`.
#[test]
fn a_tensor_of_every_expert_names_its_layer() {
    let Some(dir) = common::fixtures("a_tensor_of_every_expert_names_its_layer") else {
        return;
    };
    let checkpoint = common::open_fixture(&dir, "gguf-single");
    let model = checkpoint
        .place(&fixture_plan(common::nodes()), StoreOptions::default())
        .unwrap();
    let view = model.tensor("blk.1.ffn_gate_exps.weight").unwrap();
    assert!(view.bytes().is_none());
    let text = view.held_bytes().unwrap_err().to_string();
    assert!(
        text.contains("layer 1") && text.contains("expert(layer, e)") && !text.contains("Some("),
        "{text}"
    );
}

/// A column-sliced per-expert tensor whose rows `piece_align` padded apart in the slot
/// has no one byte slice: by name it is a named error, never the padded bytes; with the
/// rows back to back it is numpy's columns.
#[test]
fn a_padded_column_slice_by_name_is_refused_or_numpys() {
    let Some(dir) = common::fixtures("a_padded_column_slice_by_name_is_refused_or_numpys") else {
        return;
    };
    let name = "fam-qwen35-moe";
    let checkpoint = common::open_fixture(&dir, name);
    let numpy = common::numpy_tensors(&dir.join(name));
    let share = Share::default().slice(TensorSlice::parse("columns:1/2").unwrap());
    let (mut refused, mut equal) = (0, 0);
    for align in [1usize, 512] {
        let options = StoreOptions::default().piece_align(align);
        let model = checkpoint
            .place(&fixture_plan(common::nodes()).share(share.clone()), options)
            .unwrap();
        for (tensor, shape, bytes) in &numpy {
            if expert_of(tensor).is_none() {
                continue;
            }
            match model.tensor(tensor) {
                Ok(view) => {
                    let (want, _) = numpy_cut(bytes, shape, SliceAxis::Columns, 1, 2);
                    assert!(view.held_bytes().unwrap() == &want[..], "{tensor} {align}");
                    equal += 1;
                }
                Err(e @ Error::InvalidArgument { .. }) => {
                    assert!(e.to_string().contains("piece_align"), "{e}");
                    assert!(align > 1, "{tensor}: {e}");
                    refused += 1;
                }
                Err(e) => panic!("{tensor} {align}: {e}"),
            }
        }
    }
    assert!(equal > 0, "{equal} {refused}");
    eprintln!("padded column slices: {equal} by name, {refused} refused");
}
