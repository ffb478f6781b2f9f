//! What [`Checkpoint::place`](crate::model::Checkpoint::place) did ([`WholeReport`]), and
//! the check of every placed tensor, every copy, against the files ([`WholeVerify`]).

use std::fmt;
use std::os::unix::fs::FileExt;

use super::assign::PlacementCost;
use super::classes::TensorClass;
use super::views::{Place, PlacedModel};
use crate::error::{Error, Result};
use crate::model::{Checkpoint, ModelReport, VerifyReport};
use crate::store::PinStore;

/// What placing a checkpoint whole did: the plan, its cost as counted before anything
/// was reserved, and what each class's stores measured.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WholeReport {
    /// The plan in its text form.
    pub plan: String,
    /// Which share was placed ([`PlacementPlan::share_text`]); `None`: the whole model.
    ///
    /// [`PlacementPlan::share_text`]: super::PlacementPlan::share_text
    pub share: Option<String>,
    /// The expert naming (none: the checkpoint has no routed experts).
    pub naming: Option<String>,
    /// Files of the checkpoint.
    pub files: usize,
    /// Tensors of the checkpoint, every one placed.
    pub tensors: usize,
    /// Their bytes, as in the files (the whole checkpoint's; the cost counts the share).
    pub bytes: u64,
    /// The plan's cost, per class (with why each class has its layout).
    pub cost: PlacementCost,
    /// Measured per class, in the order of `cost.classes`.
    pub measured: Vec<ClassMeasured>,
    /// The experts' pack report, as [`Checkpoint::pack`](crate::model::Checkpoint::pack)
    /// gives it.
    pub experts: Option<ModelReport>,
}

/// One class's stores, measured after packing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ClassMeasured {
    /// The class.
    pub class: TensorClass,
    /// Mappings its stores occupy, counted in `/proc/self/smaps`.
    pub mappings: usize,
    /// `mbind` calls its stores made.
    pub mbind_calls: usize,
    /// `pread` calls its loads made (dense classes; the experts' are in their report).
    pub reads: usize,
    /// Bytes its [`ReadMode::Direct`](crate::store::ReadMode::Direct) loads copied through
    /// the bounce buffer instead of reading in place (dense classes; the experts' are in
    /// their report's [`LayerReport::bounced_bytes`](crate::store::LayerReport::bounced_bytes)).
    pub bounced_bytes: u64,
    /// `bound`, `unplaced`, or `degraded: REASON` (one copy, no policy).
    pub placement: String,
}

impl PlacedModel {
    /// Measures every class's stores.
    pub(crate) fn measure(&self) -> Result<Vec<ClassMeasured>> {
        let mut out: Vec<ClassMeasured> = Vec::new();
        let stores = self
            .stores
            .iter()
            .map(|s| (s.class, &s.store, s.reads, s.bounced))
            .chain(
                self.experts
                    .iter()
                    .map(|s| (TensorClass::RoutedExperts, s, 0, 0)),
            );
        for (class, store, reads, bounced) in stores {
            let stats = store.stats()?;
            let placement = placement_text(store, stats.placement);
            match out.iter_mut().find(|m| m.class == class) {
                Some(m) => {
                    m.mappings += stats.vmas;
                    m.mbind_calls += stats.mbind_calls;
                    m.reads += reads;
                    m.bounced_bytes += bounced;
                    if m.placement != placement {
                        m.placement = format!("{}, {placement}", m.placement);
                    }
                }
                None => out.push(ClassMeasured {
                    class,
                    mappings: stats.vmas,
                    mbind_calls: stats.mbind_calls,
                    reads,
                    bounced_bytes: bounced,
                    placement,
                }),
            }
        }
        out.sort_by_key(|m| m.class);
        Ok(out)
    }

