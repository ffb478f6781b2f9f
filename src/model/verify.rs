//! The check after a pack: every expert piece re-read from the files and compared with
//! its place in the store, the bytes between pieces zero.

use std::fmt;

use super::{Checkpoint, ExpertPlan, Naming, Share};
use crate::error::{Error, Result};
use crate::source::ReadMode;
use crate::source::compare::{Buffers, Compare, Difference, compare, threads};
use crate::source::load::Reader;
use crate::store::{Kind, PinStore, SlotPiece};

/// One slot that does not hold what the checkpoint says.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SlotMismatch {
    /// The model layer.
    pub layer: usize,
    /// The expert.
    pub expert: usize,
    /// Weights or scales.
    pub kind: Kind,
    /// The first differing byte, from the start of the slot.
    pub slot_offset: usize,
    /// What differs.
    pub reason: String,
}

/// What [`Checkpoint::verify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct VerifyReport {
    /// Slots compared (weights and scales each count).
    pub slots: usize,
    /// Bytes re-read from the files and compared.
    pub bytes: u64,
    /// Reads made: windows of the files of up to 32 MiB, each compared with every slot
    /// piece it holds (a direct one as several requests in flight, see
    /// [`VerifyReport::direct`]).
    pub reads: usize,
    /// Slots that differ (0: verified).
    pub mismatched_slots: usize,
    /// The first [`VerifyReport::MAX_LISTED`] of them.
    pub mismatches: Vec<SlotMismatch>,
    /// What the direct re-reads did: bytes read in place, requests per mechanism, the
    /// deepest queue (all zero for buffered re-reads). In a
    /// [`PlacedModel::verify`](crate::model::PlacedModel::verify) the experts' slots are
    /// read in one pass with the dense classes: this and [`VerifyReport::reads`] stay
    /// zero, the counts are the whole pass's
    /// ([`WholeVerify::direct`](crate::model::WholeVerify::direct)).
    pub direct: crate::source::DirectReads,
}

impl VerifyReport {
    /// Mismatches listed at most.
    pub const MAX_LISTED: usize = 64;

    /// Whether every slot holds exactly its pieces.
    pub fn verified(&self) -> bool {
        self.mismatched_slots == 0
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.verified() {
            write!(
                f,
                "verified: {} slots, {} bytes re-read in {} reads",
                self.slots, self.bytes, self.reads
            )
        } else {
            write!(
                f,
                "NOT verified: {} of {} slots differ",
                self.mismatched_slots, self.slots
            )?;
            if let Some(m) = self.mismatches.first() {
                write!(
                    f,
                    "; first: layer {} expert {} {} at byte {}: {}",
                    m.layer,
                    m.expert,
                    m.kind.name(),
                    m.slot_offset,
                    m.reason
                )?;
            }
            Ok(())
        }
    }
}

impl Checkpoint {
    /// Re-reads a share packed with [`Checkpoint::pack_share`] (as
    /// [`Checkpoint::verify`]; the naming detected).
    ///
    /// # Errors
    /// As [`Checkpoint::verify_with`] and [`ExpertPlan::share`].
    pub fn verify_share(&self, store: &PinStore, share: &Share) -> Result<VerifyReport> {
        let naming = Naming::detect(self)?;
        let plan = naming.plan(self)?.share(self, share)?;
        self.verify_plan(store, &plan, store.read_mode())
    }

    /// Re-reads every expert piece from the files and compares it with its place in
    /// `store` (as [`PinStore::slot_map`] says); the bytes between pieces must be zero.
    /// The naming is detected as in [`Checkpoint::pack`].
    ///
    /// The reads are made in the store's read mode
    /// ([`StoreOptions::read_mode`](crate::store::StoreOptions::read_mode)), as its loads
    /// were: after a direct load the page cache stays as empty as the load left it (at
    /// most 4 MiB a read); see [`Checkpoint::verify_in_mode`] to choose another.
    ///
    /// # Errors
    /// As [`Checkpoint::verify_with`].
    pub fn verify(&self, store: &PinStore) -> Result<VerifyReport> {
        let naming = Naming::detect(self)?;
        self.verify_with(store, &naming)
    }

    /// [`Checkpoint::verify`] under a naming chosen by hand (the one packed with).
    ///
    /// A slot that differs is reported in [`VerifyReport::mismatches`], not as an error.
    ///
    /// # Errors
    /// The naming's errors (as [`Checkpoint::pack`]); [`Error::NotPacked`] for a layer
    /// the store does not hold; a released slot ([`Error::Released`]); a read that fails.
    pub fn verify_with(&self, store: &PinStore, naming: &Naming) -> Result<VerifyReport> {
        self.verify_in_mode(store, naming, store.read_mode())
    }

