//! Reading and reloading a packed store: the slots of an expert, their policy, release
//! and ensure. Lookups by node (`weights_local`, `weights_on`, `home_node`) are in
//! `replica`.

use super::arena::Arena;
use super::layer::{Layer, out_of_range};
use super::{ExpertSource, Kind, LayerSpec, PACK, PinStore, State, broken, slot_map};
use crate::error::{Error, Result};
use crate::policy::{MemPolicy, ModeFlags, Observed};
use crate::source::load;

impl PinStore {
    pub(super) fn layer(&self, layer: usize) -> Result<&Layer> {
        if self.state == State::Broken {
            return Err(broken("PinStore"));
        }
        self.layers
            .get(layer)
            .map(|b| &**b)
            .ok_or(Error::NotPacked {
                op: "PinStore",
                layer,
            })
    }

    pub(super) fn slot(&self, layer: usize, expert: usize, kind: Kind) -> Result<&[u8]> {
        let l = self.layer(layer)?;
        // The expert is checked against the layer whatever the tensor: a layer without
        // scales has empty scales for its experts only. A share's global id → its slot.
        let slot = l.slot_of(layer, expert)?;
        let Some(arena) = l.arena(kind) else {
            return Ok(&[]);
        };
        arena.slot(slot).ok_or(Error::Released {
            op: "PinStore",
            layer,
            expert,
            kind: kind.name(),
        })
    }

    /// Exactly the weight bytes loaded for `expert` of `layer`. `expert` is the global
    /// expert id, also in a layer packed as a share
    /// ([`PinStore::pack_layer_share`]).
    ///
    /// # Errors
    /// The layer is not packed, the expert is out of range (or not in the layer's share:
    /// [`Error::NotHeld`]), or its weights are released.
    pub fn weights(&self, layer: usize, expert: usize) -> Result<&[u8]> {
        self.slot(layer, expert, Kind::Weights)
    }

    /// Exactly the scale bytes loaded for `expert` of `layer` (empty if the layer has no
    /// scales).
    ///
    /// # Errors
    /// As [`PinStore::weights`].
    pub fn scales(&self, layer: usize, expert: usize) -> Result<&[u8]> {
        self.slot(layer, expert, Kind::Scales)
    }

    /// The policy the kernel holds for one tensor's slot (`get_mempolicy(MPOL_F_ADDR)`):
    /// the proof that a released slot kept its policy.
    ///
    /// # Errors
    /// The layer is not packed, the expert is out of range, the layer has no such
    /// tensor, or `get_mempolicy` fails with an errno other than `EPERM`/`ENOSYS`.
    pub fn slot_policy(
        &self,
        layer: usize,
        expert: usize,
        kind: Kind,
    ) -> Result<Observed<(MemPolicy, ModeFlags)>> {
        let l = self.layer(layer)?;
        let slot = l.slot_of(layer, expert)?;
        let arena = l.arena(kind).ok_or_else(|| {
            Error::empty(
                "PinStore",
                format!("{} region in layer {layer}", kind.name()),
            )
        })?;
        if slot >= arena.slots() {
            return Err(out_of_range(layer, expert, arena.slots()));
        }
        arena.slot_policy(slot)
    }

    /// Releases both tensors of an expert. See [`PinStore::release_kind`].
    ///
    /// # Errors
    /// As [`PinStore::release_kind`].
    pub fn release(&mut self, layer: usize, expert: usize) -> Result<()> {
        self.release_kind(layer, expert, Kind::Weights)?;
        self.release_kind(layer, expert, Kind::Scales)
    }

    /// Gives one tensor's pages back (`MADV_DONTNEED` over its slot, in every replica).
    /// The slot's addresses and the region's policy stay; reading it is an error until
    /// [`PinStore::ensure`] loads it again, which faults under the same policy.
    ///
    /// # Errors
    /// The layer is not packed, the expert is out of range, or the store was exported or
    /// attached ([`Error::Frozen`]).
    pub fn release_kind(&mut self, layer: usize, expert: usize, kind: Kind) -> Result<()> {
        self.check_open("PinStore::release")?;
        let expert = self.layer(layer)?.slot_of(layer, expert)?;
        self.arena_mut(layer, expert, kind)?;
        let Some(l) = self.layers.get_mut(layer) else {
            return Ok(());
        };
        let (first, others) = l.split_replicas_mut(kind);
        for arena in first.into_iter().chain(others.into_iter().map(|(_, a)| a)) {
            arena.release_slot(expert)?;
        }
        Ok(())
    }

