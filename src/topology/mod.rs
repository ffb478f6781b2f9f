//! The machine's shape as placement needs it at run time: which node each CPU belongs to,
//! how far nodes are from each other, and which node the calling thread runs on. The
//! tables are read once from sysfs; the current node comes from the thread's rseq area
//! or `getcpu`, without a system call: cheap enough to ask per expert per token. The
//! domains (sockets) the nodes form are read with it (`domains.rs`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use numapin_sys as sys;
use sys::cpu::RseqArea;

use crate::error::{Error, Result};
use crate::node::{self, Node, NodeSet};

mod domains;
#[cfg(test)]
pub(crate) mod fake_sysfs;
mod memory;

pub use domains::Domain;
pub(crate) use memory::{FIGURE, available_bytes};

/// The sysfs directory [`Topology::read`] reads (`node/` and `cpu/` below it).
const SYSFS_SYSTEM: &str = "/sys/devices/system";

/// CPUs per node, node distances and the nodes' domains, from `/sys/devices/system`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    /// `cpu_node[cpu]`: the node of each CPU id (`None`: offline or unknown).
    cpu_node: Vec<Option<Node>>,
    /// `node → distance to node 0, 1, ...` (sysfs `distance` rows).
    distances: BTreeMap<Node, Vec<u32>>,
    /// The domains, in the order of their lowest node (empty: no NUMA view, see
    /// [`Topology::domains`]).
    domains: Vec<Domain>,
}

impl Topology {
    /// Reads the topology from sysfs. Without NUMA sysfs (a kernel without NUMA) every
    /// CPU is on node 0, the one domain.
    ///
    /// # Errors
    /// A sysfs file exists but cannot be read or parsed.
    pub fn read() -> Result<Topology> {
        Topology::read_from(Path::new(SYSFS_SYSTEM))
    }

    /// [`Topology::read`] from another sysfs tree: `system` stands for
    /// `/sys/devices/system` (its `node/` and `cpu/` directories are read). Tests build
    /// such trees; odd ones (missing files, `-1` package ids, offline CPUs, CPU-less
    /// nodes) give a topology, never a panic.
    ///
    /// # Errors
    /// A file exists but cannot be read or parsed.
    #[doc(hidden)]
    pub fn read_from(system: &Path) -> Result<Topology> {
        let online_path = system.join("node/online");
        let online = read_optional(&online_path)?;
        if online.is_empty() {
            return Ok(Topology {
                domains: vec![domains::node0()],
                ..Topology::default()
            });
        }
        let online = node::parse_kernel_list(&online).ok_or_else(|| Error::Unparsable {
            path: online_path.display().to_string(),
            what: "a node list",
            found: online.chars().take(64).collect(),
        })?;
        let mut topology = Topology::default();
        for n in online.iter() {
            let dir = system.join(format!("node/node{n}")).display().to_string();
            let cpulist = read_optional(format!("{dir}/cpulist"))?;
            let cpus = parse_cpu_list(&cpulist).map_err(|(what, found)| Error::Unparsable {
                path: format!("{dir}/cpulist"),
                what,
                found,
            })?;
            if let Some(last) = cpus.last()
                && last >= topology.cpu_node.len()
            {
                topology.cpu_node.resize(last + 1, None);
            }
            for cpu in cpus.iter() {
                topology.cpu_node[cpu] = Some(n);
            }
            let text = read_optional(format!("{dir}/distance"))?;
            // Every entry or none: a dropped entry would shift the later ones onto the
            // wrong nodes.
            let row: Vec<u32> = text
                .split_whitespace()
                .map(|d| d.parse().ok())
                .collect::<Option<_>>()
                .ok_or_else(|| Error::Unparsable {
                    path: format!("{dir}/distance"),
                    what: "a distance row",
                    found: text.chars().take(64).collect(),
                })?;
            if !row.is_empty() {
                topology.distances.insert(n, row);
            }
        }
        topology.domains = domains::read(system, &online, &topology)?;
        Ok(topology)
    }

