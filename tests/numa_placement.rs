//! Real placement on a machine with several memory nodes (the 4-node VM of
//! `cargo xtask test-numa`: nodes 0-2 with memory, node 3 memoryless). On a one-node
//! host each test prints `NOT RUN` and passes without asserting; when
//! `NUMAPIN_TEST_NODES` promises a NUMA machine, a missing node is a failure.
//!
//! Every placement is checked with the kernel's own accounting twice: `move_pages`
//! (Region::placement) and `/proc/self/numa_maps`, which must agree.

mod common;

use common::{need_nodes, pages_of};
use numapin::store::{ExpertSource, Kind, LayerSpec, Layout, PinStore, StoreOptions};
use numapin::{Advice, Error, Node, NodeHistogram, NodeSet, Region, diag, policy};

use numapin::policy::{MbindFlags, MemPolicy, Observed};

const PAGES: usize = 3 * 1024;

fn page() -> usize {
    numapin::page_size()
}

fn histogram(r: &Region) -> NodeHistogram {
    match r.placement().unwrap() {
        Observed::Known(h) => h,
        Observed::Degraded(why) => panic!("placement degraded on a NUMA machine: {why}"),
    }
}

/// Pages per node of the mapping starting at `r` according to numa_maps, which must
/// agree with move_pages exactly. The region is kept unmergeable (DontDump) so its
/// numa_maps line is its own.
fn agreeing_histogram(r: &Region) -> NodeHistogram {
    let h = histogram(r);
    let entry = diag::numa_maps_at(r.as_ptr())
        .unwrap()
        .expect("numa_maps line for the region");
    let from_maps: Vec<(Node, u64)> = entry.pages.into_iter().collect();
    let from_move: Vec<(Node, u64)> = h.pages.iter().map(|(n, p)| (*n, *p as u64)).collect();
    assert_eq!(from_maps, from_move, "numa_maps and move_pages disagree");
    h
}

fn touched(policy: &MemPolicy) -> Region {
    let mut r = Region::anonymous_fenced(PAGES * page()).unwrap();
    r.advise(Advice::NoHugePage).unwrap();
    assert!(r.bind(policy, MbindFlags::empty()).unwrap().is_bound());
    r.as_mut_slice().unwrap().fill(1);
    r
}

/// Node `node`'s memory in MiB, from its `MemTotal` line in sysfs (read here, not by numapin).
fn node_total_mib(node: usize) -> usize {
    let path = format!("/sys/devices/system/node/node{node}/meminfo");
    let text = std::fs::read_to_string(&path).unwrap();
    let kib: usize = text
        .lines()
        .find(|l| l.contains("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no MemTotal in {path}: {text}"));
    kib >> 10
}

fn first_three(nodes: &NodeSet) -> NodeSet {
    nodes.iter().take(3).collect()
}

fn assert_even(h: &NodeHistogram, over: &NodeSet, what: &str) {
    let total: usize = h.present();
    let share = total as f64 / over.len() as f64;
    for n in over.iter() {
        let got = h.on(n) as f64;
        assert!(
            (got - share).abs() <= share * 0.05,
            "{what}: node {n} has {got} of {total} pages, not within 5% of {share:.0}: {h:?}"
        );
    }
    assert_eq!(
        h.pages.keys().filter(|n| !over.contains(**n)).count(),
        0,
        "{what}: pages off the set: {h:?}"
    );
}

#[test]
fn interleave_spreads_pages_evenly() {
    let Some(nodes) = need_nodes("interleave_spreads_pages_evenly", 3) else {
        return;
    };
    let set = first_three(&nodes);
    let r = touched(&MemPolicy::Interleave(set));
    let h = agreeing_histogram(&r);
    assert_eq!(h.present(), PAGES);
    assert_even(&h, &set, "interleave");
}

#[test]
fn bind_puts_every_page_on_the_node() {
    let Some(nodes) = need_nodes("bind_puts_every_page_on_the_node", 2) else {
        return;
    };
    let node = nodes.nth(1).unwrap();
    let r = touched(&MemPolicy::Bind(std::iter::once(node).collect()));
    let h = agreeing_histogram(&r);
    assert_eq!((h.on(node), h.present()), (PAGES, PAGES), "{h:?}");
}

