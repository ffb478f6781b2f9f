//! How direct reads are issued: through `io_uring` where this process may use it, on
//! blocking loader threads where `io_uring_setup` answers `EPERM` (Docker's default
//! profile, `kernel.io_uring_disabled`) or `ENOSYS`, and the load report says which, as
//! the environment promises (`NUMAPIN_EXPECT`, and an `io_uring_setup` of the test's own).
//! Both ways load byte-exact; a file truncated by someone else during the load, and
//! signals arriving while the loader waits, end in an error naming the file and the
//! offset, or in a complete load: never a `SIGBUS` or a hang.

#[path = "common/mod.rs"]
mod common;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use numapin::store::{
    DirectIo, IoUringFallback, Kind, Layout, PinStore, Progress, ProgressHook, ReadMode,
    StoreOptions,
};
use numapin_testkit::synthetic::SyntheticModel;

/// A directory of this test's own on the target directory's file system (not tmpfs:
/// tmpfs has no direct I/O).
fn dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("direct-io-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Whether the file system under `file` does direct I/O (statx reports an alignment).
/// Whether `file`'s file system takes direct reads (`statx` says its alignments).
fn has_direct_io(file: &File) -> bool {
    common::dio_align(file).is_some()
}

/// What `io_uring_setup` answers this test, asked directly (not through numapin): `Ok` or
/// the errno.
fn io_uring_setup_here() -> Result<(), i32> {
    // struct io_uring_params is 120 bytes; zeroed: no flags.
    let mut params = [0u32; 30];
    // SAFETY: io_uring_setup writes at most sizeof(struct io_uring_params) bytes into
    // `params`, which has exactly that size; the returned descriptor is closed below.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    // SAFETY: `fd` is the descriptor io_uring_setup just returned, owned by nobody else.
    drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) });
    Ok(())
}

/// What a direct load must report here. The environments of `cargo xtask test-container`
/// promise the errno through `NUMAPIN_EXPECT` (their seccomp filters answer
/// `io_uring_setup` with it); on the host and in the VM the test's own `io_uring_setup`
/// says it (the kernel's `kernel.io_uring_disabled` included).
fn expected_direct_io() -> DirectIo {
    let promised = match std::env::var("NUMAPIN_EXPECT").as_deref() {
        Ok("denied") | Ok("sys-nice") => Some(IoUringFallback::Denied),
        Ok("unsupported") => Some(IoUringFallback::Unsupported),
        _ => None,
    };
    let here = io_uring_setup_here();
    match promised {
        Some(why) => {
            let errno = if why == IoUringFallback::Denied {
                libc::EPERM
            } else {
                libc::ENOSYS
            };
            assert_eq!(
                here,
                Err(errno),
                "the environment's filter must answer {errno}"
            );
            DirectIo::Threads(why)
        }
        None => match here {
            Ok(()) => DirectIo::IoUring { depth: 32 },
            Err(libc::EPERM) => DirectIo::Threads(IoUringFallback::Denied),
            Err(libc::ENOSYS) => DirectIo::Threads(IoUringFallback::Unsupported),
            Err(errno) => panic!("io_uring_setup answered errno {errno}"),
        },
    }
}

fn options(io_uring: bool, threads: usize) -> StoreOptions {
    StoreOptions::default()
        .read_mode(ReadMode::Direct)
        .io_uring(io_uring)
        .loader_threads(threads)
}

/// Every slot of `store` compared with the bytes the model is defined to hold.
fn verify(store: &PinStore, model: &SyntheticModel, what: &str) {
    for layer in 0..model.layers {
        for e in 0..model.experts {
            for (kind, bytes) in [
                (Kind::Weights, store.weights(layer, e).unwrap()),
                (Kind::Scales, store.scales(layer, e).unwrap()),
            ] {
                assert!(
                    model.verify(layer, e, kind, bytes),
                    "{what}: layer {layer} expert {e} {kind:?} differs"
                );
            }
        }
    }
}

