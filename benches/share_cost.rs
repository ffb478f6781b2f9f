//! `cargo bench --bench share_cost`: what a rank's tensor slice costs to pack, against the
//! whole expert and against a slice of rows, all in one run on one file.
//!
//! Writes a safetensors checkpoint shaped like Qwen3-30B-A3B's experts (hidden 2048,
//! moe_intermediate 768, BF16: gate and up `[768, 2048]`, down `[2048, 768]`, 9 MiB an
//! expert) with `NUMAPIN_BENCH_SHARE_EXPERTS` experts (default 16) in each of 2 layers,
//! then packs, in turn, the whole model, `rows:0/2` and `columns:0/2` (the file in the
//! page cache after the first pass: this measures the reads and copies, not the disk),
//! `NUMAPIN_BENCH_SHARE_RUNS` times each (default 7). Prints each one's median seconds,
//! bytes, `pread` calls, and the ratios columns/rows and rows/whole of the medians.
//! Figures are printed, never asserted: the machine is shared and noisy.

use std::io::Write;
use std::time::Instant;

use numapin::model::{Checkpoint, Share, TensorSlice};
use numapin::store::{Layout, PinStore, StoreOptions};

const HIDDEN: u64 = 2048;
const FFN: u64 = 768;
const LAYERS: usize = 2;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A per-expert safetensors file: a header naming every tensor, then their bytes (a
/// pattern: the figures do not depend on the values).
fn write_model(path: &std::path::Path, experts: usize) -> std::io::Result<u64> {
    let mut header = String::from("{");
    let mut offset = 0u64;
    let mut tensors = 0;
    for layer in 1..=LAYERS {
        for e in 0..experts {
            for (name, shape) in [
                ("gate_proj", [FFN, HIDDEN]),
                ("up_proj", [FFN, HIDDEN]),
                ("down_proj", [HIDDEN, FFN]),
            ] {
                let len = shape[0] * shape[1] * 2;
                if tensors > 0 {
                    header.push(',');
                }
                header.push_str(&format!(
                    "\"model.layers.{layer}.mlp.experts.{e}.{name}.weight\":{{\"dtype\":\"BF16\",\
                     \"shape\":[{},{}],\"data_offsets\":[{offset},{}]}}",
                    shape[0],
                    shape[1],
                    offset + len
                ));
                offset += len;
                tensors += 1;
            }
        }
    }
    header.push('}');
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    file.write_all(&(header.len() as u64).to_le_bytes())?;
    file.write_all(header.as_bytes())?;
    let chunk: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 3) as u8).collect();
    let mut left = offset;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    file.flush()?;
    Ok(offset)
}

/// Packs `share` into a fresh unplaced store: (seconds, bytes, preads).
fn pack(checkpoint: &Checkpoint, share: &Share) -> (f64, u64, usize) {
    let store = PinStore::new(Layout::Unplaced, StoreOptions::default()).expect("store");
    let start = Instant::now();
    let report = checkpoint.pack_share(&store, share).expect("pack");
    let seconds = start.elapsed().as_secs_f64();
    (seconds, report.bytes, report.reads)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let experts = env("NUMAPIN_BENCH_SHARE_EXPERTS", 16);
    let runs = env("NUMAPIN_BENCH_SHARE_RUNS", 7).max(1);
    let dir = std::env::temp_dir().join(format!("numapin-bench-share-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("model.safetensors");
    let bytes = write_model(&path, experts).expect("write the model");
    let checkpoint = Checkpoint::open(&path).expect("open");
    let shares = [
        ("whole", Share::default()),
        (
            "rows:0/2",
            Share::default().slice(TensorSlice::parse("rows:0/2").unwrap()),
        ),
        (
            "columns:0/2",
            Share::default().slice(TensorSlice::parse("columns:0/2").unwrap()),
        ),
    ];
    println!(
        "share bench: {LAYERS} layers × {experts} experts, {:.0} MiB of BF16 experts \
         (gate/up [{FFN}, {HIDDEN}], down [{HIDDEN}, {FFN}]), {runs} runs each, \
         interleaved; page cache warm",
        bytes as f64 / (1 << 20) as f64
    );
    // Warm the page cache and the allocator once.
    for (_, share) in &shares {
        pack(&checkpoint, share);
    }
    let mut times = vec![Vec::new(); shares.len()];
    let mut facts = vec![(0u64, 0usize); shares.len()];
    for _ in 0..runs {
        for (i, (_, share)) in shares.iter().enumerate() {
            let (s, b, r) = pack(&checkpoint, share);
            times[i].push(s);
            facts[i] = (b, r);
        }
    }
    let medians: Vec<f64> = times.into_iter().map(median).collect();
    for (i, (name, _)) in shares.iter().enumerate() {
        let (b, r) = facts[i];
        println!(
            "  {name:<12} median {:.4} s  {:>6.0} MiB  {:>7} preads  {:.2} GB/s",
            medians[i],
            b as f64 / (1 << 20) as f64,
            r,
            b as f64 / medians[i] / 1e9
        );
    }
    println!(
        "  ratio columns/rows {:.2}, rows/whole {:.2} (medians of the same run)",
        medians[2] / medians[1],
        medians[1] / medians[0]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
