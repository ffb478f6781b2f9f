//! The main job: pin a (synthetic) MoE model with a PinStore and show where it went.
//!
//! `cargo run --release --example pin_model` writes a 16 layers × 64 experts model
//! (1 MiB weights + 32 KiB scales each) to a temp dir, packs it interleaved over the
//! allowed nodes, verifies every slot against the file, and prints a report.
//! `cargo run --release --example pin_model -- --help` lists the flags and their
//! defaults (`examples/support/args.rs`); `--json` prints one object
//! (`examples/support/report.rs`, schema 2).
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

use std::path::PathBuf;
use std::process::ExitCode;

use numapin::store::StoreOptions;
use numapin::{NodeSet, diag};
use support::args::PinModelArgs;
use support::report::{BaselineJson, PIN_MODEL_SCHEMA, PinModelJson, Purge, RunJson};
use support::{Run, run_baseline, run_store};

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
    let nodes = args.nodes;
    let layout = args.layout();
    let model = args.model();
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

    let mut options = StoreOptions {
        huge_pages: !args.no_huge_pages,
        ..StoreOptions::default()
    };
    if let Some(t) = args.threads {
        options.loader_threads = t;
    }
    let (run, store) = run_store(&model, &file, layout, options, true)?;
    let purge = if args.purge() { Some(purge()?) } else { None };
    drop(store);
    let baseline = args
        .baseline
        .then(|| run_baseline(&model, &file, layout).map(|(run, _slabs)| run));

    if args.json {
        let json = PinModelJson {
            schema: PIN_MODEL_SCHEMA,
            run: RunJson::new(&run),
            nodes: nodes.to_string(),
            layout: args.layout.name(),
            verified: true,
            purge,
            baseline: baseline.as_ref().map(BaselineJson::new),
        };
        let text = serde_json::to_string(&json).map_err(|e| format!("JSON: {e}"))?;
        println!("{text}");
        return Ok(());
    }
    print_report(&run, baseline.as_ref(), &nodes, args.layout.name());
    if let Some(p) = purge {
        println!(
            "  jemalloc purge   RSS {} -> {} (live heap bytes {})",
            gib(p.rss_before),
            gib(p.rss_after),
            p.live_bytes
        );
    }
    Ok(())
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
    println!("numapin pin_model: every slot verified against the file");
    println!("  nodes            {nodes} (layout {layout})");
    println!(
        "  map limit        vm.max_map_count = {}",
        diag::max_map_count().unwrap_or(0)
    );
    let left = rows(run);
    match baseline {
        None => {
            for (name, value) in &left {
                println!("  {name:<16} {value}");
            }
        }
        Some(b) => {
            println!("  {:<16} {:<28} one slab per expert", "", "PinStore");
            let right = b.as_ref().map(rows).ok();
            for (i, (name, value)) in left.iter().enumerate() {
                let other = right.as_ref().map_or("-", |r| r[i].1.as_str());
                println!("  {name:<16} {value:<28} {other}");
            }
            if let Err(e) = b {
                println!("  baseline failed: {e}");
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
        ("placement", r.placement.clone()),
    ]
}