    /// The topology of this machine, read once per process.
    ///
    /// # Errors
    /// As [`Topology::read`] (the first call's error is kept).
    pub fn get() -> Result<&'static Topology> {
        static TOPOLOGY: OnceLock<Result<Topology>> = OnceLock::new();
        // Every later call gets the first call's error as it was (the same variant).
        TOPOLOGY
            .get_or_init(Topology::read)
            .as_ref()
            .map_err(Error::clone)
    }

    /// The node of CPU `cpu` (node 0 where sysfs has no NUMA view).
    pub fn node_of_cpu(&self, cpu: usize) -> Option<Node> {
        if self.cpu_node.is_empty() {
            return Some(Node(0));
        }
        self.cpu_node.get(cpu).copied().flatten()
    }

    /// The CPUs of `node`.
    pub fn cpus_of(&self, node: Node) -> Vec<usize> {
        (0..self.cpu_node.len())
            .filter(|&cpu| self.cpu_node[cpu] == Some(node))
            .collect()
    }

    /// The sysfs distance from `a` to `b` (10 = local), if known.
    pub fn distance(&self, a: Node, b: Node) -> Option<u32> {
        self.distances.get(&a)?.get(b.index()).copied()
    }

    /// The node of `among` nearest to `from` by distance, ties to the lower id; `from`
    /// itself when it is in the set. `None` for an empty set.
    pub fn nearest(&self, from: Node, among: &NodeSet) -> Option<Node> {
        if among.contains(from) {
            return Some(from);
        }
        among
            .iter()
            .min_by_key(|&n| (self.distance(from, n).unwrap_or(u32::MAX), n.index()))
    }
}

/// How [`current_node`] and [`current_cpu`] learn where the calling thread runs, chosen
/// once per process ([`node_lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeLookup {
    /// The thread's rseq area, which glibc (2.35+) registers and the kernel (6.3+) keeps
    /// current: two loads, no call. Checked once against `getcpu` before it is trusted.
    Rseq,
    /// `getcpu` (the vDSO through glibc, or the syscall): it returns the node itself.
    Getcpu,
}

/// The lookup this process uses, chosen on first use: rseq where glibc registered an area
/// that the kernel fills up to `node_id` and its answer agrees with `getcpu` on this
/// thread; `getcpu` otherwise.
pub fn node_lookup() -> NodeLookup {
    match rseq() {
        Some(_) => NodeLookup::Rseq,
        None => NodeLookup::Getcpu,
    }
}

/// The rseq area when it is usable (see [`node_lookup`]).
#[inline]
fn rseq() -> Option<RseqArea> {
    static AREA: OnceLock<Option<RseqArea>> = OnceLock::new();
    *AREA.get_or_init(|| {
        let area = RseqArea::find()?;
        // A migration between the two reads can make them differ once: try a few times.
        // Agreeing once proves the layout (offsets, fields), which is all that is checked.
        (0..8)
            .any(|_| {
                let by_rseq = area.read();
                let by_getcpu = sys::cpu::getcpu().ok();
                by_rseq.is_some() && by_rseq == by_getcpu
            })
            .then_some(area)
    })
}

/// The CPU the calling thread runs on now: the rseq area's `cpu_id` where usable (see
/// [`node_lookup`]), else `sched_getcpu` from the vDSO. Either was true at an instant
/// during the call; see [`current_node`] for the bound after a migration.
#[inline]
pub fn current_cpu() -> usize {
    if let Some((cpu, _)) = rseq().and_then(RseqArea::read) {
        return cpu as usize;
    }
    rustix::thread::sched_getcpu()
}

