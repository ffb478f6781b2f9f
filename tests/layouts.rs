//! `Layout::Replicate` and `Layout::SplitExperts` in every environment: over the nodes
//! this process may use (one on the host, three in the VM), bound where placement works
//! and degraded to one unplaced copy where it is denied or unsupported. What the replicas
//! hold, which copy `weights_local` answers from, where `home_node` says an expert lives,
//! the memory check before replicas are built, and that loaders give the calling thread
//! its affinity back. Placement itself (pages on nodes) is checked in numa_placement.rs.

mod common;

use common::memory_sources;
use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, StoreOptions};
use numapin::{Error, Node, NodeSet};

const EXPERTS: usize = 16;
const WEIGHT_BYTES: usize = 3 * 4096 + 100;
const SCALE_BYTES: usize = 200;

/// Distinct bytes per layer, expert and tensor.
fn model(layer: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..EXPERTS)
        .map(|e| {
            let w: Vec<u8> = (0..WEIGHT_BYTES)
                .map(|i| (i * 7 + e * 13 + layer * 29) as u8)
                .collect();
            let s: Vec<u8> = (0..SCALE_BYTES)
                .map(|i| (i * 3 + e * 5 + layer) as u8 ^ 0x5a)
                .collect();
            (w, s)
        })
        .collect()
}

fn spec() -> LayerSpec {
    LayerSpec {
        experts: EXPERTS,
        weight_bytes: WEIGHT_BYTES,
        scale_bytes: SCALE_BYTES,
    }
}

fn options(threads: usize) -> StoreOptions {
    StoreOptions::default()
        .huge_pages(false)
        .loader_threads(threads)
}

fn model_bytes() -> u64 {
    (EXPERTS * (WEIGHT_BYTES + SCALE_BYTES)) as u64
}

/// Where placement works, every node of the set holds a copy.
fn bound_here() -> bool {
    common::degrade_here().is_none()
}

/// A sysfs CPU or node list (`0-3,8`), as the kernel prints it.
fn parse_list(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        out.extend(a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap());
    }
    out
}

/// The node whose CPUs should fill `node`, worked out here from sysfs (not through the
/// library's topology): `node` itself when it has CPUs; for a node without any (a
/// memory-only CXL node in the VM's second boot), the nearest
/// node that has one, by `node`'s `distance` row (whose columns are the online nodes in
/// order), ties to the lower id. Without NUMA sysfs, `node`.
fn filler(node: Node) -> Node {
    let allowed = rustix::thread::sched_getaffinity(None).unwrap();
    let sys = std::path::Path::new("/sys/devices/system/node");
    let Ok(online) = std::fs::read_to_string(sys.join("online")) else {
        return node;
    };
    let online = parse_list(&online);
    let read = |n: usize, file: &str| {
        std::fs::read_to_string(sys.join(format!("node{n}/{file}"))).unwrap_or_default()
    };
    let usable: Vec<usize> = online
        .iter()
        .copied()
        .filter(|&n| {
            parse_list(&read(n, "cpulist"))
                .into_iter()
                .any(|cpu| cpu < rustix::thread::CpuSet::MAX_CPU && allowed.is_set(cpu))
        })
        .collect();
    if usable.contains(&node.index()) || !read(node.index(), "cpulist").trim().is_empty() {
        return node;
    }
    let row: Vec<u32> = read(node.index(), "distance")
        .split_whitespace()
        .map(|d| d.parse().unwrap())
        .collect();
    let column = |n: usize| online.iter().position(|&m| m == n).unwrap();
    let nearest = usable
        .into_iter()
        .min_by_key(|&n| (row[column(n)], n))
        .expect("no node with an allowed CPU");
    Node(u16::try_from(nearest).unwrap())
}

/// The distinct nodes whose CPUs fill `nodes` ([`filler`]), sorted.
fn fillers(nodes: impl IntoIterator<Item = Node>) -> Vec<Node> {
    let set: std::collections::BTreeSet<Node> = nodes.into_iter().map(filler).collect();
    set.into_iter().collect()
}

