//! The lock-free half of the slots: per slot an atomic word (`READY`, the CLOCK reference
//! bit) with the key and lengths it publishes, and pin counts split by CPU. A hit reads
//! and pins a slot through these alone; the cache's mutex is for misses and evictions.
//!
//! # Why the pin counts are split
//!
//! Threads serving one model hit the same hot experts. A pin count per slot would be one
//! cache line that every hit on that expert writes, bouncing between cores on each hit
//! (measured: two threads on 64 keys got 0.35× one thread's hits/s). So each slot has one
//! count per *shard* — the CPU the pinning thread runs on, modulo a power of two — laid
//! out shard-major: a thread writes only its own shard's lines, and the slot's word stays
//! read-mostly (a hit sets the reference bit only when it is clear). The [`Entry`]
//! remembers its shard, so a thread that migrates meanwhile still unpins where it pinned.
//!
//! # The protocol and its memory orderings
//!
//! - **Publish** (the loader, under the lock, after copying the expert in): count the
//!   loader's pin in its shard, store the key and lengths (relaxed), then
//!   `word = READY` with `Release`. Everything the loader wrote before — the bytes in the
//!   regions, the key, the lengths — happens-before whatever a thread does after an
//!   acquiring read of the word that sees it.
//! - **Pin** (a hit, no lock): `count[shard][slot] += 1` (`SeqCst`), then load the word
//!   (`SeqCst`): if it is `READY` and the key matches, the pin holds; otherwise undo it
//!   and skip the slot. The load acquires the publish, so the bytes are visible.
//! - **Unpin** (an entry's drop): `count[shard][slot] -= 1` with `Release`, so that the
//!   entry's reads happen-before an eviction that reads the count as 0.
//! - **Evict** (under the lock): clear `READY` (`SeqCst`), then read every shard's count
//!   for the slot (`SeqCst`). All 0: evicted; else set `READY` again and leave the slot.
//!
//! The pin and the eviction are Dekker's pattern: each writes its own location, then reads
//! the other's, all `SeqCst`. In the single total order one of the two writes comes
//! first, so either the pinner sees `READY` cleared (and backs off without reading a
//! byte), or the evictor sees the count (and keeps the slot); both may happen, never
//! neither. A count of 0 read by the evictor is the unpin's `Release` (or the initial
//! value), so every reader's reads happen-before the slot is rewritten. A reader that
//! backed off from a slot whose eviction was then abandoned takes the locked path, which
//! finds it ready.
//!
//! A slot that is not `READY` is written only by the thread holding the lock (evicting,
//! publishing) or the one loader that took it, so no reader sees a half-loaded slot. The
//! key fields are atomics because a reader may read them speculatively (before pinning,
//! to skip slots of other keys): such a read is only a filter, confirmed after the pin.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::Key;
use crate::topology;

/// The slot holds a published expert: hits may pin it.
const READY: u64 = 1;
/// Used since the clock hand last passed (CLOCK's reference bit), set by hits.
const REFERENCED: u64 = 2;
/// At most this many shards of pin counts (a power of two).
const MAX_SHARDS: usize = 64;
/// `AtomicU32`s per cache line: each shard's counts start on a line of their own.
const PER_LINE: usize = 16;

/// One slot's word, key and lengths, on a cache line of their own (hits only read it,
/// except to set a clear reference bit).
#[derive(Debug, Default)]
#[repr(align(64))]
struct Shared {
    word: AtomicU64,
    layer: AtomicUsize,
    expert: AtomicUsize,
    weight_len: AtomicUsize,
    scale_len: AtomicUsize,
}

/// One cache line of pin counts (16 slots of one shard): the shards never share a line.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Counts([AtomicU32; PER_LINE]);

/// A counter alone on its cache line.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Line(AtomicU64);

/// What the pinner learns: the bytes of each tensor the slot holds.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lens {
    pub weights: usize,
    pub scales: usize,
}

/// A pin: where to unpin.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pin {
    pub lens: Lens,
    pub shard: u32,
}

/// What one step of the clock hand did to a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Clock {
    /// Not ready, or pinned: left alone.
    Held,
    /// Referenced since the last pass: the bit is cleared (its second chance).
    Spared,
    /// Evicted: not ready, no pins; the caller owns the slot now.
    Evicted,
}

/// Every slot's lock-free state.
#[derive(Debug)]
pub(super) struct Slots {
    shared: Box<[Shared]>,
    /// Pin counts, shard-major, in whole lines: slot `i` of shard `h` is word `i % 16` of
    /// line `h * stride + i / 16`.
    counts: Box<[Counts]>,
    /// Lines per shard.
    stride: usize,
    /// Shards - 1 (a power of two minus one).
    mask: usize,
    /// Hits per shard.
    hits: Box<[Line]>,
}

impl Slots {
    /// `slots` slots, free; one shard per CPU up to [`MAX_SHARDS`]: 4 bytes per slot per
    /// shard, next to a slot's pages of at least 4 KiB each.
    pub(crate) fn new(slots: usize) -> Slots {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let shards = cpus.next_power_of_two().min(MAX_SHARDS);
        let stride = slots.div_ceil(PER_LINE);
        Slots {
            shared: (0..slots).map(|_| Shared::default()).collect(),
            counts: (0..stride * shards).map(|_| Counts::default()).collect(),
            stride,
            mask: shards - 1,
            hits: (0..shards).map(|_| Line::default()).collect(),
        }
    }

