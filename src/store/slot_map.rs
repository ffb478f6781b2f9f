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

use super::{LayerSpec, PinStore};
use crate::error::{Error, Result};
use crate::source::load::Job;
use crate::source::{ExpertSource, Kind, Tensor};

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

const OP: &str = "PinStore::pack_layer";

/// Checks [`StoreOptions::piece_align`](super::StoreOptions::piece_align).
pub(super) fn check_piece_align(align: usize) -> Result<()> {
    if align.is_power_of_two() && align <= super::MAX_ALIGN {
        Ok(())
    } else {
        Err(Error::bad_value(
            "PinStore::new",
            "piece_align",
            align,
            format!(
                "not a power of two up to {} (1: pieces back to back)",
                super::MAX_ALIGN
            ),
        ))
    }
}

/// How pieces are laid out in a slot: [`StoreOptions::piece_align`] and
/// [`StoreOptions::piece_congruence`] (0: off).
///
/// [`StoreOptions::piece_align`]: super::StoreOptions::piece_align
/// [`StoreOptions::piece_congruence`]: super::StoreOptions::piece_congruence
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PieceLayout {
    pub(crate) align: usize,
    pub(crate) modulus: usize,
}

impl PieceLayout {
    /// Pieces at multiples of `align`, no congruence.
    #[cfg(test)]
    pub(crate) fn aligned(align: usize) -> Self {
        PieceLayout { align, modulus: 0 }
    }

    /// Checks the alignment and the modulus as [`PinStore::new`] does, the modulus
    /// against the slot alignment `slot` (a caller that lays pieces out before any store
    /// exists, `Checkpoint::place`, would otherwise reckon with an alignment the store
    /// refuses: `usize::MAX` overflowed its cost sums).
    pub(crate) fn check(self, slot: usize) -> Result<()> {
        check_piece_align(self.align)?;
        check_piece_congruence(self.modulus, self.align, slot)
    }

    /// Where a piece at `file_offset` starts in a slot whose pieces so far end at `end`:
    /// the first offset at or after `end` that is a multiple of the alignment and, with a
    /// congruence on and a file offset that is a multiple of the alignment, congruent to
    /// the file offset modulo the modulus; `None` when that overflows.
    pub(crate) fn offset(self, end: usize, file_offset: u64) -> Option<usize> {
        let align = self.align.max(1);
        if self.modulus <= 1 || !file_offset.is_multiple_of(align as u64) {
            return end.checked_next_multiple_of(align);
        }
        // `modulus` is a power of two at least `align` (checked by `PinStore::new`), so
        // an offset congruent to an `align`-aligned file offset is `align`-aligned too.
        let want = (file_offset % self.modulus as u64) as usize;
        let at = (end - end % self.modulus).checked_add(want)?;
        if at >= end {
            Some(at)
        } else {
            at.checked_add(self.modulus)
        }
    }
}

/// Checks [`StoreOptions::piece_congruence`](super::StoreOptions::piece_congruence)
/// against the piece and slot alignments.
pub(super) fn check_piece_congruence(modulus: usize, align: usize, slot: usize) -> Result<()> {
    if modulus <= 1 {
        return Ok(());
    }
    let why = if !modulus.is_power_of_two() {
        "not a power of two (0 or 1: off)".to_owned()
    } else if modulus > super::MAX_ALIGN {
        format!("larger than {} (the largest alignment)", super::MAX_ALIGN)
    } else if modulus < align {
        format!("smaller than piece_align {align}: a piece could not be both")
    } else if modulus > slot {
        format!(
            "larger than the slot alignment {slot}: slots start at multiples of it, so a              piece's address would not follow its offset"
        )
    } else {
        return Ok(());
    };
    Err(Error::bad_value(
        "PinStore::new",
        "piece_congruence",
        modulus,
        why,
    ))
}

/// The layout of one tensor of `source`: its pieces in order, each placed by
/// [`PieceLayout::offset`].
pub(crate) fn places(
    what: &dyn Fn() -> String,
    source: &ExpertSource<'_>,
    kind: Kind,
    layout: PieceLayout,
) -> Result<Vec<SlotPiece>> {
    let overflow = || Error::overflow(OP, format!("{}: a piece offset", what()));
    match source.tensor(kind) {
        Tensor::Memory([]) => Ok(Vec::new()),
        Tensor::Memory(bytes) => Ok(vec![SlotPiece {
            offset: 0,
            len: bytes.len(),
        }]),
        Tensor::File(pieces) => {
            let mut end = 0usize;
            let mut out = Vec::with_capacity(pieces.len());
            for piece in pieces {
                let offset = layout.offset(end, piece.offset).ok_or_else(overflow)?;
                end = offset.checked_add(piece.len).ok_or_else(overflow)?;
                out.push(SlotPiece {
                    offset,
                    len: piece.len,
                });
            }
            Ok(out)
        }
    }
}