#[test]
fn replicate_puts_a_full_copy_on_every_node_and_local_reads_find_one() {
    let set = common::nodes();
    let store = PinStore::new(Layout::Replicate(set), options(3)).unwrap();
    let layers = [model(0), model(1)];
    let copies = if bound_here() { set.len() } else { 1 };
    for (layer, data) in layers.iter().enumerate() {
        let report = store
            .pack_layer(layer, &spec(), &memory_sources(data))
            .unwrap();
        assert_eq!(report.replicas, copies);
        assert_eq!(report.regions, 2 * copies);
        assert_eq!(report.bytes, model_bytes());
        // Every copy written by a loader on its node (the file's read and each copy), or
        // for a node without CPUs on the nearest node with some.
        assert_eq!(report.local_bytes, model_bytes() * copies as u64);
        assert_eq!(report.off_node_loaders, 0);
        assert_eq!(report.loader_nodes, fillers(set.iter().take(copies)));
        assert_eq!(report.mbind_calls, 2 * copies);
    }
    assert_eq!(store.degraded(), common::degrade_here());
    for (layer, data) in layers.iter().enumerate() {
        let expected_nodes = if bound_here() { set } else { NodeSet::new() };
        assert_eq!(store.replica_nodes(layer).unwrap(), expected_nodes);
        for (e, (w, s)) in data.iter().enumerate() {
            assert_eq!(store.weights_local(layer, e).unwrap(), &w[..]);
            assert_eq!(store.scales_local(layer, e).unwrap(), &s[..]);
            assert_eq!(store.weights(layer, e).unwrap(), &w[..]);
            for node in set.iter() {
                assert_eq!(store.weights_on(node, layer, e).unwrap(), &w[..]);
                assert_eq!(store.scales_on(node, layer, e).unwrap(), &s[..]);
            }
            assert_eq!(store.home_node(layer, e).unwrap(), None);
        }
    }
    // Replicas are distinct memory where there are several.
    if copies > 1 {
        let nodes: Vec<Node> = set.iter().collect();
        let a = store.weights_on(nodes[0], 0, 0).unwrap().as_ptr();
        let b = store.weights_on(nodes[1], 0, 0).unwrap().as_ptr();
        assert_ne!(a, b);
    }
    let stats = store.stats().unwrap();
    assert_eq!(stats.bytes, 2 * model_bytes() * copies as u64);
    assert_eq!(stats.experts_loaded, 2 * EXPERTS);
    let per_node: Vec<(Node, u64)> = stats.node_bytes.into_iter().collect();
    let expected: Vec<(Node, u64)> = set
        .iter()
        .take(copies)
        .map(|n| (n, 2 * model_bytes()))
        .collect();
    assert_eq!(per_node, expected);
}

#[test]
fn replicate_release_and_ensure_act_on_every_replica() {
    let set = common::nodes();
    let mut store = PinStore::new(Layout::Replicate(set), options(2)).unwrap();
    let data = model(0);
    store
        .pack_layer(0, &spec(), &memory_sources(&data))
        .unwrap();
    store.release(0, 5).unwrap();
    for node in set.iter() {
        assert!(matches!(
            store.weights_on(node, 0, 5),
            Err(Error::Released { expert: 5, .. })
        ));
        assert!(matches!(
            store.scales_on(node, 0, 5),
            Err(Error::Released { expert: 5, .. })
        ));
    }
    assert!(matches!(
        store.weights_local(0, 5),
        Err(Error::Released { .. })
    ));
    assert_eq!(store.weights_local(0, 4).unwrap(), &data[4].0[..]);
    let copies = if bound_here() { set.len() } else { 1 } as u64;
    let one = (WEIGHT_BYTES + SCALE_BYTES) as u64;
    assert_eq!(store.stats().unwrap().bytes, (model_bytes() - one) * copies);
    let srcs = memory_sources(&data);
    store.ensure(0, 5, &srcs[5]).unwrap();
    for node in set.iter() {
        assert_eq!(store.weights_on(node, 0, 5).unwrap(), &data[5].0[..]);
        assert_eq!(store.scales_on(node, 0, 5).unwrap(), &data[5].1[..]);
    }
    assert_eq!(store.stats().unwrap().bytes, model_bytes() * copies);
}

