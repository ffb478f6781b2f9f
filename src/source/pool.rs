//! Direct reads with several requests in flight where `io_uring` cannot be used (a seccomp
//! profile denies `io_uring_setup`, the kernel has none, or the options turned it off): the
//! same requests a ring would take ([`Request`]), read with blocking `preadv` calls by the
//! calling loader thread and up to [`POOL_DEPTH`]` - 1` short-lived helper threads, so that
//! the device has up to [`POOL_DEPTH`] reads of each loader queued instead of one.
//!
//! The helpers are scoped to one [`Pool::read_all`] call: the buffers are `&mut [u8]`
//! borrows of the call, and no helper outlives it. Their `iovec` arrays are built by the
//! calling thread before they start, so a helper does not allocate on its way (no malloc
//! arena of its own); a helper that cannot be spawned leaves its share to the others.
//!
//! [`Queue`] is what a loader thread's [`Scratch`](super::direct::Scratch) holds: its ring,
//! or this pool.

use std::fs::File;
use std::io::IoSliceMut;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rustix::io::Errno;

pub use super::mode::POOL_DEPTH;
use super::uring::{Request, Ring};
use crate::error::{Error, Result};

/// Stack of a helper read thread: it only issues `preadv` calls (room to spare for a
/// panic message; only the pages it touches are ever backed).
const POOL_STACK: usize = 256 << 10;

/// Set to `off` (or `0`, `false`, `no`, in any case) to make every direct read of this process use blocking calls on
/// read threads ([`POOL_DEPTH`] in flight per loader) as where `io_uring` is denied: for
/// benchmarks and tests of that path. The load report then says
/// [`IoUringFallback::Environment`](crate::store::IoUringFallback::Environment).
pub const IO_URING_ENV: &str = "NUMAPIN_IO_URING";

/// Whether [`IO_URING_ENV`] turns `io_uring` off.
pub(crate) fn turned_off_by_env() -> bool {
    std::env::var_os(IO_URING_ENV).is_some_and(|v| means_off(&v))
}

/// `off`, `0`, `false` or `no`, in any case, around blanks.
fn means_off(value: &std::ffi::OsStr) -> bool {
    value.to_str().is_some_and(|v| {
        let v = v.trim();
        ["off", "0", "false", "no"]
            .iter()
            .any(|off| v.eq_ignore_ascii_case(off))
    })
}

/// Mappings a [`Pool`]'s read threads may add while they run: [`POOL_DEPTH`]` - 1`
/// threads, each counted as a loader thread (stack and guard, signal stack and guard,
/// malloc arena).
pub(crate) const POOL_MAPS: usize = (POOL_DEPTH - 1) * super::LOADER_THREAD_MAPS;

/// Map slots set aside for read threads that loaders may spawn at any moment of their
/// fill (each [`Pool::read_all`] spawns and joins its own), shared by a store's map
/// budget and its readers. The budget takes the set-aside slots as used
/// (`store::budget`), so that a check made while another load's read threads may run
/// does not count their room as free. A claim is taken under the store's map lock, right
/// after the check that there is room for it, and given back when the pool holding it
/// drops (its loader has finished and joined its threads): check and claim are one step.
///
/// While the read threads run, their mappings are in the process's map count as well as
/// set aside: counted twice, the budget errs on the side of refusing read threads (a
/// load then reads one call at a time), never of crossing the limit.
#[derive(Debug, Clone, Default)]
pub(crate) struct ThreadRoom(Arc<AtomicUsize>);

impl ThreadRoom {
    /// Map slots set aside now.
    pub(crate) fn held(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// Sets `maps` slots aside until the claim drops. The caller holds the store's map
    /// lock and has checked that they fit.
    pub(crate) fn claim(&self, maps: usize) -> Claim {
        self.0.fetch_add(maps, Ordering::AcqRel);
        Claim {
            room: Arc::clone(&self.0),
            maps,
        }
    }
}

/// Map slots set aside in a [`ThreadRoom`]; given back on drop.
#[derive(Debug)]
pub(crate) struct Claim {
    room: Arc<AtomicUsize>,
    maps: usize,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.room.fetch_sub(self.maps, Ordering::AcqRel);
    }
}

/// A loader thread's way of keeping several direct reads in flight.
pub(crate) enum Queue {
    /// Its own `io_uring` (boxed: a ring is large, and one per loader thread).
    Ring(Box<Ring>),
    /// Blocking `preadv` calls on a few threads.
    Pool(Pool),
}

