//! `pin_model --model PATH --plan PLAN`: every tensor of a checkpoint placed under a plan
//! (`Checkpoint::place`), every copy verified, the report per class printed (or one JSON
//! object with --json).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::args::{PinModelArgs, SliceArg};
use crate::error::Error;
use crate::model::{
    Checkpoint, FrameworkPlan, PlacementPlan, TensorClass, WholeReport, WholeVerify,
};
use crate::store::{ReadMode, StoreOptions};

/// Version of `pin_model --plan --json`.
pub(crate) const WHOLE_SCHEMA: u32 = 1;

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
    /// Mappings its stores' regions lie in (smaps; a mapping merged across classes counts
    /// in each).
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
    /// Wall seconds its loads took (its stores' fills, one after the other).
    pub load_seconds: f64,
    /// Its bytes over its load seconds, in GB/s (10^9 bytes; 0 when nothing was timed).
    pub load_gb_per_s: f64,
    /// Wall seconds its verify (re-read and compare, every copy) took.
    pub verify_seconds: f64,
    /// Bytes its direct reads landed in place, and those copied through the bounce
    /// buffers.
    pub in_place_bytes: u64,
    pub bounced_bytes: u64,
    /// Reads its loads issued through `io_uring` and as blocking calls, the most one
    /// ring had in flight at once, and the most blocking calls one loader had in flight
    /// at once (its read threads, where `io_uring` was not used).
    pub uring_reads: u64,
    pub blocking_reads: u64,
    pub uring_depth: usize,
    pub blocking_depth: usize,
    /// How its loads read each file and why (`PATH: direct (auto: 0 of N pages cached,
    /// by cachestat)`).
    pub files: Vec<String>,
}

/// `pin_model --plan --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WholeJson {
    /// `WHOLE_SCHEMA`.
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
    /// Distinct mappings of the process the placement's regions lie in.
    pub mappings: usize,
    pub mbind_calls_planned: usize,
    pub per_tensor_mappings: usize,
    /// Every copy of every tensor and every expert slot equal to the files.
    pub verified: bool,
    pub copies_verified: usize,
    /// The read mode asked for (`auto`, `buffered`, `direct`, `drop-behind`).
    pub read_mode: String,
    /// Wall seconds of the whole placement (`Checkpoint::place`: plan, reserve, load).
    pub load_seconds: f64,
    /// The checkpoint's bytes over `load_seconds`, in GB/s.
    pub load_gb_per_s: f64,
    /// Wall seconds of the verify (`PlacedModel::verify`, in the load's read mode).
    pub verify_seconds: f64,
}

/// How long a `pin_model --plan` run took: the placement and the verify, wall.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WholeTimes {
    pub load: std::time::Duration,
    pub verify: std::time::Duration,
}

/// `bytes` over `seconds` in GB/s (0 where nothing was timed).
fn gb_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

