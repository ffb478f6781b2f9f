//! The memory story around a load, measured in child processes (one allocator and one
//! configuration per process): RSS after a heap-staged load with glibc malloc, jemalloc
//! retain:true, jemalloc retain:false + purge; and a second process attaching a shared
//! store vs loading its own copy.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use numapin::NodeSet;
use numapin::diag;
use numapin::store::{ExpertSource, Kind, Layout, Manifest, PinStore, StoreOptions};
use numapin_testkit::synthetic::SyntheticModel;

/// Picks glibc malloc or jemalloc once per process, from `NUMAPIN_BENCH_ALLOC`, read with
/// getenv before the first allocation completes (so every block is freed by the
/// allocator that made it).
#[cfg(feature = "jemalloc")]
pub mod switch {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicU8, Ordering};

    use numapin::jemalloc::Jemalloc;

    static CHOICE: AtomicU8 = AtomicU8::new(0);

    fn jemalloc() -> bool {
        match CHOICE.load(Ordering::Relaxed) {
            0 => {
                // SAFETY: getenv with a NUL-terminated name; no allocation happens.
                let value = unsafe { libc::getenv(c"NUMAPIN_BENCH_ALLOC".as_ptr()) };
                // SAFETY: a non-null getenv result is a NUL-terminated string.
                let yes =
                    !value.is_null() && unsafe { std::ffi::CStr::from_ptr(value) } == c"jemalloc";
                CHOICE.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
                yes
            }
            c => c == 2,
        }
    }

    pub struct Switch;

    // SAFETY: every call forwards to one allocator, the same for the whole process.
    unsafe impl GlobalAlloc for Switch {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded contract.
            unsafe {
                if jemalloc() {
                    Jemalloc.alloc(layout)
                } else {
                    System.alloc(layout)
                }
            }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: forwarded contract; the block came from the same allocator.
            unsafe {
                if jemalloc() {
                    Jemalloc.dealloc(ptr, layout)
                } else {
                    System.dealloc(ptr, layout)
                }
            }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded contract.
            unsafe {
                if jemalloc() {
                    Jemalloc.alloc_zeroed(layout)
                } else {
                    System.alloc_zeroed(layout)
                }
            }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: forwarded contract; the block came from the same allocator.
            unsafe {
                if jemalloc() {
                    Jemalloc.realloc(ptr, layout, new_size)
                } else {
                    System.realloc(ptr, layout, new_size)
                }
            }
        }
    }
}

