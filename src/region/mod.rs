//! `Region`: an owned, page-aligned mapping that can be bound, populated, locked,
//! released and inspected.
//!
//! # Safety
//!
//! This module owns mappings: it creates them with `mmap`, hands out slices only for the
//! mapped length, and unmaps them exactly once on drop. Calls that can change contents
//! (`MADV_DONTNEED`, the page-touch fallback) take `&mut self`, so no slice handed out
//! by `&self` can observe them.
//!
//! Memory that another party can change is kept out of safe code: a shared file mapping
//! is made only by the `unsafe` [`Region::map_file`], the file behind a memfd region is
//! reached only through the `unsafe` [`Region::memfd_file`], and a memfd from elsewhere
//! is attached only once the kernel guarantees it immutable (`F_SEAL_WRITE |
//! F_SEAL_SHRINK | F_SEAL_GROW`, checked with `F_GET_SEALS`) and mapped private and
//! read-only.
#![allow(unsafe_code)]

mod advise;
mod bind;
mod lock;
mod map;
mod name;
mod pages;
mod protect;
mod shmem;

pub use advise::Advice;
pub use bind::bind_range;
#[cfg(test)]
pub(crate) use name::invalid_name_reason;
pub(crate) use pages::page_histogram;
pub use pages::{MoveReport, NodeHistogram, PagesSource, migrate_process, resident_pages};
pub use protect::WriteWindow;
pub use shmem::{HugePageSize, Seals};

use std::ffi::c_void;
use std::fs::File;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::AtomicBool;

use crate::diag;
use crate::error::{Error, Result};
use crate::page::page_size;
use crate::policy::{MbindFlags, MemPolicy, ModeFlags, Observed, Placement};

/// What backs a region.
#[derive(Debug)]
enum Backing {
    /// Private anonymous memory: placed by the region's policy.
    Anonymous,
    /// A memfd (shmem): placed by its shared policy, which `mbind` sets.
    Memfd(memfd::Memfd),
    /// A read-only shared file mapping: pages live in the page cache wherever they were
    /// first read; a VMA policy does not move or place them.
    File,
    /// A private read-only mapping of a memfd sealed against writing, shrinking and
    /// growing: an attached store, or a frozen exported one. No one can change its bytes;
    /// its pages are placed by the file's shared policy.
    Sealed(File),
    /// A failed in-place remap unmapped the range: nothing is mapped any more, and the
    /// region is empty (its address may already belong to another mapping).
    Lost,
}

/// An owned, page-aligned mapping, unmapped on drop.
///
/// # Example
/// ```
/// use numapin::policy::{MbindFlags, MemPolicy, Placement};
/// use numapin::{NodeSet, Region};
/// let mut region = Region::anonymous(1 << 20).unwrap();
/// let nodes = NodeSet::allowed().unwrap();
/// // Bind before the first touch: the policy steers the page faults to come.
/// match region.bind(&MemPolicy::Interleave(nodes), MbindFlags::empty()).unwrap() {
///     Placement::Bound => {}
///     Placement::Degraded(why) => eprintln!("running unplaced: {why}"),
/// }
/// region.populate_write().unwrap();
/// region.as_mut_slice().unwrap()[0] = 1;
/// ```
#[derive(Debug)]
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// Whether [`Region::lock`] is in force (an in-place remap must lock again).
    locked: AtomicBool,
    /// Bytes of `PROT_NONE` guard mapped right before and right after the region
    /// ([`Region::anonymous_fenced`]; 0 otherwise), unmapped with it.
    fence: usize,
    /// Read-only at rest, and the write windows open ([`Region::set_read_only`]).
    protection: std::sync::Mutex<protect::Protection>,
}

// SAFETY: a Region exclusively owns its mapping; the raw pointer is not shared with any
// other owner, and shared access only reads through `&self`.
unsafe impl Send for Region {}
// SAFETY: `&self` methods only read the mapping or make syscalls that leave its contents
// unchanged (mbind without MOVE flags, move_pages queries, harmless madvise); all
// content-changing operations take `&mut self`, except the `unsafe` per-range ones
// (`slot_mut_unchecked`, `release_unchecked`) whose callers keep ranges exclusive.
unsafe impl Sync for Region {}

