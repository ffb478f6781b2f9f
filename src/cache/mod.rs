//! `ExpertCache`: a cache of experts in fixed slots (CLOCK replacement, lock-free hits),
//! one weights region and one scales region per node, each bound to its node once before
//! first touch; and `StagingPool`, reusable page-aligned buffers that bind nothing.
//!
//! The cache's mappings do not grow with churn: an eviction reuses the slot's pages in
//! place (no `munmap`, no new `mbind`), so a cache over `n` nodes keeps its `2 × n`
//! regions (`n` without scales) however many entries pass through it. Compare one slab
//! per entry, bound one by one, which costs about two mappings per entry and an `mbind`
//! per fill.
//!
//! # Concurrency: hits take no lock
//!
//! A hit is lock-free: it hashes the key into a table of hints (`hints.rs`), counts a pin
//! in the slot's count for the caller's CPU, then checks the slot's word (a `READY` bit,
//! a reference bit) and key; `slot.rs` explains the memory orderings. Dropping the
//! [`Entry`] is one atomic decrement. Pin counts and hit counters are split by CPU, so
//! threads hitting the *same* experts write different cache lines: the slot's word is
//! only read on a hit (written only to set a clear reference bit).
//!
//! One mutex guards the rest: the authoritative key index, slot states, free lists,
//! clock hands and the miss-side counters. It is held for bookkeeping, never while bytes
//! are copied. A miss marks its slot *loading*, releases the lock, copies the expert in,
//! and re-takes the lock to publish. A second thread missing on a key being loaded waits
//! on a condition variable until the first publishes (or gets its error). A pinned slot
//! is never evicted or written: eviction clears `READY`, then reads every pin count, and
//! gives the slot back if any is set (Dekker's pattern, all `SeqCst`: see `slot.rs`).
//!
//! # Replacement: CLOCK per node
//!
//! Strict LRU reorders a list on every hit, which needs the lock; the cache uses CLOCK
//! (second chance) instead. Each hit sets its slot's reference bit; a miss on a full node
//! moves the node's hand over its slots: a referenced slot is spared once (bit cleared),
//! the first unreferenced, unpinned one is evicted. A fresh load starts unreferenced, so
//! an entry loaded once and never hit again goes before one that was hit. The tests
//! compare hits, misses, evictions and the slot of every key with a reference CLOCK.
//!
//! When every slot of the node a miss wants is pinned, `get_or_load` returns an error at
//! once (it does not wait): the caller holds too many entries for the capacity it chose.
//!
//! # Safety
//!
//! No raw pointers here: the only `unsafe` is calling the region's per-range accessors
//! ([`Region::slot_mut_unchecked`], [`Region::release_unchecked`]), whose contract (no
//! other reference to the range meanwhile) the slot protocol guarantees: a slot is
//! written only while it is *loading* (by the one thread that marked it so, its word not
//! `READY`, so no entry of it exists) and released only while it is *free*; [`Entry`]
//! reads only slots it pinned while `READY`, which no one writes or releases until the
//! last pin drops; and the cache never makes a slice of a whole region. The staging pool
//! keeps its buffers apart with a free list the same way.
#![allow(unsafe_code)]

mod build;
mod hints;
mod miss;
mod slot;
mod staging;
mod state;
#[cfg(test)]
mod tests;

pub use staging::{Staging, StagingPool};

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::diag;
use crate::error::Result;
use crate::node::{Node, NodeSet};
use crate::page::page_size;
use crate::policy::Placement;
use crate::region::{Region, resident_pages};
use crate::source::ExpertSource;
use hints::Hints;
use slot::Slots;
use state::State;

/// The key of an entry: `(layer, expert)`.
pub(crate) type Key = (usize, usize);

/// How an [`ExpertCache`] is built: [`CacheOptions::default`] (both off), then a setter
/// per option. `#[non_exhaustive]`, as [`StoreOptions`](crate::store::StoreOptions).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheOptions {
    /// Fault every slot's pages in at creation (`MADV_POPULATE_WRITE`), under the bind:
    /// the first loads then copy into pages that exist.
    pub populate: bool,
    /// Align regions of 2 MiB or more to 2 MiB and advise `MADV_HUGEPAGE`: transparent
    /// huge pages back the region (never rounding a slot up to 2 MiB).
    pub huge_pages: bool,
    /// Keep the regions writable between loads (default off). Off, they are read-only
    /// (`mprotect(PROT_READ)`) except while a load fills a slot: a load opens its region
    /// (whole, so it never splits into more mappings) and the last load in flight closes
    /// it, so a stray write through an entry's bytes faults.
    pub writable: bool,
}

impl CacheOptions {
    /// [`CacheOptions::populate`].
    #[must_use]
    pub fn populate(mut self, on: bool) -> Self {
        self.populate = on;
        self
    }

