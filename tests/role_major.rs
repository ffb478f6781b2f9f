//! Role-major slots (`StoreOptions::role_major`, issue 33 item 5): a layer of `R × E`
//! slots holds role `r` of expert `e` at slot `r × E + e`, so each role's experts lie
//! back to back — a framework tensor holding one role of every expert (DBRX's `w1`,
//! `[E·I, H]`) is one view of its run — while every slot of expert `e` stays on `e`'s
//! node under `Layout::SplitExperts`. On the host: the address arithmetic, the bytes
//! against the sources, the homes by the block formula, the mappings in
//! `/proc/self/maps` and the `mbind` calls against the segments counted here (the cost:
//! `R × blocks` per region on several nodes, one on one node). In the VM (2+ nodes):
//! every slot's pages on its expert's node, by `move_pages`.

mod common;

use common::memory_sources;
use numapin::store::{ExpertAssignment, Home, LayerSpec, Layout, PinStore, StoreOptions};
use numapin::{Error, Node, NodeSet};

const EXPERTS: usize = 6;
const ROLES: usize = 3;
/// A page multiple: the slot stride is the piece, so a role's run is back to back.
const WEIGHT_BYTES: usize = 2 * 4096;
const SCALE_BYTES: usize = 4096;

/// Distinct bytes per role and expert, in role-major order (slot `r × E + e`).
fn model() -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..ROLES * EXPERTS)
        .map(|s| {
            let w = (0..WEIGHT_BYTES).map(|i| (i * 7 + s * 13) as u8).collect();
            let sc = (0..SCALE_BYTES)
                .map(|i| (i * 3 + s * 5) as u8 ^ 0x5a)
                .collect();
            (w, sc)
        })
        .collect()
}

fn spec(slots: usize) -> LayerSpec {
    LayerSpec {
        experts: slots,
        weight_bytes: WEIGHT_BYTES,
        scale_bytes: SCALE_BYTES,
    }
}

fn options() -> StoreOptions {
    StoreOptions::default()
        .huge_pages(false)
        .loader_threads(2)
        .role_major(ROLES)
}

/// Expert `e`'s node by the block formula (expert `e` of `E` on node `e × n / E`),
/// without numapin.
fn home(set: NodeSet, e: usize) -> Node {
    set.nth(e * set.len() / EXPERTS).unwrap()
}

/// Runs of consecutive slots on one node, over the whole layer in slot order: the
/// mappings of a region where placement works (the kernel merges neighbours under one
/// policy) and the `mbind` calls per region.
fn segments(set: NodeSet) -> usize {
    let homes: Vec<Node> = (0..ROLES * EXPERTS)
        .map(|s| home(set, s % EXPERTS))
        .collect();
    1 + homes.windows(2).filter(|w| w[0] != w[1]).count()
}

/// The mappings of this process overlapping `range`, in address order.
fn mappings_over(range: std::ops::Range<usize>) -> Vec<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let mut out: Vec<(usize, usize)> = maps
        .lines()
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
        .filter(|&(a, b)| a < range.end && b > range.start)
        .collect();
    out.sort_unstable();
    out
}

#[test]
fn each_roles_experts_are_one_run_and_every_slot_of_an_expert_is_on_its_node() {
    let set = common::nodes();
    let store = PinStore::new(Layout::SplitExperts(set), options()).unwrap();
    let data = model();
    let report = store
        .pack_layer(0, &spec(ROLES * EXPERTS), &memory_sources(&data))
        .unwrap();
    assert_eq!(report.weight_stride, WEIGHT_BYTES);
    assert_eq!(report.scale_stride, SCALE_BYTES);
    // One mbind per segment per region, whether it took or degraded: on one node the
    // runs are one block (2 calls), on n nodes R × n (the role-major cost).
    let segs = segments(set);
    if set.len() == 1 {
        assert_eq!(segs, 1);
    } else {
        assert_eq!(segs, ROLES * set.len().min(EXPERTS));
    }
    assert_eq!(report.mbind_calls, 2 * segs);
    assert_eq!(report.regions, 2);
    let mut per_node = std::collections::BTreeMap::new();
    for r in 0..ROLES {
        let run = store.weights(0, r * EXPERTS).unwrap().as_ptr() as usize;
        for e in 0..EXPERTS {
            let s = r * EXPERTS + e;
            let (w, sc) = &data[s];
            let got = store.weights(0, s).unwrap();
            // Back to back: role r of every expert is one range, `[E·I, H]`.
            assert_eq!(
                got.as_ptr() as usize,
                run + e * WEIGHT_BYTES,
                "role {r} E{e}"
            );
            assert_eq!(got, &w[..], "role {r} E{e}");
            assert_eq!(store.scales(0, s).unwrap(), &sc[..], "role {r} E{e}");
            assert_eq!(
                store.home_node(0, s).unwrap(),
                Some(home(set, e)),
                "slot {s}"
            );
            *per_node.entry(home(set, e)).or_insert(0u64) += (w.len() + sc.len()) as u64;
        }
    }
    assert_eq!(store.stats().unwrap().node_bytes, per_node);
    // Each region one virtual range, its mappings back to back: one per segment where
    // placement works.
    let regions = [
        (store.weights(0, 0).unwrap().as_ptr() as usize, WEIGHT_BYTES),
        (store.scales(0, 0).unwrap().as_ptr() as usize, SCALE_BYTES),
    ];
    for (first, len) in regions {
        let range = first..first + ROLES * EXPERTS * len;
        let maps = mappings_over(range.clone());
        assert!(maps[0].0 <= range.start && maps[maps.len() - 1].1 >= range.end);
        for pair in maps.windows(2) {
            assert_eq!(pair[0].1, pair[1].0, "a gap in {maps:x?}");
        }
        if common::degrade_here().is_none() {
            assert_eq!(maps.len(), segs, "{maps:x?}");
        } else {
            assert!(maps.len() <= segs, "{maps:x?}");
        }
    }
}