    /// [`Checkpoint::verify_with`], re-reading the files the way the load read them:
    /// [`ReadMode::Direct`] and [`ReadMode::DropBehind`] keep the page cache as empty as
    /// the load left it (a buffered re-read would fill it with the whole model again).
    ///
    /// # Errors
    /// As [`Checkpoint::verify_with`], or the direct-I/O set-up fails (a file system that
    /// cannot do it falls back to buffered reads, as the load does).
    pub fn verify_in_mode(
        &self,
        store: &PinStore,
        naming: &Naming,
        mode: ReadMode,
    ) -> Result<VerifyReport> {
        let plan = naming.plan(self)?;
        self.verify_plan(store, &plan, mode)
    }

    /// Re-reads the pieces of `plan` (the whole's or a share's,
    /// [`ExpertPlan::share`]) from the files and compares each with its slot in `store`,
    /// as [`Checkpoint::verify_in_mode`] does.
    ///
    /// # Errors
    /// As [`Checkpoint::verify_in_mode`].
    pub(crate) fn verify_plan(
        &self,
        store: &PinStore,
        plan: &ExpertPlan,
        mode: ReadMode,
    ) -> Result<VerifyReport> {
        let reader = Reader::new(mode, self.files.iter().map(|f| f.file()))?;
        let report = self.verify_using(store, plan, (&reader, &Buffers::default()))?;
        reader.finish()?;
        Ok(report)
    }

