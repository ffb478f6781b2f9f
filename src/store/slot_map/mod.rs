//! Where each piece of a slot starts: the table [`PinStore::slot_map`] answers from.
//!
//! A file source names its pieces in slot order (an engine's gate, up, down); the store
//! knows them only as lengths. At pack time it lays them out back to back, or each at a
//! multiple of [`StoreOptions::piece_align`](super::StoreOptions::piece_align) (the slot
//! grows by the padding) and, with [`StoreOptions::piece_congruence`](super::StoreOptions::piece_congruence),
//! congruent to its file offset (so that a direct read lands in place), records the
//! layout per layer, and loads each run of pieces
//! that touch inside the slot as one job, so that back-to-back pieces of one file are
//! still read with one `pread`. Nothing here knows what a piece is for.

use std::collections::HashMap;

mod layout;
#[cfg(test)]
mod tests;

pub(crate) use layout::{PieceLayout, places};
pub(super) use layout::{check_piece_align, check_piece_congruence, extent, jobs};

use super::{LayerSpec, PinStore};
use crate::error::{Error, Result};
use crate::source::{ExpertSource, Kind};

/// Where one piece lies inside a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SlotPiece {
    /// Its first byte, from the start of the slot.
    pub offset: usize,
    /// Its bytes.
    pub len: usize,
}

impl SlotPiece {
    /// The offset just past it.
    pub fn end(&self) -> usize {
        self.offset + self.len
    }
}

/// One expert's pieces: `[weights, scales]`, each in slot order.
type Places = [Box<[SlotPiece]>; Kind::ALL.len()];

/// The pieces of every slot of a layer, as packed: for each expert and tensor kind, where
/// each piece of its source starts in the slot and how long it is.
///
/// A source in memory is one piece (none when empty); a file source has one piece per
/// [`Piece`](super::Piece), in its order. Experts that share a layout (every expert of a
/// model layer does) share one entry.
///
/// # Example
/// ```
/// use numapin::store::{ExpertSource, Kind, LayerSpec, Layout, PinStore, SlotPiece, StoreOptions};
///
/// let options = StoreOptions::default().piece_align(64);
/// let store = PinStore::new(Layout::Unplaced, options)?;
/// let file = std::fs::File::open("/proc/self/exe").unwrap();
/// // Gate, up and down: 100, 100 and 50 bytes of the file.
/// let source = ExpertSource::from_file(&file, &[(0, 100), (100, 100), (4096, 50)], &[]);
/// store.pack_layer(0, &LayerSpec::fitting(std::slice::from_ref(&source))?, &[source])?;
/// let map = store.slot_map(0)?;
/// let at = |offset, len| SlotPiece { offset, len };
/// assert_eq!(map.uniform(Kind::Weights), Some(&[at(0, 100), at(128, 100), at(256, 50)][..]));
/// assert_eq!(store.weights(0, 0)?.len(), 306); // padding between pieces included
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotMap {
    piece_align: usize,
    piece_congruence: usize,
    /// Distinct layouts.
    places: Vec<Places>,
    /// Slot → index in `places`.
    of_expert: Vec<usize>,
    /// The global expert id of each slot, increasing, for a layer packed as a share
    /// (`None`: slot `i` is expert `i`).
    ids: Option<Box<[usize]>>,
}
/// A slot map's tables: `(piece_align, piece_congruence)`, the distinct layouts, each
/// slot's layout and the share's ids.
#[cfg(feature = "model")]
type Tables<'a> = (usize, usize, &'a [Places], &'a [usize], Option<&'a [usize]>);

