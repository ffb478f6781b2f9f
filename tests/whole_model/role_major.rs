//! Role-major expert slots in a whole placement (issue 33 item 5): DBRX keeps each role
//! of a layer's experts as one tensor (`ffn.experts.mlp.{w1,v1,w2}`, `[E·I, H]`), and
//! transformers 5 holds it as one parameter; `Checkpoint::place` gives such a checkpoint
//! role-major slots (slot `r × E + e`), so `tensor(name)` of each role is one run of
//! bytes in the file's layout. Checked against the file's bytes read here (the
//! safetensors header parsed by the test), the mappings in `/proc/self/maps` and the
//! cost against the store's role-major count (`R × blocks` per region on several nodes,
//! one on one node). Asked (`role_major(R)`) for a per-expert naming: each role's
//! experts back to back, bytes as numpy wrote them; refusals by name. In the VM (2+
//! nodes): every expert's part of each run on its home node, by `move_pages`.

use super::common::{self, fixtures, numpy_tensors, open_fixture, pages_of_bytes};
use super::plan;

use std::collections::BTreeMap;

use numapin::model::{PlacedModel, TensorClass};
use numapin::store::{ReadMode, StoreOptions};
use numapin::{Error, Node, NodeSet};

pub(super) const ROLES: usize = 3;

pub(super) fn options() -> StoreOptions {
    super::options().read_mode(ReadMode::Buffered)
}

/// Every expert tensor of the DBRX fixture's file, read without numapin: name →
/// (shape, bytes), from the safetensors header (8-byte length, JSON, data).
pub(super) fn file_experts(dir: &std::path::Path) -> BTreeMap<String, (Vec<u64>, Vec<u8>)> {
    let data = std::fs::read(dir.join("fam-dbrx").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    let body = &data[8 + n..];
    let mut out = BTreeMap::new();
    for (name, t) in header.as_object().unwrap() {
        if !name.contains(".ffn.experts.mlp.") {
            continue;
        }
        let shape = t["shape"].as_array().unwrap();
        let offsets = t["data_offsets"].as_array().unwrap();
        let (a, b) = (offsets[0].as_u64().unwrap(), offsets[1].as_u64().unwrap());
        out.insert(
            name.clone(),
            (
                shape.iter().map(|d| d.as_u64().unwrap()).collect(),
                body[a as usize..b as usize].to_vec(),
            ),
        );
    }
    out
}

/// Runs of consecutive slots on one node over a layer of `R × E` role-major slots
/// (expert `e` of `E` on node `e × n / E`, counted here without numapin): the mappings
/// of a region where placement works, and its `mbind` calls.
pub(super) fn segments(nodes: NodeSet, experts: usize) -> usize {
    let homes: Vec<usize> = (0..ROLES * experts)
        .map(|s| (s % experts) * nodes.len() / experts)
        .collect();
    1 + homes.windows(2).filter(|w| w[0] != w[1]).count()
}

/// The mappings of this process overlapping `range`.
pub(super) fn mappings_over(range: std::ops::Range<usize>) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .map(|line| {
            let span = line.split_whitespace().next().unwrap();
            let (a, b) = span.split_once('-').unwrap();
            (
                usize::from_str_radix(a, 16).unwrap(),
                usize::from_str_radix(b, 16).unwrap(),
            )
        })
        .filter(|&(a, b)| a < range.end && b > range.start)
        .count()
}

