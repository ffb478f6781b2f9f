//! Direct reads without `io_uring` (the read threads, `StoreOptions::io_uring(false)`),
//! attacked: pieces of 1 byte, 0 bytes, many tiny ones, pieces reaching past the end of
//! the file, and a file truncated by another thread while its pieces are read. Bytes
//! exact (against the file's bytes read before) or a named error; no hang (each load in
//! a thread, waited for with a timeout), no panic; the report's byte counts add up.

use super::{ROLES, base, dbrx, file_tensor, role, scratch};

use std::fs::File;
use std::sync::mpsc;
use std::time::Duration;

use numapin::model::Checkpoint;
use numapin::store::{
    DirectIo, ExpertSource, Kind, LayerSpec, Layout, POOL_DEPTH, PinStore, ReadMode, StoreOptions,
};

/// A piece: file offset and length.
type Range = (u64, usize);

/// Whether `file`'s file system takes direct reads (`statx` says its alignments).
fn has_direct_io(file: &File) -> bool {
    crate::common::dio_align(file).is_some()
}

fn threads_options(loaders: usize) -> StoreOptions {
    StoreOptions::default()
        .read_mode(ReadMode::Direct)
        .io_uring(false)
        .huge_pages(false)
        .loader_threads(loaders)
}

/// Runs `f` on a thread; fails the test if it takes over 120 s (a hang) or panics.
fn in_time<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(v) => {
            h.join().unwrap();
            v
        }
        Err(_) => panic!("{what}: no answer in 120 s (hang or panic)"),
    }
}

/// Packs `pieces` (weights only) of `bytes` written at `path`; `Ok(report)` only if
/// every slot holds exactly the file's bytes and the counts add up.
fn pack(
    path: &std::path::Path,
    bytes: &[u8],
    pieces: &[Range],
    loaders: usize,
    during: Option<Box<dyn FnOnce() + Send>>,
) -> Result<(), String> {
    let file = File::open(path).unwrap();
    let sources: Vec<ExpertSource<'_>> = pieces
        .iter()
        .map(|&w| ExpertSource::from_file(&file, &[w], &[]))
        .collect();
    let spec = LayerSpec::fitting(&sources).map_err(|e| format!("spec: {e}"))?;
    let store = PinStore::new(Layout::Unplaced, threads_options(loaders)).unwrap();
    let side = during.map(std::thread::spawn);
    let report = store.pack_layer(0, &spec, &sources);
    if let Some(h) = side {
        h.join().unwrap();
    }
    let report = report.map_err(|e| e.to_string())?;
    let want: u64 = pieces.iter().map(|p| p.1 as u64).sum();
    let d = report.direct_reads;
    if report.read_mode == ReadMode::Direct {
        assert_eq!(
            d.in_place_bytes + report.bounced_bytes,
            want,
            "counts: {report:?}"
        );
        // io_uring(false): every read a blocking call on the read threads, never the ring.
        match report.direct_io {
            Some(DirectIo::Threads(_)) => {
                assert_eq!((d.uring_reads, d.uring_depth), (0, 0), "{report:?}");
                assert!(d.blocking_reads >= 1, "{report:?}");
                assert!((1..=POOL_DEPTH).contains(&d.blocking_depth), "{report:?}");
            }
            other => panic!("io_uring(false) read with {other:?}: {report:?}"),
        }
    }
    let map = store.slot_map(0).unwrap();
    for (e, &(o, n)) in pieces.iter().enumerate() {
        let place = map.pieces(e, Kind::Weights).unwrap()[0];
        assert_eq!(place.len, n, "piece {e}");
        let slot = store.weights(0, e).unwrap();
        let o = o as usize;
        assert!(
            o + n <= bytes.len(),
            "piece {e} ({o}+{n}) past the file's {} bytes, loaded: {report:?}",
            bytes.len()
        );
        assert!(
            slot[place.offset..place.end()] == bytes[o..o + n],
            "piece {e} ({o}+{n}) not the file's bytes"
        );
    }
    Ok(())
}

