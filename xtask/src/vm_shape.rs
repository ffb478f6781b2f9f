//! The machines `cargo xtask test-numa` boots, one qemu boot each, from one initramfs:
//! `/init` picks the cases of its boot by `NUMAPIN_VM_SHAPE`, which the kernel command
//! line sets (the kernel hands unknown `name=value` parameters to init as environment
//! variables, and the test binaries inherit it).
//!
//! - [`Shape::FourNodes`]: four one-CPU sockets; nodes 0-2 with 768 MiB each, node 3 a
//!   CPU without memory. Every test binary runs here.
//! - [`Shape::Sockets`] (`NUMAPIN_VM_SHAPE=sockets`): two sockets of two cores; socket 0
//!   split into nodes 0 and 1 (sub-NUMA clusters, CPUs 0 and 1), socket 1 is node 2
//!   (CPUs 2 and 3), and node 3 is memory without CPUs, farther than any (CXL-like) and
//!   nearest node 2. Its domains are {0,1} and {2,3}. Only the binaries that need this
//!   shape (domains, and layouts' loaders for a CPU-less node) run here (see [`Shape::binaries`]), so the boot stays short.

use std::process::Command;

/// Memory per node with memory, in MiB. The initramfs unpacks into ~230 MB of
/// unreclaimable ramfs on one node (whichever CPU unpacks it); at 512 MiB that node kept
/// ~228 MB free, and late in the suite pin_model's interleave found it full and fell back
/// to node 0 (CI, stop 38: pages {0: 25344, 1: 12672}, none on node 2). /init prints
/// each node's free memory before every case (xtask shows it as `free kB per node`).
pub const NODE_MIB: usize = 768;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    FourNodes,
    Sockets,
}

impl Shape {
    pub const ALL: [Shape; 2] = [Shape::FourNodes, Shape::Sockets];

    /// The value of `NUMAPIN_VM_SHAPE` in this boot (unset in the first).
    pub fn env(self) -> Option<&'static str> {
        match self {
            Shape::FourNodes => None,
            Shape::Sockets => Some("sockets"),
        }
    }

    /// The table title.
    pub fn title(self) -> &'static str {
        match self {
            Shape::FourNodes => "4-node VM: nodes 0-2 with 768 MiB each, node 3 memoryless",
            Shape::Sockets => {
                "2-socket VM: nodes 0,1 on socket 0, node 2 on socket 1, node 3 CPU-less memory \
                 nearest node 2"
            }
        }
    }

    /// The test binaries this boot runs (`None`: all of them).
    pub fn binaries(self) -> Option<&'static [&'static str]> {
        match self {
            Shape::FourNodes => None,
            // `layouts` here too: node 3 has memory and no CPUs, so its loaders must run
            // on the nearest node with CPUs (node 2).
            Shape::Sockets => Some(&["domains", "layouts"]),
        }
    }

    /// Extra arguments of the main job's case in this boot, and the nodes its pages must
    /// be on.
    pub fn pin_model(self) -> (&'static str, usize) {
        match self {
            Shape::FourNodes => ("--json --layers 6 --experts 24", 3),
            // A copy per socket, each interleaved over its nodes: pages on all four.
            Shape::Sockets => (
                "--json --layers 4 --experts 16 --layout replicate-domains",
                4,
            ),
        }
    }

    /// What the topology line printed by `/init` must contain.
    pub fn expected_topology(self) -> [&'static str; 2] {
        match self {
            Shape::FourNodes => ["memory=0-2", "cpus=0-3"],
            Shape::Sockets => ["memory=0-3", "cpus=0-2"],
        }
    }

    /// The qemu machine: CPUs, memory per node ([`NODE_MIB`]) and distances.
    pub fn qemu_args(self, cmd: &mut Command) {
        let memory = |cmd: &mut Command, node: usize, mib: usize| {
            cmd.args([
                "-object",
                &format!("memory-backend-ram,id=m{node},size={mib}M"),
            ]);
        };
        let distances: &[(usize, usize, u32)] = match self {
            Shape::FourNodes => {
                cmd.args(["-smp", "4,sockets=4,cores=1,threads=1", "-m", "2304M"]);
                for node in 0..3 {
                    memory(cmd, node, NODE_MIB);
                    cmd.args([
                        "-numa",
                        &format!("node,nodeid={node},cpus={node},memdev=m{node}"),
                    ]);
                }
                cmd.args(["-numa", "node,nodeid=3,cpus=3"]);
                // Non-uniform distances, so that "nearest" and "first" differ: the
                // memoryless node 3 is near node 2 and far from 0 and 1.
                &[
                    (0, 1, 20),
                    (0, 2, 20),
                    (1, 2, 20),
                    (0, 3, 30),
                    (1, 3, 30),
                    (2, 3, 15),
                ]
            }
            Shape::Sockets => {
                cmd.args(["-smp", "4,sockets=2,cores=2,threads=1", "-m", "3072M"]);
                for node in 0..4 {
                    memory(cmd, node, NODE_MIB);
                    cmd.args(["-numa", &format!("node,nodeid={node},memdev=m{node}")]);
                }
                // CPUs by socket and core: socket 0's cores on nodes 0 and 1, socket 1's
                // on node 2; node 3 gets none.
                for (node, socket, core) in [(0, 0, "0"), (1, 0, "1"), (2, 1, "0"), (2, 1, "1")] {
                    cmd.args([
                        "-numa",
                        &format!(
                            "cpu,node-id={node},socket-id={socket},core-id={core},thread-id=0"
                        ),
                    ]);
                }
                // Sub-NUMA clusters 12 apart, sockets 21, the CPU-less node 30 from node 2
                // and 40 from socket 0.
                &[
                    (0, 1, 12),
                    (0, 2, 21),
                    (1, 2, 21),
                    (0, 3, 40),
                    (1, 3, 40),
                    (2, 3, 30),
                ]
            }
        };
        // qemu wants every pair (a partial table makes it exit); it mirrors each to the
        // other direction.
        for (a, b, distance) in distances {
            cmd.args(["-numa", &format!("dist,src={a},dst={b},val={distance}")]);
        }
    }
}