#[test]
fn split_experts_puts_contiguous_blocks_on_the_nodes_in_order() {
    let set = common::nodes();
    let n = set.len();
    let store = PinStore::new(Layout::SplitExperts(set), options(3)).unwrap();
    let data = model(0);
    let report = store
        .pack_layer(0, &spec(), &memory_sources(&data))
        .unwrap();
    let blocks = n.min(EXPERTS);
    // One mbind per block per region, whether it took or degraded.
    assert_eq!(report.mbind_calls, 2 * blocks);
    assert_eq!(report.regions, 2);
    assert_eq!(report.replicas, 1);
    assert_eq!(report.policy, None);
    assert_eq!(report.local_bytes, model_bytes());
    assert_eq!(report.off_node_loaders, 0);
    // A loader on each block's node, or the nearest node with CPUs for one without.
    let homes = (0..EXPERTS).map(|e| set.nth(e * n / EXPERTS).unwrap());
    assert_eq!(report.loader_nodes, fillers(homes));
    assert_eq!(store.degraded(), common::degrade_here());
    let mut per_node = std::collections::BTreeMap::new();
    for (e, (w, s)) in data.iter().enumerate() {
        let home = set.nth(e * n / EXPERTS).unwrap();
        assert_eq!(store.home_node(0, e).unwrap(), Some(home), "expert {e}");
        assert_eq!(store.weights(0, e).unwrap(), &w[..]);
        assert_eq!(store.weights_local(0, e).unwrap(), &w[..]);
        *per_node.entry(home).or_insert(0u64) += (w.len() + s.len()) as u64;
    }
    assert!(matches!(
        store.home_node(0, EXPERTS),
        Err(Error::OutOfRange { index: EXPERTS, .. })
    ));
    assert_eq!(store.stats().unwrap().node_bytes, per_node);
}

#[test]
fn layer_per_node_loaders_write_on_the_layers_node() {
    let set = common::nodes();
    let store = PinStore::new(Layout::LayerPerNode(set), options(3)).unwrap();
    for layer in 0..set.len() {
        let data = model(layer);
        let report = store
            .pack_layer(layer, &spec(), &memory_sources(&data))
            .unwrap();
        assert_eq!(report.local_bytes, model_bytes(), "layer {layer}");
        // Its loaders ran on its node, or the nearest one with CPUs if it has none.
        let node = set.nth(layer % set.len()).unwrap();
        assert_eq!(report.loader_nodes, vec![filler(node)], "layer {layer}");
        assert_eq!(
            store.home_node(layer, 3).unwrap(),
            set.nth(layer % set.len())
        );
    }
    // Interleave binds to no single node: nothing counts as local.
    let store = PinStore::new(Layout::Interleave(set), options(3)).unwrap();
    let report = store
        .pack_layer(0, &spec(), &memory_sources(&model(0)))
        .unwrap();
    assert_eq!(report.local_bytes, 0);
    assert_eq!(store.home_node(0, 0).unwrap(), None);
}

/// A loader moves the calling thread onto the target node's CPUs and back: afterwards the
/// thread's affinity is exactly what it was (here: one CPU of the layer's node).
#[test]
fn loaders_give_the_calling_thread_its_affinity_back() {
    use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};
    std::thread::spawn(|| {
        let set = common::nodes();
        let first = set.nth(0).unwrap();
        let topology = numapin::topology::Topology::get().unwrap();
        let allowed = sched_getaffinity(None).unwrap();
        let Some(cpu) = topology
            .cpus_of(first)
            .into_iter()
            .find(|&c| allowed.is_set(c))
        else {
            panic!("no allowed CPU on node {first}: {topology:?}");
        };
        let mut one = CpuSet::new();
        one.set(cpu);
        sched_setaffinity(None, &one).unwrap();
        // One loader thread: the calling thread loads everything itself.
        let store = PinStore::new(Layout::LayerPerNode(set), options(1)).unwrap();
        let report = store
            .pack_layer(0, &spec(), &memory_sources(&model(0)))
            .unwrap();
        assert_eq!(report.local_bytes, model_bytes());
        assert_eq!(report.off_node_loaders, 0);
        let after = sched_getaffinity(None).unwrap();
        assert_eq!(after.count(), 1);
        assert!(after.is_set(cpu));
        assert_eq!(numapin::topology::current_cpu(), cpu);
    })
    .join()
    .unwrap();
}

