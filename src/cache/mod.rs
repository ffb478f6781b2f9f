//! `ExpertCache`: an LRU of experts in fixed slots, one weights region and one scales
//! region per node, each bound to its node once before first touch; and `StagingPool`,
//! reusable page-aligned buffers that bind nothing.
//!
//! The cache's mappings do not grow with churn: an eviction reuses the slot's pages in
//! place (no `munmap`, no new `mbind`), so a cache over `n` nodes keeps its `2 × n`
//! regions (`n` without scales) however many entries pass through it. Compare one slab
//! per entry, bound one by one, which costs about two mappings per entry and an `mbind`
//! per fill.
//!
//! # Concurrency
//!
//! One mutex guards the key index, the per-node LRU lists and the slot states; it is
//! held only for bookkeeping, never while bytes are copied. A miss marks its slot
//! *loading*, releases the lock, copies the expert in, and re-takes the lock to publish:
//! hits on other keys go on meanwhile. A second thread missing on a key being loaded
//! waits on a condition variable until the first publishes (or gets its error). An
//! [`Entry`] pins its slot: a pinned slot is never evicted or written.
//!
//! When every slot of the node a miss wants is pinned, `get_or_load` returns an error at
//! once (it does not wait): the caller holds too many entries for the capacity it chose.
//!
//! # Safety
//!
//! No raw pointers here: the only `unsafe` is calling the region's per-range accessors
//! ([`Region::slot_mut_unchecked`], [`Region::release_unchecked`]), whose contract (no
//! other reference to the range meanwhile) the slot states under the lock guarantee: a
//! slot is written only while it is *loading* (by the one thread that marked it so) and
//! released only while it is *free*; [`Entry`] reads only slots that are *ready* and
//! pinned, which no one writes or releases; and the cache never makes a slice of a whole
//! region. The staging pool keeps its buffers apart with a free list the same way.
#![allow(unsafe_code)]

mod staging;

pub use staging::{Staging, StagingPool};

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::node::{Node, NodeSet};
use crate::page::page_size;
use crate::policy::{MbindFlags, MemPolicy, Placement};
use crate::region::{Advice, Region, resident_pages};
use crate::source::{ExpertSource, Kind};
use crate::{diag, topology};

/// The key of an entry: `(layer, expert)`.
pub type Key = (usize, usize);

const NONE: u32 = u32::MAX;
const HUGE_PAGE: usize = 2 << 20;

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
}

/// What a slot holds.
#[derive(Debug)]
enum SlotState {
    /// Nothing: on its node's free list.
    Free,
    /// A thread is copying an expert in; the lock is not held.
    Loading,
    /// Holds an expert; on its node's LRU list.
    Ready,
    /// The load failed while others waited for it: each takes a copy of the loader's
    /// error (the same variant, [`Error::replicate`]), and the last one frees the slot.
    Failed(Box<Error>),
}

#[derive(Debug)]
struct Slot {
    key: Key,
    state: SlotState,
    /// Live [`Entry`]s of this slot.
    pins: u32,
    /// Threads waiting for this slot's load.
    waiters: u32,
    /// Bytes of the loaded tensors (a source may be shorter than the slot).
    weight_len: usize,
    scale_len: usize,
    /// Pages may be resident (written since the last release).
    dirty: bool,
    /// LRU neighbours (global slot ids): `prev` is more recently used.
    prev: u32,
    next: u32,
}

/// Per-node bookkeeping: an intrusive LRU list over the node's slots and a free list.
#[derive(Debug)]
struct NodeList {
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    free: Vec<u32>,
    used: usize,
}

#[derive(Debug, Default)]
struct Counters {
    hits: u64,
    misses: u64,
    evictions: u64,
    loads: u64,
    load_failures: u64,
    bytes_loaded: u64,
}

#[derive(Debug)]
struct State {
    index: HashMap<Key, u32>,
    slots: Vec<Slot>,
    nodes: Vec<NodeList>,
    counters: Counters,
}

/// One node's regions.
#[derive(Debug)]
struct NodeRegions {
    node: Node,
    weights: Region,
    scales: Option<Region>,
    placement: Placement,
}

/// An LRU cache of experts in fixed slots per node. See the [module docs](self).
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
    state: Mutex<State>,
    published: Condvar,
}

