//! What this process may do here, and the machine it runs on.
//!
//! # Safety
//!
//! The probes map one page of their own, ask `mbind` and `move_pages` about it and unmap
//! it; `migrate_pages` is asked with empty node masks, which moves nothing.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::OnceLock;

use numapin_sys as sys;

use crate::diag;
use crate::error::{Errno, Error, Result};
use crate::node::{self, KernelMask, Node, NodeSet};
use crate::policy::DegradeReason;

/// Whether a group of NUMA syscalls works in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum MempolicySupport {
    /// The call answered its capability-free probe.
    Available,
    /// `EPERM`: denied whatever the arguments (a container's seccomp profile).
    Denied,
    /// `ENOSYS`: the kernel has no NUMA support.
    Unsupported,
}

impl MempolicySupport {
    /// The degradation this state implies, if any.
    pub fn degrade_reason(self) -> Option<DegradeReason> {
        match self {
            MempolicySupport::Available => None,
            MempolicySupport::Denied => Some(DegradeReason::Denied),
            MempolicySupport::Unsupported => Some(DegradeReason::Unsupported),
        }
    }

    fn from_probe(result: std::result::Result<(), Errno>) -> std::result::Result<Self, Errno> {
        match result {
            Ok(()) => Ok(MempolicySupport::Available),
            Err(Errno::PERM) => Ok(MempolicySupport::Denied),
            Err(Errno::NOSYS) => Ok(MempolicySupport::Unsupported),
            Err(e) => Err(e),
        }
    }
}

/// The NUMA syscalls, grouped as container profiles gate them.
///
/// Docker's default seccomp profile (moby `profiles/seccomp/default.json`) allows the
/// policy calls only with `CAP_SYS_NICE` and the page calls never: with
/// `--cap-add SYS_NICE` binding works while `move_pages` and `migrate_pages` get `EPERM`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SyscallGroup {
    /// `mbind`, `set_mempolicy`, `get_mempolicy`, `set_mempolicy_home_node`.
    Policy,
    /// `move_pages`, `migrate_pages`.
    Pages,
}

/// One probed syscall: what judges an errno from a real call (see
/// [`crate::policy::degrade_or_error`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NumaCall {
    Mbind,
    SetMempolicy,
    GetMempolicy,
    MovePages,
    MigratePages,
}

impl NumaCall {
    /// The C name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            NumaCall::Mbind => "mbind",
            NumaCall::SetMempolicy => "set_mempolicy",
            NumaCall::GetMempolicy => "get_mempolicy",
            NumaCall::MovePages => "move_pages",
            NumaCall::MigratePages => "migrate_pages",
        }
    }

    /// What the probe found for this call: the policy calls share `mbind`'s probe (a
    /// profile gates them together); each page call has its own.
    ///
    /// # Errors
    /// The probe met an errno other than `EPERM`/`ENOSYS`.
    pub(crate) fn support(self) -> Result<MempolicySupport> {
        match self {
            NumaCall::Mbind | NumaCall::SetMempolicy | NumaCall::GetMempolicy => {
                mempolicy_support()
            }
            NumaCall::MovePages => move_pages_support(),
            NumaCall::MigratePages => migrate_pages_support(),
        }
    }
}

/// Runs a probe once per process and keeps its answer.
fn once(
    cell: &'static OnceLock<std::result::Result<MempolicySupport, Errno>>,
    probe: fn() -> std::result::Result<MempolicySupport, Errno>,
    op: &'static str,
    args: &'static str,
) -> Result<MempolicySupport> {
    cell.get_or_init(probe)
        .map_err(|errno| Error::os(op, errno, format_args!("probe: {args}")))
}

/// Whether the policy calls work here: probed once per process, with
/// `mbind(MPOL_DEFAULT)` on a page-aligned page of its own (an unaligned address is
/// `EINVAL`, which must never pass for "no NUMA").
///
/// # Errors
/// An errno other than `EPERM`/`ENOSYS` from the probe: that is a bug or a kernel
/// this crate does not understand, not a state.
pub fn mempolicy_support() -> Result<MempolicySupport> {
    static SUPPORT: OnceLock<std::result::Result<MempolicySupport, Errno>> = OnceLock::new();
    once(
        &SUPPORT,
        probe_mbind,
        "mbind",
        "one page-aligned anonymous page, MPOL_DEFAULT, no mask, flags 0",
    )
}

/// Whether the page calls (`move_pages`, `migrate_pages`) work here, each probed once in
/// a form that needs no capability. `Available` only when both are; otherwise the
/// stronger refusal of the two (`Unsupported` over `Denied`).
///
/// # Errors
/// An errno from a probe that no state explains.
pub fn page_calls_support() -> Result<MempolicySupport> {
    Ok(move_pages_support()?.max(migrate_pages_support()?))
}