impl Queue {
    /// The call an error names.
    pub(crate) fn op(&self) -> &'static str {
        match self {
            Queue::Ring(_) => "io_uring read",
            Queue::Pool(_) => "preadv",
        }
    }

    /// Reads every request as [`Ring::read_all`] does.
    ///
    /// # Errors
    /// As [`Ring::read_all`].
    pub(crate) fn read_all(
        &mut self,
        file: &File,
        requests: Vec<Request<'_>>,
        align: u64,
        failed: &dyn Fn(Errno, u64, usize) -> Error,
        eof: &dyn Fn(u64, usize) -> Error,
    ) -> Result<()> {
        match self {
            Queue::Ring(ring) => ring.read_all(file, requests, align, failed, eof),
            Queue::Pool(pool) => pool.read_all(file, requests, align, failed, eof),
        }
    }
}

/// Blocking reads of one loader thread, up to [`POOL_DEPTH`] in flight.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    /// `preadv` calls so far (a short read's rest included).
    pub(crate) calls: u64,
    /// The most calls in flight at once so far.
    pub(crate) peak: usize,
    /// The map slots its read threads were given, when the store counts them
    /// ([`ThreadRoom`]); held as long as the pool may spawn them.
    pub(crate) _claim: Option<Claim>,
}

/// Why a request could not be read in full, kept as plain data by the helpers (an
/// [`Error`] is made by the calling thread).
#[derive(Clone, Copy)]
enum Problem {
    Failed(Errno, u64, usize),
    Eof(u64, usize),
}

/// One request as the helpers take it: its iovecs, file offset and bytes needed.
struct Job<'d> {
    iovecs: Vec<IoSliceMut<'d>>,
    offset: u64,
    need: usize,
}

/// What the threads of one call share.
struct Shared<'d> {
    jobs: Mutex<Vec<Job<'d>>>,
    problem: Mutex<Option<Problem>>,
    stop: AtomicBool,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    calls: AtomicU64,
}

impl Pool {
    /// Reads every request from `file` (at least its `need` bytes) with up to
    /// [`POOL_DEPTH`] threads, the calling one included: a short read is read again for
    /// the rest when it stopped at a multiple of `align` (elsewhere it ended at the end of
    /// the file). Returns once every thread is done.
    ///
    /// # Errors
    /// A read failed (`failed(errno, offset, len)`) or the file ended before a request's
    /// `need` bytes (`eof(offset, len)`: what was missing); the first one seen.
    pub(crate) fn read_all(
        &mut self,
        file: &File,
        requests: Vec<Request<'_>>,
        align: u64,
        failed: &dyn Fn(Errno, u64, usize) -> Error,
        eof: &dyn Fn(u64, usize) -> Error,
    ) -> Result<()> {
        let align = align.max(1);
        let count = requests.len();
        // Taken from the end: reversed, the file is read forwards.
        let jobs: Vec<Job<'_>> = requests
            .into_iter()
            .rev()
            .map(|r| {
                let need = r.need.min(r.bufs.iter().map(|b| b.len()).sum());
                Job {
                    iovecs: r.bufs.into_iter().map(IoSliceMut::new).collect(),
                    offset: r.offset,
                    need,
                }
            })
            .collect();
        let shared = Shared {
            jobs: Mutex::new(jobs),
            problem: Mutex::new(None),
            stop: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            calls: AtomicU64::new(0),
        };
        let helpers = POOL_DEPTH
            .min(count)
            .saturating_sub(1)
            .min(crate::diag::threads_in_address_space());
        std::thread::scope(|scope| {
            for _ in 0..helpers {
                let shared = &shared;
                let spawned = std::thread::Builder::new()
                    .name("numapin-read".into())
                    .stack_size(POOL_STACK)
                    .spawn_scoped(scope, move || shared.work(file, align));
                if spawned.is_err() {
                    break;
                }
            }
            shared.work(file, align);
        });
        self.calls += shared.calls.into_inner();
        self.peak = self.peak.max(shared.peak.into_inner());
        match shared.problem.into_inner().ok().flatten() {
            None => Ok(()),
            Some(Problem::Failed(errno, offset, len)) => Err(failed(errno, offset, len)),
            Some(Problem::Eof(offset, len)) => Err(eof(offset, len)),
        }
    }
}

