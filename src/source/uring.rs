//! Direct reads with several requests in flight: one `io_uring` per loader thread, through
//! tokio-rs's `io-uring` crate (it keeps the ring setup, the mmap offsets and the memory
//! ordering of the ring heads; the crate makes the raw syscalls itself, as rustix does).
//!
//! A device reads large requests fast, and a queue of them faster than one at a time: a
//! blocking `pread` leaves the device idle while the loader faults the next slot's pages in
//! and issues the next read. With [`DEPTH`] reads in flight the page faults of one request
//! overlap the transfers of the others.
//!
//! `io_uring_setup` is probed once per process ([`probe`]): `EPERM` (Docker's default
//! seccomp profile since Docker 25, `kernel.io_uring_disabled`) and `ENOSYS` make the
//! loaders read with blocking calls, and the load report says so
//! ([`DirectIo::Threads`](super::mode::DirectIo::Threads)); any other errno is an error.
//!
//! # Safety
//! A submitted read writes into its buffer until its completion is reaped, whatever the
//! caller does meanwhile. [`Ring::read_all`] therefore takes the buffers as `&mut [u8]`
//! borrows for its whole call and never returns while a read is in flight: after an error
//! it stops submitting and reaps what is in flight first. The ring is owned by one loader
//! thread (`Ring` is `Send`, never shared).
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use io_uring::{IoUring, opcode, types};

use super::mode::IoUringFallback;
use crate::error::{Errno, Error, Result};

/// Reads in flight per loader thread, at most (the ring's submission entries; the
/// completion queue has twice as many, so it cannot overflow).
pub(crate) const DEPTH: usize = 32;

/// The longest single read a ring issues (the disk here takes requests of up to 4 MiB,
/// `max_sectors_kb`): consecutive slots are read together up to this, and a slot larger
/// than this is read as several requests in flight at once.
pub(crate) const CHUNK: usize = 4 << 20;

/// Mappings one ring adds while it lives: the submission ring, its entries, and the
/// completion ring (one mapping fewer where the kernel maps both rings at once).
pub(crate) const RING_MAPS: usize = 3;

/// What `io_uring_setup` answered when this process first asked: usable, a reason to fall
/// back, or another errno.
static PROBED: OnceLock<std::result::Result<(), Errno>> = OnceLock::new();

/// Whether this process may use `io_uring`: probed once with a one-entry ring.
///
/// # Errors
/// `io_uring_setup` failed with an errno other than `EPERM` or `ENOSYS`.
pub(crate) fn probe() -> Result<std::result::Result<(), IoUringFallback>> {
    let answer = *PROBED.get_or_init(|| IoUring::new(1).map(drop).map_err(errno_of));
    match answer {
        Ok(()) => Ok(Ok(())),
        Err(errno) => fallback_or_error(errno, 1).map(Err),
    }
}

fn errno_of(e: std::io::Error) -> Errno {
    Errno::from_io_error(&e).unwrap_or(Errno::IO)
}

/// The one degrade rule, for `io_uring_setup`: `EPERM` and `ENOSYS` fall back, the rest
/// is an error.
fn fallback_or_error(errno: Errno, entries: usize) -> Result<IoUringFallback> {
    match errno {
        Errno::PERM => Ok(IoUringFallback::Denied),
        Errno::NOSYS => Ok(IoUringFallback::Unsupported),
        errno => Err(Error::os(
            "io_uring_setup",
            errno,
            format_args!("entries={entries} flags=0"),
        )),
    }
}

/// Buffers per request, at most (a request is one `IORING_OP_READV`).
pub(crate) const MAX_BUFS: usize = 64;

/// One read: the buffers filled in order from the file at `offset` (one contiguous range
/// of the file; the buffers are slots of two regions, weights and scales, for example).
pub(crate) struct Request<'d> {
    pub(crate) offset: u64,
    pub(crate) bufs: Vec<&'d mut [u8]>,
    /// The bytes that must be read (the rest may lie past the end of the file: the
    /// partial alignment unit at a piece's end, read whole into a bounce buffer).
    pub(crate) need: usize,
}

