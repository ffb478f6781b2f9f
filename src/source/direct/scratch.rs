//! A loader thread's bounce buffer for direct reads, its `io_uring`, and the counts of
//! what its reads did (bytes in place, bytes bounced, calls per mechanism).

use crate::source::uring::Ring;

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
    pub(super) ring: Option<Ring>,
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

    /// Whether direct reads go through this thread's `io_uring`.
    pub(crate) fn has_ring(&self) -> bool {
        self.ring.is_some()
    }

    /// What this thread's direct reads did: (bytes in place, blocking calls, ring
    /// requests, the most ring requests in flight at once).
    pub(crate) fn counts(&self) -> (u64, u64, u64, usize) {
        let (submitted, peak) = self.ring.as_ref().map_or((0, 0), |r| (r.submitted, r.peak));
        (self.in_place, self.blocking, submitted, peak)
    }

    /// The same bounce buffer, with aligned reads submitted through `ring`.
    pub(crate) fn with_ring(mut self, ring: Ring) -> Self {
        self.ring = Some(ring);
        self
    }

    /// The aligned buffer.
    pub(super) fn get(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}
