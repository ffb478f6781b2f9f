//! Hostile inputs for round 6's surface: drop-behind advising only up to the end of what
//! a fill read (layers loaded in another order than the file's), and the text forms'
//! decimal numbers. Every load is compared with the file's own bytes (read back with std).

use std::fs::File;
use std::io::Write;
use std::path::Path;

use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, ReadMode, StoreOptions};
use numapin_testkit::cache::{cached_pages, evict};
use numapin_testkit::scratch::ScratchDir;

fn dir(name: &str) -> ScratchDir {
    ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("hostile6-{name}"),
    )
}

/// `len` bytes no two 4 KiB pages of which are alike (xorshift64*), written and synced.
fn write_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let bytes: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect();
    let mut f = File::create(path).unwrap();
    f.write_all(&bytes).unwrap();
    f.sync_all().unwrap();
    bytes
}

/// Whether evicting a file of `dir` from the page cache works here: false on ramfs and
/// tmpfs, whose page cache is the file itself (the VM's initramfs).
fn evicts_here(dir: &Path) -> bool {
    let probe = dir.join("evict-probe.bin");
    std::fs::write(&probe, vec![1u8; 64 << 10]).unwrap();
    let file = File::open(&probe).unwrap();
    let evicted =
        evict(&file).is_ok() && cached_pages(&file).is_ok_and(|(resident, _)| resident == 0);
    let _ = std::fs::remove_file(&probe);
    evicted
}

/// `dir(name)` where evicting a file from the page cache works; `None` (after saying
/// NOT RUN for `test`) where it cannot.
fn evictable_dir(name: &str, test: &str) -> Option<ScratchDir> {
    let d = dir(name);
    if !evicts_here(&d) {
        println!(
            "NOT RUN: {test} needs a file system whose page cache can be evicted; {} keeps its files in memory (the VM's initramfs)",
            d.display()
        );
        let _ = std::fs::remove_dir_all(&d);
        return None;
    }
    Some(d)
}

/// The kernel's readahead window of the device holding `file`, in bytes
/// (`/sys/dev/block/MAJ:MIN/queue/read_ahead_kb`, or the bdi's); `None` if unknown.
fn read_ahead_bytes(file: &File) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let dev = file.metadata().ok()?.dev();
    let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    [
        format!("/sys/dev/block/{major}:{minor}/queue/read_ahead_kb"),
        format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
    .map(|kb| kb << 10)
}

/// Layers of one file loaded last layer first, each by its own fill, with drop-behind
/// and the kernel's readahead left on: each fill's sequential reads make the kernel read
/// ahead past the end of its layer, into the layer loaded just before, which no later
/// fill reads or advises again. `ReadMode::DropBehind` promises at most 2% of what was
/// read plus the kernel's readahead past the last byte read after the load: one window
/// (twice `read_ahead_kb` with asynchronous readahead), not one per layer.
#[test]
fn drop_behind_over_layers_loaded_backwards_leaves_one_readahead_window() {
    const TEST: &str = "drop_behind_over_layers_loaded_backwards_leaves_one_readahead_window";
    let Some(d) = evictable_dir("backwards-layers", TEST) else {
        return;
    };
    let path = d.join("model.bin");
    let (experts, expert) = (8usize, 512usize << 10);
    let layers = 16usize;
    let layer_bytes = experts * expert;
    let bytes = write_file(&path, layers * layer_bytes, 61);
    let file = File::open(&path).unwrap();
    evict(&file).unwrap();
    assert_eq!(cached_pages(&file).unwrap().0, 0, "evicted");
    let store = PinStore::new(
        Layout::Unplaced,
        StoreOptions::default()
            .huge_pages(false)
            .loader_threads(1)
            .read_mode(ReadMode::DropBehind),
    )
    .unwrap();
    let io_before = common::storage_read_bytes();
    for layer in (0..layers).rev() {
        let pieces: Vec<Vec<(u64, usize)>> = (0..experts)
            .map(|e| vec![((layer * layer_bytes + e * expert) as u64, expert)])
            .collect();
        let sources: Vec<ExpertSource<'_>> = pieces
            .iter()
            .map(|w| ExpertSource::from_file(&file, w, &[]))
            .collect();
        let spec = LayerSpec::fitting(&sources).unwrap();
        store.pack_layer(layer, &spec, &sources).unwrap();
        for e in 0..experts {
            let at = layer * layer_bytes + e * expert;
            let slot = store.weights(layer, e).unwrap();
            assert!(
                slot[..expert] == bytes[at..at + expert],
                "layer {layer} expert {e} differs from the file"
            );
        }
    }
    let (cached, total) = cached_pages(&file).unwrap();
    // Printed, not asserted: the kernel's readahead into the layer loaded before is read
    // from the device again (the advice drops it after), and other tests' reads count.
    if let (Some(a), Some(b)) = (io_before, common::storage_read_bytes()) {
        println!(
            "{} bytes read from the device for {} bytes of layers",
            b - a,
            bytes.len()
        );
    }
    let page = numapin::page_size() as u64;
    let window = read_ahead_bytes(&file).unwrap_or(128 << 10);
    let bound = (total as u64 / 50) + 2 * window.div_ceil(page) + (2 << 20) / page;
    println!(
        "{layers} layers of {layer_bytes} bytes backwards: {cached} of {total} pages cached after, bound {bound} (read_ahead {window} bytes)"
    );
    assert!(
        cached as u64 <= bound,
        "{cached} of {total} pages cached after a backwards drop-behind load, more than {bound} \
         (2% + one readahead window of {window} bytes twice + a folio)"
    );
    drop(file);
    std::fs::remove_dir_all(&d).unwrap();
}

