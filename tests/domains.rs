//! Domains (sockets) and `Layout::ReplicateDomains` on machines that have several: the
//! VMs of `cargo xtask test-numa`. The second boot (`NUMAPIN_VM_SHAPE=sockets`) is two
//! sockets: nodes 0 and 1 on socket 0 (sub-NUMA clusters, CPUs 0 and 1), node 2 on
//! socket 1 (CPUs 2 and 3), and node 3, memory without CPUs, nearest node 2 by distance
//! (CXL-like); its domains are {0,1} and {2,3}. The first boot (four one-CPU sockets)
//! has one domain per node. On a one-node host each test prints `NOT RUN` and passes
//! without asserting; when `NUMAPIN_TEST_NODES` promises a NUMA machine, a missing node
//! is a failure.
//!
//! Placement is read from the kernel (`move_pages` on each page), not from the store.

mod common;

use common::{need_nodes, pages_of};
use numapin::routing::RoutingStats;
use numapin::store::{
    ExpertAssignment, ExpertSource, Home, HotCopies, LayerSpec, Layout, PinStore, StoreOptions,
};
use numapin::topology::{Domain, Topology};
use numapin::{Node, NodeHistogram, NodeSet};

fn page() -> usize {
    numapin::page_size()
}

/// The VM shape the xtask booted (`sockets` for the second boot), if any.
fn vm_shape() -> Option<String> {
    std::env::var("NUMAPIN_VM_SHAPE").ok()
}

fn set(ids: &[usize]) -> NodeSet {
    NodeSet::from_nodes(ids.iter().copied()).unwrap()
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

/// Every page present, on the nodes of `over` only, and interleaved: each node holds
/// its equal share, give or take one page.
fn assert_interleaved(h: &NodeHistogram, pages: usize, over: &NodeSet, what: &str) {
    assert_eq!(h.present(), pages, "{what}: {h:?}");
    let n = over.len();
    for node in over.iter() {
        let got = h.on(node);
        assert!(
            got.abs_diff(pages / n) <= 1,
            "{what}: node {node} holds {got} of {pages} pages, not 1/{n} of them: {h:?}"
        );
    }
    let off: Vec<&Node> = h.pages.keys().filter(|n| !over.contains(**n)).collect();
    assert!(
        off.is_empty(),
        "{what}: pages off the domain on {off:?}: {h:?}"
    );
}

#[test]
fn domains_are_the_sockets_the_vm_was_given() {
    if vm_shape().as_deref() != Some("sockets") {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOT RUN: domains_are_the_sockets_the_vm_was_given needs the VM's second boot \
             (NUMAPIN_VM_SHAPE=sockets); here: {:?}",
            vm_shape()
        );
        return;
    }
    let topology = Topology::get().unwrap();
    let shape: Vec<(NodeSet, Option<u32>)> = topology
        .domains()
        .iter()
        .map(|d| (d.nodes(), d.package()))
        .collect();
    assert_eq!(
        shape,
        [(set(&[0, 1]), Some(0)), (set(&[2, 3]), Some(1))],
        "{topology:?}"
    );
    // Node 3 is memory without CPUs, nearer node 2 (30) than 0 or 1 (40).
    assert!(topology.cpus_of(Node(3)).is_empty(), "{topology:?}");
    assert_eq!(topology.distance(Node(3), Node(2)), Some(30));
    assert_eq!(topology.distance(Node(3), Node(0)), Some(40));
    // The calling thread's domain follows its CPU.
    for (cpu, domain) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
        let here = on_cpu(cpu, || numapin::topology::current_domain().unwrap());
        assert_eq!(here.id(), domain, "cpu {cpu}: {here:?}");
    }
    assert_eq!(topology.domain_of(Node(3)).map(Domain::id), Some(1));
    // The planner's live machine groups the nodes the same way (indices into its nodes,
    // which are 0..4 here).
    let machine = numapin::planner::Machine::live().unwrap();
    let ids: Vec<u16> = machine.nodes.iter().map(|n| n.node.0).collect();
    assert_eq!(ids, [0, 1, 2, 3], "{machine:?}");
    assert_eq!(machine.domains(), [vec![0, 1], vec![2, 3]], "{machine:?}");
}