/// A cached expert, pinned in its slot while this lives (it is neither evicted nor
/// overwritten).
#[derive(Debug)]
pub struct Entry<'a> {
    cache: &'a ExpertCache,
    slot: u32,
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
    /// `u32::MAX` slots in all, `mmap` fails, or `mbind` fails with an errno other than
    /// `EPERM`/`ENOSYS` (a node this process may not use is
    /// [`Error::NodeNotAllowed`]).
    pub fn new(
        nodes: NodeSet,
        slots_per_node: usize,
        weight_bytes: usize,
        scale_bytes: usize,
        options: CacheOptions,
    ) -> Result<ExpertCache> {
        const OP: &str = "ExpertCache::new";
        if nodes.is_empty() {
            return Err(Error::empty(OP, "nodes in the cache's node set"));
        }
        if slots_per_node == 0 {
            return Err(Error::empty(
                OP,
                "slots per node (capacity 0): a cache needs at least one slot per node",
            ));
        }
        if weight_bytes == 0 {
            return Err(Error::empty(OP, "weight bytes (weight_bytes is 0)"));
        }
        let page = page_size();
        let stride = |bytes: usize, what: &str| {
            bytes
                .checked_next_multiple_of(page)
                .ok_or_else(|| Error::overflow(OP, format!("{what} {bytes} rounded to pages")))
        };
        let weight_stride = stride(weight_bytes, "weight_bytes")?;
        let scale_stride = stride(scale_bytes, "scale_bytes")?;
        let total_slots = slots_per_node
            .checked_mul(nodes.len())
            .filter(|&n| n < NONE as usize)
            .ok_or_else(|| {
                Error::overflow(
                    OP,
                    format!(
                        "the slot count, {slots_per_node} slots on each of {} nodes (at most {} \
                         in all),",
                        nodes.len(),
                        NONE - 1
                    ),
                )
            })?;
        let region_len = |stride: usize, what: &str| {
            stride.checked_mul(slots_per_node).ok_or_else(|| {
                Error::overflow(
                    OP,
                    format!("{slots_per_node} slots × {what} stride {stride}"),
                )
            })
        };
        let weights_len = region_len(weight_stride, "weight")?;
        let scales_len = region_len(scale_stride, "scale")?;

        let mut regions = Vec::with_capacity(nodes.len());
        for node in nodes.iter() {
            let weights = node_region(weights_len, node, options)?;
            let placement = weights.1;
            let scales = if scale_bytes == 0 {
                None
            } else {
                Some(node_region(scales_len, node, options)?.0)
            };
            regions.push(NodeRegions {
                node,
                weights: weights.0,
                scales,
                placement,
            });
        }

        let slots = (0..total_slots)
            .map(|_| Slot {
                key: (0, 0),
                state: SlotState::Free,
                pins: 0,
                waiters: 0,
                weight_len: 0,
                scale_len: 0,
                dirty: options.populate,
                prev: NONE,
                next: NONE,
            })
            .collect();
        let lists = (0..nodes.len())
            .map(|n| NodeList {
                head: NONE,
                tail: NONE,
                // Popped from the end: slot 0 of the node is taken first.
                free: (0..slots_per_node)
                    .rev()
                    .map(|s| (n * slots_per_node + s) as u32)
                    .collect(),
                used: 0,
            })
            .collect();
        Ok(ExpertCache {
            regions,
            slots_per_node,
            weight_bytes,
            scale_bytes,
            weight_stride,
            scale_stride,
            state: Mutex::new(State {
                index: HashMap::with_capacity(total_slots),
                slots,
                nodes: lists,
                counters: Counters::default(),
            }),
            published: Condvar::new(),
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
        // A panic while the lock was held (only possible from an allocation failure in
        // bookkeeping) leaves no slot half-published: every state change is one
        // assignment. Go on with the state as it is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The entry for `(layer, expert)` wherever it lives, pinned; `None` if it is not
    /// cached (or still being loaded: this never waits). Counts a hit or a miss, and a
    /// hit makes the entry its node's most recently used.
    pub fn get(&self, layer: usize, expert: usize) -> Option<Entry<'_>> {
        let key = (layer, expert);
        let mut state = self.lock();
        let slot = match state.index.get(&key) {
            Some(&slot) if matches!(state.slots[slot as usize].state, SlotState::Ready) => slot,
            _ => {
                state.counters.misses += 1;
                return None;
            }
        };
        state.counters.hits += 1;
        Some(self.pin(&mut state, slot))
    }

    /// The entry for `(layer, expert)`, loaded from `source` on a miss.
    ///
    /// A hit returns the cached entry wherever it lives. A miss picks the node: `hint` if
    /// it is one of the cache's nodes, else the calling thread's node
    /// ([`topology::current_node`]) if it is, else the first node with a free or
    /// evictable slot. On that node it takes a free slot, or evicts the least recently
    /// used entry no one holds, copies the expert in (without holding the cache's lock),
    /// and returns it. A thread that misses on a key another thread is loading waits for
    /// that load and shares its result.
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
        const OP: &str = "ExpertCache::get_or_load";
        let key = (layer, expert);
        let mut state = self.lock();
        let mut counted = false;
        // A hit, or a wait for another thread's load of this key.
        while let Some(&slot) = state.index.get(&key) {
            match state.slots[slot as usize].state {
                SlotState::Ready => {
                    if !counted {
                        state.counters.hits += 1;
                    }
                    return Ok(self.pin(&mut state, slot));
                }
                SlotState::Loading => {
                    if !counted {
                        state.counters.misses += 1;
                        counted = true;
                    }
                    state.slots[slot as usize].waiters += 1;
                    // Until this key's load ends. Once published, the slot may even be
                    // evicted and refilled with another key before this thread wakes:
                    // then the index lookup below finds the key gone, and this thread
                    // loads it.
                    while matches!(state.slots[slot as usize].state, SlotState::Loading)
                        && state.slots[slot as usize].key == key
                    {
                        state = self
                            .published
                            .wait(state)
                            .unwrap_or_else(|e| e.into_inner());
                    }
                    let s = &mut state.slots[slot as usize];
                    s.waiters -= 1;
                    if let SlotState::Failed(loader_error) = &s.state {
                        // A failed slot with waiters stays off the free list until its last
                        // waiter frees it. Each waiter gets what the loader got: the same
                        // variant, so that it can react as the loader could.
                        let error = (s.key == key).then(|| Error::clone(loader_error));
                        if s.waiters == 0 {
                            self.free_slot(&mut state, slot);
                        }
                        if let Some(error) = error {
                            return Err(error);
                        }
                    }
                    // Ready, or refilled: look the key up again.
                }
                // Not indexed: a failed slot leaves the index when it fails.
                SlotState::Free | SlotState::Failed(_) => break,
            }
        }
        if !counted {
            state.counters.misses += 1;
        }

        let weight_len = source.bytes(Kind::Weights)?;
        let scale_len = source.bytes(Kind::Scales)?;
        for (kind, len, room) in [
            (Kind::Weights, weight_len, self.weight_bytes),
            (Kind::Scales, scale_len, self.scale_bytes),
        ] {
            if len > room {
                let what = format!("layer {layer} expert {expert} {}", kind.name());
                return Err(Error::too_large(OP, what, len, room, "a slot"));
            }
        }

        let node_index = self.choose_node(&state, hint)?;
        let slot = self
            .take_slot(&mut state, node_index)
            .ok_or(Error::CacheFull {
                op: OP,
                layer,
                expert,
                node: self.regions[node_index].node,
                capacity: self.slots_per_node,
            })?;
        {
            let s = &mut state.slots[slot as usize];
            s.key = key;
            s.state = SlotState::Loading;
            s.weight_len = weight_len;
            s.scale_len = scale_len;
            s.dirty = true;
        }
        state.index.insert(key, slot);
        state.nodes[node_index].used += 1;
        drop(state);

        let loaded = self.load(slot, source, weight_len, scale_len);

        let mut state = self.lock();
        let result = match loaded {
            Ok(()) => {
                state.counters.loads += 1;
                state.counters.bytes_loaded += (weight_len + scale_len) as u64;
                state.slots[slot as usize].state = SlotState::Ready;
                self.push_front(&mut state, slot);
                Ok(self.pin(&mut state, slot))
            }
            Err(error) => {
                state.counters.load_failures += 1;
                state.index.remove(&key);
                state.nodes[node_index].used -= 1;
                let s = &mut state.slots[slot as usize];
                if s.waiters == 0 {
                    s.state = SlotState::Free;
                    state.nodes[node_index].free.push(slot);
                } else {
                    s.state = SlotState::Failed(Box::new(error.clone()));
                }
                Err(error)
            }
        };
        drop(state);
        self.published.notify_all();
        result
    }

    /// Evicts unheld entries until each node holds at most `keep_per_node`, least
    /// recently used first, then gives the pages of every free slot back to the kernel
    /// (`MADV_DONTNEED`): the resident bytes shrink, the mappings and their binding stay,
    /// and a later load faults fresh pages on the same node. Returns the slots whose
    /// pages were given back.
    ///
    /// # Errors
    /// `madvise` fails (the slots released before it stay released).
    pub fn shrink(&self, keep_per_node: usize) -> Result<usize> {
        let mut state = self.lock();
        for n in 0..self.regions.len() {
            let mut cursor = state.nodes[n].tail;
            while state.nodes[n].used > keep_per_node && cursor != NONE {
                let prev = state.slots[cursor as usize].prev;
                if state.slots[cursor as usize].pins == 0 {
                    self.evict(&mut state, cursor);
                    state.nodes[n].used -= 1;
                    state.nodes[n].free.push(cursor);
                }
                cursor = prev;
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
                // SAFETY: a free slot has no Entry and no loader (both need the lock we
                // hold to leave the free list), so no reference to its ranges lives.
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

    /// Counters, per-node residency and the mappings in the cache's regions.
    ///
    /// # Errors
    /// `mincore` fails, or `/proc/self/maps` cannot be read.
    pub fn stats(&self) -> Result<CacheStats> {
        let (counters, used): (Counters, Vec<usize>) = {
            let state = self.lock();
            let c = &state.counters;
            (
                Counters {
                    hits: c.hits,
                    misses: c.misses,
                    evictions: c.evictions,
                    loads: c.loads,
                    load_failures: c.load_failures,
                    bytes_loaded: c.bytes_loaded,
                },
                state.nodes.iter().map(|n| n.used).collect(),
            )
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
            hits: counters.hits,
            misses: counters.misses,
            evictions: counters.evictions,
            loads: counters.loads,
            load_failures: counters.load_failures,
            bytes_loaded: counters.bytes_loaded,
            nodes,
            mappings: diag::maps_overlapping(&self.spans())?,
        })
    }

    /// The node index a miss fills: the hint, the caller's node, or the first node with
    /// a free or evictable slot (the first node when none has one: its error names it).
    fn choose_node(&self, state: &State, hint: Option<Node>) -> Result<usize> {
        let position = |node: Node| self.regions.iter().position(|r| r.node == node);
        if let Some(i) = hint.and_then(position) {
            return Ok(i);
        }
        if let Some(i) = position(topology::current_node()?) {
            return Ok(i);
        }
        Ok((0..self.regions.len())
            .find(|&n| !state.nodes[n].free.is_empty() || self.evictable(state, n).is_some())
            .unwrap_or(0))
    }

    /// The node's least recently used entry that no one holds.
    fn evictable(&self, state: &State, node: usize) -> Option<u32> {
        let mut cursor = state.nodes[node].tail;
        while cursor != NONE {
            let s = &state.slots[cursor as usize];
            if s.pins == 0 && matches!(s.state, SlotState::Ready) {
                return Some(cursor);
            }
            cursor = s.prev;
        }
        None
    }

    /// A free slot of the node, or its evicted LRU entry's slot; `None` when every slot
    /// is held (pinned, loading, or failed with waiters).
    fn take_slot(&self, state: &mut State, node: usize) -> Option<u32> {
        if let Some(slot) = state.nodes[node].free.pop() {
            return Some(slot);
        }
        let slot = self.evictable(state, node)?;
        self.evict(state, slot);
        state.nodes[node].used -= 1;
        Some(slot)
    }

    /// Unlinks a ready, unpinned slot and forgets its key (the caller reuses or frees it).
    fn evict(&self, state: &mut State, slot: u32) {
        self.unlink(state, slot);
        let key = state.slots[slot as usize].key;
        state.index.remove(&key);
        state.slots[slot as usize].state = SlotState::Free;
        state.counters.evictions += 1;
    }

    fn free_slot(&self, state: &mut State, slot: u32) {
        state.slots[slot as usize].state = SlotState::Free;
        let node = slot as usize / self.slots_per_node;
        state.nodes[node].free.push(slot);
    }

    fn pin(&self, state: &mut State, slot: u32) -> Entry<'_> {
        self.unlink(state, slot);
        self.push_front(state, slot);
        let s = &mut state.slots[slot as usize];
        s.pins += 1;
        Entry {
            cache: self,
            slot,
            key: s.key,
            weight_len: s.weight_len,
            scale_len: s.scale_len,
        }
    }

    fn unlink(&self, state: &mut State, slot: u32) {
        let node = slot as usize / self.slots_per_node;
        let (prev, next) = {
            let s = &state.slots[slot as usize];
            (s.prev, s.next)
        };
        if prev == NONE {
            if state.nodes[node].head == slot {
                state.nodes[node].head = next;
            }
        } else {
            state.slots[prev as usize].next = next;
        }
        if next == NONE {
            if state.nodes[node].tail == slot {
                state.nodes[node].tail = prev;
            }
        } else {
            state.slots[next as usize].prev = prev;
        }
        let s = &mut state.slots[slot as usize];
        s.prev = NONE;
        s.next = NONE;
    }

    fn push_front(&self, state: &mut State, slot: u32) {
        let node = slot as usize / self.slots_per_node;
        let head = state.nodes[node].head;
        {
            let s = &mut state.slots[slot as usize];
            s.prev = NONE;
            s.next = head;
        }
        if head == NONE {
            state.nodes[node].tail = slot;
        } else {
            state.slots[head as usize].prev = slot;
        }
        state.nodes[node].head = slot;
    }

    /// The byte ranges of a slot in its node's weights and scales regions.
    fn ranges(&self, slot: u32) -> (Range<usize>, Range<usize>) {
        let i = slot as usize % self.slots_per_node;
        (
            i * self.weight_stride..i * self.weight_stride + self.weight_bytes,
            i * self.scale_stride..i * self.scale_stride + self.scale_bytes,
        )
    }

    fn load(
        &self,
        slot: u32,
        source: &ExpertSource<'_>,
        weight_len: usize,
        scale_len: usize,
    ) -> Result<()> {
        let (weights, scales) = self.ranges(slot);
        let r = &self.regions[slot as usize / self.slots_per_node];
        {
            // SAFETY: the slot is Loading: only this thread, which marked it so under the
            // lock, touches its ranges until it publishes. No Entry of it lives (it was
            // free or evicted unpinned) and `shrink` skips slots that are not free.
            let dest = unsafe { r.weights.slot_mut_unchecked(weights) }?;
            source.read_tensor(Kind::Weights, &mut dest[..weight_len])?;
        }
        if let Some(region) = &r.scales
            && scale_len > 0
        {
            // SAFETY: as above, for the slot's scales range.
            let dest = unsafe { region.slot_mut_unchecked(scales) }?;
            source.read_tensor(Kind::Scales, &mut dest[..scale_len])?;
        }
        Ok(())
    }
}

/// A region of `len` bytes bound to `node` before anything touches it.
fn node_region(len: usize, node: Node, options: CacheOptions) -> Result<(Region, Placement)> {
    let huge = options.huge_pages && len >= HUGE_PAGE;
    let align = if huge { HUGE_PAGE } else { page_size() };
    let mut region = Region::anonymous_aligned(len, align)?;
    let mut set = NodeSet::new();
    set.insert(node);
    let placement = region.bind(&MemPolicy::Bind(set), MbindFlags::empty())?;
    if huge {
        region.advise(Advice::HugePage)?;
    }
    if options.populate {
        region.populate_write()?;
    }
    Ok((region, placement))
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
        let mut state = self.cache.lock();
        let s = &mut state.slots[self.slot as usize];
        s.pins = s.pins.saturating_sub(1);
    }
}

// Entries are handed between threads, and the cache is shared by them.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ExpertCache>();
    send_sync::<Entry<'_>>();
    send_sync::<StagingPool>();
};
