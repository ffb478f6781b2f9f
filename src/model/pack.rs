//! A checkpoint's experts into a [`PinStore`]: every MoE layer packed at its model layer
//! number straight from the files (each piece a `pread` into its slot, no copy per
//! expert, also across shards), and the check that re-reads every slot's pieces.

use std::collections::BTreeMap;
use std::fmt;

use super::{Checkpoint, ExpertPlan, LayerPlan, Naming};
use crate::error::{Error, Result};
use crate::source::ReadMode;
use crate::source::load::{Reader, Scratch};
use crate::store::{ExpertSource, Kind, LayerReport, LayerSpec, Piece, PinStore, SlotPiece};

/// What [`Checkpoint::pack`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ModelReport {
    /// The expert naming used (detected, or chosen with [`Checkpoint::pack_with`]).
    pub naming: String,
    /// Files of the checkpoint.
    pub files: usize,
    /// MoE layers packed (dense layers are not in the store).
    pub layers: usize,
    /// Model layer number → experts packed.
    pub experts_per_layer: BTreeMap<usize, usize>,
    /// Expert bytes packed (weights and scales, as in the files; padding from
    /// [`StoreOptions::piece_align`](crate::store::StoreOptions::piece_align) not
    /// included).
    pub bytes: u64,
    /// `pread` calls issued.
    pub reads: usize,
    /// Tensors that are not experts, left for the engine to load.
    pub engine_tensors: usize,
    /// Their bytes.
    pub engine_bytes: u64,
    /// Each layer's report, by increasing layer number.
    pub layer_reports: Vec<LayerReport>,
}

impl fmt::Display for ModelReport {
    /// One line: `naming per-expert: 2 MoE layers × 4 experts packed (98304 bytes, 24 reads,
    /// 2 files); 31 tensors (27392 bytes) left for the engine`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut counts = self.experts_per_layer.values();
        let first = counts.next();
        write!(f, "naming {}: {} MoE layers", self.naming, self.layers)?;
        match first {
            Some(n) if counts.all(|c| c == n) => write!(f, " × {n} experts")?,
            Some(_) => {
                let per: Vec<String> = self
                    .experts_per_layer
                    .iter()
                    .map(|(l, n)| format!("{l}:{n}"))
                    .collect();
                write!(f, " (experts per layer {})", per.join(","))?;
            }
            None => {}
        }
        write!(
            f,
            " packed ({} bytes, {} reads, {} files); {} tensors ({} bytes) left for the engine",
            self.bytes, self.reads, self.files, self.engine_tensors, self.engine_bytes
        )
    }
}

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
    /// `pread` calls made.
    pub reads: usize,
    /// Slots that differ (0: verified).
    pub mismatched_slots: usize,
    /// The first [`VerifyReport::MAX_LISTED`] of them.
    pub mismatches: Vec<SlotMismatch>,
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

/// The largest read [`Checkpoint::verify`] makes at once.
const VERIFY_CHUNK: usize = 4 << 20;

impl Checkpoint {
    /// Packs every MoE layer into `store` with [`PinStore::pack_layer`] at its model layer
    /// number, the expert naming detected (see [`Naming::detect`]). Dense layers are not
    /// packed. An expert's weight slot holds its weight pieces in the naming's order
    /// (gate, up, down; fused: gate_up, down), its scale slot the scale pieces in the same
    /// order and then the expert's biases, if any ([`Naming::Generic`]); each piece is read from its own file straight into the slot, so an expert
    /// split across two shards costs a read per shard and no copy. Where the pieces went
    /// inside a slot: [`PinStore::slot_map`].
    ///
    /// The map budget for the whole model is checked before anything is reserved
    /// ([`PinStore::check_model_budget`]); a model with some layers with scales and some
    /// without is counted as if all had them.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] from the naming ([`CheckpointFault::NoExperts`] listing names
    /// that look like expert tensors, [`CheckpointFault::Missing`],
    /// [`CheckpointFault::Shape`]); [`Error::MapBudget`] when the model cannot fit;
    /// whatever [`PinStore::pack_layer`] returns (a layer packed already, a read that
    /// fails). Layers packed before an error stay packed.
    ///
    /// [`CheckpointFault::NoExperts`]: crate::CheckpointFault::NoExperts
    /// [`CheckpointFault::Missing`]: crate::CheckpointFault::Missing
    /// [`CheckpointFault::Shape`]: crate::CheckpointFault::Shape
    ///
    /// # Example
    /// ```no_run
    /// use numapin::model::Checkpoint;
    /// use numapin::store::{Layout, PinStore, StoreOptions};
    ///
    /// let checkpoint = Checkpoint::open("/models/qwen-moe")?; // shards and their index
    /// let store = PinStore::new(Layout::Interleave(numapin::NodeSet::allowed()?),
    ///                           StoreOptions::default())?;
    /// let report = checkpoint.pack(&store)?;
    /// println!("{report}");
    /// let gate_up_down: &[u8] = store.weights(3, 17)?; // layer 3, expert 17
    /// let down = store.slot_map(3)?.pieces(17, numapin::store::Kind::Weights).unwrap()[2];
    /// let _down_bytes = &gate_up_down[down.offset..down.end()];
    /// assert!(checkpoint.verify(&store)?.verified());
    /// # Ok::<(), numapin::Error>(())
    /// ```
    pub fn pack(&self, store: &PinStore) -> Result<ModelReport> {
        let naming = Naming::detect(self)?;
        self.pack_with(store, &naming)
    }

