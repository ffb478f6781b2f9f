//! Tensor-parallel ranks of the whole model (issue 26): `PlacementPlan::tensor_parallel`
//! (column-parallel layers by rows, row-parallel layers by columns, norms and routers
//! whole) and plain column slices of every dense tensor, over the sharded safetensors,
//! GGUF (single, split) and DeepSeek-V3 FP8 fixtures, 2 and 4 ranks. Each rank's bytes
//! are compared with numpy's bytes (`tensors.json` beside each fixture) cut here by plain
//! index arithmetic; the ranks' pieces put back together — rows stacked for a row cut,
//! each row's pieces side by side for a column cut — give numpy's whole tensor byte for
//! byte, and a whole tensor is numpy's on every rank. Bad slices are named errors
//! (`bad_slices`); dense GGML blocks are kept whole (`ggml_blocks`). No
//! node placement is asserted (that is the store's, tested elsewhere), so it runs the
//! same on every host.
#![cfg(feature = "model")]

mod bad_slices;
#[path = "../common/mod.rs"]
mod common;
mod ggml_blocks;

use common::{fixtures, numpy_tensors, open_fixture};

use numapin::NodeSet;
use numapin::model::{
    Checkpoint, DenseLayout, ExpertShare, PieceRole, PlacedModel, PlacementPlan, Share, SliceAxis,
    TensorClass, TensorSlice,
};
use numapin::store::{Layout, StoreOptions};

const FIXTURES: [&str; 4] = [
    "st-sharded",
    "gguf-single",
    "gguf-split",
    "fam-deepseek-v3-fp8",
];

fn options() -> StoreOptions {
    StoreOptions::default().loader_threads(2)
}

fn base(nodes: NodeSet) -> PlacementPlan {
    PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes))
}

/// The classes a fixture keeps whole under TP: the FP8 fixture's dense MLP weights have
/// 96 and 160 rows under one 128-row scale block, so no rank can hold part of a block
/// (refused, see `bad_tp_slices_are_named_errors`).
fn kept_whole(name: &str) -> &'static [TensorClass] {
    match name {
        "fam-deepseek-v3-fp8" => &[TensorClass::DenseMlp, TensorClass::SharedExperts],
        _ => &[],
    }
}

/// The convention, restated here from the names as vLLM's layers split them: the axis a
/// rank of a TP group cuts, or `None` for a tensor every rank holds whole.
fn tp_axis(tensor: &str, shape: &[u64]) -> Option<SliceAxis> {
    let parts: Vec<&str> = tensor.split('.').collect();
    let (module, param) = (parts[parts.len() - 2], parts[parts.len() - 1]);
    let module = module.strip_suffix("_shexp").unwrap_or(module);
    let column = [
        "q_proj",
        "k_proj",
        "v_proj",
        "q_b_proj",
        "kv_b_proj",
        "gate_proj",
        "up_proj",
        "embed_tokens",
        "lm_head",
        "attn_q",
        "attn_k",
        "attn_v",
        "ffn_gate",
        "ffn_up",
        "token_embd",
        "output",
    ];
    let row = ["o_proj", "down_proj", "attn_output", "ffn_down"];
    if column.contains(&module) && (param.starts_with("weight") || param == "bias") {
        return Some(SliceAxis::Rows);
    }
    if row.contains(&module) && param.starts_with("weight") && shape.len() >= 2 {
        return Some(SliceAxis::Columns);
    }
    None
}

/// numpy's bytes of part `k` of `n` of `axis` of a tensor of `shape`: the rows stacked,
/// or each row's columns (the shape's innermost dimension; the bytes of a row divide
/// evenly, as every fixture tensor's element or block size does).
fn numpy_part(bytes: &[u8], shape: &[u64], axis: SliceAxis, k: usize, n: usize) -> Vec<u8> {
    match axis {
        SliceAxis::Rows => {
            let per = bytes.len() / n;
            bytes[k * per..(k + 1) * per].to_vec()
        }
        SliceAxis::Columns => {
            let rows: u64 = shape[..shape.len() - 1].iter().product();
            let row = bytes.len() / rows as usize;
            let per = row / n;
            bytes
                .chunks(row)
                .flat_map(|r| r[k * per..(k + 1) * per].iter().copied())
                .collect()
        }
    }
}

