//! The index a hit reads without the lock: an open-addressed table of `(tag, slot)` words.
//!
//! The table is a set of *hints*, not the truth: the locked `HashMap` in the cache's
//! state is. A hint may point to a slot that was refilled with another key since; the
//! reader confirms every candidate by pinning it and re-reading its key (see `slot.rs`).
//! A key whose window is full has no hint: its hits take the locked path, counted and
//! correct, only slower. With the table at 4× the slots and an 8-word window, a full
//! window is rare (the tests count that hits on 64 keys take no lock).
//!
//! Only the lock holder writes the table (insert at publish, remove at eviction), so the
//! first empty word of a window is found without a race. Readers load words `Relaxed`:
//! a word only names a candidate, and the pin's `Acquire` orders everything it guards.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Key;

/// Words a key may sit in, from its home position on.
const WINDOW: usize = 8;
/// An empty word (a tag is never 0).
const EMPTY: u64 = 0;

#[derive(Debug)]
pub(super) struct Hints {
    words: Box<[AtomicU64]>,
    mask: usize,
}

/// The key's hash: `(home position, tag)`. The tag (high bits, never 0) filters out most
/// other keys before their slot's line is read.
fn hash(key: Key) -> u64 {
    let h = (key.0 as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ key.1 as u64;
    // A second multiply mixes the expert's bits into the high half too.
    (h ^ (h >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// The high half of the hash, never 0: an empty word (0) matches no tag.
fn tag(h: u64) -> u64 {
    (h >> 32) | 1
}

impl Hints {
    /// A table for `slots` slots: 4× as many words, a power of two, at least a window.
    /// `slots` is below `u32::MAX` (checked by the caller), so this does not overflow a
    /// 64-bit `usize`; on a smaller one the count saturates and the allocation fails.
    pub(super) fn new(slots: usize) -> Hints {
        let len = slots
            .saturating_mul(4)
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX / 2 + 1)
            .max(WINDOW);
        Hints {
            words: (0..len).map(|_| AtomicU64::new(EMPTY)).collect(),
            mask: len - 1,
        }
    }

    /// The slots that may hold `key`, in window order.
    #[inline]
    pub(super) fn candidates(&self, key: Key) -> impl Iterator<Item = u32> + '_ {
        let h = hash(key);
        let (home, tag) = (h as usize, tag(h));
        (0..WINDOW).filter_map(move |i| {
            let word = self.words[(home + i) & self.mask].load(Ordering::Relaxed);
            (word >> 32 == tag).then_some(word as u32)
        })
    }

    /// Records `slot` as holding `key` in the first empty word of its window; the word's
    /// position, or `None` when the window is full. Under the cache's lock.
    pub(super) fn insert(&self, key: Key, slot: u32) -> Option<usize> {
        let h = hash(key);
        let word = tag(h) << 32 | u64::from(slot);
        (0..WINDOW)
            .map(|i| (h as usize + i) & self.mask)
            .find(|&p| self.words[p].load(Ordering::Relaxed) == EMPTY)
            .inspect(|&p| self.words[p].store(word, Ordering::Relaxed))
    }

    /// Empties the word at `position` (the slot is leaving its key). Under the lock.
    pub(super) fn remove(&self, position: usize) {
        if let Some(word) = self.words.get(position) {
            word.store(EMPTY, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
impl Hints {
    /// Empties every word: every key's hits must then take the locked path.
    pub(super) fn clear(&self) {
        for word in self.words.iter() {
            word.store(EMPTY, Ordering::Relaxed);
        }
    }
}