/// The text forms' numbers are ASCII decimal digits only: a sign, a Unicode digit (Arabic-
/// Indic, full-width, superscript), an empty number, whitespace inside a slice's number
/// or a number past the type are named parse errors, never another number and never a
/// panic; leading zeros are still the number.
#[cfg(feature = "model")]
#[test]
fn text_numbers_are_ascii_decimal_digits_only() {
    use numapin::model::{DenseLayout, ExpertShare, PlacementPlan, SliceAxis, TensorSlice};
    for bad in [
        "+1",
        "١",
        "٣-٥",
        "０",
        "1,²",
        "",
        ",",
        "1-",
        "-1",
        "99999999999999999999",
        "1/+2",
        "1/",
        "4 2",
        "0x10",
        "1_000",
    ] {
        match ExpertShare::parse(bad) {
            Err(numapin::Error::Parse { .. }) => {}
            Err(e) if bad.is_empty() || bad == "," => {
                // An empty list may be refused by the constructor; a named error still.
                assert!(!e.to_string().is_empty(), "{bad:?}");
            }
            other => panic!("ExpertShare::parse({bad:?}): {other:?}"),
        }
    }
    // Leading zeros and whitespace around a piece are the number.
    let ids = |text: &str| ExpertShare::parse(text).unwrap().resolve(0, 16).unwrap();
    assert_eq!(ids("007, 010-011"), vec![7, 10, 11]);
    assert_eq!(ids(" 1/4 "), vec![4, 5, 6, 7]);
    for bad in [
        "rows:+1/2",
        "rows:1/２",
        "rows:١/2",
        "rows: 1/2",
        "rows:0:",
        "rows::4",
        "columns:0:99999999999999999999",
        "cols:1/2 ",
    ] {
        match TensorSlice::parse(bad) {
            Err(numapin::Error::Parse { .. }) => {}
            other if bad == "cols:1/2 " => {
                // The whole text is trimmed: the trailing space is not in a number.
                assert_eq!(
                    other.unwrap(),
                    TensorSlice::part(SliceAxis::Columns, 1, 2).unwrap()
                );
            }
            other => panic!("TensorSlice::parse({bad:?}): {other:?}"),
        }
    }
    assert_eq!(
        TensorSlice::parse("rows:007:010").unwrap(),
        TensorSlice::span(SliceAxis::Rows, 7, 10).unwrap()
    );
    let plan = || PlacementPlan::new(numapin::store::Layout::Unplaced, DenseLayout::Unplaced);
    for bad in [
        "dense=bind:+0",
        "dense=bind:٠",
        "dense=bind:",
        "dense=bind: 0",
        "dense=bind:65536",
        "dense=bind:99999999999999999999",
    ] {
        assert!(plan().apply(bad).is_err(), "{bad:?} was accepted");
    }
    assert_eq!(
        plan().apply("dense=bind:00").unwrap(),
        plan().apply("dense=bind:0").unwrap()
    );
}

#[cfg(feature = "model")]
#[path = "common/mod.rs"]
mod common;

