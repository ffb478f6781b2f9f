//! Peers side by side: what a user would pick instead of PinStore, on the same file in the
//! same run, warm (page-cached) and cold (evicted first), each row in a process of its own
//! so that its RSS and the page cache it leaves are its own. Also the ceilings: 2-thread
//! memcpy from memory into pre-faulted and into fresh memory, and a plain sequential
//! `O_DIRECT` read of the file for the cold rows.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use numapin::store::{Kind, LayerSpec, Layout, PinStore, ReadMode, StoreOptions};
use numapin::{Advice, NodeSet, Region, diag, policy};

use numapin::policy::{MbindFlags, MemPolicy};
use numapin_testkit::baseline::SlabPerExpert;
use numapin_testkit::cache::{cached_pages, evict};
use numapin_testkit::synthetic::SyntheticModel;

const HUGE: usize = 2 << 20;
/// Window of the plain `O_DIRECT` read and of the warm-up read.
const WINDOW: usize = 8 << 20;

/// The model of the peers table: the benchmark's (1.03 GiB); 17 rows × 3 runs, each
/// warmed or evicted first, take about a minute here.
pub fn model() -> SyntheticModel {
    SyntheticModel::default()
}

/// The rows: (name, child mode, read warm and cold?).
const ROWS: &[(&str, &str, bool)] = &[
    ("one slab per expert", "slabs", true),
    ("mmap + touch (llama.cpp default)", "mmap", true),
    ("read all, interleave policy", "read-all", true),
    ("layer mmap+mbind+pread, 1 thr", "per-layer", true),
    ("PinStore buffered", "pin-buffered", true),
    ("PinStore direct", "pin-direct", true),
    ("PinStore drop-behind", "pin-drop-behind", true),
    ("plain O_DIRECT read (ceiling)", "o-direct", false),
    ("memcpy 2 thr, pre-faulted", "memcpy-prefaulted", false),
    ("memcpy 2 thr, fresh (ceiling)", "memcpy-fresh", false),
];

fn nodes() -> Result<NodeSet, String> {
    NodeSet::allowed().map_err(|e| e.to_string())
}

fn fresh(len: usize, policy: &MemPolicy) -> Result<Region, String> {
    let r = Region::anonymous_aligned(len, HUGE).map_err(|e| e.to_string())?;
    r.advise(Advice::HugePage).map_err(|e| e.to_string())?;
    // Degraded (a container) still measures the same copy, unplaced.
    let _placement = r
        .bind(policy, MbindFlags::empty())
        .map_err(|e| e.to_string())?;
    Ok(r)
}

/// Copies `from` into `to` with two threads, one half each.
fn copy_2_threads(from: &[u8], to: &mut [u8]) {
    let half = from.len() / 2;
    let (a, b) = to.split_at_mut(half);
    std::thread::scope(|s| {
        s.spawn(|| a.copy_from_slice(&from[..half]));
        b.copy_from_slice(&from[half..]);
    });
}

/// An aligned buffer of `len` bytes inside a `Vec`.
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let buf = vec![0u8; len + 4096];
    let start = buf.as_ptr().align_offset(4096);
    (buf, start)
}

/// What every row's load reads: the model, its file and length, the nodes.
struct Load<'a> {
    model: &'a SyntheticModel,
    path: &'a Path,
    file: File,
    len: usize,
    nodes: NodeSet,
    interleave: MemPolicy,
    spec: LayerSpec,
}

/// Memory a row keeps alive until RSS is read.
type Keep = Vec<Box<dyn std::any::Any>>;

/// One row's load in this process; returns what `REPORT` prints. Memory that must stay
/// alive until RSS is read is kept in `keep`.
fn load(mode: &str, model: &SyntheticModel, path: &Path, keep: &mut Keep) -> Result<u64, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let len = model.total_bytes().map_err(|e| e.to_string())? as usize;
    let nodes = nodes()?;
    let l = Load {
        model,
        path,
        file,
        len,
        nodes,
        interleave: MemPolicy::Interleave(nodes),
        spec: model.spec(),
    };
    match mode {
        "slabs" => load_slabs(&l, keep)?,
        "mmap" => load_mmap_touch(&l, keep)?,
        "read-all" => load_read_all(&l, keep)?,
        "per-layer" => load_per_layer(&l, keep)?,
        "pin-buffered" | "pin-direct" | "pin-drop-behind" | "pin-direct-threads" => {
            load_pin_store(&l, mode, keep)?;
        }
        "o-direct-fresh" => load_o_direct_fresh(&l, keep)?,
        "buffered-read" => read_buffered(&l)?,
        "o-direct" => read_o_direct(&l)?,
        other => return Err(format!("unknown peer row {other}")),
    }
    Ok(l.len as u64)
}