    /// Checks every slot's layout (pieces, lengths, zero padding) and compares its
    /// pieces with the files, every slot's reads together ([`compare`]: windows of the
    /// files in flight on a few threads, compared in place), through `reader` (made for
    /// this checkpoint's files) into `buffers`.
    fn verify_using(
        &self,
        store: &PinStore,
        plan: &ExpertPlan,
        (reader, buffers): (&Reader<'_>, &Buffers),
    ) -> Result<VerifyReport> {
        let mut check = self.expert_check(store, plan, (0, 0))?;
        let compares = std::mem::take(&mut check.compares);
        let compared = compare((reader, buffers), threads(), compares, &|| {
            "verify experts".to_owned()
        })?;
        let mut report = self.expert_found(plan, check, compared.differences);
        report.reads = compared.reads;
        report.direct = compared.direct;
        Ok(report)
    }

    /// The first half of [`Checkpoint::verify_using`]: every slot's layout checked, and
    /// the ranges to compare with the files (tags from `first_tag` on, counted under
    /// `group`).
    ///
    /// # Errors
    /// As [`Checkpoint::verify_in_mode`].
    pub(crate) fn expert_check<'a>(
        &'a self,
        store: &'a PinStore,
        plan: &ExpertPlan,
        (group, first_tag): (usize, usize),
    ) -> Result<ExpertCheck<'a>> {
        let mut check = ExpertCheck {
            report: VerifyReport {
                slots: 0,
                bytes: 0,
                reads: 0,
                mismatched_slots: 0,
                mismatches: Vec::new(),
                direct: crate::source::DirectReads::default(),
            },
            found: Vec::new(),
            slots: Vec::new(),
            compares: Vec::new(),
            first_tag,
        };
        for layer in plan.layers() {
            let map = store.slot_map(layer.layer())?;
            for (slot, expert) in layer.experts().iter().enumerate() {
                // The global id: a share's store is looked up by it.
                let e = layer.expert_id(slot);
                for kind in Kind::ALL {
                    let (slot, pieces) = match kind {
                        Kind::Weights => (store.weights(layer.layer(), e)?, expert.weights()),
                        Kind::Scales => (store.scales(layer.layer(), e)?, expert.scales()),
                    };
                    if pieces.is_empty() && slot.is_empty() {
                        continue;
                    }
                    let order = check.report.slots;
                    check.report.slots += 1;
                    let places = map.pieces(e, kind).unwrap_or_default();
                    let at = SlotMismatch {
                        layer: layer.layer(),
                        expert: e,
                        kind,
                        slot_offset: 0,
                        reason: String::new(),
                    };
                    let fault = match self.slice_fault(layer, e, kind, pieces) {
                        Some(fault) => Some((0, fault)),
                        None => self.slot_fault(slot, pieces, places)?,
                    };
                    if let Some((slot_offset, reason)) = fault {
                        let m = SlotMismatch {
                            slot_offset,
                            reason,
                            ..at
                        };
                        check.found.push((order, m));
                        continue;
                    }
                    for (place, piece) in places.iter().zip(pieces) {
                        check.report.bytes += place.len as u64;
                        check.compares.push(Compare {
                            file: self.files[piece.file()].file(),
                            offset: piece.offset(),
                            copies: vec![&slot[place.offset..place.end()]],
                            tag: first_tag + check.slots.len(),
                            at: place.offset,
                            group,
                        });
                    }
                    check.slots.push((order, at, places.to_vec()));
                }
            }
        }
        Ok(check)
    }

    /// The second half: the report, given what the compare found (the differences of
    /// this check's tags; `reads` and `direct` are the caller's to fill).
    pub(crate) fn expert_found(
        &self,
        plan: &ExpertPlan,
        check: ExpertCheck<'_>,
        differences: Vec<Difference>,
    ) -> VerifyReport {
        let ExpertCheck {
            mut report,
            mut found,
            slots,
            first_tag,
            ..
        } = check;
        for d in differences {
            let Some((order, at, places)) = slots.get(d.tag.wrapping_sub(first_tag)) else {
                continue;
            };
            let index = places
                .iter()
                .position(|p| p.offset <= d.at && d.at < p.end())
                .unwrap_or(0);
            let path = places
                .get(index)
                .and(plan_file(self, plan, at, index))
                .unwrap_or_default();
            let reason = format!(
                "piece {index} differs from {path} at file offset {}",
                d.file_offset
            );
            let m = SlotMismatch {
                slot_offset: d.at,
                reason,
                ..at.clone()
            };
            found.push((*order, m));
        }
        found.sort_by_key(|(order, _)| *order);
        report.mismatched_slots = found.len();
        report.mismatches = found
            .into_iter()
            .take(VerifyReport::MAX_LISTED)
            .map(|(_, m)| m)
            .collect();
        report
    }

    /// How the pieces of a sliced layer's slot differ from what each role's slice must
    /// hold, computed from the role's shape, its tensor's bytes and dtype alone
    /// ([`slice::check`](super::slice::check)): so a slice that placed whole rows, or
    /// pieces that do not start at row starts, is not called verified because its bytes
    /// equal the file's at the offsets it chose.
    fn slice_fault(
        &self,
        layer: &super::LayerPlan,
        expert: usize,
        kind: Kind,
        pieces: &[super::TensorPiece],
    ) -> Option<String> {
        use super::slice::check::{Part, expected_parts, mismatch};
        let share = layer.share()?;
        let weight = kind == Kind::Weights;
        let mut at = 0usize;
        for cut in share.slices().iter().filter(|c| c.weight == weight) {
            let Some(first) = pieces.get(at) else {
                return Some(format!("{}: no piece where its slice starts", cut.role));
            };
            let Some(t) = self.tensors().get(first.tensor()) else {
                return Some(format!(
                    "{}: a piece names tensor {} of {}",
                    cut.role,
                    first.tensor(),
                    self.tensors().len()
                ));
            };
            let shape = &cut.shape;
            let per_expert = super::whole::normalized_shape(t) == *shape;
            let bytes = if per_expert {
                Some(t.len())
            } else {
                (share.of() > 0 && t.len().is_multiple_of(share.of() as u64))
                    .then(|| t.len() / share.of() as u64)
            };
            let Some(bytes) = bytes else {
                return Some(format!(
                    "{}: {} bytes are not {} experts' parts",
                    cut.role,
                    t.len(),
                    share.of()
                ));
            };
            let part = Part {
                bytes,
                outer: shape.first().copied().unwrap_or(1),
                rows: shape.split_last().map_or(1, |(_, r)| r.iter().product()),
                dtype: t.dtype(),
            };
            let slice = (cut.axis, cut.start, cut.len, cut.extent);
            let want = match expected_parts(part, slice, cut.parts, cut.whole) {
                Ok(want) => want,
                Err(why) => return Some(format!("{}: {why}", cut.role)),
            };
            let base = t.offset().saturating_add(if per_expert {
                0
            } else {
                (expert as u64).saturating_mul(bytes)
            });
            let count = usize::try_from(want.count).unwrap_or(usize::MAX);
            let mine: Vec<(u64, u64)> = pieces
                .iter()
                .skip(at)
                .take(count)
                .map(|p| (p.offset(), p.len()))
                .collect();
            at = at.saturating_add(count);
            if let Some(why) = mismatch(&mine, &want, base) {
                return Some(format!("{}: {why}", cut.role));
            }
        }
        (at != pieces.len() && !share.slices().is_empty()).then(|| {
            format!(
                "{} pieces where the slices' geometry has {at}",
                pieces.len()
            )
        })
    }

    /// The first fault of `slot`'s layout: its pieces' count and lengths against the
    /// checkpoint's, its length, padding that is not zero, a piece naming a file the
    /// checkpoint does not have (an error). The pieces' bytes are compared later.
    fn slot_fault(
        &self,
        slot: &[u8],
        pieces: &[super::TensorPiece],
        places: &[SlotPiece],
    ) -> Result<Option<(usize, String)>> {
        if places.len() != pieces.len()
            || places
                .iter()
                .zip(pieces)
                .any(|(a, b)| a.len as u64 != b.len())
        {
            return Ok(Some((
                0,
                format!(
                    "the slot holds pieces of {:?} bytes, the checkpoint has {:?}",
                    places.iter().map(|p| p.len).collect::<Vec<_>>(),
                    pieces.iter().map(|p| p.len()).collect::<Vec<_>>()
                ),
            )));
        }
        let end = places.last().map_or(0, SlotPiece::end);
        if slot.len() != end {
            return Ok(Some((
                slot.len().min(end),
                format!(
                    "the slot holds {} bytes, its pieces end at {end}",
                    slot.len()
                ),
            )));
        }
        let mut at = 0;
        for (index, (place, piece)) in places.iter().zip(pieces).enumerate() {
            let Some(padding) = slot.get(at..place.offset) else {
                return Ok(Some((
                    at,
                    format!("piece {index} starts before the one before ends"),
                )));
            };
            if let Some(i) = first_nonzero(padding) {
                return Ok(Some((
                    at + i,
                    format!("padding before piece {index} is not zero"),
                )));
            }
            if self.files.get(piece.file()).is_none() {
                return Err(Error::bad_value(
                    "Checkpoint::verify",
                    "a piece's file",
                    piece.file(),
                    format!("the checkpoint has {} files", self.files.len()),
                ));
            }
            at = place.end();
        }
        Ok(None)
    }
}