/// Each DBRX role tensor as one run: its bytes the file's, at the address of expert
/// 0's piece, every expert's piece at `first + e × piece` (back to back).
fn check_runs(model: &PlacedModel, file: &BTreeMap<String, (Vec<u64>, Vec<u8>)>) {
    assert_eq!(file.len(), 6, "w1, v1, w2 of 2 layers");
    for (name, (shape, bytes)) in file {
        let view = model.tensor(name).unwrap();
        assert_eq!(view.class(), TensorClass::RoutedExperts, "{name}");
        assert_eq!(view.shape(), &shape[..], "{name}: the file's shape");
        let held = view.bytes().unwrap_or_else(|| panic!("{name}: no one run"));
        assert!(held == &bytes[..], "{name}: not the file's bytes");
        let layer = view.layer().unwrap();
        let experts = model.expert_ids(layer).unwrap();
        let per = bytes.len() / experts.len();
        for &e in &experts {
            let pieces = model.expert(layer, e).unwrap();
            let p = pieces.iter().find(|p| p.tensor == name).unwrap();
            assert_eq!(
                p.bytes.as_ptr() as usize,
                held.as_ptr() as usize + e * per,
                "{name} E{e}: inside the run"
            );
            assert!(p.bytes == &bytes[e * per..][..per], "{name} E{e}");
        }
        for (node, copy) in model.tensor_copies(name).unwrap() {
            assert!(copy == &bytes[..], "{name}: copy on {node:?}");
        }
    }
}

#[test]
fn dbrx_roles_are_each_one_run_of_the_files_bytes() {
    let Some(dir) = fixtures("dbrx_roles_are_each_one_run_of_the_files_bytes") else {
        return;
    };
    let nodes = common::nodes();
    let checkpoint = open_fixture(&dir, "fam-dbrx");
    let file = file_experts(&dir);
    let model = checkpoint.place(&plan(nodes), options()).unwrap();
    check_runs(&model, &file);
    assert!(model.verify(&checkpoint).unwrap().verified());
    // The mappings: each layer's weight region (R × E slots from slot 0) in `segments`
    // mappings where placement works, and the cost and the loads count them as such.
    let report = model.report().unwrap();
    let layers = &report.experts.as_ref().unwrap().layer_reports;
    let store = model.expert_store().unwrap();
    let mut calls = 0;
    for l in layers {
        let experts = model.expert_ids(l.layer).unwrap().len();
        assert_eq!(l.experts, ROLES * experts, "L{}: R × E slots", l.layer);
        let segs = segments(nodes, experts);
        if nodes.len() == 1 {
            assert_eq!(segs, 1);
        }
        // Weights only (DBRX has no scales): one region, one call per segment.
        assert_eq!(l.mbind_calls, segs, "L{}", l.layer);
        calls += segs;
        let first = store.weights(l.layer, 0).unwrap().as_ptr() as usize;
        let maps = mappings_over(first..first + ROLES * experts * l.weight_stride);
        if common::degrade_here().is_none() {
            assert_eq!(maps, segs, "L{}: mappings", l.layer);
        }
    }
    let cost = checkpoint.placement_cost(&plan(nodes), &options()).unwrap();
    let experts = cost
        .classes
        .iter()
        .find(|c| c.class == TensorClass::RoutedExperts);
    let experts = experts.unwrap();
    assert_eq!(experts.mbind_calls, calls, "the cost counts the runs");
    assert!(
        experts.layout.ends_with(" role-major x3"),
        "{}",
        experts.layout
    );
    // Expert-major where nothing is flattened per role (st-mixtral, not asked).
    let plain = open_fixture(&dir, "st-mixtral")
        .placement_cost(&plan(nodes), &options())
        .unwrap();
    let routed = plain
        .classes
        .iter()
        .find(|c| c.class == TensorClass::RoutedExperts);
    assert!(!routed.unwrap().layout.contains("role-major"));
}