/// One slab per expert, each bound.
fn load_slabs(l: &Load<'_>, keep: &mut Keep) -> Result<(), String> {
    let mut slabs = SlabPerExpert::new();
    for layer in 0..l.model.layers {
        slabs
            .load_layer(
                layer,
                &l.spec,
                &l.model.sources(&l.file, layer),
                Some(&l.interleave),
            )
            .map_err(|e| e.to_string())?;
    }
    keep.push(Box::new(slabs));
    Ok(())
}

/// The file mapped, one byte of each page touched (llama.cpp's default).
fn load_mmap_touch(l: &Load<'_>, keep: &mut Keep) -> Result<(), String> {
    // SAFETY: the benchmark's own file; nothing writes or truncates it meanwhile.
    let region = unsafe { Region::map_file(&l.file, 0, l.len) }.map_err(|e| e.to_string())?;
    let sum = region
        .as_slice()
        .iter()
        .step_by(numapin::page_size())
        .fold(0u64, |a, &b| a.wrapping_add(u64::from(b)));
    std::hint::black_box(sum);
    keep.push(Box::new(region));
    Ok(())
}

/// The whole file read into one buffer under an interleave policy.
fn load_read_all(l: &Load<'_>, keep: &mut Keep) -> Result<(), String> {
    let _guard = policy::scoped(&l.interleave).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; l.len];
    l.file
        .read_exact_at(&mut buf, 0)
        .map_err(|e| e.to_string())?;
    keep.push(Box::new(buf));
    Ok(())
}

/// One region per layer and kind, mapped and bound, then each expert `pread` into its slot.
fn load_per_layer(l: &Load<'_>, keep: &mut Keep) -> Result<(), String> {
    let mut regions = Vec::new();
    for layer in 0..l.model.layers {
        for kind in Kind::ALL {
            let size = l.spec.bytes(kind);
            let r = Region::anonymous(size * l.model.experts).map_err(|e| e.to_string())?;
            let _placement = r
                .bind(&l.interleave, MbindFlags::empty())
                .map_err(|e| e.to_string())?;
            regions.push((layer, kind, size, r));
        }
    }
    for (layer, kind, size, r) in &mut regions {
        let slots = r.as_mut_slice().map_err(|e| e.to_string())?;
        for (e, slot) in slots.chunks_mut(*size).enumerate() {
            l.file
                .read_exact_at(slot, l.model.offset(*layer, e, *kind))
                .map_err(|e| e.to_string())?;
        }
    }
    keep.push(Box::new(regions));
    Ok(())
}

/// PinStore in the read mode the row names (`pin-<mode>`, `-threads` without io_uring);
/// an error where it ran another mode.
fn load_pin_store(l: &Load<'_>, mode: &str, keep: &mut Keep) -> Result<(), String> {
    let threads = mode.ends_with("-threads");
    let read_mode: ReadMode = mode["pin-".len()..]
        .trim_end_matches("-threads")
        .parse()
        .map_err(|e: numapin::Error| e.to_string())?;
    let options = StoreOptions::default()
        .loader_threads(2)
        .read_mode(read_mode)
        .io_uring(!threads);
    let store = PinStore::new(Layout::Interleave(l.nodes), options).map_err(|e| e.to_string())?;
    for layer in 0..l.model.layers {
        let report = store
            .pack_layer(layer, &l.spec, &l.model.sources(&l.file, layer))
            .map_err(|e| e.to_string())?;
        if report.read_mode != read_mode {
            return Err(format!(
                "{mode}: ran {} ({:?})",
                report.read_mode, report.read_fallback
            ));
        }
    }
    keep.push(Box::new(store));
    Ok(())
}

/// `O_DIRECT` into fresh memory as a load writes it (bound, huge pages).
fn load_o_direct_fresh(l: &Load<'_>, keep: &mut Keep) -> Result<(), String> {
    // One thread, 8 MiB reads one after the other: each read faults and zeroes its
    // pages, then waits for the device.
    let direct = open_direct(l.path)?;
    let mut dest = fresh(l.len.next_multiple_of(HUGE), &l.interleave)?;
    let slice = dest.as_mut_slice().map_err(|e| e.to_string())?;
    let mut offset = 0usize;
    while offset < l.len {
        let end = (offset + WINDOW).min(slice.len());
        let n = direct
            .read_at(&mut slice[offset..end], offset as u64)
            .map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        offset += n;
    }
    if offset != l.len {
        return Err(format!("O_DIRECT read {offset} of {} bytes", l.len));
    }
    keep.push(Box::new(dest));
    Ok(())
}