#[test]
fn preferred_lands_on_the_node_while_it_has_room() {
    let Some(nodes) = need_nodes("preferred_lands_on_the_node_while_it_has_room", 3) else {
        return;
    };
    let node = nodes.nth(2).unwrap();
    let r = touched(&MemPolicy::Preferred(node));
    let h = agreeing_histogram(&r);
    assert_eq!(h.on(node), PAGES, "{h:?}");
}

#[test]
fn scoped_thread_policy_places_first_touch_and_restores() {
    let Some(nodes) = need_nodes("scoped_thread_policy_places_first_touch_and_restores", 2) else {
        return;
    };
    std::thread::spawn(move || {
        let node = nodes.nth(1).unwrap();
        let mut r = Region::anonymous_fenced(256 * page()).unwrap();
        {
            let guard = policy::scoped(&MemPolicy::Bind(std::iter::once(node).collect())).unwrap();
            assert!(guard.placement().is_bound());
            r.as_mut_slice().unwrap().fill(2);
        }
        assert_eq!(agreeing_histogram(&r).on(node), 256);
        assert_eq!(
            policy::thread_policy().unwrap(),
            Observed::Known((MemPolicy::Default, numapin::policy::ModeFlags::empty()))
        );
    })
    .join()
    .unwrap();
}

#[test]
fn memoryless_nodes_are_not_allowed_and_cannot_be_bound_alone() {
    let Some(nodes) = need_nodes(
        "memoryless_nodes_are_not_allowed_and_cannot_be_bound_alone",
        3,
    ) else {
        return;
    };
    let support = numapin::probe().unwrap();
    let memoryless = support
        .nodes_with_cpus
        .difference(&support.nodes_with_memory);
    let Some(node) = memoryless.iter().next() else {
        panic!("the test VM has a memoryless node; this machine has none: {support}");
    };
    assert!(!nodes.contains(node));
    let r = Region::anonymous(page()).unwrap();
    match r.bind(
        &MemPolicy::Bind(std::iter::once(node).collect()),
        MbindFlags::empty(),
    ) {
        Err(Error::NodeNotAllowed {
            node: n, allowed, ..
        }) => {
            assert_eq!(n, node);
            assert_eq!(*allowed, nodes);
        }
        other => panic!("binding to memoryless node {node} gave {other:?}"),
    }
    // Node strings resolve against the real topology.
    assert_eq!(NodeSet::parse("all").unwrap(), nodes);
    let first: NodeSet = std::iter::once(nodes.nth(0).unwrap()).collect();
    assert_eq!(NodeSet::parse("!0").unwrap(), nodes.difference(&first));
    assert_eq!(
        NodeSet::parse("+1").unwrap(),
        std::iter::once(nodes.nth(1).unwrap()).collect()
    );
    assert!(matches!(
        NodeSet::parse(&format!("+{}", nodes.len())),
        Err(Error::Parse { .. })
    ));
}

fn sources(data: &[Vec<u8>]) -> Vec<ExpertSource<'_>> {
    data.iter()
        .map(|w| ExpertSource::Memory {
            weights: w,
            scales: &w[..512],
        })
        .collect()
}

#[test]
fn pinstore_interleave_spreads_every_layer() {
    let Some(nodes) = need_nodes("pinstore_interleave_spreads_every_layer", 3) else {
        return;
    };
    let set = first_three(&nodes);
    let options = StoreOptions::default().huge_pages(false);
    let store = PinStore::new(Layout::Interleave(set), options).unwrap();
    let (experts, w) = (48, 64 * 1024);
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: 4096,
    };
    let data: Vec<Vec<u8>> = (0..experts).map(|e| vec![e as u8; w]).collect();
    for layer in 0..3 {
        store.pack_layer(layer, &spec, &sources(&data)).unwrap();
        // The weights slots are contiguous at the stride (64 KiB, page-aligned).
        let h = pages_of(store.weights(layer, 0).unwrap().as_ptr(), experts * w);
        assert_eq!(h.present(), experts * w / page());
        assert_even(&h, &set, &format!("layer {layer} weights"));
    }
}

