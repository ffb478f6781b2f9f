//! Measuring one load: what `numapin place` reports, shared with the benchmark and the
//! pin_model example (which adds the slab-per-expert baseline).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::time::Instant;

use super::synthetic::SyntheticModel;
use crate::diag;
use crate::nodeset::Node;
use crate::policy::Placement;
use crate::region::PagesSource;
use crate::store::{Kind, LayerReport, Layout, PinStore, StoreOptions};

/// What one load cost.
#[derive(Debug, Clone, Default)]
pub struct Run {
    pub layers: usize,
    /// Experts in each layer.
    pub experts_per_layer: usize,
    /// Experts in all the layers (`experts_total` in the JSON).
    pub experts: usize,
    pub bytes: u64,
    pub vmas: usize,
    pub mbind_calls: usize,
    pub load_seconds: f64,
    pub pages_per_node: BTreeMap<Node, u64>,
    /// Loaded bytes per node by the layout: each replica's, each block's, each layer's
    /// (`StoreStats::node_bytes`; empty for interleave, unplaced and the baseline).
    pub node_bytes: BTreeMap<Node, u64>,
    /// Where `pages_per_node` comes from; `None`: unavailable here.
    pub pages_source: Option<PagesSource>,
    /// Pages whose node numa_maps could not tell (a mapping merged across the edge).
    pub pages_merged: u64,
    pub rss_bytes: u64,
    pub placement: String,
    pub minor_faults: u64,
    pub anon_huge_bytes: u64,
    /// The read mode that ran (`buffered`, `direct`, `drop-behind`).
    pub read_mode: String,
    /// Why a direct read fell back to buffered reads, if it did.
    pub read_fallback: Option<String>,
    /// How direct reads were issued (`io_uring (...)` or `threads (fallback: ...)`);
    /// `None`: no file was read directly.
    pub direct_io: Option<String>,
}

impl Run {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.load_seconds.max(1e-9) / 1e9
    }

    /// `move_pages`, `numa_maps` or `unavailable`.
    pub fn pages_source_name(&self) -> &'static str {
        self.pages_source.map_or("unavailable", PagesSource::name)
    }
}

/// Minor page faults of this process so far: `minflt`, the 10th field of
/// `/proc/self/stat` (0 where it cannot be read).
pub fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The command name (field 2) is in parentheses and may hold spaces: count from the
    // last `)`, after which field 3 comes first.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(7))
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}

/// A store's placement in words (`None`: no binding was asked for).
pub fn placement_text(p: Option<Placement>) -> String {
    p.map_or("unplaced (no binding requested)".to_string(), |p| {
        p.to_string()
    })
}

/// Loads the whole model into a PinStore; verifies every slot when `verify`.
pub fn run_store(
    model: &SyntheticModel,
    file: &File,
    layout: Layout,
    options: StoreOptions,
    verify: bool,
) -> Result<(Run, PinStore), String> {
    let store = PinStore::new(layout, options).map_err(|e| e.to_string())?;
    let faults = minor_faults();
    let start = Instant::now();
    let mut reports = Vec::with_capacity(model.layers);
    for layer in 0..model.layers {
        reports.push(
            store
                .pack_layer(layer, &model.spec(), &model.sources(file, layer))
                .map_err(|e| e.to_string())?,
        );
    }
    let load_seconds = start.elapsed().as_secs_f64();
    let minor = minor_faults() - faults;
    if verify {
        for layer in 0..model.layers {
            for expert in 0..model.experts {
                let w = store.weights(layer, expert).map_err(|e| e.to_string())?;
                let s = store.scales(layer, expert).map_err(|e| e.to_string())?;
                if !model.verify(layer, expert, Kind::Weights, w)
                    || !model.verify(layer, expert, Kind::Scales, s)
                {
                    return Err(format!(
                        "layer {layer} expert {expert}: bytes differ from the file"
                    ));
                }
            }
        }
    }
    let run = measure(&store, model.experts, load_seconds, minor, &reports)?;
    Ok((run, store))
}

/// The figures of a loaded store: its stats, the process's RSS, and what the layer
/// reports say about the reads.
pub(crate) fn measure(
    store: &PinStore,
    experts_per_layer: usize,
    load_seconds: f64,
    minor_faults: u64,
    reports: &[LayerReport],
) -> Result<Run, String> {
    let stats = store.stats().map_err(|e| e.to_string())?;
    Ok(Run {
        layers: stats.layers,
        experts_per_layer,
        experts: stats.experts_loaded,
        bytes: stats.bytes,
        vmas: stats.vmas,
        mbind_calls: stats.mbind_calls,
        load_seconds,
        pages_per_node: stats.pages_per_node,
        node_bytes: stats.node_bytes,
        pages_source: stats.pages_source,
        pages_merged: stats.pages_merged,
        rss_bytes: diag::rss_bytes().unwrap_or(0),
        placement: placement_text(stats.placement),
        minor_faults,
        anon_huge_bytes: stats.anon_huge_bytes,
        read_mode: reports
            .first()
            .map_or("buffered".to_string(), |r| r.read_mode.to_string()),
        read_fallback: reports
            .iter()
            .find_map(|r| r.read_fallback)
            .map(|f| f.to_string()),
        // A layer that fell back to blocking reads is the one to report.
        direct_io: reports
            .iter()
            .filter_map(|r| r.direct_io)
            .min_by_key(|io| io.is_io_uring())
            .map(|io| io.to_string()),
    })
}

/// One line on standard output (see `outln!`): a closed pipe ends the process with
/// status 141, another write error with status 1 and the error.
pub fn write_line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(141),
        Err(e) => {
            eprintln!("standard output: {e}");
            std::process::exit(1);
        }
    }
}
