//! The main job: pin a (synthetic) MoE model with a PinStore and show where it went.
//!
//! `cargo run --release --example pin_model` writes a 16 layers × 64 experts model
//! (1 MiB weights + 32 KiB scales each) to a temp dir, packs it interleaved over the
//! allowed nodes, verifies every slot against the file, and prints a report.
//! `cargo run --release --example pin_model -- --help` lists the flags and their
//! defaults (`examples/support/args.rs`); `--json` prints one object
//! (`examples/support/report.rs`, schema 2).
//!
//! `--model PATH` pins a real checkpoint instead. Its "verified" re-reads the pieces the
//! plan named and compares them with the slots: it proves the copy, not the plan. The
//! plan is checked on its own: every expert must have every role of its naming (and every
//! MoE layer a `config.json` beside it names must be there), or nothing is packed;
//! `--json` reports `"complete":true` from `ExpertPlan::is_complete`.
//!
//! Built with `--features jemalloc`, jemalloc is the global allocator (with
//! `retain:false` baked in) and the example purges its arenas after the load by default,
//! printing RSS before and after and the live bytes.

mod support;

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: numapin::jemalloc::Jemalloc = numapin::jemalloc::Jemalloc;

#[cfg(feature = "jemalloc")]
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8; 13] = b"retain:false\0";

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use support::outln;

use indicatif::{ProgressBar, ProgressStyle};
use numapin::model::{Checkpoint, Naming};
use numapin::planner::{self, Machine, ModelSizes, PlanOptions};
use numapin::routing::RoutingStats;
use numapin::store::{PinStore, Progress, ProgressHook, StoreOptions};
use numapin::{NodeSet, diag};
use support::args::PinModelArgs;
use support::report::{
    BaselineJson, LayerRolesJson, ModelJson, PIN_MODEL_SCHEMA, PinModelJson, Purge, RunJson,
    ShareJson,
};
use support::{Run, measure, minor_faults, run_baseline, run_store};

