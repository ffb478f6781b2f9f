//! [`StoreOptions`] and [`SlotAlign`]: how a [`PinStore`](super::PinStore) maps, aligns
//! and loads its regions.

use super::{ExpertAssignment, ProgressHook, ReadMode, arena};
#[cfg(doc)]
use super::{LayerReport, PinStore, Progress};
use crate::error::{Error, Result};

/// Options of a [`PinStore`]: [`StoreOptions::default`], then a setter per option to
/// change (memmap2's `MmapOptions` is the model). `#[non_exhaustive]`: options can be
/// added without breaking callers, so they are read as fields but set through the
/// setters (struct-literal syntax is refused outside the crate, E0639).
///
/// # Example
/// ```
/// use numapin::store::{ReadMode, SlotAlign, StoreOptions};
/// let options = StoreOptions::default()
///     .huge_pages(false)
///     .loader_threads(2)
///     .read_mode(ReadMode::DropBehind)
///     .slot_align(SlotAlign::HugePage);
/// assert_eq!((options.huge_pages, options.loader_threads), (false, 2));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreOptions {
    /// 2 MiB-aligned regions with `MADV_HUGEPAGE` (default on); off: `MADV_NOHUGEPAGE`,
    /// so that even with THP `always` interleaving stays page by page.
    pub huge_pages: bool,
    /// Fault each region in (`MADV_POPULATE_WRITE`) before loading a layer that copies
    /// bytes from memory (default on). A layer read from files skips it, in every
    /// [`ReadMode`]: the reads fault the slots in under the bind, on every loader thread
    /// and overlapped with the device's transfers, where a separate pass would zero the
    /// whole layer first on one thread.
    pub populate: bool,
    /// Threads that fill slots (default: the available parallelism).
    pub loader_threads: usize,
    /// Replace `vm.max_map_count` in the budget check (tests).
    #[doc(hidden)]
    pub vma_budget: Option<usize>,
    /// Back the arenas with memfds (shmem, placed by their shared policy) so that
    /// [`PinStore::export`] can hand them to other processes (default off). Huge pages
    /// then follow `/sys/kernel/mm/transparent_hugepage/shmem_enabled`.
    pub shared: bool,
    /// Where slots start: the default [`SlotAlign::Page`] wastes less than a page per
    /// slot; [`SlotAlign::HugePage`] lets `release` give back whole huge pages, at up to
    /// 2 MiB of padding per slot.
    pub slot_align: SlotAlign,
    /// How [`PinStore::pack_layer`] reads file pieces (default [`ReadMode::Auto`]:
    /// buffered what is cached, direct what is not, per file);
    /// [`LayerReport::read_mode`] says what ran. [`PinStore::ensure`] always reads
    /// buffered.
    pub read_mode: ReadMode,
    /// [`ReadMode::Direct`]: each loader thread keeps several reads in flight on its own
    /// `io_uring` (default on). Where `io_uring_setup` answers `EPERM` or `ENOSYS` the
    /// loaders read with blocking calls instead, and [`LayerReport::direct_io`] says so.
    pub io_uring: bool,
    /// Called with each layer's [`Progress`] while it loads (default none); see
    /// [`ProgressHook`] for the rate and the guarantees.
    pub progress: Option<ProgressHook>,
    /// Where pieces of a file source start inside a slot: at multiples of this power of
    /// two (default 1: back to back). A slot grows by the padding; the padding bytes are
    /// zero. [`PinStore::slot_map`] tells where each piece went.
    pub piece_align: usize,
    /// Where pieces of a file source start modulo this power of two (default 0: off,
    /// pieces at multiples of [`StoreOptions::piece_align`] only). On, each piece whose
    /// file offset is a multiple of `piece_align` starts at the first offset after the
    /// previous piece that is congruent to its file offset modulo this (so also a
    /// multiple of `piece_align`): a [`ReadMode::Direct`] read then lands in the slot in
    /// place, only the partial alignment units at a run's two ends going through the
    /// bounce buffer. Set it to the file's direct-I/O memory alignment (`STATX_DIOALIGN`'s
    /// `stx_dio_mem_align`: from the first aligned file offset on, only the address must be
    /// aligned, to that).
    /// Pieces that follow each other in the file stay together in the slot (a gap of
    /// less than the modulus is mirrored). Costs at most `modulus - 1` bytes of padding
    /// per piece. A piece whose file offset is not a multiple of `piece_align` keeps the
    /// alignment and is read through the bounce buffer. 0 or 1: off; otherwise a power
    /// of two from `piece_align` to the slot alignment (slots start at multiples of it,
    /// so a larger modulus could not reach the addresses).
    ///
    /// `Checkpoint::place` (feature `model`) lays its dense stores and its experts out
    /// with the files' direct-I/O alignment when this is 0 and the files are read
    /// directly ([`ReadMode::Direct`], or [`ReadMode::Auto`] on files mostly not cached);
    /// 1 keeps them at the alignment alone.
    pub piece_congruence: usize,
    /// Which node of a [`Layout::SplitExperts`](super::Layout::SplitExperts) set each
    /// expert lives on, for the layers it names (default none: every layer split by
    /// index). Only with `SplitExperts`, and not with [`StoreOptions::shared`].
    pub assignment: Option<ExpertAssignment>,
    /// Keep the arenas writable once loaded (default off). Off, each layer's regions are
    /// made read-only (`mprotect(PROT_READ)` of each whole region) once the layer is
    /// loaded, so a stray write through a pointer an engine made from a view faults
    /// (`SIGSEGV`) instead of changing what every reader sees. [`PinStore::ensure`]
    /// opens a region for its fill and closes it after, whole, so a region never splits
    /// into more mappings. On: the regions stay `PROT_READ | PROT_WRITE`.
    pub writable: bool,
    /// Role-major slots (default 1: a slot per expert). With `roles` > 1 a layer of
    /// `S` slots holds `roles` runs of its `E = S / roles` experts: slot `r × E + e`
    /// holds role `r` of expert `e` (the caller packs one source per role and expert in
    /// that order), so that each role's experts lie back to back at one stride and a
    /// framework tensor holding one role of every expert (DBRX's `w1`/`v1`/`w2`,
    /// `[E·I, H]` each) is one view of its run. [`PinStore::home_node`] and the loaders
    /// take expert `e`'s node for each of its slots. Cost in mappings: none, except
    /// under [`Layout::SplitExperts`](super::Layout::SplitExperts) on several nodes,
    /// where each run is split in the node blocks: `roles × blocks` mappings and `mbind`
    /// calls per region instead of `blocks` (a run's last block and the next run's first
    /// are on different nodes, so they never merge; on one node the runs are one block).
    /// Not with [`StoreOptions::assignment`] or [`StoreOptions::shared`].
    pub role_major: usize,
}

