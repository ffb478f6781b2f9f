//! `numapin stat PID`: a running process's memory per mapping and per node, from
//! `/proc/PID/numa_maps` (policy and pages per node) and `/proc/PID/maps` (names), like
//! `numastat -p PID` but per mapping, with numapin's mappings named where the kernel
//! names them.
//!
//! A mapping is numapin's when its name says so: a shared store's memfds
//! (`/memfd:numapin-layer3-weights`, [`MEMFD_PREFIX`]) and, where the kernel names
//! anonymous mappings (Linux 5.17 with `CONFIG_ANON_VMA_NAME`), its anonymous regions
//! (`[anon:numapin 1 L3 weights 0]`, [`ANON_PREFIX`]). Elsewhere an anonymous store is
//! unnamed, and the report says so instead of guessing.

use std::collections::BTreeMap;

use serde::Serialize;

use super::args::StatArgs;
use crate::diag::{self, MapsEntry, NumaMapsEntry};

/// Version of `numapin stat --json`.
pub(crate) const STAT_SCHEMA: u32 = 1;

/// How `/proc/PID/maps` names a numapin memfd (`Region::memfd`'s name after `memfd:`).
pub(crate) const MEMFD_PREFIX: &str = "/memfd:numapin";

/// How `/proc/PID/maps` names a numapin anonymous region, where the kernel names them.
pub(crate) const ANON_PREFIX: &str = "[anon:numapin ";

/// One mapping of `numapin stat --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct MappingJson {
    /// Start and end addresses (`0x7f…`).
    pub start: String,
    pub end: String,
    /// The name `/proc/PID/maps` gives (a path, `[heap]`, `/memfd:…`, `[anon:…]`);
    /// `null` for an unnamed anonymous mapping.
    pub name: Option<String>,
    /// The name is one numapin gives ([`MEMFD_PREFIX`], [`ANON_PREFIX`]).
    pub numapin: bool,
    /// The policy as numa_maps prints it (`default`, `bind:0`, `interleave:0-3`).
    pub policy: String,
    /// The size of the pages counted (`kernelpagesize_kB`).
    pub page_kib: u64,
    /// Node id → pages present there.
    pub pages: BTreeMap<u16, u64>,
    /// Node id → bytes present there (pages × page size).
    pub bytes: BTreeMap<u16, u64>,
}

/// `numapin stat --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct StatJson {
    /// [`STAT_SCHEMA`].
    pub schema: u32,
    pub pid: u32,
    /// Whether this kernel names anonymous mappings (otherwise numapin's anonymous
    /// regions are among the unnamed ones).
    pub anonymous_names: bool,
    /// The mappings listed: numapin's, or every mapping with pages with `--all`.
    pub mappings: Vec<MappingJson>,
    /// Mappings of the process (numa_maps lines) and how many are numapin's.
    pub mappings_total: usize,
    pub numapin_mappings: usize,
    /// Node id → bytes in numapin's mappings, and in the whole process.
    pub numapin_bytes: BTreeMap<u16, u64>,
    pub total_bytes: BTreeMap<u16, u64>,
}

/// Reads `/proc/PID/FILE`; a process that does not exist is named as such.
fn read_proc(pid: u32, file: &str) -> Result<String, String> {
    let path = format!("/proc/{pid}/{file}");
    std::fs::read_to_string(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("no process {pid} ({path}: {e})"),
        _ => format!("process {pid}: read {path}: {e}"),
    })
}

/// Whether a `/proc/PID/maps` name is one numapin gives.
pub(crate) fn is_numapin_name(name: &str) -> bool {
    name.starts_with(MEMFD_PREFIX) || name.starts_with(ANON_PREFIX)
}