/// The bytes a slot holds with these pieces: up to the end of the last one.
pub(super) fn extent(places: &[SlotPiece]) -> usize {
    places.last().map_or(0, SlotPiece::end)
}

/// The jobs that fill `dest` (one slot) with `tensor` laid out as `places`: one job per
/// run of pieces that touch inside the slot (with `piece_align` 1, one job per slot, so
/// adjacent pieces of one file still coalesce into one read).
pub(super) fn jobs<'a>(
    places: &[SlotPiece],
    dest: &'a mut [u8],
    tensor: Tensor<'a>,
    what: (usize, usize, Kind),
) -> Result<Vec<Job<'a>>> {
    let pieces = match tensor {
        Tensor::Memory(_) => return Ok(vec![Job { dest, tensor, what }]),
        Tensor::File(pieces) => pieces,
    };
    let (layer, expert, kind) = what;
    let room = dest.len();
    let mismatch = || {
        Error::invalid(
            OP,
            format!(
                "layer {layer} expert {expert} {}: {} pieces laid out as {places:?} do not fit a \
                 slot of {} bytes",
                kind.name(),
                pieces.len(),
                room
            ),
        )
    };
    if places.len() != pieces.len() {
        return Err(mismatch());
    }
    let mut jobs = Vec::new();
    let mut rest = dest;
    let mut consumed = 0;
    let mut first = 0;
    while first < pieces.len() {
        let mut last = first;
        while last + 1 < pieces.len() && places[last + 1].offset == places[last].end() {
            last += 1;
        }
        let (start, end) = (places[first].offset, places[last].end());
        let (_, tail) = rest
            .split_at_mut_checked(start - consumed)
            .ok_or_else(mismatch)?;
        let (window, tail) = tail
            .split_at_mut_checked(end - start)
            .ok_or_else(mismatch)?;
        jobs.push(Job {
            dest: window,
            tensor: Tensor::File(&pieces[first..=last]),
            what,
        });
        rest = tail;
        consumed = end;
        first = last + 1;
    }
    Ok(jobs)
}