/// The experts' half of a verify between its two steps
/// ([`Checkpoint::expert_check`], [`Checkpoint::expert_found`]).
pub(crate) struct ExpertCheck<'a> {
    report: VerifyReport,
    /// Every slot that differs so far, with its place in slot order.
    found: Vec<(usize, SlotMismatch)>,
    /// Per compared slot (its tag less `first_tag`): its order, where it is, its pieces'
    /// places.
    slots: Vec<(usize, SlotMismatch, Vec<SlotPiece>)>,
    /// The ranges to compare.
    pub(crate) compares: Vec<Compare<'a>>,
    first_tag: usize,
}

/// The path of the file piece `index` of the slot `at` names (for a message).
fn plan_file(
    checkpoint: &Checkpoint,
    plan: &ExpertPlan,
    at: &SlotMismatch,
    index: usize,
) -> Option<String> {
    let layer = plan.layers().iter().find(|l| l.layer() == at.layer)?;
    let slot = (0..layer.experts().len()).find(|&s| layer.expert_id(s) == at.expert)?;
    let expert = layer.experts().get(slot)?;
    let pieces = match at.kind {
        Kind::Weights => expert.weights(),
        Kind::Scales => expert.scales(),
    };
    let file = checkpoint.files.get(pieces.get(index)?.file())?;
    Some(file.path().display().to_string())
}

/// The index of the first byte of `bytes` that is not zero. Compared a page-sized chunk at
/// a time with a zero page (`memcmp`), not byte by byte: a slot aligned to 1 GiB holds
/// GiBs of padding, which a byte loop took minutes over in a debug build.
fn first_nonzero(bytes: &[u8]) -> Option<usize> {
    static ZEROS: [u8; 4096] = [0; 4096];
    let mut at = 0;
    for chunk in bytes.chunks(ZEROS.len()) {
        if chunk != &ZEROS[..chunk.len()] {
            return chunk.iter().position(|&b| b != 0).map(|i| at + i);
        }
        at += chunk.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::first_nonzero;

    #[test]
    fn the_first_nonzero_byte_is_found_across_chunks() {
        assert_eq!(first_nonzero(&[]), None);
        let mut bytes = vec![0u8; 3 * 4096 + 7];
        assert_eq!(first_nonzero(&bytes), None);
        for at in [0, 4095, 4096, 8191, 3 * 4096 + 6] {
            bytes[at] = 1;
            let reference = bytes.iter().position(|&b| b != 0);
            assert_eq!(first_nonzero(&bytes), reference);
            assert_eq!(reference, Some(at));
            bytes[at] = 0;
        }
    }
}