impl Region {
    fn owned(ptr: *mut c_void, len: usize, backing: Backing) -> Region {
        Region {
            // mmap never returns null on success (MAP_FIXED is never used here).
            ptr: NonNull::new(ptr.cast()).unwrap_or(NonNull::dangling()),
            len,
            backing,
            locked: AtomicBool::new(false),
            fence: 0,
            protection: Default::default(),
        }
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes (a whole number of pages, except for file mappings).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True only for a region whose mapping was lost by a failed in-place remap (see
    /// [`PinStore::export`](crate::store::PinStore::export)); regions have at least one
    /// page otherwise.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd behind a [`Region::memfd`] region, or the sealed file behind an
    /// attached one.
    ///
    /// # Safety
    ///
    /// Through the file, safe code can change the bytes this region hands out as `&[u8]`:
    /// `set_len` below the region's length makes reading it raise SIGBUS, and `write_at`
    /// changes bytes under a live shared borrow. While the region or any slice of it
    /// lives, the caller must not shrink the file, write to it, punch holes in it, or map
    /// it writable elsewhere (nor hand it to a process that might), unless the file is
    /// sealed against that ([`Region::seals`]: `SHRINK` and `WRITE` or `FUTURE_WRITE`).
    /// Reading it, duplicating it for a process that maps it read-only, and adding seals
    /// are fine.
    ///
    /// # Example
    /// ```compile_fail,E0133
    /// let region = numapin::Region::memfd("x", 4096).unwrap();
    /// region.memfd_file().unwrap().set_len(0).unwrap(); // would SIGBUS a later read
    /// ```
    pub unsafe fn memfd_file(&self) -> Option<&File> {
        self.file()
    }

    /// The file behind a memfd or sealed region, for this module's own careful use.
    fn file(&self) -> Option<&File> {
        match &self.backing {
            Backing::Memfd(fd) => Some(fd.as_file()),
            Backing::Sealed(file) => Some(file),
            _ => None,
        }
    }

    /// The bytes. Reading faults pages in (zero pages for untouched anonymous memory).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: [ptr, ptr + len) is mapped readable for the lifetime of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    ///
    /// # Errors
    /// The region is a read-only file mapping or sealed view, or is read-only at rest
    /// ([`Region::set_read_only`]) with no write window open.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.writable("Region::as_mut_slice")?;
        // SAFETY: mapped read-write for the lifetime of `self`, and `&mut self` makes
        // this the only live reference.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// Refuses a write to a region whose backing is read-only, or that is read-only at
    /// rest ([`Region::set_read_only`]) with no write window open.
    fn writable(&self, op: &'static str) -> Result<()> {
        self.backing_writable(op)?;
        if self.protection_state().writable_now() {
            return Ok(());
        }
        Err(Error::wrong_backing(
            op,
            "the region is read-only (mprotect PROT_READ) and no write window is open",
            "a writable region, or a write window open on it (Region::open_write)",
        ))
    }

    /// Refuses a region whose backing cannot be written (a file mapping, a sealed view, a
    /// lost mapping), whatever its protection.
    fn backing_writable(&self, op: &'static str) -> Result<()> {
        const WRITABLE: &str = "a writable anonymous or memfd mapping";
        match self.backing {
            Backing::File => Err(Error::wrong_backing(
                op,
                "the region is a read-only file mapping",
                WRITABLE,
            )),
            Backing::Sealed(_) => Err(Error::wrong_backing(
                op,
                "the region is a read-only view of a sealed memfd (an attached or exported \
                 store): its bytes cannot change",
                WRITABLE,
            )),
            Backing::Lost => Err(Error::wrong_backing(
                op,
                "the region's mapping was lost by a failed remap",
                WRITABLE,
            )),
            Backing::Anonymous | Backing::Memfd(_) => Ok(()),
        }
    }

    /// Which node each page of the region is on, without faulting anything in: from
    /// `move_pages`, or from `/proc/self/numa_maps` where the probe found the page calls
    /// denied ([`NodeHistogram::source`] says which; `numa_maps` counts only pages this
    /// mapping faulted in, and a mapping merged with a neighbour is reported in
    /// [`NodeHistogram::merged`], not guessed).
    ///
    /// # Errors
    /// Any `move_pages` errno but `ENOSYS` (which gives [`Observed::Degraded`]), or
    /// `numa_maps` cannot be read.
    #[doc(alias = "move_pages")]
    #[doc(alias = "numa_maps")]
    pub fn placement(&self) -> Result<Observed<NodeHistogram>> {
        self.placement_sampled(1)
    }

    /// The memory figures (`smaps`) of the mappings this region lies in: resident,
    /// anonymous, file-backed (shmem included), shared, private, locked and huge-page
    /// bytes. The kernel merges a region with equal neighbours into one mapping; their
    /// bytes are then counted too.
    ///
    /// # Errors
    /// `/proc/self/smaps` cannot be read.
    pub fn memory(&self) -> Result<diag::SmapsEntry> {
        let start = self.as_ptr() as usize;
        let entries = diag::smaps_in_range(start, start + self.map_len())?;
        Ok(diag::SmapsEntry::total(&entries))
    }

    /// Re-places pages that already exist: binds the region to `to` and moves its
    /// present pages there (`mbind` with `MPOL_MF_MOVE`); future faults land there too.
    /// Counts come from [`Region::placement`] before and after (`move_pages`, or
    /// `numa_maps` where the page calls are denied: `mbind` still moves there).
    ///
    /// # Errors
    /// An empty set, or a target [`Region::bind`] refuses before the call (in every
    /// environment, before placement is asked), or `mbind`/`move_pages` fail with an
    /// errno other than `EPERM`/`ENOSYS` (which give [`Observed::Degraded`]).
    pub fn migrate(&self, to: &crate::node::NodeSet) -> Result<Observed<MoveReport>> {
        // Checked before the placement query, which degrades where the page calls are
        // denied: an invalid target is an error in every environment.
        let policy = MemPolicy::Bind(*to);
        crate::policy::check_policy_call("mbind", &policy, ModeFlags::empty())?;
        let before = match self.placement()? {
            Observed::Known(h) => h,
            Observed::Degraded(reason) => return Ok(Observed::Degraded(reason)),
        };
        if let Placement::Degraded(reason) = self.bind(&policy, MbindFlags::MOVE)? {
            return Ok(Observed::Degraded(reason));
        }
        Ok(match self.placement()? {
            Observed::Known(after) => Observed::Known(pages::report_against(&before, &after, to)),
            Observed::Degraded(reason) => Observed::Degraded(reason),
        })
    }

    /// Moves each present page to `node` with `move_pages`, keeping the region's policy
    /// (later faults follow the policy, not this move). Pages that could not move are
    /// counted by the kernel's reason.
    ///
    /// # Errors
    /// A node id this machine cannot have, or [`Error::NodeNotAllowed`] for a node this
    /// process may not allocate on (offline, no memory, outside its cpuset: the kernel's
    /// `ENODEV`/`EACCES`), checked before the call in every environment; or `move_pages`
    /// fails as a whole.
    #[doc(alias = "move_pages")]
    pub fn move_pages_to(&self, node: crate::node::Node) -> Result<Observed<MoveReport>> {
        // SAFETY: the whole range is our own mapping; moving keeps contents.
        unsafe { pages::move_range_to(self.as_ptr(), self.map_len(), node) }
    }

    /// [`Region::placement`] of every `step`-th page only: bounded cost for big regions.
    /// Counts from `move_pages` are of sampled pages; multiply by `step` for an estimate.
    /// Counts from `numa_maps` are whole (one read costs the same for any region). Step 0
    /// is taken as 1 (every page); a step larger than the region samples its first page
    /// only.
    ///
    /// # Errors
    /// As [`Region::placement`].
    pub fn placement_sampled(&self, step: usize) -> Result<Observed<NodeHistogram>> {
        let start = self.as_ptr() as usize;
        // SAFETY: the whole range is our own mapping.
        unsafe { pages::spans_histogram(&[(start, start + self.map_len())], step) }
    }

    /// [`Region::placement_sampled`] of several regions at once, from one read of
    /// `numa_maps` where the page calls are denied (regions the kernel merged with each
    /// other then count exactly).
    ///
    /// # Errors
    /// As [`Region::placement`].
    pub(crate) fn placement_of_all(
        regions: &[&Region],
        step: usize,
    ) -> Result<Observed<NodeHistogram>> {
        let spans: Vec<(usize, usize)> = regions
            .iter()
            .map(|r| (r.as_ptr() as usize, r.as_ptr() as usize + r.map_len()))
            .collect();
        // SAFETY: every span is a live region's own mapping.
        unsafe { pages::spans_histogram(&spans, step) }
    }

    /// Refuses a reversed range or one that reaches past the region.
    fn check_range(&self, op: &'static str, range: &Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::out_of_bounds(
                op,
                "range",
                range.start as u64..range.end as u64,
                self.len,
                "the region",
            ));
        }
        Ok(())
    }

    fn map_len(&self) -> usize {
        self.len.next_multiple_of(page_size())
    }

    /// The policy the kernel holds for the page at `offset` (`get_mempolicy` with
    /// `MPOL_F_ADDR`).
    ///
    /// # Errors
    /// `offset` is outside the region, or `get_mempolicy` fails with an errno other than
    /// `EPERM`/`ENOSYS`.
    pub fn policy_at(&self, offset: usize) -> Result<Observed<(MemPolicy, ModeFlags)>> {
        if offset >= self.len {
            return Err(Error::out_of_bounds(
                "Region::policy_at",
                "offset",
                offset as u64..offset as u64,
                self.len,
                "the region",
            ));
        }
        // SAFETY: the address is inside our own mapping.
        unsafe { crate::policy::policy_at_addr(self.as_ptr().add(offset).cast()) }
    }

    /// The bytes of `range` only: a shared slice that covers nothing outside it, so that
    /// another range of the region can be written meanwhile through
    /// [`Region::slot_mut_unchecked`] (a slice from [`Region::as_slice`] covers the whole
    /// region and forbids that).
    ///
    /// # Errors
    /// The range is reversed or reaches past the region.
    pub fn slot(&self, range: Range<usize>) -> Result<&[u8]> {
        self.check_range("Region::slot", &range)?;
        // SAFETY: inside the mapping, readable for the lifetime of `self`. Writers of this
        // range through `slot_mut_unchecked` promised that no other reference to it lives
        // while their slice does.
        Ok(unsafe {
            std::slice::from_raw_parts(self.as_ptr().add(range.start), range.end - range.start)
        })
    }

    /// The bytes of `range`, writable, through `&self`: one slot of a region written
    /// while other slots of it are read (an expert cache loading one entry while others
    /// serve, a staging pool handing out buffers).
    ///
    /// # Safety
    ///
    /// While the returned slice lives, no other reference to any byte of `range` may
    /// exist or be created: no slice from [`Region::as_slice`] (it covers every range),
    /// [`Region::slot`] or another `slot_mut_unchecked` overlapping `range`, and no
    /// [`Region::release_unchecked`] of an overlapping range. The caller keeps the ranges
    /// it hands out apart (slot states under a lock, a free list).
    /// For a region read-only at rest, a write window opened before the call
    /// ([`Region::open_write`]) outlives the slice.
    ///
    /// A region that is read-only at rest ([`Region::set_read_only`]) must have a write
    /// window open ([`Region::open_write`]) for as long as the returned slice lives: the
    /// call refuses it when none is open, and closing the last window while the slice
    /// lives makes a write through it fault.
    ///
    /// # Errors
    /// The range is reversed or reaches past the region, or the region is not writable
    /// (a file mapping, a sealed view, or read-only with no write window open).
    // The point of this function: `&mut` from `&self`, with exclusivity promised by the
    // caller per range (the `# Safety` contract) instead of by the borrow checker.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut_unchecked(&self, range: Range<usize>) -> Result<&mut [u8]> {
        const OP: &str = "Region::slot_mut_unchecked";
        self.writable(OP)?;
        self.check_range(OP, &range)?;
        // SAFETY: inside the mapping, which is read-write (checked above) for the
        // lifetime of `self`; the pointer comes from mmap, not from a shared reference;
        // the caller guarantees that no other reference to the range lives meanwhile.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.as_ptr().add(range.start), range.end - range.start)
        })
    }
}

