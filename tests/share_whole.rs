//! A rank's share inside the whole-model plan (issues 26 × 22): two ranks, each placing
//! half of the routed experts (`ExpertShare::part(k, 2)`) and the k-th half of the rows
//! of every sliceable dense tensor (`rows:k/2`), over the sharded safetensors, GGUF
//! (single, split) and DeepSeek-V3 FP8 fixtures. Each rank's bytes are compared with
//! numpy's bytes (`tensors.json` beside each fixture) cut by plain index arithmetic here,
//! and the two ranks' pieces put together give numpy's whole tensor for every tensor.
//! Bad slices are errors naming the tensor. No node placement is asserted (1 copy per
//! rank's store is what matters here), so it runs the same on every host.
#![cfg(feature = "model")]

mod common;

use common::{fixtures, numpy_tensors, open_fixture};

use std::collections::BTreeMap;

use numapin::model::{
    Checkpoint, DenseLayout, ExpertShare, PlacedModel, PlacementPlan, Share, SliceAxis,
    TensorClass, TensorSlice,
};
use numapin::store::{Layout, StoreOptions};
use numapin::{Error, NodeSet};

const FIXTURES: [&str; 4] = [
    "st-sharded",
    "gguf-single",
    "gguf-split",
    "fam-deepseek-v3-fp8",
];

/// The classes a fixture keeps whole: the FP8 fixture's MLP weights have 96 and 160 rows
/// under 128-row scale blocks, so half of them would cut a block (refused, see
/// `bad_dense_slices_are_errors_naming_the_tensor`).
fn kept_whole(name: &str) -> &'static [TensorClass] {
    match name {
        "fam-deepseek-v3-fp8" => &[TensorClass::DenseMlp, TensorClass::SharedExperts],
        _ => &[],
    }
}

fn rank_plan(name: &str, nodes: NodeSet, k: u64) -> PlacementPlan {
    let mut plan = PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes))
        .share(Share::default().experts(ExpertShare::part(k as usize, 2).unwrap()))
        .dense_slice(TensorSlice::part(SliceAxis::Rows, k, 2).unwrap());
    for &class in kept_whole(name) {
        plan = plan.whole(class);
    }
    plan
}

fn options() -> StoreOptions {
    StoreOptions::default().loader_threads(2)
}

/// Whether a tensor of `class` and numpy `shape` is sliced: the rule stated by
/// `PlacementPlan::dense_slice`, written here from the shape alone.
fn expect_sliced(name: &str, class: TensorClass, shape: &[u64]) -> bool {
    shape.len() >= 2
        && !kept_whole(name).contains(&class)
        && matches!(
            class,
            TensorClass::SharedExperts
                | TensorClass::Attention
                | TensorClass::DenseMlp
                | TensorClass::Embeddings
                | TensorClass::OutputHead
        )
}