#[test]
fn replicate_domains_puts_one_copy_per_domain_interleaved_over_its_nodes() {
    let test = "replicate_domains_puts_one_copy_per_domain_interleaved_over_its_nodes";
    let Some(nodes) = need_nodes(test, 2) else {
        return;
    };
    let topology = Topology::get().unwrap();
    let domains = topology.domains_within(&nodes);
    if vm_shape().as_deref() == Some("sockets") {
        assert_eq!(domains, [set(&[0, 1]), set(&[2, 3])]);
    }
    let store = PinStore::new(
        Layout::ReplicateDomains(nodes),
        StoreOptions::default().huge_pages(false).loader_threads(2),
    )
    .unwrap();
    assert_eq!(store.copy_groups(), &domains[..]);
    let (experts, w) = (8, 64 * 1024);
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: 4096,
    };
    let data: Vec<Vec<u8>> = (0..experts).map(|e| vec![e as u8 + 3; w]).collect();
    let sources: Vec<ExpertSource<'_>> = data
        .iter()
        .map(|d| ExpertSource::Memory {
            weights: d,
            scales: &d[..512],
        })
        .collect();
    for layer in 0..2 {
        let report = store.pack_layer(layer, &spec, &sources).unwrap();
        assert_eq!(report.replicas, domains.len());
        assert_eq!(report.mbind_calls, 2 * domains.len());
        assert!(report.placement.is_some_and(|p| p.is_bound()), "{report:?}");
    }
    for layer in 0..2 {
        for domain in &domains {
            let lead = domain.nth(0).unwrap();
            let what = format!("layer {layer}, the copy of domain {domain}");
            let weights = store.weights_on(lead, layer, 0).unwrap().as_ptr();
            let h = pages_of(weights, experts * w);
            assert_interleaved(&h, experts * w / page(), domain, &what);
            let scales = store.scales_on(lead, layer, 0).unwrap().as_ptr();
            let h = pages_of(scales, experts * page());
            assert_interleaved(&h, experts, domain, &format!("{what}, scales"));
            for node in domain.iter() {
                assert_eq!(store.weights_on(node, layer, 0).unwrap().as_ptr(), weights);
                for (e, d) in data.iter().enumerate() {
                    assert_eq!(store.weights_on(node, layer, e).unwrap(), &d[..]);
                }
            }
        }
    }
    // A thread on each CPU reads its own domain's copy: every page of what it gets
    // is in its domain.
    let cpus: Vec<usize> = nodes.iter().flat_map(|n| topology.cpus_of(n)).collect();
    let store_ref = &store;
    for cpu in cpus {
        let (ptr, domain) = on_cpu(cpu, || {
            let w = store_ref.weights_local(1, 5).unwrap();
            (
                w.as_ptr() as usize,
                numapin::topology::current_domain().unwrap(),
            )
        });
        let h = pages_of(ptr as *const u8, w);
        let off: Vec<&Node> = h
            .pages
            .keys()
            .filter(|n| !domain.nodes().contains(**n))
            .collect();
        assert!(
            off.is_empty(),
            "cpu {cpu} in {domain:?} read pages on {off:?}"
        );
        assert_eq!(h.present(), w / page(), "cpu {cpu}: {h:?}");
    }
    let stats = store.stats().unwrap();
    assert_eq!(stats.mbind_calls, 2 * 2 * domains.len());
}

/// A thread on every CPU of `nodes` reads hot expert 1 from its own domain's copy
/// (interleaved over the domain's nodes, by `move_pages`) and cold expert 9 from its home.
fn every_cpu_reads_its_domains_copy(
    store: &PinStore,
    nodes: NodeSet,
    topology: &Topology,
    w: usize,
) {
    let cpus: Vec<usize> = nodes.iter().flat_map(|n| topology.cpus_of(n)).collect();
    for cpu in cpus {
        let (hot_ptr, cold_ptr, domain) = on_cpu(cpu, || {
            (
                store.weights_local(0, 1).unwrap().as_ptr() as usize,
                store.weights_local(0, 9).unwrap().as_ptr() as usize,
                numapin::topology::current_domain().unwrap(),
            )
        });
        let h = pages_of(hot_ptr as *const u8, w);
        let within = domain.nodes().intersection(&nodes);
        assert_interleaved(&h, w / page(), &within, &format!("cpu {cpu} reading hot 1"));
        assert_eq!(cold_ptr, store.weights(0, 9).unwrap().as_ptr() as usize);
    }
}