impl AsRef<[u8]> for Region {
    /// [`Region::as_slice`].
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let start = self.as_ptr() as usize;
        let fence = self.fence;
        // munmap of a range we mapped can only fail on arguments we never pass (or
        // ENOMEM splitting a VMA, impossible when unmapping whole mappings); a
        // destructor has no one to report to.
        if let Backing::Lost = self.backing {
            // Nothing of ours is mapped there any more; the range may be someone else's.
            // (Only a memfd region can be lost, and those have no guards.)
            return;
        }
        // SAFETY: we own the mapping and its guards, and no borrow of it outlives `self`.
        let _ = unsafe {
            rustix::mm::munmap((start - fence) as *mut c_void, self.map_len() + 2 * fence)
        };
    }
}

/// Where the pages of memory another crate owns are (`move_pages(2)` with no target
/// nodes: nothing is moved or faulted in) — [`Region::placement`] for foreign memory.
///
/// # Safety
///
/// `[ptr, ptr + len)` must be mapped in this process for the duration of the call (the
/// kernel only reads page tables; an unmapped page is reported, not touched).
///
/// # Errors
/// `ptr` is not page-aligned or `ptr + len` overflows, or `move_pages` fails with an
/// errno other than `EPERM`/`ENOSYS` (which give [`Observed::Degraded`]).
#[doc(alias = "move_pages")]
pub unsafe fn range_placement(ptr: *const u8, len: usize) -> Result<Observed<NodeHistogram>> {
    let page = page_size();
    if !(ptr as usize).is_multiple_of(page) {
        return Err(Error::misaligned(
            "range_placement",
            "address",
            ptr as usize,
            page,
        ));
    }
    if (ptr as usize).checked_add(len).is_none() {
        return Err(Error::overflow(
            "range_placement",
            format!("address {ptr:p} + len {len}"),
        ));
    }
    // SAFETY: forwarded from the caller; a query moves nothing.
    unsafe { page_histogram(ptr.cast_mut(), len) }
}