    /// [`Checkpoint::pack`] with a naming chosen by hand.
    ///
    /// # Errors
    /// As [`Checkpoint::pack`].
    pub fn pack_with(&self, store: &PinStore, naming: &Naming) -> Result<ModelReport> {
        let plan = naming.plan(self)?;
        // Each layer's sources, built once: sized here, packed below.
        let mut layers = Vec::with_capacity(plan.layers().len());
        for layer in plan.layers() {
            let sources = self.sources(layer)?;
            let spec = LayerSpec::fitting(&sources)?;
            layers.push((layer.layer(), spec, sources));
        }
        if let Some((_, first, _)) = layers.first() {
            let mut widest = *first;
            widest.scale_bytes = layers
                .iter()
                .map(|(_, s, _)| s.scale_bytes)
                .max()
                .unwrap_or(0);
            store.check_model_budget(layers.len(), &widest)?;
        }
        let mut layer_reports = Vec::with_capacity(layers.len());
        for (layer, spec, sources) in &layers {
            layer_reports.push(store.pack_layer(*layer, spec, sources)?);
        }
        Ok(self.report(&plan, layer_reports))
    }

    fn report(&self, plan: &ExpertPlan, layer_reports: Vec<LayerReport>) -> ModelReport {
        ModelReport {
            naming: plan.naming().to_owned(),
            files: self.files.len(),
            layers: plan.layers().len(),
            experts_per_layer: plan
                .layers()
                .iter()
                .map(|l| (l.layer(), l.experts().len()))
                .collect(),
            bytes: plan
                .layers()
                .iter()
                .map(|l| (l.weight_bytes() + l.scale_bytes()) * l.experts().len() as u64)
                .sum(),
            reads: layer_reports.iter().map(|r| r.reads).sum(),
            engine_tensors: plan.engine_tensors(),
            engine_bytes: plan.engine_bytes(),
            layer_reports,
        }
    }

