//! [`Machine`]: what the planner knows of a machine — its nodes, their domains (sockets),
//! distances, free memory, and how many mappings a process may still make. Read from the
//! live machine ([`Machine::live`]) or from a small description file
//! ([`Machine::from_json`]), so that a plan can be made for a machine one does not have.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result, shown};
use crate::nodeset::Node;
use crate::topology::Topology;

const OP: &str = "Machine::from_json";

/// One node of a [`Machine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineNode {
    /// The node id.
    pub node: Node,
    /// Its domain (socket): an index into [`Machine::domains`].
    pub domain: usize,
    /// Free memory, in bytes. [`Machine::live`] reads the store's figure, `MemFree +
    /// Inactive(file)` of the node's meminfo (free pages plus the clean page cache the
    /// kernel reclaims first), so that a row that fits is a layout `place` accepts.
    pub free_bytes: u64,
    /// Whether it has CPUs: threads that read experts run only on nodes with CPUs (CXL or
    /// HBM memory nodes have none).
    pub cpus: bool,
}

/// A machine as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// The nodes, by increasing id.
    pub nodes: Vec<MachineNode>,
    /// `distances[i][j]`: the SLIT distance from `nodes[i]` to `nodes[j]`.
    pub distances: Vec<Vec<u32>>,
    /// Mappings a process may still make (`vm.max_map_count` less what it has).
    pub map_limit: usize,
}

impl Machine {
    /// The domains: for each, the indices (into [`Machine::nodes`]) of its nodes.
    pub fn domains(&self) -> Vec<Vec<usize>> {
        // Keyed by the domain number, not indexed by it: a machine built by hand may
        // number its domains anyhow (`usize::MAX` included).
        let mut domains: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (i, n) in self.nodes.iter().enumerate() {
            domains.entry(n.domain).or_default().push(i);
        }
        domains.into_values().collect()
    }

    /// This machine: the nodes this process may allocate on (mems_allowed with memory),
    /// their free memory and distances, and `vm.max_map_count` less the mappings the
    /// process has; the domains (sockets) as [`Topology::domains`] reads them.
    ///
    /// # Errors
    /// The probe fails, or no node is allowed.
    pub fn live() -> Result<Machine> {
        let support = crate::probe::probe()?;
        let mut allowed = support.mems_allowed;
        if allowed.is_empty() {
            allowed = support.nodes_with_memory;
        }
        let ids: Vec<Node> = allowed.iter().collect();
        if ids.is_empty() {
            return Err(Error::empty("Machine::live", "nodes this process may use"));
        }
        let nodes = ids
            .iter()
            .map(|&node| MachineNode {
                node,
                domain: live_domain_of(node, &ids),
                free_bytes: support
                    .free_bytes
                    .iter()
                    .find(|(n, _)| *n == node)
                    .map_or(0, |(_, b)| *b),
                cpus: support.nodes_with_cpus.contains(node) || support.nodes_with_cpus.is_empty(),
            })
            .collect();
        let distance = |a: Node, b: Node| {
            support
                .distances
                .iter()
                .find(|(n, _)| *n == a)
                .and_then(|(_, row)| row.get(usize::from(b.0)).copied())
                .unwrap_or(if a == b { 10 } else { 20 })
        };
        let distances = ids
            .iter()
            .map(|&a| ids.iter().map(|&b| distance(a, b)).collect())
            .collect();
        let machine = Machine {
            nodes,
            distances,
            map_limit: support.max_map_count.saturating_sub(support.map_count),
        };
        machine.check("Machine::live")?;
        Ok(machine)
    }

    /// Reads a description:
    ///
    /// ```json
    /// {"numapin_topology": 1,
    ///  "nodes": [{"id": 0, "domain": 0, "free_bytes": 206158430208, "cpus": true},
    ///            {"id": 1, "domain": 0, "free_bytes": 206158430208}],
    ///  "distances": [[10, 12], [12, 10]],
    ///  "max_map_count": 65530}
    /// ```
    /// `domain` is any number naming the node's socket (nodes with the same number share
    /// it; omitted: the node is its own domain); `cpus` defaults to true; `distances` is
    /// in the order of `nodes` (omitted: 10 on the diagonal, 20 elsewhere);
    /// `max_map_count` defaults to 65530 (Linux's default).
    ///
    /// # Errors
    /// Text past 16 MiB; not JSON, an object key given twice, a version other than 1, no nodes, a node id twice or past the kernel's
    /// limit, a missing or non-integer field, a distance matrix of the wrong size, no node
    /// with CPUs, or a domain with no memory — each naming what was wrong.
    pub fn from_json(text: &str) -> Result<Machine> {
        crate::routing::check_len(OP, text)?;
        let root: Value = crate::routing::strict::from_str(text)
            .map_err(|e| Error::bad_value(OP, "topology description", "the text", e.to_string()))?;
        check_version(&root)?;
        let nodes = read_nodes(&root)?;
        let n = nodes.len();
        let distances = match root.get("distances") {
            None => (0..n)
                .map(|i| (0..n).map(|j| if i == j { 10 } else { 20 }).collect())
                .collect(),
            Some(d) => read_distances(d, n)?,
        };
        let machine = Machine {
            nodes,
            distances,
            map_limit: read_map_limit(&root)?,
        }
        .sorted_by_id();
        machine.check(OP)?;
        Ok(machine)
    }