impl<'d> Request<'d> {
    /// A request that must be read in full.
    pub(crate) fn full(offset: u64, bufs: Vec<&'d mut [u8]>) -> Self {
        let need = bufs.iter().map(|b| b.len()).sum();
        Request { offset, bufs, need }
    }

    fn len(&self) -> usize {
        self.bufs.iter().map(|b| b.len()).sum()
    }

    /// The rest of the request once its first `done` bytes are read.
    fn advance(self, mut done: usize) -> Request<'d> {
        let offset = self.offset + done as u64;
        let mut bufs = Vec::with_capacity(self.bufs.len());
        for buf in self.bufs {
            if done >= buf.len() {
                done -= buf.len();
            } else {
                bufs.push(&mut buf[done..]);
                done = 0;
            }
        }
        Request {
            offset,
            bufs,
            need: self.need.saturating_sub(done),
        }
    }
}

/// What one completion means for its request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Read in full.
    Done,
    /// Not yet in full: submit it again from `done` bytes on (a short read, `EINTR`,
    /// `EAGAIN`).
    Again { done: usize },
    /// The file ended `done` bytes into the request.
    Eof { done: usize },
    /// The kernel cancelled the read (`ECANCELED`) though nothing here asked it to: a
    /// read handed to the ring's worker threads can end so while signals arrive (seen
    /// in a user namespace under a signal storm). Submitted again, a bounded number of
    /// times ([`MAX_CANCELED`]).
    Canceled,
    /// The read failed.
    Failed(Errno),
}

/// The meaning of completion result `res` for a request of `len` bytes.
pub(crate) fn settle(res: i32, len: usize) -> Settled {
    match usize::try_from(res) {
        Ok(0) if len > 0 => Settled::Eof { done: 0 },
        Ok(n) if n >= len => Settled::Done,
        Ok(n) => Settled::Again { done: n },
        Err(_) => {
            // The kernel answers -errno, 1..=4095; anything else is not an errno at all.
            let raw = res.saturating_neg();
            let errno = if (1..4096).contains(&raw) {
                Errno::from_raw_os_error(raw)
            } else {
                Errno::IO
            };
            match errno {
                Errno::INTR | Errno::AGAIN => Settled::Again { done: 0 },
                Errno::CANCELED => Settled::Canceled,
                errno => Settled::Failed(errno),
            }
        }
    }
}

/// Reads of one call submitted again after `ECANCELED` before the call fails with it:
/// a guard against a ring that cancels everything, far above what a signal storm causes.
pub(crate) const MAX_CANCELED: usize = 1 << 16;

/// A loader thread's ring.
pub(crate) struct Ring {
    ring: IoUring,
    /// Requests submitted so far (resubmissions included).
    pub(crate) submitted: u64,
    /// The most requests in flight at once so far.
    pub(crate) peak: usize,
}

impl Ring {
    /// A ring of [`DEPTH`] entries, or the reason to read with blocking calls.
    ///
    /// # Errors
    /// `io_uring_setup` failed with an errno other than `EPERM` or `ENOSYS`.
    pub(crate) fn new() -> Result<std::result::Result<Ring, IoUringFallback>> {
        match IoUring::builder()
            .setup_cqsize(2 * DEPTH as u32)
            .build(DEPTH as u32)
        {
            Ok(ring) => Ok(Ok(Ring {
                ring,
                submitted: 0,
                peak: 0,
            })),
            Err(e) => fallback_or_error(errno_of(e), DEPTH).map(Err),
        }
    }

