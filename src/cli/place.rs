//! `numapin place` (and the pin_model example): pin a (synthetic) MoE model with a
//! PinStore and show where it went.
//!
//! Without `--model`, writes a 16 layers × 64 experts model (1 MiB weights + 32 KiB
//! scales each) to a temp dir, packs it interleaved over the allowed nodes, verifies
//! every slot against the file, and prints a report; `--json` prints one object
//! ([`super::report`], schema 2).
//!
//! `--model PATH` pins a real checkpoint instead. Its "verified" re-reads the pieces the
//! plan named and compares them with the slots: it proves the copy, not the plan. The
//! plan is checked on its own: every expert must have every role of its naming (and every
//! MoE layer a `config.json` beside it names must be there), or nothing is packed;
//! `--json` reports `"complete":true` from `ExpertPlan::is_complete`.
//!
//! Built with `--features jemalloc`, the binary's global allocator is jemalloc (with
//! `retain:false` baked in) and the load is followed by a purge of its arenas by default,
//! printing RSS before and after and the live bytes.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use super::Hooks;
use super::args::PinModelArgs;
use super::report::{
    BaselineJson, LayerRolesJson, ModelJson, PIN_MODEL_SCHEMA, PinModelJson, Purge, RunJson,
    ShareJson,
};
use super::run::{Run, measure, minor_faults, run_store};
use super::text::{print_checkpoint, print_purge, print_report};
use crate::error::Error;
use crate::model::{Checkpoint, Naming};
use crate::store::{PinStore, Progress, ProgressHook, StoreOptions};

/// What `--baseline` says where no front end brought the slab-per-expert baseline.
const NO_BASELINE: &str = "the slab-per-expert baseline lives in the dev-only testkit: run \
     `cargo run --release --example pin_model -- --baseline` in a checkout";