    /// [`CacheOptions::huge_pages`].
    #[must_use]
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// [`CacheOptions::writable`].
    #[must_use]
    pub fn writable(mut self, on: bool) -> Self {
        self.writable = on;
        self
    }
}

/// One node's regions.
#[derive(Debug)]
struct NodeRegions {
    node: Node,
    weights: Region,
    scales: Option<Region>,
    placement: Placement,
}

/// A cache of experts in fixed slots per node, replaced by CLOCK, hits lock-free. See the
/// [module docs](self).
///
/// # Example
/// ```
/// use numapin::cache::{CacheOptions, ExpertCache};
/// use numapin::store::ExpertSource;
/// use numapin::{Node, NodeSet};
/// let nodes = NodeSet::from_nodes([0])?;
/// let cache = ExpertCache::new(nodes, 4, 4096, 64, CacheOptions::default())?;
/// let (w, s) = (vec![7u8; 4096], vec![1u8; 64]);
/// let source = ExpertSource::Memory { weights: &w, scales: &s };
/// let entry = cache.get_or_load(3, 17, &source, Some(Node(0)))?;
/// assert_eq!(entry.weights(), &w[..]);
/// assert_eq!(entry.node(), Node(0));
/// drop(entry);
/// assert!(cache.get(3, 17).is_some());
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug)]
pub struct ExpertCache {
    regions: Vec<NodeRegions>,
    slots_per_node: usize,
    weight_bytes: usize,
    scale_bytes: usize,
    weight_stride: usize,
    scale_stride: usize,
    /// Per slot (global id), the atomics a hit uses.
    slots: Slots,
    hints: Hints,
    /// Lookups that found no ready entry (rare next to hits: one shared counter).
    misses: AtomicU64,
    state: Mutex<State>,
    published: Condvar,
    /// Acquisitions of `state`, for the test that hits take none.
    #[cfg(test)]
    locks: AtomicU64,
}

/// A cached expert, pinned in its slot while this lives (it is neither evicted nor
/// overwritten).
#[derive(Debug)]
pub struct Entry<'a> {
    cache: &'a ExpertCache,
    slot: u32,
    /// The pin-count shard this entry was counted in.
    shard: u32,
    key: Key,
    weight_len: usize,
    scale_len: usize,
}

/// One node of a cache, in [`CacheStats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStats {
    /// The node.
    pub node: Node,
    /// Whether the node's regions are bound to it, or why not (`Degraded`: the cache
    /// works, unplaced).
    pub placement: Placement,
    /// Slots on the node.
    pub slots: usize,
    /// Slots holding an entry or being loaded.
    pub used: usize,
    /// Bytes of the node's regions resident now (`mincore`).
    pub resident_bytes: u64,
}

/// What a cache did and holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found a ready entry.
    pub hits: u64,
    /// Lookups that did not (each `get_or_load` miss loads, or waits for a load).
    pub misses: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Experts loaded into slots.
    pub loads: u64,
    /// Loads that failed (the slot went back to the free list).
    pub load_failures: u64,
    /// Bytes copied in by loads.
    pub bytes_loaded: u64,
    /// Per node, in the order of the cache's node set.
    pub nodes: Vec<NodeStats>,
    /// Mappings (lines of `/proc/self/maps`) that overlap the cache's regions.
    pub mappings: usize,
}

impl ExpertCache {
    /// A cache of `slots_per_node` slots on each node of `nodes`, each slot holding
    /// `weight_bytes` of weights and `scale_bytes` of scales (0: no scales region). The
    /// slot stride is each size rounded up to the page. Each node gets one weights region
    /// and one scales region, bound to it (`MPOL_BIND`, no flags) before anything touches
    /// them; where binding is denied (`EPERM`/`ENOSYS`) the cache works unplaced and
    /// [`CacheStats::nodes`] says why.
    ///
    /// # Errors
    /// An empty node set, 0 slots, 0 weight bytes, sizes that overflow, more than
    /// `u32::MAX - 1` slots in all, `mmap` fails, or `mbind` fails with an errno other
    /// than `EPERM`/`ENOSYS` (a node this process may not use is
    /// [`Error::NodeNotAllowed`](crate::error::Error::NodeNotAllowed)).
    pub fn new(
        nodes: NodeSet,
        slots_per_node: usize,
        weight_bytes: usize,
        scale_bytes: usize,
        options: CacheOptions,
    ) -> Result<ExpertCache> {
        let geometry = build::geometry(&nodes, slots_per_node, weight_bytes, scale_bytes)?;
        let regions = build::node_regions(&nodes, &geometry, scale_bytes > 0, options)?;
        Ok(ExpertCache {
            regions,
            slots_per_node,
            weight_bytes,
            scale_bytes,
            weight_stride: geometry.weight_stride,
            scale_stride: geometry.scale_stride,
            slots: Slots::new(geometry.total_slots),
            hints: Hints::new(geometry.total_slots),
            misses: AtomicU64::new(0),
            state: Mutex::new(State::new(nodes.len(), slots_per_node, options.populate)),
            published: Condvar::new(),
            #[cfg(test)]
            locks: AtomicU64::new(0),
        })
    }