/// VM (2+ nodes): every slot of expert `e` — one per role, in `R` runs — has its pages
/// on `e`'s node, asked of the kernel (`move_pages`), and the runs span the nodes.
#[test]
fn every_role_of_an_expert_has_its_pages_on_its_home_node() {
    let test = "every_role_of_an_expert_has_its_pages_on_its_home_node";
    let Some(set) = common::need_nodes(test, 2) else {
        return;
    };
    let store = PinStore::new(Layout::SplitExperts(set), options()).unwrap();
    let data = model();
    store
        .pack_layer(0, &spec(ROLES * EXPERTS), &memory_sources(&data))
        .unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for s in 0..ROLES * EXPERTS {
        let node = home(set, s % EXPERTS);
        for bytes in [store.weights(0, s).unwrap(), store.scales(0, s).unwrap()] {
            let h = common::pages_of_bytes(bytes);
            assert!(
                h.present() > 0 && h.on(node) == h.present(),
                "slot {s} (role {}, expert {}): {h:?}, home {node:?}",
                s / EXPERTS,
                s % EXPERTS
            );
        }
        seen.insert(node);
    }
    assert_eq!(
        seen.len(),
        set.len().min(EXPERTS),
        "every node holds experts"
    );
}

#[test]
fn role_major_refuses_what_it_cannot_keep_by_name() {
    let set = common::nodes();
    let invalid = |r: numapin::Result<PinStore>, what: &str| match r {
        Err(e @ Error::InvalidArgument { .. }) => {
            assert!(e.to_string().contains("role_major"), "{what}: {e}")
        }
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    };
    let split = Layout::SplitExperts(set);
    invalid(PinStore::new(split, options().role_major(0)), "no roles");
    let first = Home::Node(set.nth(0).unwrap());
    let assigned = ExpertAssignment::new().layer(0, vec![first; ROLES * EXPERTS]);
    invalid(
        PinStore::new(split, options().assignment(Some(assigned))),
        "with an assignment",
    );
    // A shared store takes it: its export carries the order (StorePart::role_major,
    // tests/model_export/role_major.rs).
    let shared = PinStore::new(split, options().shared(true)).unwrap();
    let data = model();
    shared
        .pack_layer(0, &spec(data.len()), &memory_sources(&data))
        .unwrap();
    for (s, (bytes, _)) in data.iter().enumerate() {
        assert_eq!(shared.weights(0, s).unwrap(), &bytes[..], "shared slot {s}");
    }
    drop(shared);
    // Slots that do not divide into the runs: refused before anything is mapped, and
    // the store stays usable.
    let store = PinStore::new(split, options()).unwrap();
    let data = model();
    let short = &data[..ROLES * EXPERTS - 1];
    match store.pack_layer(0, &spec(short.len()), &memory_sources(short)) {
        Err(e @ Error::InvalidArgument { .. }) => {
            let text = e.to_string();
            assert!(text.contains("role-major") && text.contains("17"), "{text}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    store
        .pack_layer(0, &spec(data.len()), &memory_sources(&data))
        .unwrap();
    assert_eq!(store.weights(0, 5).unwrap(), &data[5].0[..]);
    // Role-major with one slot per expert is the default order.
    let plain = PinStore::new(split, options().role_major(1)).unwrap();
    plain
        .pack_layer(0, &spec(data.len()), &memory_sources(&data))
        .unwrap();
    assert_eq!(
        plain.home_node(0, ROLES * EXPERTS - 1).unwrap(),
        Some(set.nth(set.len() - 1).unwrap())
    );
}
