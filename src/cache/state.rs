//! The locked half of the cache: the authoritative key index, each slot's state, the
//! per-node free lists and clock hands, and the counters that only misses change.

use std::collections::HashMap;

use super::Key;
use super::hints::Hints;
use super::slot::{Clock, Slots};
use crate::error::Error;

/// What a slot holds, as the lock holder sees it.
#[derive(Debug)]
pub(super) enum SlotState {
    /// Nothing: on its node's free list.
    Free,
    /// A thread is copying an expert in; the lock is not held.
    Loading,
    /// Holds a published expert (its word has `READY`, or pins being dropped).
    Ready,
    /// The load failed while others waited for it: each takes a copy of the loader's
    /// error (the same variant, [`Error::replicate`]), and the last one frees the slot.
    Failed(Box<Error>),
}

#[derive(Debug)]
pub(super) struct SlotMeta {
    pub key: Key,
    pub state: SlotState,
    /// Threads waiting for this slot's load.
    pub waiters: u32,
    /// Pages may be resident (written since the last release).
    pub dirty: bool,
    /// The slot's word in the hint table while it is indexed there.
    pub hint: Option<usize>,
}

/// Per-node bookkeeping.
#[derive(Debug)]
pub(super) struct NodeList {
    /// Free slots (global ids), popped from the end.
    pub free: Vec<u32>,
    /// The clock hand: the next of the node's slots (0-based within the node) to visit.
    pub hand: usize,
    /// Slots holding an entry or being loaded.
    pub used: usize,
}

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Counters {
    pub evictions: u64,
    pub loads: u64,
    pub load_failures: u64,
    pub bytes_loaded: u64,
}

#[derive(Debug)]
pub(super) struct State {
    pub index: HashMap<Key, u32>,
    pub slots: Vec<SlotMeta>,
    pub nodes: Vec<NodeList>,
    pub counters: Counters,
    slots_per_node: usize,
}

impl State {
    /// Every slot free; slot 0 of each node is taken first. `dirty`: pages were faulted
    /// in at creation (populate).
    pub(crate) fn new(nodes: usize, slots_per_node: usize, dirty: bool) -> State {
        let total = nodes * slots_per_node;
        State {
            index: HashMap::with_capacity(total),
            slots: (0..total)
                .map(|_| SlotMeta {
                    key: (0, 0),
                    state: SlotState::Free,
                    waiters: 0,
                    dirty,
                    hint: None,
                })
                .collect(),
            nodes: (0..nodes)
                .map(|n| NodeList {
                    free: (0..slots_per_node)
                        .rev()
                        .map(|s| (n * slots_per_node + s) as u32)
                        .collect(),
                    hand: 0,
                    used: 0,
                })
                .collect(),
            counters: Counters::default(),
            slots_per_node,
        }
    }

    /// CLOCK over the node's ready slots: from the hand on, a referenced slot is spared
    /// once (its bit cleared), the first unreferenced unpinned one is evicted (its word
    /// cleared; the caller finishes with [`State::forget`]). Two passes find a victim
    /// unless every ready slot is pinned, or hits re-reference slots as fast as the hand
    /// clears them: a third pass then takes any unpinned slot. `None`: all are held.
    pub(crate) fn victim(&mut self, node: usize, slots: &Slots) -> Option<u32> {
        let n = self.slots_per_node;
        let base = node * n;
        for pass in 0..3 {
            for _ in 0..n {
                let i = self.nodes[node].hand;
                self.nodes[node].hand = (i + 1) % n;
                let slot = base + i;
                if matches!(self.slots[slot].state, SlotState::Ready)
                    && slots.clock(slot, pass < 2) == Clock::Evicted
                {
                    return Some(slot as u32);
                }
            }
        }
        None
    }

    /// After [`State::victim`]: the slot leaves the index and the hints, and is free
    /// (not yet on a free list: the caller reuses or frees it).
    pub(crate) fn forget(&mut self, slot: u32, hints: &Hints) {
        let meta = &mut self.slots[slot as usize];
        self.index.remove(&meta.key);
        if let Some(position) = meta.hint.take() {
            hints.remove(position);
        }
        meta.state = SlotState::Free;
        self.counters.evictions += 1;
    }

    /// A free slot back on its node's free list.
    pub(crate) fn free_slot(&mut self, slot: u32) {
        self.slots[slot as usize].state = SlotState::Free;
        self.nodes[slot as usize / self.slots_per_node]
            .free
            .push(slot);
    }

    /// A free slot of the node, or a victim's; `None` when every slot is held (pinned,
    /// loading, or failed with waiters).
    pub(crate) fn take_slot(&mut self, node: usize, slots: &Slots, hints: &Hints) -> Option<u32> {
        if let Some(slot) = self.nodes[node].free.pop() {
            return Some(slot);
        }
        let slot = self.victim(node, slots)?;
        self.forget(slot, hints);
        self.nodes[node].used -= 1;
        Some(slot)
    }

    /// Marks a taken slot as being loaded with `key`.
    pub(crate) fn mark_loading(&mut self, slot: u32, key: Key) {
        let meta = &mut self.slots[slot as usize];
        meta.key = key;
        meta.state = SlotState::Loading;
        meta.dirty = true;
        self.index.insert(key, slot);
        self.nodes[slot as usize / self.slots_per_node].used += 1;
    }
}
