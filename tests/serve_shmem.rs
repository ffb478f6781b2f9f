//! A served placement's memory is given back once its last holder exits: `Shmem` in
//! `/proc/meminfo` rises by the placement's size while a server and a reader (two child
//! processes) hold it, stays up while the reader alone holds it (the server SIGKILLed),
//! and falls by the size once the reader exits too.
//!
//! In a test binary of its own, so that no other test of the binary allocates memfds
//! meanwhile. `Shmem` is machine-wide, and other processes change it too: the placement
//! is 256 MiB (against the few MiB other jobs move), every reading is retried (up to 40
//! times, 50 ms apart) until it meets its bound, and the whole sequence is tried up to 3
//! times; the test fails only if no try saw the rise, the hold and the fall. A leak (pages
//! kept after both exit) fails every try. Nothing here is a timing assert.

mod serve_common;

use std::io::{BufRead, BufReader};
use std::time::Duration;

use numapin::serve::{self, Access, Server};
use numapin::store::{ExpertSource, LayerSpec, Layout, Manifest, PinStore, StoreOptions};
use serve_common::{spawn, unique, var, wait_line};

const LAYERS: usize = 16;
const EXPERTS: usize = 8;
const SLOT: usize = 2 << 20;
/// The placement's bytes: 256 MiB.
const SIZE: u64 = (LAYERS * EXPERTS * SLOT) as u64;

/// Expert `e` of `layer`'s bytes, from its coordinates alone.
fn slot(layer: usize, e: usize) -> Vec<u8> {
    let seed = (layer * EXPERTS + e) as u8;
    (0..SLOT)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8 ^ seed)
        .collect()
}

/// `Shmem` of `/proc/meminfo`, in bytes.
fn shmem() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Shmem:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("Shmem in /proc/meminfo");
    kb * 1024
}

/// Reads `Shmem` until `ok` holds of it (at most 40 readings, 50 ms apart): the last
/// reading and whether `ok` held.
fn shmem_until(ok: impl Fn(u64) -> bool) -> (u64, bool) {
    let mut v = shmem();
    for _ in 0..40 {
        if ok(v) {
            return (v, true);
        }
        std::thread::sleep(Duration::from_millis(50));
        v = shmem();
    }
    (v, ok(v))
}

const MIB: u64 = 1 << 20;

/// One try: `Ok` with the figures, or `Err` saying which bound was not met.
fn attempt() -> Result<String, String> {
    let base = shmem();
    let want = SIZE / 10 * 9;
    let name = unique("shmem");
    let mut server = spawn("child_shmem_server", &[("SERVE_NAME", &name)]);
    wait_line(
        &mut BufReader::new(server.stdout.take().unwrap()),
        "SERVING",
    );
    let mut reader = spawn("child_shmem_reader", &[("SERVE_NAME", &name)]);
    let mut out = BufReader::new(reader.stdout.take().unwrap());
    let read = wait_line(&mut out, "HOLDING");
    assert_eq!(read, format!("HOLDING bytes={SIZE}"));
    let rose = |v: u64| v.saturating_sub(base) >= want;
    let (both, ok_both) = shmem_until(rose);
    server.kill().unwrap();
    server.wait().unwrap();
    let (alone, ok_alone) = shmem_until(rose);
    // The reader returns when its stdin closes.
    drop(reader.stdin.take());
    assert!(reader.wait().unwrap().success(), "the reader failed");
    let (after, ok_after) = shmem_until(|v| alone.saturating_sub(v) >= want);
    let figures = format!(
        "Shmem before {} MiB, server and reader holding {} MiB, reader alone {} MiB, both \
         gone {} MiB (placement {} MiB)",
        base / MIB,
        both / MIB,
        alone / MIB,
        after / MIB,
        SIZE / MIB
    );
    if ok_both && ok_alone && ok_after {
        Ok(figures)
    } else {
        Err(figures)
    }
}

#[test]
fn shmem_comes_back_once_the_last_holder_exits() {
    let mut tries = Vec::new();
    for _ in 0..3 {
        match attempt() {
            Ok(figures) => {
                eprintln!("{figures}");
                return;
            }
            Err(figures) => tries.push(figures),
        }
    }
    panic!(
        "no try saw Shmem rise by 0.9x the placement, stay while the reader held it and fall by 0.9x: {tries:#?}"
    );
}

/// Places 256 MiB into memfds and serves them until killed.
#[test]
#[ignore = "a child process of serve_shmem"]
fn child_shmem_server() {
    let store = PinStore::new(Layout::Unplaced, StoreOptions::default().shared(true)).unwrap();
    let spec = LayerSpec {
        experts: EXPERTS,
        weight_bytes: SLOT,
        scale_bytes: 0,
    };
    for layer in 0..LAYERS {
        let data: Vec<Vec<u8>> = (0..EXPERTS).map(|e| slot(layer, e)).collect();
        let sources: Vec<ExpertSource> = data
            .iter()
            .map(|w| ExpertSource::Memory {
                weights: w,
                scales: &[],
            })
            .collect();
        store.pack_layer(layer, &spec, &sources).unwrap();
    }
    let mut store = store;
    let export = store.export().unwrap();
    let parcel = serve::Parcel {
        manifest: export.manifest.to_text().into_bytes(),
        files: export.files,
    };
    let _server = Server::bind(&var("SERVE_NAME"), parcel, Access::same_uid()).unwrap();
    println!("SERVING");
    std::thread::sleep(Duration::from_secs(300));
}

/// Fetches and attaches, reads every byte against [`slot`], then holds the placement
/// until its stdin closes.
#[test]
#[ignore = "a child process of serve_shmem"]
fn child_shmem_reader() {
    let parcel = serve::fetch(&var("SERVE_NAME"), &serve::Limits::default()).unwrap();
    let manifest = Manifest::parse(std::str::from_utf8(&parcel.manifest).unwrap()).unwrap();
    let store = PinStore::attach(&manifest, parcel.files).unwrap();
    let mut bytes = 0;
    for layer in 0..LAYERS {
        for e in 0..EXPERTS {
            let w = store.weights(layer, e).unwrap();
            assert!(w == &slot(layer, e)[..], "layer {layer} expert {e}");
            bytes += w.len();
        }
    }
    println!("HOLDING bytes={bytes}");
    let mut line = String::new();
    while std::io::stdin().lock().read_line(&mut line).unwrap() > 0 {
        line.clear();
    }
    drop(store);
}