    /// The nodes of the cache, in order.
    pub fn nodes(&self) -> impl Iterator<Item = Node> + '_ {
        self.regions.iter().map(|r| r.node)
    }

    /// Slots on each node.
    pub fn slots_per_node(&self) -> usize {
        self.slots_per_node
    }

    /// `(weight_bytes, scale_bytes)`: the most a slot holds of each.
    pub fn slot_bytes(&self) -> (usize, usize) {
        (self.weight_bytes, self.scale_bytes)
    }

    /// The cache's regions as `[start, end)` address spans (weights and scales per node):
    /// what [`CacheStats::mappings`] counts mappings in.
    pub fn spans(&self) -> Vec<(usize, usize)> {
        let mut spans = Vec::with_capacity(self.regions.len() * 2);
        for r in &self.regions {
            for region in std::iter::once(&r.weights).chain(r.scales.as_ref()) {
                let start = region.as_ptr() as usize;
                spans.push((start, start + region.len()));
            }
        }
        spans
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        #[cfg(test)]
        self.locks.fetch_add(1, Ordering::Relaxed);
        // A panic while the lock was held (only possible from an allocation failure in
        // bookkeeping) leaves no slot half-published: a slot becomes READY in one store,
        // after its bytes. Go on with the state as it is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The entry for `(layer, expert)` wherever it lives, pinned; `None` if it is not
    /// cached (or still being loaded: this never waits). Counts a hit or a miss, and a
    /// hit marks the entry referenced (CLOCK spares it once). A hit takes no lock.
    pub fn get(&self, layer: usize, expert: usize) -> Option<Entry<'_>> {
        let key = (layer, expert);
        if let Some(entry) = self.hit(key) {
            return Some(entry);
        }
        // The hints are not the truth: a key whose hint window was full, or published a
        // moment ago, is found in the locked index.
        let state = self.lock();
        let ready = state
            .index
            .get(&key)
            .filter(|&&slot| matches!(state.slots[slot as usize].state, state::SlotState::Ready));
        let entry = ready.and_then(|&slot| self.pin(slot, key, true));
        if entry.is_none() {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        entry
    }

    /// The entry for `(layer, expert)`, loaded from `source` on a miss.
    ///
    /// A hit returns the cached entry wherever it lives, without taking a lock. A miss
    /// picks the node: `hint` if it is one of the cache's nodes, else the calling
    /// thread's node ([`topology::current_node`](crate::topology::current_node)) if it
    /// is, else the first node with a free or evictable slot. On that node it takes a
    /// free slot, or evicts the entry CLOCK picks among those no one holds, copies the
    /// expert in (without holding the cache's lock), and returns it. A thread that misses
    /// on a key another thread is loading waits for that load and shares its result.
    ///
    /// # Errors
    /// - The source's weights or scales are larger than a slot's (checked before any slot
    ///   is taken).
    /// - Every slot of the chosen node is held by live [`Entry`]s: the error names the
    ///   node and its capacity (no wait: drop entries, or build a larger cache).
    /// - The copy fails (a file read): the slot goes back to the free list and the key is
    ///   not cached; threads that waited for this load get the error too.
    /// - The calling thread's node cannot be found (the topology cannot be read) when no
    ///   hint applies.
    pub fn get_or_load(
        &self,
        layer: usize,
        expert: usize,
        source: &ExpertSource<'_>,
        hint: Option<Node>,
    ) -> Result<Entry<'_>> {
        let key = (layer, expert);
        match self.hit(key) {
            Some(entry) => Ok(entry),
            None => self.miss(key, source, hint),
        }
    }

    /// The lock-free hit: the first hinted slot that pins as `key`.
    #[inline]
    fn hit(&self, key: Key) -> Option<Entry<'_>> {
        self.hints
            .candidates(key)
            .find_map(|slot| self.pin(slot, key, true))
    }

    /// Pins `slot` if it is ready and holds `key` (see `slot.rs`).
    #[inline]
    fn pin(&self, slot: u32, key: Key, count_hit: bool) -> Option<Entry<'_>> {
        let pin = self.slots.pin(slot as usize, key, count_hit)?;
        Some(Entry {
            cache: self,
            slot,
            shard: pin.shard,
            key,
            weight_len: pin.lens.weights,
            scale_len: pin.lens.scales,
        })
    }

    /// Evicts unheld entries until each node holds at most `keep_per_node`, in CLOCK
    /// order (unreferenced first, from each node's hand on), then gives the pages of
    /// every free slot back to the kernel (`MADV_DONTNEED`): the resident bytes shrink,
    /// the mappings and their binding stay, and a later load faults fresh pages on the
    /// same node. Returns the slots whose pages were given back.
    ///
    /// # Errors
    /// `madvise` fails (the slots released before it stay released).
    pub fn shrink(&self, keep_per_node: usize) -> Result<usize> {
        let mut state = self.lock();
        for n in 0..self.regions.len() {
            while state.nodes[n].used > keep_per_node {
                let Some(slot) = state.victim(n, &self.slots) else {
                    break;
                };
                state.forget(slot, &self.hints);
                state.nodes[n].used -= 1;
                state.nodes[n].free.push(slot);
            }
        }
        let mut released = 0;
        for n in 0..self.regions.len() {
            for i in 0..state.nodes[n].free.len() {
                let slot = state.nodes[n].free[i];
                if !state.slots[slot as usize].dirty {
                    continue;
                }
                let (weights, scales) = self.ranges(slot);
                let r = &self.regions[n];
                // SAFETY: a free slot has no Entry (its word is not READY, so none can be
                // pinned) and no loader (leaving the free list needs the lock we hold),
                // so no reference to its ranges lives.
                unsafe {
                    r.weights.release_unchecked(weights)?;
                    if let Some(region) = &r.scales {
                        region.release_unchecked(scales)?;
                    }
                }
                state.slots[slot as usize].dirty = false;
                released += 1;
            }
        }
        Ok(released)
    }

    /// Counters, per-node residency and the mappings in the cache's regions. The hit
    /// count sums per-slot counters read without stopping hits: with lookups in flight it
    /// is a snapshot.
    ///
    /// # Errors
    /// `mincore` fails, or `/proc/self/maps` cannot be read.
    pub fn stats(&self) -> Result<CacheStats> {
        let (counters, used) = {
            let state = self.lock();
            let used: Vec<usize> = state.nodes.iter().map(|n| n.used).collect();
            (state.counters, used)
        };
        let page = page_size() as u64;
        let mut nodes = Vec::with_capacity(self.regions.len());
        for (r, used) in self.regions.iter().zip(used) {
            let mut pages = 0;
            for region in std::iter::once(&r.weights).chain(r.scales.as_ref()) {
                pages += resident_pages(region.as_ptr() as usize, region.len())?;
            }
            nodes.push(NodeStats {
                node: r.node,
                placement: r.placement,
                slots: self.slots_per_node,
                used,
                resident_bytes: pages as u64 * page,
            });
        }
        Ok(CacheStats {
            hits: self.slots.hits(),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: counters.evictions,
            loads: counters.loads,
            load_failures: counters.load_failures,
            bytes_loaded: counters.bytes_loaded,
            nodes,
            mappings: diag::maps_overlapping(&self.spans())?,
        })
    }

    /// The byte ranges of a slot in its node's weights and scales regions.
    fn ranges(&self, slot: u32) -> (Range<usize>, Range<usize>) {
        let i = slot as usize % self.slots_per_node;
        (
            i * self.weight_stride..i * self.weight_stride + self.weight_bytes,
            i * self.scale_stride..i * self.scale_stride + self.scale_bytes,
        )
    }
}

