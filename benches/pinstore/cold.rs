//! Cold loads against the device (`NUMAPIN_BENCH_ONLY=cold`, `NUMAPIN_BENCH_COLD_ROUNDS`
//! rounds, default 5): every row once per round, in a rotating order, each in a process of
//! its own with the file evicted first; each row's ratio to its yardstick is taken round
//! by round (the rows of one round run within seconds of each other, so a machine whose
//! speed drifts moves both sides of a ratio), and the median of those ratios is printed.
//!
//! Yardsticks: a plain `O_DIRECT` read in 8 MiB windows into one buffer (what
//! `dd bs=8M iflag=direct` does) for the direct rows, a buffered read into one buffer
//! (`cat file > /dev/null`) for drop-behind and buffered loads. `NUMAPIN_BENCH_COLD_ROWS`
//! (child modes, comma-separated) runs some rows only, with their yardsticks. "O_DIRECT into fresh memory" is the same
//! plain read into memory a load would fill (bound, huge pages, faulted and zeroed as it
//! is read): what a loader that does not overlap its page faults with the device's
//! transfers reaches. "zero+copy 2 thr" is the CPU's ceiling for any buffered
//! load into fresh memory (drop-behind's included): the file's bytes, already in memory,
//! copied into fresh bound huge pages by two threads, each page zeroed by the kernel at
//! its first touch, then overwritten; `cat` does neither.

use std::path::Path;

use super::peers;

/// (name, child mode, yardstick mode).
const ROWS: &[(&str, &str, &str)] = &[
    ("plain O_DIRECT read (dd bs=8M)", "o-direct", "o-direct"),
    ("O_DIRECT into fresh memory", "o-direct-fresh", "o-direct"),
    ("PinStore direct (io_uring)", "pin-direct", "o-direct"),
    (
        "PinStore direct (threads)",
        "pin-direct-threads",
        "o-direct",
    ),
    ("buffered read (cat)", "buffered-read", "buffered-read"),
    ("PinStore drop-behind", "pin-drop-behind", "buffered-read"),
    ("PinStore buffered", "pin-buffered", "buffered-read"),
    (
        "zero+copy 2 thr (CPU ceiling)",
        "memcpy-fresh",
        "buffered-read",
    ),
];

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn spread(values: &[f64]) -> (f64, f64) {
    values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

/// The rows to run: those `NUMAPIN_BENCH_COLD_ROWS` names (child modes, comma-separated:
/// `pin-drop-behind,pin-buffered`) and their yardsticks; every row when it is unset.
fn selected() -> Vec<bool> {
    let Ok(names) = std::env::var("NUMAPIN_BENCH_COLD_ROWS") else {
        return vec![true; ROWS.len()];
    };
    let named: Vec<&str> = names.split(',').map(str::trim).collect();
    ROWS.iter()
        .map(|&(_, mode, _)| {
            named.contains(&mode)
                || ROWS
                    .iter()
                    .any(|&(_, m, yard)| yard == mode && named.contains(&m))
        })
        .collect()
}

/// Prints the cold table for the model file at `path`.
pub fn rows(path: &Path, rounds: usize) {
    let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    println!();
    println!(
        "cold loads of one {} MiB file: {rounds} rounds, every row once a round in a rotating \
         order, each in a process of its own with the file evicted first",
        bytes >> 20
    );
    // gbps[row][round], cached[row][round]
    let mut gbps = vec![Vec::new(); ROWS.len()];
    let mut cached = vec![Vec::new(); ROWS.len()];
    let mut peak = vec![Vec::new(); ROWS.len()];
    let wanted = selected();
    for round in 0..rounds {
        for i in 0..ROWS.len() {
            let row = (i + round) % ROWS.len();
            if !wanted[row] {
                continue;
            }
            match peers::cold_once(ROWS[row].1, path) {
                Ok((g, c, p)) => {
                    gbps[row].push(g);
                    cached[row].push(c);
                    peak[row].push(p);
                }
                Err(e) => {
                    println!("{}: failed: {}", ROWS[row].0, e.trim());
                    return;
                }
            }
        }
    }
    println!(
        "{:<32} {:>7} {:>13} {:>8} {:>13} {:>9} {:>7}",
        "case", "GB/s", "(min-max)", "x yard", "(min-max)", "cached %", "peak %"
    );
    for (row, &(name, _, yardstick)) in ROWS.iter().enumerate() {
        if !wanted[row] {
            continue;
        }
        let yard = ROWS.iter().position(|r| r.1 == yardstick).unwrap_or(row);
        let ratios: Vec<f64> = gbps[row]
            .iter()
            .zip(&gbps[yard])
            .map(|(a, b)| a / b)
            .collect();
        let (lo, hi) = spread(&gbps[row]);
        let (rlo, rhi) = spread(&ratios);
        println!(
            "{name:<32} {:>7.2} {:>13} {:>8.2} {:>13} {:>9.1} {:>7.1}",
            median(gbps[row].clone()),
            format!("({lo:.2}-{hi:.2})"),
            median(ratios.clone()),
            format!("({rlo:.2}-{rhi:.2})"),
            cached[row].iter().copied().fold(0.0, f64::max) * 100.0,
            peak[row].iter().copied().fold(0.0, f64::max) * 100.0
        );
    }
    println!(
        "x yard: the median over rounds of the row's GB/s over its yardstick's in the same \
         round (direct rows: the plain O_DIRECT read; drop-behind: the buffered read); \
         cached %: the most of the file left in the page cache after a run; peak %: the \
         most of it seen cached during a run (mincore every 25 ms)"
    );
}
