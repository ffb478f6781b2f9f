//! What the command prints as JSON (built with serde), and probe's one-line verdict.
//!
//! The JSON types are views over what the examples measured: they need no feature of
//! the library (its `serde` feature is off by default), so `cargo run --example probe --
//! --json` works with the default features.

use std::collections::BTreeMap;

use serde::Serialize;

use super::run::Run;
use crate::probe::{MempolicySupport, Support, ThpMode};

/// Version of `pin_model --json`. 2: `experts` became `experts_per_layer` and
/// `experts_total`, and `schema` appeared (the unversioned output was 1).
pub const PIN_MODEL_SCHEMA: u32 = 2;

/// Version of `probe --json`.
pub const PROBE_SCHEMA: u32 = 1;

/// One load, as JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunJson<'a> {
    pub layers: usize,
    pub experts_per_layer: usize,
    pub experts_total: usize,
    /// Bytes of weights and scales loaded.
    pub bytes: u64,
    /// Mappings the load added.
    pub vmas: usize,
    pub mbind_calls: usize,
    /// Rounded to the microsecond.
    pub load_seconds: f64,
    /// Rounded to the MB/s.
    pub gbps: f64,
    /// Node id (a string, as JSON keys are) → pages.
    pub pages_per_node: BTreeMap<u16, u64>,
    /// `move_pages`, `numa_maps` or `unavailable`.
    pub pages_source: &'static str,
    /// Pages in a mapping merged with a neighbour, whose node numa_maps cannot tell.
    pub pages_merged: u64,
    /// The process's RSS after the load.
    pub rss_bytes: u64,
    /// `bound`, `degraded: ...` or `unplaced (no binding requested)`.
    pub placement: &'a str,
    pub minor_faults: u64,
    /// Bytes backed by transparent huge pages.
    pub anon_huge_bytes: u64,
    /// The read mode that ran: `buffered`, `direct` or `drop-behind`.
    pub read_mode: &'a str,
    /// Why a direct read fell back to buffered reads (`null`: it did not).
    pub fallback: Option<&'a str>,
    /// How direct reads were issued: `io_uring (depth N per loader)` or `threads
    /// (fallback: why)` (`null`: no direct reads).
    pub direct_io: Option<&'a str>,
}

impl<'a> RunJson<'a> {
    pub fn new(run: &'a Run) -> Self {
        RunJson {
            layers: run.layers,
            experts_per_layer: run.experts_per_layer,
            experts_total: run.experts,
            bytes: run.bytes,
            vmas: run.vmas,
            mbind_calls: run.mbind_calls,
            load_seconds: (run.load_seconds * 1e6).round() / 1e6,
            gbps: (run.gbps() * 1e3).round() / 1e3,
            pages_per_node: run.pages_per_node.iter().map(|(n, p)| (n.0, *p)).collect(),
            pages_source: run.pages_source_name(),
            pages_merged: run.pages_merged,
            rss_bytes: run.rss_bytes,
            placement: &run.placement,
            minor_faults: run.minor_faults,
            anon_huge_bytes: run.anon_huge_bytes,
            read_mode: &run.read_mode,
            fallback: run.read_fallback.as_deref(),
            direct_io: run.direct_io.as_deref(),
        }
    }
}

/// RSS around a purge of every jemalloc arena, and the live heap bytes after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Purge {
    pub rss_before: u64,
    pub rss_after: u64,
    pub live_bytes: u64,
}

/// The one-slab-per-expert comparison: its load, or why it failed (it is expected to
/// fail with ENOMEM past `vm.max_map_count`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum BaselineJson<'a> {
    Run(RunJson<'a>),
    Failed { error: &'a str },
}

impl<'a> BaselineJson<'a> {
    pub fn new(baseline: &'a Result<Run, String>) -> Self {
        match baseline {
            Ok(run) => BaselineJson::Run(RunJson::new(run)),
            Err(error) => BaselineJson::Failed { error },
        }
    }
}

/// `pin_model --json`: one object, the PinStore's load at the top level.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PinModelJson<'a> {
    /// [`PIN_MODEL_SCHEMA`].
    pub schema: u32,
    #[serde(flatten)]
    pub run: RunJson<'a>,
    /// The `--nodes` set (numactl syntax).
    pub nodes: String,
    /// The `--layout` word.
    pub layout: &'static str,
    /// Every slot was compared with the file (pin_model fails otherwise).
    pub verified: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub purge: Option<Purge>,
    /// The checkpoint pinned with `--model` (absent for the synthetic model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<BaselineJson<'a>>,
}

