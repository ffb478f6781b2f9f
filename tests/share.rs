//! A rank's share (`Checkpoint::pack_share`): the fixtures written by the official writers
//! (`NUMAPIN_FIXTURES`, made by `cargo xtask fixtures`) packed by 2 and 4 ranks under
//! expert parallelism, tensor parallelism (rows and columns) and both, each rank in a
//! store of its own. Every held slot is compared with the bytes numpy wrote for it
//! (`expected/` for whole experts, `expected_tp/` for numpy's slices), and the ranks'
//! shares put together are compared with numpy's whole experts. In the VM, two ranks'
//! shares on two nodes, placement read back with `move_pages`.
#![cfg(feature = "model")]

mod common;

use common::fixtures;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use numapin::model::{Checkpoint, ExpertShare, Share, SliceAxis, TensorSlice};
use numapin::store::{Kind, Layout, PinStore, StoreOptions};
use numapin::{Error, Invalid};

struct Fixture {
    root: PathBuf,
    checkpoint: Checkpoint,
    /// Model layer → experts, from fixture.json (what the script wrote).
    layers: Vec<(usize, usize)>,
}

impl Fixture {
    fn open(dir: &Path, name: &str) -> Fixture {
        let root = dir.join(name);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(root.join("fixture.json")).unwrap()).unwrap();
        let checkpoint = Checkpoint::open(root.join(json["path"].as_str().unwrap())).unwrap();
        let layers = json["layers"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(l, n)| (l.parse().unwrap(), n.as_u64().unwrap() as usize))
            .collect();
        Fixture {
            root,
            checkpoint,
            layers,
        }
    }

    /// numpy's bytes of a whole expert's slot (`None`: a model without scales).
    fn expected(&self, layer: usize, expert: usize, kind: Kind) -> Option<Vec<u8>> {
        let name = format!("L{layer}_E{expert}.{}.bin", kind.name());
        std::fs::read(self.root.join("expected").join(name)).ok()
    }

    /// numpy's bytes of rank `k` of `n`'s slice of an expert's slot.
    fn expected_tp(
        &self,
        axis: &str,
        k: usize,
        n: usize,
        l: usize,
        e: usize,
        kind: Kind,
    ) -> Option<Vec<u8>> {
        let dir = self
            .root
            .join("expected_tp")
            .join(format!("{axis}-{k}of{n}"));
        std::fs::read(dir.join(format!("L{l}_E{e}.{}.bin", kind.name()))).ok()
    }
}

fn store() -> PinStore {
    PinStore::new(Layout::Interleave(common::nodes()), StoreOptions::default()).unwrap()
}

fn ep(k: usize, n: usize) -> Share {
    Share::default().experts(ExpertShare::part(k, n).unwrap())
}

fn tp(axis: &str, k: usize, n: usize) -> TensorSlice {
    TensorSlice::parse(&format!("{axis}:{k}/{n}")).unwrap()
}

/// Packs `share` of `f` in a store of its own and checks what it says it holds.
fn pack(f: &Fixture, share: &Share) -> PinStore {
    let store = store();
    let report = f.checkpoint.pack_share(&store, share).unwrap();
    let held = report.share.as_ref().expect("a share report");
    assert_eq!(held.share, share.to_string());
    assert!(f.checkpoint.verify_share(&store, share).unwrap().verified());
    store
}