#[test]
fn pinstore_layer_per_node_and_release_ensure_keep_placement() {
    let Some(nodes) = need_nodes(
        "pinstore_layer_per_node_and_release_ensure_keep_placement",
        3,
    ) else {
        return;
    };
    let set = first_three(&nodes);
    let options = StoreOptions::default().huge_pages(false);
    let mut store = PinStore::new(Layout::LayerPerNode(set), options).unwrap();
    let (experts, w) = (8, 64 * 1024);
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: 4096,
    };
    let data: Vec<Vec<u8>> = (0..experts).map(|e| vec![e as u8 + 1; w]).collect();
    for layer in 0..6 {
        store.pack_layer(layer, &spec, &sources(&data)).unwrap();
        let want = set.nth(layer % 3).unwrap();
        assert_eq!(
            store.slot_policy(layer, 0, Kind::Weights).unwrap(),
            Observed::Known((
                MemPolicy::Bind(std::iter::once(want).collect()),
                numapin::policy::ModeFlags::empty()
            ))
        );
    }
    for layer in 0..6 {
        let want = set.nth(layer % 3).unwrap();
        let h = pages_of(store.weights(layer, 0).unwrap().as_ptr(), experts * w);
        assert_eq!(h.on(want), experts * w / page(), "layer {layer}: {h:?}");
    }
    let before = store.stats().unwrap().pages_per_node;
    for layer in 0..6 {
        store.release(layer, 3).unwrap();
    }
    for layer in 0..6 {
        store.ensure(layer, 3, &sources(&data)[3]).unwrap();
        assert_eq!(store.weights(layer, 3).unwrap(), &data[3][..]);
    }
    assert_eq!(
        store.stats().unwrap().pages_per_node,
        before,
        "release + ensure moved pages"
    );
}

#[test]
fn interleaved_memfd_pages_spread_by_the_shared_policy() {
    let Some(nodes) = need_nodes("interleaved_memfd_pages_spread_by_the_shared_policy", 3) else {
        return;
    };
    let set = first_three(&nodes);
    let mut r = Region::memfd("numapin-interleave", PAGES * page()).unwrap();
    assert!(
        r.bind(&MemPolicy::Interleave(set), MbindFlags::empty())
            .unwrap()
            .is_bound()
    );
    r.as_mut_slice().unwrap().fill(4);
    let h = agreeing_histogram(&r);
    assert_eq!(h.present(), PAGES);
    assert_even(&h, &set, "memfd interleave");
}

/// Runs `f` on a new thread allowed only on `cpu`.
fn on_cpu<T: Send>(cpu: usize, f: impl FnOnce() -> T + Send) -> T {
    use rustix::thread::{CpuSet, sched_setaffinity};
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut one = CpuSet::new();
            one.set(cpu);
            sched_setaffinity(None, &one).unwrap();
            assert_eq!(numapin::topology::current_cpu(), cpu);
            f()
        })
        .join()
        .unwrap()
    })
}

/// The node of the page at `ptr` (move_pages).
fn node_of(ptr: *const u8) -> Node {
    let h = pages_of(ptr, page());
    assert_eq!(h.present(), 1, "{h:?}");
    *h.pages.keys().next().unwrap()
}

fn replica_options(threads: usize) -> StoreOptions {
    StoreOptions::default()
        .huge_pages(false)
        .loader_threads(threads)
}

