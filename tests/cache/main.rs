//! ExpertCache and StagingPool: a randomized Zipf workload over 4 threads in which every
//! entry must hold exactly its expert's bytes, a single-threaded run that must match a
//! reference CLOCK model hit for hit (and one with concurrent phases), mappings that must not change with churn, and the
//! edge cases (capacity 0, every slot held, a source larger than a slot, the largest
//! keys, a failed load) as errors.
//!
//! `NUMAPIN_CACHE_OPS` sets the randomized runs' operation count (default 1,000,000; the
//! container and VM stages set 100,000).

mod against_a_model;
#[path = "../common/mod.rs"]
mod common;
mod edges;

use std::collections::HashMap;
use std::sync::{Arc, Barrier};

use common::{Expect, expect, need_nodes, nodes};
use numapin::cache::{CacheOptions, ExpertCache, StagingPool};
use numapin::store::ExpertSource;
use numapin::{Error, Invalid, Node, NodeSet, diag};

use numapin::policy::{DegradeReason, Observed, Placement};

const LAYERS: usize = 64;
const EXPERTS: usize = 256;
const WEIGHT_BYTES: usize = 4096;
const SCALE_BYTES: usize = 4096;
const CACHE_SLOTS: usize = 128;
const THREADS: usize = 4;

fn ops() -> usize {
    std::env::var("NUMAPIN_CACHE_OPS")
        .ok()
        .map(|v| v.parse().expect("NUMAPIN_CACHE_OPS is a number"))
        .unwrap_or(1_000_000)
}

/// xorshift64*: a tiny seeded generator.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s = 1.0) over `n` ranks by inverse CDF; ranks map to keys through a seeded
/// shuffle so that hot experts are scattered over layers.
struct Zipf {
    cdf: Vec<f64>,
    keys: Vec<(usize, usize)>,
}

impl Zipf {
    fn new(layers: usize, experts: usize, seed: u64) -> Zipf {
        let n = layers * experts;
        let mut cdf = Vec::with_capacity(n);
        let mut sum = 0.0;
        for rank in 1..=n {
            sum += 1.0 / rank as f64;
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        let mut keys: Vec<(usize, usize)> = (0..layers)
            .flat_map(|l| (0..experts).map(move |e| (l, e)))
            .collect();
        let mut rng = XorShift(seed);
        for i in (1..n).rev() {
            keys.swap(i, rng.below(i + 1));
        }
        Zipf { cdf, keys }
    }

    fn sample(&self, rng: &mut XorShift) -> (usize, usize) {
        let u = rng.unit();
        let rank = self
            .cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1);
        self.keys[rank]
    }
}

/// Every expert's bytes, derived from its key: a window of a random pattern starting at
/// a per-key offset, so that no two experts hold the same bytes and checking an entry is
/// one comparison.
struct Experts {
    weights: Vec<u8>,
    scales: Vec<u8>,
}

impl Experts {
    fn new(seed: u64) -> Experts {
        let mut rng = XorShift(seed);
        let len = LAYERS * EXPERTS * 8 + WEIGHT_BYTES.max(SCALE_BYTES);
        let mut pattern = |len: usize| -> Vec<u8> {
            (0..len.div_ceil(8))
                .flat_map(|_| rng.next().to_le_bytes())
                .collect()
        };
        Experts {
            weights: pattern(len),
            scales: pattern(len),
        }
    }

    fn source(&self, (layer, expert): (usize, usize)) -> ExpertSource<'_> {
        let start = ((layer % LAYERS) * EXPERTS + expert % EXPERTS) * 8;
        ExpertSource::Memory {
            weights: &self.weights[start..start + WEIGHT_BYTES],
            scales: &self.scales[start..start + SCALE_BYTES],
        }
    }

    fn check(&self, entry: &numapin::cache::Entry<'_>) {
        let ExpertSource::Memory { weights, scales } = self.source(entry.key()) else {
            unreachable!()
        };
        assert!(entry.weights() == weights, "weights of {:?}", entry.key());
        assert!(entry.scales() == scales, "scales of {:?}", entry.key());
    }
}

fn cache_nodes() -> NodeSet {
    nodes()
}

fn new_cache(nodes: NodeSet, slots_per_node: usize) -> ExpertCache {
    ExpertCache::new(
        nodes,
        slots_per_node,
        WEIGHT_BYTES,
        SCALE_BYTES,
        CacheOptions::default(),
    )
    .unwrap()
}

fn expected_placement() -> Placement {
    match expect() {
        Expect::Full => Placement::Bound,
        Expect::Denied => Placement::Degraded(DegradeReason::Denied),
        Expect::Unsupported => Placement::Degraded(DegradeReason::Unsupported),
    }
}

/// One operation of a stream: a `get`, or a `get_or_load` with a hint.
#[derive(Clone, Copy)]
enum Op {
    Get((usize, usize)),
    Load((usize, usize), Node),
}

fn stream(seed: u64, n: usize, nodes: &[Node]) -> Vec<Op> {
    let zipf = Zipf::new(LAYERS, EXPERTS, 0x5eed);
    let mut rng = XorShift(seed);
    (0..n)
        .map(|_| {
            let key = zipf.sample(&mut rng);
            let hint = nodes[rng.below(nodes.len())];
            if rng.below(4) == 0 {
                Op::Get(key)
            } else {
                Op::Load(key, hint)
            }
        })
        .collect()
}
