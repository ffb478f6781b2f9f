//! Direct reads where `io_uring` is not used (denied by seccomp in containers, or turned
//! off: [`StoreOptions::io_uring`], `NUMAPIN_IO_URING=off`): each loader keeps several
//! blocking reads in flight on short-lived read threads. The report says the mechanism and
//! counts what it did; every byte equals the file's, read independently. Nothing here
//! assumes `io_uring` is available, nor that it is not.

#[path = "common/mod.rs"]
mod common;

use std::fs::File;
use std::path::Path;

use numapin_testkit::scratch::ScratchDir;

use numapin::store::{
    DirectIo, ExpertSource, IoUringFallback, Kind, LayerSpec, Layout, POOL_DEPTH, PinStore,
    ReadMode, StoreOptions,
};

/// The test's directory, removed when it ends (passed or panicked).
fn dir(name: &str) -> ScratchDir {
    ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("read-threads-{name}"),
    )
}

/// Runs this test binary's ignored test `test` alone with `READ_THREADS_FILE=path` and
/// `env`; returns its stdout after checking it passed.
fn run_child(test: &str, path: &Path, env: &[(&str, &str)]) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--ignored"])
        .env("READ_THREADS_FILE", path)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// Whether `file`'s file system takes direct reads (`statx` says its alignments).
fn has_direct_io(file: &File) -> bool {
    common::dio_align(file).is_some()
}

/// A piece: file offset and length.
type Range = (u64, usize);

/// `[weights, scales]` pieces of each expert: safetensors-like odd offsets (a 1 MiB + 37
/// byte tensor, then a 4096 + 5 byte one), back to back in the file after a 123-byte
/// header, as a checkpoint's tensors are.
fn layout(experts: usize) -> (Vec<[Range; 2]>, usize) {
    let (w, s) = ((1 << 20) + 37, 4096 + 5);
    let mut at = 123u64;
    let mut out = Vec::new();
    for _ in 0..experts {
        let weights = (at, w);
        at += w as u64;
        let scales = (at, s);
        at += s as u64;
        out.push([weights, scales]);
    }
    (out, at as usize + 77)
}

#[test]
fn several_reads_in_flight_without_io_uring_are_counted_and_byte_exact() {
    let dir = dir("exact");
    let experts = 24;
    let (pieces, len) = layout(experts);
    let path = dir.join("model.bin");
    let bytes: Vec<u8> = (0..len)
        .map(|i| ((i * 31 + i / 4099) % 251) as u8)
        .collect();
    std::fs::write(&path, &bytes).unwrap();
    let file = File::open(&path).unwrap();
    if !has_direct_io(&file) {
        println!("NOT RUN: the target directory's file system has no direct I/O");
        return;
    }
    // The reference: the file read back in one buffered read, not through numapin.
    let reference = std::fs::read(&path).unwrap();
    assert_eq!(reference, bytes);
    let sources: Vec<ExpertSource<'_>> = pieces
        .iter()
        .map(|&[w, s]| ExpertSource::from_file(&file, &[w], &[s]))
        .collect();
    let spec = LayerSpec::fitting(&sources).unwrap();
    let file_bytes: u64 = pieces.iter().map(|[w, s]| (w.1 + s.1) as u64).sum();
    for io_uring in [true, false] {
        for threads in [1, 2] {
            let options = StoreOptions::default()
                .read_mode(ReadMode::Direct)
                .io_uring(io_uring)
                .loader_threads(threads)
                .piece_congruence(4096);
            let store = PinStore::new(Layout::Unplaced, options).unwrap();
            let report = store.pack_layer(0, &spec, &sources).unwrap();
            let what = format!("io_uring option {io_uring}, {threads} loaders: {report:?}");
            assert_eq!(report.read_mode, ReadMode::Direct, "{what}");
            let d = report.direct_reads;
            // Every byte read once: in place or through a bounce buffer.
            assert_eq!(
                d.in_place_bytes + report.bounced_bytes,
                file_bytes,
                "{what}"
            );
            // Congruent slots: all but the partial units at the pieces' ends in place.
            assert!(d.in_place_bytes > file_bytes / 2, "{what}");
            match report.direct_io {
                Some(DirectIo::IoUring { depth }) => {
                    assert!(io_uring, "{what}");
                    assert!(d.uring_reads > 0 && d.uring_depth <= depth, "{what}");
                }
                Some(DirectIo::Threads(why)) => {
                    if !io_uring {
                        assert_eq!(why, IoUringFallback::Off, "{what}");
                    }
                    // Every read a blocking call, up to POOL_DEPTH of them in flight per
                    // loader (how many at once is the scheduler's): never the ring.
                    assert_eq!((d.uring_reads, d.uring_depth), (0, 0), "{what}");
                    assert!(d.blocking_reads >= experts as u64, "{what}");
                    assert!((1..=POOL_DEPTH).contains(&d.blocking_depth), "{what}");
                    assert!(report.direct_io.unwrap().to_string().contains("in flight"));
                }
                other => panic!("not a direct load: {other:?}: {what}"),
            }
            for (e, &[w, s]) in pieces.iter().enumerate() {
                let map = store.slot_map(0).unwrap();
                for (kind, (offset, n)) in [(Kind::Weights, w), (Kind::Scales, s)] {
                    let place = map.pieces(e, kind).unwrap()[0];
                    let slot = match kind {
                        Kind::Weights => store.weights(0, e).unwrap(),
                        Kind::Scales => store.scales(0, e).unwrap(),
                    };
                    assert_eq!(place.len, n);
                    let o = offset as usize;
                    assert!(
                        slot[place.offset..place.end()] == reference[o..o + n],
                        "{what}: expert {e} {kind:?} differs from the file"
                    );
                }
            }
        }
    }
}