/// A temp dir removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(super) fn run(args: &PinModelArgs, hooks: &Hooks) -> Result<(), String> {
    if let (Some(path), Some(plan)) = (&args.model, &args.plan) {
        return super::whole::run_whole(args, path, plan);
    }
    if let Some(path) = &args.model {
        if let Some(plan) = args.plan_only.then(|| args.plan_args()).flatten() {
            return super::plan::run(&plan);
        }
        return run_checkpoint(args, path);
    }
    let nodes = args.nodes;
    let layout = args.layout();
    let model = args.synthetic();
    let total = model.total_bytes().map_err(|e| e.to_string())?;

    let mut _temp = None;
    let path = match &args.file {
        Some(path) => {
            let len = std::fs::metadata(path)
                .map_err(|e| format!("{}: {e}", path.display()))?
                .len();
            if len < total {
                return Err(format!(
                    "{}: {len} bytes, the model needs {total}",
                    path.display()
                ));
            }
            path.clone()
        }
        None => {
            let dir =
                std::env::temp_dir().join(format!("numapin-pin-model-{}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            let temp = TempDir(dir);
            let path = temp.0.join("model.bin");
            if !args.json {
                eprintln!(
                    "writing a {:.2} GiB synthetic model to {}",
                    total as f64 / (1u64 << 30) as f64,
                    path.display()
                );
            }
            model.write(&path).map_err(|e| e.to_string())?;
            _temp = Some(temp);
            path
        }
    };
    let file = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;

    let bar = progress_bar(args, total, model.layers);
    // Every slot is compared with the bytes the model is defined to hold, computed, not
    // re-read: the check leaves the page cache as the load left it.
    let (run, store) = run_store(&model, &file, layout, store_options(args, &bar), true)?;
    finish(&bar);
    let purge = if args.purge() { Some(purge()?) } else { None };
    drop(store);
    let baseline = match (args.baseline, hooks.baseline) {
        (false, _) => None,
        (true, Some(load)) => Some(load(&model, &file, layout)),
        (true, None) => Some(Err(NO_BASELINE.to_owned())),
    };

    if args.json {
        return print_json(args, &run, purge, None, baseline.as_ref());
    }
    print_report(&run, baseline.as_ref(), &nodes, args.layout.name());
    print_purge(purge);
    Ok(())
}

/// `--model PATH`: a real checkpoint, packed layer by layer at its model layer numbers,
/// then every slot re-read from the files with the load's read mode and compared.
///
/// "verified" means the store holds exactly what the plan named: it re-reads the same
/// pieces, so it cannot notice a plan that named the wrong ones. What guards the plan is
/// that it is complete (every expert has every role of its naming, every MoE layer of a
/// `config.json` is there; otherwise packing is refused), reported as `complete`.
fn run_checkpoint(args: &PinModelArgs, path: &std::path::Path) -> Result<(), String> {
    let err = |e: Error| e.to_string();
    let checkpoint = Checkpoint::open(path).map_err(err)?;
    let naming = Naming::detect(&checkpoint).map_err(err)?;
    let share = args.share();
    let mut plan = naming.plan(&checkpoint).map_err(err)?;
    if !share.is_whole() {
        plan = plan.share(&checkpoint, &share).map_err(err)?;
    }
    let bytes: u64 = plan
        .layers()
        .iter()
        .map(|l| (l.weight_bytes() + l.scale_bytes()) * l.experts().len() as u64)
        .sum();
    let bar = progress_bar(args, bytes, plan.layers().len());
    let store = PinStore::new(args.layout(), store_options(args, &bar)).map_err(err)?;
    let faults = minor_faults();
    let start = Instant::now();
    let report = if share.is_whole() {
        checkpoint.pack_with(&store, &naming)
    } else {
        checkpoint.pack_share_with(&store, &naming, &share)
    }
    .map_err(err)?;
    let load_seconds = start.elapsed().as_secs_f64();
    let minor = minor_faults() - faults;
    finish(&bar);
    let verify = checkpoint
        .verify_plan(&store, &plan, args.read)
        .map_err(err)?;
    if !verify.verified() {
        return Err(format!("{}: {verify}", path.display()));
    }
    let experts_per_layer = report
        .experts_per_layer
        .values()
        .copied()
        .max()
        .unwrap_or(0);
    let run = measure(
        &store,
        experts_per_layer,
        load_seconds,
        minor,
        &report.layer_reports,
    )?;
    let purge = if args.purge() { Some(purge()?) } else { None };
    let model = model_json(path, &plan, &report, &verify);
    if !model.complete {
        return Err(format!(
            "{}: the plan is not complete (an expert lacks a role): not reporting it as pinned",
            path.display()
        ));
    }
    if args.json {
        return print_json(args, &run, purge, Some(model), None);
    }
    print_checkpoint(path, &model, &report, &verify, &plan, &run);
    print_report(&run, None, &args.nodes, args.layout.name());
    print_purge(purge);
    Ok(())
}

/// What the JSON report says of the checkpoint: its files, naming, layers and roles, and
/// how many slots were verified against the plan.
fn model_json(
    path: &std::path::Path,
    plan: &crate::model::ExpertPlan,
    report: &crate::model::ModelReport,
    verify: &crate::model::VerifyReport,
) -> ModelJson {
    ModelJson {
        path: path.display().to_string(),
        naming: report.naming.clone(),
        files: report.files,
        experts_per_layer: report.experts_per_layer.clone(),
        engine_tensors: report.engine_tensors,
        engine_bytes: report.engine_bytes,
        reads: report.reads,
        slots_verified: verify.slots,
        complete: plan.is_complete(),
        layer_roles: plan
            .layers()
            .iter()
            .map(|l| {
                let roles = LayerRolesJson {
                    roles: l.roles().map(|(_, n)| n.to_owned()).collect(),
                    gate_up_layout: l.gate_up_layout().map(|g| g.name()),
                };
                (l.layer(), roles)
            })
            .collect(),
        share: report.share.as_ref().map(ShareJson::new),
    }
}

fn store_options(args: &PinModelArgs, bar: &Option<ProgressBar>) -> StoreOptions {
    let mut options = StoreOptions::default()
        .huge_pages(!args.no_huge_pages)
        .read_mode(args.read)
        .io_uring(!args.no_io_uring);
    if let Some(t) = args.threads {
        options.loader_threads = t;
    }
    if let Some(bar) = bar {
        let bar = bar.clone();
        // Each layer reports its own bytes; the bar counts the whole model.
        let done = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<usize, u64>::new()));
        options.progress = Some(ProgressHook::new(move |p: &Progress| {
            let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
            done.insert(p.layer, p.bytes_done);
            bar.set_position(done.values().sum());
            bar.set_message(format!("layer {}", p.layer));
        }));
    }
    options
}

/// A progress bar on stderr when it is a terminal (never with --json or --no-progress).
fn progress_bar(args: &PinModelArgs, bytes: u64, layers: usize) -> Option<ProgressBar> {
    if args.json || args.no_progress || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(bytes);
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(format!("{layers} layers"));
    Some(bar)
}

fn finish(bar: &Option<ProgressBar>) {
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
}

fn print_json(
    args: &PinModelArgs,
    run: &Run,
    purge: Option<Purge>,
    model: Option<ModelJson>,
    baseline: Option<&Result<Run, String>>,
) -> Result<(), String> {
    let json = PinModelJson {
        schema: PIN_MODEL_SCHEMA,
        run: RunJson::new(run),
        nodes: args.nodes.to_string(),
        layout: args.layout.name(),
        verified: true,
        purge,
        model,
        baseline: baseline.map(BaselineJson::new),
    };
    let text = serde_json::to_string(&json).map_err(|e| format!("JSON: {e}"))?;
    outln!("{text}");
    Ok(())
}

#[cfg(feature = "jemalloc")]
fn purge() -> Result<Purge, String> {
    let rss_before = crate::diag::rss_bytes().map_err(|e| e.to_string())?;
    crate::jemalloc::purge_all().map_err(|e| e.to_string())?;
    let stats = crate::jemalloc::stats().map_err(|e| e.to_string())?;
    Ok(Purge {
        rss_before,
        rss_after: crate::diag::rss_bytes().map_err(|e| e.to_string())?,
        live_bytes: stats.allocated as u64,
    })
}

#[cfg(not(feature = "jemalloc"))]
fn purge() -> Result<Purge, String> {
    Err("--purge needs jemalloc: build with `--features jemalloc`".into())
}