fn mapping(numa: &NumaMapsEntry, maps: &BTreeMap<usize, MapsEntry>) -> MappingJson {
    let entry = maps.get(&numa.address);
    let name = entry.and_then(|m| m.path.clone()).or(numa.file.clone());
    let page_bytes = match numa.kernel_page_kib {
        0 => crate::page::page_size() as u64,
        kib => kib << 10,
    };
    MappingJson {
        start: format!("{:#x}", numa.address),
        end: entry.map_or_else(String::new, |m| format!("{:#x}", m.end)),
        numapin: name.as_deref().is_some_and(is_numapin_name),
        name,
        policy: numa.policy.clone(),
        page_kib: numa.kernel_page_kib,
        pages: numa.pages.iter().map(|(n, p)| (n.0, *p)).collect(),
        bytes: numa
            .pages
            .iter()
            .map(|(n, p)| (n.0, p.saturating_mul(page_bytes)))
            .collect(),
    }
}

fn add(total: &mut BTreeMap<u16, u64>, bytes: &BTreeMap<u16, u64>) {
    for (node, b) in bytes {
        *total.entry(*node).or_insert(0) += b;
    }
}

/// The report of process `pid` (`all`: every mapping with pages, not only numapin's).
///
/// # Errors
/// The process does not exist, or its numa_maps or maps cannot be read (another user's
/// process, a kernel without NUMA).
pub(crate) fn stat(pid: u32, all: bool) -> Result<StatJson, String> {
    let numa = diag::parse_numa_maps(&read_proc(pid, "numa_maps")?);
    let maps: BTreeMap<usize, MapsEntry> = diag::parse_maps(&read_proc(pid, "maps")?)
        .into_iter()
        .map(|m| (m.start, m))
        .collect();
    let mut json = StatJson {
        schema: STAT_SCHEMA,
        pid,
        anonymous_names: crate::probe::anon_vma_names_supported(),
        mappings: Vec::new(),
        mappings_total: numa.len(),
        numapin_mappings: 0,
        numapin_bytes: BTreeMap::new(),
        total_bytes: BTreeMap::new(),
    };
    for entry in &numa {
        let m = mapping(entry, &maps);
        add(&mut json.total_bytes, &m.bytes);
        if m.numapin {
            json.numapin_mappings += 1;
            add(&mut json.numapin_bytes, &m.bytes);
        }
        if m.numapin || (all && !m.pages.is_empty()) {
            json.mappings.push(m);
        }
    }
    Ok(json)
}

pub(super) fn run(args: &StatArgs) -> Result<(), String> {
    let json = stat(args.pid, args.all)?;
    if args.json {
        let text = serde_json::to_string(&json).map_err(|e| format!("JSON: {e}"))?;
        outln!("{text}");
        return Ok(());
    }
    print(&json);
    Ok(())
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
}

fn per_node(nodes: &[u16], bytes: &BTreeMap<u16, u64>) -> String {
    nodes
        .iter()
        .map(|n| format!("{:>9}", mib(bytes.get(n).copied().unwrap_or(0))))
        .collect()
}

fn print(json: &StatJson) {
    let nodes: Vec<u16> = json.total_bytes.keys().copied().collect();
    outln!(
        "numapin stat: process {}, {} mappings, {} of them numapin's (MiB per node)",
        json.pid,
        json.mappings_total,
        json.numapin_mappings
    );
    if !json.anonymous_names {
        outln!(
            "  this kernel does not name anonymous mappings (CONFIG_ANON_VMA_NAME): a \
             store's anonymous regions are unnamed here; shared (memfd) stores are named"
        );
    }
    let header: String = nodes
        .iter()
        .map(|n| format!("{:>9}", format!("N{n}")))
        .collect();
    outln!("  {:<14} {:<16}{header}  name", "start", "policy");
    for m in &json.mappings {
        outln!(
            "  {:<14} {:<16}{}  {}",
            m.start,
            m.policy,
            per_node(&nodes, &m.bytes),
            m.name.as_deref().unwrap_or("(anonymous)")
        );
    }
    outln!(
        "  {:<31}{}",
        "numapin's mappings",
        per_node(&nodes, &json.numapin_bytes)
    );
    outln!(
        "  {:<31}{}",
        "the whole process",
        per_node(&nodes, &json.total_bytes)
    );
}
