//! `Layout::SplitExperts` with an `ExpertAssignment` (experts to nodes balanced by
//! routing load): what the store refuses, that every expert reads back its own bytes
//! (against the sources, which the store did not compute), and — in the VM, on 2+ nodes —
//! that `move_pages` finds each expert on its assigned home and the per-node report
//! counts each node's experts.

mod common;

use common::{need_nodes, nodes, pages_of};
use numapin::routing::RoutingStats;
use numapin::store::{
    ExpertAssignment, ExpertSource, Home, HotCopies, LayerSpec, Layout, PinStore, StoreOptions,
};
use numapin::{Error, Invalid};

const W: usize = 64 * 1024;

fn options() -> StoreOptions {
    StoreOptions::default().huge_pages(false).loader_threads(2)
}

fn data(experts: usize) -> Vec<Vec<u8>> {
    (0..experts)
        .map(|e| (0..W).map(|i| (e * 31 + i % 251) as u8).collect())
        .collect()
}

fn sources(data: &[Vec<u8>]) -> Vec<ExpertSource<'_>> {
    data.iter()
        .map(|w| ExpertSource::Memory {
            weights: w,
            scales: &w[..512],
        })
        .collect()
}

fn spec(experts: usize) -> LayerSpec {
    LayerSpec {
        experts,
        weight_bytes: W,
        scale_bytes: 4096,
    }
}

