//! The whole model placed (`Checkpoint::place`): every tensor of the sharded safetensors,
//! GGUF (single and split) and DeepSeek-V3 FP8 fixtures under `experts: SplitExperts(all),
//! dense: Replicate(all)`, each tensor's bytes (every copy) compared with the bytes numpy
//! wrote (`tensors.json` beside each fixture), shapes with numpy's; the mappings counted
//! from /proc against the plan's count; bad plans refused before anything is reserved;
//! the DeepSeek-V3-shaped dry run of docs/whole-model.md. The node checks (each dense
//! replica wholly on its node, each expert on its home node) run in the VM.
#![cfg(feature = "model")]

mod attack_r11;
#[path = "../common/mod.rs"]
mod common;
mod drop_behind;
mod dry_run;
mod figures;
mod one_range;
mod role_major;
mod role_major_share;
mod verify_mode;

use common::{fixtures, numpy_tensors, open_fixture, pages_of_bytes};

use std::io::Write;
use std::path::{Path, PathBuf};

use numapin::model::{Checkpoint, DenseLayout, PlacementPlan, TensorClass};
use numapin::store::{Layout, StoreOptions};
use numapin::{CheckpointFault, Error, NodeSet};

const FIXTURES: [&str; 4] = [
    "st-sharded",
    "gguf-single",
    "gguf-split",
    "fam-deepseek-v3-fp8",
];

fn plan(nodes: NodeSet) -> PlacementPlan {
    PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes))
}

fn options() -> StoreOptions {
    StoreOptions::default().loader_threads(2)
}

#[test]
fn every_tensor_of_every_fixture_equals_numpys() {
    let Some(dir) = fixtures("every_tensor_of_every_fixture_equals_numpys") else {
        return;
    };
    let nodes = common::nodes();
    for name in FIXTURES {
        let checkpoint = open_fixture(&dir, name);
        let model = checkpoint.place(&plan(nodes), options()).unwrap();
        let numpy = numpy_tensors(&dir.join(name));
        assert_eq!(numpy.len(), checkpoint.tensors().len(), "{name}");
        assert_eq!(model.len(), numpy.len(), "{name}: every tensor placed");
        let mut classes = std::collections::BTreeSet::new();
        let mut per_class = std::collections::BTreeMap::new();
        let mut copies = 0;
        for (tensor, shape, bytes) in &numpy {
            let view = model.tensor(tensor).unwrap();
            classes.insert(view.class());
            *per_class.entry(view.class()).or_insert(0usize) += 1;
            if view.bytes().is_some() {
                copies += match view.class() {
                    TensorClass::RoutedExperts => 1,
                    _ => copies_here(nodes),
                };
            }
            assert_eq!(view.shape(), &shape[..], "{name} {tensor}: numpy's shape");
            match view.bytes() {
                Some(held) => {
                    assert!(
                        held == &bytes[..],
                        "{name} {tensor}: bytes differ from numpy's"
                    );
                    for (node, copy) in model.tensor_copies(tensor).unwrap() {
                        assert!(copy == &bytes[..], "{name} {tensor} copy on {node:?}");
                    }
                }
                None => {
                    // A tensor holding every expert: expert e's piece is numpy's e-th
                    // slice of it.
                    assert_eq!(view.class(), TensorClass::RoutedExperts, "{tensor}");
                    let layer = view.layer().unwrap();
                    let experts = shape[0] as usize;
                    let per = bytes.len() / experts;
                    for e in 0..experts {
                        let pieces = model.expert(layer, e).unwrap();
                        let piece = pieces.iter().find(|p| p.tensor == tensor).unwrap();
                        assert!(
                            piece.bytes == &bytes[e * per..(e + 1) * per],
                            "{tensor} {e}"
                        );
                        assert_eq!(piece.shape, shape[1..], "{tensor}: one expert's shape");
                    }
                }
            }
        }
        for class in [
            TensorClass::RoutedExperts,
            TensorClass::Attention,
            TensorClass::NormsAndRouters,
            TensorClass::Embeddings,
            TensorClass::DenseMlp,
        ] {
            // The DeepSeek-V3 fixture has no attention tensors (norms, MLPs and routers).
            if class == TensorClass::Attention && name == "fam-deepseek-v3-fp8" {
                continue;
            }
            assert!(classes.contains(&class), "{name}: no {class} tensor");
        }
        if name != "st-sharded" {
            assert!(classes.contains(&TensorClass::SharedExperts), "{name}");
        }
        // The report counts tensors as numpy wrote them: a tensor holding every expert of
        // a layer once, not once per expert.
        let reported: std::collections::BTreeMap<TensorClass, usize> = (model.report().unwrap())
            .cost
            .classes
            .iter()
            .map(|c| (c.class, c.tensors))
            .collect();
        assert_eq!(reported, per_class, "{name}: tensors per class");
        let verify = model.verify(&checkpoint).unwrap();
        assert!(verify.verified(), "{name}: {verify}");
        assert_eq!(
            verify.copies, copies,
            "{name}: every copy of every tensor compared"
        );
        check_mappings(name, &model);
    }
}