/// What `--model` found in a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelJson {
    /// The path given.
    pub path: String,
    /// The expert naming detected (`per-expert`, `mixtral`, `fused`, `gguf-merged`, ...).
    pub naming: String,
    /// Files read (shards, split parts).
    pub files: usize,
    /// Model layer number → experts packed (dense layers are absent).
    pub experts_per_layer: BTreeMap<usize, usize>,
    /// Tensors left for the engine (not expert tensors), and their bytes.
    pub engine_tensors: usize,
    pub engine_bytes: u64,
    /// `pread`s issued by the pack (after coalescing adjacent pieces).
    pub reads: usize,
    /// Slots re-read from the files and compared with them: this proves the copy of
    /// what the plan named, not that the plan named the right bytes (see `complete`).
    pub slots_verified: usize,
    /// Every expert of every layer has every role its naming declares (gate, up, down;
    /// or gate_up, down; and their scales): `ExpertPlan::is_complete`, derived from the
    /// plan. A checkpoint with a missing role does not pack at all.
    pub complete: bool,
    /// Model layer → the roles every expert has, in slot order (weights, then scales,
    /// as the naming calls them), and how a fused gate_up holds gate and up.
    pub layer_roles: BTreeMap<usize, LayerRolesJson>,
    /// The rank's share placed (`--experts`, `--slice`); absent for the whole
    /// checkpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share: Option<ShareJson>,
}

/// Which share of the checkpoint was placed (`numapin::model::ShareReport`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShareJson {
    /// `"experts 0-63, slice rows:0/2"`.
    pub share: String,
    /// Model layer → the global expert ids held, as ranges.
    pub experts_held: BTreeMap<usize, String>,
    /// Model layer → experts the checkpoint's layer has.
    pub experts_of: BTreeMap<usize, usize>,
    /// Model layer → each role's slice, in slot order (empty without --slice).
    pub slices: BTreeMap<usize, Vec<RoleSliceJson>>,
}

/// One role's slice (`numapin::model::RoleSlice`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoleSliceJson {
    /// The role as the naming calls it.
    pub role: String,
    /// `"rows"` or `"columns"`.
    pub axis: &'static str,
    /// First entry held (of each packed block when `parts` > 1), entries held (in
    /// all), entries of the whole axis.
    pub start: u64,
    pub len: u64,
    pub extent: u64,
    /// The equal blocks the axis is cut in, each alike: 1, or 2 for a fused gate_up cut
    /// by packed halves (`rows:k/n:2`: gate rows k/n, then up rows k/n).
    pub parts: u64,
    /// One expert's whole tensor, row-major.
    pub shape: Vec<u64>,
    /// Kept whole (a one-element scale, a bias under a column cut).
    pub whole: bool,
}

impl ShareJson {
    pub(crate) fn new(r: &crate::model::ShareReport) -> ShareJson {
        ShareJson {
            share: r.share.clone(),
            experts_held: r.experts_held.clone(),
            experts_of: r.experts_of.clone(),
            slices: r
                .slices
                .iter()
                .map(|(&l, s)| {
                    let roles = s
                        .iter()
                        .map(|s| RoleSliceJson {
                            role: s.role.clone(),
                            axis: s.axis.name(),
                            start: s.start,
                            len: s.len,
                            extent: s.extent,
                            parts: s.parts,
                            shape: s.shape.clone(),
                            whole: s.whole,
                        })
                        .collect();
                    (l, roles)
                })
                .collect(),
        }
    }
}

/// One MoE layer's roles (see [`ModelJson::layer_roles`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerRolesJson {
    /// `"gate_proj"`, …, `"gate_up"`, `"down"`, `"w1 scale"`, … in slot order.
    pub roles: Vec<String>,
    /// `GateUpLayout::name()` of the layer's gate_up role; absent without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gate_up_layout: Option<&'static str>,
}

