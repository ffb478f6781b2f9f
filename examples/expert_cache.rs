//! Drives a Zipf(1.0) stream of expert requests through an `ExpertCache` — a serving
//! cache of fixed slots in one bound region pair per node — and prints the hit rate, the
//! mappings before and after the churn, and what a miss costs next to a hit.
//!
//! `cargo run --release --example expert_cache -- --ops 1000000 --slots 128`

mod support;

use std::time::Instant;
use support::outln;

use clap::Parser;
use numapin::NodeSet;
use numapin::cache::{CacheOptions, ExpertCache};
use numapin::store::ExpertSource;

/// Zipf stream through an ExpertCache: hit rate, mappings, miss cost.
#[derive(Debug, Parser)]
#[command(name = "expert_cache")]
struct Args {
    /// Requests to make.
    #[arg(long, default_value_t = 1_000_000)]
    ops: usize,
    /// Slots per node.
    #[arg(long, default_value_t = 128)]
    slots: usize,
    /// Layers of the model the requests draw from.
    #[arg(long, default_value_t = 64)]
    layers: usize,
    /// Experts per layer.
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// Weight bytes per expert (scales are a sixteenth of them).
    #[arg(long, default_value_t = 64 << 10)]
    weight_bytes: usize,
    /// The nodes of the cache (numactl syntax).
    #[arg(long, default_value = "all", value_parser = NodeSet::parse)]
    nodes: NodeSet,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let scale_bytes = args.weight_bytes / 16;
    let cache = ExpertCache::new(
        args.nodes,
        args.slots,
        args.weight_bytes,
        scale_bytes,
        CacheOptions::default(),
    )?;
    let created = cache.stats()?.mappings;
    // Every expert's bytes are windows of one buffer: the copy is what a load costs.
    let keys = args.layers * args.experts;
    let pattern: Vec<u8> = (0..args.weight_bytes + keys).map(|i| i as u8).collect();
    let source = |key: usize| ExpertSource::Memory {
        weights: &pattern[key..key + args.weight_bytes],
        scales: &pattern[key..key + scale_bytes],
    };
    let stream = zipf(keys, args.ops, 0x5eed);
    let start = Instant::now();
    for &key in &stream {
        let (layer, expert) = (key / args.experts, key % args.experts);
        let entry = cache.get_or_load(layer, expert, &source(key), None)?;
        std::hint::black_box(entry.weights());
    }
    let seconds = start.elapsed().as_secs_f64();
    let stats = cache.stats()?;
    // A hit alone, on the hottest key, for the cost of a lookup.
    let hot = stream[0];
    let hits = 100_000;
    let hit_start = Instant::now();
    for _ in 0..hits {
        let entry = cache.get(hot / args.experts, hot % args.experts);
        std::hint::black_box(entry.map(|e| e.weights().len()));
    }
    let hit_ns = hit_start.elapsed().as_secs_f64() * 1e9 / hits as f64;
    let op_ns = seconds * 1e9 / args.ops as f64;
    let hit_rate = stats.hits as f64 / (stats.hits + stats.misses).max(1) as f64;
    // op = hit_rate × hit + (1 − hit_rate) × miss.
    let miss_ns = (op_ns - hit_rate * hit_ns) / (1.0 - hit_rate).max(1e-9);
    outln!(
        "expert_cache: {} requests, Zipf(1.0) over {keys} experts",
        args.ops
    );
    outln!(
        "  nodes          {} ({} slots each)",
        args.nodes,
        args.slots
    );
    outln!(
        "  hit rate       {:.1}% ({} hits, {} misses, {} evictions)",
        100.0 * hit_rate,
        stats.hits,
        stats.misses,
        stats.evictions
    );
    outln!(
        "  mappings       {created} after creation, {} after the churn",
        stats.mappings
    );
    outln!("  per request    {op_ns:.0} ns; a hit {hit_ns:.0} ns, a miss ~{miss_ns:.0} ns");
    for node in &stats.nodes {
        outln!(
            "  node {:<9} {} of {} slots used, {} KiB resident, {}",
            node.node.to_string(),
            node.used,
            node.slots,
            node.resident_bytes >> 10,
            node.placement
        );
    }
    Ok(())
}

/// `n` keys drawn Zipf(1.0) over `count` keys (inverse CDF, xorshift64*).
fn zipf(count: usize, n: usize, mut seed: u64) -> Vec<usize> {
    let mut next = move || {
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        seed.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut cdf: Vec<f64> = (1..=count)
        .scan(0.0, |sum, rank| {
            *sum += 1.0 / rank as f64;
            Some(*sum)
        })
        .collect();
    let total = cdf.last().copied().unwrap_or(1.0);
    cdf.iter_mut().for_each(|c| *c /= total);
    (0..n)
        .map(|_| {
            let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
            cdf.partition_point(|&c| c <= u).min(count - 1)
        })
        .collect()
}