    /// Reads every request from `file` (at least its `need` bytes), at most [`DEPTH`] in
    /// flight; a short read is submitted again for the rest, from where it stopped when
    /// that is a multiple of `align` (the direct-I/O offset alignment; a read that ended
    /// elsewhere ended at the end of the file). Returns only once nothing is in flight.
    ///
    /// # Errors
    /// A read failed (`failed(errno, offset, len)` makes the error) or the file ended
    /// before a request was read in full (`eof(offset, len)`: what was missing); the first
    /// error is returned after every read in flight has completed.
    pub(crate) fn read_all(
        &mut self,
        file: &File,
        requests: Vec<Request<'_>>,
        align: u64,
        failed: &dyn Fn(Errno, u64, usize) -> Error,
        eof: &dyn Fn(u64, usize) -> Error,
    ) -> Result<()> {
        let align = align.max(1);
        let fd = types::Fd(file.as_raw_fd());
        // Taken from the end: reverse so that the file is read forwards.
        let mut pending: Vec<Request<'_>> = requests.into_iter().rev().collect();
        // Each request in flight with its iovecs, which the kernel reads until it completes.
        let mut flight: Vec<Option<(Request<'_>, Vec<libc::iovec>)>> =
            (0..DEPTH).map(|_| None).collect();
        let mut free: Vec<usize> = (0..DEPTH).rev().collect();
        let mut in_flight = 0usize;
        let mut first_error: Option<Error> = None;
        let mut canceled = 0usize;
        loop {
            // One request at a time: fault its pages in, then submit it, so that the
            // faults of the next request overlap the transfers of those in flight.
            let room = first_error.is_none() && !free.is_empty();
            if let Some(mut request) = room.then(|| pending.pop()).flatten() {
                let slot = free.pop().unwrap_or_default();
                let iovecs = prefaulted_iovecs(&mut request);
                let count = u32::try_from(iovecs.len()).unwrap_or(u32::MAX);
                let entry = opcode::Readv::new(fd, iovecs.as_ptr(), count)
                    .offset(request.offset)
                    .build()
                    .user_data(slot as u64);
                // SAFETY: the buffers are live `&mut [u8]` borrowed for this whole call;
                // they and their iovecs (a heap array that does not move with the Vec) are
                // kept in `flight[slot]` until the completion is reaped, and this function
                // does not return while any read is in flight (module docs).
                if unsafe { self.ring.submission().push(&entry) }.is_err() {
                    pending.push(request);
                    free.push(slot);
                    self.wait_one();
                } else {
                    flight[slot] = Some((request, iovecs));
                    in_flight += 1;
                    self.submitted += 1;
                    self.peak = self.peak.max(in_flight);
                    self.submit();
                }
            } else if in_flight == 0 {
                break;
            } else {
                self.wait_one();
            }
            let completions: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result()))
                .collect();
            for (slot, res) in completions {
                let Some((request, _iovecs)) = usize::try_from(slot)
                    .ok()
                    .and_then(|s| flight.get_mut(s))
                    .and_then(Option::take)
                else {
                    continue;
                };
                free.push(slot as usize);
                in_flight -= 1;
                let len = request.need.min(request.len());
                match settle(res, len) {
                    Settled::Done => {}
                    Settled::Again { done }
                        if !(request.offset + done as u64).is_multiple_of(align) =>
                    {
                        let at = request.offset + done as u64;
                        first_error.get_or_insert_with(|| eof(at, len - done));
                    }
                    Settled::Again { done } => pending.push(request.advance(done)),
                    Settled::Canceled if canceled < MAX_CANCELED => {
                        canceled += 1;
                        pending.push(request);
                    }
                    Settled::Canceled => {
                        first_error
                            .get_or_insert_with(|| failed(Errno::CANCELED, request.offset, len));
                    }
                    Settled::Eof { done } => {
                        let at = request.offset + done as u64;
                        first_error.get_or_insert_with(|| eof(at, len - done));
                    }
                    Settled::Failed(errno) => {
                        first_error.get_or_insert_with(|| failed(errno, request.offset, len));
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Submits what is queued without waiting. An error leaves the entries queued, and
    /// [`Ring::wait_one`] submits them again.
    fn submit(&mut self) {
        let _ = self.ring.submit();
    }

    /// Submits what is queued and waits for at least one completion. `EINTR`, `EAGAIN`
    /// and `EBUSY` are asked again (the completions reaped by the caller make room).
    fn wait_one(&mut self) {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => return,
                Err(e) => match errno_of(e) {
                    Errno::INTR | Errno::AGAIN | Errno::BUSY => {
                        if !self.ring.completion().is_empty() {
                            return;
                        }
                    }
                    // Any other errno from io_uring_enter (EBADF, EFAULT, EINVAL) means the
                    // ring itself is broken while reads may still be writing into the
                    // caller's buffers: returning would hand those buffers back under a
                    // live write. Nothing in the input can cause this; stop the process.
                    _ => std::process::abort(),
                },
            }
        }
    }
}

/// Faults the whole pages of `buf` in, writable (`MADV_POPULATE_WRITE`), under the
/// mapping's policy, before a read into it is submitted. Otherwise the read faults them
/// itself: inline submission cannot (it must not block), so the read is handed to one of
/// the kernel's worker threads, which fault them one request at a time (measured here:
/// 0.17 GB/s instead of 1.2). The bytes are not changed. An error is ignored on purpose:
/// the read faults whatever is still missing (a kernel before 5.14 answers `EINVAL`).
/// The request's buffers as iovecs, each buffer's pages faulted in first (so that the
/// faults of the next request overlap the transfers of those in flight).
fn prefaulted_iovecs(request: &mut Request<'_>) -> Vec<libc::iovec> {
    request
        .bufs
        .iter_mut()
        .map(|buf| {
            prefault(buf);
            libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            }
        })
        .collect()
}

fn prefault(buf: &mut [u8]) {
    let page = crate::page::page_size();
    let start = (buf.as_mut_ptr() as usize).next_multiple_of(page);
    let end = (buf.as_mut_ptr() as usize + buf.len()) / page * page;
    if end > start {
        // SAFETY: the range lies inside `buf`, which the caller holds as `&mut`;
        // MADV_POPULATE_WRITE faults pages in without changing their contents.
        let _ = unsafe {
            numapin_sys::madvise(
                start as *mut std::ffi::c_void,
                end - start,
                numapin_sys::MADV_POPULATE_WRITE,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_read_leaves_the_rest_of_the_buffers() {
        let (mut a, mut b, mut c) = ([0u8; 10], [0u8; 20], [0u8; 5]);
        let request = Request::full(100, vec![&mut a[..], &mut b[..], &mut c[..]]);
        assert_eq!(request.len(), 35);
        let rest = request.advance(15);
        assert_eq!(rest.offset, 115);
        assert_eq!(
            rest.bufs.iter().map(|b| b.len()).collect::<Vec<_>>(),
            [15, 5]
        );
        let rest = rest.advance(15);
        assert_eq!((rest.offset, rest.len()), (130, 5));
        assert!(rest.advance(5).bufs.is_empty());
    }

    #[test]
    fn completions_settle_as_the_kernel_means_them() {
        assert_eq!(settle(4096, 4096), Settled::Done);
        assert_eq!(settle(1000, 4096), Settled::Again { done: 1000 });
        assert_eq!(settle(0, 4096), Settled::Eof { done: 0 });
        assert_eq!(settle(-libc::EINTR, 4096), Settled::Again { done: 0 });
        assert_eq!(settle(-libc::EAGAIN, 4096), Settled::Again { done: 0 });
        assert_eq!(settle(-libc::ECANCELED, 4096), Settled::Canceled);
        assert_eq!(settle(-libc::EIO, 4096), Settled::Failed(Errno::IO));
        assert_eq!(settle(-libc::EINVAL, 4096), Settled::Failed(Errno::INVAL));
        assert_eq!(settle(i32::MIN, 4096), Settled::Failed(Errno::IO));
        assert_eq!(settle(-5000, 4096), Settled::Failed(Errno::IO));
    }
}