/// The largest slot or piece alignment a store accepts: 1 GiB, the largest huge page.
/// Anything larger only pads slots (a 100-byte piece aligned to 1 TiB asks for a TiB),
/// and with overcommit on, populating would fault all of it in.
pub const MAX_ALIGN: usize = 1 << 30;

/// The alignment of slots inside an arena (the stride is the slot size rounded up to it).
///
/// Whatever the alignment, an arena's region is 2 MiB-aligned with `MADV_HUGEPAGE` when
/// [`StoreOptions::huge_pages`] is on, so transparent huge pages back the region, not
/// each slot. What the alignment changes is `release`: releasing a page-aligned slot
/// inside a THP region splits the huge pages at its edges (lazily: RSS drops at once,
/// `MemFree` may not until the split pages are reclaimed), and khugepaged may collapse a
/// partly released range into a huge page again. Measure a release with RSS or `mincore`,
/// not `MemFree`. Huge-page-aligned slots release whole huge pages, at the price of
/// padding every slot up to a multiple of 2 MiB (a 2 MiB + 1 byte slot takes 4 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SlotAlign {
    /// The base page (4 KiB): the stride is the slot size rounded up to the page.
    #[default]
    Page,
    /// The transparent huge page (2 MiB).
    HugePage,
    /// Any power of two at least the page size.
    Bytes(usize),
}

