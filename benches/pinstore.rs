//! `cargo bench --bench pinstore`: PinStore against one-slab-per-expert binding,
//! mmap-then-copy, and the ceiling (memcpy from memory into fresh memory with the same
//! huge-page setting), all in one run; medians of `NUMAPIN_BENCH_RUNS` runs (default 5)
//! after one warm-up of each. Then the peers side by side, warm and cold, with the page
//! cache each leaves (`NUMAPIN_BENCH_PEER_RUNS`, default 3; `NUMAPIN_BENCH_ONLY=peers`
//! prints that table alone), replica builds and local lookups (`NUMAPIN_BENCH_ONLY=replicas`
//! alone), and the mappings each strategy needs as experts grow. `NUMAPIN_BENCH_ONLY=cold`
//! prints only the cold loads against the device, in alternating rounds (`cold.rs`).
//!
//! Figures are printed, never asserted: the machine is shared and noisy, so compare the
//! ratios within one run.

#[path = "../examples/support/mod.rs"]
mod support;

#[path = "pinstore/memory.rs"]
mod memory;

#[path = "pinstore/peers.rs"]
mod peers;

#[path = "pinstore/replicas.rs"]
mod replicas;

#[path = "pinstore/cold.rs"]
mod cold;

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: memory::switch::Switch = memory::switch::Switch;

use std::fs::File;
use std::path::Path;
use std::time::Instant;

use numapin::store::{ExpertSource, Kind, LayerSpec, Layout, PinStore, StoreOptions};
use numapin::{Advice, NodeSet, Region, diag};

use numapin::policy::{MbindFlags, MemPolicy};
use numapin_testkit::synthetic::SyntheticModel;
use support::{Run, minor_faults, run_baseline, run_store};

const HUGE: usize = 2 << 20;

/// One measured strategy.
type Case<'a> = Box<dyn Fn() -> Run + 'a>;

fn fresh(len: usize, policy: &MemPolicy) -> Region {
    let r = Region::anonymous_aligned(len, HUGE).expect("mmap");
    r.advise(Advice::HugePage).expect("madvise");
    let _ = r.bind(policy, MbindFlags::empty()).expect("mbind");
    r
}

fn huge_bytes(regions: &[Region]) -> u64 {
    let spans: Vec<(usize, usize)> = regions
        .iter()
        .map(|r| (r.as_ptr() as usize, r.as_ptr() as usize + r.len()))
        .collect();
    diag::smaps_overlapping(&spans).map_or(0, |e| e.iter().map(|e| e.anon_huge).sum())
}

/// One region per layer and kind, filled by `fill(layer, kind, dest)`; single-threaded.
fn run_copy(
    model: &SyntheticModel,
    policy: &MemPolicy,
    mut fill: impl FnMut(usize, Kind, &mut [u8]),
) -> Run {
    let faults = minor_faults();
    let maps = diag::map_count().unwrap_or(0);
    let start = Instant::now();
    let mut regions = Vec::new();
    for layer in 0..model.layers {
        for (kind, bytes) in [
            (Kind::Weights, model.weight_bytes),
            (Kind::Scales, model.scale_bytes),
        ] {
            let mut r = fresh(bytes * model.experts, policy);
            fill(layer, kind, r.as_mut_slice().expect("writable"));
            regions.push(r);
        }
    }
    let load_seconds = start.elapsed().as_secs_f64();
    Run {
        layers: model.layers,
        experts: model.layers * model.experts,
        bytes: model.total_bytes().unwrap_or(0),
        vmas: diag::map_count().unwrap_or(0).saturating_sub(maps),
        mbind_calls: regions.len(),
        load_seconds,
        minor_faults: minor_faults() - faults,
        anon_huge_bytes: huge_bytes(&regions),
        rss_bytes: diag::rss_bytes().unwrap_or(0),
        ..Run::default()
    }
}