/// Copies a replicated tensor has here: one per node where placement works, else one.
fn copies_here(nodes: NodeSet) -> usize {
    if common::degrade_here().is_some() {
        1
    } else {
        nodes.len()
    }
}

/// The mappings each class's stores occupy (smaps) are the plan's count where placement
/// works (one per copy of a dense group; per MoE layer and kind one per block), and at
/// most it where it degrades (one copy).
fn check_mappings(name: &str, model: &numapin::model::PlacedModel) {
    let report = model.report().unwrap();
    for cost in &report.cost.classes {
        let measured = report
            .measured
            .iter()
            .find(|m| m.class == cost.class)
            .unwrap();
        if common::degrade_here().is_none() {
            assert_eq!(measured.mappings, cost.mappings, "{name} {}", cost.class);
            assert_eq!(
                measured.mbind_calls, cost.mbind_calls,
                "{name} {}",
                cost.class
            );
        } else {
            assert!(measured.mappings <= cost.mappings, "{name} {}", cost.class);
        }
        if cost.class != TensorClass::RoutedExperts {
            // O(layers × nodes): a group per (class, layer), a mapping per copy.
            assert_eq!(
                cost.mappings,
                cost.groups * copies_planned(&report.plan, cost)
            );
        }
    }
}

fn copies_planned(_plan: &str, cost: &numapin::model::ClassCost) -> usize {
    match cost.layout.strip_prefix("replicate:") {
        Some(nodes) => NodeSet::parse(nodes).unwrap().len(),
        None => 1,
    }
}

#[test]
fn the_gguf_shapes_are_numpys_not_ggmls() {
    let Some(dir) = fixtures("the_gguf_shapes_are_numpys_not_ggmls") else {
        return;
    };
    let checkpoint = open_fixture(&dir, "gguf-single");
    let model = checkpoint.place(&plan(common::nodes()), options()).unwrap();
    // gguf-py wrote token_embd from a numpy (128, 64) array: ggml's ne is [64, 128].
    let embd = model.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.shape(), &[128, 64]);
    assert_eq!(
        checkpoint.tensor("token_embd.weight").unwrap().shape(),
        &[64, 128]
    );
    let q8 = model.tensor("blk.1.ffn_up_exps.weight").unwrap();
    assert_eq!(q8.shape(), &[4, 32, 64]);
    assert_eq!((q8.block().elements, q8.block().bytes), (32, 34), "Q8_0");
    assert_eq!(
        model.tensor("output.weight").unwrap().class(),
        TensorClass::OutputHead
    );
    assert_eq!(
        model.tensor("blk.1.ffn_gate_shexp.weight").unwrap().class(),
        TensorClass::SharedExperts
    );
    assert!(model.tensor("no.such.tensor").is_err());
}