/// The shape of part `k` of `n` along `axis`.
fn part_shape(shape: &[u64], axis: SliceAxis, n: u64) -> Vec<u64> {
    let mut cut = shape.to_vec();
    match axis {
        SliceAxis::Rows => cut[0] /= n,
        SliceAxis::Columns => *cut.last_mut().unwrap() /= n,
    }
    cut
}

/// Puts the ranks' parts back together: rows stacked, or each row's parts side by side.
fn reassemble(parts: &[Vec<u8>], shape: &[u64], axis: SliceAxis) -> Vec<u8> {
    match axis {
        SliceAxis::Rows => parts.concat(),
        SliceAxis::Columns => {
            let rows: u64 = shape[..shape.len() - 1].iter().product();
            let per = parts[0].len() / rows as usize;
            let mut out = Vec::new();
            for r in 0..rows as usize {
                for p in parts {
                    out.extend_from_slice(&p[r * per..(r + 1) * per]);
                }
            }
            out
        }
    }
}

/// Which axis a test expects a dense tensor cut along (`None`: whole), from its name,
/// class and numpy shape.
type Expect<'a> = &'a dyn Fn(&str, TensorClass, &[u64]) -> Option<SliceAxis>;

/// Checks every dense tensor of `ranks` against numpy: `expect(tensor, shape)` says the
/// axis cut (or `None`: whole). Returns how many tensors were cut by rows and columns.
fn check_dense(
    name: &str,
    ranks: &[PlacedModel],
    numpy: &[(String, Vec<u64>, Vec<u8>)],
    expect: Expect<'_>,
) -> (usize, usize) {
    let n = ranks.len();
    let (mut by_rows, mut by_columns) = (0, 0);
    for (tensor, shape, bytes) in numpy {
        let views = match ranks
            .iter()
            .map(|m| m.tensor(tensor))
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(views) => views,
            // A per-expert tensor of another rank's expert (tests/share_views.rs).
            Err(numapin::Error::NotHeld { .. }) => continue,
            Err(e) => panic!("{name} {tensor}: {e}"),
        };
        let class = views[0].class();
        if class == TensorClass::RoutedExperts {
            continue;
        }
        let Some(axis) = expect(tensor, class, shape) else {
            for (k, view) in views.iter().enumerate() {
                assert!(view.slice().is_none(), "{name} {tensor}: whole");
                assert_eq!(view.shape(), &shape[..], "{name} {tensor}");
                assert!(
                    view.bytes().unwrap() == &bytes[..],
                    "{name} {tensor} rank {k}: numpy's whole tensor"
                );
            }
            continue;
        };
        match axis {
            SliceAxis::Rows => by_rows += 1,
            SliceAxis::Columns => by_columns += 1,
        }
        let extent = match axis {
            SliceAxis::Rows => shape[0],
            SliceAxis::Columns => *shape.last().unwrap(),
        };
        let len = extent / n as u64;
        let mut parts = Vec::new();
        for (k, view) in views.iter().enumerate() {
            let s = view.slice().expect("a sliced tensor says so");
            assert_eq!(
                (s.axis, s.start, s.len, s.extent),
                (axis, k as u64 * len, len, extent),
                "{name} {tensor} rank {k}"
            );
            assert_eq!(
                view.shape(),
                &part_shape(shape, axis, n as u64)[..],
                "{name} {tensor} rank {k}: the sliced shape"
            );
            let held = view.bytes().unwrap();
            assert!(
                held == &numpy_part(bytes, shape, axis, k, n)[..],
                "{name} {tensor} rank {k}: numpy's {} {k}/{n}",
                axis.name()
            );
            parts.push(held.to_vec());
        }
        assert!(
            reassemble(&parts, shape, axis) == *bytes,
            "{name} {tensor}: the {n} ranks' parts are numpy's tensor"
        );
    }
    (by_rows, by_columns)
}

/// Every rank verifies against the files (each copy re-read, a column cut row by row).
fn verify_all(name: &str, checkpoint: &Checkpoint, ranks: &[PlacedModel]) {
    for (k, model) in ranks.iter().enumerate() {
        let verify = model.verify(checkpoint).unwrap();
        assert!(verify.verified(), "{name} rank {k}: {verify}");
    }
}