#[test]
fn replicas_that_cannot_fit_are_refused_up_front_with_each_nodes_figure() {
    let set = common::nodes();
    let store = PinStore::new(Layout::Replicate(set), StoreOptions::default()).unwrap();
    // 1 TiB per layer copy: more than any node here has.
    let huge = LayerSpec {
        experts: 1 << 10,
        weight_bytes: 1 << 30,
        scale_bytes: 0,
    };
    let per_layer = (1u64 << 10) * (1 << 30);
    let result = store.check_model_memory(3, &huge);
    let pack = {
        let empty: Vec<ExpertSource<'_>> = (0..huge.experts)
            .map(|_| ExpertSource::Memory {
                weights: &[],
                scales: &[],
            })
            .collect();
        store.pack_layer(0, &huge, &empty).map(|_| ())
    };
    if !bound_here() {
        // One unplaced copy is built where placement is unavailable: nothing to check.
        assert!(result.is_ok(), "{result:?}");
        return;
    }
    match result {
        Err(Error::NodeMemory {
            needed,
            available,
            figure,
            ..
        }) => {
            assert_eq!(needed, 3 * per_layer);
            let nodes: Vec<Node> = available.iter().map(|(n, _)| *n).collect();
            assert_eq!(nodes, set.iter().collect::<Vec<_>>());
            assert!(available.iter().all(|(_, free)| *free < needed));
            assert!(figure.starts_with("MemFree + Inactive(file)"), "{figure}");
        }
        other => panic!("expected NodeMemory, got {other:?}"),
    }
    match pack {
        Err(Error::NodeMemory { needed, .. }) => assert_eq!(needed, per_layer),
        other => panic!("expected NodeMemory, got {other:?}"),
    }
    assert!(matches!(
        store.weights(0, 0),
        Err(Error::NotPacked { layer: 0, .. })
    ));
}

#[test]
fn replicated_shared_stores_export_only_whole_and_empty_sets_are_refused() {
    let set = common::nodes();
    let shared = StoreOptions::default().shared(true);
    // A replicated shared store packs; its replicas export only through
    // PlacedModel::export (the store manifest has no place for them).
    let mut store = PinStore::new(Layout::Replicate(set), shared).unwrap();
    let w = vec![5u8; 5000];
    let source = ExpertSource::Memory {
        weights: &w,
        scales: &[],
    };
    let spec = LayerSpec {
        experts: 1,
        weight_bytes: 5000,
        scale_bytes: 0,
    };
    store
        .pack_layer(0, &spec, std::slice::from_ref(&source))
        .unwrap();
    if store.replica_nodes(0).unwrap().is_empty() {
        store.export().unwrap(); // placement denied: one unplaced copy
    } else {
        let e = store.export().unwrap_err().to_string();
        assert!(e.contains("PlacedModel::export"), "{e}");
    }
    for layout in [
        Layout::Replicate(NodeSet::new()),
        Layout::SplitExperts(NodeSet::new()),
    ] {
        assert!(matches!(
            PinStore::new(layout, StoreOptions::default()),
            Err(Error::InvalidArgument { .. })
        ));
    }
}

/// Interleaved memory has no single node: the loaders are spread one per node instead
/// (loader w on the w-th node of the set), and the calling thread gets its affinity back.
#[test]
fn interleave_spreads_its_loaders_over_the_nodes_and_gives_the_affinity_back() {
    use rustix::thread::sched_getaffinity;
    std::thread::spawn(|| {
        let set = common::nodes();
        let before = sched_getaffinity(None).unwrap();
        let store = PinStore::new(Layout::Interleave(set), options(set.len())).unwrap();
        let data = model(0);
        let report = store
            .pack_layer(0, &spec(), &memory_sources(&data))
            .unwrap();
        if bound_here() {
            // One per node; a node without CPUs gets its loader on the nearest node with
            // some (which also has its own).
            assert_eq!(report.loader_nodes, fillers(set.iter()));
        } else {
            // Placement degraded: nothing to be near, the loaders stay put.
            assert!(report.loader_nodes.is_empty(), "{report:?}");
        }
        assert_eq!(report.local_bytes, 0);
        assert_eq!(sched_getaffinity(None).unwrap(), before);
        for (e, (w, s)) in data.iter().enumerate() {
            assert_eq!(store.weights(0, e).unwrap(), &w[..]);
            assert_eq!(store.scales(0, e).unwrap(), &s[..]);
        }
        // The other layouts' loaders follow the node they fill instead.
        let store = PinStore::new(Layout::LayerPerNode(set), options(set.len())).unwrap();
        let report = store
            .pack_layer(0, &spec(), &memory_sources(&data))
            .unwrap();
        assert_eq!(report.loader_nodes, vec![filler(set.nth(0).unwrap())]);
    })
    .join()
    .unwrap();
}