fn main() -> ExitCode {
    let args = PinModelArgs::try_parse_checked(std::env::args_os()).unwrap_or_else(|e| e.exit());
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pin_model: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A temp dir removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(args: &PinModelArgs) -> Result<(), String> {
    if let (Some(path), Some(plan)) = (&args.model, &args.plan) {
        return support::whole::run_whole(args, path, plan);
    }
    if let Some(path) = &args.model {
        if args.plan_only {
            return run_plan(args, path);
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
    let baseline = args
        .baseline
        .then(|| run_baseline(&model, &file, layout).map(|(run, _slabs)| run));

    if args.json {
        return print_json(args, &run, purge, None, baseline.as_ref());
    }
    print_report(&run, baseline.as_ref(), &nodes, args.layout.name());
    print_purge(purge);
    Ok(())
}

/// `--plan-only`: the planner's table for the checkpoint's header (nothing is loaded) on
/// this machine or `--topology`'s, with `--routing`'s statistics and `--budget`.
fn run_plan(args: &PinModelArgs, path: &std::path::Path) -> Result<(), String> {
    let err = |e: numapin::Error| e.to_string();
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

/// `--model PATH`: a real checkpoint, packed layer by layer at its model layer numbers,
/// then every slot re-read from the files with the load's read mode and compared.
///
/// "verified" means the store holds exactly what the plan named: it re-reads the same
/// pieces, so it cannot notice a plan that named the wrong ones. What guards the plan is
/// that it is complete (every expert has every role of its naming, every MoE layer of a
/// `config.json` is there; otherwise packing is refused), reported as `complete`.
fn run_checkpoint(args: &PinModelArgs, path: &std::path::Path) -> Result<(), String> {
    let err = |e: numapin::Error| e.to_string();
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
    plan: &numapin::model::ExpertPlan,
    report: &numapin::model::ModelReport,
    verify: &numapin::model::VerifyReport,
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

/// The checkpoint's part of the text report: what was packed, for the engine, verified.
fn print_checkpoint(
    path: &std::path::Path,
    model: &ModelJson,
    report: &numapin::model::ModelReport,
    verify: &numapin::model::VerifyReport,
    plan: &numapin::model::ExpertPlan,
    run: &Run,
) {
    outln!("numapin pin_model: {}", path.display());
    outln!(
        "  checkpoint       {} file(s), naming {}, {} MoE layers (model layers {})",
        model.files,
        model.naming,
        report.layers,
        layer_list(&model.experts_per_layer)
    );
    print_roles(&model.layer_roles);
    if let Some(share) = &model.share {
        print_share(share);
    }
    outln!(
        "  for the engine   {} tensors, {} (not experts: read them yourself)",
        model.engine_tensors,
        gib(model.engine_bytes)
    );
    outln!(
        "  verified         {} slots re-read from the files ({} read) and equal to what \
         the plan named; every expert complete ({} roles each)",
        verify.slots,
        run.read_mode,
        plan.layers().first().map_or(0, |l| l.roles().count())
    );
}

/// `0-2,5` style list of the model layer numbers, with the experts of each when they
/// differ.
fn layer_list(layers: &BTreeMap<usize, usize>) -> String {
    let numbers: Vec<String> = layers.keys().map(usize::to_string).collect();
    let experts: std::collections::BTreeSet<&usize> = layers.values().collect();
    let experts = match experts.len() {
        1 => format!(
            "{} experts each",
            experts.iter().next().copied().unwrap_or(&0)
        ),
        _ => "experts per layer differ".into(),
    };
    format!("{}; {experts}", numbers.join(","))
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

/// One line per run of consecutive layers with the same roles and gate_up layout.
fn print_roles(layers: &BTreeMap<usize, LayerRolesJson>) {
    let mut runs: Vec<(usize, usize, &LayerRolesJson)> = Vec::new();
    for (&layer, roles) in layers {
        match runs.last_mut() {
            Some((_, last, r)) if *r == roles => *last = layer,
            _ => runs.push((layer, layer, roles)),
        }
    }
    for (first, last, r) in runs {
        let layers = if first == last {
            format!("layer {first}")
        } else {
            format!("layers {first}-{last}")
        };
        let layout = r
            .gate_up_layout
            .map(|g| format!("; gate_up {g}"))
            .unwrap_or_default();
        outln!(
            "  roles            {layers}: {}{layout}",
            r.roles.join(", ")
        );
    }
}

/// The share placed: what was asked, the experts held of each layer (once when every
/// layer holds the same), and each role's slice of the first layer.
fn print_share(share: &ShareJson) {
    outln!("  share            {}", share.share);
    let mut held = share.experts_held.iter();
    if let Some((&first, ids)) = held.next() {
        let of = share.experts_of.get(&first).copied().unwrap_or(0);
        if share.experts_held.values().all(|v| v == ids) {
            outln!("  experts held     {ids} of {of} in every MoE layer");
        } else {
            for (layer, ids) in share.experts_held.iter() {
                let of = share.experts_of.get(layer).copied().unwrap_or(0);
                outln!("  experts held     layer {layer}: {ids} of {of}");
            }
        }
    }
    if let Some((layer, slices)) = share.slices.iter().next() {
        for s in slices {
            let what = if s.whole {
                "whole".to_owned()
            } else {
                format!(
                    "{} {}..{} of {}",
                    s.axis,
                    s.start,
                    s.start + s.len,
                    s.extent
                )
            };
            outln!(
                "  slice            layer {layer} {} {:?}: {what}",
                s.role,
                s.shape
            );
        }
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

fn print_purge(purge: Option<Purge>) {
    if let Some(p) = purge {
        outln!(
            "  jemalloc purge   RSS {} -> {} (live heap bytes {})",
            gib(p.rss_before),
            gib(p.rss_after),
            p.live_bytes
        );
    }
}

#[cfg(feature = "jemalloc")]
fn purge() -> Result<Purge, String> {
    let rss_before = diag::rss_bytes().map_err(|e| e.to_string())?;
    numapin::jemalloc::purge_all().map_err(|e| e.to_string())?;
    let stats = numapin::jemalloc::stats().map_err(|e| e.to_string())?;
    Ok(Purge {
        rss_before,
        rss_after: diag::rss_bytes().map_err(|e| e.to_string())?,
        live_bytes: stats.allocated as u64,
    })
}

#[cfg(not(feature = "jemalloc"))]
fn purge() -> Result<Purge, String> {
    Err("--purge needs jemalloc: build with `--features jemalloc`".into())
}

fn read_mode(r: &Run) -> String {
    match &r.read_fallback {
        Some(why) => format!("{} (fell back: {why})", r.read_mode),
        None => r.read_mode.clone(),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn pages(run: &Run) -> String {
    if run.pages_source.is_none() {
        return "unknown (no page source here)".into();
    }
    let total: u64 = run.pages_per_node.values().sum();
    let mut text = run
        .pages_per_node
        .iter()
        .map(|(n, p)| format!("N{n}={p} ({:.1}%)", 100.0 * *p as f64 / total.max(1) as f64))
        .collect::<Vec<_>>()
        .join(" ");
    if run.pages_per_node.is_empty() {
        text.push_str("no pages");
    }
    if run.pages_merged > 0 {
        text.push_str(&format!(
            " + {} in a mapping merged with a neighbour (node unknown)",
            run.pages_merged
        ));
    }
    format!("{text} (from {})", run.pages_source_name())
}

fn print_report(run: &Run, baseline: Option<&Result<Run, String>>, nodes: &NodeSet, layout: &str) {
    outln!("numapin pin_model: every slot verified");
    outln!("  nodes            {nodes} (layout {layout})");
    outln!(
        "  map limit        vm.max_map_count = {}",
        diag::max_map_count().unwrap_or(0)
    );
    let left = rows(run);
    match baseline {
        None => {
            for (name, value) in &left {
                outln!("  {name:<16} {value}");
            }
        }
        Some(b) => {
            outln!("  {:<16} {:<28} one slab per expert", "", "PinStore");
            let right = b.as_ref().map(rows).ok();
            for (i, (name, value)) in left.iter().enumerate() {
                let other = right.as_ref().map_or("-", |r| r[i].1.as_str());
                outln!("  {name:<16} {value:<28} {other}");
            }
            if let Err(e) = b {
                outln!("  baseline failed: {e}");
            }
        }
    }
}

/// Bytes per node as the layout put them (a replica or a block per node).
fn node_bytes(run: &Run) -> String {
    if run.node_bytes.is_empty() {
        return "- (no single node per tensor in this layout)".into();
    }
    run.node_bytes
        .iter()
        .map(|(n, b)| format!("N{n}={:.1} MiB", *b as f64 / (1u64 << 20) as f64))
        .collect::<Vec<_>>()
        .join(" ")
}

fn rows(r: &Run) -> Vec<(&'static str, String)> {
    vec![
        ("layers", r.layers.to_string()),
        ("experts/layer", r.experts_per_layer.to_string()),
        ("experts total", r.experts.to_string()),
        ("bytes", gib(r.bytes)),
        ("load seconds", format!("{:.3}", r.load_seconds)),
        ("load GB/s", format!("{:.2}", r.gbps())),
        ("mappings (VMAs)", r.vmas.to_string()),
        ("mbind calls", r.mbind_calls.to_string()),
        ("minor faults", r.minor_faults.to_string()),
        ("THP bytes", gib(r.anon_huge_bytes)),
        ("process RSS", gib(r.rss_bytes)),
        ("pages per node", pages(r)),
        ("bytes per node", node_bytes(r)),
        ("pages source", r.pages_source_name().to_string()),
        ("read mode", read_mode(r)),
        (
            "direct I/O",
            r.direct_io.clone().unwrap_or_else(|| "-".into()),
        ),
        ("placement", r.placement.clone()),
    ]
}