fn reason(e: Error) -> Invalid {
    match e {
        Error::InvalidArgument { reason, .. } => reason,
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_assignment_is_for_a_split() {
    let set = nodes();
    let first = Home::Node(set.nth(0).unwrap());
    let a = Some(ExpertAssignment::new().layer(0, vec![first; 4]));
    for layout in [
        Layout::Interleave(set),
        Layout::Replicate(set),
        Layout::Unplaced,
    ] {
        let e = PinStore::new(layout, options().assignment(a.clone())).unwrap_err();
        assert!(e.to_string().contains("SplitExperts"), "{e}");
    }
    // Shared too: a hybrid placement exports through PlacedModel::export.
    let shared = options().shared(true).assignment(a.clone());
    assert!(PinStore::new(Layout::SplitExperts(set), shared).is_ok());
    let store = PinStore::new(Layout::SplitExperts(set), options().assignment(a)).unwrap();
    // Layer 0 is assigned 4 experts; packing 5 is a mismatch, named.
    let d = data(5);
    let e = store.pack_layer(0, &spec(5), &sources(&d)).unwrap_err();
    assert!(matches!(
        reason(e),
        Invalid::Mismatch {
            expected: 5,
            found: 4,
            ..
        }
    ));
    // A home outside the set (node ids, not indices: 63 is no node of the tests).
    let outside = Home::Node(numapin::Node(63));
    let bad = ExpertAssignment::new().layer(0, vec![first, outside]);
    let store = PinStore::new(Layout::SplitExperts(set), options().assignment(Some(bad))).unwrap();
    let d = data(2);
    let e = store.pack_layer(0, &spec(2), &sources(&d)).unwrap_err();
    assert!(matches!(
        reason(e),
        Invalid::BadValue {
            what: "assignment",
            ..
        }
    ));
}

/// On any machine (and degraded in the containers): the balanced split over the allowed
/// nodes reads every expert back as its source, through release and ensure too.
#[test]
fn a_balanced_split_reads_back_every_expert() {
    let set = nodes();
    let counts = [100u64, 90, 5, 5, 5, 5, 1, 1];
    let stats = RoutingStats::from_counts([(0, counts.to_vec()), (1, counts.to_vec())]).unwrap();
    let a = ExpertAssignment::balanced(&stats, &[(0, 8), (1, 8)], &set).unwrap();
    let store = PinStore::new(
        Layout::SplitExperts(set),
        options().assignment(Some(a.clone())),
    )
    .unwrap();
    let d = data(8);
    for layer in 0..2 {
        store.pack_layer(layer, &spec(8), &sources(&d)).unwrap();
    }
    for layer in 0..2 {
        for (e, w) in d.iter().enumerate() {
            assert_eq!(
                store.weights(layer, e).unwrap(),
                &w[..],
                "layer {layer} expert {e}"
            );
            assert_eq!(store.scales(layer, e).unwrap(), &w[..512]);
            assert_eq!(store.weights_local(layer, e).unwrap(), &w[..]);
            let Some(Home::Node(home)) = a.home(layer, e) else {
                panic!("layer {layer} expert {e}: no node home");
            };
            assert_eq!(store.home_node(layer, e).unwrap(), Some(home));
        }
    }
    let mut store = store;
    store.release(1, 6).unwrap();
    assert!(store.weights(1, 6).is_err());
    let s = sources(&d);
    store.ensure(1, 6, &s[6]).unwrap();
    assert_eq!(store.weights(1, 6).unwrap(), &d[6][..]);
    assert_eq!(store.weights(1, 7).unwrap(), &d[7][..]);
}

/// In the VM (2+ nodes; on the 1-node host this says it did not run): the two hot
/// experts land on different nodes, every expert's pages on its assigned home, one
/// `mbind` per node per region, and the report's bytes per node are the assigned
/// experts' bytes.
#[test]
fn balanced_experts_live_on_their_homes() {
    let Some(all) = need_nodes("balanced_experts_live_on_their_homes", 2) else {
        return;
    };
    let set: numapin::NodeSet = all.iter().take(2).collect();
    let counts = vec![100u64, 90, 5, 5, 5, 5, 1, 1];
    let stats = RoutingStats::from_counts([(0, counts)]).unwrap();
    let a = ExpertAssignment::balanced(&stats, &[(0, 8)], &set).unwrap();
    let homes: Vec<Home> = (0..8).map(|e| a.home(0, e).unwrap()).collect();
    assert_ne!(homes[0], homes[1], "the two hottest apart: {homes:?}");
    // By index, 0 and 1 would share node 0 (loads 190 against 12).
    let store = PinStore::new(Layout::SplitExperts(set), options().assignment(Some(a))).unwrap();
    let d = data(8);
    let report = store.pack_layer(0, &spec(8), &sources(&d)).unwrap();
    assert_eq!(report.mbind_calls, 4, "2 regions x 2 node blocks");
    let mut want = std::collections::BTreeMap::new();
    for (e, w) in d.iter().enumerate() {
        let Home::Node(home) = homes[e] else {
            panic!("expert {e} is hot: {homes:?}");
        };
        assert_eq!(store.home_node(0, e).unwrap(), Some(home));
        let weights = store.weights(0, e).unwrap();
        assert_eq!(weights, &w[..]);
        let h = pages_of(weights.as_ptr(), W);
        assert_eq!(h.on(home), W / numapin::page_size(), "expert {e}: {h:?}");
        let scales = pages_of(store.scales(0, e).unwrap().as_ptr(), 4096);
        assert_eq!(scales.on(home), 1, "expert {e} scales: {scales:?}");
        *want.entry(home).or_insert(0u64) += (W + 512) as u64;
    }
    assert_eq!(store.stats().unwrap().node_bytes, want);
}

/// A hybrid layer (the two hottest experts on every node, the rest balanced): every read
/// path returns the source's bytes, hot experts have no single home, release and ensure
/// restore every copy, and the per-node shares add up (counted here from the counts and
/// the assignment, not by the store).
#[test]
fn a_hybrid_layer_reads_back_every_expert() {
    let set = nodes();
    let counts = vec![100u64, 90, 5, 5, 5, 5, 1, 1];
    let stats = RoutingStats::from_counts([(0, counts.clone())]).unwrap();
    let a = ExpertAssignment::hybrid(&stats, &[(0, 8)], &set, 2).unwrap();
    let store = PinStore::new(
        Layout::SplitExperts(set),
        options().assignment(Some(a.clone())),
    )
    .unwrap();
    let d = data(8);
    store.pack_layer(0, &spec(8), &sources(&d)).unwrap();
    for (e, w) in d.iter().enumerate() {
        assert_eq!(store.weights(0, e).unwrap(), &w[..], "expert {e}");
        assert_eq!(store.weights_local(0, e).unwrap(), &w[..], "expert {e}");
        assert_eq!(store.scales_local(0, e).unwrap(), &w[..512]);
        for node in set.iter() {
            assert_eq!(store.weights_on(node, 0, e).unwrap(), &w[..]);
        }
        let home = store.home_node(0, e).unwrap();
        match a.home(0, e).unwrap() {
            Home::Hot => assert_eq!(home, None, "expert {e} is hot"),
            Home::Node(h) => assert_eq!(home, Some(h)),
        }
    }
    let shares = store.expert_shares(Some(&stats)).unwrap();
    let total: u64 = counts.iter().sum();
    for (node, share) in &shares {
        assert_eq!(share.hot_experts, 2);
        let cold: Vec<usize> = (0..8)
            .filter(|&e| a.home(0, e) == Some(Home::Node(*node)))
            .collect();
        assert_eq!(share.cold_experts, cold.len());
        let mine: u64 = cold.iter().map(|&e| counts[e]).sum();
        let want = (mine as f64 + 190.0 / set.len() as f64) / total as f64;
        assert!(
            (share.load_share - want).abs() < 1e-12,
            "{node:?}: {share:?}"
        );
    }
    assert_eq!(shares.values().map(|s| s.cold_experts).sum::<usize>(), 6);
    let mut store = store;
    for e in [0, 7] {
        store.release(0, e).unwrap();
        assert!(store.weights(0, e).is_err());
        let s = sources(&d);
        store.ensure(0, e, &s[e]).unwrap();
        for node in set.iter() {
            assert_eq!(store.weights_on(node, 0, e).unwrap(), &d[e][..]);
        }
    }
}

/// In the VM (2+ nodes; on the 1-node host this says it did not run): a hybrid layer
/// over 3 nodes (2 where only 2 are allowed) puts each hot expert's pages on every node,
/// each cold one on its home, costs kinds × (blocks + nodes − 1) `mbind`s, and reports per
/// node the hot bytes plus its cold experts' bytes.
#[test]
fn hybrid_hot_on_every_node_cold_on_their_homes() {
    let Some(all) = need_nodes("hybrid_hot_on_every_node_cold_on_their_homes", 2) else {
        return;
    };
    let set: numapin::NodeSet = all.iter().take(3).collect();
    let n = set.len();
    let counts = vec![100u64, 90, 5, 5, 5, 5, 1, 1, 1];
    let stats = RoutingStats::from_counts([(0, counts)]).unwrap();
    let a = ExpertAssignment::hybrid(&stats, &[(0, 9)], &set, 2).unwrap();
    let store = PinStore::new(
        Layout::SplitExperts(set),
        options().assignment(Some(a.clone())),
    )
    .unwrap();
    let d = data(9);
    let report = store.pack_layer(0, &spec(9), &sources(&d)).unwrap();
    assert_eq!(report.mbind_calls, 2 * (n + n - 1), "{report:?}");
    let slot = (W + 512) as u64;
    let mut want = std::collections::BTreeMap::new();
    for (e, w) in d.iter().enumerate() {
        match a.home(0, e).unwrap() {
            Home::Hot => {
                for node in set.iter() {
                    let copy = store.weights_on(node, 0, e).unwrap();
                    assert_eq!(copy, &w[..]);
                    let h = pages_of(copy.as_ptr(), W);
                    assert_eq!(
                        h.on(node),
                        W / numapin::page_size(),
                        "hot {e} on {node:?}: {h:?}"
                    );
                    *want.entry(node).or_insert(0u64) += slot;
                }
            }
            Home::Node(home) => {
                let h = pages_of(store.weights(0, e).unwrap().as_ptr(), W);
                assert_eq!(h.on(home), W / numapin::page_size(), "cold {e}: {h:?}");
                for node in set.iter() {
                    // Every node reads a cold expert from its home.
                    let p = store.weights_on(node, 0, e).unwrap().as_ptr();
                    assert_eq!(p, store.weights(0, e).unwrap().as_ptr());
                }
                *want.entry(home).or_insert(0u64) += slot;
            }
        }
    }
    assert_eq!(store.stats().unwrap().node_bytes, want);
    let shares = store.expert_shares(Some(&stats)).unwrap();
    for (node, bytes) in &want {
        assert_eq!(shares[node].bytes, *bytes);
    }
}

/// A hybrid layer that no node can hold (1 TiB, 4 hot experts one copy per domain) is
/// refused before anything is mapped, with `Error::NodeMemory` naming the nodes that
/// need as much as the first one short and, in its text, every node's need. On the
/// 1-node host the need is the whole layer; in the VM each node's block plus its share
/// of its domain's hot copy (counted here from the domains, not by the store). Where
/// placement is unavailable (containers) one unplaced copy would be built: not run.
#[test]
fn a_hybrid_layer_too_large_for_its_nodes_is_refused_before_anything_is_mapped() {
    let test = "a_hybrid_layer_too_large_for_its_nodes_is_refused_before_anything_is_mapped";
    if common::degrade_here().is_some() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOT RUN: {test}: placement is unavailable here, so no memory is asked of a node"
        );
        return;
    }
    let set = nodes();
    let (experts, gib) = (1usize << 10, 1u64 << 30);
    let huge = LayerSpec {
        experts,
        weight_bytes: 1 << 30,
        scale_bytes: 0,
    };
    // Experts 0-3 hot, the others split by index over the set.
    let cold = experts - 4;
    let ids: Vec<numapin::Node> = set.iter().collect();
    let homes: Vec<Home> = (0..experts)
        .map(|e| match e {
            0..4 => Home::Hot,
            _ => Home::Node(ids[(e - 4) * set.len() / cold]),
        })
        .collect();
    let a = ExpertAssignment::new()
        .layer(0, homes.clone())
        .hot_copies(HotCopies::PerDomain);
    let store = PinStore::new(Layout::SplitExperts(set), options().assignment(Some(a))).unwrap();
    let domains = numapin::topology::Topology::get()
        .unwrap()
        .domains_within(&set);
    let need = |node: numapin::Node| -> u64 {
        let mine = homes.iter().filter(|&&h| h == Home::Node(node)).count() as u64 * gib;
        let domain = domains.iter().find(|d| d.contains(node)).unwrap();
        mine + (4 * gib).div_ceil(domain.len() as u64)
    };
    let first = set.nth(0).unwrap();
    let empty: Vec<ExpertSource<'_>> = (0..experts)
        .map(|_| ExpertSource::Memory {
            weights: &[],
            scales: &[],
        })
        .collect();
    match store.pack_layer(0, &huge, &empty) {
        Err(Error::NodeMemory {
            what,
            needed,
            available,
            figure,
        }) => {
            if set.len() == 1 {
                assert_eq!(needed, experts as u64 * gib);
            }
            assert_eq!(needed, need(first), "{what}");
            let same: Vec<numapin::Node> = set.iter().filter(|&n| need(n) == needed).collect();
            let named: Vec<numapin::Node> = available.iter().map(|(n, _)| *n).collect();
            assert_eq!(named, same, "{what}");
            assert!(available.iter().all(|(_, free)| *free < needed));
            for node in set.iter() {
                let each = format!("{node}: {}", need(node));
                assert!(what.contains(&each), "{each} not in {what}");
            }
            assert!(figure.starts_with("MemFree + Inactive(file)"), "{figure}");
        }
        other => panic!("expected NodeMemory, got {other:?}"),
    }
    assert!(matches!(
        store.weights(0, 0),
        Err(Error::NotPacked { layer: 0, .. })
    ));
    // Nothing was mapped for it: no mapping of this process is a node's share of it.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let (start, end) = line
            .split_whitespace()
            .next()
            .unwrap()
            .split_once('-')
            .unwrap();
        let len = u64::from_str_radix(end, 16).unwrap() - u64::from_str_radix(start, 16).unwrap();
        assert!(
            len < 200 * gib,
            "a {len}-byte mapping after the refusal: {line}"
        );
    }
}

