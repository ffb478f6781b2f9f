//! One packed layer: its spec and one arena per tensor kind that it has.

use super::LayerSpec;
use super::arena::Arena;
use super::slot_map::SlotMap;
use crate::source::Kind;

/// A packed (or attached) layer.
#[derive(Debug)]
pub(crate) struct Layer {
    spec: LayerSpec,
    /// Indexed by [`Kind::index`]; `None` for a kind the layer has no bytes of.
    arenas: [Option<Arena>; Kind::ALL.len()],
    /// Where each piece of each slot lies (`None` for an attached layer).
    slot_map: Option<SlotMap>,
}

impl Layer {
    /// A layer from its arenas; the weights arena is required.
    pub(crate) fn new(spec: LayerSpec, arenas: [Option<Arena>; Kind::ALL.len()]) -> Layer {
        Layer {
            spec,
            arenas,
            slot_map: None,
        }
    }

    /// The layer with its pieces' layout.
    pub(crate) fn with_slot_map(mut self, map: SlotMap) -> Layer {
        self.slot_map = Some(map);
        self
    }

    pub(crate) fn slot_map(&self) -> Option<&SlotMap> {
        self.slot_map.as_ref()
    }

    pub(crate) fn slot_map_mut(&mut self) -> Option<&mut SlotMap> {
        self.slot_map.as_mut()
    }

    pub(crate) fn spec(&self) -> &LayerSpec {
        &self.spec
    }

    /// Experts (slots per arena).
    pub(crate) fn experts(&self) -> usize {
        self.spec.experts
    }

    pub(crate) fn arena(&self, kind: Kind) -> Option<&Arena> {
        self.arenas[kind.index()].as_ref()
    }

    pub(crate) fn arena_mut(&mut self, kind: Kind) -> Option<&mut Arena> {
        self.arenas[kind.index()].as_mut()
    }

    /// The arenas the layer has.
    pub(crate) fn arenas(&self) -> impl Iterator<Item = &Arena> {
        self.arenas.iter().flatten()
    }

    /// The arenas the layer has, with their kind.
    pub(crate) fn arenas_by_kind(&self) -> impl Iterator<Item = (Kind, &Arena)> {
        Kind::ALL
            .into_iter()
            .filter_map(|k| Some((k, self.arena(k)?)))
    }

    pub(crate) fn arenas_mut(&mut self) -> impl Iterator<Item = &mut Arena> {
        self.arenas.iter_mut().flatten()
    }

    /// Experts whose weights are loaded.
    pub(crate) fn experts_loaded(&self) -> usize {
        self.arena(Kind::Weights).map_or(0, Arena::loaded_count)
    }
}
