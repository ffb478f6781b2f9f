//! The lock-free half of a slot: one atomic word (pins, `READY`, the CLOCK reference bit)
//! and the key and lengths it publishes. A hit reads and pins a slot through this alone;
//! the cache's mutex is for misses and evictions.
//!
//! # The protocol and its memory orderings
//!
//! - **Publish** (the loader, under the lock, after copying the expert in): store the key
//!   and the lengths (relaxed), then `word = READY | 1` with `Release` (the loader's own
//!   [`Entry`](super::Entry) is the one pin). Everything the loader wrote before — the
//!   bytes in the regions, the key, the lengths — happens-before whatever a thread does
//!   after an `Acquire` read of this store or of a later read-modify-write of the word
//!   (every other change of the word is an RMW, so they all continue its release
//!   sequence).
//! - **Pin** (a hit, no lock): `compare_exchange(w, (w + 1) | REFERENCED)` with `Acquire`,
//!   only from a word with `READY` set. After it succeeds the key is re-read: it cannot
//!   change while the pin lives (see *evict*), and the `Acquire` makes the loader's bytes
//!   visible. A slot that turns out to hold another key (it was refilled between the
//!   hint and the pin) is unpinned and skipped: the reader never reads its bytes.
//! - **Unpin** (an entry's drop): `fetch_sub(1)` with `Release`, so that the entry's reads
//!   of the bytes happen-before an eviction that observes the count at 0.
//! - **Evict** (under the lock): `compare_exchange(w, 0)` with `Acquire` from a word that
//!   is `READY` with no pins. Success means no pin exists and none can be taken (`READY`
//!   is clear; pins are only taken from `READY` words), and the `Acquire` orders every
//!   earlier reader's unpin (and so its reads) before the slot is rewritten. A failed
//!   exchange (a hit pinned it meanwhile) leaves the slot alone.
//!
//! A slot that is not `READY` is written only by the thread holding the lock (evicting,
//! publishing) or the one loader that took it: no reader can pin it, so no reader sees a
//! half-loaded slot. The key fields are atomics because a reader may read them
//! speculatively (before pinning, to skip slots of other keys): such a read is only a
//! filter, confirmed after the pin.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::Key;

/// Live pins (entries) of the slot, in the low 32 bits.
const PINS: u64 = u32::MAX as u64;
/// The slot holds a published expert: hits may pin it.
const READY: u64 = 1 << 32;
/// Used since the clock hand last passed (CLOCK's reference bit), set by every hit.
const REFERENCED: u64 = 1 << 33;

/// One slot's atomics, on a cache line of their own: a hit writes its slot's line only,
/// so threads hitting different slots do not invalidate each other's lines.
#[derive(Debug, Default)]
#[repr(align(64))]
pub(super) struct Shared {
    word: AtomicU64,
    layer: AtomicUsize,
    expert: AtomicUsize,
    weight_len: AtomicUsize,
    scale_len: AtomicUsize,
    /// Hits on this slot since the cache was built (summed by `stats`): a counter on the
    /// line the hit writes anyway, rather than one shared line every hit would write.
    hits: AtomicU64,
}

/// What the pinner learns: the bytes of each tensor the slot holds.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lens {
    pub weights: usize,
    pub scales: usize,
}

/// What one step of the clock hand did to a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Clock {
    /// Not ready, pinned, or pinned meanwhile: left alone.
    Held,
    /// Referenced since the last pass: the bit is cleared (its second chance).
    Spared,
    /// Evicted: not ready, no pins; the caller owns the slot now.
    Evicted,
}

impl Shared {
    /// Pins the slot if it is ready and holds `key`, setting its reference bit; counts a
    /// hit if asked. Lock-free. `None`: not ready, another key, or `u32::MAX` pins.
    pub(super) fn pin(&self, key: Key, count_hit: bool) -> Option<Lens> {
        // A filter only (relaxed, possibly mid-refill): confirmed after the pin.
        if !self.holds(key) {
            return None;
        }
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            if word & READY == 0 || word & PINS == PINS {
                return None;
            }
            match self.word.compare_exchange_weak(
                word,
                (word + 1) | REFERENCED,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => word = now,
            }
        }
        // Pinned: the key and lengths are those of the publish our Acquire read from, and
        // stay so until we unpin.
        if !self.holds(key) {
            self.unpin();
            return None;
        }
        if count_hit {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        Some(Lens {
            weights: self.weight_len.load(Ordering::Relaxed),
            scales: self.scale_len.load(Ordering::Relaxed),
        })
    }

    fn holds(&self, key: Key) -> bool {
        self.layer.load(Ordering::Relaxed) == key.0 && self.expert.load(Ordering::Relaxed) == key.1
    }

    /// Drops one pin (an entry's drop).
    pub(super) fn unpin(&self) {
        self.word.fetch_sub(1, Ordering::Release);
    }

    /// Publishes a loaded slot, pinned once for the loader's entry. Only for a slot that
    /// is not ready (free, or evicted by the caller), under the cache's lock.
    pub(super) fn publish(&self, key: Key, lens: Lens) {
        self.layer.store(key.0, Ordering::Relaxed);
        self.expert.store(key.1, Ordering::Relaxed);
        self.weight_len.store(lens.weights, Ordering::Relaxed);
        self.scale_len.store(lens.scales, Ordering::Relaxed);
        // No one else writes a word without READY (pins are taken only from READY
        // words), so a plain store is exact.
        self.word.store(READY | 1, Ordering::Release);
    }

    /// One step of the clock hand over a ready slot, under the cache's lock. With
    /// `second_chance`, a referenced slot is spared (its bit cleared); without it (the
    /// sweep's last pass, when hits keep setting bits), any unpinned slot is evicted.
    pub(super) fn clock(&self, second_chance: bool) -> Clock {
        let word = self.word.load(Ordering::Relaxed);
        if word & READY == 0 || word & PINS != 0 {
            return Clock::Held;
        }
        if second_chance && word & REFERENCED != 0 {
            // Relaxed: the bit steers replacement and guards no data. A hit between the
            // load above and this clear loses its mark: at worst an early eviction (a
            // reload later), never a wrong byte.
            self.word.fetch_and(!REFERENCED, Ordering::Relaxed);
            return Clock::Spared;
        }
        match self
            .word
            .compare_exchange(word, 0, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => Clock::Evicted,
            Err(_) => Clock::Held,
        }
    }

    /// Hits counted on this slot so far.
    pub(super) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Ready with no pins now (a snapshot: a hit may pin it a moment later).
    pub(super) fn evictable(&self) -> bool {
        let word = self.word.load(Ordering::Relaxed);
        word & READY != 0 && word & PINS == 0
    }

    /// Live pins now (a snapshot).
    #[cfg(test)]
    pub(super) fn pins(&self) -> u64 {
        self.word.load(Ordering::Relaxed) & PINS
    }
}
