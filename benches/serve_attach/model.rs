//! The whole-model mode of `serve_attach` (`cargo bench --bench serve_attach -- model`):
//! 4 processes attach one placed ~1 GiB safetensors checkpoint served by name, against 4
//! processes each placing its own copy.
//!
//! The checkpoint (written once under the target directory) is shaped like Qwen3-30B-A3B's
//! layers: `NUMAPIN_BENCH_SERVE_MODEL_LAYERS` layers (default 4), each with attention
//! q/k/v/o `[2048, 2048]` and `NUMAPIN_BENCH_SERVE_MODEL_EXPERTS` experts (default 26) of
//! gate/up `[768, 2048]` and down `[2048, 768]`, all BF16: 1064 MiB, every byte a function
//! of its file offset. Every store is unplaced (one copy, no policy: what "one copy" means
//! on any machine).
//! 1. served: the placer is `Checkpoint::place_or_attach` (it places the whole model
//!    into memfds, exports it and serves it); 4 readers each `PlacedModel::attach_served`
//!    (the time printed: from connecting to an attached model), read one byte of every
//!    page of every tensor (timed), then compare every tensor's bytes with the file's
//!    (`pread` at the header's offsets; every data byte of the file is covered).
//! 2. own copy: 4 processes each `Checkpoint::place` the model privately (timed), then
//!    compare in the same way.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use numapin::model::{Checkpoint, DenseLayout, PlacedModel, PlacementPlan};
use numapin::serve::{Access, Limits};
use numapin::store::{Layout, StoreOptions};

use super::{READERS, field, finish, gib, pss_bytes, secs, spawn, wait_stdin};

const HIDDEN: u64 = 2048;
const FFN: u64 = 768;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn layers() -> usize {
    env("NUMAPIN_BENCH_SERVE_MODEL_LAYERS", 4)
}

fn experts() -> usize {
    env("NUMAPIN_BENCH_SERVE_MODEL_EXPERTS", 26)
}

/// The checkpoint's tensors, in file order: (name, shape).
fn tensors() -> Vec<(String, [u64; 2])> {
    let mut out = Vec::new();
    for layer in 0..layers() {
        for name in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            out.push((
                format!("model.layers.{layer}.self_attn.{name}.weight"),
                [HIDDEN, HIDDEN],
            ));
        }
        for e in 0..experts() {
            for (name, shape) in [
                ("gate_proj", [FFN, HIDDEN]),
                ("up_proj", [FFN, HIDDEN]),
                ("down_proj", [HIDDEN, FFN]),
            ] {
                out.push((
                    format!("model.layers.{layer}.mlp.experts.{e}.{name}.weight"),
                    shape,
                ));
            }
        }
    }
    out
}

/// (name, absolute file offset, length) of every tensor, and the header's length.
fn layout() -> (Vec<(String, u64, u64)>, String) {
    let mut header = String::from("{");
    let mut offset = 0u64;
    let mut spans = Vec::new();
    for (i, (name, shape)) in tensors().into_iter().enumerate() {
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
        spans.push((name, offset, len));
        offset += len;
    }
    header.push('}');
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let base = 8 + header.len() as u64;
    for s in &mut spans {
        s.1 += base;
    }
    (spans, header)
}

/// The byte at file offset `at` of a data region.
fn byte_at(at: u64) -> u8 {
    ((at % 251) ^ (at >> 20) ^ (at >> 12)) as u8
}

pub fn path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/release/deps/serve_attach-… → target/
    let target = exe.ancestors().nth(3).unwrap().to_path_buf();
    target.join(format!(
        "serve-bench-model-{}x{}.safetensors",
        layers(),
        experts()
    ))
}

/// Writes the checkpoint unless a file of its length is there; its data bytes.
fn write() -> u64 {
    let (spans, header) = layout();
    let data: u64 = spans.iter().map(|s| s.2).sum();
    let base = 8 + header.len() as u64;
    let path = path();
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == base + data) {
        return data;
    }
    let tmp = path.with_extension("partial");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).unwrap());
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(header.as_bytes()).unwrap();
    let mut chunk = vec![0u8; 1 << 20];
    let mut at = base;
    while at < base + data {
        let n = (base + data - at).min(chunk.len() as u64) as usize;
        for (i, b) in chunk[..n].iter_mut().enumerate() {
            *b = byte_at(at + i as u64);
        }
        f.write_all(&chunk[..n]).unwrap();
        at += n as u64;
    }
    f.flush().unwrap();
    drop(f);
    std::fs::rename(&tmp, &path).unwrap();
    data
}

fn plan() -> PlacementPlan {
    PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
}