#[test]
fn replicate_domains_makes_a_copy_per_domain_and_local_reads_find_it() {
    // One copy per domain of the machine among the allowed nodes (one domain on the host;
    // every socket in the VMs). Where each copy's pages land is numa_placement.rs's and
    // domains.rs's business; here: the copies, the reads and the figures.
    let set = common::nodes();
    let topology = numapin::topology::Topology::get().unwrap();
    let domains = topology.domains_within(&set);
    let store = PinStore::new(Layout::ReplicateDomains(set), options(2)).unwrap();
    assert_eq!(store.copy_groups(), &domains[..]);
    let copies = if bound_here() { domains.len() } else { 1 };
    let data = model(0);
    let report = store
        .pack_layer(0, &spec(), &memory_sources(&data))
        .unwrap();
    assert_eq!(report.replicas, copies);
    assert_eq!(report.regions, 2 * copies);
    assert_eq!(report.mbind_calls, 2 * copies);
    assert_eq!(store.degraded(), common::degrade_here());
    let leads: NodeSet = domains.iter().filter_map(|d| d.nth(0)).collect();
    let expected_leads = if bound_here() { leads } else { NodeSet::new() };
    assert_eq!(store.replica_nodes(0).unwrap(), expected_leads);
    // The thread stays on the CPU it runs on now: the domain it reads locally is the one
    // sampled here (unpinned, it migrated between the two on the VM's four nodes).
    let before = rustix::thread::sched_getaffinity(None).unwrap();
    let mut one = rustix::thread::CpuSet::new();
    one.set(numapin::topology::current_cpu());
    rustix::thread::sched_setaffinity(None, &one).unwrap();
    let here = numapin::topology::current_domain().unwrap();
    for (e, (w, s)) in data.iter().enumerate() {
        assert_eq!(store.weights_local(0, e).unwrap(), &w[..]);
        assert_eq!(store.scales_local(0, e).unwrap(), &s[..]);
        for node in set.iter() {
            assert_eq!(store.weights_on(node, 0, e).unwrap(), &w[..]);
        }
        assert_eq!(store.home_node(0, e).unwrap(), None);
    }
    // Nodes of one domain read the same copy; the calling thread its domain's.
    for domain in &domains {
        let first = store
            .weights_on(domain.nth(0).unwrap(), 0, 3)
            .unwrap()
            .as_ptr();
        for node in domain.iter() {
            assert_eq!(store.weights_on(node, 0, 3).unwrap().as_ptr(), first);
        }
        if bound_here() && domain.iter().any(|n| here.nodes().contains(n)) {
            assert_eq!(store.weights_local(0, 3).unwrap().as_ptr(), first);
        }
    }
    rustix::thread::sched_setaffinity(None, &before).unwrap();
    let stats = store.stats().unwrap();
    assert_eq!(stats.bytes, model_bytes() * copies as u64);
    // Each copy's bytes split evenly over its domain's nodes (the remainder on the
    // lowest), as an interleaved copy's pages are.
    if bound_here() {
        let mut expected = std::collections::BTreeMap::new();
        for domain in &domains {
            let n = domain.len() as u64;
            for (i, node) in domain.iter().enumerate() {
                let share = model_bytes() / n + u64::from((i as u64) < model_bytes() % n);
                expected.insert(node, share);
            }
        }
        assert_eq!(stats.node_bytes, expected);
    }
    // Shared replicas are made (and export through PlacedModel::export), as for Replicate.
    let shared = StoreOptions::default().shared(true);
    assert!(PinStore::new(Layout::ReplicateDomains(set), shared).is_ok());
}

#[test]
fn replicate_domains_asks_each_node_for_its_share_of_a_copy() {
    let set = common::nodes();
    let topology = numapin::topology::Topology::get().unwrap();
    let domains = topology.domains_within(&set);
    let store = PinStore::new(Layout::ReplicateDomains(set), StoreOptions::default()).unwrap();
    // 1 TiB per layer copy: more than any domain here has.
    let huge = LayerSpec {
        experts: 1 << 10,
        weight_bytes: 1 << 30,
        scale_bytes: 0,
    };
    let result = store.check_model_memory(3, &huge);
    if !bound_here() {
        assert!(result.is_ok(), "{result:?}");
        return;
    }
    let copy = 3 * (1u64 << 10) * (1 << 30);
    match result {
        Err(Error::NodeMemory {
            needed, available, ..
        }) => {
            // The first domain short of its share is the first domain (each is short).
            let first = domains[0];
            assert_eq!(needed, copy.div_ceil(first.len() as u64));
            let nodes: NodeSet = available.iter().map(|(n, _)| *n).collect();
            let same_share: NodeSet = domains
                .iter()
                .filter(|d| d.len() == first.len())
                .fold(NodeSet::new(), |all, d| all.union(d));
            assert_eq!(nodes, same_share);
        }
        other => panic!("expected NodeMemory, got {other:?}"),
    }
}
