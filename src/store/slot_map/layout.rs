//! How pieces are laid out in a slot ([`PieceLayout`]), checked against the store's
//! options, and the load jobs that fill a slot so.

use crate::error::{Error, Result};
use crate::source::load::Job;
use crate::source::{ExpertSource, Kind, Tensor};

use super::SlotPiece;

const OP: &str = "PinStore::pack_layer";

/// Checks [`StoreOptions::piece_align`](crate::store::StoreOptions::piece_align).
pub(in crate::store) fn check_piece_align(align: usize) -> Result<()> {
    if align.is_power_of_two() && align <= crate::store::MAX_ALIGN {
        Ok(())
    } else {
        Err(Error::bad_value(
            "PinStore::new",
            "piece_align",
            align,
            format!(
                "not a power of two up to {} (1: pieces back to back)",
                crate::store::MAX_ALIGN
            ),
        ))
    }
}

/// How pieces are laid out in a slot: [`StoreOptions::piece_align`] and
/// [`StoreOptions::piece_congruence`] (0: off).
///
/// [`StoreOptions::piece_align`]: crate::store::StoreOptions::piece_align
/// [`StoreOptions::piece_congruence`]: crate::store::StoreOptions::piece_congruence
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

/// Checks [`StoreOptions::piece_congruence`](crate::store::StoreOptions::piece_congruence)
/// against the piece and slot alignments.
pub(in crate::store) fn check_piece_congruence(
    modulus: usize,
    align: usize,
    slot: usize,
) -> Result<()> {
    if modulus <= 1 {
        return Ok(());
    }
    let why = if !modulus.is_power_of_two() {
        "not a power of two (0 or 1: off)".to_owned()
    } else if modulus > crate::store::MAX_ALIGN {
        format!(
            "larger than {} (the largest alignment)",
            crate::store::MAX_ALIGN
        )
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
/// [`PieceLayout::offset`] (a [`Piece::joined`](crate::source::Piece::joined) one right
/// after the piece before it).
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
                let offset = if piece.joined && !out.is_empty() {
                    end
                } else {
                    layout.offset(end, piece.offset).ok_or_else(overflow)?
                };
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
pub(in crate::store) fn extent(places: &[SlotPiece]) -> usize {
    places.last().map_or(0, SlotPiece::end)
}

/// The jobs that fill `dest` (one slot) with `tensor` laid out as `places`: one job per
/// run of pieces that touch inside the slot (with `piece_align` 1, one job per slot, so
/// adjacent pieces of one file still coalesce into one read).
pub(in crate::store) fn jobs<'a>(
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