    /// The store's sources for one layer: each plan piece as a [`Piece`] of its open file.
    fn sources(&self, layer: &LayerPlan) -> Result<Vec<ExpertSource<'_>>> {
        let piece = |p: &super::TensorPiece| -> Result<Piece<'_>> {
            let file = self.files.get(p.file()).ok_or_else(|| {
                Error::invalid(
                    "Checkpoint::pack",
                    format!("a piece names file {} of {}", p.file(), self.files.len()),
                )
            })?;
            let len = usize::try_from(p.len()).map_err(|_| {
                Error::overflow(
                    "Checkpoint::pack",
                    format!(
                        "{}: a piece of {} bytes as a usize",
                        file.path().display(),
                        p.len()
                    ),
                )
            })?;
            Ok(Piece::new(file.file(), p.offset(), len))
        };
        layer
            .experts()
            .iter()
            .map(|e| {
                Ok(ExpertSource::File {
                    weights: e.weights().iter().map(piece).collect::<Result<_>>()?,
                    scales: e.scales().iter().map(piece).collect::<Result<_>>()?,
                })
            })
            .collect()
    }

    /// Re-reads every expert piece from the files and compares it with its place in
    /// `store` (as [`PinStore::slot_map`] says); the bytes between pieces must be zero.
    /// The naming is detected as in [`Checkpoint::pack`].
    ///
    /// The reads go through the page cache (`pread`, at most 4 MiB at once); see
    /// [`Checkpoint::verify_in_mode`] to re-read the way a direct or drop-behind load did.
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
        self.verify_in_mode(store, naming, ReadMode::Buffered)
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
        let reader = Reader::new(mode, self.files.iter().map(|f| f.file()))?;
        let mut scratch = reader.scratch()?;
        let report = self.verify_using(store, naming, &reader, &mut scratch)?;
        reader.finish()?;
        Ok(report)
    }

    fn verify_using(
        &self,
        store: &PinStore,
        naming: &Naming,
        reader: &Reader<'_>,
        scratch: &mut Scratch,
    ) -> Result<VerifyReport> {
        let plan = naming.plan(self)?;
        let mut report = VerifyReport {
            slots: 0,
            bytes: 0,
            reads: 0,
            mismatched_slots: 0,
            mismatches: Vec::new(),
        };
        let largest = plan
            .layers()
            .iter()
            .flat_map(|l| l.experts())
            .flat_map(|e| e.weights().iter().chain(e.scales()))
            .map(|p| p.len())
            .max()
            .unwrap_or(0);
        let mut buffer =
            vec![0u8; usize::try_from(largest).map_or(VERIFY_CHUNK, |n| n.min(VERIFY_CHUNK))];
        for layer in plan.layers() {
            let map = store.slot_map(layer.layer())?;
            for (e, expert) in layer.experts().iter().enumerate() {
                for kind in Kind::ALL {
                    let (slot, pieces) = match kind {
                        Kind::Weights => (store.weights(layer.layer(), e)?, expert.weights()),
                        Kind::Scales => (store.scales(layer.layer(), e)?, expert.scales()),
                    };
                    if pieces.is_empty() && slot.is_empty() {
                        continue;
                    }
                    report.slots += 1;
                    let places = map.pieces(e, kind).unwrap_or_default();
                    let found = self.compare_slot(
                        slot,
                        pieces,
                        places,
                        (&mut buffer, reader, &mut *scratch),
                        &mut report,
                    )?;
                    if let Some((slot_offset, reason)) = found {
                        report.mismatched_slots += 1;
                        if report.mismatches.len() < VerifyReport::MAX_LISTED {
                            report.mismatches.push(SlotMismatch {
                                layer: layer.layer(),
                                expert: e,
                                kind,
                                slot_offset,
                                reason,
                            });
                        }
                    }
                }
            }
        }
        Ok(report)
    }

    /// The first difference between `slot` and `pieces` laid out as `places`.
    fn compare_slot(
        &self,
        slot: &[u8],
        pieces: &[super::TensorPiece],
        places: &[SlotPiece],
        (buffer, reader, scratch): (&mut [u8], &Reader<'_>, &mut Scratch),
        report: &mut VerifyReport,
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
            if let Some(i) = padding.iter().position(|&b| b != 0) {
                return Ok(Some((
                    at + i,
                    format!("padding before piece {index} is not zero"),
                )));
            }
            let file = self.files.get(piece.file()).ok_or_else(|| {
                Error::invalid(
                    "Checkpoint::verify",
                    format!(
                        "a piece names file {} of {}",
                        piece.file(),
                        self.files.len()
                    ),
                )
            })?;
            let mut done = 0usize;
            while done < place.len {
                let n = (place.len - done).min(buffer.len());
                let offset = piece.offset() + done as u64;
                let what = || format!("verify {}", file.path().display());
                reader.read(file.file(), offset, &mut buffer[..n], scratch, &what)?;
                report.reads += 1;
                report.bytes += n as u64;
                let here = place.offset + done;
                let held = slot.get(here..here + n).unwrap_or_default();
                if held != &buffer[..n] {
                    let i = (0..n).find(|&i| held.get(i) != buffer.get(i)).unwrap_or(0);
                    return Ok(Some((
                        here + i,
                        format!(
                            "piece {index} differs from {} at file offset {}",
                            file.path().display(),
                            offset + i as u64
                        ),
                    )));
                }
                done += n;
            }
            at = place.end();
        }
        Ok(None)
    }
}
