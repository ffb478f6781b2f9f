//! A store loaded and placed once, shared with another process: the child attaches the
//! exported memfds through inherited fds, serves every byte, and holds no private copy.

mod common;

use std::os::fd::{AsRawFd, FromRawFd};

use common::{degrade_here, expect};
use numapin::NodeSet;
use numapin::store::{
    ExpertSource, Export, Kind, LayerSpec, Layout, Manifest, PinStore, StoreOptions,
};

use numapin::policy::Placement;

const LAYERS: usize = 3;
const EXPERTS: usize = 16;
const WEIGHTS: usize = 40 * 1024;
const SCALES: usize = 4096;

fn tensor(layer: usize, expert: usize, kind: Kind, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((layer * 7 + expert * 13 + kind as usize * 29 + i * 3) % 253) as u8)
        .collect()
}

#[test]
fn shares_a_loaded_store_with_a_child_process() {
    let mut store = packed_shared_store();
    let export = store.export().unwrap();
    assert_eq!(export.files.len(), 2 * LAYERS);
    // The exported files are immutable: nobody can truncate (SIGBUS) or write them.
    for file in &export.files {
        assert_eq!(
            file.set_len(0).unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
    }
    let dir = std::env::temp_dir().join(format!("numapin-shared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let line = attach_in_a_child(&export, &dir);
    let field = |key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.parse().ok())
            .unwrap_or_else(|| panic!("{key} missing in {line}"))
    };
    let bytes = (LAYERS * EXPERTS * (WEIGHTS + SCALES)) as u64;
    assert_eq!(field("slots="), (2 * LAYERS * EXPERTS) as u64);
    assert_eq!(field("bytes="), bytes);
    // No private copy: every resident byte of the child's view is shared with us.
    assert_eq!(field("private="), 0, "{line}");
    assert!(field("shared=") >= bytes, "{line}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A shared (memfd) store with every layer packed, one slot released and loaded again.
fn packed_shared_store() -> PinStore {
    let nodes = NodeSet::allowed().unwrap();
    let options = StoreOptions::default().shared(true);
    let mut store = PinStore::new(Layout::Interleave(nodes), options).unwrap();
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
    assert_eq!(
        store.stats().unwrap().placement,
        Some(degrade_here().map_or(Placement::Bound, Placement::Degraded))
    );
    // Release and reload works on a memfd store too (it punches and refills the hole).
    store.release(1, 2).unwrap();
    let (w, s) = (
        tensor(1, 2, Kind::Weights, WEIGHTS),
        tensor(1, 2, Kind::Scales, SCALES),
    );
    store
        .ensure(
            1,
            2,
            &ExpertSource::Memory {
                weights: &w,
                scales: &s,
            },
        )
        .unwrap();
    store
}

/// Runs `attach_child` in a child process given the exported files (inherited) and the
/// manifest (written in `dir`); its `ATTACHED` report line.
fn attach_in_a_child(export: &Export, dir: &std::path::Path) -> String {
    let manifest_path = dir.join("manifest");
    std::fs::write(&manifest_path, export.manifest.to_text()).unwrap();
    let fds: Vec<String> = export
        .files
        .iter()
        .map(|f| {
            rustix::io::fcntl_setfd(f, rustix::io::FdFlags::empty()).unwrap();
            f.as_raw_fd().to_string()
        })
        .collect();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "attach_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("NUMAPIN_ATTACH_FDS", fds.join(","))
        .env("NUMAPIN_ATTACH_MANIFEST", &manifest_path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.find("ATTACHED").map(|at| l[at..].to_owned()))
        .unwrap_or_else(|| panic!("no child report in:\n{stdout}"))
}

/// The child side, run by the test above in a process of its own.
#[test]
#[ignore = "the child process of shares_a_loaded_store_with_a_child_process"]
fn attach_child() {
    let fds = std::env::var("NUMAPIN_ATTACH_FDS")
        .expect("run by shares_a_loaded_store_with_a_child_process");
    let manifest = Manifest::parse(
        &std::fs::read_to_string(std::env::var("NUMAPIN_ATTACH_MANIFEST").unwrap()).unwrap(),
    )
    .unwrap();
    let files = fds
        .split(',')
        .map(|fd| {
            // SAFETY: the parent left these fds open across exec for this process alone.
            unsafe { std::fs::File::from_raw_fd(fd.parse().unwrap()) }
        })
        .collect();
    let mut store = PinStore::attach(&manifest, files).unwrap();
    let mut slots = 0;
    for layer in 0..LAYERS {
        for e in 0..EXPERTS {
            assert_eq!(
                store.weights(layer, e).unwrap(),
                &tensor(layer, e, Kind::Weights, WEIGHTS)[..]
            );
            assert_eq!(
                store.scales(layer, e).unwrap(),
                &tensor(layer, e, Kind::Scales, SCALES)[..]
            );
            slots += 2;
        }
    }
    // Read-only: the exporter owns the memory.
    assert!(store.release(0, 0).is_err());
    assert_eq!(store.weights(0, 0).unwrap().len(), WEIGHTS);
    let stats = store.stats().unwrap();
    let _ = expect();
    println!(
        "ATTACHED slots={slots} bytes={} private={} shared={} rss={}",
        stats.bytes, stats.private_bytes, stats.shared_bytes, stats.resident_bytes
    );
}