/// Asked of a per-expert naming (Mixtral's `w1/w2/w3`): each role's experts lie back to
/// back, every tensor as numpy wrote it (in a shared store too); a count other than the
/// roles refused by name before anything is reserved.
#[test]
fn role_major_where_asked_keeps_numpys_bytes_and_refuses_by_name() {
    let Some(dir) = fixtures("role_major_where_asked_keeps_numpys_bytes_and_refuses_by_name")
    else {
        return;
    };
    let nodes = common::nodes();
    let checkpoint = open_fixture(&dir, "st-mixtral");
    let model = checkpoint
        .place(&plan(nodes), options().role_major(ROLES))
        .unwrap();
    let numpy = numpy_tensors(&dir.join("st-mixtral"));
    for (name, _, bytes) in &numpy {
        let held = model.tensor(name).unwrap().bytes().map(<[u8]>::to_vec);
        assert_eq!(held.as_deref(), Some(&bytes[..]), "{name}");
    }
    let store = model.expert_store().unwrap();
    let report = model.report().unwrap().experts.as_ref().unwrap();
    assert!(!report.layer_reports.is_empty());
    for layer in report.layer_reports.iter().map(|l| l.layer) {
        let ids = model.expert_ids(layer).unwrap();
        let stride = store.weights(layer, 1).unwrap().as_ptr() as usize
            - store.weights(layer, 0).unwrap().as_ptr() as usize;
        let first = model.expert(layer, ids[0]).unwrap();
        for (r, piece) in first.iter().enumerate() {
            for &e in &ids {
                let p = &model.expert(layer, e).unwrap()[r];
                assert_eq!(p.role, piece.role);
                assert_eq!(
                    p.bytes.as_ptr() as usize,
                    piece.bytes.as_ptr() as usize + e * stride,
                    "L{layer} E{e} {}: back to back in its role's run",
                    p.role
                );
            }
        }
    }
    assert!(model.verify(&checkpoint).unwrap().verified());
    let refused = |options: StoreOptions, what: &str| match checkpoint.place(&plan(nodes), options)
    {
        Err(e @ Error::InvalidArgument { .. }) => {
            assert!(e.to_string().contains("role_major"), "{what}: {e}")
        }
        Err(e) => panic!("{what}: {e}"),
        Ok(_) => panic!("{what}: placed"),
    };
    refused(options().role_major(2), "2 roles of 3");
    refused(options().role_major(0), "no roles");
    // A shared store carries the order in its export (tests/model_export/role_major.rs).
    let shared = checkpoint.place(&plan(nodes), options().role_major(ROLES).shared(true));
    let shared = shared.unwrap();
    for (name, _, bytes) in &numpy {
        let held = shared.tensor(name).unwrap().bytes().map(<[u8]>::to_vec);
        assert_eq!(held.as_deref(), Some(&bytes[..]), "shared: {name}");
    }
}

/// VM (2+ nodes): under `split:all`, every expert's part of each DBRX role run (one
/// view, the file's `[E·I, H]`) has its pages on the expert's home node, asked of the
/// kernel page by page (`move_pages`), and the runs span the nodes.
#[test]
fn each_experts_part_of_a_dbrx_role_run_is_on_its_home_node() {
    let test = "each_experts_part_of_a_dbrx_role_run_is_on_its_home_node";
    let Some(nodes) = common::need_nodes(test, 2) else {
        return;
    };
    let Some(dir) = fixtures(test) else {
        return;
    };
    let checkpoint = open_fixture(&dir, "fam-dbrx");
    let file = file_experts(&dir);
    let model = checkpoint.place(&plan(nodes), options()).unwrap();
    check_runs(&model, &file);
    for name in file.keys() {
        let view = model.tensor(name).unwrap();
        let run = view.bytes().unwrap();
        let experts = model.expert_ids(view.layer().unwrap()).unwrap().len();
        let per = run.len() / experts;
        let mut on = std::collections::BTreeSet::new();
        for e in 0..experts {
            let home: Node = nodes.nth(e * nodes.len() / experts).unwrap();
            let h = pages_of_bytes(&run[e * per..][..per]);
            assert!(
                h.present() > 0 && h.on(home) == h.present(),
                "{name} E{e}: pages {h:?}, home {home:?}"
            );
            on.insert(home);
        }
        assert_eq!(
            on.len(),
            nodes.len().min(experts),
            "{name}: the run spans the nodes"
        );
    }
}
