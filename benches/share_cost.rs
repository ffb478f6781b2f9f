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
//!
//! Then the dense side (issue 26's tensor parallelism): the file also holds a dense
//! layer 0 (attention q/k/v/o `[2048, 2048]`, MLP gate/up `[6144, 2048]`, down
//! `[2048, 6144]`) and the attention of the MoE layers, 168 MiB of BF16; the whole-model
//! plan (`Checkpoint::place`, unplaced, one expert per MoE layer so that the dense bytes
//! dominate) places the dense tensors whole, `rows:0/2`, `columns:0/2` (one strided
//! piece per row) and under the tensor-parallel preset `tp:0/2` (q/k/v/gate/up rows,
//! o/down columns), interleaved, and prints the same figures and the ratio
//! columns/rows of the medians.

use std::io::Write;
use std::time::Instant;

use numapin::model::{
    Checkpoint, DenseLayout, ExpertShare, PlacementPlan, Share, SliceAxis, TensorSlice,
};
use numapin::store::{Layout, PinStore, StoreOptions};

const HIDDEN: u64 = 2048;
const FFN: u64 = 768;
const LAYERS: usize = 2;
/// The dense layer's MLP width.
const DENSE_FFN: u64 = 6144;

/// The dense tensors of the file: layer 0's attention and MLP, the MoE layers' attention.
fn dense_tensors() -> Vec<(String, [u64; 2])> {
    let mut out = Vec::new();
    for layer in 0..=LAYERS {
        for name in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            out.push((
                format!("model.layers.{layer}.self_attn.{name}.weight"),
                [HIDDEN, HIDDEN],
            ));
        }
    }
    for (name, shape) in [
        ("gate_proj", [DENSE_FFN, HIDDEN]),
        ("up_proj", [DENSE_FFN, HIDDEN]),
        ("down_proj", [HIDDEN, DENSE_FFN]),
    ] {
        out.push((format!("model.layers.0.mlp.{name}.weight"), shape));
    }
    out
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A per-expert safetensors file: a header naming every tensor, then their bytes (a
/// pattern: the figures do not depend on the values).
fn write_model(path: &std::path::Path, experts: usize) -> std::io::Result<u64> {
    let mut all = dense_tensors();
    for layer in 1..=LAYERS {
        for e in 0..experts {
            for (name, shape) in [
                ("gate_proj", [FFN, HIDDEN]),
                ("up_proj", [FFN, HIDDEN]),
                ("down_proj", [HIDDEN, FFN]),
            ] {
                all.push((
                    format!("model.layers.{layer}.mlp.experts.{e}.{name}.weight"),
                    shape,
                ));
            }
        }
    }
    let mut header = String::from("{");
    let mut offset = 0u64;
    for (i, (name, shape)) in all.iter().enumerate() {
        let len = shape[0] * shape[1] * 2;
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"{name}\":{{\"dtype\":\"BF16\",\"shape\":[{},{}],\"data_offsets\":[{offset},{}]}}",
            shape[0],
            shape[1],
            offset + len
        ));
        offset += len;
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

/// Places `plan` (every store unplaced): (seconds, dense bytes held, dense preads).
fn place(checkpoint: &Checkpoint, plan: &PlacementPlan) -> (f64, u64, usize) {
    let start = Instant::now();
    let model = checkpoint
        .place(plan, StoreOptions::default())
        .expect("place");
    let seconds = start.elapsed().as_secs_f64();
    let report = model.report().expect("report");
    let dense = |c: &numapin::model::TensorClass| *c != numapin::model::TensorClass::RoutedExperts;
    let bytes = report
        .cost
        .classes
        .iter()
        .filter(|c| dense(&c.class))
        .map(|c| c.bytes)
        .sum();
    let reads = report
        .measured
        .iter()
        .filter(|m| dense(&m.class))
        .map(|m| m.reads)
        .sum();
    (seconds, bytes, reads)
}

/// The dense half: whole, rows, columns and the TP preset, interleaved.
fn dense_bench(checkpoint: &Checkpoint, experts: usize, runs: usize) {
    let base = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
        .share(Share::default().experts(ExpertShare::part(0, experts).expect("share")));
    let part = |axis| TensorSlice::part(axis, 0, 2).expect("slice");
    let plans = [
        ("dense whole", base.clone()),
        (
            "dense rows:0/2",
            base.clone().dense_slice(part(SliceAxis::Rows)),
        ),
        (
            "dense columns:0/2",
            base.clone().dense_slice(part(SliceAxis::Columns)),
        ),
        ("dense tp:0/2", {
            // The preset's own expert share would slice the experts too: keep the one
            // expert per layer whole, as in the other plans.
            let plan = base.clone().tensor_parallel(0, 2).expect("tp");
            plan.share(Share::default().experts(ExpertShare::part(0, experts).expect("share")))
        }),
    ];
    for (_, plan) in &plans {
        place(checkpoint, plan);
    }
    let mut times = vec![Vec::new(); plans.len()];
    let mut facts = vec![(0u64, 0usize); plans.len()];
    for _ in 0..runs {
        for (i, (_, plan)) in plans.iter().enumerate() {
            let (s, b, r) = place(checkpoint, plan);
            times[i].push(s);
            facts[i] = (b, r);
        }
    }
    let medians: Vec<f64> = times.into_iter().map(median).collect();
    for (i, (name, _)) in plans.iter().enumerate() {
        let (b, r) = facts[i];
        println!(
            "  {name:<18} median {:.4} s  {:>6.0} MiB dense  {:>7} dense preads",
            medians[i],
            b as f64 / (1 << 20) as f64,
            r
        );
    }
    println!(
        "  dense ratio columns/rows {:.2}, tp/rows {:.2}, rows/whole {:.2} (medians of the \
         same run; each place also packs one expert per MoE layer)",
        medians[2] / medians[1],
        medians[3] / medians[1],
        medians[1] / medians[0]
    );
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
        "share bench: {LAYERS} layers × {experts} experts, {:.0} MiB of BF16 (experts, then 168 MiB dense) \
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
    dense_bench(&checkpoint, experts, runs);
    let _ = std::fs::remove_dir_all(&dir);
}