/// The support of a whole [`SyscallGroup`].
///
/// # Errors
/// As [`mempolicy_support`] and [`page_calls_support`].
pub fn group_support(group: SyscallGroup) -> Result<MempolicySupport> {
    match group {
        SyscallGroup::Policy => mempolicy_support(),
        SyscallGroup::Pages => page_calls_support(),
    }
}

fn move_pages_support() -> Result<MempolicySupport> {
    static SUPPORT: OnceLock<std::result::Result<MempolicySupport, Errno>> = OnceLock::new();
    once(
        &SUPPORT,
        probe_move_pages,
        "move_pages",
        "pid 0, one page of its own, no target nodes (a query), flags 0",
    )
}

fn migrate_pages_support() -> Result<MempolicySupport> {
    static SUPPORT: OnceLock<std::result::Result<MempolicySupport, Errno>> = OnceLock::new();
    once(
        &SUPPORT,
        probe_migrate_pages,
        "migrate_pages",
        "pid 0, empty old and new masks (EINVAL after the permission checks)",
    )
}

/// Maps one private page, hands it to `probe`, unmaps it.
fn with_probe_page(
    probe: impl FnOnce(*mut std::ffi::c_void, usize) -> std::result::Result<(), Errno>,
) -> std::result::Result<(), Errno> {
    let page = crate::page_size();
    // SAFETY: a fresh private page, unmapped below; nothing else refers to it.
    let ptr = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            page,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE,
        )
    }?;
    let result = probe(ptr, page);
    // SAFETY: unmapping the page mapped above, referenced by nothing.
    let _ = unsafe { rustix::mm::munmap(ptr, page) };
    result
}

fn probe_mbind() -> std::result::Result<MempolicySupport, Errno> {
    MempolicySupport::from_probe(with_probe_page(|ptr, page| {
        // SAFETY: our own page-aligned page; MPOL_DEFAULT with a null mask changes nothing.
        unsafe { sys::mbind(ptr, page, sys::MPOL_DEFAULT, std::ptr::null(), 0, 0) }
    }))
}

/// `move_pages` with no target nodes is a query of where the page is: no capability is
/// checked (only `MPOL_MF_MOVE_ALL` and another process's pages need one).
fn probe_move_pages() -> std::result::Result<MempolicySupport, Errno> {
    MempolicySupport::from_probe(with_probe_page(|ptr, _| {
        let pages = [ptr];
        let mut status = [0i32; 1];
        // SAFETY: one page of our own, one status slot; a query moves nothing.
        unsafe {
            sys::move_pages(
                0,
                1,
                pages.as_ptr(),
                std::ptr::null(),
                status.as_mut_ptr(),
                0,
            )
        }
        .map(drop)
    }))
}

/// `migrate_pages(0, maxnode, {}, {})`: the kernel (`kernel_migrate_pages` in
/// mm/mempolicy.c) reads both masks, checks that this process may touch itself and that
/// the new nodes are a subset of its cpuset (the empty set is, so `CAP_SYS_NICE` is
/// never asked), then finds the new set empty and answers `EINVAL` without moving
/// anything. So `EINVAL` here means "available"; a seccomp filter answers before the
/// kernel looks at the arguments.
fn probe_migrate_pages() -> std::result::Result<MempolicySupport, Errno> {
    let empty = KernelMask::empty(node::possible_node_count());
    let (old, new) = (empty, empty);
    // SAFETY: both masks hold `maxnode / 64` words; empty masks move nothing.
    let result =
        unsafe { sys::migrate_pages(0, old.maxnode(), old.words().as_ptr(), new.words().as_ptr()) };
    MempolicySupport::from_probe(match result {
        Ok(_) | Err(Errno::INVAL) => Ok(()),
        Err(e) => Err(e),
    })
}

fn populate_write_works() -> bool {
    static WORKS: OnceLock<bool> = OnceLock::new();
    *WORKS.get_or_init(|| {
        with_probe_page(|ptr, page| {
            // SAFETY: our own fresh page; populating keeps contents.
            unsafe { sys::madvise(ptr, page, sys::MADV_POPULATE_WRITE) }
        })
        .is_ok()
    })
}

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
    /// `MemFree` of each node, bytes.
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
        if let Ok(text) = std::fs::read_to_string(format!("{dir}/meminfo")) {
            let free = text
                .lines()
                .find(|l| l.contains("MemFree:"))
                .and_then(|l| l.split_whitespace().rev().nth(1)?.parse::<u64>().ok());
            if let Some(kib) = free {
                free_bytes.push((n, kib * 1024));
            }
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