/// A hybrid layer over every node with its 2 hot experts one copy per domain
/// (`HotCopies::PerDomain`), 16 experts of 64 KiB with Zipf counts. `move_pages` finds
/// each domain's copy of each hot expert on that domain's nodes only, half on each of a
/// 2-node domain (±1 page); each cold expert on its load-balanced home; a thread on
/// every CPU reads its own domain's copy of a hot expert and the home of a cold one.
/// Per kind, `mbind` calls and mappings (the store's smaps count) are the node blocks
/// holding cold experts, the hot range apart where the first domain has 2+ nodes, and a
/// copy per further domain; bytes per node are each node's cold experts plus its share
/// of its domain's hot copy (counted here from the assignment and the domains), and
/// each node's resident pages stay within a budget: the slots the fullest node would
/// hold with a hot copy per node, one fewer in the sockets boot.
#[test]
fn hybrid_hot_copies_per_domain_lie_on_their_domains() {
    let test = "hybrid_hot_copies_per_domain_lie_on_their_domains";
    let Some(nodes) = need_nodes(test, 2) else {
        return;
    };
    let topology = Topology::get().unwrap();
    let domains = topology.domains_within(&nodes);
    let sockets = vm_shape().as_deref() == Some("sockets");
    if sockets {
        assert_eq!(domains, [set(&[0, 1]), set(&[2, 3])]);
    }
    let (n, experts, w) = (nodes.len(), 16, 64 * 1024);
    let counts: Vec<u64> = (0..experts).map(|e| 1000 / (e as u64 + 1)).collect();
    let stats = RoutingStats::from_counts([(0, counts)]).unwrap();
    let a = ExpertAssignment::hybrid(&stats, &[(0, experts)], &nodes, 2)
        .unwrap()
        .hot_copies(HotCopies::PerDomain);
    let options = StoreOptions::default().huge_pages(false).loader_threads(2);
    let store = PinStore::new(
        Layout::SplitExperts(nodes),
        options.assignment(Some(a.clone())),
    )
    .unwrap();
    assert_eq!(store.hot_groups(), &domains[..]);
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: 4096,
    };
    let data: Vec<Vec<u8>> = (0..experts).map(|e| vec![e as u8 + 3; w]).collect();
    let sources: Vec<ExpertSource<'_>> = data
        .iter()
        .map(|d| ExpertSource::Memory {
            weights: d,
            scales: &d[..512],
        })
        .collect();
    let report = store.pack_layer(0, &spec, &sources).unwrap();
    assert!(report.placement.is_some_and(|p| p.is_bound()), "{report:?}");
    let homes: Vec<Home> = (0..experts).map(|e| a.home(0, e).unwrap()).collect();
    let hot: Vec<usize> = (0..experts).filter(|&e| homes[e] == Home::Hot).collect();
    assert_eq!(hot, [0, 1]);
    let apart = domains[0].len() > 1;
    let blocks = (nodes.iter().enumerate())
        .filter(|&(i, node)| homes.contains(&Home::Node(node)) || (i == 0 && !apart))
        .count();
    let per_kind = blocks + usize::from(apart) + domains.len() - 1;
    assert_eq!(report.mbind_calls, 2 * per_kind, "{report:?}");
    let slot = (w + 512) as u64;
    let mut want = std::collections::BTreeMap::new();
    for domain in &domains {
        let lead = domain.nth(0).unwrap();
        for &e in &hot {
            let copy = store.weights_on(lead, 0, e).unwrap();
            assert_eq!(copy, &data[e][..], "hot {e}");
            let what = format!("hot expert {e}, the copy of domain {domain}");
            assert_interleaved(&pages_of(copy.as_ptr(), w), w / page(), domain, &what);
            for node in domain.iter() {
                assert_eq!(
                    store.weights_on(node, 0, e).unwrap().as_ptr(),
                    copy.as_ptr()
                );
            }
        }
        let hot_bytes = hot.len() as u64 * slot;
        let m = domain.len() as u64;
        for (i, node) in domain.iter().enumerate() {
            *want.entry(node).or_insert(0u64) +=
                hot_bytes / m + u64::from((i as u64) < hot_bytes % m);
        }
    }
    for e in (0..experts).filter(|e| !hot.contains(e)) {
        let Home::Node(home) = homes[e] else {
            panic!("cold expert {e} has no node: {homes:?}");
        };
        assert_eq!(store.home_node(0, e).unwrap(), Some(home));
        let h = pages_of(store.weights(0, e).unwrap().as_ptr(), w);
        assert_eq!(h.on(home), w / page(), "cold {e}: {h:?}");
        *want.entry(home).or_insert(0u64) += slot;
    }
    every_cpu_reads_its_domains_copy(&store, nodes, topology, w);
    let measured = store.stats().unwrap();
    // smaps counts VMAs, and the kernel merges two adjacent mappings of equal flags and
    // policy (a domain's hot weights and hot scales regions, mapped one after the other;
    // no anonymous names tell them apart on the VM's kernel): at most one VMA per
    // mapping, at least one per kind's worth. The `mbind` calls above are exact.
    assert!(
        (per_kind..=2 * per_kind).contains(&measured.vmas),
        "{} VMAs for {} mappings: {measured:?}",
        measured.vmas,
        2 * per_kind
    );
    assert_eq!(measured.node_bytes, want);
    let shares = store.expert_shares(Some(&stats)).unwrap();
    for (node, bytes) in &want {
        assert_eq!(shares[node].bytes, *bytes);
        assert_eq!(shares[node].hot_experts, 2);
    }
    // The budget: the slots the fullest node would hold with a hot copy per node (its
    // even share of the cold experts, and both hot ones), one fewer in the sockets boot,
    // where each node holds half of its domain's hot copy instead.
    let per_node = (experts - hot.len()).div_ceil(n) + hot.len();
    let budget = (per_node - usize::from(sockets)) as u64 * (w + 4096) as u64;
    within_budget(&measured.pages_per_node, budget);
}

/// Every node's resident pages of the store within `budget` bytes.
fn within_budget(pages_per_node: &std::collections::BTreeMap<Node, u64>, budget: u64) {
    for (node, pages) in pages_per_node {
        assert!(
            pages * page() as u64 <= budget,
            "node {node}: {pages} pages over the budget of {budget} bytes"
        );
    }
}