fn field(report: &str, key: &str) -> f64 {
    report
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn child(envs: &[(&str, String)]) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "child failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    text.lines()
        .find(|l| l.starts_with("REPORT"))
        .map(str::to_string)
        .ok_or_else(|| format!("no report from child: {text}"))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Runs the child modes if this process is one; returns whether it was.
pub fn run_child(model: &SyntheticModel) -> bool {
    let Ok(mode) = std::env::var("NUMAPIN_BENCH_CHILD") else {
        return false;
    };
    let path = std::env::var("NUMAPIN_BENCH_MODEL").expect("model path");
    let file = File::open(&path).expect("model file");
    let result = match mode.as_str() {
        "direct" | "staged" => load_child(model, &file, mode == "staged"),
        "attach" => attach_child(model),
        other => Err(format!("unknown child mode {other}")),
    };
    match result {
        Ok(report) => println!("REPORT {report}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
    true
}

/// Loads the model into its own store: from file pieces (`direct`), or the way many
/// engines do, reading each tensor into a heap buffer first (`staged`).
fn load_child(model: &SyntheticModel, file: &File, staged: bool) -> Result<String, String> {
    let nodes = NodeSet::allowed().map_err(|e| e.to_string())?;
    let store = PinStore::new(Layout::Interleave(nodes), StoreOptions::default())
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    for layer in 0..model.layers {
        if staged {
            let mut buffers = Vec::with_capacity(model.experts);
            for e in 0..model.experts {
                let mut w = vec![0u8; model.weight_bytes];
                let mut s = vec![0u8; model.scale_bytes];
                file.read_exact_at(&mut w, model.offset(layer, e, Kind::Weights))
                    .map_err(|e| e.to_string())?;
                file.read_exact_at(&mut s, model.offset(layer, e, Kind::Scales))
                    .map_err(|e| e.to_string())?;
                buffers.push((w, s));
            }
            let sources: Vec<ExpertSource> = buffers
                .iter()
                .map(|(w, s)| ExpertSource::Memory {
                    weights: w,
                    scales: s,
                })
                .collect();
            store
                .pack_layer(layer, &model.spec(), &sources)
                .map_err(|e| e.to_string())?;
        } else {
            store
                .pack_layer(layer, &model.spec(), &model.sources(file, layer))
                .map_err(|e| e.to_string())?;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let rss_loaded = diag::rss_bytes().map_err(|e| e.to_string())?;
    #[cfg(feature = "jemalloc")]
    if std::env::var("NUMAPIN_BENCH_PURGE").is_ok() {
        numapin::jemalloc::purge_all().map_err(|e| e.to_string())?;
    }
    let rss = diag::rss_bytes().map_err(|e| e.to_string())?;
    let stats = store.stats().map_err(|e| e.to_string())?;
    Ok(format!(
        "seconds={seconds} rss_loaded={rss_loaded} rss={rss} store={} private={}",
        stats.resident_bytes, stats.private_bytes
    ))
}

/// Attaches the exported store whose fds this process inherited and reads every byte.
fn attach_child(model: &SyntheticModel) -> Result<String, String> {
    let start = Instant::now();
    let fds = std::env::var("NUMAPIN_BENCH_FDS").map_err(|e| e.to_string())?;
    let manifest_path = std::env::var("NUMAPIN_BENCH_MANIFEST").map_err(|e| e.to_string())?;
    let manifest =
        Manifest::parse(&std::fs::read_to_string(manifest_path).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    let files = fds
        .split(',')
        .map(|fd| {
            // SAFETY: inherited from the parent for this process alone.
            unsafe { File::from_raw_fd(fd.parse().expect("fd")) }
        })
        .collect();
    let store = PinStore::attach(&manifest, files).map_err(|e| e.to_string())?;
    let mut sum = 0u64;
    for layer in 0..model.layers {
        for e in 0..model.experts {
            for bytes in [store.weights(layer, e), store.scales(layer, e)] {
                let bytes = bytes.map_err(|e| e.to_string())?;
                sum = bytes
                    .iter()
                    .step_by(4096)
                    .fold(sum, |a, &b| a.wrapping_add(u64::from(b)));
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let stats = store.stats().map_err(|e| e.to_string())?;
    Ok(format!(
        "seconds={seconds} rss={} store={} private={} shared={} sum={sum}",
        diag::rss_bytes().map_err(|e| e.to_string())?,
        stats.resident_bytes,
        stats.private_bytes,
        stats.shared_bytes
    ))
}

/// Prints the allocator table.
pub fn allocator_rows(path: &Path, runs: usize) {
    println!();
    println!("heap-staged load: RSS after the load, by allocator (each in its own process)");
    let model_env = ("NUMAPIN_BENCH_MODEL", path.display().to_string());
    let mut cases: Vec<(&str, Vec<(&str, String)>)> = vec![
        (
            "direct preads (no staging)",
            vec![("NUMAPIN_BENCH_CHILD", "direct".into())],
        ),
        (
            "glibc malloc",
            vec![("NUMAPIN_BENCH_CHILD", "staged".into())],
        ),
    ];
    if cfg!(feature = "jemalloc") {
        let je = |conf: &str, purge: bool| {
            let mut env = vec![
                ("NUMAPIN_BENCH_CHILD", "staged".to_string()),
                ("NUMAPIN_BENCH_ALLOC", "jemalloc".to_string()),
                ("_RJEM_MALLOC_CONF", conf.to_string()),
            ];
            if purge {
                env.push(("NUMAPIN_BENCH_PURGE", "1".to_string()));
            }
            env
        };
        cases.push(("jemalloc retain:true", je("retain:true", false)));
        cases.push(("jemalloc retain:false + purge", je("retain:false", true)));
    } else {
        println!("(jemalloc rows need `--features jemalloc`)");
    }
    println!(
        "{:<32} {:>9} {:>12} {:>14} {:>12} {:>13}",
        "case", "seconds", "x direct", "RSS MiB", "store MiB", "heap MiB"
    );
    let mut direct = f64::NAN;
    for (name, mut env) in cases {
        env.push(model_env.clone());
        let reports: Vec<String> = (0..runs)
            .filter_map(|_| child(&env).map_err(|e| eprintln!("{name}: {e}")).ok())
            .collect();
        if reports.is_empty() {
            println!("{name:<32} failed");
            continue;
        }
        let m = |key: &str| median(reports.iter().map(|r| field(r, key)).collect());
        let (seconds, rss, store) = (m("seconds="), m("rss="), m("store="));
        if direct.is_nan() {
            direct = seconds;
        }
        println!(
            "{name:<32} {seconds:>9.3} {:>12.2} {:>14.0} {:>12.0} {:>13.0}",
            seconds / direct,
            rss / 1048576.0,
            store / 1048576.0,
            (rss - store) / 1048576.0
        );
    }
}

/// Prints the sharing table: a second process attaching the exported store vs loading
/// its own copy.
pub fn sharing_rows(model: &SyntheticModel, path: &Path, runs: usize) {
    println!();
    println!("a second process: attach the exported store vs load its own copy");
    let file = File::open(path).expect("model");
    let nodes = NodeSet::allowed().expect("nodes");
    let options = StoreOptions::default().shared(true);
    let mut store = PinStore::new(Layout::Interleave(nodes), options).expect("store");
    for layer in 0..model.layers {
        store
            .pack_layer(layer, &model.spec(), &model.sources(&file, layer))
            .expect("pack");
    }
    let export = store.export().expect("export");
    let dir = path.parent().expect("dir");
    let manifest = dir.join("manifest");
    std::fs::write(&manifest, export.manifest.to_text()).expect("manifest");
    let fds: Vec<String> = export
        .files
        .iter()
        .map(|f| {
            rustix::io::fcntl_setfd(f, rustix::io::FdFlags::empty()).expect("fcntl");
            f.as_raw_fd().to_string()
        })
        .collect();
    let attach = vec![
        ("NUMAPIN_BENCH_CHILD", "attach".to_string()),
        ("NUMAPIN_BENCH_FDS", fds.join(",")),
        ("NUMAPIN_BENCH_MANIFEST", manifest.display().to_string()),
        ("NUMAPIN_BENCH_MODEL", path.display().to_string()),
    ];
    let own = vec![
        ("NUMAPIN_BENCH_CHILD", "direct".to_string()),
        ("NUMAPIN_BENCH_MODEL", path.display().to_string()),
    ];
    println!(
        "{:<28} {:>9} {:>10} {:>14} {:>13}",
        "second process", "seconds", "RSS MiB", "private MiB", "shared MiB"
    );
    for (name, env) in [
        ("attach the shared store", attach),
        ("load its own copy", own),
    ] {
        let reports: Vec<String> = (0..runs)
            .filter_map(|_| child(&env).map_err(|e| eprintln!("{name}: {e}")).ok())
            .collect();
        if reports.is_empty() {
            println!("{name:<28} failed");
            continue;
        }
        let m = |key: &str| median(reports.iter().map(|r| field(r, key)).collect());
        let shared = m("shared=");
        println!(
            "{name:<28} {:>9.3} {:>10.0} {:>14.0} {:>13}",
            m("seconds="),
            m("rss=") / 1048576.0,
            m("private=") / 1048576.0,
            if shared.is_nan() {
                "-".to_string()
            } else {
                format!("{:.0}", shared / 1048576.0)
            }
        );
    }
}
