//! `cargo bench --bench serve_attach`: 4 processes on one placed 1 GiB store, served by
//! name, against 4 processes each placing its own copy.
//!
//! Writes (once) a 1 GiB file under the target directory: `NUMAPIN_BENCH_SERVE_LAYERS`
//! layers (default 16) of 32 experts of 2 MiB, every byte a function of its offset.
//! Then, each in processes of its own (this binary run again, `NUMAPIN_BENCH_SERVE_ROLE`):
//! 1. served: one process places the file into a memfd store, exports it and serves it
//!    (`numapin::serve::Server::bind`); 4 readers each fetch, parse the manifest and
//!    attach (the time printed: from connecting to an attached `PinStore`), read one
//!    byte of every page (mapping the shared pages in: timed too), then compare every
//!    byte with the file (`pread`). The sum of the 5 processes' `Pss` (from
//!    `/proc/PID/smaps_rollup`) is read while all hold the store, then again after the
//!    server is SIGKILLed (the 4 readers alone).
//! 2. own copy: 4 processes each place the file into a private store (the time printed:
//!    `PinStore::new` and every `pack_layer`, the file in the page cache), compare every
//!    byte, and the sum of their `Pss` is read.
//!
//! Prints each process's seconds, the sums of `Pss` in GiB and against one copy, and the
//! ratios of the times. Figures are printed, never asserted: the machine is shared.
//!
//! `-- store` runs only the above; `-- model` only the whole-model mode (`model.rs`: a
//! ~1 GiB safetensors checkpoint placed and served by `Checkpoint::place_or_attach`,
//! attached by `PlacedModel::attach_served`); with neither, both run.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use numapin::serve::{self, Access, Limits, Parcel, Server};
use numapin::store::{ExpertSource, LayerSpec, Layout, Manifest, PinStore, StoreOptions};

#[path = "serve_attach/model.rs"]
mod model;

const EXPERTS: usize = 32;
const EXPERT_BYTES: usize = 2 << 20;
const READERS: usize = 4;

fn layers() -> usize {
    std::env::var("NUMAPIN_BENCH_SERVE_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
}

/// The byte at `offset` of the file.
fn byte_at(offset: usize) -> u8 {
    ((offset % 251) ^ (offset >> 21) ^ (offset >> 13)) as u8
}

fn file_path() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/release/deps/serve_attach-… → target/
    let target = exe.ancestors().nth(3).unwrap().to_path_buf();
    target.join(format!(
        "serve-bench-{}x{EXPERTS}x{EXPERT_BYTES}.bin",
        layers()
    ))
}

fn write_file() -> std::path::PathBuf {
    let path = file_path();
    let len = (layers() * EXPERTS * EXPERT_BYTES) as u64;
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == len) {
        return path;
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let mut chunk = vec![0u8; EXPERT_BYTES];
    for c in 0..layers() * EXPERTS {
        for (i, b) in chunk.iter_mut().enumerate() {
            *b = byte_at(c * EXPERT_BYTES + i);
        }
        f.write_all(&chunk).unwrap();
    }
    f.flush().unwrap();
    path
}

/// Places the file into a store (memfd-backed when `shared`).
fn place(shared: bool) -> PinStore {
    let file = std::fs::File::open(file_path()).unwrap();
    let options = StoreOptions::default().shared(shared);
    let store = PinStore::new(Layout::Unplaced, options).unwrap();
    let spec = LayerSpec {
        experts: EXPERTS,
        weight_bytes: EXPERT_BYTES,
        scale_bytes: 0,
    };
    for layer in 0..layers() {
        let sources: Vec<ExpertSource> = (0..EXPERTS)
            .map(|e| {
                let at = ((layer * EXPERTS + e) * EXPERT_BYTES) as u64;
                ExpertSource::from_file(&file, &[(at, EXPERT_BYTES)], &[])
            })
            .collect();
        store.pack_layer(layer, &spec, &sources).unwrap();
    }
    store
}

/// Every byte of the store against the file; the bytes compared.
fn compare(store: &PinStore) -> usize {
    let file = std::fs::File::open(file_path()).unwrap();
    let mut buf = vec![0u8; EXPERT_BYTES];
    let mut n = 0;
    for layer in 0..layers() {
        for e in 0..EXPERTS {
            let at = ((layer * EXPERTS + e) * EXPERT_BYTES) as u64;
            file.read_exact_at(&mut buf, at).unwrap();
            assert!(
                store.weights(layer, e).unwrap() == &buf[..],
                "layer {layer} expert {e}"
            );
            n += buf.len();
        }
    }
    n
}

/// Reads one byte of every page (the shared pages mapped in: minor faults, no copy).
fn touch(store: &PinStore) -> u64 {
    let mut sum = 0u64;
    for layer in 0..layers() {
        for e in 0..EXPERTS {
            let w = store.weights(layer, e).unwrap();
            sum += w.iter().step_by(4096).map(|&b| b as u64).sum::<u64>();
        }
    }
    sum
}

