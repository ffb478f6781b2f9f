//! Domains: the groups of nodes one copy of read-mostly data should serve. A domain is a
//! package (socket): with sub-NUMA clustering (Intel SNC, AMD NPS2/NPS4) one socket shows
//! 2–4 nodes, and a copy per node would cost 2–4 times the memory for little gain.
//!
//! # How a node's domain is found
//!
//! - A node with online CPUs is in the domain of its CPUs' package,
//!   `cpu/cpuN/topology/physical_package_id`. Where that is unknown — the files are
//!   missing (offline CPUs have no `topology/` directory), the id is `-1` (some virtual
//!   machines and firmware), or the node's CPUs name different packages — the node is a
//!   domain of its own: merging nodes on a guess would hide a socket boundary.
//! - A node without CPUs (CXL or HBM memory) joins the domain of its initiators where the
//!   kernel lists them (`node/nodeN/access0/initiators/nodeM`, from ACPI HMAT; the nearest
//!   of them by distance if several), else the domain of the nearest node with CPUs by
//!   SLIT distance (`node/nodeN/distance`), ties to the lowest id. Without either it is a
//!   domain of its own.
//!
//! Domains are numbered from 0 in the order of their lowest node.

use std::collections::BTreeMap;
use std::path::Path;

use super::{Topology, read_optional};
use crate::error::{Error, Result};
use crate::node::{Node, NodeSet};

/// A group of nodes that shares one copy of replicated data: a package (socket) with its
/// nodes and the CPU-less memory nodes attached to it (see [`Topology::domains`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Domain {
    id: usize,
    nodes: NodeSet,
    package: Option<u32>,
}

impl Domain {
    /// The domain's number: 0, 1, ... in the order of each domain's lowest node.
    pub fn id(&self) -> usize {
        self.id
    }

    /// The domain's nodes (never empty).
    pub fn nodes(&self) -> NodeSet {
        self.nodes
    }

    /// The package (`physical_package_id`) of the domain's CPUs; `None` where it is not
    /// known and the domain is one node's.
    pub fn package(&self) -> Option<u32> {
        self.package
    }
}

impl Topology {
    /// The machine's domains, in the order of their lowest node; every online node is in
    /// exactly one. Without a NUMA view of sysfs: one domain, node 0.
    pub fn domains(&self) -> &[Domain] {
        &self.domains
    }

    /// The domain holding `node` (`None`: the node is not online here).
    pub fn domain_of(&self, node: Node) -> Option<&Domain> {
        self.domains().iter().find(|d| d.nodes.contains(node))
    }

    /// The nodes of `set` grouped by domain, in the order of each group's lowest node; a
    /// node of `set` that is in no domain (not online) is a group of its own. Empty
    /// groups are left out.
    pub fn domains_within(&self, set: &NodeSet) -> Vec<NodeSet> {
        let mut groups: Vec<NodeSet> = self
            .domains()
            .iter()
            .map(|d| d.nodes.intersection(set))
            .filter(|g| !g.is_empty())
            .collect();
        let covered = groups.iter().fold(NodeSet::new(), |all, g| all.union(g));
        groups.extend(set.difference(&covered).iter().map(single));
        groups.sort_by_key(|g| g.nth(0));
        groups
    }
}

/// The one domain of a machine without a NUMA view of sysfs: node 0.
pub(super) fn node0() -> Domain {
    Domain {
        id: 0,
        nodes: single(Node(0)),
        package: None,
    }
}

fn single(node: Node) -> NodeSet {
    std::iter::once(node).collect()
}

/// The domains of the `online` nodes of the sysfs tree at `system`, given the CPUs and
/// distances already read into `topology`.
pub(super) fn read(system: &Path, online: &NodeSet, topology: &Topology) -> Result<Vec<Domain>> {
    let mut with_cpus = NodeSet::new();
    let mut packages: BTreeMap<u32, NodeSet> = BTreeMap::new();
    let mut groups: Vec<(NodeSet, Option<u32>)> = Vec::new();
    for node in online.iter() {
        let cpus = topology.cpus_of(node);
        if cpus.is_empty() {
            continue;
        }
        with_cpus.insert(node);
        match package_of(system, &cpus)? {
            Some(package) => packages.entry(package).or_default().insert(node),
            None => groups.push((single(node), None)),
        }
    }
    groups.extend(packages.into_iter().map(|(p, nodes)| (nodes, Some(p))));
    for node in online.difference(&with_cpus).iter() {
        let anchor = anchor_of(system, node, &with_cpus, topology)?;
        match anchor.and_then(|a| groups.iter_mut().find(|(g, _)| g.contains(a))) {
            Some((group, _)) => group.insert(node),
            None => groups.push((single(node), None)),
        }
    }
    groups.sort_by_key(|(g, _)| g.nth(0));
    Ok(groups
        .into_iter()
        .enumerate()
        .map(|(id, (nodes, package))| Domain { id, nodes, package })
        .collect())
}