    fn count(&self, shard: usize, slot: usize) -> &AtomicU32 {
        &self.counts[shard * self.stride + slot / PER_LINE].0[slot % PER_LINE]
    }

    /// Pins `slot` if it is ready and holds `key`; marks it referenced; counts a hit if
    /// asked. Lock-free. `None`: no such slot, not ready, or another key.
    #[inline]
    pub(crate) fn pin(&self, slot: usize, key: Key, count_hit: bool) -> Option<Pin> {
        let s = self.shared.get(slot)?;
        // Filters only (relaxed, possibly mid-refill): confirmed after the pin.
        if !s.holds(key) || s.word.load(Ordering::Relaxed) & READY == 0 {
            return None;
        }
        let shard = topology::current_cpu() & self.mask;
        let count = self.count(shard, slot);
        // Refuse a pin past 2^31 live entries of one slot on one shard, well before the
        // count could wrap to the 0 an evictor reads as "unpinned".
        if count.load(Ordering::Relaxed) >= u32::MAX / 2 {
            return None;
        }
        count.fetch_add(1, Ordering::SeqCst);
        let word = s.word.load(Ordering::SeqCst);
        if word & READY == 0 || !s.holds(key) {
            count.fetch_sub(1, Ordering::Release);
            return None;
        }
        if word & REFERENCED == 0 {
            s.word.fetch_or(REFERENCED, Ordering::Relaxed);
        }
        if count_hit {
            self.hits[shard].0.fetch_add(1, Ordering::Relaxed);
        }
        Some(Pin {
            lens: Lens {
                weights: s.weight_len.load(Ordering::Relaxed),
                scales: s.scale_len.load(Ordering::Relaxed),
            },
            shard: shard as u32,
        })
    }

    /// Drops a pin taken by [`Slots::pin`] or [`Slots::publish`].
    #[inline]
    pub(crate) fn unpin(&self, slot: usize, shard: u32) {
        self.count(shard as usize, slot)
            .fetch_sub(1, Ordering::Release);
    }

    /// Publishes a loaded slot, pinned once for the loader's entry (the pin's shard is
    /// returned). Only for a slot that is not ready (free, or evicted by the caller),
    /// under the cache's lock.
    pub(crate) fn publish(&self, slot: usize, key: Key, lens: Lens) -> u32 {
        let shard = topology::current_cpu() & self.mask;
        self.count(shard, slot).fetch_add(1, Ordering::Relaxed);
        let s = &self.shared[slot];
        s.layer.store(key.0, Ordering::Relaxed);
        s.expert.store(key.1, Ordering::Relaxed);
        s.weight_len.store(lens.weights, Ordering::Relaxed);
        s.scale_len.store(lens.scales, Ordering::Relaxed);
        s.word.store(READY, Ordering::Release);
        shard as u32
    }

    /// Whether any shard counts a pin of `slot` (`SeqCst`: the evictor's half of the
    /// Dekker pattern).
    fn pinned(&self, slot: usize) -> bool {
        (0..=self.mask).any(|shard| self.count(shard, slot).load(Ordering::SeqCst) != 0)
    }

    /// One step of the clock hand over a ready slot, under the cache's lock. With
    /// `second_chance`, a referenced slot is spared (its bit cleared); without it (the
    /// sweep's last pass, when hits keep setting bits), any unpinned slot is evicted.
    pub(crate) fn clock(&self, slot: usize, second_chance: bool) -> Clock {
        let s = &self.shared[slot];
        let word = s.word.load(Ordering::Relaxed);
        if word & READY == 0 {
            return Clock::Held;
        }
        if second_chance && word & REFERENCED != 0 {
            // Relaxed: the bit steers replacement and guards no data. A hit setting it
            // meanwhile may lose its mark: at worst an early eviction (a reload later),
            // never a wrong byte.
            s.word.fetch_and(!REFERENCED, Ordering::Relaxed);
            return Clock::Spared;
        }
        s.word.fetch_and(!READY, Ordering::SeqCst);
        if self.pinned(slot) {
            // A pinner backing off from the cleared bit finds the slot through the lock.
            s.word.fetch_or(READY, Ordering::Release);
            return Clock::Held;
        }
        s.word.store(0, Ordering::Relaxed);
        Clock::Evicted
    }

    /// Ready with no pins now (a snapshot: a hit may pin it a moment later).
    pub(crate) fn evictable(&self, slot: usize) -> bool {
        self.shared[slot].word.load(Ordering::Relaxed) & READY != 0 && !self.pinned(slot)
    }

    /// Hits counted so far.
    pub(crate) fn hits(&self) -> u64 {
        self.hits.iter().map(|h| h.0.load(Ordering::Relaxed)).sum()
    }

    /// Live pins of `slot` now (a snapshot).
    #[cfg(test)]
    pub(crate) fn pins(&self, slot: usize) -> u64 {
        (0..=self.mask)
            .map(|shard| u64::from(self.count(shard, slot).load(Ordering::Relaxed)))
            .sum()
    }

    /// Slots.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shared.len()
    }
}

impl Shared {
    fn holds(&self, key: Key) -> bool {
        self.layer.load(Ordering::Relaxed) == key.0 && self.expert.load(Ordering::Relaxed) == key.1
    }
}
