//! The examples' side of the command: `numapin::cli`'s flags, JSON and measurements
//! re-exported under their old paths (the benchmark and tests include this module), and
//! the slab-per-expert baseline, which needs the dev-only testkit.
#![allow(dead_code, unused_imports, unused_macros)]

/// `println!` for a program whose output may go to a pipe that closes early
/// (`pin_model --json | head -c 100`): a closed pipe ends the process quietly with
/// status 141, as `SIGPIPE` ends `cat`, instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::support::write_line(format_args!($($arg)*))
    };
}
pub(crate) use outln;

pub use numapin::cli::run::{Run, minor_faults, placement_text, run_store, write_line};
pub use numapin::cli::{args, report, whole};

use std::collections::BTreeMap;
use std::fs::File;
use std::time::Instant;

use numapin::store::{Layout, PinStore, StoreOptions};
use numapin::{PagesSource, diag};

use numapin::policy::{Observed, Placement};
use numapin_testkit::baseline::SlabPerExpert;
use numapin_testkit::synthetic::SyntheticModel;

/// Loads the whole model one slab per expert tensor, each bound on its own.
pub fn run_baseline(
    model: &SyntheticModel,
    file: &File,
    layout: Layout,
) -> Result<(Run, SlabPerExpert), String> {
    let policy_of = PinStore::new(layout, StoreOptions::default()).map_err(|e| e.to_string())?;
    let mut slabs = SlabPerExpert::new();
    let faults = minor_faults();
    let start = Instant::now();
    for layer in 0..model.layers {
        let policy = policy_of.policy_for(layer);
        slabs
            .load_layer(
                layer,
                &model.spec(),
                &model.sources(file, layer),
                policy.as_ref(),
            )
            .map_err(|e| format!("after {} slabs: {e}", slabs.slabs()))?;
    }
    let load_seconds = start.elapsed().as_secs_f64();
    let minor = minor_faults() - faults;
    // The baseline asks move_pages only: its slabs share the allocator's mappings, whose
    // numa_maps lines are never a slab's own.
    let (pages_per_node, pages_source) = match slabs.pages_per_node().map_err(|e| e.to_string())? {
        Observed::Known(p) => (p, Some(PagesSource::MovePages)),
        Observed::Degraded(_) => (BTreeMap::new(), None),
    };
    let placement = match (layout, slabs.placement()) {
        (Layout::Unplaced, _) => None,
        (_, Some(p)) => Some(p),
        (_, None) => Some(Placement::Bound),
    };
    let run = Run {
        layers: model.layers,
        experts_per_layer: model.experts,
        experts: model.layers * model.experts,
        bytes: slabs.bytes(),
        vmas: slabs.vmas().map_err(|e| e.to_string())?,
        mbind_calls: slabs.mbind_calls(),
        load_seconds,
        pages_per_node,
        node_bytes: BTreeMap::new(),
        pages_source,
        pages_merged: 0,
        rss_bytes: diag::rss_bytes().unwrap_or(0),
        placement: placement_text(placement),
        minor_faults: minor,
        anon_huge_bytes: 0,
        read_mode: "buffered".into(),
        read_fallback: None,
        direct_io: None,
    };
    Ok((run, slabs))
}