    /// The same machine with its nodes by increasing id, and the distances along: a
    /// description may list its nodes in any order.
    fn sorted_by_id(mut self) -> Machine {
        let mut order: Vec<usize> = (0..self.nodes.len()).collect();
        order.sort_by_key(|&i| self.nodes[i].node);
        self.nodes = order.iter().map(|&i| self.nodes[i].clone()).collect();
        self.distances = order
            .iter()
            .map(|&i| order.iter().map(|&j| self.distances[i][j]).collect())
            .collect();
        self
    }

    /// Reads a description file ([`Machine::from_json`]).
    ///
    /// # Errors
    /// The file cannot be read, or as [`Machine::from_json`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Machine> {
        let text = crate::routing::read_text("Machine::from_file", path.as_ref())?;
        Machine::from_json(&text)
    }

    /// No nodes, nodes out of order or a node twice, a distance matrix that is not
    /// nodes × nodes or holds a 0, no node with CPUs, a domain without memory. The
    /// fields are public: [`plan`](super::plan) checks a machine built by hand too.
    pub(super) fn check(&self, op: &'static str) -> Result<()> {
        if self.nodes.is_empty() {
            return Err(Error::empty(op, "nodes in the topology"));
        }
        let n = self.nodes.len();
        if self.distances.len() != n {
            return Err(Error::mismatch(
                op,
                "rows of distances against nodes",
                n,
                self.distances.len(),
            ));
        }
        for (i, row) in self.distances.iter().enumerate() {
            if row.len() != n {
                return Err(Error::mismatch(
                    op,
                    format!("columns of distances[{i}] against nodes"),
                    n,
                    row.len(),
                ));
            }
            if let Some(j) = row.iter().position(|&d| d == 0) {
                return Err(Error::bad_value(
                    op,
                    "distances",
                    format!("distances[{i}][{j}] = 0"),
                    "a positive integer",
                ));
            }
        }
        for w in self.nodes.windows(2) {
            if w[0].node > w[1].node {
                return Err(Error::bad_value(
                    op,
                    "node id",
                    w[1].node.0,
                    "nodes are listed by increasing id",
                ));
            }
            if w[0].node == w[1].node {
                return Err(Error::bad_value(
                    op,
                    "node id",
                    w[0].node.0,
                    "a node is listed twice",
                ));
            }
        }
        if !self.nodes.iter().any(|n| n.cpus) {
            return Err(Error::empty(
                op,
                "nodes with CPUs (nothing would read the experts)",
            ));
        }
        for (d, members) in self.domains().iter().enumerate() {
            if members.iter().all(|&i| self.nodes[i].free_bytes == 0) {
                let ids: Vec<String> = members
                    .iter()
                    .map(|&i| self.nodes[i].node.0.to_string())
                    .collect();
                return Err(Error::bad_value(
                    op,
                    "domain",
                    d,
                    format!("domain {d} (nodes {}) has no free memory", ids.join(",")),
                ));
            }
        }
        Ok(())
    }
}

/// The domain of `node` among `nodes` on the live machine, as an index: the topology's
/// domains ([`Topology::domains`]) numbered in the order `nodes` first meets them. A node
/// the topology does not place (or a topology that cannot be read) is a domain of its own.
fn live_domain_of(node: Node, nodes: &[Node]) -> usize {
    let topology = Topology::get().ok();
    let key = |n: Node| match topology.and_then(|t| t.domain_of(n)) {
        Some(domain) => (true, domain.id()),
        None => (false, usize::from(n.0)),
    };
    let mut seen: Vec<(bool, usize)> = Vec::new();
    for &n in nodes {
        if !seen.contains(&key(n)) {
            seen.push(key(n));
        }
    }
    seen.iter().position(|&k| k == key(node)).unwrap_or(0)
}