fn write(path: &std::path::Path, len: usize) -> Vec<u8> {
    let bytes: Vec<u8> = (0..len)
        .map(|i| ((i * 31 + i / 4099) % 251) as u8)
        .collect();
    std::fs::write(path, &bytes).unwrap();
    bytes
}

#[test]
fn tiny_empty_and_past_the_end_pieces_are_exact_or_refused() {
    let dir = scratch("reads_tiny");
    let path = dir.join("model.bin");
    let len = (1 << 20) + 123;
    let bytes = write(&path, len);
    if !has_direct_io(&File::open(&path).unwrap()) {
        println!("NOT RUN: no direct I/O here");
        return;
    }
    let l = len as u64;
    let cases: Vec<(&str, Vec<Range>, Option<bool>)> = vec![
        ("one byte", vec![(7, 1)], Some(true)),
        ("one byte at 0", vec![(0, 1)], Some(true)),
        ("last byte", vec![(l - 1, 1)], Some(true)),
        (
            "1-byte pieces",
            (0..300).map(|i| (i * 3491 + 1, 1)).collect(),
            Some(true),
        ),
        (
            "tiny odd pieces",
            (0..500)
                .map(|i| (i * 2000 + i % 7, 1 + i as usize % 13))
                .collect(),
            Some(true),
        ),
        (
            "same byte many times",
            (0..64).map(|_| (4095, 1)).collect(),
            Some(true),
        ),
        (
            "overlapping",
            (0..64).map(|i| (i * 100, 5000)).collect(),
            Some(true),
        ),
        ("0 bytes", vec![(10, 0)], None),
        ("0 bytes among", vec![(10, 0), (20, 3), (l, 0)], Some(true)),
        ("whole file", vec![(0, len)], Some(true)),
        ("one past the end", vec![(l - 10, 11)], Some(false)),
        ("at the end", vec![(l, 1)], Some(false)),
        ("far past the end", vec![(l * 4, 4096)], Some(false)),
        ("past u64", vec![(u64::MAX - 2, 8)], Some(false)),
        ("good then past", vec![(0, 100), (l - 1, 2)], Some(false)),
    ];
    for (case, pieces, fits) in cases {
        for loaders in [1, 2] {
            let what = format!("{case}, {loaders} loaders");
            let (p, b, pieces2) = (path.clone(), bytes.clone(), pieces.clone());
            let got = in_time(&what, move || pack(&p, &b, &pieces2, loaders, None));
            match got {
                Ok(()) => assert_ne!(fits, Some(false), "{what}: loaded pieces past the end"),
                Err(e) => {
                    eprintln!("{what}: refused: {e}");
                    assert_ne!(
                        fits,
                        Some(true),
                        "{what}: refused a piece inside the file: {e}"
                    );
                    assert!(
                        e.contains("past the end")
                            || e.contains("overflows")
                            || e.contains("weight bytes"),
                        "{what}: not a named error: {e}"
                    );
                }
            }
        }
    }
}

/// The file cut short by another thread while the read threads read it: every load
/// either holds exactly the bytes the file had, or is an error; none hangs or panics.
#[test]
fn a_file_truncated_during_the_read_threads_load_is_exact_or_an_error() {
    let dir = scratch("reads_truncate");
    let path = dir.join("model.bin");
    let (piece, experts) = ((1 << 20) + 37, 40usize);
    let len = piece * experts + 4096;
    let pieces: Vec<Range> = (0..experts)
        .map(|e| ((e * piece + 11) as u64, piece))
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for round in 0..8u64 {
        let bytes = write(&path, len);
        if !has_direct_io(&File::open(&path).unwrap()) {
            println!("NOT RUN: no direct I/O here");
            return;
        }
        let to = [0u64, 4096, (len / 2) as u64, (len - 1) as u64][round as usize % 4];
        let p2 = path.clone();
        let cut: Box<dyn FnOnce() + Send> = Box::new(move || {
            std::thread::sleep(Duration::from_micros(round * 700));
            let f = std::fs::OpenOptions::new().write(true).open(&p2).unwrap();
            f.set_len(to).unwrap();
        });
        let (p, b, pc) = (path.clone(), bytes.clone(), pieces.clone());
        let what = format!("round {round}: cut to {to}");
        match in_time(&what, move || pack(&p, &b, &pc, 2, Some(cut))) {
            Ok(()) => ok += 1,
            Err(e) => {
                eprintln!("{what}: refused: {e}");
                refused += 1;
            }
        }
    }
    eprintln!("truncated during the load: {ok} exact, {refused} refused");
}