#[test]
fn overrides_by_class_and_pattern_move_tensors_to_other_stores() {
    let Some(dir) = fixtures("overrides_by_class_and_pattern_move_tensors_to_other_stores") else {
        return;
    };
    let nodes = common::nodes();
    let first = nodes.nth(0).unwrap();
    let checkpoint = open_fixture(&dir, "st-sharded");
    let plan = plan(nodes)
        .class(TensorClass::Embeddings, DenseLayout::Interleave(nodes))
        .pattern("*.self_attn.o_proj.*", DenseLayout::Bind(first));
    let model = checkpoint.place(&plan, options()).unwrap();
    let report = model.report().unwrap();
    let attention = report
        .cost
        .classes
        .iter()
        .find(|c| c.class == TensorClass::Attention)
        .unwrap();
    // q_proj replicated, o_proj bound: two layouts, one store each.
    assert_eq!(
        attention.layout,
        format!("replicate:{nodes}+bind:{}", first.0)
    );
    assert_eq!(model.class_stores(TensorClass::Attention).count(), 2);
    assert_eq!(attention.groups, 6, "3 layers × 2 layouts");
    assert!(model.verify(&checkpoint).unwrap().verified());

    // A pattern matching nothing is an error naming it, before anything is reserved.
    let bad = self::plan(nodes).pattern("*.no_such_proj.*", DenseLayout::Unplaced);
    let err = checkpoint.place(&bad, options()).unwrap_err();
    assert!(err.to_string().contains("*.no_such_proj.*"), "{err}");
    // Routed experts are not matched by patterns.
    let experts_only = self::plan(nodes).pattern("*.experts.*", DenseLayout::Unplaced);
    assert!(
        checkpoint
            .placement_cost(&experts_only, &options())
            .is_err()
    );
}

#[test]
fn the_default_plan_says_why() {
    let Some(dir) = fixtures("the_default_plan_says_why") else {
        return;
    };
    let checkpoint = open_fixture(&dir, "fam-deepseek-v3-fp8");
    let nodes = common::nodes();
    let plan = checkpoint.default_plan(nodes).unwrap();
    // A few KiB of dense tensors fit on any node: replicated; embeddings interleaved.
    assert_eq!(
        plan.layout_of(TensorClass::Attention),
        DenseLayout::Replicate(nodes)
    );
    assert_eq!(
        plan.layout_of(TensorClass::Embeddings),
        DenseLayout::Interleave(nodes)
    );
    assert!(
        plan.why(TensorClass::Attention)
            .starts_with("default: replicated")
    );
    assert!(plan.why(TensorClass::Embeddings).contains("a few rows"));
    assert_eq!(plan.experts_layout(), Layout::SplitExperts(nodes));
}

/// Alone ([`common::alone`]): the budget is 4 above the count read here, and the plan is
/// checked against the count read later; the other tests of this binary place whole
/// models meanwhile, and as they drop them the count falls by more than the plan needs.
#[test]
fn a_plan_over_the_map_budget_is_refused_with_the_figures() {
    let Some(dir) = fixtures("a_plan_over_the_map_budget_is_refused_with_the_figures") else {
        return;
    };
    if !common::alone("a_plan_over_the_map_budget_is_refused_with_the_figures") {
        return;
    }
    let checkpoint = open_fixture(&dir, "gguf-single");
    let current = numapin::diag::map_count().unwrap();
    let options = options().vma_budget(Some(current + 4));
    match checkpoint.place(&plan(common::nodes()), options) {
        Err(Error::MapBudget {
            needed,
            available,
            what,
            ..
        }) => {
            assert!(needed > available, "{needed} {available}");
            assert!(what.contains("placement plan"), "{what}");
        }
        other => panic!("expected MapBudget, got {other:?}"),
    }
}