impl SlotMap {
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
            Error::invalid(
                "PinStore::slot_map",
                format!("layer {layer} was attached from an export, which carries no piece layout"),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Piece;
    use std::fs::File;

    fn file() -> File {
        File::open("/proc/self/exe").unwrap()
    }

    fn offsets(places: &[SlotPiece]) -> Vec<(usize, usize)> {
        places.iter().map(|p| (p.offset, p.len)).collect()
    }

    #[test]
    fn pieces_go_back_to_back_or_at_multiples_of_the_alignment() {
        let f = file();
        let source = ExpertSource::from_file(&f, &[(0, 100), (100, 28), (500, 1)], &[(9, 3)]);
        let what = || "test".to_string();
        let back = places(&what, &source, Kind::Weights, PieceLayout::aligned(1)).unwrap();
        assert_eq!(offsets(&back), [(0, 100), (100, 28), (128, 1)]);
        let aligned = places(&what, &source, Kind::Weights, PieceLayout::aligned(64)).unwrap();
        assert_eq!(offsets(&aligned), [(0, 100), (128, 28), (192, 1)]);
        assert_eq!(extent(&aligned), 193);
        let scales = places(&what, &source, Kind::Scales, PieceLayout::aligned(64)).unwrap();
        assert_eq!(offsets(&scales), [(0, 3)]);
        let empty = ExpertSource::Memory {
            weights: &[1, 2],
            scales: &[],
        };
        assert_eq!(
            offsets(&places(&what, &empty, Kind::Weights, PieceLayout::aligned(4096)).unwrap()),
            [(0, 2)]
        );
        assert!(
            places(&what, &empty, Kind::Scales, PieceLayout::aligned(4096))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn offsets_that_overflow_are_an_error() {
        let f = file();
        let source = ExpertSource::File {
            weights: vec![Piece::new(&f, 0, usize::MAX - 10), Piece::new(&f, 0, 1)],
            scales: vec![],
        };
        let what = || "layer 7".to_string();
        let err = places(&what, &source, Kind::Weights, PieceLayout::aligned(64)).unwrap_err();
        assert!(err.to_string().contains("layer 7"), "{err}");
    }

    #[test]
    fn touching_pieces_are_one_job_and_padding_splits_jobs() {
        let f = file();
        let pieces = [
            Piece::new(&f, 0, 10),
            Piece::new(&f, 10, 6),
            Piece::new(&f, 100, 4),
        ];
        let tensor = Tensor::File(&pieces);
        let mut slot = vec![0u8; 64];
        let what = (1, 2, Kind::Weights);
        let back = [
            SlotPiece { offset: 0, len: 10 },
            SlotPiece { offset: 10, len: 6 },
            SlotPiece { offset: 16, len: 4 },
        ];
        let jobs = jobs(&back, &mut slot, tensor, what).unwrap();
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].dest.len(), 20);
        drop(jobs);
        let padded = [
            SlotPiece { offset: 0, len: 10 },
            SlotPiece { offset: 16, len: 6 },
            SlotPiece { offset: 22, len: 4 },
        ];
        let split = super::jobs(&padded, &mut slot, tensor, what).unwrap();
        let shape: Vec<(usize, usize)> = split
            .iter()
            .map(|j| {
                let Tensor::File(p) = j.tensor else {
                    unreachable!()
                };
                (j.dest.len(), p.len())
            })
            .collect();
        assert_eq!(shape, [(10, 1), (10, 2)]);
        drop(split);
        let too_far = [
            SlotPiece { offset: 0, len: 10 },
            SlotPiece { offset: 60, len: 6 },
            SlotPiece { offset: 66, len: 4 },
        ];
        assert!(super::jobs(&too_far, &mut slot, tensor, what).is_err());
        assert!(super::jobs(&back[..2], &mut slot, tensor, what).is_err());
    }

    #[test]
    fn experts_with_one_layout_share_it_and_set_changes_one() {
        let f = file();
        let sources: Vec<ExpertSource> = (0..3)
            .map(|e| ExpertSource::from_file(&f, &[(e * 100, 50), (e * 100 + 50, 50)], &[]))
            .collect();
        let mut map = SlotMap::build(0, &sources, PieceLayout::aligned(1)).unwrap();
        assert_eq!(map.places.len(), 1);
        assert_eq!(map.experts(), 3);
        assert_eq!(
            offsets(map.uniform(Kind::Weights).unwrap()),
            [(0, 50), (50, 50)]
        );
        let spec = LayerSpec {
            experts: 3,
            weight_bytes: 100,
            scale_bytes: 0,
        };
        assert_eq!(map.grown(&spec), spec);
        map.set(
            1,
            Kind::Weights,
            vec![SlotPiece {
                offset: 0,
                len: 100,
            }],
        );
        assert_eq!(map.uniform(Kind::Weights), None);
        assert_eq!(offsets(map.pieces(1, Kind::Weights).unwrap()), [(0, 100)]);
        assert_eq!(
            offsets(map.pieces(2, Kind::Weights).unwrap()),
            [(0, 50), (50, 50)]
        );
        assert_eq!(map.pieces(3, Kind::Weights), None);
        let aligned = SlotMap::build(0, &sources, PieceLayout::aligned(4096)).unwrap();
        assert_eq!(aligned.grown(&spec).weight_bytes, 4096 + 50);
    }

    /// The pieces of a dense group: file offsets and lengths as a GGUF file at 32-byte
    /// alignment has them (some at 32 mod 64), one 100 bytes past its predecessor.
    const FILE: [(u64, usize); 5] = [
        (4096 + 64, 8192),
        (4096 + 64 + 8192, 256),            // continues the previous one
        (4096 + 64 + 8192 + 256 + 32, 100), // 32 mod 64: the alignment wins
        (20_000 * 64, 4032),
        (20_000 * 64 + 4032 + 128, 64), // a gap of 128 bytes: mirrored
    ];

    #[test]
    fn congruent_pieces_follow_their_file_offsets_modulo_the_modulus() {
        let f = file();
        let source = ExpertSource::from_file(&f, &FILE, &[]);
        let what = || "test".to_string();
        for modulus in [512usize, 4096] {
            let layout = PieceLayout { align: 64, modulus };
            let places = places(&what, &source, Kind::Weights, layout).unwrap();
            let mut end = 0;
            for (p, &(offset, len)) in places.iter().zip(&FILE) {
                assert_eq!(p.len, len);
                assert!(p.offset >= end, "{places:?}");
                assert!(p.offset.is_multiple_of(64), "{places:?}");
                if offset.is_multiple_of(64) {
                    // Congruent, and no more padding than one modulus.
                    assert_eq!(p.offset as u64 % modulus as u64, offset % modulus as u64);
                    assert!(p.offset - end < modulus, "{places:?}");
                } else {
                    // The alignment wins: the next multiple of 64.
                    assert_eq!(p.offset, end.next_multiple_of(64));
                }
                end = p.end();
            }
            // Contiguous in the file, contiguous in the slot; a gap mirrored.
            assert_eq!(places[1].offset, places[0].end());
            assert_eq!(places[4].offset, places[3].end() + 128);
            assert_eq!(places[0].offset, (4096 + 64) % modulus);
        }
        // Off (0 and 1): today's layout.
        for off in [0, 1] {
            let layout = PieceLayout {
                align: 64,
                modulus: off,
            };
            assert_eq!(
                places(&what, &source, Kind::Weights, layout).unwrap(),
                places(&what, &source, Kind::Weights, PieceLayout::aligned(64)).unwrap()
            );
        }
    }

    #[test]
    fn a_congruent_layout_runs_as_one_job_per_file_run() {
        let f = file();
        let source = ExpertSource::from_file(&f, &FILE, &[]);
        let layout = PieceLayout {
            align: 64,
            modulus: 4096,
        };
        let places = places(&|| "t".into(), &source, Kind::Weights, layout).unwrap();
        let mut slot = vec![0u8; extent(&places)];
        let jobs = jobs(
            &places,
            &mut slot,
            source.tensor(Kind::Weights),
            (0, 0, Kind::Weights),
        )
        .unwrap();
        // Pieces 0-1 touch; 2 (32 bytes further in the file, 32 mod 64) goes to the next
        // multiple of 64, where 1 ends, so it touches too (its read is its own: the file
        // has a gap); 3 starts at its congruent offset, 4 after the mirrored gap.
        let runs: Vec<usize> = jobs
            .iter()
            .map(|j| match j.tensor {
                Tensor::File(p) => p.len(),
                Tensor::Memory(_) => 0,
            })
            .collect();
        assert_eq!(runs, [3, 1, 1]);
    }

    #[test]
    fn bad_moduli_are_refused_by_name() {
        let page = crate::page::page_size();
        for modulus in [0, 1, 64, 512, page] {
            check_piece_congruence(modulus, 64, page).unwrap();
        }
        for (modulus, words) in [
            (3, "power of two"),
            (usize::MAX, "power of two"),
            (super::super::MAX_ALIGN * 2, "larger than"),
            (32, "smaller than piece_align 64"),
            (page * 2, "slot alignment"),
        ] {
            let e = check_piece_congruence(modulus, 64, page).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains("piece_congruence") && text.contains(words),
                "{modulus}: {text}"
            );
        }
        let store = |m| {
            PinStore::new(
                super::super::Layout::Unplaced,
                super::super::StoreOptions::default()
                    .piece_align(64)
                    .piece_congruence(m),
            )
        };
        assert!(store(3).is_err() && store(usize::MAX).is_err());
        assert!(store(0).is_ok() && store(4096.min(page)).is_ok());
    }

    #[test]
    fn congruent_offsets_that_overflow_are_an_error() {
        let f = file();
        let layout = PieceLayout {
            align: 64,
            modulus: 4096,
        };
        let what = || "layer 9".to_string();
        // A piece at the top of the file offsets, after one that fills the slot offsets.
        let top = u64::MAX - 4095; // a multiple of 4096: congruent to 0
        let source = ExpertSource::File {
            weights: vec![Piece::new(&f, 1, usize::MAX - 100), Piece::new(&f, top, 1)],
            scales: vec![],
        };
        let e = places(&what, &source, Kind::Weights, layout).unwrap_err();
        assert!(e.to_string().contains("layer 9"), "{e}");
        let near = ExpertSource::File {
            weights: vec![Piece::new(&f, u64::MAX - 63, 10)],
            scales: vec![],
        };
        let p = places(&what, &near, Kind::Weights, layout).unwrap();
        assert_eq!(p[0].offset as u64, (u64::MAX - 63) % 4096);
        assert_eq!(layout.offset(usize::MAX - 10, 0), None);
        assert_eq!(layout.offset(usize::MAX - 10, u64::MAX - 63), None);
    }
}