#[test]
fn expert_shares_of_2_and_4_ranks_hold_each_expert_once_with_numpys_bytes() {
    let Some(dir) = fixtures("expert_shares_of_2_and_4_ranks") else {
        return;
    };
    for name in [
        "st-sharded",
        "st-single",
        "st-mixtral",
        "st-fused",
        "gguf-single",
        "gguf-split",
    ] {
        let f = Fixture::open(&dir, name);
        for n in [2, 4] {
            let mut seen: BTreeSet<(usize, usize)> = BTreeSet::new();
            for k in 0..n {
                let share = ep(k, n);
                if f.layers.iter().any(|&(_, experts)| experts < n) {
                    // 3 experts over 4 ranks: the last rank holds none of the layer.
                    let store = store();
                    match f.checkpoint.pack_share(&store, &share) {
                        Ok(_) => {}
                        Err(Error::InvalidArgument {
                            reason: Invalid::Empty { what },
                            ..
                        }) => {
                            assert!(
                                what.contains("layer") && what.contains(&format!("{k}/{n}")),
                                "{what}"
                            );
                            continue;
                        }
                        Err(e) => panic!("{name} {k}/{n}: {e}"),
                    }
                }
                let store = pack(&f, &share);
                for &(layer, experts) in &f.layers {
                    for e in 0..experts {
                        match store.weights(layer, e) {
                            Ok(w) => {
                                assert!(seen.insert((layer, e)), "{name}: expert {e} twice");
                                assert_eq!(
                                    Some(w.to_vec()),
                                    f.expected(layer, e, Kind::Weights),
                                    "{name} L{layer} E{e}"
                                );
                                let scales = store.scales(layer, e).unwrap();
                                match f.expected(layer, e, Kind::Scales) {
                                    Some(s) => assert_eq!(scales, &s[..]),
                                    None => assert!(scales.is_empty()),
                                }
                                assert!(
                                    store
                                        .slot_map(layer)
                                        .unwrap()
                                        .pieces(e, Kind::Weights)
                                        .is_some()
                                );
                            }
                            Err(Error::NotHeld {
                                expert,
                                layer: l,
                                held,
                                ..
                            }) => {
                                assert_eq!((expert, l), (e, layer));
                                assert!(!held.is_empty());
                                assert!(
                                    store
                                        .slot_map(layer)
                                        .unwrap()
                                        .pieces(e, Kind::Weights)
                                        .is_none()
                                );
                                assert!(matches!(
                                    store.home_node(layer, e),
                                    Err(Error::NotHeld { .. })
                                ));
                            }
                            Err(other) => panic!("{name} L{layer} E{e}: {other}"),
                        }
                    }
                    // Past the layer: the store names the id as not held.
                    assert!(matches!(
                        store.weights(layer, experts),
                        Err(Error::NotHeld { .. })
                    ));
                }
            }
            let all: usize = f.layers.iter().map(|&(_, n)| n).sum();
            assert_eq!(seen.len(), all, "{name}: {n} ranks cover every expert");
        }
    }
}

/// The slot of every expert of every rank put back together: piece `i` of each rank in
/// rank order, for each `i` (rows: a role a piece; columns: a row a piece).
fn assemble(stores: &[PinStore], layer: usize, e: usize, kind: Kind) -> Vec<u8> {
    let maps: Vec<_> = stores
        .iter()
        .map(|s| s.slot_map(layer).unwrap().pieces(e, kind).unwrap())
        .collect();
    let slots: Vec<&[u8]> = stores
        .iter()
        .map(|s| match kind {
            Kind::Weights => s.weights(layer, e).unwrap(),
            Kind::Scales => s.scales(layer, e).unwrap(),
        })
        .collect();
    let pieces = maps[0].len();
    assert!(maps.iter().all(|m| m.len() == pieces));
    let mut out = Vec::new();
    for i in 0..pieces {
        for (map, slot) in maps.iter().zip(&slots) {
            out.extend_from_slice(&slot[map[i].offset..map[i].end()]);
        }
    }
    out
}