/// The TP preset, its routed experts under an expert share (the fixtures' expert tensors
/// are too narrow for every TP split: Q8_0 `ffn_down_exps` has 32 columns, one block;
/// the per-role TP of experts is `tp_experts_split_gate_up_by_rows_and_down_by_columns`).
fn tp_plan(name: &str, nodes: NodeSet, k: u64, n: u64) -> PlacementPlan {
    let mut plan = base(nodes)
        .tensor_parallel(k, n)
        .unwrap()
        .share(Share::default().experts(ExpertShare::part(k as usize, n as usize).unwrap()));
    for &class in kept_whole(name) {
        plan = plan.whole(class);
    }
    plan
}

#[test]
fn tp_ranks_concatenate_to_numpys_tensors() {
    let Some(dir) = fixtures("tp_ranks_concatenate_to_numpys_tensors") else {
        return;
    };
    let nodes = common::nodes();
    for name in FIXTURES {
        let checkpoint = open_fixture(&dir, name);
        let numpy = numpy_tensors(&dir.join(name));
        for n in [2u64, 4] {
            let ranks: Vec<PlacedModel> = (0..n)
                .map(|k| {
                    checkpoint
                        .place(&tp_plan(name, nodes, k, n), options())
                        .unwrap()
                })
                .collect();
            let expect = |tensor: &str, class: TensorClass, shape: &[u64]| {
                if kept_whole(name).contains(&class) {
                    return None;
                }
                // FP8 scale grids follow their weight: the fixture's are kept whole with
                // the dense MLP; no other scale grid is dense.
                tp_axis(tensor, shape)
            };
            let (rows, columns) = check_dense(name, &ranks, &numpy, &expect);
            assert!(rows > 0, "{name} {n}: no tensor was cut by rows");
            if name != "fam-deepseek-v3-fp8" {
                // The FP8 fixture has no row-parallel dense tensor outside its MLP.
                assert!(columns > 0, "{name} {n}: no tensor was cut by columns");
            }
            verify_all(name, &checkpoint, &ranks);
            for (k, model) in ranks.iter().enumerate() {
                let share = model.report().unwrap().share.clone().unwrap();
                assert!(share.contains(&format!("tp {k}/{n}")), "{name}: {share}");
            }
        }
    }
}

#[test]
fn column_slices_of_every_dense_tensor_concatenate_to_numpys() {
    let Some(dir) = fixtures("column_slices_of_every_dense_tensor_concatenate_to_numpys") else {
        return;
    };
    let nodes = common::nodes();
    for name in ["st-sharded", "gguf-single", "gguf-split"] {
        let checkpoint = open_fixture(&dir, name);
        let numpy = numpy_tensors(&dir.join(name));
        for n in [2u64, 4] {
            let ranks: Vec<PlacedModel> = (0..n)
                .map(|k| {
                    let plan = base(nodes)
                        .dense_slice(TensorSlice::part(SliceAxis::Columns, k, n).unwrap())
                        .share(
                            Share::default()
                                .experts(ExpertShare::part(k as usize, n as usize).unwrap()),
                        );
                    checkpoint.place(&plan, options()).unwrap()
                })
                .collect();
            // The rule `PlacementPlan::dense_slice` states, from the shape and class.
            let expect = |_: &str, class: TensorClass, shape: &[u64]| {
                (shape.len() >= 2 && TensorClass::SLICEABLE.contains(&class))
                    .then_some(SliceAxis::Columns)
            };
            let (_, columns) = check_dense(name, &ranks, &numpy, &expect);
            assert!(columns > 0, "{name} {n}: no tensor was cut");
            verify_all(name, &checkpoint, &ranks);
            // The cost counts the column share: each sliced class holds 1/n of numpy's.
            let cost = checkpoint
                .placement_cost(
                    &base(nodes).dense_slice(TensorSlice::part(SliceAxis::Columns, 0, n).unwrap()),
                    &StoreOptions::default(),
                )
                .unwrap();
            let attention: u64 = numpy
                .iter()
                .filter(|(t, _, _)| {
                    ranks[0]
                        .tensor(t)
                        .is_ok_and(|v| v.class() == TensorClass::Attention)
                })
                .map(|(_, s, b)| {
                    if s.len() >= 2 {
                        b.len() as u64 / n
                    } else {
                        b.len() as u64
                    }
                })
                .sum();
            let class = cost
                .classes
                .iter()
                .find(|c| c.class == TensorClass::Attention)
                .unwrap();
            assert_eq!(class.bytes, attention, "{name} {n}: attention's bytes");
        }
    }
}