/// Every tensor's bytes in `model` against the file's (`pread`); the bytes compared.
fn compare(model: &PlacedModel) -> u64 {
    let file = std::fs::File::open(path()).unwrap();
    let mut buf = Vec::new();
    let mut n = 0;
    for (name, at, len) in layout().0 {
        buf.resize(len as usize, 0);
        file.read_exact_at(&mut buf, at).unwrap();
        let view = model.tensor(&name).unwrap();
        let bytes = view.bytes().unwrap_or_else(|| panic!("{name}: no bytes"));
        assert!(bytes == &buf[..], "{name}: the model's bytes differ");
        n += len;
    }
    n
}

/// Reads one byte of every page of every tensor.
fn touch(model: &PlacedModel) -> u64 {
    let mut sum = 0u64;
    for view in model.tensors() {
        let bytes = view.unwrap().bytes().unwrap();
        sum += bytes.iter().step_by(4096).map(|&b| b as u64).sum::<u64>();
    }
    sum
}

fn limits() -> Limits {
    Limits::default()
}

/// A child of the model mode: `false` when `role` is not one.
pub fn child(role: &str, name: &str) -> bool {
    match role {
        "model-server" => {
            let checkpoint = Checkpoint::open(path()).unwrap();
            let options = StoreOptions::default();
            let (_model, server) = checkpoint
                .place_or_attach(name, &plan(), options, Access::same_uid(), &limits())
                .unwrap();
            assert!(server.is_some(), "the first process must place and serve");
            println!("READY");
            wait_stdin();
        }
        "model-reader" => {
            let t = Instant::now();
            let model = PlacedModel::attach_served(name, &limits()).unwrap();
            let secs = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let touched = touch(&model);
            let touch = t.elapsed().as_secs_f64();
            let n = compare(&model);
            println!("READY secs={secs:.4} touch={touch:.4} bytes={n} sum={touched}");
            wait_stdin();
        }
        "model-own" => {
            let checkpoint = Checkpoint::open(path()).unwrap();
            let t = Instant::now();
            let model = checkpoint.place(&plan(), StoreOptions::default()).unwrap();
            let secs = t.elapsed().as_secs_f64();
            let n = compare(&model);
            println!("READY secs={secs:.4} bytes={n}");
            wait_stdin();
        }
        _ => return false,
    }
    true
}

pub fn run() {
    let t = Instant::now();
    let data = write();
    println!(
        "model {} ({} layers, {} experts a layer, {:.3} GiB of tensors) ready in {:.1} s",
        path().display(),
        layers(),
        experts(),
        gib(data as f64),
        t.elapsed().as_secs_f64()
    );
    // Warm the page cache so that the placer and the own copies read from memory.
    let _ = std::fs::read(path()).unwrap();
    let copy = data as f64;
    let name = format!("bench-model-{}", std::process::id());
    let t = Instant::now();
    let (mut server, _) = spawn("model-server", &name);
    let serve_secs = t.elapsed().as_secs_f64();
    let readers: Vec<_> = (0..READERS).map(|_| spawn("model-reader", &name)).collect();
    for (_, l) in &readers {
        assert_eq!(field(l, "bytes=") as u64, data, "{l}");
    }
    let attach: Vec<f64> = readers.iter().map(|(_, l)| secs(l)).collect();
    let touch: Vec<f64> = readers.iter().map(|(_, l)| field(l, "touch=")).collect();
    let ready: Vec<f64> = attach.iter().zip(&touch).map(|(a, t)| a + t).collect();
    let pss_server = pss_bytes(server.id()) as f64;
    let pss_all = pss_server
        + readers
            .iter()
            .map(|(c, _)| pss_bytes(c.id()) as f64)
            .sum::<f64>();
    server.kill().unwrap();
    server.wait().unwrap();
    let pss_readers: f64 = readers.iter().map(|(c, _)| pss_bytes(c.id()) as f64).sum();
    finish(readers);
    let own: Vec<_> = (0..READERS)
        .map(|i| spawn("model-own", &format!("own{i}")))
        .collect();
    for (_, l) in &own {
        assert_eq!(field(l, "bytes=") as u64, data, "{l}");
    }
    let own_secs: Vec<f64> = own.iter().map(|(_, l)| secs(l)).collect();
    let pss_own: f64 = own.iter().map(|(c, _)| pss_bytes(c.id()) as f64).sum();
    finish(own);
    println!(
        "every tensor byte equal to the file in all {READERS} readers and {READERS} own copies"
    );
    println!(
        "server: open + place_or_attach (place, export, bind) {serve_secs:.3} s (process start \
         included); its Pss {:.3} GiB",
        gib(pss_server)
    );
    super::print_figures(&super::Figures {
        title: "whole model, 4 processes",
        attach_row: "served: attach_served (+server)",
        attach: &attach,
        ready: &ready,
        own: &own_secs,
        pss: [pss_all, pss_readers, pss_own],
        copy,
    });
}