/// Copies every expert's `kind` tensor of `layer` from the file image `from` into its slot.
fn copy_layer(model: &SyntheticModel, from: &[u8], layer: usize, kind: Kind, dest: &mut [u8]) {
    let size = match kind {
        Kind::Weights => model.weight_bytes,
        Kind::Scales => model.scale_bytes,
    };
    for e in 0..model.experts {
        let at = model.offset(layer, e, kind) as usize;
        dest[e * size..(e + 1) * size].copy_from_slice(&from[at..at + size]);
    }
}

fn errno_name(e: numapin::Errno) -> &'static str {
    match e {
        numapin::Errno::NOMEM => "ENOMEM",
        numapin::Errno::PERM => "EPERM",
        _ => "another errno",
    }
}

fn median(mut runs: Vec<Run>) -> Run {
    runs.sort_by(|a, b| a.load_seconds.total_cmp(&b.load_seconds));
    runs.swap_remove(runs.len() / 2)
}

/// One row of the scaling table, in a process of its own.
fn scaling_row(experts: usize, layout: Layout, policy: &MemPolicy) {
    let w = vec![7u8; 4096];
    let sources: Vec<ExpertSource> = (0..experts)
        .map(|_| ExpertSource::Memory {
            weights: &w,
            scales: &w,
        })
        .collect();
    let spec = LayerSpec {
        experts,
        weight_bytes: 4096,
        scale_bytes: 4096,
    };
    let store = PinStore::new(layout, StoreOptions::default()).expect("store");
    store.pack_layer(0, &spec, &sources).expect("pack");
    let store_vmas = store.stats().expect("stats").vmas;
    drop(store);
    let mut slabs = numapin_testkit::baseline::SlabPerExpert::new();
    let slab_vmas = match slabs.load_layer(0, &spec, &sources, Some(policy)) {
        Ok(()) => slabs
            .vmas()
            .map_or_else(|e| e.to_string(), |n| n.to_string()),
        Err(e) => format!(
            "failed after {} slabs: {}",
            slabs.slabs(),
            e.errno().map_or("?", errno_name)
        ),
    };
    println!("{experts:>8} {store_vmas:>14} {slab_vmas:>22}");
}

/// The count in environment variable `name`, or `default` where unset or not a number.
fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The table `NUMAPIN_BENCH_ONLY` asks for alone, if any: true when it ran one.
fn run_only_table(model: &SyntheticModel, path: &Path, runs: usize, peer_runs: usize) -> bool {
    match std::env::var("NUMAPIN_BENCH_ONLY").as_deref() {
        Ok("replicas") => replicas::rows(model, path, runs),
        Ok("cold") => cold::rows(path, env_count("NUMAPIN_BENCH_COLD_ROUNDS", 5)),
        Ok("lookup") => {
            let node = numapin::topology::current_node().expect("current node");
            let layout = Layout::Replicate(std::iter::once(node).collect::<NodeSet>());
            let file = File::open(path).expect("open model");
            replicas::lookups(model, &file, layout, runs);
        }
        Ok("peers") => peers::rows(path, peer_runs),
        _ => return false,
    }
    true
}