#[test]
fn tp_experts_split_gate_up_by_rows_and_down_by_columns() {
    let Some(dir) = fixtures("tp_experts_split_gate_up_by_rows_and_down_by_columns") else {
        return;
    };
    let nodes = common::nodes();
    // st-sharded's experts: gate/up [32, 64] and down [64, 32] in FP8 with
    // `weight_scale_inv` grids of 16-entry blocks, so halves fall on block edges.
    let name = "st-sharded";
    let checkpoint = open_fixture(&dir, name);
    let numpy = numpy_tensors(&dir.join(name));
    let n = 2;
    let ranks: Vec<PlacedModel> = (0..n)
        .map(|k| {
            let plan = base(nodes).tensor_parallel(k, n).unwrap();
            checkpoint.place(&plan, options()).unwrap()
        })
        .collect();
    verify_all(name, &checkpoint, &ranks);
    let mut checked = 0;
    for (tensor, shape, bytes) in &numpy {
        // model.layers.L.mlp.experts.E.ROLE.weight(_scale_inv)
        let parts: Vec<&str> = tensor.split('.').collect();
        let Some(at) = parts.iter().position(|p| *p == "experts") else {
            continue;
        };
        let layer: usize = parts[2].parse().unwrap();
        let expert: usize = parts[at + 1].parse().unwrap();
        let role = parts[at + 2];
        let axis = match role {
            "gate_proj" | "up_proj" => SliceAxis::Rows,
            "down_proj" => SliceAxis::Columns,
            other => panic!("{other}"),
        };
        let mut held = Vec::new();
        for (k, model) in ranks.iter().enumerate() {
            let pieces = model.expert(layer, expert).unwrap();
            let piece = pieces.iter().find(|p| p.tensor == tensor).unwrap();
            assert_eq!(
                piece.shape,
                part_shape(shape, axis, n),
                "{tensor} rank {k}: {:?}",
                piece.slot
            );
            assert!(
                piece.bytes == &numpy_part(bytes, shape, axis, k, n as usize)[..],
                "{tensor} rank {k}: numpy's {} {k}/{n}",
                axis.name()
            );
            held.push(piece.bytes.to_vec());
            if piece.slot == PieceRole::Weight {
                checked += 1;
            }
        }
        assert!(
            reassemble(&held, shape, axis) == *bytes,
            "{tensor}: the ranks' parts are numpy's"
        );
    }
    assert!(checked > 0, "no expert weight was checked");
    // The report says how each role was cut.
    let share = ranks[0].report().unwrap().share.clone().unwrap();
    assert!(share.contains("tp:0/2"), "{share}");
}

#[test]
fn slice_overrides_by_pattern_and_class() {
    let Some(dir) = fixtures("slice_overrides_by_pattern_and_class") else {
        return;
    };
    let nodes = common::nodes();
    let name = "gguf-single";
    let checkpoint = open_fixture(&dir, name);
    let numpy = numpy_tensors(&dir.join(name));
    let n = 2;
    // Rows for everything sliceable, columns for attention, and by name: the output
    // projection by rows again, the norms' entries by rows (1-D, asked for by name).
    let ranks: Vec<PlacedModel> = (0..n)
        .map(|k| {
            let plan = base(nodes)
                .dense_slice(TensorSlice::part(SliceAxis::Rows, k, n).unwrap())
                .slice_class(
                    TensorClass::Attention,
                    TensorSlice::part(SliceAxis::Columns, k, n).unwrap(),
                )
                .slice_pattern(
                    "blk.*.attn_output.*",
                    TensorSlice::part(SliceAxis::Rows, k, n).unwrap(),
                )
                .slice_pattern(
                    "*attn_norm*",
                    TensorSlice::part(SliceAxis::Rows, k, n).unwrap(),
                )
                .share(Share::default().experts(ExpertShare::part(k as usize, 2).unwrap()));
            checkpoint.place(&plan, options()).unwrap()
        })
        .collect();
    let expect = |tensor: &str, class: TensorClass, shape: &[u64]| {
        if tensor.contains("attn_output") || tensor.contains("attn_norm") {
            return Some(SliceAxis::Rows);
        }
        if shape.len() < 2 || !TensorClass::SLICEABLE.contains(&class) {
            return None;
        }
        Some(match class {
            TensorClass::Attention => SliceAxis::Columns,
            _ => SliceAxis::Rows,
        })
    };
    let (rows, columns) = check_dense(name, &ranks, &numpy, &expect);
    assert!(rows > 0 && columns > 0, "{rows} {columns}");
    verify_all(name, &checkpoint, &ranks);
    let share = ranks[1].report().unwrap().share.clone().unwrap();
    assert!(
        share.contains("attention columns:1/2") && share.contains("blk.*.attn_output.* rows:1/2"),
        "{share}"
    );
}