/// A description's `numapin_topology`: only version 1 is understood.
fn check_version(root: &Value) -> Result<()> {
    if root.get("numapin_topology").and_then(Value::as_u64) != Some(1) {
        return Err(Error::bad_value(
            OP,
            "numapin_topology",
            root.get("numapin_topology").map_or("nothing".into(), shown),
            "the format version must be 1",
        ));
    }
    Ok(())
}

/// A description's `nodes`, in the file's order.
fn read_nodes(root: &Value) -> Result<Vec<MachineNode>> {
    let list = root
        .get("nodes")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::bad_value(OP, "nodes", "nothing", "an array of node objects"))?;
    let mut nodes = Vec::with_capacity(list.len());
    // Explicit domain numbers, and a key of their own for nodes that name none (a
    // number taken from the id could collide with an explicit one).
    let mut domain_ids: Vec<Option<u64>> = Vec::new();
    for (i, v) in list.iter().enumerate() {
        nodes.push(read_node(i, v, &mut domain_ids)?);
    }
    Ok(nodes)
}

/// `nodes[i]`. Its domain is its place in `domain_ids` (the domains met so far, by their
/// number in the file), which a node naming a new domain, or none, extends.
fn read_node(i: usize, v: &Value, domain_ids: &mut Vec<Option<u64>>) -> Result<MachineNode> {
    let int = |key: &'static str| {
        v.get(key).and_then(Value::as_u64).ok_or_else(|| {
            Error::bad_value(
                OP,
                key,
                v.get(key).map_or("nothing".into(), shown),
                format!("nodes[{i}].{key} must be an integer from 0"),
            )
        })
    };
    let id = int("id")?;
    let node = u16::try_from(id)
        .ok()
        .filter(|&n| usize::from(n) < crate::nodeset::MAX_NODES)
        .map(Node)
        .ok_or_else(|| {
            Error::no_such_node(
                OP,
                format!("nodes[{i}].id"),
                id as usize,
                crate::nodeset::MAX_NODES,
                None,
            )
        })?;
    let domain_id = match v.get("domain") {
        None => None,
        Some(_) => Some(int("domain")?),
    };
    let found = domain_id.and_then(|d| domain_ids.iter().position(|&x| x == Some(d)));
    let domain = match found {
        Some(d) => d,
        None => {
            domain_ids.push(domain_id);
            domain_ids.len() - 1
        }
    };
    let cpus = match v.get("cpus") {
        None => true,
        Some(c) => c.as_bool().ok_or_else(|| {
            Error::bad_value(
                OP,
                "cpus",
                shown(c),
                format!("nodes[{i}].cpus must be true or false"),
            )
        })?,
    };
    Ok(MachineNode {
        node,
        domain,
        free_bytes: int("free_bytes")?,
        cpus,
    })
}

/// A description's `max_map_count`; Linux's default when it names none.
fn read_map_limit(root: &Value) -> Result<usize> {
    Ok(match root.get("max_map_count") {
        None => 65530,
        Some(v) => v
            .as_u64()
            .and_then(|m| usize::try_from(m).ok())
            .ok_or_else(|| Error::bad_value(OP, "max_map_count", shown(v), "an integer from 0"))?,
    })
}

fn read_distances(d: &Value, n: usize) -> Result<Vec<Vec<u32>>> {
    let bad = |why: String| Error::bad_value(OP, "distances", "the matrix", why);
    let rows = d
        .as_array()
        .ok_or_else(|| bad("an array of arrays".into()))?;
    if rows.len() != n {
        return Err(Error::mismatch(
            OP,
            "rows of distances against nodes",
            n,
            rows.len(),
        ));
    }
    let mut out = Vec::with_capacity(n);
    for (i, row) in rows.iter().enumerate() {
        let row = row
            .as_array()
            .ok_or_else(|| bad(format!("distances[{i}] is not an array")))?;
        if row.len() != n {
            return Err(Error::mismatch(
                OP,
                format!("columns of distances[{i}] against nodes"),
                n,
                row.len(),
            ));
        }
        let mut r = Vec::with_capacity(n);
        for (j, v) in row.iter().enumerate() {
            let x = v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .filter(|&x| x > 0)
                .ok_or_else(|| {
                    bad(format!(
                        "distances[{i}][{j}] = {}: a positive integer",
                        shown(v)
                    ))
                })?;
            r.push(x);
        }
        out.push(r);
    }
    Ok(out)
}
