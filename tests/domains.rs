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
use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, StoreOptions};
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