#[test]
fn two_ranks_shares_concatenate_to_numpys_tensors() {
    let Some(dir) = fixtures("two_ranks_shares_concatenate_to_numpys_tensors") else {
        return;
    };
    let nodes = common::nodes();
    for name in FIXTURES {
        let checkpoint = open_fixture(&dir, name);
        let numpy = numpy_tensors(&dir.join(name));
        let ranks: Vec<PlacedModel> = (0..2)
            .map(|k| {
                checkpoint
                    .place(&rank_plan(name, nodes, k), options())
                    .unwrap()
            })
            .collect();
        let mut sliced = 0;
        for (tensor, shape, bytes) in &numpy {
            let views: Vec<_> = ranks.iter().map(|m| m.tensor(tensor)).collect();
            // A per-expert tensor of an expert a rank does not hold is NotHeld there.
            let not_held = |v: &Result<_, Error>| matches!(v, Err(Error::NotHeld { .. }));
            let seen = views.iter().find_map(|v| v.as_ref().ok());
            if views.iter().any(not_held)
                || seen.is_some_and(|v| v.class() == TensorClass::RoutedExperts)
            {
                let layer = seen.and_then(|v| v.layer());
                check_experts(name, &ranks, tensor, shape, bytes, layer);
                continue;
            }
            let views: Vec<_> = views.into_iter().map(Result::unwrap).collect();
            let class = views[0].class();
            let mut whole = Vec::new();
            for (k, view) in views.iter().enumerate() {
                let held = view.bytes().unwrap();
                if expect_sliced(name, class, shape) {
                    let (rows, half) = (shape[0], shape[0] / 2);
                    let row = bytes.len() / rows as usize;
                    let s = view.slice().expect("a sliced tensor says so");
                    assert_eq!(
                        (s.axis, s.start, s.len, s.extent),
                        (SliceAxis::Rows, k as u64 * half, half, rows),
                        "{name} {tensor}"
                    );
                    let mut cut = shape.clone();
                    cut[0] = half;
                    assert_eq!(view.shape(), &cut[..], "{name} {tensor}: sliced shape");
                    let part = &bytes[k * half as usize * row..(k + 1) * half as usize * row];
                    assert!(held == part, "{name} {tensor} rank {k}: numpy's rows");
                    whole.extend_from_slice(held);
                } else {
                    assert!(view.slice().is_none(), "{name} {tensor}: placed whole");
                    assert_eq!(view.shape(), &shape[..], "{name} {tensor}");
                    assert!(held == &bytes[..], "{name} {tensor} rank {k}: whole");
                    whole = held.to_vec();
                }
            }
            if expect_sliced(name, class, shape) {
                sliced += 1;
            }
            assert!(
                whole == *bytes,
                "{name} {tensor}: the ranks' pieces are numpy's"
            );
        }
        assert!(sliced > 0, "{name}: no tensor was sliced");
        for (k, model) in ranks.iter().enumerate() {
            let verify = model.verify(&checkpoint).unwrap();
            assert!(verify.verified(), "{name} rank {k}: {verify}");
            let report = model.report().unwrap();
            // The mappings the share's cost counts are the ones its stores occupy
            // (smaps), at most that many where placement degrades to one copy.
            for cost in &report.cost.classes {
                let measured = report
                    .measured
                    .iter()
                    .find(|m| m.class == cost.class)
                    .unwrap();
                if common::degrade_here().is_none() {
                    assert_eq!(measured.mappings, cost.mappings, "{name} {}", cost.class);
                } else {
                    assert!(measured.mappings <= cost.mappings, "{name} {}", cost.class);
                }
            }
            let share = report.share.as_deref().unwrap();
            assert!(
                share.contains(&format!("rows:{k}/2")) && share.contains("experts"),
                "{name}: {share}"
            );
        }
        check_costs(name, &checkpoint, &numpy, nodes);
    }
}

/// Routed experts: each expert held by exactly one rank, with numpy's bytes (a tensor
/// per expert: numpy's whole tensor; a merged `[E, …]` tensor: numpy's e-th slice).
fn check_experts(
    name: &str,
    ranks: &[PlacedModel],
    tensor: &str,
    shape: &[u64],
    bytes: &[u8],
    layer: Option<usize>,
) {
    let held: Vec<Option<&[u8]>> = ranks
        .iter()
        .map(|m| match m.tensor(tensor) {
            Ok(view) => view.bytes(),
            Err(Error::NotHeld { .. }) => None,
            Err(e) => panic!("{name} {tensor}: {e}"),
        })
        .collect();
    let holders = held.iter().filter(|b| b.is_some()).count();
    if holders > 0 {
        assert_eq!(
            holders, 1,
            "{name} {tensor}: one rank holds a per-expert tensor"
        );
        assert!(
            held.iter().flatten().all(|b| *b == bytes),
            "{name} {tensor}"
        );
        return;
    }
    let layer = layer.unwrap();
    let experts = shape[0] as usize;
    let per = bytes.len() / experts;
    for e in 0..experts {
        let mut owners = 0;
        for model in ranks {
            match model.expert(layer, e) {
                Ok(pieces) => {
                    owners += 1;
                    let piece = pieces.iter().find(|p| p.tensor == tensor).unwrap();
                    assert!(
                        piece.bytes == &bytes[e * per..(e + 1) * per],
                        "{tensor} {e}"
                    );
                }
                Err(Error::NotHeld { expert, .. }) => assert_eq!(expert, e),
                Err(other) => panic!("{name} {tensor} {e}: {other}"),
            }
        }
        assert_eq!(owners, 1, "{name} {tensor} expert {e}: held once");
    }
}

