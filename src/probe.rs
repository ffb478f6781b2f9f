//! What this process may do here, and the machine it runs on: the syscall families
//! (probed in `calls`), the nodes, distances, free memory, THP, the map budget and the
//! capabilities.

use std::fmt;

use crate::calls::populate_write_works;
pub use crate::calls::{
    MempolicySupport, SyscallGroup, anon_vma_names_supported, group_support, mempolicy_support,
    page_calls_support,
};
use crate::diag;
use crate::error::Result;
use crate::node::{self, Node, NodeSet};

/// Transparent huge page mode (`/sys/kernel/mm/transparent_hugepage/enabled`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum ThpMode {
    /// Every suitable anonymous mapping.
    Always,
    /// Only where `MADV_HUGEPAGE` asks.
    Madvise,
    /// Never.
    Never,
    /// The file is missing or unknown.
    Unknown,
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
///
/// With the `serde` feature it serializes field by field: the states and the THP mode as
/// lowercase words (`"available"`, `"madvise"`), node sets as their
/// [`Display`](fmt::Display) strings, nodes as numbers.
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Support {
    /// Whether the policy calls work here (placement: `mbind`, `set_mempolicy`, ...).
    pub mempolicy: MempolicySupport,
    /// Whether the page calls work here (`move_pages` queries and moves,
    /// `migrate_pages`); without them placement is read from `/proc/self/numa_maps`.
    pub page_calls: MempolicySupport,
    /// Node ids the kernel can have.
    pub possible_nodes: usize,
    /// Nodes with memory (`has_memory`); node 0 without NUMA sysfs.
    pub nodes_with_memory: NodeSet,
    /// Nodes with CPUs (`has_cpu`).
    pub nodes_with_cpus: NodeSet,
    /// This process's `Mems_allowed_list`.
    pub mems_allowed: NodeSet,
    /// `distance` rows: for each node with a row, its distance to nodes 0, 1, ...
    pub distances: Vec<(Node, Vec<u32>)>,
    /// Bytes each node can give a bound allocation: `MemFree + Inactive(file)` of its
    /// meminfo, the figure the store's memory checks and the planner use too (see
    /// [`PinStore::check_model_memory`](crate::store::PinStore::check_model_memory)).
    pub free_bytes: Vec<(Node, u64)>,
    /// `kernel.numa_balancing` (`None` when absent).
    pub numa_balancing: Option<u32>,
    /// THP mode.
    pub thp: ThpMode,
    /// `vm.max_map_count`.
    pub max_map_count: usize,
    /// Mappings this process has now.
    pub map_count: usize,
    /// Whether `CAP_SYS_NICE` is effective (needed for `MOVE_ALL` and moving other
    /// processes' pages; in a child user namespace it does not reach host resources).
    pub cap_sys_nice: bool,
    /// Whether `MADV_POPULATE_WRITE` (Linux 5.14) works.
    pub populate_write: bool,
    /// Whether anonymous mappings can be named (`PR_SET_VMA_ANON_NAME`, Linux 5.17 with
    /// `CONFIG_ANON_VMA_NAME`): stores then name their regions, `[anon:numapin 3 L12
    /// weights]` in `/proc/PID/maps` (see [`Region::set_name`](crate::Region::set_name)).
    #[cfg_attr(feature = "serde", serde(default))]
    pub anon_vma_names: bool,
}

impl Support {
    /// Nodes with memory that this process may allocate on.
    pub fn allowed(&self) -> NodeSet {
        self.mems_allowed.intersection(&self.nodes_with_memory)
    }
}