impl Entry<'_> {
    /// `(layer, expert)`.
    pub fn key(&self) -> Key {
        self.key
    }

    /// The node whose regions hold the entry.
    pub fn node(&self) -> Node {
        self.cache.regions[self.slot as usize / self.cache.slots_per_node].node
    }

    /// The expert's weights (as many bytes as its source had).
    pub fn weights(&self) -> &[u8] {
        let (range, _) = self.cache.ranges(self.slot);
        let region = &self.cache.regions[self.slot as usize / self.cache.slots_per_node].weights;
        // The range is inside the region by construction; an empty slice is unreachable.
        region
            .slot(range.start..range.start + self.weight_len)
            .unwrap_or_default()
    }

    /// The expert's scales (empty for a cache without scales).
    pub fn scales(&self) -> &[u8] {
        let (_, range) = self.cache.ranges(self.slot);
        match &self.cache.regions[self.slot as usize / self.cache.slots_per_node].scales {
            Some(region) => region
                .slot(range.start..range.start + self.scale_len)
                .unwrap_or_default(),
            None => &[],
        }
    }
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        // No lock: one atomic decrement on this shard's line (Release: see slot.rs).
        self.cache.slots.unpin(self.slot as usize, self.shard);
    }
}

// Entries are handed between threads, and the cache is shared by them.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ExpertCache>();
    send_sync::<Entry<'_>>();
    send_sync::<StagingPool>();
};
