//! Figures that count what is there: the report's total mappings against this file's own
//! parse of `/proc/self/maps`, and `tensor_copies` of a per-expert tensor (every copy,
//! each numpy's bytes, as many as the layout makes).

use std::collections::BTreeSet;

use super::common::{self, fixtures, numpy_tensors, open_fixture};
use numapin::model::{DenseLayout, PlacedModel, PlacementPlan, TensorClass};
use numapin::store::{Layout, StoreOptions};

/// The `/proc/self/maps` lines (their address ranges) overlapping any of `spans`.
fn maps_over(spans: &[(usize, usize)]) -> BTreeSet<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .map(|line| {
            let (a, b) = line
                .split_whitespace()
                .next()
                .unwrap()
                .split_once('-')
                .unwrap();
            (
                usize::from_str_radix(a, 16).unwrap(),
                usize::from_str_radix(b, 16).unwrap(),
            )
        })
        .filter(|&(a, b)| spans.iter().any(|&(s, e)| s < b && a < e))
        .collect()
}

/// Every placed byte range: each copy of each tensor, each piece of each expert.
fn placed_spans(model: &PlacedModel) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut push = |bytes: &[u8]| {
        if !bytes.is_empty() {
            let start = bytes.as_ptr() as usize;
            spans.push((start, start + bytes.len()));
        }
    };
    for view in model.tensors() {
        let view = view.unwrap();
        if view.bytes().is_some() {
            for (_, copy) in model.tensor_copies(view.name()).unwrap() {
                push(copy);
            }
        }
    }
    if model.expert_store().is_ok() {
        for layer in 0..4096 {
            let Ok(ids) = model.expert_ids(layer) else {
                continue;
            };
            for e in ids {
                for piece in model.expert(layer, e).unwrap() {
                    push(piece.bytes);
                }
            }
        }
    }
    spans
}

#[test]
fn the_total_counts_each_mapping_once() {
    let Some(dir) = fixtures("the_total_counts_each_mapping_once") else {
        return;
    };
    let nodes = common::nodes();
    // All interleaved, no names where the kernel has none: adjacent regions of equal
    // policy merge into one mapping, which several classes then share.
    let plan = PlacementPlan::new(Layout::Interleave(nodes), DenseLayout::Interleave(nodes));
    for name in ["st-sharded", "fam-deepseek-v3-fp8", "gguf-single"] {
        for writable in [false, true] {
            let checkpoint = open_fixture(&dir, name);
            let options = StoreOptions::default()
                .loader_threads(2)
                .huge_pages(false)
                .writable(writable);
            let model = checkpoint.place(&plan, options).unwrap();
            let report = model.report().unwrap();
            let here = maps_over(&placed_spans(&model));
            assert_eq!(
                report.mappings,
                here.len(),
                "{name} (writable {writable}): the report's total against /proc/self/maps"
            );
            let text = report.to_string();
            assert!(
                text.contains(&format!("({} measured, distinct)", here.len())),
                "{name}: {text}"
            );
            // Each class counts what its own regions lie in: never more than the
            // distinct total.
            for m in &report.measured {
                assert!(m.mappings <= here.len(), "{name}: {m:?}");
            }
        }
    }
}

#[test]
fn tensor_copies_of_an_expert_tensor_are_every_copy() {
    let Some(dir) = fixtures("tensor_copies_of_an_expert_tensor_are_every_copy") else {
        return;
    };
    let nodes = common::nodes();
    let copies = if common::degrade_here().is_some() {
        1
    } else {
        nodes.len()
    };
    let plan = PlacementPlan::new(Layout::Replicate(nodes), DenseLayout::Interleave(nodes));
    let mut per_expert = 0;
    for name in ["st-sharded", "fam-deepseek-v3-fp8", "gguf-single"] {
        let checkpoint = open_fixture(&dir, name);
        let model = checkpoint
            .place(&plan, StoreOptions::default().loader_threads(2))
            .unwrap();
        let numpy = numpy_tensors(&dir.join(name));
        for (tensor, _, bytes) in &numpy {
            let view = model.tensor(tensor).unwrap();
            if view.class() != TensorClass::RoutedExperts {
                continue;
            }
            if view.bytes().is_none() {
                // A tensor of every expert has no one run of bytes: an error, as documented.
                assert!(model.tensor_copies(tensor).is_err(), "{name} {tensor}");
                continue;
            }
            per_expert += 1;
            let held = model.tensor_copies(tensor).unwrap();
            assert_eq!(held.len(), copies, "{name} {tensor}: one per copy");
            let addresses: BTreeSet<usize> =
                held.iter().map(|(_, b)| b.as_ptr() as usize).collect();
            assert_eq!(addresses.len(), copies, "{name} {tensor}: distinct copies");
            for (node, copy) in &held {
                assert!(
                    *copy == &bytes[..],
                    "{name} {tensor} copy on {node:?}: not numpy's"
                );
                if copies > 1 {
                    assert!(node.is_some(), "{name} {tensor}: a replica names its node");
                }
            }
        }
        assert!(model.verify(&checkpoint).unwrap().verified(), "{name}");
    }
    assert!(per_expert > 0, "no per-expert tensor in the fixtures");
}
