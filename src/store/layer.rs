//! One packed layer: its spec and one arena per tensor kind that it has, plus, for
//! [`Layout::Replicate`](super::Layout::Replicate), a copy of those arenas per further node.

use super::LayerSpec;
use super::arena::Arena;
use super::slot_map::SlotMap;
use crate::error::{Error, Result};
use crate::node::{Node, NodeSet};
use crate::source::Kind;

/// The arenas of one copy of a layer, indexed by [`Kind::index`].
pub(crate) type Arenas = [Option<Arena>; Kind::ALL.len()];

/// A packed (or attached) layer.
#[derive(Debug)]
pub(crate) struct Layer {
    spec: LayerSpec,
    /// Indexed by [`Kind::index`]; `None` for a kind the layer has no bytes of.
    arenas: [Option<Arena>; Kind::ALL.len()],
    /// Where each piece of each slot lies (`None` for an attached layer).
    slot_map: Option<SlotMap>,
    /// The node the first copy (`arenas`) is bound to, for a replicated layer.
    first_node: Option<Node>,
    /// The other replicas, in node order, each with the node it is bound to.
    replicas: Vec<(Node, Arenas)>,
    /// The nodes holding a replica (the first's included; empty: not replicated).
    replica_nodes: NodeSet,
    /// The global expert id of each slot, increasing, for a layer packed as a share
    /// ([`super::PinStore::pack_layer_share`]); `None`: slot `i` is expert `i`.
    ids: Option<Box<[usize]>>,
}

impl Layer {
    /// A layer from its arenas; the weights arena is required.
    pub(crate) fn new(spec: LayerSpec, arenas: [Option<Arena>; Kind::ALL.len()]) -> Layer {
        Layer {
            spec,
            arenas,
            slot_map: None,
            first_node: None,
            replicas: Vec::new(),
            replica_nodes: NodeSet::new(),
            ids: None,
        }
    }

    /// The layer holding, in slot `i`, global expert `ids[i]` (increasing).
    pub(crate) fn with_ids(mut self, ids: Option<Box<[usize]>>) -> Layer {
        self.ids = ids;
        self
    }

    /// The global expert ids of the slots (`None`: slot `i` is expert `i`).
    pub(crate) fn ids(&self) -> Option<&[usize]> {
        self.ids.as_deref()
    }

    /// The slot of global expert `expert` of model layer `layer` (this layer):
    /// [`Error::NotHeld`] for an id a share does not hold, [`Error::OutOfRange`] past
    /// the experts of a whole layer.
    pub(crate) fn slot_of(&self, layer: usize, expert: usize) -> Result<usize> {
        match &self.ids {
            None if expert < self.spec.experts => Ok(expert),
            None => Err(out_of_range(layer, expert, self.spec.experts)),
            Some(ids) => ids.binary_search(&expert).map_err(|_| Error::NotHeld {
                op: "PinStore",
                layer,
                expert,
                held: ids_text(ids),
            }),
        }
    }

    /// The layer with its first copy bound to `first` and the other replicas.
    pub(crate) fn with_replicas(mut self, first: Node, replicas: Vec<(Node, Arenas)>) -> Layer {
        self.replica_nodes = std::iter::once(first)
            .chain(replicas.iter().map(|(n, _)| *n))
            .collect();
        self.first_node = Some(first);
        self.replicas = replicas;
        self
    }

    /// The first copy's arenas (the only copy of a layer that is not replicated).
    pub(crate) fn first_copy(&self) -> &Arenas {
        &self.arenas
    }

    /// The nodes holding a replica (empty: the layer is not replicated).
    pub(crate) fn replica_nodes(&self) -> &NodeSet {
        &self.replica_nodes
    }

    /// The arena of `kind` of the replica on `node` (`None`: no replica there, or no
    /// such kind).
    pub(crate) fn replica_arena(&self, node: Node, kind: Kind) -> Option<&Arena> {
        if self.first_node == Some(node) {
            return self.arena(kind);
        }
        let (_, arenas) = self.replicas.iter().find(|(n, _)| *n == node)?;
        arenas[kind.index()].as_ref()
    }

    /// Every replica's arenas with their node (the first copy first; a layer that is not
    /// replicated yields nothing).
    pub(crate) fn replicas(&self) -> impl Iterator<Item = (Node, &Arenas)> {
        self.first_node
            .map(|n| (n, &self.arenas))
            .into_iter()
            .chain(self.replicas.iter().map(|(n, a)| (*n, a)))
    }

    /// The first copy and the other replicas' arenas of `kind`, writable: the first
    /// (source of copies) apart from the others.
    pub(crate) fn split_replicas_mut(
        &mut self,
        kind: Kind,
    ) -> (Option<&mut Arena>, Vec<(Node, &mut Arena)>) {
        let others = self
            .replicas
            .iter_mut()
            .filter_map(|(n, a)| Some((*n, a[kind.index()].as_mut()?)))
            .collect();
        (self.arenas[kind.index()].as_mut(), others)
    }

    /// Every arena of every copy (the first copy's, then the other replicas').
    pub(crate) fn all_arenas(&self) -> impl Iterator<Item = &Arena> {
        self.arenas
            .iter()
            .chain(self.replicas.iter().flat_map(|(_, a)| a.iter()))
            .flatten()
    }

    /// Every arena of every copy, writable (the first copy's, then the other replicas').
    pub(crate) fn all_arenas_mut(&mut self) -> impl Iterator<Item = &mut Arena> {
        self.arenas
            .iter_mut()
            .chain(self.replicas.iter_mut().flat_map(|(_, a)| a.iter_mut()))
            .flatten()
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

/// Increasing expert ids as inclusive ranges, `"0-63,70,96-127"`; past 16 ranges the rest
/// is counted (`"…(+5 ranges)"`), so an error quoting a scattered share stays short.
pub(crate) fn ids_text(ids: &[usize]) -> String {
    const SHOWN: usize = 16;
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for &id in ids {
        match ranges.last_mut() {
            Some((_, end)) if end.checked_add(1) == Some(id) => *end = id,
            _ => ranges.push((id, id)),
        }
    }
    let mut text: Vec<String> = ranges
        .iter()
        .take(SHOWN)
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    if ranges.len() > SHOWN {
        text.push(format!("…(+{} ranges)", ranges.len() - SHOWN));
    }
    if text.is_empty() {
        return "none".to_owned();
    }
    text.join(",")
}

/// An expert id past the experts of a whole layer (its slot lookups and the store's).
pub(super) fn out_of_range(layer: usize, expert: usize, experts: usize) -> Error {
    Error::OutOfRange {
        op: "PinStore",
        what: format!("expert of layer {layer}"),
        index: expert,
        len: experts,
    }
}

#[cfg(test)]
mod tests {
    use super::ids_text;

    #[test]
    fn ids_read_as_ranges_and_stay_short() {
        assert_eq!(ids_text(&[0, 1, 2, 3, 70, 96, 97]), "0-3,70,96-97");
        assert_eq!(ids_text(&[]), "none");
        assert_eq!(
            ids_text(&[usize::MAX - 1, usize::MAX]),
            format!("{}-{}", usize::MAX - 1, usize::MAX)
        );
        let scattered: Vec<usize> = (0..100).map(|i| i * 2).collect();
        let text = ids_text(&scattered);
        assert!(text.ends_with("…(+84 ranges)"), "{text}");
        assert!(text.starts_with("0,2,4,"), "{text}");
    }
}