impl SlotMap {
    /// Its tables, for a whole-model export.
    #[cfg(feature = "model")]
    pub(super) fn tables(&self) -> Tables<'_> {
        (
            self.piece_align,
            self.piece_congruence,
            &self.places,
            &self.of_expert,
            self.ids.as_deref(),
        )
    }

    /// A map from its tables (checked by the caller: every slot names a layout).
    #[cfg(feature = "model")]
    pub(super) fn from_tables(
        (piece_align, piece_congruence): (usize, usize),
        places: Vec<Places>,
        of_expert: Vec<usize>,
        ids: Option<Box<[usize]>>,
    ) -> SlotMap {
        SlotMap {
            piece_align,
            piece_congruence,
            places,
            of_expert,
            ids,
        }
    }

    /// The layout of every source of a layer.
    pub(super) fn build(
        layer: usize,
        sources: &[ExpertSource<'_>],
        layout: PieceLayout,
    ) -> Result<SlotMap> {
        let mut index: HashMap<Places, usize> = HashMap::new();
        let mut map = SlotMap {
            piece_align: layout.align,
            piece_congruence: layout.modulus,
            places: Vec::new(),
            of_expert: Vec::with_capacity(sources.len()),
            ids: None,
        };
        for (expert, source) in sources.iter().enumerate() {
            let mut places: Places = Default::default();
            for kind in Kind::ALL {
                let what = || format!("layer {layer} expert {expert} {}", kind.name());
                places[kind.index()] = self::places(&what, source, kind, layout)?.into();
            }
            let next = map.places.len();
            let at = *index.entry(places.clone()).or_insert(next);
            if at == next {
                map.places.push(places);
            }
            map.of_expert.push(at);
        }
        Ok(map)
    }

    /// `spec` with each slot grown to hold its largest layout (padding included).
    pub(super) fn grown(&self, spec: &LayerSpec) -> LayerSpec {
        let mut grown = *spec;
        for kind in Kind::ALL {
            let most = self
                .places
                .iter()
                .map(|p| extent(&p[kind.index()]))
                .max()
                .unwrap_or(0);
            let bytes = grown.bytes_mut(kind);
            *bytes = (*bytes).max(most);
        }
        grown
    }

    /// Replaces one tensor's layout of `expert` (after [`PinStore::ensure`] loaded it from
    /// a source with other pieces).
    pub(super) fn set(&mut self, expert: usize, kind: Kind, places: Vec<SlotPiece>) {
        let Some(&at) = self.of_expert.get(expert) else {
            return;
        };
        if *self.places[at][kind.index()] == *places {
            return;
        }
        let mut new = self.places[at].clone();
        new[kind.index()] = places.into();
        let at = match self.places.iter().position(|p| *p == new) {
            Some(at) => at,
            None => {
                self.places.push(new);
                self.places.len() - 1
            }
        };
        self.of_expert[expert] = at;
    }

    /// The piece alignment the layer was packed with (1: back to back).
    pub fn piece_align(&self) -> usize {
        self.piece_align
    }

    /// The congruence modulus the layer was packed with (0: off; see
    /// [`StoreOptions::piece_congruence`](super::StoreOptions::piece_congruence)).
    pub fn piece_congruence(&self) -> usize {
        self.piece_congruence
    }

    /// Experts in the layer (in its share, for a layer packed as one).
    pub fn experts(&self) -> usize {
        self.of_expert.len()
    }

    /// The global expert id of each slot, increasing, when the layer was packed as a
    /// share ([`PinStore::pack_layer_share`]); `None`: slot `i` holds expert `i`.
    pub fn expert_ids(&self) -> Option<&[usize]> {
        self.ids.as_deref()
    }

    /// The map with the slots' global expert ids.
    pub(super) fn with_ids(mut self, ids: Option<Box<[usize]>>) -> SlotMap {
        self.ids = ids;
        self
    }

    /// The pieces of `expert`'s tensor `kind` (`expert` the global id), in slot order
    /// (empty for a kind the layer has no bytes of); `None` when the expert is out of
    /// range or not in the layer's share.
    pub fn pieces(&self, expert: usize, kind: Kind) -> Option<&[SlotPiece]> {
        let slot = match &self.ids {
            Some(ids) => ids.binary_search(&expert).ok()?,
            None => expert,
        };
        self.slot_pieces(slot, kind)
    }

    /// The pieces of slot `slot` (the slot's index, not a share's global id).
    pub(super) fn slot_pieces(&self, slot: usize, kind: Kind) -> Option<&[SlotPiece]> {
        let at = *self.of_expert.get(slot)?;
        Some(&self.places[at][kind.index()])
    }

    /// The pieces of tensor `kind` when every expert of the layer has the same layout
    /// (always for a layer packed from a checkpoint); `None` otherwise.
    pub fn uniform(&self, kind: Kind) -> Option<&[SlotPiece]> {
        let first = self.places.first()?;
        self.places
            .iter()
            .all(|p| p[kind.index()] == first[kind.index()])
            .then_some(&first[kind.index()][..])
    }
}

impl PinStore {
    /// How this store lays pieces out in its slots.
    pub(super) fn piece_layout(&self) -> PieceLayout {
        PieceLayout {
            align: self.options.piece_align,
            modulus: self.options.piece_congruence,
        }
    }

    /// Where each piece starts inside the slots of `layer`, as it was packed (see
    /// [`SlotMap`]).
    ///
    /// # Errors
    /// [`Error::NotPacked`] when the layer is not packed; an invalid-argument error for a
    /// layer attached from an export (the manifest carries no piece layout).
    pub fn slot_map(&self, layer: usize) -> Result<&SlotMap> {
        self.layer(layer)?.slot_map().ok_or_else(|| {
            Error::wrong_backing(
                "PinStore::slot_map",
                format!("layer {layer} was attached from an export, which carries no piece layout"),
                "a layer packed in this process",
            )
        })
    }
}