/// `cat file > /dev/null`: buffered 128 KiB reads into one buffer.
fn read_buffered(l: &Load<'_>) -> Result<(), String> {
    let mut buf = vec![0u8; 128 << 10];
    let mut offset = 0u64;
    loop {
        let n = l
            .file
            .read_at(&mut buf, offset)
            .map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        offset += n as u64;
    }
    Ok(())
}

/// The plain sequential `O_DIRECT` read of the file through one aligned window.
fn read_o_direct(l: &Load<'_>) -> Result<(), String> {
    let direct = open_direct(l.path)?;
    let (mut buf, start) = aligned(WINDOW);
    let window = &mut buf[start..start + WINDOW];
    let mut offset = 0u64;
    loop {
        let n = direct.read_at(window, offset).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        offset += n as u64;
    }
    if offset != l.len as u64 {
        return Err(format!("O_DIRECT read {offset} of {} bytes", l.len));
    }
    Ok(())
}

/// `path` opened for reading with `O_DIRECT`.
fn open_direct(path: &Path) -> Result<File, String> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| e.to_string())
}

/// The ceilings: the source is read into memory first (not timed, not counted in RSS).
fn ceiling(mode: &str, path: &Path) -> Result<String, String> {
    let source = std::fs::read(path).map_err(|e| e.to_string())?;
    let interleave = MemPolicy::Interleave(nodes()?);
    let rss = diag::rss_bytes().map_err(|e| e.to_string())?;
    let mut dest = fresh(source.len(), &interleave)?;
    if mode == "memcpy-prefaulted" {
        dest.populate_write().map_err(|e| e.to_string())?;
    }
    let start = Instant::now();
    copy_2_threads(&source, dest.as_mut_slice().map_err(|e| e.to_string())?);
    let seconds = start.elapsed().as_secs_f64();
    let grown = diag::rss_bytes()
        .map_err(|e| e.to_string())?
        .saturating_sub(rss);
    Ok(format!(
        "seconds={seconds} bytes={} rss={grown}",
        source.len()
    ))
}

/// Runs this process's peer row if it is a peer child; returns whether it was.
pub fn run_child() -> bool {
    let Ok(mode) = std::env::var("NUMAPIN_BENCH_PEER") else {
        return false;
    };
    let model = &model();
    let path = std::env::var("NUMAPIN_BENCH_MODEL").expect("model path");
    let path = Path::new(&path);
    let result = if mode.starts_with("memcpy") {
        ceiling(&mode, path)
    } else {
        let rss = diag::rss_bytes().unwrap_or(0);
        let mut keep = Vec::new();
        let start = Instant::now();
        load(&mode, model, path, &mut keep).map(|bytes| {
            let seconds = start.elapsed().as_secs_f64();
            let grown = diag::rss_bytes().unwrap_or(0).saturating_sub(rss);
            format!("seconds={seconds} bytes={bytes} rss={grown}")
        })
    };
    match result {
        Ok(report) => println!("REPORT {report}"),
        Err(e) => {
            eprintln!("{mode}: {e}");
            std::process::exit(1);
        }
    }
    true
}