/// The cost counts the share: a sliced class's bytes are half of numpy's, a whole class's
/// all of them, and the two ranks' expert bytes add up to the whole plan's.
fn check_costs(
    name: &str,
    checkpoint: &Checkpoint,
    numpy: &[(String, Vec<u64>, Vec<u8>)],
    nodes: NodeSet,
) {
    let opts = StoreOptions::default();
    let whole_plan = PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes));
    let whole = checkpoint.placement_cost(&whole_plan, &opts).unwrap();
    let costs: Vec<_> = (0..2)
        .map(|k| {
            checkpoint
                .placement_cost(&rank_plan(name, nodes, k), &opts)
                .unwrap()
        })
        .collect();
    let model = checkpoint.place(&whole_plan, options()).unwrap();
    let mut expected: BTreeMap<TensorClass, u64> = BTreeMap::new();
    for (tensor, shape, bytes) in numpy {
        let class = model.tensor(tensor).unwrap().class();
        let held = if expect_sliced(name, class, shape) {
            bytes.len() as u64 / 2
        } else {
            bytes.len() as u64
        };
        *expected.entry(class).or_default() += held;
    }
    let bytes_of = |cost: &numapin::model::PlacementCost, class| {
        cost.classes
            .iter()
            .find(|c| c.class == class)
            .map_or(0, |c| c.bytes)
    };
    for (&class, &held) in &expected {
        if class == TensorClass::RoutedExperts {
            let sum: u64 = costs.iter().map(|c| bytes_of(c, class)).sum();
            assert_eq!(
                sum,
                bytes_of(&whole, class),
                "{name}: experts' shares add up"
            );
            assert!(costs.iter().all(|c| bytes_of(c, class) < held), "{name}");
            continue;
        }
        for cost in &costs {
            assert_eq!(
                bytes_of(cost, class),
                held,
                "{name} {class}: the share's bytes"
            );
        }
    }
    for cost in &costs {
        let total = |c: &numapin::model::PlacementCost| c.node_bytes.values().sum::<u64>();
        assert!(
            total(cost) < total(&whole),
            "{name}: a rank asks the nodes for less"
        );
    }
}

#[test]
fn bad_dense_slices_are_errors_naming_the_tensor() {
    let Some(dir) = fixtures("bad_dense_slices_are_errors_naming_the_tensor") else {
        return;
    };
    let nodes = common::nodes();
    let checkpoint = open_fixture(&dir, "gguf-single");
    let base = PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes));
    let opts = StoreOptions::default();
    // 7 parts divide no fixture tensor's rows or columns; a span past every axis.
    for (slice, why) in [
        ("rows:0/7", "does not divide"),
        ("rows:0:100000", "runs past the axis"),
        ("columns:0/7", "does not divide"),
    ] {
        let plan = base.clone().dense_slice(TensorSlice::parse(slice).unwrap());
        let err = checkpoint.placement_cost(&plan, &opts).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(why) && text.contains('"'), "{slice}: {text}");
        assert!(checkpoint.place(&plan, options()).is_err(), "{slice}");
    }
    // A cut through an FP8 scale block (96 rows under one 128-row block) names it.
    let fp8 = open_fixture(&dir, "fam-deepseek-v3-fp8");
    let half = base
        .clone()
        .dense_slice(TensorSlice::parse("rows:0/2").unwrap());
    let text = fp8.placement_cost(&half, &opts).unwrap_err().to_string();
    assert!(
        text.contains("weight_scale_inv") && text.contains("scale blocks"),
        "{text}"
    );
    // Every sliceable class kept whole: the slice cuts nothing, every tensor is whole.
    let mut plan = base
        .clone()
        .dense_slice(TensorSlice::parse("rows:0/7").unwrap());
    for class in TensorClass::SLICEABLE {
        plan = plan.whole(class);
    }
    let cost = checkpoint.placement_cost(&plan, &opts).unwrap();
    assert_eq!(cost, checkpoint.placement_cost(&base, &opts).unwrap());
    // An expert id past the layer's count is refused naming it.
    let plan = base.share(Share::default().experts(ExpertShare::list([999]).unwrap()));
    let text = checkpoint
        .placement_cost(&plan, &opts)
        .unwrap_err()
        .to_string();
    assert!(text.contains("999"), "{text}");
}