/// Probes everything in [`Support`].
///
/// # Errors
/// As [`mempolicy_support`] and [`page_calls_support`], or a procfs/sysfs file this needs cannot be read.
///
/// # Example
/// ```
/// let support = numapin::probe().unwrap();
/// println!("{support}");
/// ```
pub fn probe() -> Result<Support> {
    let mempolicy = mempolicy_support()?;
    let page_calls = page_calls_support()?;
    let nodes_with_memory = node::read_sysfs_nodes("has_memory")?.unwrap_or_else(node0);
    let nodes_with_cpus = node::read_sysfs_nodes("has_cpu")?.unwrap_or_else(node0);
    let mut distances = Vec::new();
    let mut free_bytes = Vec::new();
    let online = node::read_sysfs_nodes("online")?.unwrap_or_else(node0);
    for n in online.iter() {
        let dir = format!("/sys/devices/system/node/node{n}");
        if let Ok(text) = std::fs::read_to_string(format!("{dir}/distance")) {
            distances.push((
                n,
                text.split_whitespace()
                    .filter_map(|d| d.parse().ok())
                    .collect(),
            ));
        }
        // The one figure of free memory, the store's checks' too.
        if let Ok(Some(bytes)) = crate::topology::available_bytes(n) {
            free_bytes.push((n, bytes));
        }
    }
    let numa_balancing = std::fs::read_to_string("/proc/sys/kernel/numa_balancing")
        .ok()
        .and_then(|t| t.trim().parse().ok());
    let thp = match std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled") {
        Ok(t) if t.contains("[always]") => ThpMode::Always,
        Ok(t) if t.contains("[madvise]") => ThpMode::Madvise,
        Ok(t) if t.contains("[never]") => ThpMode::Never,
        _ => ThpMode::Unknown,
    };
    Ok(Support {
        mempolicy,
        page_calls,
        possible_nodes: node::possible_node_count(),
        nodes_with_memory,
        nodes_with_cpus,
        mems_allowed: node::mems_allowed()?,
        distances,
        free_bytes,
        numa_balancing,
        thp,
        max_map_count: diag::max_map_count()?,
        map_count: diag::map_count()?,
        cap_sys_nice: caps::has_cap(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_SYS_NICE,
        )
        .unwrap_or(false),
        populate_write: populate_write_works(),
        anon_vma_names: anon_vma_names_supported(),
    })
}

fn node0() -> NodeSet {
    std::iter::once(Node(0)).collect()
}

/// A support state with the errno behind it.
fn state_text(state: MempolicySupport) -> &'static str {
    match state {
        MempolicySupport::Available => "available",
        MempolicySupport::Denied => "denied (EPERM)",
        MempolicySupport::Unsupported => "unsupported (ENOSYS)",
    }
}

impl fmt::Display for Support {
    /// One `label value` row per fact, every value starting in the same column; the
    /// distances as a table under a header of the node ids they lead to.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let yes = |b: bool| if b { "yes" } else { "no" }.to_string();
        let nodes = |set: &NodeSet| {
            if set.is_empty() {
                "none".to_string()
            } else {
                set.to_string()
            }
        };
        let mut rows: Vec<(String, String)> = vec![
            ("mempolicy".into(), state_text(self.mempolicy).into()),
            ("page calls".into(), state_text(self.page_calls).into()),
            ("possible nodes".into(), self.possible_nodes.to_string()),
            ("nodes with memory".into(), nodes(&self.nodes_with_memory)),
            ("nodes with CPUs".into(), nodes(&self.nodes_with_cpus)),
            ("mems_allowed".into(), nodes(&self.mems_allowed)),
            ("allowed (usable)".into(), nodes(&self.allowed())),
        ];
        // One width for the header and every distance, so the table's columns line up.
        let square = self
            .distances
            .iter()
            .all(|(_, row)| row.len() == self.distances.len());
        let ids = self.distances.iter().map(|(n, _)| n.to_string().len());
        let distances = self.distances.iter().flat_map(|(_, row)| row);
        let width = distances
            .map(|d| d.to_string().len())
            .chain(ids.filter(|_| square))
            .max()
            .unwrap_or(0);
        let row_text = |values: &[String]| {
            values
                .iter()
                .map(|v| format!("{v:>width$}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        if square && !self.distances.is_empty() {
            let ids: Vec<String> = self.distances.iter().map(|(n, _)| n.to_string()).collect();
            rows.push(("distance to node".into(), row_text(&ids)));
        }
        for (n, row) in &self.distances {
            let row: Vec<String> = row.iter().map(u32::to_string).collect();
            rows.push((format!("distance from {n}"), row_text(&row)));
        }
        let free: Vec<String> = self
            .free_bytes
            .iter()
            .map(|(_, bytes)| format!("{:.1}", *bytes as f64 / (1u64 << 30) as f64))
            .collect();
        let free_width = free.iter().map(String::len).max().unwrap_or(0);
        for ((n, _), gib) in self.free_bytes.iter().zip(&free) {
            rows.push((
                format!("free on node {n}"),
                format!("{gib:>free_width$} GiB"),
            ));
        }
        let balancing = self
            .numa_balancing
            .map_or("absent".into(), |v| v.to_string());
        rows.push(("numa_balancing".into(), balancing));
        rows.push(("THP".into(), format!("{:?}", self.thp).to_lowercase()));
        rows.push((
            "maps".into(),
            format!(
                "{} of vm.max_map_count {}",
                self.map_count, self.max_map_count
            ),
        ));
        rows.push(("CAP_SYS_NICE".into(), yes(self.cap_sys_nice)));
        rows.push(("MADV_POPULATE_WRITE".into(), yes(self.populate_write)));
        rows.push(("anonymous mapping names".into(), yes(self.anon_vma_names)));
        let label = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
        for (i, (name, value)) in rows.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{name:<label$} {value}")?;
        }
        Ok(())
    }
}
