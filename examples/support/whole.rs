//! `pin_model --model PATH --plan PLAN`: every tensor of a checkpoint placed under a plan
//! (`Checkpoint::place`), every copy verified, the report per class printed (or one JSON
//! object with --json).

use std::collections::BTreeMap;
use std::path::Path;

use numapin::model::{Checkpoint, PlacementPlan, WholeReport};
use numapin::store::StoreOptions;
use serde::Serialize;

use super::args::PinModelArgs;

/// Version of `pin_model --plan --json`.
pub const WHOLE_SCHEMA: u32 = 1;

/// One class of the report, as JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassJson {
    pub class: &'static str,
    pub layout: String,
    pub why: String,
    pub tensors: usize,
    pub bytes: u64,
    pub groups: usize,
    /// Mappings the plan counts.
    pub mappings_planned: usize,
    /// Mappings its stores occupy (smaps).
    pub mappings: usize,
    pub mbind_calls_planned: usize,
    pub mbind_calls: usize,
    /// One mapping per tensor per copy instead.
    pub per_tensor_mappings: usize,
    /// Node id → bytes the layout puts there.
    pub node_bytes: BTreeMap<u16, u64>,
    /// `bound`, `unplaced` or `degraded: …`.
    pub placement: String,
    /// The slices its tensors hold, counted (`rows:0/2 ×4, columns:0/2 ×2, whole ×1`);
    /// empty when none is cut.
    pub slices: String,
}

/// `pin_model --plan --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WholeJson {
    /// [`WHOLE_SCHEMA`].
    pub schema: u32,
    pub path: String,
    pub plan: String,
    /// Which share was placed (`--experts`, `--slice`); null for the whole model.
    pub share: Option<String>,
    pub naming: Option<String>,
    pub files: usize,
    pub tensors: usize,
    pub bytes: u64,
    pub classes: Vec<ClassJson>,
    pub mappings_planned: usize,
    pub mappings: usize,
    pub mbind_calls_planned: usize,
    pub per_tensor_mappings: usize,
    /// Every copy of every tensor and every expert slot equal to the files.
    pub verified: bool,
    pub copies_verified: usize,
}

impl WholeJson {
    pub fn new(path: &Path, report: &WholeReport, verified: bool, copies: usize) -> Self {
        let classes = report
            .cost
            .classes
            .iter()
            .map(|c| {
                let m = report.measured.iter().find(|m| m.class == c.class);
                ClassJson {
                    class: c.class.name(),
                    layout: c.layout.clone(),
                    why: c.why.clone(),
                    tensors: c.tensors,
                    bytes: c.bytes,
                    groups: c.groups,
                    mappings_planned: c.mappings,
                    mappings: m.map_or(0, |m| m.mappings),
                    mbind_calls_planned: c.mbind_calls,
                    mbind_calls: m.map_or(0, |m| m.mbind_calls),
                    per_tensor_mappings: c.per_tensor_mappings,
                    node_bytes: c.node_bytes.iter().map(|(n, b)| (n.0, *b)).collect(),
                    placement: m.map_or(String::new(), |m| m.placement.clone()),
                    slices: c.slices.clone(),
                }
            })
            .collect::<Vec<_>>();
        WholeJson {
            schema: WHOLE_SCHEMA,
            path: path.display().to_string(),
            plan: report.plan.clone(),
            share: report.share.clone(),
            naming: report.naming.clone(),
            files: report.files,
            tensors: report.tensors,
            bytes: report.bytes,
            mappings: classes.iter().map(|c| c.mappings).sum(),
            classes,
            mappings_planned: report.cost.mappings,
            mbind_calls_planned: report.cost.mbind_calls,
            per_tensor_mappings: report.cost.per_tensor_mappings,
            verified,
            copies_verified: copies,
        }
    }
}

/// Opens the checkpoint, builds the plan (the default over --nodes, then the text's
/// items, then the rank's share: `--experts` the routed experts held, `--slice` the slice
/// of the dense tensors held, `--slice tp:k/n` the tensor-parallel preset), places, verifies every copy, prints.
pub fn run_whole(args: &PinModelArgs, path: &Path, text: &str) -> Result<(), String> {
    let err = |e: numapin::Error| e.to_string();
    let checkpoint = Checkpoint::open(path).map_err(err)?;
    let mut plan: PlacementPlan = checkpoint.default_plan(args.nodes).map_err(err)?;
    if text != "default" {
        plan = plan.apply(text).map_err(err)?;
    }
    // With --plan, --slice cuts the dense tensors (tensor parallelism) and the routed
    // experts are held whole under --experts' share (expert parallelism).
    let mut share = args.share();
    if let Some(slice) = share.tensor_slice.take() {
        plan = plan.dense_slice(slice);
    }
    // `--slice tp:k/n`: the preset cuts dense tensors and experts by role.
    share.tensor_parallel = None;
    plan = plan.share(share);
    if let Some(super::args::SliceArg::Tp(k, n)) = args.slice {
        plan = plan.tensor_parallel(k, n).map_err(err)?;
    }
    let mut options = StoreOptions::default()
        .huge_pages(!args.no_huge_pages)
        .read_mode(args.read);
    if let Some(threads) = args.threads {
        options = options.loader_threads(threads);
    }
    let model = checkpoint.place(&plan, options).map_err(err)?;
    let verify = model.verify(&checkpoint).map_err(err)?;
    if !verify.verified() {
        return Err(format!("{}: {verify}", path.display()));
    }
    let report = model.report().ok_or_else(|| "no report".to_owned())?;
    if args.json {
        let json = WholeJson::new(path, report, verify.verified(), verify.copies);
        outln!(
            "{}",
            serde_json::to_string(&json).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    outln!("numapin pin_model: {} (whole model)", path.display());
    outln!("{report}");
    outln!("  {verify}");
    Ok(())
}