/// A DBRX-like checkpoint placed with direct reads and the read threads while its file
/// is cut short: the placement is refused, or every role run is the file's bytes as
/// they were (read before the cut).
#[test]
fn a_checkpoint_truncated_during_a_direct_place_is_exact_or_an_error() {
    let dir = scratch("reads_place_truncate");
    let r = ("BF16", vec![4 * 2048, 64]);
    let path = dbrx(&dir, 4, [r.clone(), r.clone(), r]);
    if !has_direct_io(&File::open(&path).unwrap()) {
        println!("NOT RUN: no direct I/O here");
        return;
    }
    let want: Vec<(String, Vec<u8>)> = (0..2)
        .flat_map(|l| ROLES.map(|r| role(l, r)))
        .map(|n| {
            let b = file_tensor(&path, &n).1;
            (n, b)
        })
        .collect();
    let original = std::fs::read(&path).unwrap();
    for round in 0..6u64 {
        std::fs::write(&path, &original).unwrap();
        let checkpoint = Checkpoint::open(&path).unwrap();
        let p2 = path.clone();
        let to = original.len() as u64 / (2 + round);
        let cut = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_micros(round * 500));
            let f = std::fs::OpenOptions::new().write(true).open(&p2).unwrap();
            f.set_len(to).unwrap();
        });
        let want = want.clone();
        let what = format!("round {round}: cut to {to}");
        let w2 = what.clone();
        in_time(&what, move || {
            let opts = threads_options(2);
            match checkpoint.place(&base(), opts) {
                Err(e) => eprintln!("{w2}: refused: {e}"),
                Ok(m) => {
                    for (name, bytes) in &want {
                        let t = m.tensor(name).unwrap();
                        if let Some(run) = t.bytes() {
                            assert!(run == &bytes[..], "{w2}: {name} not the file's bytes");
                        } else {
                            let layer = t.layer().unwrap();
                            let per = bytes.len() / 4;
                            for e in 0..4 {
                                let pieces = m.expert(layer, e).unwrap();
                                let p = pieces.iter().find(|p| p.tensor == name).unwrap();
                                assert!(p.bytes == &bytes[e * per..(e + 1) * per], "{w2}");
                            }
                        }
                    }
                }
            }
        });
        cut.join().unwrap();
    }
}

/// On tmpfs (`/dev/shm`: no `O_DIRECT`), direct reads asked without `io_uring`: the
/// load falls back as the report says and every piece, tiny or large, is the file's.
#[test]
fn direct_reads_without_io_uring_on_tmpfs_are_exact() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("NOT RUN: no /dev/shm");
        return;
    }
    let dir = numapin_testkit::scratch::ScratchDir::new(shm, "attack_r9-reads_tmpfs");
    let path = dir.join("model.bin");
    let len = (3 << 20) + 77;
    let bytes = write(&path, len);
    let pieces: Vec<Range> = (0..40)
        .map(|i| ((i * 77_777 + i % 5) as u64, 1 + (i * 3001) % 70_000))
        .chain([(0, 1 << 20), ((len - 1) as u64, 1)])
        .collect();
    for loaders in [1, 3] {
        let (p, b, pc) = (path.clone(), bytes.clone(), pieces.clone());
        let what = format!("tmpfs, {loaders} loaders");
        if let Err(e) = in_time(&what, move || pack(&p, &b, &pc, loaders, None)) {
            panic!("{what}: {e}");
        }
    }
}