impl WholeJson {
    pub fn new(
        path: &Path,
        report: &WholeReport,
        verify: &WholeVerify,
        read_mode: ReadMode,
        times: WholeTimes,
    ) -> Self {
        let classes = report
            .cost
            .classes
            .iter()
            .map(|c| {
                let m = report.measured.iter().find(|m| m.class == c.class);
                let load_seconds = m.map_or(0, |m| m.load_nanos) as f64 / 1e9;
                let verify_nanos = (verify.class_nanos.iter())
                    .find(|(class, _)| *class == c.class)
                    .map_or(0, |&(_, n)| n);
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
                    load_seconds,
                    load_gb_per_s: gb_per_s(c.bytes, load_seconds),
                    verify_seconds: verify_nanos as f64 / 1e9,
                    in_place_bytes: m.map_or(0, |m| m.direct_reads.in_place_bytes),
                    bounced_bytes: match (c.class, &report.experts) {
                        (TensorClass::RoutedExperts, Some(experts)) => {
                            (experts.layer_reports.iter())
                                .map(|l| l.bounced_bytes)
                                .sum()
                        }
                        _ => m.map_or(0, |m| m.bounced_bytes),
                    },
                    uring_reads: m.map_or(0, |m| m.direct_reads.uring_reads),
                    blocking_reads: m.map_or(0, |m| m.direct_reads.blocking_reads),
                    uring_depth: m.map_or(0, |m| m.direct_reads.uring_depth),
                    blocking_depth: m.map_or(0, |m| m.direct_reads.blocking_depth),
                    files: m.map_or(Vec::new(), |m| {
                        m.files.iter().map(ToString::to_string).collect()
                    }),
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
            // Distinct: a mapping merged across classes counts in each class's figure.
            mappings: report.mappings,
            classes,
            mappings_planned: report.cost.mappings,
            mbind_calls_planned: report.cost.mbind_calls,
            per_tensor_mappings: report.cost.per_tensor_mappings,
            verified: verify.verified(),
            copies_verified: verify.copies,
            read_mode: read_mode.to_string(),
            load_seconds: times.load.as_secs_f64(),
            load_gb_per_s: gb_per_s(report.bytes, times.load.as_secs_f64()),
            verify_seconds: times.verify.as_secs_f64(),
        }
    }
}

/// The framework plan in `file`: a JSON object of module glob → style, at most 1 MiB.
fn framework_plan(file: &Path) -> Result<FrameworkPlan, String> {
    use std::io::Read;
    const MAX: u64 = 1 << 20;
    let named = |e: std::io::Error| format!("--framework-plan {}: {e}", file.display());
    let mut text = String::new();
    std::fs::File::open(file)
        .map_err(named)?
        .take(MAX + 1)
        .read_to_string(&mut text)
        .map_err(named)?;
    if text.len() as u64 > MAX {
        return Err(format!(
            "--framework-plan {}: larger than {MAX} bytes",
            file.display()
        ));
    }
    FrameworkPlan::from_json(&text).map_err(|e| format!("--framework-plan {}: {e}", file.display()))
}

/// Opens the checkpoint, builds the plan (the default over --nodes, then the text's
/// items, then the rank's share: `--experts` the routed experts held, `--slice` the slice
/// of the dense tensors held, `--slice tp:k/n` the tensor-parallel preset), places, verifies every copy, prints.
pub fn run_whole(args: &PinModelArgs, path: &Path, text: &str) -> Result<(), String> {
    let err = |e: Error| e.to_string();
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
    match (&args.framework_plan, args.slice) {
        (Some(file), Some(SliceArg::Tp(k, n))) => {
            let framework = framework_plan(file)?;
            plan = framework.share(&checkpoint, plan, k, n).map_err(err)?;
        }
        (Some(_), _) => {
            return Err("--framework-plan needs --slice tp:k/n (the rank k of n)".to_owned());
        }
        (None, Some(SliceArg::Tp(k, n))) => {
            plan = plan.tensor_parallel(k, n).map_err(err)?;
        }
        (None, _) => {}
    }
    let mut options = StoreOptions::default()
        .huge_pages(!args.no_huge_pages)
        .read_mode(args.read);
    if let Some(threads) = args.threads {
        options = options.loader_threads(threads);
    }
    let started = std::time::Instant::now();
    let model = checkpoint.place(&plan, options).map_err(err)?;
    let load = started.elapsed();
    let started = std::time::Instant::now();
    let verify = model.verify(&checkpoint).map_err(err)?;
    let times = WholeTimes {
        load,
        verify: started.elapsed(),
    };
    if !verify.verified() {
        return Err(format!("{}: {verify}", path.display()));
    }
    let report = model.report().ok_or_else(|| "no report".to_owned())?;
    if args.json {
        let json = WholeJson::new(path, report, &verify, args.read, times);
        outln!(
            "{}",
            serde_json::to_string(&json).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    outln!("numapin place: {} (whole model)", path.display());
    outln!("{report}");
    outln!("  {verify}");
    let json = WholeJson::new(path, report, &verify, args.read, times);
    outln!(
        "  read {}: load {:.3} s ({:.2} GB/s), verify {:.3} s",
        json.read_mode,
        json.load_seconds,
        json.load_gb_per_s,
        json.verify_seconds
    );
    for c in &json.classes {
        outln!(
            "    {:<11} load {:.3} s ({:.2} GB/s), verify {:.3} s",
            c.class,
            c.load_seconds,
            c.load_gb_per_s,
            c.verify_seconds
        );
        if c.in_place_bytes + c.bounced_bytes > 0 {
            outln!(
                "      direct: {} bytes in place, {} bounced; {} io_uring reads (depth {}), {} blocking (up to {} in flight)",
                c.in_place_bytes,
                c.bounced_bytes,
                c.uring_reads,
                c.uring_depth,
                c.blocking_reads,
                c.blocking_depth
            );
        }
        for file in &c.files {
            outln!("      {file}");
        }
    }
    Ok(())
}
