//! `Layout::Replicate`: what building k copies costs, and what finding the local copy
//! costs per call.
//!
//! A one-node host cannot hold replicas on k nodes, so the build is measured as k copies
//! on one node: the file read once into the first copy (a `Replicate` store over this
//! node), then k - 1 copies built exactly as replicas are (reserve, bind, populate, copy
//! with the loader threads; `PinStore::bench_replica_copy`), against reading the file k
//! times (k stores), warm (page-cached, buffered reads) and cold (`O_DIRECT`: every read
//! from the device). Each extra copy is dropped once built, so at most two copies are
//! resident. Lookup: `weights_local` (the node from the thread's rseq area or `getcpu`,
//! then the replica) against `weights` and against indexing a `Vec<&[u8]>`, in
//! alternating rounds (`NUMAPIN_BENCH_ONLY=lookup` runs this part alone).

use std::fs::File;
use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use numapin::NodeSet;
use numapin::store::{Layout, PinStore, ReadMode, StoreOptions};
use numapin_testkit::synthetic::SyntheticModel;

fn options(mode: ReadMode) -> StoreOptions {
    StoreOptions::default().loader_threads(2).read_mode(mode)
}

/// Seconds to pack every layer of `model` from `file` into a new store.
fn pack(model: &SyntheticModel, file: &File, layout: Layout, mode: ReadMode) -> (f64, PinStore) {
    let store = PinStore::new(layout, options(mode)).expect("store");
    let start = Instant::now();
    for layer in 0..model.layers {
        store
            .pack_layer(layer, &model.spec(), &model.sources(file, layer))
            .expect("pack");
    }
    (start.elapsed().as_secs_f64(), store)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn rows(model: &SyntheticModel, path: &Path, runs: usize) {
    let file = File::open(path).expect("open model");
    let node = numapin::topology::current_node().expect("current node");
    let layout = Layout::Replicate(std::iter::once(node).collect::<NodeSet>());
    let bytes = model.total_bytes().unwrap_or(0) as f64;
    // Warm: the file page-cached (buffered reads). Cold: every read from the device
    // (O_DIRECT), so reading k times reads the device k times.
    for (temperature, mode) in [
        ("warm (page-cached)", ReadMode::Buffered),
        ("cold (O_DIRECT)", ReadMode::Direct),
    ] {
        println!();
        println!(
            "replica build, {temperature}: k copies on node {node} ({:.2} GiB each, 2 loader threads; the llama.cpp NUMA mirror PR reports 16.1 GiB in 17.5 s = 0.99 GB/s)",
            bytes / (1u64 << 30) as f64
        );
        build_rows(model, &file, layout, mode, runs);
    }

    lookups(model, &file, layout, runs);
}

/// `weights_local` against `weights` (and a plain index), in alternating rounds: the
/// median ns per call of each, their ratio, and what `current_node` alone costs.
pub fn lookups(model: &SyntheticModel, file: &File, layout: Layout, runs: usize) {
    let (_, store) = pack(model, file, layout, ReadMode::Buffered);
    let slices: Vec<Vec<&[u8]>> = (0..model.layers)
        .map(|l| {
            (0..model.experts)
                .map(|e| store.weights(l, e).expect("weights"))
                .collect()
        })
        .collect();
    let calls = 4_000_000usize;
    let time = |f: &dyn Fn(usize, usize) -> u8| {
        let start = Instant::now();
        let mut sum = 0u64;
        for i in 0..calls {
            sum += u64::from(f(black_box(i % model.layers), black_box(i % model.experts)));
        }
        black_box(sum);
        start.elapsed().as_secs_f64() * 1e9 / calls as f64
    };
    // Alternating rounds, so that a burst of load on the shared machine hits all alike.
    let rounds = runs.max(5);
    let (mut local, mut plain, mut index, mut node, mut ratios) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let l = time(&|l, e| store.weights_local(l, e).expect("local")[0]);
        let p = time(&|l, e| store.weights(l, e).expect("weights")[0]);
        local.push(l);
        plain.push(p);
        ratios.push(l / p);
        index.push(time(&|l, e| slices[l][e][0]));
        node.push(time(&|_, _| {
            numapin::topology::current_node().expect("node").index() as u8
        }));
    }
    let lookup = numapin::topology::node_lookup();
    println!();
    println!(
        "lookup, ns per call ({calls} calls, median of {rounds} alternating rounds; node \
         lookup: {lookup:?}; 2 cores shared with other builds: load {})",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!("{:<34} {:>8.1}", "weights_local", median(local));
    println!("{:<34} {:>8.1}", "weights", median(plain));
    println!(
        "{:<34} {:>8.2}x",
        "weights_local / weights (median)",
        median(ratios)
    );
    println!("{:<34} {:>8.1}", "current_node", median(node));
    println!("{:<34} {:>8.1}", "Vec<&[u8]> index", median(index));
}

/// k = 2, 3 copies: the file read once and copied k - 1 times, against read k times; the
/// two alternate within each run.
fn build_rows(model: &SyntheticModel, file: &File, layout: Layout, mode: ReadMode, runs: usize) {
    let node = numapin::topology::current_node().expect("current node");
    let bytes = model.total_bytes().unwrap_or(0) as f64;
    println!(
        "{:>3} {:>26} {:>26} {:>10}",
        "k", "read once + copy (GB/s)", "read k times (GB/s)", "speed-up"
    );
    let _ = pack(model, file, layout, mode); // warm-up
    for k in [2usize, 3] {
        let mut copied = Vec::new();
        let mut reread = Vec::new();
        for _ in 0..runs {
            let (read, store) = pack(model, file, layout, mode);
            let start = Instant::now();
            for _ in 1..k {
                for layer in 0..model.layers {
                    store.bench_replica_copy(layer, node).expect("copy");
                }
            }
            copied.push(read + start.elapsed().as_secs_f64());
            drop(store);
            let mut total = 0.0;
            for _ in 0..k {
                total += pack(model, file, layout, mode).0;
            }
            reread.push(total);
        }
        let (copied, reread) = (median(copied), median(reread));
        let gbps = |seconds: f64| k as f64 * bytes / seconds / 1e9;
        println!(
            "{k:>3} {:>26.2} {:>26.2} {:>9.2}x",
            gbps(copied),
            gbps(reread),
            reread / copied
        );
    }
}
