//! A loader thread's bounce buffer for direct reads, its `io_uring`, and the counts of
//! what its reads did (bytes in place, bytes bounced, calls per mechanism).

use crate::source::mode::DirectReads;
use crate::source::pool::Queue;

/// The bounce buffer of one loader thread for direct reads (at least two alignment
/// units): an unaligned 1 MiB expert takes one read, and a batch of small unaligned
/// slots one window.
const BOUNCE: usize = 8 << 20;

/// A loader thread's bounce buffer: `len` bytes aligned for direct I/O inside `buf`; and
/// its `io_uring`, when direct reads go through one.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(super) buf: Vec<u8>,
    /// Where the aligned buffer starts in `buf`.
    pub(super) start: usize,
    /// Bytes of the buffer (0: none, the thread reads no file directly).
    pub(super) len: usize,
    /// Its ring, or its pool of read threads: several reads in flight.
    pub(super) ring: Option<Queue>,
    /// Slot bytes copied out of `buf` so far (the bytes a direct read did not land in
    /// place).
    pub(super) bounced: u64,
    /// Slot bytes direct reads wrote in place so far.
    pub(super) in_place: u64,
    /// Blocking `pread`/`preadv` calls so far.
    pub(super) blocking: u64,
}

impl Scratch {
    pub(crate) fn new(mem_align: usize, offset_align: usize) -> Self {
        let len = BOUNCE.max(2 * offset_align).next_multiple_of(offset_align);
        let buf = vec![0u8; len + mem_align];
        let start = buf.as_ptr().align_offset(mem_align);
        Scratch {
            buf,
            start,
            len,
            ring: None,
            bounced: 0,
            in_place: 0,
            blocking: 0,
        }
    }

    /// Slot bytes this thread's direct reads copied out of the bounce buffer.
    pub(crate) fn bounced(&self) -> u64 {
        self.bounced
    }

    /// Whether direct reads keep several reads in flight (this thread's `io_uring` or
    /// its pool of read threads).
    pub(crate) fn has_ring(&self) -> bool {
        self.ring.is_some()
    }

    /// Whether direct reads go through this thread's `io_uring`.
    #[cfg(test)]
    pub(crate) fn has_io_uring(&self) -> bool {
        matches!(self.ring, Some(Queue::Ring(_)))
    }

    /// What this thread's direct reads did: bytes in place, ring requests and the most in
    /// flight at once, blocking calls (its own and its pool's) and the most in flight at
    /// once (1 for calls one at a time).
    pub(crate) fn counts(&self) -> DirectReads {
        let mut counts = DirectReads {
            in_place_bytes: self.in_place,
            blocking_reads: self.blocking,
            blocking_depth: usize::from(self.blocking > 0),
            ..DirectReads::default()
        };
        match &self.ring {
            Some(Queue::Ring(ring)) => {
                counts.uring_reads = ring.submitted;
                counts.uring_depth = ring.peak;
            }
            Some(Queue::Pool(pool)) => {
                counts.blocking_reads += pool.calls;
                counts.blocking_depth = counts.blocking_depth.max(pool.peak);
            }
            None => {}
        }
        counts
    }

    /// The same bounce buffer, with aligned reads issued through `queue`.
    pub(crate) fn with_ring(mut self, queue: Queue) -> Self {
        self.ring = Some(queue);
        self
    }

    /// The aligned buffer.
    pub(super) fn get(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}