/// A column slice's rows are back to back in the slot whatever the layout options: a
/// 4096-byte `piece_align`, direct reads with their congruent layout, `piece_congruence`
/// on; the views stay numpy's and every copy verifies.
#[test]
fn column_slices_hold_under_direct_reads_and_wide_alignment() {
    let Some(dir) = fixtures("column_slices_hold_under_direct_reads_and_wide_alignment") else {
        return;
    };
    let nodes = common::nodes();
    let variants = [
        ("piece_align 4096", options().piece_align(4096)),
        (
            "direct",
            options().read_mode(numapin::store::ReadMode::Direct),
        ),
        (
            "congruence 4096",
            options().piece_align(64).piece_congruence(4096),
        ),
    ];
    for name in ["st-sharded", "gguf-single"] {
        let checkpoint = open_fixture(&dir, name);
        let numpy = numpy_tensors(&dir.join(name));
        for (what, opts) in &variants {
            let n = 4;
            let ranks: Vec<PlacedModel> = (0..n)
                .map(|k| {
                    let plan = base(nodes)
                        .dense_slice(TensorSlice::part(SliceAxis::Columns, k, n).unwrap())
                        .share(
                            Share::default()
                                .experts(ExpertShare::part(k as usize, n as usize).unwrap()),
                        );
                    checkpoint.place(&plan, opts.clone()).unwrap()
                })
                .collect();
            let expect = |_: &str, class: TensorClass, shape: &[u64]| {
                (shape.len() >= 2 && TensorClass::SLICEABLE.contains(&class))
                    .then_some(SliceAxis::Columns)
            };
            let (_, columns) = check_dense(&format!("{name} {what}"), &ranks, &numpy, &expect);
            assert!(columns > 0, "{name} {what}");
            verify_all(&format!("{name} {what}"), &checkpoint, &ranks);
        }
    }
}

/// DeepSeek-V3's FP8 `weight_scale_inv` grid is cut with its weight by columns: the
/// fixture's gate_proj `[96, 160]` under a grid `[1, 2]` (80 columns a block), so each
/// of 2 ranks holds 80 columns and one scale column, both numpy's.
#[test]
fn fp8_scale_grids_are_cut_with_their_weight_by_columns() {
    let Some(dir) = fixtures("fp8_scale_grids_are_cut_with_their_weight_by_columns") else {
        return;
    };
    let nodes = common::nodes();
    let name = "fam-deepseek-v3-fp8";
    let checkpoint = open_fixture(&dir, name);
    let numpy = numpy_tensors(&dir.join(name));
    let n = 2;
    let ranks: Vec<PlacedModel> = (0..n)
        .map(|k| {
            let plan = base(nodes)
                .slice_pattern(
                    "*.mlp.gate_proj.weight",
                    TensorSlice::part(SliceAxis::Columns, k, n).unwrap(),
                )
                .share(Share::default().experts(ExpertShare::part(k as usize, 2).unwrap()));
            checkpoint.place(&plan, options()).unwrap()
        })
        .collect();
    let expect = |tensor: &str, _: TensorClass, _: &[u64]| {
        tensor
            .contains(".mlp.gate_proj.weight")
            .then_some(SliceAxis::Columns)
    };
    let (_, columns) = check_dense(name, &ranks, &numpy, &expect);
    assert_eq!(columns, 2, "the weight and its scale grid");
    verify_all(name, &checkpoint, &ranks);
}