#[test]
fn the_report_says_io_uring_or_the_fallback_as_the_environment_promises() {
    let dir = dir("report");
    let model = SyntheticModel {
        layers: 2,
        experts: 8,
        weight_bytes: (1 << 20) + 4096,
        scale_bytes: 4096,
    };
    let path = dir.join("model.bin");
    model.write(&path).unwrap();
    let file = File::open(&path).unwrap();
    if !has_direct_io(&file) {
        println!("NOT RUN: the target directory's file system has no direct I/O");
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    }
    let expected = expected_direct_io();
    for (io_uring, want) in [
        (true, expected),
        (false, DirectIo::Threads(IoUringFallback::Off)),
    ] {
        let store = PinStore::new(Layout::Unplaced, options(io_uring, 2)).unwrap();
        for layer in 0..model.layers {
            let report = store
                .pack_layer(layer, &model.spec(), &model.sources(&file, layer))
                .unwrap();
            assert_eq!(report.read_mode, ReadMode::Direct);
            assert_eq!(report.direct_io, Some(want), "io_uring option {io_uring}");
            let text = want.to_string();
            match want {
                DirectIo::IoUring { .. } => assert!(text.starts_with("io_uring"), "{text}"),
                _ => assert!(text.contains("fallback"), "{text}"),
            }
        }
        verify(&store, &model, &format!("io_uring option {io_uring}"));
    }
    // Buffered reads issue no direct reads: nothing to say.
    let store = PinStore::new(
        Layout::Unplaced,
        options(true, 1).read_mode(ReadMode::Buffered),
    )
    .unwrap();
    let report = store
        .pack_layer(0, &model.spec(), &model.sources(&file, 0))
        .unwrap();
    assert_eq!(report.direct_io, None);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Unaligned slots (the bounce buffer's path) and slots larger than a ring request
/// (several requests in flight for one slot), with and without `io_uring`.
#[test]
fn both_ways_load_byte_exact() {
    let dir = dir("exact");
    let shapes = [
        (5, (9 << 20) + 4096, 8192),
        (7, (300 << 10) + 333, 4096 + 5),
        (40, 64 << 10, 4 << 10),
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
        if !has_direct_io(&file) {
            println!("NOT RUN: the target directory's file system has no direct I/O");
            break;
        }
        for io_uring in [true, false] {
            for threads in [1, 2] {
                let store = PinStore::new(Layout::Unplaced, options(io_uring, threads)).unwrap();
                for layer in 0..model.layers {
                    store
                        .pack_layer(layer, &model.spec(), &model.sources(&file, layer))
                        .unwrap();
                }
                let what = format!("{model:?}, io_uring {io_uring}, {threads} threads");
                verify(&store, &model, &what);
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Another process truncates the file while the layer loads (here: the progress hook, on
/// a loader thread, at the first report): the load fails with an error naming the file
/// and an offset past the new end, in every read mode and both ways of issuing direct
/// reads. Nothing maps the file, so there is no `SIGBUS`; nothing waits forever.
///
/// One loader thread, which the hook holds: the slots after the first report are read
/// only once the file is cut, so the load meets the new end by construction. With two,
/// the other loader went on while the hook ran, and on a loaded machine (a stress run:
/// 16 test threads, `drop_caches` every 0.2 s) it read the whole 96 MiB before the hook's
/// `set_len`: the load succeeded and the test failed.
#[test]
fn a_file_truncated_during_the_load_is_an_error_naming_the_file_and_offset() {
    let dir = dir("truncated");
    // 96 MiB in 2 MiB slots: the first progress report comes long before the end.
    let model = SyntheticModel {
        layers: 1,
        experts: 48,
        weight_bytes: 2 << 20,
        scale_bytes: 0,
    };
    let cut = 4u64 << 20;
    for (mode, io_uring) in [
        (ReadMode::Direct, true),
        (ReadMode::Direct, false),
        (ReadMode::Buffered, true),
        (ReadMode::DropBehind, true),
    ] {
        let path = dir.join("model.bin");
        model.write(&path).unwrap();
        let file = File::open(&path).unwrap();
        let truncated = Arc::new(AtomicBool::new(false));
        let hook = {
            let (path, truncated) = (path.clone(), truncated.clone());
            ProgressHook::new(move |_: &Progress| {
                if !truncated.swap(true, Ordering::SeqCst) {
                    let writer = File::options().write(true).open(&path).unwrap();
                    writer.set_len(cut).unwrap();
                }
            })
        };
        let mut options = options(io_uring, 1).read_mode(mode);
        options.progress = Some(hook);
        let store = PinStore::new(Layout::Unplaced, options).unwrap();
        let what = format!("{mode}, io_uring {io_uring}");
        let e = store
            .pack_layer(0, &model.spec(), &model.sources(&file, 0))
            .expect_err(&what);
        assert!(truncated.load(Ordering::SeqCst), "{what}: the hook ran");
        let text = e.to_string();
        assert!(text.contains(&path.display().to_string()), "{what}: {text}");
        let offset = text
            .split("file offset ")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("{what}: no file offset in {text}"));
        assert!(
            offset >= cut,
            "{what}: offset {offset} is before the cut: {text}"
        );
        // The layer is not packed; the store stays usable.
        assert!(store.weights(0, 0).is_err(), "{what}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

extern "C" fn ignore(_: libc::c_int) {}

/// Signals (without `SA_RESTART`) at the loading thread every 50 µs while it waits for
/// its reads: `EINTR` from the waits is asked again, and the load is complete and exact.
#[test]
fn signals_during_the_load_do_not_lose_reads() {
    let dir = dir("eintr");
    let model = SyntheticModel {
        layers: 2,
        experts: 16,
        weight_bytes: 1 << 20,
        scale_bytes: 4096,
    };
    let path = dir.join("model.bin");
    model.write(&path).unwrap();
    let file = File::open(&path).unwrap();
    // SAFETY: a zeroed sigaction with a handler that does nothing, no SA_RESTART (so
    // waits end with EINTR); SIGUSR2 is used by nothing else in this test binary.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = ignore as *const () as usize;
        assert_eq!(
            libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()),
            0
        );
    }
    // SAFETY: pthread_self has no preconditions.
    let me = unsafe { libc::pthread_self() };
    for io_uring in [true, false] {
        let done = Arc::new(AtomicBool::new(false));
        let signals = {
            let done = done.clone();
            std::thread::spawn(move || {
                let mut sent = 0u64;
                while !done.load(Ordering::SeqCst) {
                    // SAFETY: `me` is the test thread, alive until `done` is set and this
                    // thread joined.
                    unsafe { libc::pthread_kill(me, libc::SIGUSR2) };
                    sent += 1;
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                sent
            })
        };
        // One loader: the test thread itself, the one the signals hit.
        let store = PinStore::new(Layout::Unplaced, options(io_uring, 1)).unwrap();
        let result: Result<Vec<_>, _> = (0..model.layers)
            .map(|layer| store.pack_layer(layer, &model.spec(), &model.sources(&file, layer)))
            .collect();
        done.store(true, Ordering::SeqCst);
        let sent = signals.join().unwrap();
        result.unwrap();
        assert!(sent > 0);
        verify(&store, &model, &format!("signals, io_uring {io_uring}"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