/// The one package of `cpus` (`None`: a file missing, `-1`, or CPUs in different
/// packages).
fn package_of(system: &Path, cpus: &[usize]) -> Result<Option<u32>> {
    let mut found = None;
    for cpu in cpus {
        let path = system.join(format!("cpu/cpu{cpu}/topology/physical_package_id"));
        let text = read_optional(&path)?;
        let text = text.trim();
        if text.is_empty() {
            return Ok(None);
        }
        let id: i64 = text.parse().map_err(|_| Error::Unparsable {
            path: path.display().to_string(),
            what: "a package id",
            found: text.chars().take(64).collect(),
        })?;
        let Ok(id) = u32::try_from(id) else {
            return Ok(None);
        };
        if found.is_some_and(|f| f != id) {
            return Ok(None);
        }
        found = Some(id);
    }
    Ok(found)
}

/// The node with CPUs whose domain the CPU-less `node` joins: the nearest of its
/// initiators with CPUs, else the nearest node with CPUs by distance (ties to the lowest
/// id); `None` where neither is known.
fn anchor_of(
    system: &Path,
    node: Node,
    with_cpus: &NodeSet,
    topology: &Topology,
) -> Result<Option<Node>> {
    let initiators = initiators(system, node)?.intersection(with_cpus);
    if !initiators.is_empty() {
        return Ok(topology.nearest(node, &initiators));
    }
    let known: NodeSet = with_cpus
        .iter()
        .filter(|&n| topology.distance(node, n).is_some())
        .collect();
    Ok(topology.nearest(node, &known))
}