#[test]
fn replicate_puts_each_replica_on_its_node_and_local_reads_are_local() {
    let Some(nodes) = need_nodes(
        "replicate_puts_each_replica_on_its_node_and_local_reads_are_local",
        3,
    ) else {
        return;
    };
    let set = first_three(&nodes);
    let topology = numapin::topology::Topology::get().unwrap();
    // The VM's distances: node 3 (memoryless, CPU 3) is nearest to node 2.
    assert_eq!(
        topology.distance(Node(3), Node(2)),
        Some(15),
        "{topology:?}"
    );
    assert_eq!(
        topology.distance(Node(3), Node(0)),
        Some(30),
        "{topology:?}"
    );
    let mut store = PinStore::new(Layout::Replicate(set), replica_options(3)).unwrap();
    let (experts, w) = (8, 64 * 1024);
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: 4096,
    };
    let data: Vec<Vec<u8>> = (0..experts).map(|e| vec![e as u8 + 7; w]).collect();
    let bytes = (experts * (w + 512)) as u64;
    for layer in 0..2 {
        let report = store.pack_layer(layer, &spec, &sources(&data)).unwrap();
        assert_eq!(report.replicas, 3);
        assert_eq!(report.bytes, bytes);
        assert_eq!(
            report.local_bytes,
            3 * bytes,
            "every copy written on its node"
        );
        assert_eq!(report.mbind_calls, 6);
    }
    let check_replicas = |store: &PinStore, when: &str| {
        for layer in 0..2 {
            for node in set.iter() {
                let h = pages_of(
                    store.weights_on(node, layer, 0).unwrap().as_ptr(),
                    experts * w,
                );
                assert_eq!(
                    h.on(node),
                    experts * w / page(),
                    "{when} layer {layer}: {h:?}"
                );
                let s = pages_of(
                    store.scales_on(node, layer, 0).unwrap().as_ptr(),
                    experts * page(),
                );
                assert_eq!(s.on(node), experts, "{when} layer {layer} scales: {s:?}");
                for (e, d) in data.iter().enumerate() {
                    assert_eq!(store.weights_on(node, layer, e).unwrap(), &d[..]);
                    assert_eq!(store.scales_on(node, layer, e).unwrap(), &d[..512]);
                }
            }
        }
    };
    check_replicas(&store, "packed");
    let stats = store.stats().unwrap();
    assert_eq!(stats.bytes, 2 * 3 * bytes);
    for node in set.iter() {
        assert_eq!(stats.node_bytes.get(&node), Some(&(2 * bytes)), "{stats:?}");
    }
    // A thread on CPU k (node k) reads node k's replica; CPU 3 (node 3, memoryless)
    // the nearest by distance, node 2, not the first.
    let store_ref = &store;
    for (cpu, want) in [(0, Node(0)), (1, Node(1)), (2, Node(2)), (3, Node(2))] {
        let ptr = on_cpu(cpu, || {
            store_ref.weights_local(1, 5).unwrap().as_ptr() as usize
        });
        assert_eq!(node_of(ptr as *const u8), want, "cpu {cpu}");
        assert_eq!(
            ptr,
            store.weights_on(want, 1, 5).unwrap().as_ptr() as usize,
            "cpu {cpu}"
        );
    }
    for layer in 0..2 {
        store.release(layer, 3).unwrap();
        store.ensure(layer, 3, &sources(&data)[3]).unwrap();
    }
    check_replicas(&store, "after release + ensure");
}

#[test]
fn split_experts_blocks_land_on_their_home_nodes() {
    let Some(nodes) = need_nodes("split_experts_blocks_land_on_their_home_nodes", 3) else {
        return;
    };
    let set = first_three(&nodes);
    let store = PinStore::new(Layout::SplitExperts(set), replica_options(3)).unwrap();
    let (experts, w) = (16, 64 * 1024);
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: 4096,
    };
    let data: Vec<Vec<u8>> = (0..experts).map(|e| vec![e as u8 + 1; w]).collect();
    let report = store.pack_layer(0, &spec, &sources(&data)).unwrap();
    assert_eq!(report.mbind_calls, 6);
    assert_eq!(report.local_bytes, report.bytes);
    let mut per_node = std::collections::BTreeMap::new();
    for (e, d) in data.iter().enumerate() {
        let home = store.home_node(0, e).unwrap().unwrap();
        assert_eq!(home, set.nth(e * 3 / experts).unwrap());
        let weights = store.weights(0, e).unwrap();
        assert_eq!(weights, &d[..]);
        let h = pages_of(weights.as_ptr(), w);
        assert_eq!(h.on(home), w / page(), "expert {e}: {h:?}");
        assert_eq!(node_of(store.scales(0, e).unwrap().as_ptr()), home);
        *per_node.entry(home).or_insert(0) += 1;
    }
    // 16 experts over 3 nodes: blocks of 6, 5, 5.
    assert_eq!(per_node.into_values().collect::<Vec<_>>(), vec![6, 5, 5]);
}