/// The load strategies against the ceiling: medians of `runs` after a warm-up each.
fn load_table(model: &SyntheticModel, path: &Path, nodes: NodeSet, runs: usize) {
    let layout = Layout::Interleave(nodes);
    let policy = MemPolicy::Interleave(nodes);
    let file = File::open(path).expect("open model");
    // The file is page-cached now (just written); the memory copy of it is the ceiling's
    // source.
    let source = std::fs::read(path).expect("read model");
    // SAFETY: the benchmark's own temp file; nothing writes or truncates it while mapped.
    let mapped = unsafe { Region::map_file(&file, 0, source.len()) }.expect("map file");

    let options = StoreOptions::default().loader_threads(2);
    let cases: Vec<(&str, Case<'_>)> = vec![
        (
            "PinStore (2 loader threads)",
            Box::new(|| {
                run_store(model, &file, layout, options.clone(), false)
                    .expect("store")
                    .0
            }),
        ),
        (
            "one slab per expert",
            Box::new(|| run_baseline(model, &file, layout).expect("baseline").0),
        ),
        (
            "mmap file, then copy",
            Box::new(|| {
                run_copy(model, &policy, |l, k, d| {
                    copy_layer(model, mapped.as_slice(), l, k, d)
                })
            }),
        ),
        (
            "ceiling: memcpy from memory",
            Box::new(|| {
                run_copy(model, &policy, |l, k, d| {
                    copy_layer(model, &source, l, k, d)
                })
            }),
        ),
    ];
    eprintln!(
        "model: {} layers x {} experts x ({} + {} bytes) = {:.2} GiB; nodes {nodes}; {runs} runs each after a warm-up",
        model.layers,
        model.experts,
        model.weight_bytes,
        model.scale_bytes,
        model.total_bytes().unwrap_or(0) as f64 / (1u64 << 30) as f64
    );
    let mut results = Vec::new();
    for (name, case) in &cases {
        let _ = case();
        results.push((name, median((0..runs).map(|_| case()).collect())));
    }
    let ceiling = results[3].1.gbps();
    println!(
        "{:<30} {:>8} {:>9} {:>7} {:>7} {:>12} {:>10} {:>9}",
        "case", "GB/s", "x ceiling", "VMAs", "mbinds", "minor faults", "THP MiB", "RSS MiB"
    );
    for (name, r) in &results {
        println!(
            "{:<30} {:>8.2} {:>9.2} {:>7} {:>7} {:>12} {:>10} {:>9}",
            name,
            r.gbps(),
            r.gbps() / ceiling,
            r.vmas,
            r.mbind_calls,
            r.minor_faults,
            r.anon_huge_bytes >> 20,
            r.rss_bytes >> 20
        );
    }
    let bytes = model.total_bytes().unwrap_or(0);
    println!(
        "fault budget with THP: bytes / 2 MiB x 1.2 = {}; PinStore took {}",
        (bytes as f64 / HUGE as f64 * 1.2) as u64,
        results[0].1.minor_faults
    );
}

/// The mappings each strategy needs as experts grow, one size per child process.
fn scaling_table() {
    println!();
    println!("mappings as experts grow (one layer, 4 KiB weights + 4 KiB scales per expert)");
    println!(
        "{:>8} {:>14} {:>22}",
        "experts", "PinStore VMAs", "slab-per-expert VMAs"
    );
    // Each size in a fresh process: freed heap pages keep their policies, so a process
    // that bound slabs before would reuse (and merge with) them.
    let exe = std::env::current_exe().expect("current exe");
    for experts in [64usize, 256, 1024, 4096, 16384, 32768] {
        let out = std::process::Command::new(&exe)
            .env("NUMAPIN_BENCH_SCALING", experts.to_string())
            .output()
            .expect("run scaling child");
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
}

fn main() {
    if memory::run_child(&SyntheticModel::default()) || peers::run_child() {
        return;
    }
    let nodes = NodeSet::allowed().expect("allowed nodes");
    if let Some(experts) = std::env::var("NUMAPIN_BENCH_SCALING")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        scaling_row(
            experts,
            Layout::Interleave(nodes),
            &MemPolicy::Interleave(nodes),
        );
        return;
    }
    let runs = env_count("NUMAPIN_BENCH_RUNS", 5);
    let model = SyntheticModel::default();
    let dir = std::env::temp_dir().join(format!("numapin-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("model.bin");
    let peer_runs = env_count("NUMAPIN_BENCH_PEER_RUNS", 3);
    model.write(&path).expect("write model");
    if run_only_table(&model, &path, runs, peer_runs) {
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    load_table(&model, &path, nodes, runs);
    memory::allocator_rows(&path, runs);
    memory::sharing_rows(&model, &path, runs);
    peers::rows(&path, peer_runs);
    replicas::rows(&model, &path, runs);
    let _ = std::fs::remove_dir_all(&dir);
    scaling_table();
}