/// The nodes listed in `node/nodeN/access0/initiators/` (entries `nodeM`; the directory
/// also holds bandwidth and latency files). Empty where the directory does not exist.
fn initiators(system: &Path, node: Node) -> Result<NodeSet> {
    let dir = system.join(format!("node/node{node}/access0/initiators"));
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(NodeSet::new()),
        Err(e) => return Err(Error::io("read_dir", dir.display().to_string(), e)),
    };
    let mut nodes = NodeSet::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("read_dir", dir.display().to_string(), e))?;
        let name = entry.file_name();
        let id = name
            .to_str()
            .and_then(|n| n.strip_prefix("node"))
            .and_then(|id| id.parse::<u16>().ok());
        if let Some(id) = id {
            nodes.insert(Node(id));
        }
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::super::fake_sysfs::FakeSysfs;
    use super::*;

    /// Each domain's nodes and package, in order.
    fn shape(system: &FakeSysfs) -> Vec<(String, Option<u32>)> {
        let t = Topology::read_from(system.path()).unwrap();
        for (i, d) in t.domains().iter().enumerate() {
            assert_eq!(d.id(), i, "ids in order");
        }
        t.domains()
            .iter()
            .map(|d| (d.nodes().to_string(), d.package()))
            .collect()
    }

    fn domains(list: &[(&str, Option<u32>)]) -> Vec<(String, Option<u32>)> {
        list.iter().map(|(n, p)| (n.to_string(), *p)).collect()
    }

    /// Two sockets in SNC-2/NPS2 mode: nodes 0,1 on package 0, nodes 2,3 on package 1.
    const SNC_DISTANCES: &[&[u32]] = &[
        &[10, 12, 21, 21],
        &[12, 10, 21, 21],
        &[21, 21, 10, 12],
        &[21, 21, 12, 10],
    ];

    #[test]
    fn sub_numa_clusters_share_their_socket() {
        let s = FakeSysfs::new();
        s.nodes(&["0-1", "2-3", "4-5", "6-7"], SNC_DISTANCES)
            .package(0..=3, "0")
            .package(4..=7, "1");
        assert_eq!(shape(&s), domains(&[("0,1", Some(0)), ("2,3", Some(1))]));
        let t = Topology::read_from(s.path()).unwrap();
        assert_eq!(t.domain_of(Node(3)).map(Domain::id), Some(1));
        assert_eq!(t.domain_of(Node(4)), None, "not online");
        let set = NodeSet::from_nodes([1, 2, 3, 9]).unwrap();
        let within: Vec<String> = t
            .domains_within(&set)
            .iter()
            .map(|g| g.to_string())
            .collect();
        assert_eq!(
            within,
            ["1", "2,3", "9"],
            "node 9 is in no domain: its own group"
        );
    }

    #[test]
    fn packages_need_not_follow_node_order() {
        // Package 1 holds nodes 0 and 2, package 0 node 1: ids follow the lowest node.
        let s = FakeSysfs::new();
        s.nodes(
            &["0", "1", "2"],
            &[&[10, 20, 12], &[20, 10, 20], &[12, 20, 10]],
        )
        .package(0..=0, "1")
        .package(1..=1, "0")
        .package(2..=2, "1");
        assert_eq!(shape(&s), domains(&[("0,2", Some(1)), ("1", Some(0))]));
    }

    #[test]
    fn unknown_packages_leave_each_node_alone() {
        // -1 (some VMs), a missing file (an offline CPU's topology), CPUs of one node in
        // two packages: no merging on a guess.
        let s = FakeSysfs::new();
        s.nodes(&["0", "1", "2", "3", "4-5"], &[&[10u32; 5][..]; 5])
            .package(0..=0, "-1")
            .package(1..=1, "-1")
            .package(3..=3, "0")
            .package(4..=4, "0")
            .package(5..=5, "1");
        assert_eq!(
            shape(&s),
            domains(&[
                ("0", None),
                ("1", None),
                ("2", None),
                ("3", Some(0)),
                ("4", None)
            ])
        );
    }

    #[test]
    fn a_cxl_node_joins_its_nearest_socket() {
        // Node 2 has memory and no CPUs, 25 from node 1 and 30 from node 0.
        let s = FakeSysfs::new();
        s.nodes(
            &["0-1", "2-3", ""],
            &[&[10, 21, 30], &[21, 10, 25], &[30, 25, 10]],
        )
        .package(0..=1, "0")
        .package(2..=3, "1");
        assert_eq!(shape(&s), domains(&[("0", Some(0)), ("1,2", Some(1))]));
        // At equal distance, the lower id's socket.
        let s = FakeSysfs::new();
        s.nodes(
            &["0", "1", ""],
            &[&[10, 21, 30], &[21, 10, 30], &[30, 30, 10]],
        )
        .package(0..=0, "0")
        .package(1..=1, "1");
        assert_eq!(shape(&s), domains(&[("0,2", Some(0)), ("1", Some(1))]));
    }

    #[test]
    fn initiators_win_over_distances() {
        // HMAT names node 0 as node 2's initiator although SLIT puts node 1 nearer.
        let s = FakeSysfs::new();
        s.nodes(
            &["0", "1", ""],
            &[&[10, 21, 30], &[21, 10, 25], &[30, 25, 10]],
        )
        .package(0..=0, "0")
        .package(1..=1, "1")
        .initiator(2, 0);
        assert_eq!(shape(&s), domains(&[("0,2", Some(0)), ("1", Some(1))]));
        // An initiator without CPUs (another memory node) is no anchor: distances decide.
        let s = FakeSysfs::new();
        s.nodes(
            &["0", "1", ""],
            &[&[10, 21, 30], &[21, 10, 25], &[30, 25, 10]],
        )
        .package(0..=0, "0")
        .package(1..=1, "1")
        .initiator(2, 2);
        assert_eq!(shape(&s), domains(&[("0", Some(0)), ("1,2", Some(1))]));
    }

    #[test]
    fn odd_trees_give_a_topology_or_an_error_never_a_panic() {
        // No NUMA sysfs at all: node 0 is the one domain.
        let s = FakeSysfs::new();
        assert_eq!(shape(&s), domains(&[("0", None)]));
        // Online nodes without any file below them: each its own domain, no CPUs.
        let s = FakeSysfs::new();
        s.write("node/online", "0-2\n");
        assert_eq!(shape(&s), domains(&[("0", None), ("1", None), ("2", None)]));
        // A CPU-less node without distances or initiators stays alone.
        let s = FakeSysfs::new();
        s.write("node/online", "0-1\n")
            .write("node/node0/cpulist", "0\n")
            .package(0..=0, "0");
        assert_eq!(shape(&s), domains(&[("0", Some(0)), ("1", None)]));
        // Package ids past u32: unknown. Garbage: an error naming the file.
        let s = FakeSysfs::new();
        s.nodes(&["0"], &[&[10]]).package(0..=0, "99999999999");
        assert_eq!(shape(&s), domains(&[("0", None)]));
        s.package(0..=0, "socket");
        let e = Topology::read_from(s.path()).unwrap_err().to_string();
        assert!(
            e.contains("physical_package_id") && e.contains("socket"),
            "{e}"
        );
        // Garbage in the online list, a short distance row, a huge node id.
        s.write("node/online", "0-x\n");
        assert!(Topology::read_from(s.path()).is_err());
        s.write("node/online", "0-2000\n");
        assert!(Topology::read_from(s.path()).is_err());
        let s = FakeSysfs::new();
        s.nodes(&["0", ""], &[&[10], &[]]).package(0..=0, "0");
        assert_eq!(shape(&s), domains(&[("0", Some(0)), ("1", None)]));
    }

    #[test]
    fn this_machine_has_domains_covering_its_nodes() {
        let t = Topology::get().unwrap();
        assert!(!t.domains().is_empty());
        let node = crate::topology::current_node().unwrap();
        let here = crate::topology::current_domain().unwrap();
        assert!(here.nodes().contains(node), "{here:?} {node}");
    }
}