/// The map budget counts a hybrid layer's hot copies: over 4 nodes, hot experts on
/// every node need 2 kinds × 3 more mappings than the same layer split by index, and the
/// refusal comes before anything is mapped. The nodes are ids no machine of the tests
/// has: nothing is mapped or bound, and a node without meminfo is not asked for memory
/// (a real memoryless node would be refused first, with `Error::NodeMemory`).
#[test]
fn the_map_budget_counts_the_hot_copies() {
    let four = numapin::NodeSet::from_nodes([60, 61, 62, 63]).unwrap();
    let d = data(6);
    let needed = |a: Option<ExpertAssignment>| {
        let store = PinStore::new(
            Layout::SplitExperts(four),
            options().vma_budget(Some(1)).assignment(a),
        )
        .unwrap();
        match store.pack_layer(0, &spec(6), &sources(&d)) {
            Err(Error::MapBudget { needed, .. }) => {
                assert!(store.stats().unwrap().vmas == 0);
                needed
            }
            other => panic!("expected MapBudget, got {other:?}"),
        }
    };
    let (h, n) = (Home::Hot, |id: u16| Home::Node(numapin::Node(id)));
    let hybrid = ExpertAssignment::new().layer(0, vec![h, n(60), n(61), n(62), n(63), h]);
    let by_index = needed(None);
    assert_eq!(needed(Some(hybrid)), by_index + 2 * 3);
}