    /// Re-reads every placed tensor from the files and compares it with every copy of it
    /// (each replica of a replicated class); the routed experts as
    /// [`Checkpoint::verify_with`] does (each slot's pieces, padding zero).
    ///
    /// # Errors
    /// `checkpoint` is not the one placed (its tensor names differ); a read fails; a
    /// store read fails.
    pub fn verify(&self, checkpoint: &Checkpoint) -> Result<WholeVerify> {
        let same = checkpoint.tensors().len() == self.tensors.len()
            && checkpoint
                .tensors()
                .iter()
                .zip(&self.tensors)
                .all(|(a, b)| a.name() == b.name && (a.len() == b.len || b.slice.is_some()));
        if !same {
            return Err(Error::invalid(
                "PlacedModel::verify",
                "the checkpoint is not the one placed (its tensors differ)",
            ));
        }
        let mut report = WholeVerify::default();
        let mut buffer = Vec::new();
        for t in &self.tensors {
            if !matches!(t.place, Place::Dense { .. } | Place::ExpertPiece { .. }) {
                continue;
            }
            let file = checkpoint.files().get(t.file).ok_or_else(|| {
                Error::invalid(
                    "PlacedModel::verify",
                    format!("file {} of a tensor", t.file),
                )
            })?;
            let len = usize::try_from(t.len).map_err(|_| {
                Error::overflow(
                    "PlacedModel::verify",
                    format!("{}: {} bytes", t.name, t.len),
                )
            })?;
            buffer.resize(len, 0);
            report.reads += read_held(file, t, &mut buffer)?;
            report.tensors += 1;
            for (node, held) in self.tensor_copies(&t.name)? {
                report.copies += 1;
                report.bytes += held.len() as u64;
                if held != &buffer[..] {
                    report.mismatched += 1;
                    if report.mismatches.len() < VerifyReport::MAX_LISTED {
                        let at = held.iter().zip(&buffer).position(|(a, b)| a != b);
                        report.mismatches.push(format!(
                            "{} (copy on node {}): {} bytes held, {} in the file, first \
                             difference at byte {}",
                            t.name,
                            node.map_or("-".to_owned(), |n| n.0.to_string()),
                            held.len(),
                            buffer.len(),
                            at.unwrap_or(held.len().min(buffer.len()))
                        ));
                    }
                }
            }
        }
        if let (Some(store), Some(plan)) = (&self.experts, &self.expert_plan) {
            report.experts =
                Some(checkpoint.verify_plan(store, plan, crate::source::ReadMode::Buffered)?);
        }
        Ok(report)
    }
}

/// The most bytes one verify read of a column slice spans (its rows and the other
/// ranks' columns between them), so that re-reading a big tensor costs few `pread`s
/// and bounded memory.
const VERIFY_SPAN: u64 = 4 << 20;

/// Reads the bytes `t` holds into `buffer` (its `len` bytes): one read, or for a column
/// slice one read per run of rows spanning at most [`VERIFY_SPAN`], each row's piece
/// then packed back to back as the slot holds them. Returns the reads.
fn read_held(
    file: &crate::model::CheckpointFile,
    t: &super::views::PlacedTensor,
    buffer: &mut [u8],
) -> Result<usize> {
    let (count, stride) = t.rows;
    let per = usize::try_from(t.len / count.max(1)).unwrap_or(usize::MAX);
    let io = |e| Error::io("pread", file.path().display().to_string(), e);
    if count <= 1 || per == 0 {
        file.file().read_exact_at(buffer, t.offset).map_err(io)?;
        return Ok(1);
    }
    let what = &t.name;
    let read = |at: u64, into: &mut [u8]| file.file().read_exact_at(into, at).map_err(io);
    gather_rows(read, (t.offset, stride, per), buffer, VERIFY_SPAN, what)
}

/// Fills `buffer` with pieces of `per` bytes, the first at `offset`, each `stride` after
/// the one before, through `read` (file offset, bytes), one read per run of rows whose
/// span is at most `span` (at least one row a read). Returns the reads.
fn gather_rows(
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
    (offset, stride, per): (u64, u64, usize),
    buffer: &mut [u8],
    span: u64,
    what: &str,
) -> Result<usize> {
    let overflow = || Error::overflow("PlacedModel::verify", format!("{what}: a row offset"));
    // Rows a read covers: the span of `n` rows is (n - 1) strides and a piece.
    let rows_per_read = (span.saturating_sub(per as u64) / stride.max(1) + 1).max(1);
    let group_bytes = per.saturating_mul(usize::try_from(rows_per_read).unwrap_or(usize::MAX));
    let mut scratch = Vec::new();
    let mut reads = 0;
    for (g, group) in buffer.chunks_mut(group_bytes.max(1)).enumerate() {
        let at = (g as u64)
            .checked_mul(rows_per_read)
            .and_then(|first| first.checked_mul(stride))
            .and_then(|d| offset.checked_add(d))
            .ok_or_else(overflow)?;
        let rows = group.len().div_ceil(per);
        let bytes = (rows - 1)
            .checked_mul(usize::try_from(stride).map_err(|_| overflow())?)
            .and_then(|d| d.checked_add(per))
            .ok_or_else(overflow)?;
        scratch.resize(bytes, 0);
        read(at, &mut scratch)?;
        reads += 1;
        for (r, row) in group.chunks_mut(per).enumerate() {
            let from = r * stride as usize;
            row.copy_from_slice(&scratch[from..from + row.len()]);
        }
    }
    Ok(reads)
}

fn placement_text(store: &PinStore, placement: Option<crate::policy::Placement>) -> String {
    match (store.degraded(), placement) {
        (Some(reason), _) => format!("degraded: {reason:?}"),
        (None, Some(_)) => "bound".to_owned(),
        (None, None) => "unplaced".to_owned(),
    }
}

