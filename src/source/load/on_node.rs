//! Loader threads on a node's CPUs: the calling thread moved onto them for as long as a
//! guard lives (rule 12: write where it will be read).

use crate::node::Node;
use crate::topology::{self, Topology};
use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

/// The calling thread moved onto the CPUs of one node that it may use (its
/// `sched_getaffinity` set, which cpusets shrink, intersected with the node's CPUs); the
/// affinity it had comes back on drop. A thread that cannot move (an empty intersection,
/// a refused call, an unknown topology) stays where it is: [`OnNode::moved`] says so.
#[derive(Debug)]
pub(crate) struct OnNode {
    /// The affinity to restore; `None`: nothing was changed.
    previous: Option<CpuSet>,
    /// The thread runs on the node's CPUs only (moved there, or every CPU is on it).
    on_node: bool,
}

impl OnNode {
    /// Moves the calling thread onto `node`'s CPUs.
    #[doc(alias = "sched_setaffinity")]
    pub(crate) fn enter(node: Node) -> OnNode {
        let stay = OnNode {
            previous: None,
            on_node: false,
        };
        let (Ok(topology), Ok(allowed)) = (Topology::get(), sched_getaffinity(None)) else {
            return stay;
        };
        let cpus = topology.cpus_of(node);
        if cpus.is_empty() && running_on(node) {
            // No CPU list at all (a kernel without NUMA: every CPU is on node 0).
            return OnNode {
                previous: None,
                on_node: true,
            };
        }
        let mut set = CpuSet::new();
        let mut any = false;
        for cpu in cpus {
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
            on_node: true,
        }
    }

    /// Whether the thread now runs only on the node's CPUs.
    pub(crate) fn moved(&self) -> bool {
        self.on_node
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

/// Whether the calling thread runs on `node` now (`sched_getcpu` through the CPU → node
/// table).
pub(crate) fn running_on(node: Node) -> bool {
    topology::current_node().is_ok_and(|n| n == node)
}
