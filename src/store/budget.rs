//! The map budget: refuse, with the figures, what would cross `vm.max_map_count`.
//!
//! # Shape: a checked reservation under one lock per store
//!
//! Every new mapping a store makes — each region, and each loader thread, whose stack,
//! signal stack and malloc arena are mappings too — is made by [`MapGate::reserve`]:
//! under the store's one map lock, count the free map slots, refuse (or, for an optional
//! loader thread, skip) when fewer than the need plus [`HEAP_MARGIN`] are left, and make
//! the mapping before the lock is let go. A loader thread counts as made only once it
//! runs and has allocated (see `load::fill`), because Rust's runtime maps a thread's
//! signal stack *inside* the new thread after `spawn` has returned `Ok`: a thread that
//! cannot get that mapping aborts the process, and nothing can catch it. Packs running
//! at once on one store therefore take map slots one after another, each seeing what the
//! others took.
//!
//! The other shape — a persistent loader pool made with the store — was not taken: it
//! would hold `loader_threads` stacks and arenas for the store's whole life, needs
//! `'static` jobs (today's jobs borrow the caller's sources and the arena's slots), and
//! would still need this check for the regions.
//!
//! A loader that reads directly without `io_uring` spawns up to
//! [`POOL_DEPTH`](crate::store::POOL_DEPTH)` - 1` read threads for each batch it reads,
//! outside the lock: their room is claimed when its pool is made, under the lock, and
//! stays claimed until the pool drops (`source::pool::ThreadRoom`), so that two packs
//! near the limit cannot both count the same free slots as their read threads'.
//!
//! # The race that remains
//!
//! The lock is the store's, not the process's: another thread of the process (another
//! store, the allocator, any library) can take map slots between the check and the
//! `mmap`, and a thread spawned elsewhere can still abort the process at the limit. The
//! margin absorbs this store's own heap allocations, not other threads'.

use std::sync::{Mutex, MutexGuard};

use super::{LayerSpec, PinStore};
use crate::diag;
use crate::error::{Error, Result};
use crate::source::ThreadRoom;

/// Mappings kept free beyond what a reservation needs: the heap allocations a pack makes
/// between two reservations (the slot tables and the job list, which glibc serves with
/// `mmap` when they are large; `malloc` returning NULL aborts a Rust program).
pub(crate) const HEAP_MARGIN: usize = 2;

/// One lock per store around "count free map slots, then map".
#[derive(Debug)]
pub(crate) struct MapGate {
    lock: Mutex<()>,
    /// [`super::StoreOptions::vma_budget`].
    budget: Option<usize>,
    /// Slots set aside for the read threads of the loaders that read directly without
    /// `io_uring`: they spawn them at any moment of their fill, outside the lock, so the
    /// room is claimed under the lock when a loader's pool is made, and counted as used
    /// until the pool drops.
    room: ThreadRoom,
}

/// Held while the reserved mappings are being made.
pub(crate) type Reservation<'a> = MutexGuard<'a, ()>;

impl MapGate {
    pub(crate) fn new(budget: Option<usize>) -> Self {
        MapGate {
            lock: Mutex::new(()),
            budget,
            room: ThreadRoom::default(),
        }
    }

    /// Where loaders claim room for their read threads ([`crate::source::load::Reader`]'s
    /// `room`): under this gate's lock, each pool of read threads made then counts as
    /// used by every later check until it drops.
    pub(crate) fn room(&self) -> ThreadRoom {
        self.room.clone()
    }

    /// Takes the store's map lock and checks that `needed` mappings plus [`HEAP_MARGIN`]
    /// fit; the caller makes them before dropping the guard.
    ///
    /// # Errors
    /// [`Error::MapBudget`] with the figures, or they cannot be read.
    pub(crate) fn reserve(
        &self,
        what: impl FnOnce() -> String,
        needed: usize,
    ) -> Result<Reservation<'_>> {
        // A poisoned lock guards nothing but `()`: go on.
        let guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.check(what, needed)?;
        Ok(guard)
    }

    /// The check alone (no lock): `needed` plus [`HEAP_MARGIN`] against the free slots.
    fn check(&self, what: impl FnOnce() -> String, needed: usize) -> Result<()> {
        let Some(needed) = needed.checked_add(HEAP_MARGIN) else {
            return Err(Error::overflow(
                "PinStore map budget",
                format!("{}: {needed} mappings + a margin of {HEAP_MARGIN}", what()),
            ));
        };
        let limit = match self.budget {
            Some(budget) => budget,
            None => diag::max_map_count()?,
        };
        // What the process has, and what loaders have set aside for their read threads.
        let current = diag::map_count()?.saturating_add(self.room.held());
        let available = limit.saturating_sub(current);
        if needed > available {
            return Err(Error::MapBudget {
                what: what(),
                needed,
                available,
                limit,
                current,
            });
        }
        Ok(())
    }
}

impl PinStore {
    /// Checks, before loading anything, that `layers` more layers of `spec` fit in the
    /// map budget (`vm.max_map_count`, or [`StoreOptions::vma_budget`], minus the
    /// mappings this process has now): a model that cannot fit is refused up front
    /// instead of failing mid-load.
    ///
    /// A hybrid store ([`StoreOptions::assignment`] with hot experts) counts each layer's
    /// hot copies as if every layer had hot experts (an upper bound: the layers are not
    /// named here); each layer's exact count is checked again when it is packed.
    ///
    /// Loader threads are not counted: each is spawned only if its mappings fit at that
    /// moment, and the calling thread loads alone otherwise.
    ///
    /// # Errors
    /// [`Error::MapBudget`] naming the mappings needed, left, the limit and the current
    /// count; an error naming the figures when `layers` regions overflow `usize`; or the
    /// figures cannot be read.
    ///
    /// [`StoreOptions::vma_budget`]: super::StoreOptions::vma_budget
    /// [`StoreOptions::assignment`]: super::StoreOptions::assignment
    pub fn check_model_budget(&self, layers: usize, spec: &LayerSpec) -> Result<()> {
        // Replicas and split blocks are mappings too: a region per kind per copy, a
        // mapping per block of a split region.
        // A hybrid store's hot copies: counted as if every layer had hot experts.
        // The mappings are the one arithmetic's (`layout::Placer`); they do not depend on
        // the strides, only on which kinds have a region.
        let kinds = 1 + usize::from(spec.scale_bytes > 0);
        let maps = (self.placer).mappings(spec.experts, [true, spec.scale_bytes > 0]);
        let hot = kinds * self.copies() * self.hot_maps_bound();
        let per_layer = maps.saturating_add(hot);
        let needed = layers.checked_mul(per_layer).ok_or_else(|| {
            Error::overflow(
                "PinStore::check_model_budget",
                format!("{layers} layers × {per_layer} regions"),
            )
        })?;
        self.check_budget(format!("a model of {layers} layers"), needed)
    }

    /// Checks that `regions` new mappings (plus the margin) fit now, without reserving.
    pub(super) fn check_budget(&self, what: String, regions: usize) -> Result<()> {
        self.maps.check(|| what, regions)
    }
}