/// What [`PlacedModel::verify`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WholeVerify {
    /// Tensors re-read and compared (dense ones and per-expert ones; the pieces of
    /// tensors holding every expert are in `experts`).
    pub tensors: usize,
    /// Copies compared (a replicated tensor has one per node).
    pub copies: usize,
    /// Bytes compared over every copy.
    pub bytes: u64,
    /// `pread` calls.
    pub reads: usize,
    /// Copies that differ.
    pub mismatched: usize,
    /// The first [`VerifyReport::MAX_LISTED`] of them.
    pub mismatches: Vec<String>,
    /// The experts' slots, compared as [`Checkpoint::verify_with`] does.
    pub experts: Option<VerifyReport>,
}

impl WholeVerify {
    /// Whether every copy of every tensor, and every expert slot, is exactly the file's.
    pub fn verified(&self) -> bool {
        self.mismatched == 0 && self.experts.as_ref().is_none_or(VerifyReport::verified)
    }
}

impl fmt::Display for WholeVerify {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.verified() {
            write!(
                f,
                "verified: {} tensors in {} copies ({} bytes) equal to the files",
                self.tensors, self.copies, self.bytes
            )?;
        } else {
            write!(f, "NOT verified: {} copies differ", self.mismatched)?;
            if let Some(m) = self.mismatches.first() {
                write!(f, "; first: {m}")?;
            }
        }
        if let Some(e) = &self.experts {
            write!(f, "; experts {e}")?;
        }
        Ok(())
    }
}

impl fmt::Display for WholeReport {
    /// A table: per class its layout, tensors, bytes, groups, mappings (planned and
    /// measured), `mbind` calls, one-mapping-per-tensor, and why.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "plan {} ({} tensors, {} bytes, {} file(s), naming {})",
            self.plan,
            self.tensors,
            self.bytes,
            self.files,
            self.naming.as_deref().unwrap_or("none")
        )?;
        if let Some(share) = &self.share {
            writeln!(
                f,
                "  share placed: {share} (cost and budgets count the share)"
            )?;
        }
        writeln!(
            f,
            "  {:<11} {:<22} {:>7} {:>12} {:>6} {:>9} {:>9} {:>6} {:>10}  placement; why",
            "class",
            "layout",
            "tensors",
            "bytes",
            "groups",
            "mappings",
            "measured",
            "mbind",
            "per-tensor"
        )?;
        for c in &self.cost.classes {
            let m = self.measured.iter().find(|m| m.class == c.class);
            writeln!(
                f,
                "  {:<11} {:<22} {:>7} {:>12} {:>6} {:>9} {:>9} {:>6} {:>10}  {}; {}",
                c.class.name(),
                c.layout,
                c.tensors,
                c.bytes,
                c.groups,
                c.mappings,
                m.map_or(0, |m| m.mappings),
                m.map_or(0, |m| m.mbind_calls),
                c.per_tensor_mappings,
                m.map_or("", |m| m.placement.as_str()),
                c.why
            )?;
            if !c.slices.is_empty() {
                // What an engine checks it got: the slices of the class's tensors.
                writeln!(f, "  {:<11} slices held: {}", "", c.slices)?;
            }
        }
        let nodes: Vec<String> = self
            .cost
            .node_bytes
            .iter()
            .map(|(n, b)| format!("node {}: {b}", n.0))
            .collect();
        write!(
            f,
            "  total: {} mappings planned ({} measured), {} mbind calls planned, against {} \
             for one mapping per tensor; bytes per node {}",
            self.cost.mappings,
            self.measured.iter().map(|m| m.mappings).sum::<usize>(),
            self.cost.mbind_calls,
            self.cost.per_tensor_mappings,
            if nodes.is_empty() {
                "none bound".to_owned()
            } else {
                nodes.join(", ")
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::gather_rows;

    #[test]
    fn rows_are_gathered_in_runs_within_the_span() {
        // 10 rows of 16 bytes, 4 held from byte 4 of each.
        let file: Vec<u8> = (0..160u8).collect();
        let want: Vec<u8> = (0..10)
            .flat_map(|r| file[r * 16 + 4..r * 16 + 8].to_vec())
            .collect();
        for (span, reads) in [(1u64, 10), (4, 10), (20, 5), (36, 4), (1 << 20, 1)] {
            let mut buffer = vec![0u8; 40];
            let mut calls = 0;
            let read = |at: u64, into: &mut [u8]| {
                calls += 1;
                let at = at as usize;
                into.copy_from_slice(&file[at..at + into.len()]);
                Ok(())
            };
            let n = gather_rows(read, (4, 16, 4), &mut buffer, span, "t").unwrap();
            assert_eq!(buffer, want, "span {span}");
            assert_eq!((n, calls), (reads, reads), "span {span}");
        }
    }
}