/// `NUMAPIN_IO_URING=off` forces the read threads in a process (here: the CLI), and its
/// report says so. Run as a child so this test binary's environment stays as it is.
#[test]
fn the_environment_variable_forces_the_read_threads() {
    let dir = dir("env");
    let (_, len) = layout(4);
    let path = dir.join("model.bin");
    let bytes: Vec<u8> = (0..len).map(|i| (i % 247) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let file = File::open(&path).unwrap();
    if !has_direct_io(&file) {
        println!("NOT RUN: the target directory's file system has no direct I/O");
        return;
    }
    // The child: this test binary itself, running the one test below with the variable.
    let text = run_child(
        "child_loads_with_the_variable",
        &path,
        &[("NUMAPIN_IO_URING", "off")],
    );
    assert!(text.contains("CHILD direct_io=threads"), "{text}");
    assert!(text.contains("NUMAPIN_IO_URING"), "{text}");
}

/// Run by [`the_environment_variable_forces_the_read_threads`] only.
#[test]
#[ignore = "a child of the_environment_variable_forces_the_read_threads"]
fn child_loads_with_the_variable() {
    let Some(path) = std::env::var_os("READ_THREADS_FILE") else {
        return;
    };
    let file = File::open(path).unwrap();
    let (pieces, _) = layout(4);
    let sources: Vec<ExpertSource<'_>> = pieces
        .iter()
        .map(|&[w, s]| ExpertSource::from_file(&file, &[w], &[s]))
        .collect();
    let spec = LayerSpec::fitting(&sources).unwrap();
    let options = StoreOptions::default()
        .read_mode(ReadMode::Direct)
        .loader_threads(2);
    let store = PinStore::new(Layout::Unplaced, options).unwrap();
    let report = store.pack_layer(0, &spec, &sources).unwrap();
    let Some(io) = report.direct_io else {
        panic!("no direct reads: {report:?}");
    };
    let d = report.direct_reads;
    assert_eq!(d.uring_reads, 0, "{report:?}");
    assert!(matches!(
        io,
        DirectIo::Threads(IoUringFallback::Environment)
    ));
    let kind = match io {
        DirectIo::Threads(_) => "threads",
        _ => "io_uring",
    };
    println!("CHILD direct_io={kind} {io}");
}

/// A map budget with room for a loader's bounce buffer but not for its read threads: the
/// load reads one blocking call at a time (depth 1) instead of failing, byte-exact. Run as
/// a child so that no other test's threads change the map count meanwhile.
#[test]
fn a_budget_without_room_for_read_threads_reads_one_at_a_time() {
    let dir = dir("budget");
    let (_, len) = layout(6);
    let path = dir.join("model.bin");
    let bytes: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let file = File::open(&path).unwrap();
    if !has_direct_io(&file) {
        println!("NOT RUN: the target directory's file system has no direct I/O");
        return;
    }
    let text = run_child("child_loads_in_a_tight_budget", &path, &[]);
    assert!(text.contains("CHILD depth=1"), "{text}");
}

/// Run by [`a_budget_without_room_for_read_threads_reads_one_at_a_time`] only.
#[test]
#[ignore = "a child of a_budget_without_room_for_read_threads_reads_one_at_a_time"]
fn child_loads_in_a_tight_budget() {
    let Some(path) = std::env::var_os("READ_THREADS_FILE") else {
        return;
    };
    let file = File::open(path).unwrap();
    let reference = std::fs::read(std::env::var_os("READ_THREADS_FILE").unwrap()).unwrap();
    let (pieces, _) = layout(6);
    let sources: Vec<ExpertSource<'_>> = pieces
        .iter()
        .map(|&[w, s]| ExpertSource::from_file(&file, &[w], &[s]))
        .collect();
    let spec = LayerSpec::fitting(&sources).unwrap();
    // Room for the layer's regions and one bounce buffer, far from the read threads'
    // (POOL_DEPTH - 1) * LOADER_THREAD_MAPS.
    let room = 12;
    assert!(room < (POOL_DEPTH - 1) * numapin::store::LOADER_THREAD_MAPS);
    let options = StoreOptions::default()
        .read_mode(ReadMode::Direct)
        .io_uring(false)
        .loader_threads(1)
        .vma_budget(Some(numapin::diag::map_count().unwrap() + room));
    let store = PinStore::new(Layout::Unplaced, options).unwrap();
    let report = store.pack_layer(0, &spec, &sources).unwrap();
    assert_eq!(
        report.direct_io,
        Some(DirectIo::Threads(IoUringFallback::Off))
    );
    let d = report.direct_reads;
    assert_eq!(d.uring_reads, 0, "{report:?}");
    // One blocking call at a time (the six experts are one run of the file: one aligned
    // window through the bounce buffer may hold them all), every byte once.
    assert!(d.blocking_reads >= 1, "{report:?}");
    let total: u64 = pieces.iter().map(|[w, s]| (w.1 + s.1) as u64).sum();
    assert_eq!(d.in_place_bytes + report.bounced_bytes, total, "{report:?}");
    for (e, &[w, _]) in pieces.iter().enumerate() {
        let place = store.slot_map(0).unwrap().pieces(e, Kind::Weights).unwrap()[0];
        let slot = store.weights(0, e).unwrap();
        let o = w.0 as usize;
        assert!(slot[place.offset..place.end()] == reference[o..o + w.1]);
    }
    println!("CHILD depth={}", d.blocking_depth);
}

/// Two packs at once on one store whose map budget has room for one loader's read
/// threads, not two: the first claims the room under the store's map lock when its
/// loader's pool is made, and keeps it until the loader is done; the second, checking
/// while the first is mid-fill (the first's progress hook holds it there until the second
/// has returned), is refused the read threads and reads one call at a time (depth 1)
/// instead of counting the same free slots as its own. Both byte-exact, neither fails.
/// Run as a child so that no other test's threads change the map count meanwhile.
#[test]
fn two_packs_at_once_do_not_both_take_the_room_for_read_threads() {
    let dir = dir("two-packs");
    let (_, len) = layout(24);
    let path = dir.join("model.bin");
    let bytes: Vec<u8> = (0..len).map(|i| ((i * 13 + i / 977) % 239) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let file = File::open(&path).unwrap();
    if !has_direct_io(&file) {
        println!("NOT RUN: the target directory's file system has no direct I/O");
        return;
    }
    let text = run_child("child_two_packs_in_one_room", &path, &[]);
    assert!(text.contains("CHILD second=1 "), "{text}");
}

/// Run by [`two_packs_at_once_do_not_both_take_the_room_for_read_threads`] only.
#[test]
#[ignore = "a child of two_packs_at_once_do_not_both_take_the_room_for_read_threads"]
fn child_two_packs_in_one_room() {
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::Duration;

    let Some(path) = std::env::var_os("READ_THREADS_FILE") else {
        return;
    };
    let file = File::open(&path).unwrap();
    // The reference: the file read back in one buffered read, not through numapin.
    let reference = std::fs::read(&path).unwrap();
    // 24 MiB and more: the first progress report (every PROGRESS_STEP = 16 MiB) comes
    // mid-fill, while the loader and its pool are alive.
    let (pieces, _) = layout(24);
    assert!(pieces.len() << 20 > numapin::store::PROGRESS_STEP as usize);
    let sources: Vec<ExpertSource<'_>> = pieces
        .iter()
        .map(|&[w, s]| ExpertSource::from_file(&file, &[w], &[s]))
        .collect();
    let spec = LayerSpec::fitting(&sources).unwrap();
    // 0: start; 1: layer 0 is mid-fill; 2: layer 1's pack has returned.
    let stage = Arc::new((Mutex::new(0u8), Condvar::new()));
    let seen = Arc::clone(&stage);
    let hook = numapin::store::ProgressHook::new(move |p| {
        if p.layer != 0 {
            return;
        }
        let (lock, changed) = &*seen;
        let mut now = lock.lock().unwrap();
        if *now == 0 {
            *now = 1;
            changed.notify_all();
            // Held mid-fill until the other pack is done (bounded: never a hang).
            let _ = changed
                .wait_timeout_while(now, Duration::from_secs(300), |s| *s < 2)
                .unwrap();
        }
    });
    // Room for the layers' regions, the loaders' bounce buffers, the first loader's
    // read threads (POOL_DEPTH - 1 of LOADER_THREAD_MAPS each) and what the first
    // thread and its joined read threads leave mapped (stack caches, arenas); not for a
    // second set of read threads on top of the first's claim.
    let pool_maps = (POOL_DEPTH - 1) * numapin::store::LOADER_THREAD_MAPS;
    let room = 2 * pool_maps + 16;
    let options = StoreOptions::default()
        .read_mode(ReadMode::Direct)
        .io_uring(false)
        .loader_threads(1)
        .piece_congruence(4096)
        .progress(Some(hook))
        .vma_budget(Some(numapin::diag::map_count().unwrap() + room));
    let store = PinStore::new(Layout::Unplaced, options).unwrap();
    let (first, second) = std::thread::scope(|scope| {
        let first = scope.spawn(|| store.pack_layer(0, &spec, &sources));
        let (lock, changed) = &*stage;
        let now = lock.lock().unwrap();
        let now = changed
            .wait_timeout_while(now, Duration::from_secs(300), |s| *s == 0)
            .unwrap()
            .0;
        assert_eq!(*now, 1, "layer 0 never reported mid-fill");
        drop(now);
        let second = store.pack_layer(1, &spec, &sources);
        *lock.lock().unwrap() = 2;
        changed.notify_all();
        (first.join().unwrap(), second)
    });
    let (first, second) = (first.unwrap(), second.unwrap());
    let total: u64 = pieces.iter().map(|[w, s]| (w.1 + s.1) as u64).sum();
    for (layer, report) in [(0, &first), (1, &second)] {
        assert_eq!(
            report.direct_io,
            Some(DirectIo::Threads(IoUringFallback::Off)),
            "{report:?}"
        );
        let d = report.direct_reads;
        assert_eq!((d.uring_reads, d.uring_depth), (0, 0), "{report:?}");
        assert!(d.blocking_reads >= 1, "{report:?}");
        assert_eq!(d.in_place_bytes + report.bounced_bytes, total, "{report:?}");
        let map = store.slot_map(layer).unwrap();
        for (e, &[w, s]) in pieces.iter().enumerate() {
            for (kind, (offset, n)) in [(Kind::Weights, w), (Kind::Scales, s)] {
                let place = map.pieces(e, kind).unwrap()[0];
                let slot = match kind {
                    Kind::Weights => store.weights(layer, e).unwrap(),
                    Kind::Scales => store.scales(layer, e).unwrap(),
                };
                let o = offset as usize;
                assert!(
                    slot[place.offset..place.end()] == reference[o..o + n],
                    "layer {layer} expert {e} {kind:?} differs from the file"
                );
            }
        }
    }
    // The first had the read threads (how many ran at once is the scheduler's); the
    // second, refused them, one call at a time.
    assert!((1..=POOL_DEPTH).contains(&first.direct_reads.blocking_depth));
    println!(
        "CHILD second={} first={} (blocking calls {} and {})",
        second.direct_reads.blocking_depth,
        first.direct_reads.blocking_depth,
        second.direct_reads.blocking_reads,
        first.direct_reads.blocking_reads
    );
}