impl SlotAlign {
    /// The alignment in bytes.
    ///
    /// # Errors
    /// [`SlotAlign::Bytes`] that is not a power of two at least the page size.
    pub fn bytes(self) -> Result<usize> {
        let page = crate::page::page_size();
        match self {
            SlotAlign::Page => Ok(page),
            SlotAlign::HugePage => Ok(arena::HUGE_PAGE),
            SlotAlign::Bytes(n) if n.is_power_of_two() && n >= page && n <= MAX_ALIGN => Ok(n),
            SlotAlign::Bytes(n) => Err(Error::bad_value(
                "SlotAlign",
                "SlotAlign::Bytes",
                n,
                format!(
                    "not a power of two from the page size {page} to {MAX_ALIGN} \
                     (1 GiB: a larger alignment pads every slot by more than a huge page of \
                     the largest size)"
                ),
            )),
        }
    }
}

impl StoreOptions {
    /// [`StoreOptions::huge_pages`].
    #[must_use]
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// [`StoreOptions::populate`].
    #[must_use]
    pub fn populate(mut self, on: bool) -> Self {
        self.populate = on;
        self
    }

    /// [`StoreOptions::io_uring`].
    #[must_use]
    pub fn io_uring(mut self, on: bool) -> Self {
        self.io_uring = on;
        self
    }

    /// [`StoreOptions::loader_threads`] (0 is refused by [`PinStore::new`]).
    #[must_use]
    pub fn loader_threads(mut self, threads: usize) -> Self {
        self.loader_threads = threads;
        self
    }

    /// Replaces `vm.max_map_count` in the budget check (tests).
    #[doc(hidden)]
    #[must_use]
    pub fn vma_budget(mut self, budget: Option<usize>) -> Self {
        self.vma_budget = budget;
        self
    }

    /// [`StoreOptions::shared`].
    #[must_use]
    pub fn shared(mut self, on: bool) -> Self {
        self.shared = on;
        self
    }

    /// [`StoreOptions::slot_align`].
    #[must_use]
    pub fn slot_align(mut self, align: SlotAlign) -> Self {
        self.slot_align = align;
        self
    }

    /// [`StoreOptions::read_mode`].
    #[must_use]
    pub fn read_mode(mut self, mode: ReadMode) -> Self {
        self.read_mode = mode;
        self
    }

    /// [`StoreOptions::progress`].
    #[must_use]
    pub fn progress(mut self, hook: Option<ProgressHook>) -> Self {
        self.progress = hook;
        self
    }

    /// [`StoreOptions::piece_align`].
    #[must_use]
    pub fn piece_align(mut self, align: usize) -> Self {
        self.piece_align = align;
        self
    }

    /// [`StoreOptions::piece_congruence`].
    #[must_use]
    pub fn piece_congruence(mut self, modulus: usize) -> Self {
        self.piece_congruence = modulus;
        self
    }

    /// [`StoreOptions::assignment`].
    #[must_use]
    pub fn assignment(mut self, assignment: Option<ExpertAssignment>) -> Self {
        self.assignment = assignment;
        self
    }

    /// [`StoreOptions::writable`].
    #[must_use]
    pub fn writable(mut self, on: bool) -> Self {
        self.writable = on;
        self
    }

    /// [`StoreOptions::role_major`].
    #[must_use]
    pub fn role_major(mut self, roles: usize) -> Self {
        self.role_major = roles;
        self
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            huge_pages: true,
            populate: true,
            loader_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            vma_budget: None,
            shared: false,
            slot_align: SlotAlign::Page,
            read_mode: ReadMode::Auto,
            io_uring: true,
            progress: None,
            piece_align: 1,
            piece_congruence: 0,
            assignment: None,
            writable: false,
            role_major: 1,
        }
    }
}
