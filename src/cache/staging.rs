//! `StagingPool`: a fixed number of page-aligned buffers of one size in one region,
//! allocated once and recycled. Transient data (a GPU upload, a decompression) earns no
//! memory policy: the pool binds nothing unless asked to ([`StagingPool::bound`]), and
//! its mappings stay the same however many buffers pass through it.

use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::node::{Node, NodeSet};
use crate::page::page_size;
use crate::policy::{MbindFlags, MemPolicy, Placement};
use crate::region::Region;

/// Reusable page-aligned buffers for data read once and handed elsewhere: never bound
/// unless asked ([`StagingPool::bound`]), allocated once, recycled; the mappings stay the
/// same however many buffers pass through.
///
/// # Example
/// ```
/// use numapin::cache::StagingPool;
/// let pool = StagingPool::new(2, 10_000)?;
/// let mut a = pool.take().expect("a free buffer");
/// a.as_mut_slice()[..5].copy_from_slice(b"hello");
/// let b = pool.take().expect("a second one");
/// assert!(pool.take().is_none(), "both are out");
/// drop(a); // back to the pool
/// assert!(pool.take().is_some());
/// # drop(b);
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug)]
pub struct StagingPool {
    region: Region,
    buffers: usize,
    buffer_bytes: usize,
    stride: usize,
    placement: Option<Placement>,
    free: Mutex<Vec<usize>>,
    returned: Condvar,
}

/// A buffer taken from a [`StagingPool`], given back when dropped. Its bytes are whatever
/// the previous user left (zero the first time).
#[derive(Debug)]
pub struct Staging<'a> {
    pool: &'a StagingPool,
    index: usize,
    bytes: &'a mut [u8],
}

impl StagingPool {
    /// `buffers` buffers of `buffer_bytes` each (the stride rounded up to the page), in one
    /// unbound anonymous region.
    ///
    /// # Errors
    /// 0 buffers or 0 bytes, sizes that overflow, or `mmap` fails.
    pub fn new(buffers: usize, buffer_bytes: usize) -> Result<StagingPool> {
        Self::build(buffers, buffer_bytes, None)
    }

    /// [`StagingPool::new`] with the region bound to `node` (`MPOL_BIND`, before first
    /// touch): staging next to the device that reads it. [`StagingPool::placement`] says
    /// whether the bind took (`Degraded` where `mbind` is denied: the pool works
    /// unplaced).
    ///
    /// # Errors
    /// As [`StagingPool::new`]; a node this machine cannot have, or one this process may
    /// not allocate on ([`Error::NodeNotAllowed`]), checked before the call in every
    /// environment; or `mbind` fails with an errno other than `EPERM`/`ENOSYS`.
    pub fn bound(buffers: usize, buffer_bytes: usize, node: Node) -> Result<StagingPool> {
        Self::build(buffers, buffer_bytes, Some(node))
    }

    fn build(buffers: usize, buffer_bytes: usize, node: Option<Node>) -> Result<StagingPool> {
        const OP: &str = "StagingPool::new";
        if buffers == 0 || buffer_bytes == 0 {
            return Err(Error::empty(
                OP,
                format!(
                    "buffers or no buffer bytes ({buffers} buffers of {buffer_bytes} bytes): \
                     both must be at least 1"
                ),
            ));
        }
        let stride = buffer_bytes
            .checked_next_multiple_of(page_size())
            .ok_or_else(|| Error::overflow(OP, format!("{buffer_bytes} bytes rounded to pages")))?;
        let len = stride
            .checked_mul(buffers)
            .ok_or_else(|| Error::overflow(OP, format!("{buffers} buffers × stride {stride}")))?;
        let region = Region::anonymous(len)?;
        let placement = match node {
            Some(node) => {
                // The node itself first: a `NodeSet` cannot hold an id past MAX_NODES, and
                // the empty set left would be refused as an empty policy.
                crate::policy::check_exist(OP, "node", [node])?;
                let mut set = NodeSet::new();
                set.insert(node);
                Some(region.bind(&MemPolicy::Bind(set), MbindFlags::empty())?)
            }
            None => None,
        };
        Ok(StagingPool {
            region,
            buffers,
            buffer_bytes,
            stride,
            placement,
            free: Mutex::new((0..buffers).rev().collect()),
            returned: Condvar::new(),
        })
    }

    /// Buffers in the pool.
    pub fn buffers(&self) -> usize {
        self.buffers
    }

    /// Bytes of each buffer.
    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// `None` for an unbound pool; the bind's outcome for [`StagingPool::bound`].
    pub fn placement(&self) -> Option<Placement> {
        self.placement
    }

    /// The pool's region as a `[start, end)` address span.
    pub fn span(&self) -> (usize, usize) {
        let start = self.region.as_ptr() as usize;
        (start, start + self.region.len())
    }

    /// Buffers free now.
    pub fn available(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<usize>> {
        // The free list is a Vec of indices, consistent after every push and pop.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A free buffer, or `None` when all are taken.
    pub fn take(&self) -> Option<Staging<'_>> {
        let index = self.lock().pop()?;
        Some(self.hand_out(index))
    }

    /// A free buffer, waiting for one to be returned as long as it takes.
    pub fn take_wait(&self) -> Staging<'_> {
        let mut free = self.lock();
        loop {
            if let Some(index) = free.pop() {
                drop(free);
                return self.hand_out(index);
            }
            free = self.returned.wait(free).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// A free buffer, waiting at most `timeout` for one to be returned.
    pub fn take_timeout(&self, timeout: Duration) -> Option<Staging<'_>> {
        let deadline = Instant::now().checked_add(timeout);
        let mut free = self.lock();
        loop {
            if let Some(index) = free.pop() {
                drop(free);
                return Some(self.hand_out(index));
            }
            let left = match deadline {
                Some(deadline) => deadline.checked_duration_since(Instant::now())?,
                None => Duration::MAX,
            };
            free = self
                .returned
                .wait_timeout(free, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn range(&self, index: usize) -> Range<usize> {
        index * self.stride..index * self.stride + self.buffer_bytes
    }

    fn hand_out(&self, index: usize) -> Staging<'_> {
        // SAFETY: `index` just left the free list under its lock, and goes back only when
        // this Staging drops: no other reference to its range exists while `bytes` lives.
        // The pool never makes a slice of the whole region.
        let bytes =
            unsafe { self.region.slot_mut_unchecked(self.range(index)) }.unwrap_or_default();
        Staging {
            pool: self,
            index,
            bytes,
        }
    }
}

impl Staging<'_> {
    /// The buffer.
    pub fn as_slice(&self) -> &[u8] {
        self.bytes
    }

    /// The buffer, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.bytes
    }

    /// The buffer's index in its pool.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        self.pool.lock().push(self.index);
        self.pool.returned.notify_one();
    }
}