/// The node the calling thread runs on now, without a system call: the rseq area's
/// `node_id` (Linux 6.3+ with glibc 2.35+), else `getcpu`'s node (the vDSO), else the
/// CPU → node table from sysfs (node 0 where the topology is unknown).
///
/// # How stale it can be
/// The answer was true at some instant during the call. The kernel rewrites the rseq
/// area on the thread's return to user space after every preemption or migration, before
/// the thread runs another instruction on the new CPU, and the vDSO's `getcpu` reads the
/// CPU it runs on: a thread that moved gets the new node from its very next call. What
/// no lookup can prevent is a migration right after it returns: a caller that must stay
/// on the node pins the thread (`sched_setaffinity`) to that node's CPUs.
///
/// # Errors
/// The topology cannot be read (only on the fallback to the sysfs table).
#[inline]
pub fn current_node() -> Result<Node> {
    if let Some((_, node)) = rseq().and_then(RseqArea::read)
        && let Ok(node) = u16::try_from(node)
    {
        return Ok(Node(node));
    }
    current_node_slow()
}

/// `getcpu`'s node, or the sysfs table's for `sched_getcpu`'s CPU.
fn current_node_slow() -> Result<Node> {
    if let Ok((_, node)) = sys::cpu::getcpu()
        && let Ok(node) = u16::try_from(node)
    {
        return Ok(Node(node));
    }
    let topology = Topology::get()?;
    Ok(topology
        .node_of_cpu(rustix::thread::sched_getcpu())
        .unwrap_or(Node(0)))
}

/// The calling thread's domain: the domain of [`current_node`].
///
/// # Errors
/// The topology cannot be read.
pub fn current_domain() -> Result<Domain> {
    let node = current_node()?;
    let topology = Topology::get()?;
    // Every online node is in a domain; node 0 of a machine without NUMA sysfs too.
    Ok(topology
        .domain_of(node)
        .or_else(|| topology.domains().first())
        .copied()
        .unwrap_or_else(domains::node0))
}

/// A file's text; empty where it does not exist (an optional sysfs file).
fn read_optional(path: impl AsRef<Path>) -> Result<String> {
    let path = path.as_ref();
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(Error::io("read", path.display().to_string(), e)),
    }
}

/// CPU ids a CPU list may name: below 2^20 (x86-64 kernels build with `NR_CPUS` <= 8,192), so
/// that a corrupt file cannot ask for a huge table.
const MAX_CPU: usize = 1 << 20;

/// The CPUs of a kernel CPU list, one bit per id below [`MAX_CPU`] (128 KiB at most): a
/// list naming the same range many times costs no more than once (issue 31: a cpulist
/// repeating `0-1048575` 2,000 times, 20 KB, allocated ~16 GB as a list of ids).
#[derive(Debug, Default, PartialEq, Eq)]
struct CpuBits {
    words: Vec<u64>,
}

impl CpuBits {
    /// Sets the ids `lo..=hi` (below [`MAX_CPU`]) a word at a time.
    fn insert_range(&mut self, lo: usize, hi: usize) {
        if self.words.len() <= hi / 64 {
            self.words.resize(hi / 64 + 1, 0);
        }
        for w in lo / 64..=hi / 64 {
            let from = if w == lo / 64 { lo % 64 } else { 0 };
            let to = if w == hi / 64 { hi % 64 } else { 63 };
            self.words[w] |= (u64::MAX >> (63 - (to - from))) << from;
        }
    }

    /// The ids, ascending.
    fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &word)| {
            (0..64)
                .filter(move |b| word & (1 << b) != 0)
                .map(move |b| w * 64 + b)
        })
    }

    /// How many CPUs.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The highest id, if any.
    fn last(&self) -> Option<usize> {
        let w = self.words.iter().rposition(|&w| w != 0)?;
        Some(w * 64 + 63 - self.words[w].leading_zeros() as usize)
    }
}

