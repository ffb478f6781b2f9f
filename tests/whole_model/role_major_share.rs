//! Role-major slots under a share (issue 33 item 5): a rank holding whole experts of
//! DBRX (`experts_held`, an expert share) keeps role `r` of its `i`-th held expert in
//! slot `r × E_held + i`, so each of its `w1`/`v1`/`w2` is one run: the tensor's rows of
//! the held experts, `[E_held·I, H]`, compared with the rows cut from the file by the
//! test's own header parse; the mappings from `/proc/self/maps` against the store's rule.
//! Held ids with a gap are no rows of the tensor (the role's tensor gives no bytes, each
//! expert still its file bytes); a tensor-parallel share cuts the roles and stays a slot
//! per expert (asked: refused by name). In the VM: each held expert's part of a run on
//! its home node, by `move_pages`.

use super::common::{self, fixtures, open_fixture, pages_of_bytes};
use super::plan;
use super::role_major::{ROLES, file_experts, mappings_over, options, segments};

use numapin::model::{ExpertShare, PlacementPlan, Share, SliceAxis, TensorClass};
use numapin::{Error, Node, NodeSet};

/// Experts per DBRX layer in the fixture (`moe_num_experts`).
const EXPERTS: usize = 4;

fn held(nodes: NodeSet, experts: ExpertShare) -> PlacementPlan {
    plan(nodes).share(Share::default().experts(experts))
}

/// Places `ids` of each layer and checks every role tensor against the file's rows of
/// those experts, every held expert inside its run, the others not held, verify, and
/// the weight region's mappings; returns the model's role runs' layout.
fn check_held(dir: &std::path::Path, nodes: NodeSet, share: ExpertShare, ids: &[usize]) {
    let checkpoint = open_fixture(dir, "fam-dbrx");
    let file = file_experts(dir);
    let what = format!("held {ids:?}");
    let model = checkpoint.place(&held(nodes, share.clone()), options());
    let model = model.unwrap_or_else(|e| panic!("{what}: {e}"));
    let consecutive = ids.windows(2).all(|w| w[1] == w[0] + 1);
    for (name, (shape, bytes)) in &file {
        let view = model.tensor(name).unwrap();
        assert_eq!(view.class(), TensorClass::RoutedExperts, "{what} {name}");
        let layer = view.layer().unwrap();
        assert_eq!(model.expert_ids(layer).unwrap(), ids, "{what}");
        let (rows, per) = (shape[0] as usize / EXPERTS, bytes.len() / EXPERTS);
        let run = view.bytes();
        if consecutive {
            let run = run.unwrap_or_else(|| panic!("{what} {name}: no one run"));
            let (a, n) = (ids[0], ids.len());
            assert_eq!(
                view.shape(),
                &[(n * rows) as u64, shape[1]],
                "{what} {name}"
            );
            assert!(run == &bytes[a * per..(a + n) * per], "{what} {name}: rows");
            match view.slice() {
                None => assert_eq!(n, EXPERTS, "{what} {name}: every expert, no slice"),
                Some(slice) => {
                    assert_eq!(slice.axis, SliceAxis::Rows);
                    assert_eq!(
                        (slice.start, slice.len, slice.extent),
                        ((a * rows) as u64, (n * rows) as u64, shape[0]),
                        "{what} {name}"
                    );
                }
            }
        } else {
            assert!(
                run.is_none(),
                "{what} {name}: held ids with a gap are no rows"
            );
        }
        for e in 0..EXPERTS {
            let Some(i) = ids.iter().position(|&x| x == e) else {
                let err = model.expert(layer, e).unwrap_err();
                assert!(matches!(err, Error::NotHeld { .. }), "{what} E{e}: {err}");
                continue;
            };
            let pieces = model.expert(layer, e).unwrap();
            let p = pieces.iter().find(|p| p.tensor == name).unwrap();
            assert!(p.bytes == &bytes[e * per..][..per], "{what} {name} E{e}");
            if let Some(run) = run {
                let at = run.as_ptr() as usize + i * per;
                assert_eq!(
                    p.bytes.as_ptr() as usize,
                    at,
                    "{what} {name} E{e}: in the run"
                );
            }
        }
    }
    assert!(model.verify(&checkpoint).unwrap().verified(), "{what}");
    let report = model.report().unwrap();
    let store = model.expert_store().unwrap();
    for l in &report.experts.as_ref().unwrap().layer_reports {
        assert_eq!(
            l.experts,
            ROLES * ids.len(),
            "{what} L{}: R × E_held",
            l.layer
        );
        let segs = segments(nodes, ids.len());
        assert_eq!(l.mbind_calls, segs, "{what} L{}", l.layer);
        let first = store.weights(l.layer, 0).unwrap().as_ptr() as usize;
        let maps = mappings_over(first..first + ROLES * ids.len() * l.weight_stride);
        if common::degrade_here().is_none() {
            assert_eq!(maps, segs, "{what} L{}: mappings", l.layer);
        }
    }
    let cost = checkpoint
        .placement_cost(&held(nodes, share), &options())
        .unwrap();
    let routed = cost
        .classes
        .iter()
        .find(|c| c.class == TensorClass::RoutedExperts);
    let layout = &routed.unwrap().layout;
    assert!(layout.ends_with(" role-major x3"), "{what}: {layout}");
}