fn field(report: &str, key: &str) -> f64 {
    report
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Reads the whole file through the page cache, so that it is cached.
fn warm(file: &File) {
    let mut buf = vec![0u8; WINDOW];
    let mut offset = 0u64;
    while let Ok(n) = file.read_at(&mut buf, offset) {
        if n == 0 {
            break;
        }
        offset += n as u64;
    }
}

/// One cold run of `mode` in a child process (the file evicted first): GB/s, the share of
/// the file cached after it, and the most of it seen cached while the child ran (polled
/// with `mincore` every [`POLL`]: a peak between two polls goes unseen).
pub fn cold_once(mode: &str, path: &Path) -> Result<(f64, f64, f64), String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    evict(&file).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(&exe)
        .env("NUMAPIN_BENCH_PEER", mode)
        .env("NUMAPIN_BENCH_MODEL", path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut peak = 0usize;
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        let (resident, _) = cached_pages(&file).map_err(|e| e.to_string())?;
        peak = peak.max(resident);
        std::thread::sleep(POLL);
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let report = text
        .lines()
        .find_map(|l| l.strip_prefix("REPORT "))
        .ok_or_else(|| format!("no report: {text}"))?;
    let (resident, total) = cached_pages(&file).map_err(|e| e.to_string())?;
    let share = |pages: usize| pages as f64 / total.max(1) as f64;
    Ok((
        field(report, "bytes=") / field(report, "seconds=") / 1e9,
        share(resident),
        share(peak.max(resident)),
    ))
}

/// How often [`cold_once`] looks at the page cache while a child loads.
const POLL: std::time::Duration = std::time::Duration::from_millis(25);

/// One row's figures: medians over `runs` child processes.
struct Row {
    gbps: f64,
    rss_per_byte: f64,
    cached: Option<f64>,
}

fn measure(mode: &str, cold: Option<bool>, path: &Path, runs: usize) -> Result<Row, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut reports = Vec::new();
    for _ in 0..runs {
        match cold {
            Some(true) => evict(&file).map_err(|e| e.to_string())?,
            Some(false) | None => warm(&file),
        }
        let out = Command::new(&exe)
            .env("NUMAPIN_BENCH_PEER", mode)
            .env("NUMAPIN_BENCH_MODEL", path)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let report = text
            .lines()
            .find_map(|l| l.strip_prefix("REPORT "))
            .ok_or_else(|| format!("no report: {text}"))?
            .to_string();
        let (resident, total) = cached_pages(&file).map_err(|e| e.to_string())?;
        reports.push((report, resident as f64 / total.max(1) as f64));
    }
    let m = |key: &str| median(reports.iter().map(|(r, _)| field(r, key)).collect());
    let bytes = m("bytes=");
    Ok(Row {
        gbps: bytes / m("seconds=") / 1e9,
        rss_per_byte: m("rss=") / bytes,
        cached: cold.map(|_| median(reports.iter().map(|(_, c)| *c).collect())),
    })
}

/// Prints the peers table for the benchmark's model file at `path`.
pub fn rows(path: &Path, runs: usize) {
    let model = &model();
    println!();
    println!(
        "peers on one file ({} layers x {} experts x ({} + {} bytes) = {} MiB), warm \
         (page-cached) and cold (evicted first); each row a process of its own, median of {runs}",
        model.layers,
        model.experts,
        model.weight_bytes,
        model.scale_bytes,
        model.total_bytes().unwrap_or(0) >> 20
    );
    println!(
        "{:<33} {:>5} {:>7} {:>8} {:>10} {:>9}",
        "case", "file", "GB/s", "x fresh", "RSS/bytes", "cached %"
    );
    let mut results: Vec<(&str, &str, Result<Row, String>)> = Vec::new();
    for &(name, mode, both) in ROWS {
        let temperatures: &[Option<bool>] = match (both, mode) {
            (true, _) => &[Some(false), Some(true)],
            (false, "o-direct") => &[Some(true)],
            _ => &[None],
        };
        for &cold in temperatures {
            let label = match cold {
                Some(true) => "cold",
                Some(false) => "warm",
                None => "-",
            };
            results.push((name, label, measure(mode, cold, path, runs)));
        }
    }
    let fresh = results
        .iter()
        .find(|(n, _, _)| n.contains("fresh"))
        .and_then(|(_, _, r)| r.as_ref().ok().map(|r| r.gbps))
        .unwrap_or(f64::NAN);
    for (name, label, row) in &results {
        match row {
            Ok(r) => println!(
                "{name:<33} {label:>5} {:>7.2} {:>8.2} {:>10.2} {:>9}",
                r.gbps,
                r.gbps / fresh,
                r.rss_per_byte,
                r.cached
                    .map_or_else(|| "-".to_string(), |c| format!("{:.1}", c * 100.0))
            ),
            Err(e) => println!("{name:<33} {label:>5} failed: {}", e.trim()),
        }
    }
    let gbps = |name: &str, label: &str| {
        results
            .iter()
            .find(|(n, l, _)| *n == name && *l == label)
            .and_then(|(_, _, r)| r.as_ref().ok().map(|r| r.gbps))
            .unwrap_or(f64::NAN)
    };
    println!(
        "cold PinStore direct / plain O_DIRECT read: {:.2}",
        gbps("PinStore direct", "cold") / gbps("plain O_DIRECT read (ceiling)", "cold")
    );
}