#[test]
fn loaders_move_to_the_target_node_or_say_they_could_not() {
    let Some(nodes) = need_nodes("loaders_move_to_the_target_node_or_say_they_could_not", 3) else {
        return;
    };
    let set = first_three(&nodes);
    let (experts, w) = (8, 64 * 1024);
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: 4096,
    };
    let data: Vec<Vec<u8>> = (0..experts).map(|e| vec![e as u8; w]).collect();
    let bytes = (experts * (w + 512)) as u64;
    // Three loaders filling layer 1 (bound to node 1) all run on node 1's CPU; the
    // calling thread gets its whole affinity back.
    let store = PinStore::new(Layout::LayerPerNode(set), replica_options(3)).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let before = rustix::thread::sched_getaffinity(None).unwrap();
            store.pack_layer(0, &spec, &sources(&data)).unwrap();
            let report = store.pack_layer(1, &spec, &sources(&data)).unwrap();
            assert_eq!(report.local_bytes, bytes);
            assert_eq!(report.off_node_loaders, 0);
            assert_eq!(rustix::thread::sched_getaffinity(None).unwrap(), before);
        });
    });
    // One loader, allowed on CPU 0 only, filling node 1: no CPU of node 1 is allowed, so
    // it loads from node 0 and says so.
    let store = PinStore::new(Layout::LayerPerNode(set), replica_options(1)).unwrap();
    on_cpu(0, || {
        store.pack_layer(0, &spec, &sources(&data)).unwrap();
        let report = store.pack_layer(1, &spec, &sources(&data)).unwrap();
        assert_eq!(report.local_bytes, 0);
        assert_eq!(report.off_node_loaders, 1);
        let h = pages_of(store.weights(1, 0).unwrap().as_ptr(), experts * w);
        assert_eq!(h.on(Node(1)), experts * w / page(), "still bound: {h:?}");
    });
}

#[test]
fn replicas_and_blocks_are_refused_by_memory_and_map_budget_with_their_figures() {
    let Some(nodes) = need_nodes(
        "replicas_and_blocks_are_refused_by_memory_and_map_budget_with_their_figures",
        3,
    ) else {
        return;
    };
    // Alone: the map budget is 50 above the count read here and the check reads the count
    // again, so the other tests' stores and loader threads (mapped meanwhile) must not
    // eat the 30 mappings of margin the fitting check has.
    if !common::alone("replicas_and_blocks_are_refused_by_memory_and_map_budget_with_their_figures")
    {
        return;
    }
    let set = first_three(&nodes);
    let store = PinStore::new(Layout::Replicate(set), replica_options(1)).unwrap();
    // A copy 88 MiB larger than the largest of the three nodes (the kernel's MemTotal).
    let largest_mib = (0..3).map(node_total_mib).max().unwrap();
    let big = LayerSpec {
        experts: largest_mib + 88,
        weight_bytes: 1 << 20,
        scale_bytes: 0,
    };
    match store.check_model_memory(1, &big) {
        Err(Error::NodeMemory {
            needed, available, ..
        }) => {
            assert_eq!(needed, ((largest_mib + 88) as u64) << 20);
            assert_eq!(
                available.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
                vec![Node(0), Node(1), Node(2)]
            );
            assert!(
                available
                    .iter()
                    .all(|(_, b)| *b < (largest_mib as u64) << 20),
                "{available:?}"
            );
        }
        other => panic!("expected NodeMemory: {other:?}"),
    }
    let small = LayerSpec {
        experts: 16,
        weight_bytes: 1 << 20,
        scale_bytes: 4096,
    };
    store.check_model_memory(1, &small).unwrap();
    // Map budget: 2 regions × 3 copies (Replicate) or × 3 blocks (SplitExperts) per layer.
    for layout in [Layout::Replicate(set), Layout::SplitExperts(set)] {
        let options = replica_options(1).vma_budget(Some(diag::map_count().unwrap() + 50));
        let store = PinStore::new(layout, options).unwrap();
        match store.check_model_budget(20, &small) {
            Err(Error::MapBudget { needed, .. }) => assert_eq!(needed, 20 * 2 * 3 + 2),
            other => panic!("{layout:?}: expected MapBudget: {other:?}"),
        }
        store.check_model_budget(3, &small).unwrap();
    }
}