/// `PlacedModel::expert_ids` under a per-layer expert share that holds other ids in each
/// layer (odd ids in even layers, even ids in odd ones, at least one), on every fixture:
/// the ids are the ones worked out here from `fixture.json`'s expert counts (the fixture
/// script's), increasing; each is an expert the model reads back, the others are not
/// held; layers that are not MoE layers, and absurd ones, are errors, never a panic.
#[cfg(feature = "model")]
#[test]
fn expert_ids_are_each_layers_share_on_every_fixture() {
    use numapin::model::{DenseLayout, ExpertShare, PlacementPlan, Share};
    let Some(dir) = common::fixtures("expert_ids_are_each_layers_share_on_every_fixture") else {
        return;
    };
    let held = |layer: usize, experts: usize| -> Vec<usize> {
        let ids: Vec<usize> = (0..experts).filter(|e| (e + layer) % 2 == 1).collect();
        if ids.is_empty() { vec![0] } else { ids }
    };
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("fixture.json").is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(!names.is_empty(), "no fixtures in {}", dir.display());
    for name in names {
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(&name).join("fixture.json")).unwrap())
                .unwrap();
        let layers: Vec<(usize, usize)> = meta["layers"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), v.as_u64().unwrap() as usize))
            .collect();
        let checkpoint = common::open_fixture(&dir, &name);
        let share =
            ExpertShare::per_layer(move |layer, experts| ExpertShare::list(held(layer, experts)));
        let plan = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
            .share(Share::default().experts(share));
        let model = checkpoint
            .place(&plan, StoreOptions::default().loader_threads(2))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for &(layer, experts) in &layers {
            let want = held(layer, experts);
            assert_eq!(
                model.expert_ids(layer).unwrap(),
                want,
                "{name} layer {layer}"
            );
            for e in 0..experts {
                let got = model.expert(layer, e);
                assert_eq!(
                    got.is_ok(),
                    want.contains(&e),
                    "{name} layer {layer} expert {e}"
                );
            }
        }
        let moe: Vec<usize> = layers.iter().map(|&(l, _)| l).collect();
        for layer in [0, 1, 2, 3, 1000, usize::MAX] {
            if !moe.contains(&layer) {
                assert!(model.expert_ids(layer).is_err(), "{name}: layer {layer}");
            }
        }
    }
}

/// A drop-behind layer whose piece lies at the top of the `u64` offsets (past what
/// `posix_fadvise` takes, an `i64` length) or far past the end of the file fails with a
/// named error before any read; the store's next layer, of good pieces of the same file,
/// still loads byte-exact (no end-of-fill advice of the failed layers is remembered).
#[test]
fn a_drop_behind_layer_at_the_top_of_the_offsets_fails_alone() {
    let d = dir("top-offsets");
    let path = d.join("data.bin");
    let bytes = write_file(&path, 3 << 20, 67);
    let file = File::open(&path).unwrap();
    let store = PinStore::new(
        Layout::Unplaced,
        StoreOptions::default()
            .huge_pages(false)
            .loader_threads(2)
            .read_mode(ReadMode::DropBehind),
    )
    .unwrap();
    let pack = |layer: usize, pieces: &[Vec<(u64, usize)>]| {
        let sources: Vec<ExpertSource<'_>> = pieces
            .iter()
            .map(|w| ExpertSource::from_file(&file, w, &[]))
            .collect();
        let spec = LayerSpec::fitting(&sources)?;
        store.pack_layer(layer, &spec, &sources).map(|_| ())
    };
    for (layer, at) in [
        (0, u64::MAX - 4096),
        (1, u64::MAX - (3 << 20)),
        (2, 1 << 62),
    ] {
        let err = pack(layer, &[vec![(0, 4096)], vec![(at, 4096)]]).unwrap_err();
        assert!(
            err.to_string().contains("past the end of the file"),
            "layer {layer}: refused, named: {err}"
        );
    }
    let good: Vec<Vec<(u64, usize)>> = (0..3).map(|e| vec![(e << 20, 1 << 20)]).collect();
    pack(3, &good).unwrap_or_else(|e| panic!("a good layer after the failed ones: {e}"));
    for e in 0..3 {
        let at = e << 20;
        assert!(
            store.weights(3, e).unwrap()[..1 << 20] == bytes[at..at + (1 << 20)],
            "expert {e}"
        );
    }
    drop(file);
    std::fs::remove_dir_all(&d).unwrap();
}