/// `numapin::Support` field by field, in the form the library's `serde` feature gives it
/// (tests/examples/probe.rs holds the two together): states and the THP mode as lowercase
/// words, node sets as their Display strings, nodes as numbers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SupportJson<'a> {
    pub mempolicy: &'static str,
    pub page_calls: &'static str,
    pub possible_nodes: usize,
    pub nodes_with_memory: String,
    pub nodes_with_cpus: String,
    pub mems_allowed: String,
    pub distances: Vec<(u16, &'a [u32])>,
    pub free_bytes: Vec<(u16, u64)>,
    pub numa_balancing: Option<u32>,
    pub thp: &'static str,
    pub max_map_count: usize,
    pub map_count: usize,
    pub cap_sys_nice: bool,
    pub populate_write: bool,
    pub anon_vma_names: bool,
}

fn state_word(state: MempolicySupport) -> &'static str {
    match state {
        MempolicySupport::Available => "available",
        MempolicySupport::Denied => "denied",
        MempolicySupport::Unsupported => "unsupported",
    }
}

fn thp_word(thp: ThpMode) -> &'static str {
    match thp {
        ThpMode::Always => "always",
        ThpMode::Madvise => "madvise",
        ThpMode::Never => "never",
        ThpMode::Unknown => "unknown",
    }
}

impl<'a> SupportJson<'a> {
    pub(crate) fn new(support: &'a Support) -> Self {
        SupportJson {
            mempolicy: state_word(support.mempolicy),
            page_calls: state_word(support.page_calls),
            possible_nodes: support.possible_nodes,
            nodes_with_memory: support.nodes_with_memory.to_string(),
            nodes_with_cpus: support.nodes_with_cpus.to_string(),
            mems_allowed: support.mems_allowed.to_string(),
            distances: support
                .distances
                .iter()
                .map(|(n, row)| (n.0, row.as_slice()))
                .collect(),
            free_bytes: support.free_bytes.iter().map(|(n, b)| (n.0, *b)).collect(),
            numa_balancing: support.numa_balancing,
            thp: thp_word(support.thp),
            max_map_count: support.max_map_count,
            map_count: support.map_count,
            cap_sys_nice: support.cap_sys_nice,
            populate_write: support.populate_write,
            anon_vma_names: support.anon_vma_names,
        }
    }
}

/// `probe --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProbeJson<'a> {
    /// [`PROBE_SCHEMA`].
    pub schema: u32,
    pub support: SupportJson<'a>,
    /// `Support::allowed()`: the nodes placement can use.
    pub allowed: String,
    /// [`verdict`].
    pub verdict: String,
}

impl<'a> ProbeJson<'a> {
    pub fn new(support: &'a Support) -> Self {
        ProbeJson {
            schema: PROBE_SCHEMA,
            support: SupportJson::new(support),
            allowed: support.allowed().to_string(),
            verdict: verdict(support),
        }
    }
}

/// What placement does here, in one line: whether the policy calls work, over how many
/// nodes, and where placement is read from when the page calls are denied.
pub fn verdict(support: &Support) -> String {
    let allowed = support.allowed();
    let placement = match support.mempolicy {
        MempolicySupport::Denied => return "NUMA calls denied (EPERM): running unplaced".into(),
        MempolicySupport::Unsupported => {
            return "kernel without NUMA (ENOSYS): running unplaced".into();
        }
        MempolicySupport::Available => match allowed.len() {
            0 => "no memory node allowed: nothing to place on".to_string(),
            1 if support.nodes_with_memory.len() > 1 => format!(
                "one allowed memory node ({allowed} of {}): placement is a no-op here",
                support.nodes_with_memory
            ),
            1 => "one memory node: placement is a no-op here".to_string(),
            _ => format!("placement works on nodes {allowed}"),
        },
    };
    let pages = match support.page_calls {
        MempolicySupport::Available => return placement,
        MempolicySupport::Denied => "page calls denied (EPERM)",
        MempolicySupport::Unsupported => "page calls unsupported (ENOSYS)",
    };
    format!("{placement}; {pages}: placement proven through numa_maps")
}
