//! The locked path of `get_or_load`: a key the hints did not find. It waits for a load in
//! flight, or takes a slot (free, or CLOCK's victim), copies the expert in without the
//! lock, and publishes it.

use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

use super::slot::Lens;
use super::state::{SlotState, State};
use super::{Entry, ExpertCache, Key};
use crate::error::{Error, Result};
use crate::node::Node;
use crate::source::{ExpertSource, Kind};
use crate::topology;

const OP: &str = "ExpertCache::get_or_load";

/// What the locked index says about a key.
enum Awaited<'a> {
    /// Ready (now, or after a load this thread waited for): pinned.
    Hit(Entry<'a>),
    /// Not cached: the lock, and whether a miss was counted already (by a wait).
    Absent(MutexGuard<'a, State>, bool),
}

impl ExpertCache {
    /// `get_or_load` past the hints: see its docs.
    pub(super) fn miss(
        &self,
        key: Key,
        source: &ExpertSource<'_>,
        hint: Option<Node>,
    ) -> Result<Entry<'_>> {
        let (mut state, counted) = match self.await_key(self.lock(), key)? {
            Awaited::Hit(entry) => return Ok(entry),
            Awaited::Absent(state, counted) => (state, counted),
        };
        if !counted {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        let lens = self.fits(key, source)?;
        let node = self.choose_node(&state, hint)?;
        let slot = state
            .take_slot(node, &self.slots, &self.hints)
            .ok_or(Error::CacheFull {
                op: OP,
                layer: key.0,
                expert: key.1,
                node: self.regions[node].node,
                capacity: self.slots_per_node,
            })?;
        state.mark_loading(slot, key);
        drop(state);
        let loaded = self.load(slot, source, lens);
        self.finish(key, slot, lens, loaded)
    }

    /// A hit under the lock, or a wait for this key's load, or `Absent`.
    fn await_key<'a>(&'a self, mut state: MutexGuard<'a, State>, key: Key) -> Result<Awaited<'a>> {
        let mut counted = false;
        while let Some(&slot) = state.index.get(&key) {
            match state.slots[slot as usize].state {
                SlotState::Ready => {
                    // No one evicts while we hold the lock: the pin fails only with
                    // 2^31 entries of this slot alive on one shard.
                    let entry = self.pin(slot, key, !counted).ok_or_else(|| {
                        Error::overflow(OP, format!("the pins of layer {} expert {}", key.0, key.1))
                    })?;
                    return Ok(Awaited::Hit(entry));
                }
                SlotState::Loading => {
                    if !counted {
                        self.misses.fetch_add(1, Ordering::Relaxed);
                        counted = true;
                    }
                    state = self.wait_for(state, slot, key)?;
                }
                // Not indexed: a failed slot leaves the index when it fails.
                SlotState::Free | SlotState::Failed(_) => break,
            }
        }
        Ok(Awaited::Absent(state, counted))
    }

    /// Waits until the load of `key` into `slot` ends; its error if it failed (then
    /// look the key up again).
    fn wait_for<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        slot: u32,
        key: Key,
    ) -> Result<MutexGuard<'a, State>> {
        state.slots[slot as usize].waiters += 1;
        // Once published, the slot may even be evicted and refilled with another key
        // before this thread wakes: the caller's lookup then finds the key gone, and
        // this thread loads it.
        while matches!(state.slots[slot as usize].state, SlotState::Loading)
            && state.slots[slot as usize].key == key
        {
            state = self
                .published
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
        let meta = &mut state.slots[slot as usize];
        meta.waiters -= 1;
        if let SlotState::Failed(loader_error) = &meta.state {
            // A failed slot with waiters stays off the free list until its last waiter
            // frees it. Each waiter gets what the loader got: the same variant, so that
            // it can react as the loader could.
            let error = (meta.key == key).then(|| Error::clone(loader_error));
            if meta.waiters == 0 {
                state.free_slot(slot);
            }
            if let Some(error) = error {
                return Err(error);
            }
        }
        Ok(state)
    }

    /// The source's lengths, if they fit a slot.
    fn fits(&self, key: Key, source: &ExpertSource<'_>) -> Result<Lens> {
        let lens = Lens {
            weights: source.bytes(Kind::Weights)?,
            scales: source.bytes(Kind::Scales)?,
        };
        for (kind, len, room) in [
            (Kind::Weights, lens.weights, self.weight_bytes),
            (Kind::Scales, lens.scales, self.scale_bytes),
        ] {
            if len > room {
                let what = format!("layer {} expert {} {}", key.0, key.1, kind.name());
                return Err(Error::too_large(OP, what, len, room, "a slot"));
            }
        }
        Ok(lens)
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
        let base = |n: usize| n * self.slots_per_node;
        Ok((0..self.regions.len())
            .find(|&n| {
                !state.nodes[n].free.is_empty()
                    || (base(n)..base(n) + self.slots_per_node).any(|s| {
                        matches!(state.slots[s].state, SlotState::Ready) && self.slots.evictable(s)
                    })
            })
            .unwrap_or(0))
    }

    /// Copies the expert into a slot this thread marked `Loading`. Each region written
    /// is opened (whole) for the copy and closed after: loads of other slots may hold it
    /// open meanwhile, and the last one to close makes it read-only again.
    fn load(&self, slot: u32, source: &ExpertSource<'_>, lens: Lens) -> Result<()> {
        let (weights, scales) = self.ranges(slot);
        let r = &self.regions[slot as usize / self.slots_per_node];
        {
            let window = r.weights.open_write()?;
            // SAFETY: the slot is Loading: only this thread, which marked it so under the
            // lock, touches its ranges until it publishes. Its word is not READY, so no
            // Entry of it lives or can be made (see slot.rs), and `shrink` releases only
            // free slots. `window` outlives `dest`.
            let dest = unsafe { r.weights.slot_mut_unchecked(weights) }?;
            source.read_tensor(Kind::Weights, &mut dest[..lens.weights])?;
            window.close()?;
        }
        if let Some(region) = &r.scales
            && lens.scales > 0
        {
            let window = region.open_write()?;
            // SAFETY: as above, for the slot's scales range.
            let dest = unsafe { region.slot_mut_unchecked(scales) }?;
            source.read_tensor(Kind::Scales, &mut dest[..lens.scales])?;
            window.close()?;
        }
        Ok(())
    }

    /// Publishes a load (pinned for the caller), or frees its slot and hands the error
    /// to the caller and to every waiter.
    fn finish(&self, key: Key, slot: u32, lens: Lens, loaded: Result<()>) -> Result<Entry<'_>> {
        let mut state = self.lock();
        let result = match loaded {
            Ok(()) => {
                let c = &mut state.counters;
                c.loads += 1;
                c.bytes_loaded += (lens.weights + lens.scales) as u64;
                let meta = &mut state.slots[slot as usize];
                meta.state = SlotState::Ready;
                meta.hint = self.hints.insert(key, slot);
                let shard = self.slots.publish(slot as usize, key, lens);
                Ok(Entry {
                    cache: self,
                    slot,
                    shard,
                    key,
                    weight_len: lens.weights,
                    scale_len: lens.scales,
                })
            }
            Err(error) => {
                state.counters.load_failures += 1;
                state.index.remove(&key);
                state.nodes[slot as usize / self.slots_per_node].used -= 1;
                if state.slots[slot as usize].waiters == 0 {
                    state.free_slot(slot);
                } else {
                    state.slots[slot as usize].state = SlotState::Failed(Box::new(error.clone()));
                }
                Err(error)
            }
        };
        drop(state);
        self.published.notify_all();
        result
    }
}
