//! `numapin plan` (and `place --model PATH --plan-only`): which layout for a checkpoint,
//! and why; nothing is loaded.

use super::args::PlanArgs;
use crate::error::Error;
use crate::model::Checkpoint;
use crate::planner::{self, Machine, ModelSizes, PlanOptions};
use crate::routing::RoutingStats;

/// The planner's table for the checkpoint's header (nothing is loaded) on
/// this machine or `--topology`'s, with `--routing`'s statistics and `--budget`.
pub(super) fn run(args: &PlanArgs) -> Result<(), String> {
    let path = args.model.as_path();
    let err = |e: Error| e.to_string();
    let checkpoint = Checkpoint::open(path).map_err(err)?;
    let sizes = ModelSizes::from_checkpoint(&checkpoint).map_err(err)?;
    let machine = match &args.topology {
        Some(file) => Machine::from_file(file),
        None => Machine::live(),
    }
    .map_err(err)?;
    let stats = match &args.routing {
        Some(file) => Some(RoutingStats::from_file(file).map_err(err)?),
        None => None,
    };
    let mut options = PlanOptions::default();
    if let Some(bytes) = args.budget {
        options = options.budget(bytes);
    }
    let table = planner::plan(&sizes, &machine, stats.as_ref(), &options).map_err(err)?;
    if args.json {
        outln!("{}", table.to_json());
    } else {
        let experts: usize = sizes.moe_layers.iter().map(|l| l.experts).sum();
        outln!(
            "{}: {} MoE layers, {} experts, {:.1} GiB of experts, {:.1} GiB of other tensors",
            path.display(),
            sizes.moe_layers.len(),
            experts,
            sizes.expert_bytes() as f64 / (1u64 << 30) as f64,
            sizes.other_bytes as f64 / (1u64 << 30) as f64
        );
        outln!("{table}");
    }
    Ok(())
}
