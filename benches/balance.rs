//! `cargo bench --bench balance`: how [`routing::balance`] and [`planner::plan`] with
//! routing statistics grow with a layer's experts (issue 31: they were quadratic or worse).
//!
//! For each size (default 1024, 8192 and 65536 experts — the crate's ceiling per layer;
//! `NUMAPIN_BENCH_BALANCE_SIZES=1024,8192` to choose), Zipf-like counts (expert of rank
//! `r` routed `1e6 / (r + 1)` times plus noise, ranks shuffled by a fixed xorshift):
//! - `balance` over the 8 nodes of docs/planner/nps4_2socket.json, tight caps (the even
//!   share, `ceil(E / 8)`) and loose ones (`E`: no cap);
//! - `plan()` for that machine, 2 MoE layers of `E` experts of 3 MiB each with statistics
//!   for both, a per-node budget of 1.5 × an even split of the experts (so that the hybrid
//!   layouts replicate some and split the rest by load).
//!
//! Prints each one's median seconds over `NUMAPIN_BENCH_BALANCE_RUNS` runs (default 3; one
//! run when a run takes over 10 s), the largest node load over the mean (how balanced), and
//! each size's time over the first size's. `NUMAPIN_BENCH_ONLY=plan` (or `tight`, `no caps`)
//! runs the cases whose name holds it. Figures are printed, never asserted.

use std::time::Instant;

use numapin::planner::{self, Machine, ModelSizes, MoeLayerSizes, PlanOptions};
use numapin::routing::{self, RoutingStats};

const MACHINE: &str = include_str!("../docs/planner/nps4_2socket.json");
const NODES: usize = 8;

fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Zipf-like counts, ranks shuffled (Fisher-Yates with xorshift).
fn counts(experts: usize, seed: u64) -> Vec<u64> {
    let mut state = seed;
    let mut rank: Vec<usize> = (0..experts).collect();
    for i in (1..experts).rev() {
        let j = (next(&mut state) % (i as u64 + 1)) as usize;
        rank.swap(i, j);
    }
    rank.iter()
        .map(|&r| 1_000_000 / (r as u64 + 1) + next(&mut state) % 16)
        .collect()
}

/// Median seconds of `runs` runs of `f` (one run when the first takes over 10 s).
fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut times = Vec::new();
    let mut out;
    loop {
        let t = Instant::now();
        out = f();
        times.push(t.elapsed().as_secs_f64());
        if times.len() >= runs || times[0] > 10.0 {
            break;
        }
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], out)
}

fn imbalance(counts: &[u64], node_of: &[usize]) -> f64 {
    let load = routing::node_loads(counts, node_of, NODES);
    let max = load.iter().copied().max().unwrap_or(0) as f64;
    let mean = load.iter().sum::<u128>() as f64 / NODES as f64;
    max / mean
}

fn main() {
    let sizes: Vec<usize> = std::env::var("NUMAPIN_BENCH_BALANCE_SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1024, 8192, 65536]);
    let runs: usize = std::env::var("NUMAPIN_BENCH_BALANCE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let machine = Machine::from_json(MACHINE).expect("the committed machine description");
    println!(
        "{:<26} {:>8} {:>12} {:>10} {:>9}",
        "case", "experts", "seconds", "x first", "max/mean"
    );
    let only = std::env::var("NUMAPIN_BENCH_ONLY").unwrap_or_default();
    let cases = [
        "balance, tight caps",
        "balance, no caps",
        "plan() with statistics",
    ];
    for case in cases.into_iter().filter(|c| c.contains(only.as_str())) {
        let mut first = None;
        for &e in &sizes {
            let c = counts(e, 0x9e37_79b9_7f4a_7c15 ^ e as u64);
            let (secs, quality) = match case {
                "plan() with statistics" => {
                    let slot = 3u64 << 20;
                    let model = ModelSizes {
                        moe_layers: (1..=2)
                            .map(|layer| MoeLayerSizes {
                                layer,
                                experts: e,
                                weight_bytes: slot,
                                scale_bytes: 0,
                            })
                            .collect(),
                        other_bytes: 1 << 30,
                    };
                    let stats =
                        RoutingStats::from_counts([(1, c.clone()), (2, counts(e, e as u64))])
                            .expect("counts");
                    let budget = (1 << 30) + 3 * model.expert_bytes() / (2 * NODES as u64);
                    let options = PlanOptions::default().budget(budget);
                    let (secs, table) = time(runs, || {
                        planner::plan(&model, &machine, Some(&stats), &options).expect("plan")
                    });
                    (secs, table.rows.len() as f64)
                }
                _ => {
                    let cap = if case == "balance, tight caps" {
                        e.div_ceil(NODES)
                    } else {
                        e
                    };
                    let (secs, node_of) = time(runs, || {
                        routing::balance(&c, &[cap; NODES]).expect("balance")
                    });
                    (secs, imbalance(&c, &node_of))
                }
            };
            let base = *first.get_or_insert(secs);
            let quality = match case {
                "plan() with statistics" => "-".to_string(),
                _ => format!("{quality:.6}"),
            };
            println!(
                "{case:<26} {e:>8} {secs:>12.6} {:>10.1} {quality:>9}",
                secs / base
            );
        }
    }
}