/// A safetensors file whose header names `tensors` (name, dtype, shape, bytes) and whose
/// data is a hole: a checkpoint of any size that costs no disk.
fn sparse_checkpoint(path: &Path, tensors: &[(String, &str, Vec<u64>, u64)]) {
    let mut at = 0u64;
    let entries: Vec<String> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let s = format!(
                r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
                at + bytes
            );
            at += bytes;
            s
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut file = std::fs::File::create(path).unwrap();
    file.write_all(&(header.len() as u64).to_le_bytes())
        .unwrap();
    file.write_all(header.as_bytes()).unwrap();
    file.set_len(8 + header.len() as u64 + at).unwrap();
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("numapin-whole-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_plan_larger_than_the_nodes_is_refused_before_any_allocation() {
    let dir = temp("huge");
    let path = dir.join("model.safetensors");
    // 1 TiB of embeddings, a hole on disk.
    let rows = 1u64 << 30;
    let tensors = [(
        "model.embed_tokens.weight".to_owned(),
        "U8",
        vec![rows, 1024],
        rows * 1024,
    )];
    sparse_checkpoint(&path, &tensors);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let nodes = common::nodes();
    let cost = checkpoint.placement_cost(&plan(nodes), &options()).unwrap();
    assert_eq!(
        cost.mappings,
        nodes.len(),
        "one group, one mapping per replica"
    );
    match checkpoint.place(&plan(nodes), options()) {
        Err(Error::NodeMemory {
            needed, available, ..
        }) => {
            assert!(
                available.iter().any(|&(_, a)| a < needed),
                "{needed} {available:?}"
            );
            assert!(needed >= 1 << 40);
        }
        other => panic!("expected NodeMemory, got {other:?}"),
    }
    // Nothing was mapped for it: no mapping of this process is as large as the plan.
    // (Not a map count: the other tests of this binary map and unmap whole models
    // meanwhile, by more than any margin a count could allow.)
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let range = line.split_whitespace().next().unwrap();
        let (start, end) = range.split_once('-').unwrap();
        let len =
            usize::from_str_radix(end, 16).unwrap() - usize::from_str_radix(start, 16).unwrap();
        assert!(
            len < 1 << 40,
            "a {len}-byte mapping after the refusal: {line}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tensor_whose_bytes_are_not_its_shape_is_a_checkpoint_error() {
    let dir = temp("size");
    let path = dir.join("model.safetensors");
    // F16 [4, 4] is 32 bytes; the header gives it 30.
    sparse_checkpoint(
        &path,
        &[("model.norm.weight".to_owned(), "F16", vec![4, 4], 30)],
    );
    match Checkpoint::open(&path) {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Size,
            tensor,
            ..
        }) => {
            assert_eq!(tensor.as_deref(), Some("model.norm.weight"));
        }
        other => panic!("expected a size fault, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// VM (2+ nodes): every copy of every dense tensor wholly on its replica's node, every
/// expert wholly on its home node, and the mappings O(layers × nodes) as a count.
#[test]
fn dense_replicas_and_experts_on_their_nodes() {
    let test = "dense_replicas_and_experts_on_their_nodes";
    let Some(nodes) = common::need_nodes(test, 2) else {
        return;
    };
    let Some(dir) = fixtures(test) else {
        return;
    };
    for name in ["st-sharded", "gguf-single"] {
        let checkpoint = open_fixture(&dir, name);
        let model = checkpoint.place(&plan(nodes), options()).unwrap();
        for t in checkpoint.tensors() {
            let view = model.tensor(t.name()).unwrap();
            if view.class() == TensorClass::RoutedExperts || t.is_empty() {
                continue;
            }
            let copies = model.tensor_copies(t.name()).unwrap();
            assert_eq!(copies.len(), nodes.len(), "{name} {}", t.name());
            for (node, bytes) in copies {
                let h = pages_of_bytes(bytes);
                let node = node.unwrap();
                assert!(
                    h.present() > 0 && h.on(node) == h.present(),
                    "{name} {} on {node:?}: {h:?}",
                    t.name()
                );
            }
        }
        let store = model.expert_store().unwrap();
        let report = model.report().unwrap();
        let experts = report.experts.as_ref().unwrap();
        for (&layer, &count) in &experts.experts_per_layer {
            for e in 0..count {
                let home = store.home_node(layer, e).unwrap().unwrap();
                let h = pages_of_bytes(store.weights(layer, e).unwrap());
                assert!(
                    h.present() > 0 && h.on(home) == h.present(),
                    "{name} L{layer} E{e}: {h:?}"
                );
            }
        }
        // O(layers × nodes): a dense group per class and layer, a copy per node; per MoE
        // layer and kind a block per node. Counted in smaps.
        let measured: usize = report.measured.iter().map(|m| m.mappings).sum();
        let dense_groups: usize = report
            .cost
            .classes
            .iter()
            .filter(|c| c.class != TensorClass::RoutedExperts)
            .map(|c| c.groups)
            .sum();
        let kinds = if name == "st-sharded" { 2 } else { 1 };
        let moe_layers = experts.experts_per_layer.len();
        assert_eq!(
            measured,
            (dense_groups + moe_layers * kinds) * nodes.len(),
            "{name}"
        );
        assert!(model.verify(&checkpoint).unwrap().verified());
    }
}

/// A pattern holding one of the text form's separators is written quoted in the text
/// form (see tests/plan_text.rs); one that matches no tensor is refused, naming it.
#[test]
fn a_pattern_holding_a_separator_is_refused_naming_it() {
    let Some(dir) = fixtures("a_pattern_holding_a_separator_is_refused_naming_it") else {
        return;
    };
    let checkpoint = Checkpoint::open(dir.join("gguf-single/model.gguf")).unwrap();
    for glob in ["blk.{1,2}.*", "a;b", "x=y"] {
        let plan = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
            .pattern(glob, DenseLayout::Unplaced);
        let err = checkpoint
            .placement_cost(&plan, &StoreOptions::default())
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { .. }) && err.to_string().contains(glob),
            "{glob}: {err}"
        );
    }
}

/// A whole-model placement's stores (one per class and layout, each numbering its layers
/// from 0) share the caller's progress hook: `Progress::store` tells them apart. Every
/// (store, layer) gets exactly one final report, from a store of the model, and the final
/// totals add up to the bytes numpy wrote for every tensor of the checkpoint (keyed by
/// layer alone, the dense groups and the MoE layers collide: the Python bar stopped at
/// 68% of the sharded fixture).
#[test]
fn progress_reports_name_their_store_and_add_up_to_the_model() {
    use numapin::store::{Progress, ProgressHook};
    use std::collections::BTreeSet;
    use std::sync::{Arc, Mutex};
    let Some(dir) = fixtures("progress_reports_name_their_store_and_add_up_to_the_model") else {
        return;
    };
    let nodes = common::nodes();
    for name in FIXTURES {
        let checkpoint = open_fixture(&dir, name);
        let finals: Arc<Mutex<Vec<Progress>>> = Arc::default();
        let seen = Arc::clone(&finals);
        let hook = ProgressHook::new(move |p| {
            if p.is_done() {
                seen.lock().unwrap().push(*p);
            }
        });
        let model = checkpoint
            .place(&plan(nodes), options().progress(Some(hook)))
            .unwrap();
        let finals = finals.lock().unwrap().clone();
        let keys: BTreeSet<(u64, usize)> = finals.iter().map(|p| (p.store, p.layer)).collect();
        assert_eq!(
            keys.len(),
            finals.len(),
            "{name}: one final report per load"
        );
        let mut stores: BTreeSet<u64> = TensorClass::DENSE
            .into_iter()
            .flat_map(|c| {
                model
                    .class_stores(c)
                    .map(|s| s.number())
                    .collect::<Vec<_>>()
            })
            .collect();
        stores.extend(model.expert_store().ok().map(|s| s.number()));
        let reported: BTreeSet<u64> = keys.iter().map(|&(s, _)| s).collect();
        assert!(
            reported.is_subset(&stores),
            "{name}: {reported:?} of {stores:?}"
        );
        assert!(reported.len() > 1, "{name}: several stores report");
        let total: u64 = finals.iter().map(|p| p.bytes_total).sum();
        let numpy: u64 = numpy_tensors(&dir.join(name))
            .iter()
            .map(|(_, _, bytes)| bytes.len() as u64)
            .sum();
        assert_eq!(
            total, numpy,
            "{name}: the final reports' bytes are the model's"
        );
    }
}