#[test]
fn tensor_slices_of_2_and_4_ranks_match_numpy_and_concatenate_to_the_whole() {
    let Some(dir) = fixtures("tensor_slices_of_2_and_4_ranks") else {
        return;
    };
    let cases: [(&str, &[(&str, usize)]); 4] = [
        ("st-single", &[("rows", 2), ("columns", 2)]),
        (
            "st-mixtral",
            &[("rows", 2), ("rows", 4), ("columns", 2), ("columns", 4)],
        ),
        (
            "st-fused",
            &[("rows", 2), ("rows", 4), ("columns", 2), ("columns", 4)],
        ),
        ("gguf-single", &[("rows", 2), ("rows", 4)]),
    ];
    for (name, slices) in cases {
        let f = Fixture::open(&dir, name);
        for &(axis, n) in slices {
            let stores: Vec<PinStore> = (0..n)
                .map(|k| pack(&f, &Share::default().slice(tp(axis, k, n))))
                .collect();
            for (k, store) in stores.iter().enumerate() {
                for &(layer, experts) in &f.layers {
                    for e in 0..experts {
                        let what = format!("{name} {axis}:{k}/{n} L{layer} E{e}");
                        let want = f
                            .expected_tp(axis, k, n, layer, e, Kind::Weights)
                            .expect(&what);
                        assert_eq!(store.weights(layer, e).unwrap(), &want[..], "{what}");
                        let scales = store.scales(layer, e).unwrap();
                        match f.expected_tp(axis, k, n, layer, e, Kind::Scales) {
                            Some(s) => assert_eq!(scales, &s[..], "{what} scales"),
                            None => assert!(scales.is_empty(), "{what}"),
                        }
                    }
                }
            }
            for &(layer, experts) in &f.layers {
                for e in 0..experts {
                    for kind in Kind::ALL {
                        let whole = f.expected(layer, e, kind).unwrap_or_default();
                        assert_eq!(
                            assemble(&stores, layer, e, kind),
                            whole,
                            "{name} {axis}/{n} L{layer} E{e} {kind:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn expert_and_tensor_parallel_together_cover_the_model() {
    let Some(dir) = fixtures("expert_and_tensor_parallel_together") else {
        return;
    };
    let f = Fixture::open(&dir, "st-mixtral");
    for axis in ["rows", "columns"] {
        // 2 expert-parallel groups × 2 tensor-parallel ranks: 4 stores.
        let mut covered = BTreeSet::new();
        for group in 0..2 {
            let stores: Vec<PinStore> = (0..2)
                .map(|k| pack(&f, &ep(group, 2).slice(tp(axis, k, 2))))
                .collect();
            for &(layer, experts) in &f.layers {
                for e in 0..experts {
                    if matches!(stores[0].weights(layer, e), Err(Error::NotHeld { .. })) {
                        assert!(matches!(
                            stores[1].weights(layer, e),
                            Err(Error::NotHeld { .. })
                        ));
                        continue;
                    }
                    for (k, store) in stores.iter().enumerate() {
                        let want = f.expected_tp(axis, k, 2, layer, e, Kind::Weights).unwrap();
                        assert_eq!(store.weights(layer, e).unwrap(), &want[..]);
                    }
                    let whole = f.expected(layer, e, Kind::Weights).unwrap();
                    assert_eq!(assemble(&stores, layer, e, Kind::Weights), whole);
                    assert!(covered.insert((layer, e)));
                }
            }
        }
        assert_eq!(
            covered.len(),
            f.layers.iter().map(|&(_, n)| n).sum::<usize>()
        );
    }
}

#[test]
fn the_report_says_which_share_was_placed() {
    let Some(dir) = fixtures("the_report_says_which_share_was_placed") else {
        return;
    };
    let f = Fixture::open(&dir, "st-single");
    let share = Share::default()
        .experts(ExpertShare::parse("0,2").unwrap())
        .slice(tp("columns", 1, 2));
    let store = store();
    let report = f.checkpoint.pack_share(&store, &share).unwrap();
    let held = report.share.clone().unwrap();
    // A cut plan is still complete: every held expert has every role (one piece a row).
    let plan = f.checkpoint.expert_plan().unwrap();
    let cut = plan.share(&f.checkpoint, &share).unwrap();
    assert!(cut.is_complete() && cut.is_share() && !plan.is_share());
    assert!(
        cut.share(&f.checkpoint, &share).is_err(),
        "a share of a share"
    );
    assert_eq!(cut.layer(1).unwrap().share().unwrap().expert_ids(), &[0, 2]);
    assert_eq!(held.share, "experts 0,2, slice columns:1/2");
    for (&layer, ids) in &held.experts_held {
        assert_eq!(ids, "0,2", "layer {layer}");
        assert_eq!(held.experts_of[&layer], 3);
        // gate, up, down and their scales: HIDDEN = 64 and FFN = 32 columns (numpy's
        // shapes in the fixture script), scale grids of 16.
        let slices = &held.slices[&layer];
        let got: Vec<(bool, u64, u64, u64)> = slices
            .iter()
            .map(|s| (s.weight, s.start, s.len, s.extent))
            .collect();
        assert_eq!(
            got,
            vec![
                (true, 32, 32, 64),
                (true, 32, 32, 64),
                (true, 16, 16, 32),
                (false, 2, 2, 4),
                (false, 2, 2, 4),
                (false, 1, 1, 2),
            ]
        );
        assert!(
            slices
                .iter()
                .all(|s| s.axis == SliceAxis::Columns && !s.whole)
        );
    }
    assert_eq!(
        report
            .experts_per_layer
            .values()
            .copied()
            .collect::<Vec<_>>(),
        vec![2, 2, 2]
    );
    // Half the columns of 2 of 3 experts: a third of the whole's bytes.
    let whole: u64 = (0..3)
        .flat_map(|e| (1..=3).map(move |l| (l, e)))
        .map(|(l, e)| {
            f.expected(l, e, Kind::Weights).unwrap().len() as u64
                + f.expected(l, e, Kind::Scales).unwrap().len() as u64
        })
        .sum();
    assert_eq!(report.bytes * 3, whole);
    assert!(
        report
            .to_string()
            .ends_with("share: experts 0,2, slice columns:1/2"),
        "{report}"
    );
}

fn invalid(result: Result<numapin::model::ModelReport, Error>) -> String {
    match result {
        Err(e @ Error::InvalidArgument { .. }) | Err(e @ Error::OutOfRange { .. }) => e.to_string(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_shares_are_errors_naming_what_and_where() {
    let Some(dir) = fixtures("bad_shares_are_errors") else {
        return;
    };
    let single = Fixture::open(&dir, "st-single");
    let gguf = Fixture::open(&dir, "gguf-single");
    let fused = Fixture::open(&dir, "st-fused");
    let try_pack = |f: &Fixture, share: Share| f.checkpoint.pack_share(&store(), &share);
    // An id past the layer's 3 experts.
    let err = invalid(try_pack(
        &single,
        Share::default().experts(ExpertShare::parse("1-5").unwrap()),
    ));
    assert!(
        err.contains("5") && err.contains("layer 1") && err.contains("there are 3"),
        "{err}"
    );
    // Overlapping ranges, an empty share: refused when made.
    assert!(
        ExpertShare::parse("0-2,2")
            .unwrap_err()
            .to_string()
            .contains("overlapping")
    );
    assert!(ExpertShare::ranges([]).is_err());
    // A slice past the axis (gate_up has 64 rows), a part that does not divide it.
    let err = invalid(try_pack(
        &fused,
        Share::default().slice(TensorSlice::parse("rows:48:32").unwrap()),
    ));
    assert!(
        err.contains("48..80") && err.contains("past the axis"),
        "{err}"
    );
    let err = invalid(try_pack(&fused, Share::default().slice(tp("rows", 0, 3))));
    assert!(err.contains("3 does not divide"), "{err}");
    // Through a Q8_0 block: down's rows are 32 elements, one block.
    let err = invalid(try_pack(&gguf, Share::default().slice(tp("columns", 0, 2))));
    assert!(err.contains("Q8_0 blocks of 32 elements"), "{err}");
    // Through a scale block: gate's 32 rows in 4 parts of 8, its scales in blocks of 16.
    let err = invalid(try_pack(&single, Share::default().slice(tp("rows", 0, 4))));
    assert!(err.contains("scale blocks of 16"), "{err}");
    // Nothing was packed by any of these.
    let s = store();
    assert!(
        try_pack(
            &single,
            Share::default().experts(ExpertShare::parse("7").unwrap())
        )
        .is_err()
    );
    assert!(matches!(s.weights(1, 0), Err(Error::NotPacked { .. })));
}

#[test]
fn split_experts_splits_the_share_and_the_source_follows_global_ids() {
    let Some(dir) = fixtures("split_experts_splits_the_share") else {
        return;
    };
    let f = Fixture::open(&dir, "st-mixtral");
    let nodes = common::nodes();
    let mut store = PinStore::new(Layout::SplitExperts(nodes), StoreOptions::default()).unwrap();
    let share = Share::default().experts(ExpertShare::list([1, 3]).unwrap());
    let report = f.checkpoint.pack_share(&store, &share).unwrap();
    for r in &report.layer_reports {
        assert_eq!(r.experts, 2, "slots only for the share");
    }
    // Blocks over the held experts: the first held on the first node.
    assert_eq!(store.home_node(1, 1).unwrap(), nodes.nth(0));
    assert_eq!(store.home_node(1, 3).unwrap(), nodes.nth(1 % nodes.len()));
    // Release and ensure by global id, from the plan's source for that id.
    let plan = f
        .checkpoint
        .expert_plan()
        .unwrap()
        .share(&f.checkpoint, &share)
        .unwrap();
    store.release(2, 3).unwrap();
    assert!(matches!(store.weights(2, 3), Err(Error::Released { .. })));
    let source = f.checkpoint.expert_source(&plan, 2, 3).unwrap();
    store.ensure(2, 3, &source).unwrap();
    assert_eq!(
        Some(store.weights(2, 3).unwrap().to_vec()),
        f.expected(2, 3, Kind::Weights)
    );
    assert!(matches!(
        f.checkpoint.expert_source(&plan, 2, 2),
        Err(Error::NotHeld { expert: 2, .. })
    ));
    assert!(matches!(store.release(2, 0), Err(Error::NotHeld { .. })));
}

/// Two ranks' shares, each in its own store bound to its own node (`LayerPerNode` over a
/// one-node set): every page of each rank's slots on its node, by `move_pages`.
#[test]
fn two_ranks_shares_land_on_their_own_nodes() {
    let Some(nodes) = common::need_nodes("two_ranks_shares_land_on_their_own_nodes", 2) else {
        return;
    };
    let Some(dir) = fixtures("two_ranks_shares_land_on_their_own_nodes") else {
        return;
    };
    let f = Fixture::open(&dir, "st-mixtral");
    for rank in 0..2 {
        let node = nodes.nth(rank).unwrap();
        let set = std::iter::once(node).collect();
        let store = PinStore::new(
            Layout::LayerPerNode(set),
            StoreOptions::default().huge_pages(false),
        )
        .unwrap();
        let share = ep(rank, 2).slice(tp("rows", rank, 2));
        f.checkpoint.pack_share(&store, &share).unwrap();
        let stats = store.stats().unwrap();
        assert_eq!(
            stats.pages_source,
            Some(numapin::PagesSource::MovePages),
            "{stats:?}"
        );
        let on = stats.pages_per_node.get(&node).copied().unwrap_or(0);
        let all: u64 = stats.pages_per_node.values().sum();
        assert!(all > 0, "rank {rank}: no pages");
        assert_eq!(
            on, all,
            "rank {rank}: pages {:?}, want all on {node}",
            stats.pages_per_node
        );
        for &(layer, experts) in &f.layers {
            for e in 0..experts {
                if let Ok(w) = store.weights(layer, e) {
                    let want = f
                        .expected_tp("rows", rank, 2, layer, e, Kind::Weights)
                        .unwrap();
                    assert_eq!(w, &want[..]);
                }
            }
        }
    }
}
