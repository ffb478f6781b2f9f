//! Read modes: every mode loads byte-exact (odd offsets and lengths, a piece ending at the
//! end of a file whose size is not a multiple of 512, pieces of two files), direct reads
//! fall back with a reason where the file system has no direct I/O, and the page cache a
//! cold load leaves, counted with `mincore`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use numapin::store::{
    DROP_BEHIND_EVERY, ExpertSource, Kind, LayerSpec, Layout, Piece, PinStore, ProgressHook,
    ReadFallback, ReadMode, StoreOptions,
};
use numapin_testkit::cache::{cached_pages, evict};
use numapin_testkit::synthetic::SyntheticModel;

mod common;

/// A directory of this test's own on the target directory's file system.
fn dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("read-modes-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `len` bytes of the synthetic stream from stream offset `base` to `path`.
fn write_stream(path: &Path, base: u64, len: usize) -> File {
    let mut bytes = vec![0u8; len];
    SyntheticModel::expected_bytes(base, &mut bytes);
    std::fs::write(path, &bytes).unwrap();
    File::open(path).unwrap()
}

/// The bytes the pieces name, concatenated (`base` per file, in the pieces' order).
fn expected(pieces: &[(usize, u64, usize)], bases: &[u64]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(f, offset, len) in pieces {
        let mut b = vec![0u8; len];
        SyntheticModel::expected_bytes(bases[f] + offset, &mut b);
        out.extend_from_slice(&b);
    }
    out
}

/// What `mode` runs as on the file system of `path`: direct where statx reports a
/// direct-I/O alignment, else buffered with the reason.
fn expected_outcome(mode: ReadMode, file: &File) -> (ReadMode, Option<ReadFallback>) {
    // Auto reads a file it finds cached buffered: these were written just before.
    if mode == ReadMode::Auto {
        return (ReadMode::Buffered, None);
    }
    if mode != ReadMode::Direct {
        return (mode, None);
    }
    if common::dio_align(file).is_some() {
        (ReadMode::Direct, None)
    } else {
        (ReadMode::Buffered, Some(ReadFallback::NoDirectIoAlignment))
    }
}

fn options(mode: ReadMode, threads: usize) -> StoreOptions {
    StoreOptions::default()
        .read_mode(mode)
        .loader_threads(threads)
}

/// Size of file A: 10 MiB + 333, not a multiple of 512.
const A_LEN: usize = (10 << 20) + 333;
/// Size of file B: 3 × 512 + 17.
const B_LEN: usize = 3 * 512 + 17;
const BASES: [u64; 2] = [0, 1 << 40];

/// Expert pieces as (file, offset, length): weights, then scales.
#[allow(clippy::type_complexity)]
fn expert_pieces() -> Vec<(Vec<(usize, u64, usize)>, Vec<(usize, u64, usize)>)> {
    let a = A_LEN as u64;
    vec![
        // Aligned offset and length: straight into the slot.
        (vec![(0, 4096, 8192)], vec![(0, 512, 512)]),
        // Aligned offset, odd length: the bulk direct, the tail through the bounce buffer.
        (vec![(0, 1 << 20, 8192 + 100)], vec![(1, 0, 1)]),
        // Odd offset and length, larger than one bounce buffer (8 MiB).
        (vec![(0, 7, (9 << 20) + 77)], vec![(0, 3, 5)]),
        // A 5-byte piece, then one whose offset is ≡ 5 (mod 512): after its head, the
        // slot is aligned and the rest goes straight in.
        (vec![(0, 1000, 5), (0, 2053, 10_000)], vec![]),
        // Pieces of two files in one slot, and a piece ending at the end of each file.
        (
            vec![(1, 100, B_LEN - 100), (0, a - 1234, 1234), (0, 9, 1)],
            vec![(0, a - 1, 1)],
        ),
        // A whole file B, and adjacent pieces that coalesce across a 512 boundary.
        (
            vec![(1, 0, B_LEN)],
            vec![(0, 510, 1), (0, 511, 1), (0, 512, 700)],
        ),
    ]
}

fn check_every_mode(dir: &Path, what: &str) {
    let files = [
        write_stream(&dir.join("a.bin"), BASES[0], A_LEN),
        write_stream(&dir.join("b.bin"), BASES[1], B_LEN),
    ];
    let plan = expert_pieces();
    let pieces = |list: &[(usize, u64, usize)]| -> Vec<Piece> {
        list.iter()
            .map(|&(f, o, l)| Piece::new(&files[f], o, l))
            .collect()
    };
    let sources: Vec<ExpertSource> = plan
        .iter()
        .map(|(w, s)| ExpertSource::File {
            weights: pieces(w),
            scales: pieces(s),
        })
        .collect();
    let spec = LayerSpec::fitting(&sources).unwrap();
    for mode in ReadMode::ALL {
        for threads in [1, 3] {
            let store = PinStore::new(Layout::Unplaced, options(mode, threads)).unwrap();
            let report = store.pack_layer(0, &spec, &sources).unwrap();
            assert_eq!(
                (report.read_mode, report.read_fallback),
                expected_outcome(mode, &files[0]),
                "{what}: {mode} with {threads} threads"
            );
            for (e, (w, s)) in plan.iter().enumerate() {
                assert!(
                    store.weights(0, e).unwrap() == expected(w, &BASES),
                    "{what}: {mode}, {threads} threads: expert {e} weights differ"
                );
                assert!(
                    store.scales(0, e).unwrap() == expected(s, &BASES),
                    "{what}: {mode}, {threads} threads: expert {e} scales differ"
                );
            }
        }
    }
}

#[test]
fn every_mode_loads_byte_exact() {
    let dir = dir("exact");
    check_every_mode(&dir, "target dir");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn direct_reads_fall_back_on_tmpfs_and_say_why() {
    let Some(dir) = common::shm_dir(
        "direct_reads_fall_back_on_tmpfs_and_say_why",
        "numapin-read-modes",
    ) else {
        return;
    };
    let file = write_stream(&dir.join("a.bin"), 0, 4096 + 3);
    // tmpfs reports no direct-I/O alignment: the expectation is the fallback itself.
    assert_eq!(
        expected_outcome(ReadMode::Direct, &file),
        (ReadMode::Buffered, Some(ReadFallback::NoDirectIoAlignment))
    );
    check_every_mode(&dir, "tmpfs");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A cold load of a 320 MiB model (file evicted first) in `mode`: the pages of the file in
/// the page cache after the load, and the most seen at any progress report during it.
/// Each layer (160 MiB) is well over [`DROP_BEHIND_EVERY`] plus the margins of the bound
/// below, so drop-behind must advise during a layer, not only at its end, to meet it.
///
/// The descriptor the store reads through is advised `POSIX_FADV_RANDOM`: the kernel then
/// reads exactly the pages a `pread` asks for and nothing ahead of it, so what is cached
/// during the load is what the loaders read and have not dropped yet, a count the bound
/// below makes by construction. With readahead on, the kernel's windows (their size set
/// by `read_ahead_kb`, the device's largest request and how far each loader thread has
/// run ahead) came on top, and the bound depended on the machine and on the timing.
fn cold_load(mode: ReadMode, dir: &Path) -> ((usize, usize), usize) {
    let model = SyntheticModel {
        layers: 2,
        experts: 80,
        weight_bytes: (2 << 20) + 333,
        scale_bytes: 4096 + 5,
    };
    let path = dir.join(format!("{mode}.bin"));
    model.write(&path).unwrap();
    let file = File::open(&path).unwrap();
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random).unwrap();
    evict(&file).unwrap();
    assert_eq!(cached_pages(&file).unwrap().0, 0, "{mode}: evicted");
    let peak = Arc::new(Mutex::new(0usize));
    let sampler = {
        let (peak, file) = (peak.clone(), file.try_clone().unwrap());
        ProgressHook::new(move |_| {
            let (resident, _) = cached_pages(&file).unwrap();
            let mut p = peak.lock().unwrap();
            *p = (*p).max(resident);
        })
    };
    let store = PinStore::new(Layout::Unplaced, options(mode, 2).progress(Some(sampler))).unwrap();
    for layer in 0..model.layers {
        let report = store
            .pack_layer(layer, &model.spec(), &model.sources(&file, layer))
            .unwrap();
        assert_eq!(report.read_mode, mode);
    }
    for layer in 0..model.layers {
        for e in 0..model.experts {
            assert!(model.verify(
                layer,
                e,
                numapin::store::Kind::Weights,
                store.weights(layer, e).unwrap()
            ));
        }
    }
    let after = cached_pages(&file).unwrap();
    let peak = *peak.lock().unwrap();
    std::fs::remove_file(&path).unwrap();
    (after, peak)
}

#[test]
fn a_cold_load_leaves_the_page_cache_as_promised() {
    let dir = dir("cache");
    let probe = write_stream(&dir.join("probe.bin"), 0, 4096);
    if expected_outcome(ReadMode::Direct, &probe).0 != ReadMode::Direct {
        let fs = rustix::fs::fstatfs(&probe).unwrap().f_type;
        println!(
            "NOT RUN: a_cold_load_leaves_the_page_cache_as_promised needs a file system with \
             direct I/O for {}; its statfs magic is {fs:#x}, which reports no STATX_DIOALIGN",
            dir.display()
        );
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    }
    let page = numapin::page_size();
    // The control: the count sees this file's cache. 8 pages of it mapped and locked
    // (`mlock` reads them in and pins them: neither another process's `drop_caches` nor
    // memory pressure can take them) are counted, whatever else is cached meanwhile.
    // 32 KiB: under the smallest default RLIMIT_MEMLOCK (64 KiB) where the sandbox has
    // no CAP_IPC_LOCK.
    // A buffered load's leftovers are not the control: whoever drops caches or reclaims
    // (another test, the machine) takes them, and the stress run saw 0 of 82094 left.
    let ((_, total), _) = cold_load(ReadMode::Buffered, &dir);
    let control = dir.join("control.bin");
    let held = write_stream(&control, 0, 8 * page);
    // SAFETY: the file is this test's own; nothing writes or truncates it while mapped.
    let locked = unsafe { numapin::Region::map_file(&held, 0, 8 * page) }.unwrap();
    locked.lock().unwrap();
    let (cached, pages) = cached_pages(&held).unwrap();
    assert_eq!((cached, pages), (8, 8), "the locked control");
    drop(locked);
    for mode in [ReadMode::Direct, ReadMode::DropBehind] {
        let ((cached, total_here), peak) = cold_load(mode, &dir);
        assert_eq!(total_here, total);
        println!(
            "{mode}: {cached} of {total} pages cached after the load, at most {peak} during it"
        );
        assert!(
            cached * 50 <= total,
            "{mode}: {cached} of {total} pages cached after the load (> 2%)"
        );
        // During the load, with no kernel readahead (see `cold_load`): drop-behind holds
        // at most what every loader finished reading since the last advice (under
        // DROP_BEHIND_EVERY but for the read that reaches it), the 2 MiB folio below the
        // mark it stops at and the one it rounds to, and per loader thread one slot (2 MiB
        // + 333 weights, 4 KiB + 5 scales) in flight or read and not yet counted; direct
        // reads, none. Still well
        // under a layer (160 MiB), so drop-behind that advised only at a layer's end
        // fails by far.
        let threads = 2;
        let bound = match mode {
            ReadMode::DropBehind => {
                (DROP_BEHIND_EVERY as usize + 2 * (2 << 20) + threads * (3 << 20)) / page
            }
            _ => 0,
        };
        assert!(
            peak <= bound,
            "{mode}: {peak} pages cached during the load, more than {bound}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Whole synthetic models in every mode: experts back to back in the file, which direct
/// reads take in batches of consecutive slots (one `preadv` into the slots where every
/// piece is aligned, bounce-buffer windows where not), ending at the end of the file.
#[test]
fn consecutive_slots_load_byte_exact_in_every_mode() {
    let dir = dir("batches");
    let shapes = [
        // Aligned: 64 KiB weights + 4 KiB scales.
        (9, 64 << 10, 4 << 10),
        // Unaligned, the file's size not a multiple of 512.
        (9, (300 << 10) + 333, 4096 + 5),
        // Slots larger than a batch (8 MiB) and than the bounce buffer.
        (3, (9 << 20) + 1, 17),
    ];
    for (experts, weight_bytes, scale_bytes) in shapes {
        let model = SyntheticModel {
            layers: 2,
            experts,
            weight_bytes,
            scale_bytes,
        };
        let path = dir.join("model.bin");
        model.write(&path).unwrap();
        let file = File::open(&path).unwrap();
        for mode in ReadMode::ALL {
            for threads in [1, 2] {
                let store = PinStore::new(Layout::Unplaced, options(mode, threads)).unwrap();
                for layer in 0..model.layers {
                    let report = store
                        .pack_layer(layer, &model.spec(), &model.sources(&file, layer))
                        .unwrap();
                    assert_eq!(
                        (report.read_mode, report.read_fallback),
                        expected_outcome(mode, &file)
                    );
                    for e in 0..model.experts {
                        for (kind, bytes) in [
                            (Kind::Weights, store.weights(layer, e).unwrap()),
                            (Kind::Scales, store.scales(layer, e).unwrap()),
                        ] {
                            assert!(
                                model.verify(layer, e, kind, bytes),
                                "{model:?} {mode} {threads} threads: layer {layer} expert {e} {kind:?}"
                            );
                        }
                    }
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A cold drop-behind load, one fill per layer with the kernel's readahead on, reads the
/// file from the device once: each fill leaves what the kernel read ahead past its last
/// byte for the next fill. Advising the whole file at the end of each fill threw that
/// away at every layer boundary, and the next fill read it again (11% of a 16-layer
/// model with this machine's 8 MiB readahead, 2.75× the file on 4 MiB layers; here 63
/// boundaries × at least 128 KiB, the smallest usual `read_ahead_kb`, = 7.9 MiB, above
/// this test's 4 MiB allowance). Counted by the kernel, alone in its process, so no
/// other test's reads count; the allowance is for this process's own code pages, which
/// it faults in from the test binary where something evicted them (the container stage
/// saw 1.9 MB).
#[test]
fn a_drop_behind_load_reads_the_file_from_the_device_once() {
    const TEST: &str = "a_drop_behind_load_reads_the_file_from_the_device_once";
    if !common::alone(TEST) {
        return;
    }
    let dir = dir("once");
    let model = SyntheticModel {
        layers: 64,
        experts: 4,
        weight_bytes: (256 << 10) + 333,
        scale_bytes: 4096 + 5,
    };
    let path = dir.join("model.bin");
    model.write(&path).unwrap();
    // The code of a drop-behind load, run once on another file first, so that its pages
    // are in memory before the count starts.
    let warm = SyntheticModel { layers: 1, ..model };
    let warm_path = dir.join("warm.bin");
    warm.write(&warm_path).unwrap();
    let warm_file = File::open(&warm_path).unwrap();
    PinStore::new(Layout::Unplaced, options(ReadMode::DropBehind, 2))
        .unwrap()
        .pack_layer(0, &warm.spec(), &warm.sources(&warm_file, 0))
        .unwrap();
    let file = File::open(&path).unwrap();
    let len = file.metadata().unwrap().len();
    let Some(before) = common::cold_read_count(TEST, &file, &path) else {
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    };
    let store = PinStore::new(Layout::Unplaced, options(ReadMode::DropBehind, 2)).unwrap();
    for layer in 0..model.layers {
        let report = store
            .pack_layer(layer, &model.spec(), &model.sources(&file, layer))
            .unwrap();
        assert_eq!(report.read_mode, ReadMode::DropBehind);
    }
    let read = common::storage_read_bytes().unwrap() - before;
    for layer in 0..model.layers {
        for e in 0..model.experts {
            assert!(model.verify(layer, e, Kind::Weights, store.weights(layer, e).unwrap()));
        }
    }
    println!("{TEST}: {read} bytes read from the device for a {len}-byte file");
    // At least the file (else the kernel counts nothing here and the bound says nothing),
    // at most the file and 4 MiB (the file system's metadata, this process's code).
    assert!(
        read >= len,
        "{read} bytes read from the device, the file has {len}"
    );
    assert!(
        read <= len + (4 << 20),
        "{read} bytes read from the device for a {len}-byte file: read more than once"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