fn wait_stdin() {
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

fn child(role: &str, name: &str) {
    if model::child(role, name) {
        return;
    }
    match role {
        "server" => {
            let mut store = place(true);
            let export = store.export().unwrap();
            let parcel = Parcel {
                manifest: export.manifest.to_text().into_bytes(),
                files: export.files,
            };
            let _server = Server::bind(name, parcel, Access::same_uid()).unwrap();
            println!("READY");
            wait_stdin();
        }
        "reader" => {
            let t = Instant::now();
            let parcel = serve::fetch(name, &Limits::default()).unwrap();
            let manifest = Manifest::parse(std::str::from_utf8(&parcel.manifest).unwrap()).unwrap();
            let store = PinStore::attach(&manifest, parcel.files).unwrap();
            let secs = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let touched = touch(&store);
            let touch = t.elapsed().as_secs_f64();
            let n = compare(&store);
            println!("READY secs={secs:.4} touch={touch:.4} bytes={n} sum={touched}");
            wait_stdin();
        }
        "own" => {
            let t = Instant::now();
            let store = place(false);
            let secs = t.elapsed().as_secs_f64();
            let n = compare(&store);
            println!("READY secs={secs:.4} bytes={n}");
            wait_stdin();
        }
        _ => panic!("unknown role {role}"),
    }
}

fn spawn(role: &str, name: &str) -> (Child, String) {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .env("NUMAPIN_BENCH_SERVE_ROLE", role)
        .env("NUMAPIN_BENCH_SERVE_NAME", name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("READY") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "{role} ended early");
    }
    (c, line.trim().to_string())
}

fn pss_bytes(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kb * 1024
}

fn field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.parse().ok())
        .unwrap()
}

fn secs(line: &str) -> f64 {
    field(line, "secs=")
}

fn finish(children: Vec<(Child, String)>) {
    for (mut c, _) in children {
        drop(c.stdin.take());
        c.wait().unwrap();
    }
}

fn main() {
    if let Ok(role) = std::env::var("NUMAPIN_BENCH_SERVE_ROLE") {
        return child(&role, &std::env::var("NUMAPIN_BENCH_SERVE_NAME").unwrap());
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let store = std::env::args().any(|a| a == "store");
    let whole = std::env::args().any(|a| a == "model");
    if store || !whole {
        store_bench();
    }
    if whole || !store {
        model::run();
    }
}

/// The store mode: a `PinStore` served, against own copies.
fn store_bench() {
    let t = Instant::now();
    write_file();
    let copy = (layers() * EXPERTS * EXPERT_BYTES) as f64;
    println!(
        "file {} ({:.2} GiB) ready in {:.1} s",
        file_path().display(),
        gib(copy),
        t.elapsed().as_secs_f64()
    );
    let name = format!("bench-{}", std::process::id());
    let t = Instant::now();
    let (mut server, _) = spawn("server", &name);
    let serve_secs = t.elapsed().as_secs_f64();
    let readers: Vec<_> = (0..READERS).map(|_| spawn("reader", &name)).collect();
    let attach: Vec<f64> = readers.iter().map(|(_, l)| secs(l)).collect();
    let touch: Vec<f64> = readers.iter().map(|(_, l)| field(l, "touch=")).collect();
    let ready: Vec<f64> = attach.iter().zip(&touch).map(|(a, t)| a + t).collect();
    let pss_all = pss_bytes(server.id()) as f64
        + readers
            .iter()
            .map(|(c, _)| pss_bytes(c.id()) as f64)
            .sum::<f64>();
    server.kill().unwrap();
    server.wait().unwrap();
    let pss_readers: f64 = readers.iter().map(|(c, _)| pss_bytes(c.id()) as f64).sum();
    finish(readers);
    let own: Vec<_> = (0..READERS)
        .map(|i| spawn("own", &format!("own{i}")))
        .collect();
    let own_secs: Vec<f64> = own.iter().map(|(_, l)| secs(l)).collect();
    let pss_own: f64 = own.iter().map(|(c, _)| pss_bytes(c.id()) as f64).sum();
    finish(own);
    println!(
        "every byte equal to the file in all {} readers and {READERS} own copies",
        READERS
    );
    println!("server: place + export + bind {serve_secs:.3} s (process start included)");
    print_figures(&Figures {
        title: "4 processes",
        attach_row: "served: fetch + attach (+server)",
        attach: &attach,
        ready: &ready,
        own: &own_secs,
        pss: [pss_all, pss_readers, pss_own],
        copy,
    });
}

/// One mode's figures: attach times and summed Pss of the served readers (with the server,
/// then after it was killed) against each process placing its own copy.
struct Figures<'a> {
    title: &'a str,
    attach_row: &'a str,
    attach: &'a [f64],
    ready: &'a [f64],
    own: &'a [f64],
    /// Summed Pss: server and readers, readers after the server's kill, the own copies.
    pss: [f64; 3],
    copy: f64,
}

/// Bytes in GiB.
fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

/// Prints `f` as a table, then the ratios.
fn print_figures(f: &Figures<'_>) {
    let max = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let [pss_all, pss_readers, pss_own] = f.pss;
    println!(
        "{:<36} {:>9} {:>9} {:>10} {:>9}",
        f.title, "mean s", "max s", "sum Pss", "x 1 copy"
    );
    let row = |what: &str, s: &[f64], pss: f64| {
        println!(
            "{what:<36} {:>9.4} {:>9.4} {:>6.3} GiB {:>9.3}",
            mean(s),
            max(s),
            gib(pss),
            pss / f.copy
        );
    };
    row(f.attach_row, f.attach, pss_all);
    row("served: readers after server kill", f.attach, pss_readers);
    row("served: attach + read a byte a page", f.ready, pss_readers);
    row("own copy: place each", f.own, pss_own);
    println!(
        "attach / place (means): {:.4}; attach + a byte a page / place: {:.4}; \
         memory served / own: {:.3}",
        mean(f.attach) / mean(f.own),
        mean(f.ready) / mean(f.own),
        pss_all / pss_own
    );
}
