//! What the serve tests share: a memfd store with known bytes, its parcel, the reader's
//! check against bytes recomputed independently, and running this binary as a child.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};

use numapin::serve::Parcel;
use numapin::store::{ExpertSource, Kind, LayerSpec, Layout, Manifest, PinStore, StoreOptions};

pub const LAYERS: usize = 4;
pub const EXPERTS: usize = 16;
pub const WEIGHTS: usize = 64 * 1024;
pub const SCALES: usize = 4096;

/// The bytes of a tensor, from its coordinates alone (the reference every reader
/// recomputes).
pub fn tensor(layer: usize, expert: usize, kind: Kind, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((layer * 7 + expert * 13 + kind as usize * 29 + i * 3 + i / 251) % 253) as u8)
        .collect()
}

/// A packed memfd store (about 4.3 MB).
pub fn store() -> PinStore {
    let options = StoreOptions::default().shared(true);
    let store = PinStore::new(Layout::Unplaced, options).unwrap();
    let spec = LayerSpec {
        experts: EXPERTS,
        weight_bytes: WEIGHTS,
        scale_bytes: SCALES,
    };
    for layer in 0..LAYERS {
        let data: Vec<(Vec<u8>, Vec<u8>)> = (0..EXPERTS)
            .map(|e| {
                (
                    tensor(layer, e, Kind::Weights, WEIGHTS),
                    tensor(layer, e, Kind::Scales, SCALES),
                )
            })
            .collect();
        let sources: Vec<ExpertSource> = data
            .iter()
            .map(|(w, s)| ExpertSource::Memory {
                weights: w,
                scales: s,
            })
            .collect();
        store.pack_layer(layer, &spec, &sources).unwrap();
    }
    store
}

/// The store exported as a parcel.
pub fn parcel(store: &mut PinStore) -> Parcel {
    let export = store.export().unwrap();
    Parcel {
        manifest: export.manifest.to_text().into_bytes(),
        files: export.files,
    }
}

/// Attaches a parcel.
pub fn attach(parcel: Parcel) -> PinStore {
    let text = std::str::from_utf8(&parcel.manifest).unwrap();
    let manifest = Manifest::parse(text).unwrap();
    PinStore::attach(&manifest, parcel.files).unwrap()
}

/// Every byte of an attached store against the reference; the bytes checked.
pub fn check(store: &PinStore) -> usize {
    let mut bytes = 0;
    for layer in 0..LAYERS {
        for e in 0..EXPERTS {
            let w = store.weights(layer, e).unwrap();
            assert!(
                w == &tensor(layer, e, Kind::Weights, WEIGHTS)[..],
                "layer {layer} expert {e}"
            );
            let s = store.scales(layer, e).unwrap();
            assert!(
                s == &tensor(layer, e, Kind::Scales, SCALES)[..],
                "layer {layer} expert {e}"
            );
            bytes += w.len() + s.len();
        }
    }
    bytes
}

pub const TOTAL: usize = LAYERS * EXPERTS * (WEIGHTS + SCALES);

/// A name no other test (or run) uses.
pub fn unique(tag: &str) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "t{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// This test binary run as a child: only the ignored test `child`, with `env`; stdin
/// and stdout piped.
pub fn spawn(child: &str, env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--ignored",
        "--exact",
        child,
        "--nocapture",
        "--test-threads=1",
    ])
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// Reads the child's stdout up to the line that starts with `tag` (panics at its end).
pub fn wait_line(out: &mut BufReader<ChildStdout>, tag: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).unwrap();
        assert!(n > 0, "the child ended before printing {tag}");
        if let Some(at) = line.find(tag) {
            return line[at..].trim_end().to_string();
        }
    }
}

/// Open fds of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The env var a child mode was given.
pub fn var(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key}: run by the parent test"))
}

/// The server's stats once it has handled `peers` connections (it counts one after its
/// last write, which the peer may have read already), waiting at most 20 s.
pub fn settle(server: &numapin::serve::Server, peers: u64) -> numapin::serve::ServeStats {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let s = server.stats();
        if s.served + s.failed + s.refused >= peers || std::time::Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
