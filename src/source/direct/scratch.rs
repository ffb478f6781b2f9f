//! A loader thread's bounce buffer for direct reads, its `io_uring`, and the counts of
//! what its reads did (bytes in place, bytes bounced, calls per mechanism).

use crate::region::Region;
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
    pub(super) buf: Bounce,
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
    /// A bounce buffer of 8 MiB (or two `offset_align` units), at a multiple of
    /// `mem_align`.
    ///
    /// # Errors
    /// Neither a mapping nor the heap has room for it (a tight `RLIMIT_AS`): the
    /// mapping's error, naming the call and the length.
    pub(crate) fn new(mem_align: usize, offset_align: usize) -> crate::error::Result<Self> {
        let len = BOUNCE.max(2 * offset_align).next_multiple_of(offset_align);
        let buf = Bounce::new(len + mem_align)?;
        let start = buf.as_ptr().align_offset(mem_align);
        Ok(Scratch {
            buf,
            start,
            len,
            ring: None,
            bounced: 0,
            in_place: 0,
            blocking: 0,
        })
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

/// A bounce buffer's memory: a private anonymous mapping of its own ([`Region`]),
/// unmapped when the loader drops it (a heap allocation where the mapping is refused).
/// Not malloc's: once a process has freed a large mapped block, glibc raises its mmap
/// threshold above 8 MiB and serves such a buffer from the loader thread's arena, whose
/// freed top then stays resident after the load (docs/benchmarks.md, "Per-rank memory
/// under torchrun"). Either way one mapping, as the store's map budget counts it.
#[derive(Default)]
pub(crate) enum Bounce {
    /// No buffer (the thread reads no file directly).
    #[default]
    None,
    /// Its own mapping.
    Mapped(Region),
    /// On the heap: the mapping was refused.
    Heap(Vec<u8>),
}

impl Bounce {
    /// `len` zeroed bytes (`len` > 0).
    ///
    /// # Errors
    /// The mapping was refused and the heap has no room either: the mapping's error (an
    /// allocation that fails must not abort the process, as `vec!` would).
    fn new(len: usize) -> crate::error::Result<Self> {
        match Region::anonymous(len) {
            Ok(region) => Ok(Bounce::Mapped(region)),
            Err(e) => {
                let mut heap = Vec::new();
                if heap.try_reserve_exact(len).is_err() {
                    return Err(e);
                }
                heap.resize(len, 0);
                Ok(Bounce::Heap(heap))
            }
        }
    }
}

impl std::ops::Deref for Bounce {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bounce::None => &[],
            Bounce::Mapped(region) => region.as_slice(),
            Bounce::Heap(v) => v,
        }
    }
}

impl std::ops::DerefMut for Bounce {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Bounce::None => &mut [],
            // Never read-only (nothing protects it): writable.
            Bounce::Mapped(region) => region.as_mut_slice().unwrap_or_default(),
            Bounce::Heap(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buffer is a mapping of its own (the kernel's list of mappings,
    /// /proc/self/maps: one mapping whose span holds the buffer), page-aligned and
    /// zeroed; not a heap block.
    #[test]
    fn the_bounce_buffer_is_a_mapping_of_its_own() {
        let mut scratch = Scratch::new(4096, 4096).unwrap();
        assert!(matches!(scratch.buf, Bounce::Mapped(_)));
        let bounce = scratch.get();
        assert!(bounce.len() >= BOUNCE);
        assert!(bounce.iter().all(|&b| b == 0));
        bounce[0] = 1;
        let (at, len) = (bounce.as_ptr() as usize, bounce.len());
        assert_eq!(at % 4096, 0);
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let holder = maps
            .lines()
            .find(|l| {
                let (a, b) = l
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .split_once('-')
                    .unwrap();
                let a = usize::from_str_radix(a, 16).unwrap();
                let b = usize::from_str_radix(b, 16).unwrap();
                a <= at && at + len <= b
            })
            .expect("a mapping holds the bounce buffer");
        // Anonymous (no path, not the heap).
        assert_eq!(holder.split_whitespace().count(), 5, "{holder}");
        assert_eq!(scratch.get()[0], 1);
    }
}
