//! Loader threads on a node's CPUs: the calling thread moved onto them for as long as a
//! guard lives (rule 12: write where it will be read). A node without CPUs of its own
//! (CXL or HBM memory) is filled from the nearest node whose CPUs the thread may use.

use crate::node::{Node, NodeSet};
use crate::topology::{self, Topology};
use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

/// The calling thread moved onto the CPUs that fill one node (its `sched_getaffinity` set,
/// which cpusets shrink, intersected with the CPUs of [`fill_node`]); the affinity it had
/// comes back on drop. A thread that cannot move (no usable CPU at all, a refused call, an
/// unknown topology) stays where it is: [`OnNode::moved`] says so.
#[derive(Debug)]
pub(crate) struct OnNode {
    /// The affinity to restore; `None`: nothing was changed.
    previous: Option<CpuSet>,
    /// The node whose CPUs the thread runs on only (moved there, or every CPU is on it);
    /// `None`: it stayed where it was.
    on: Option<Node>,
}

impl OnNode {
    /// Moves the calling thread onto the CPUs that fill `node`: its own, or for a node
    /// without CPUs the nearest node's whose CPUs the thread may use ([`fill_node`]).
    #[doc(alias = "sched_setaffinity")]
    pub(crate) fn enter(node: Node) -> OnNode {
        let stay = OnNode {
            previous: None,
            on: None,
        };
        let (Ok(topology), Ok(allowed)) = (Topology::get(), sched_getaffinity(None)) else {
            return stay;
        };
        if topology.cpus_of(node).is_empty() && running_on(node) {
            // No CPU list at all (a kernel without NUMA: every CPU is on node 0).
            return OnNode {
                previous: None,
                on: Some(node),
            };
        }
        let Some(host) = fill_node(topology, node, &allowed) else {
            return stay;
        };
        let mut set = CpuSet::new();
        let mut any = false;
        for cpu in topology.cpus_of(host) {
            if cpu < CpuSet::MAX_CPU && allowed.is_set(cpu) {
                set.set(cpu);
                any = true;
            }
        }
        if !any || sched_setaffinity(None, &set).is_err() {
            return stay;
        }
        OnNode {
            previous: Some(allowed),
            on: Some(host),
        }
    }

    /// Whether the thread now runs only on the CPUs that fill the node.
    pub(crate) fn moved(&self) -> bool {
        self.on.is_some()
    }

    /// The node whose CPUs the thread now runs on (the node entered, or the nearest one
    /// with usable CPUs for a node without them); `None` when it could not move.
    pub(crate) fn node(&self) -> Option<Node> {
        self.on
    }
}

impl Drop for OnNode {
    fn drop(&mut self) {
        if let Some(previous) = &self.previous {
            // The set was this thread's own a moment ago; should the kernel refuse it now
            // (a cpuset shrank meanwhile), the thread keeps the node's CPUs, which it was
            // allowed to run on: nothing to report from a destructor.
            let _ = sched_setaffinity(None, previous);
        }
    }
}

/// The node whose CPUs fill `node`'s memory for a thread allowed on `allowed`: `node`
/// itself when it has CPUs (if none of them is allowed the loader stays put and says so);
/// for a memory-only node (CXL, HBM) the nearest node by sysfs distance with an allowed
/// CPU, ties to the lower id (it is written at the speed of the link from there). `None`:
/// no allowed CPU has a known node.
pub(crate) fn fill_node(topology: &Topology, node: Node, allowed: &CpuSet) -> Option<Node> {
    if !topology.cpus_of(node).is_empty() {
        return Some(node);
    }
    let usable: NodeSet = (0..CpuSet::MAX_CPU)
        .filter(|&cpu| allowed.is_set(cpu))
        .filter_map(|cpu| topology.node_of_cpu(cpu))
        .collect();
    topology.nearest(node, &usable)
}

/// Whether the calling thread runs on `node` now (`sched_getcpu` through the CPU → node
/// table).
pub(crate) fn running_on(node: Node) -> bool {
    topology::current_node().is_ok_and(|n| n == node)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::fake_sysfs::FakeSysfs;

    fn cpus(list: &[usize]) -> CpuSet {
        let mut set = CpuSet::new();
        for &cpu in list {
            set.set(cpu);
        }
        set
    }

    #[test]
    fn a_node_without_usable_cpus_is_filled_from_the_nearest_node_with_some() {
        // The VM's second boot: nodes 0 and 1 (12 apart), node 2 across the socket link
        // (21), node 3 memory only, 30 from node 2 and 40 from the others.
        let s = FakeSysfs::new();
        s.nodes(
            &["0", "1", "2-3", ""],
            &[
                &[10, 12, 21, 40],
                &[12, 10, 21, 40],
                &[21, 21, 10, 30],
                &[40, 40, 30, 10],
            ],
        );
        let topology = Topology::read_from(s.path()).unwrap();
        let all = cpus(&[0, 1, 2, 3]);
        assert_eq!(fill_node(&topology, Node(3), &all), Some(Node(2)));
        for n in 0..3 {
            assert_eq!(fill_node(&topology, Node(n), &all), Some(Node(n)));
        }
        // A cpuset without node 2's CPUs: node 3 from the nearest allowed node, ties to
        // the lower id; node 2 keeps its own (its loader then cannot move, and says so).
        let socket0 = cpus(&[0, 1]);
        assert_eq!(fill_node(&topology, Node(3), &socket0), Some(Node(0)));
        assert_eq!(fill_node(&topology, Node(2), &socket0), Some(Node(2)));
        assert_eq!(fill_node(&topology, Node(3), &cpus(&[1])), Some(Node(1)));
        // No allowed CPU with a known node: nowhere to go.
        assert_eq!(fill_node(&topology, Node(3), &CpuSet::new()), None);
        assert_eq!(fill_node(&topology, Node(3), &cpus(&[9])), None);
    }
}