    pub(super) fn arena_mut(
        &mut self,
        layer: usize,
        expert: usize,
        kind: Kind,
    ) -> Result<Option<&mut Arena>> {
        let l = self.layers.get_mut(layer).ok_or(Error::NotPacked {
            op: "PinStore",
            layer,
        })?;
        let experts = l.experts();
        if expert >= experts {
            return Err(out_of_range(layer, expert, experts));
        }
        Ok(l.arena_mut(kind))
    }

    /// Loads whatever of `expert` is released (weights, scales, or both) from `source`
    /// into its own slot, under the policy the region kept, its pieces laid out as in
    /// [`PinStore::pack_layer`] (the slot map follows). Loaded tensors are left as they
    /// are. A replicated layer reloads the first copy from `source` and copies it to the
    /// other replicas, each copy made on the replica's node. A region read-only at rest
    /// ([`StoreOptions::writable`](super::StoreOptions::writable) off) is opened, whole,
    /// for the fill and made read-only again after, whether the fill worked or not.
    ///
    /// # Errors
    /// As [`PinStore::release_kind`] (including [`Error::Frozen`]), a source larger than
    /// the slot (padding included), or a read fails (the slot then stays released).
    pub fn ensure(&mut self, layer: usize, expert: usize, source: &ExpertSource<'_>) -> Result<()> {
        self.check_open("PinStore::ensure")?;
        // From here on `expert` is the slot (the same number but in a share's layer).
        let expert = self.layer(layer)?.slot_of(layer, expert)?;
        let spec = *self.layer(layer)?.spec();
        // Loaded from the CPUs of the node the slot is bound to, if one (the first copy's
        // node for a replicated layer; the replicas are copied on theirs).
        let on_node = (expert < spec.experts)
            .then(|| self.expert_node(layer, spec.experts, expert))
            .flatten()
            .map(load::OnNode::enter);
        check_fits(layer, expert, &spec, source)?;
        for kind in Kind::ALL {
            let what = || describe(layer, expert, kind);
            let places = slot_map::places(&what, source, kind, self.piece_layout())?;
            let len = slot_map::extent(&places);
            if len > spec.bytes(kind) {
                return Err(Error::too_large(
                    "PinStore::ensure",
                    format!("{} (the pieces with their padding)", what()),
                    len,
                    spec.bytes(kind),
                    "the slot",
                ));
            }
            let Some(arena) = self.arena_mut(layer, expert, kind)? else {
                continue;
            };
            if arena.loaded(expert).is_some() {
                continue;
            }
            let tensor = source.tensor(kind);
            // A read-only region is opened, whole, for the fill and closed after.
            arena.writing(|arena| {
                let dest = arena.slot_mut(expert)?;
                for job in slot_map::jobs(&places, dest, tensor, (layer, expert, kind))? {
                    load::fill_slot(job)?;
                }
                arena.mark_loaded(expert, len);
                Ok(())
            })?;
            if let Some(map) = self.layers.get_mut(layer).and_then(|l| l.slot_map_mut()) {
                map.set(expert, kind, places);
            }
        }
        // Back to the caller's own affinity before moving to each replica's node (from
        // the first node's CPUs alone, no other node's CPU would be allowed).
        drop(on_node);
        self.sync_replicas(layer, expert)
    }
}

pub(super) fn describe(layer: usize, expert: usize, kind: Kind) -> String {
    format!("layer {layer} expert {expert} {}", kind.name())
}

/// Checks that `source` fits its slots; returns its `[weights, scales]` byte counts.
pub(super) fn check_fits(
    layer: usize,
    expert: usize,
    spec: &LayerSpec,
    source: &ExpertSource<'_>,
) -> Result<[usize; 2]> {
    if expert >= spec.experts {
        return Err(out_of_range(layer, expert, spec.experts));
    }
    let mut lengths = [0; 2];
    for kind in Kind::ALL {
        let max = spec.bytes(kind);
        let what = || describe(layer, expert, kind);
        let len = source.tensor(kind).checked_len(PACK, &what)?;
        if len > max {
            return Err(Error::too_large(PACK, what(), len, max, "the slot"));
        }
        lengths[kind.index()] = len;
    }
    Ok(lengths)
}
