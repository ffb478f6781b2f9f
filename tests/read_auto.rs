//! `ReadMode::Auto`, the default: a file the page cache holds is read buffered, one it
//! does not hold is read directly, and the report says which and why per file. Counts,
//! not timings: the residency the report quotes is checked against the testkit's own
//! `mincore` count, and the page cache after a direct load against the same count.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use numapin::store::{ExpertSource, LayerSpec, Layout, Piece, PinStore, ReadMode, StoreOptions};
use numapin_testkit::cache::{cached_pages, evict};
use numapin_testkit::scratch::ScratchDir;
use numapin_testkit::synthetic::SyntheticModel;

mod common;

fn dir(name: &str) -> ScratchDir {
    ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("read-auto-{name}"),
    )
}

/// Loads 6 experts of odd sizes and offsets from `file` with default options; checks
/// every byte and returns the report.
fn load(file: &File) -> numapin::store::LayerReport {
    let (w, s) = ((1 << 20) + 333, 4096 + 5);
    let sources: Vec<ExpertSource> = (0..6u64)
        .map(|e| {
            let base = 7 + e * (w + s) as u64;
            ExpertSource::File {
                weights: vec![Piece::new(file, base, w)],
                scales: vec![Piece::new(file, base + w as u64, s)],
            }
        })
        .collect();
    let spec = LayerSpec::fitting(&sources).unwrap();
    let store = PinStore::new(Layout::Unplaced, StoreOptions::default()).unwrap();
    let report = store.pack_layer(0, &spec, &sources).unwrap();
    for e in 0..6u64 {
        let base = 7 + e * (w + s) as u64;
        let mut expected = vec![0u8; w];
        SyntheticModel::expected_bytes(base, &mut expected);
        assert!(
            store.weights(0, e as usize).unwrap() == expected,
            "expert {e}"
        );
        let mut expected = vec![0u8; s];
        SyntheticModel::expected_bytes(base + w as u64, &mut expected);
        assert!(
            store.scales(0, e as usize).unwrap() == expected,
            "expert {e}"
        );
    }
    report
}

#[test]
fn auto_reads_a_cached_file_buffered_and_an_evicted_one_direct() {
    let dir = dir("pick");
    let path = dir.join("model.bin");
    let len = 8 << 20;
    let mut bytes = vec![0u8; len];
    SyntheticModel::expected_bytes(0, &mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    let file = File::open(&path).unwrap();
    assert_eq!(StoreOptions::default().read_mode, ReadMode::Auto);
    // tmpfs and ramfs (the VM's TMPDIR and root) keep their pages: nothing there can be
    // evicted.
    if !numapin_testkit::cache::evictable(&file) {
        println!(
            "NOT RUN: {} is on tmpfs or ramfs, whose pages cannot be evicted",
            path.display()
        );
        return;
    }

    // Cached: read it whole first.
    File::open(&path)
        .unwrap()
        .read_to_end(&mut Vec::new())
        .unwrap();
    let (cached, pages) = cached_pages(&file).unwrap();
    assert_eq!(cached, pages, "read whole: every page cached");
    let report = load(&file);
    assert_eq!(report.files.len(), 1, "{:?}", report.files);
    let read = &report.files[0];
    assert_eq!(read.mode, ReadMode::Buffered, "{read}");
    assert_eq!(report.read_mode, ReadMode::Buffered);
    let r = read.residency.expect("auto measured the file");
    assert_eq!(
        (r.cached_pages, r.pages),
        (pages as u64, pages as u64),
        "{read}"
    );
    assert!(read.path.ends_with("model.bin"), "{read}");
    assert!(read.to_string().contains("buffered (auto: "), "{read}");

    // Evicted: nothing cached, so direct (where the file system can).
    evict(&file).unwrap();
    assert_eq!(cached_pages(&file).unwrap().0, 0, "evicted");
    let report = load(&file);
    let read = &report.files[0];
    let r = read.residency.expect("auto measured the file");
    assert_eq!(r.cached_pages, 0, "{read}");
    if common::dio_align(&file).is_some() {
        assert_eq!(read.mode, ReadMode::Direct, "{read}");
        assert_eq!(read.fallback, None);
        assert_eq!(report.read_mode, ReadMode::Direct);
        // Read around the page cache: it holds none of the file after the load.
        assert_eq!(cached_pages(&file).unwrap().0, 0, "{read}");
    } else {
        println!(
            "NOTE: no direct I/O under {}: checked the fallback",
            dir.display()
        );
        assert_eq!(read.mode, ReadMode::Buffered, "{read}");
        assert!(read.fallback.is_some(), "{read}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn auto_on_tmpfs_reads_buffered_and_says_the_file_is_cached() {
    let Some(dir) = common::shm_dir(
        "auto_on_tmpfs_reads_buffered_and_says_the_file_is_cached",
        "numapin-read-auto",
    ) else {
        return;
    };
    let path = dir.join("model.bin");
    let mut bytes = vec![0u8; 8 << 20];
    SyntheticModel::expected_bytes(0, &mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    let file = File::open(&path).unwrap();
    let report = load(&file);
    std::fs::remove_dir_all(&dir).unwrap();
    let read = &report.files[0];
    // A tmpfs file is its page cache: always cached, never a direct read.
    assert_eq!(read.mode, ReadMode::Buffered, "{read}");
    let r = read.residency.expect("auto measured the file");
    assert_eq!(r.cached_pages, r.pages, "{read}");
}