/// A kernel CPU list (`0-3,8,10-11`) as a set of CPUs; `Err((what, found))` for
/// [`Error::Unparsable`]: a malformed list, or the first item naming an id from
/// [`MAX_CPU`] up, by name.
fn parse_cpu_list(text: &str) -> std::result::Result<CpuBits, (&'static str, String)> {
    let clipped = |t: &str| t.chars().take(64).collect::<String>();
    let ranges =
        node::parse_kernel_ranges(text, usize::MAX).ok_or(("a CPU list", clipped(text)))?;
    let mut bits = CpuBits::default();
    for (lo, hi) in ranges {
        if hi >= MAX_CPU {
            let item = match lo == hi {
                true => format!("{hi}"),
                false => format!("{lo}-{hi}"),
            };
            return Err(("a CPU list of ids below 1048576 (2^20)", item));
        }
        bits.insert_range(lo, hi);
    }
    Ok(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_garbage_does_not() {
        let ids = |text| parse_cpu_list(text).map(|b| b.iter().collect::<Vec<_>>());
        assert_eq!(ids("0-2,5\n"), Ok(vec![0, 1, 2, 5]));
        assert_eq!(ids(""), Ok(vec![]));
        assert_eq!(
            ids("63-64,127,5,1-3,128"),
            Ok(vec![1, 2, 3, 5, 63, 64, 127, 128])
        );
        for bad in ["3-1", "x", "0-", "99999999999", "0-1048576"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad}");
        }
        // An id past the ceiling is refused by name: the item, not the list's head.
        let (what, found) = parse_cpu_list("0-3,7,1048576").unwrap_err();
        assert_eq!(found, "1048576");
        assert!(what.contains("below 1048576"), "{what}");
        assert_eq!(parse_cpu_list("1-2,5-1048577").unwrap_err().1, "5-1048577");
    }

    /// Issue 31: `0-1048575` 2,000 times (20 KB) aborted the process allocating ~16 GB
    /// (a list of ids with every duplicate); as a set it is 2^20 CPUs in 128 KiB.
    #[test]
    fn a_range_repeated_is_counted_once() {
        let hostile = vec!["0-1048575"; 2000].join(",");
        assert_eq!(hostile.len(), 2000 * 10 - 1);
        let bits = parse_cpu_list(&hostile).unwrap();
        assert_eq!(bits.len(), 1 << 20);
        assert_eq!(bits.words.len(), (1 << 20) / 64);
        let fake = fake_sysfs::FakeSysfs::new();
        fake.nodes(&[hostile.as_str(), "5,5,5,5"], &[&[10, 20], &[20, 10]]);
        let t = Topology::read_from(fake.path()).unwrap();
        // CPU 5 is named by both nodes: the later node's, as before.
        assert_eq!(t.cpus_of(Node(0)).len(), (1 << 20) - 1);
        assert_eq!(t.cpus_of(Node(1)), vec![5]);
        assert_eq!(t.node_of_cpu((1 << 20) - 1), Some(Node(0)));
    }

    #[test]
    fn nearest_uses_distances_and_ties_to_the_lower_id() {
        let mut t = Topology::default();
        // The VM's table: node 3 is 15 from node 2, 30 from 0 and 1.
        for (n, row) in [
            (0, vec![10, 20, 20, 30]),
            (1, vec![20, 10, 20, 30]),
            (2, vec![20, 20, 10, 15]),
            (3, vec![30, 30, 15, 10]),
        ] {
            t.distances.insert(Node(n), row);
        }
        let memory = NodeSet::from_nodes([0, 1, 2]).unwrap();
        assert_eq!(t.nearest(Node(3), &memory), Some(Node(2)));
        assert_eq!(t.nearest(Node(1), &memory), Some(Node(1)));
        let far = NodeSet::from_nodes([0, 1]).unwrap();
        assert_eq!(t.nearest(Node(3), &far), Some(Node(0)), "tie: lower id");
        assert_eq!(t.nearest(Node(0), &NodeSet::new()), None);
    }

    #[test]
    fn this_machine_knows_the_current_cpu() {
        let t = Topology::get().unwrap();
        let cpu = current_cpu();
        assert!(t.node_of_cpu(cpu).is_some(), "cpu {cpu}: {t:?}");
        let node = current_node().unwrap();
        assert!(t.cpus_of(node).contains(&cpu) || t.cpu_node.is_empty());
    }
}