impl Shared<'_> {
    /// Takes requests until none is left or a read has failed.
    fn work(&self, file: &File, align: u64) {
        while !self.stop.load(Ordering::Relaxed) {
            let job = self.jobs.lock().ok().and_then(|mut jobs| jobs.pop());
            let Some(mut job) = job else { return };
            if let Err(problem) = self.read(file, align, &mut job) {
                self.stop.store(true, Ordering::Relaxed);
                if let Ok(mut slot) = self.problem.lock() {
                    slot.get_or_insert(problem);
                }
            }
        }
    }

    /// Reads one request: `preadv` until its `need` bytes are in.
    fn read(&self, file: &File, align: u64, job: &mut Job<'_>) -> std::result::Result<(), Problem> {
        let total: usize = job.iovecs.iter().map(|b| b.len()).sum();
        let (need, mut done) = (job.need, 0usize);
        let mut iovecs: &mut [IoSliceMut<'_>] = &mut job.iovecs;
        while done < need {
            let at = job.offset + done as u64;
            let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
            self.peak.fetch_max(now, Ordering::Relaxed);
            self.calls.fetch_add(1, Ordering::Relaxed);
            let got = loop {
                match rustix::io::preadv(file, iovecs, at) {
                    Err(Errno::INTR | Errno::AGAIN) => continue,
                    other => break other,
                }
            };
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            let got = got.map_err(|errno| Problem::Failed(errno, at, total - done))?;
            done += got;
            if done >= need {
                break;
            }
            // Nothing more, or a stop off the alignment: the file ended there.
            if got == 0 || !(job.offset + done as u64).is_multiple_of(align) {
                return Err(Problem::Eof(job.offset + done as u64, need - done));
            }
            IoSliceMut::advance_slices(&mut iovecs, got);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_means_off_in_any_case_and_nothing_else_does() {
        for v in ["off", "OFF", "Off", "0", "false", "FALSE", "no", " off\n"] {
            assert!(means_off(std::ffi::OsStr::new(v)), "{v:?}");
        }
        for v in ["", "on", "1", "true", "yes", "of", "offf", "disable"] {
            assert!(!means_off(std::ffi::OsStr::new(v)), "{v:?}");
        }
    }

    #[test]
    fn a_claim_is_set_aside_until_it_drops_and_clones_share_it() {
        let room = ThreadRoom::default();
        let seen = room.clone();
        let a = room.claim(POOL_MAPS);
        let b = seen.claim(5);
        assert_eq!((room.held(), seen.held()), (POOL_MAPS + 5, POOL_MAPS + 5));
        drop(a);
        assert_eq!(seen.held(), 5);
        let pool = Pool {
            _claim: Some(b),
            ..Pool::default()
        };
        assert_eq!(room.held(), 5);
        drop(pool);
        assert_eq!(room.held(), 0);
    }

    fn file_of(name: &str, len: usize) -> (std::path::PathBuf, File, Vec<u8>) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target")
            .join(format!("pool-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
        std::fs::write(dir.join("f"), &bytes).unwrap();
        let file = File::open(dir.join("f")).unwrap();
        (dir, file, bytes)
    }

    fn failed(errno: Errno, offset: u64, len: usize) -> Error {
        Error::os("preadv", errno, format_args!("offset={offset} len={len}"))
    }

    fn eof(offset: u64, len: usize) -> Error {
        Error::invalid(
            "t",
            format!("end of the file at file offset {offset} ({len} missing)"),
        )
    }

    #[test]
    fn many_requests_read_exact_with_several_in_flight_calls() {
        let len = 3 << 20;
        let (dir, file, bytes) = file_of("exact", len);
        let mut dest = vec![0u8; len];
        // 48 requests of 64 KiB, each over two buffers of unequal length.
        let requests: Vec<Request<'_>> = dest
            .chunks_mut(64 << 10)
            .enumerate()
            .map(|(i, chunk)| {
                let (a, b) = chunk.split_at_mut(1000 + i);
                Request::full((i * (64 << 10)) as u64, vec![a, b])
            })
            .collect();
        let mut pool = Pool::default();
        pool.read_all(&file, requests, 1, &failed, &eof).unwrap();
        assert!(dest == bytes);
        // One call a request (a regular file on disk reads each in full), several at once
        // at most POOL_DEPTH.
        assert_eq!(pool.calls, 48);
        assert!((1..=POOL_DEPTH).contains(&pool.peak), "{}", pool.peak);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_request_past_the_end_is_an_error_and_what_may_lie_past_it_is_not() {
        let len = 10_000;
        let (dir, file, bytes) = file_of("eof", len);
        let mut dest = vec![0u8; 8192];
        let (a, b) = dest.split_at_mut(4096);
        // The second request needs only its first 1808 bytes (the file's last ones).
        let mut tail = Request::full(8192, vec![b]);
        tail.need = len - 8192;
        let mut pool = Pool::default();
        pool.read_all(
            &file,
            vec![Request::full(0, vec![a]), tail],
            4096,
            &failed,
            &eof,
        )
        .unwrap();
        assert!(dest[..4096] == bytes[..4096]);
        assert!(dest[4096..4096 + 1808] == bytes[8192..]);
        let mut past = vec![0u8; 4096];
        let e = pool
            .read_all(
                &file,
                vec![Request::full(8192, vec![&mut past[..]])],
                4096,
                &failed,
                &eof,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("at file offset 10000"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