#[test]
fn dbrx_held_experts_are_one_run_of_the_files_rows_per_role() {
    let Some(dir) = fixtures("dbrx_held_experts_are_one_run_of_the_files_rows_per_role") else {
        return;
    };
    let nodes = common::nodes();
    for n in [1, 2, 4] {
        for k in 0..n {
            let ids: Vec<usize> = (k * EXPERTS / n..(k + 1) * EXPERTS / n).collect();
            check_held(&dir, nodes, ExpertShare::part(k, n).unwrap(), &ids);
        }
    }
    check_held(&dir, nodes, ExpertShare::list([1, 2]).unwrap(), &[1, 2]);
    check_held(
        &dir,
        nodes,
        ExpertShare::list([0, 2, 3]).unwrap(),
        &[0, 2, 3],
    );
}

/// Tensor parallel cuts DBRX's roles: a slot per expert as before (the cost says so),
/// `role_major(R)` refused by name; hostile counts refused by name under a share; a
/// share holding nothing an error, not a panic.
#[test]
fn a_cut_share_stays_expert_major_and_hostile_counts_are_refused() {
    let Some(dir) = fixtures("a_cut_share_stays_expert_major_and_hostile_counts_are_refused")
    else {
        return;
    };
    let nodes = common::nodes();
    let checkpoint = open_fixture(&dir, "fam-dbrx");
    let file = file_experts(&dir);
    let tp = plan(nodes).tensor_parallel(1, 2).unwrap();
    let cost = checkpoint.placement_cost(&tp, &options()).unwrap();
    let routed = cost
        .classes
        .iter()
        .find(|c| c.class == TensorClass::RoutedExperts);
    let layout = &routed.unwrap().layout;
    assert!(!layout.contains("role-major"), "tp: {layout}");
    let model = checkpoint.place(&tp, options()).unwrap();
    for name in file.keys() {
        let layer = model.tensor(name).unwrap().layer().unwrap();
        let report = model.report().unwrap();
        let l = report.experts.as_ref().unwrap().layer_reports.iter();
        let slots = l.filter(|l| l.layer == layer).map(|l| l.experts).next();
        assert_eq!(slots, Some(EXPERTS), "{name}: a slot per expert");
    }
    assert!(model.verify(&checkpoint).unwrap().verified());
    let refused = |plan: &PlacementPlan, roles: usize, what: &str| {
        match checkpoint.place(plan, options().role_major(roles)) {
            Err(e @ Error::InvalidArgument { .. }) => {
                assert!(e.to_string().contains("role_major"), "{what}: {e}")
            }
            Err(e) => panic!("{what}: {e}"),
            Ok(_) => panic!("{what}: placed"),
        }
        let cost = checkpoint.placement_cost(plan, &options().role_major(roles));
        assert!(cost.is_err(), "{what}: the dry run refuses it too");
    };
    refused(&tp, ROLES, "tp asked role-major");
    let ep = held(nodes, ExpertShare::part(0, 2).unwrap());
    refused(&ep, 0, "role_major(0) under a share");
    refused(&ep, usize::MAX, "role_major(usize::MAX) under a share");
    refused(&ep, 2, "2 roles of 3 under a share");
    // Asked with the roles it has: the same as not asking.
    let asked = checkpoint.place(&ep, options().role_major(ROLES)).unwrap();
    let w1 = "transformer.blocks.0.ffn.experts.mlp.w1";
    let (_, bytes) = &file[w1];
    let run = asked.tensor(w1).unwrap().bytes().map(<[u8]>::to_vec);
    assert_eq!(run.as_deref(), Some(&bytes[..bytes.len() / 2]));
    // A rank holding none of a layer's experts: an error naming the share, no panic.
    for roles in [1, ROLES] {
        for share in [
            ExpertShare::list([EXPERTS + 3]).unwrap(),
            ExpertShare::part(5, 8).unwrap(), // 8 ranks over 4 experts: rank 5 has none
        ] {
            let empty = held(nodes, share);
            let e = checkpoint
                .place(&empty, options().role_major(roles))
                .unwrap_err();
            assert!(e.to_string().contains("expert"), "{e}");
            let cost = checkpoint.placement_cost(&empty, &options().role_major(roles));
            assert!(cost.is_err(), "the dry run refuses it too");
        }
    }
}

/// VM (2+ nodes): under `split:all` and a share of 2 or more held experts, every held
/// expert's part of each role run has its pages on its home node (the `i`-th held of
/// `E_held` on node `i × n / E_held`), asked of the kernel with `move_pages`.
#[test]
fn each_held_experts_part_of_a_role_run_is_on_its_home_node() {
    let test = "each_held_experts_part_of_a_role_run_is_on_its_home_node";
    let Some(nodes) = common::need_nodes(test, 2) else {
        return;
    };
    let Some(dir) = fixtures(test) else {
        return;
    };
    let checkpoint = open_fixture(&dir, "fam-dbrx");
    let file = file_experts(&dir);
    for k in 0..2 {
        let share = held(nodes, ExpertShare::part(k, 2).unwrap());
        let model = checkpoint.place(&share, options()).unwrap();
        for name in file.keys() {
            let run = model.tensor(name).unwrap().bytes().unwrap();
            let count = EXPERTS / 2;
            let per = run.len() / count;
            for i in 0..count {
                let home: Node = nodes.nth(i * nodes.len() / count).unwrap();
                let h = pages_of_bytes(&run[i * per..][..per]);
                assert!(
                    h.present() > 0 && h.on(home) == h.present(),
                    "rank {k} {name} held {i}: pages {h:?}, home {home:?}"
                );
            }
        }
    }
}
