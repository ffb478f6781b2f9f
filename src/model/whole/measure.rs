//! What a placed model measures: the mappings of its stores, each class's figures for
//! its [`WholeReport`](super::WholeReport), and the check of every placed tensor, every
//! copy, against the files ([`PlacedModel::verify`]).

use super::classes::TensorClass;
use super::report::{ClassMeasured, WholeVerify};
use super::shape::normalized_shape;
use super::views::{Place, PlacedModel, PlacedTensor};
use crate::error::{Error, Result, quote};
use crate::source::load::{Reader, Scratch};
use crate::store::PinStore;

impl PlacedModel {
    /// Distinct mappings the regions of every store lie in (each counted once).
    pub(crate) fn mappings(&self) -> Result<usize> {
        let spans: Vec<(usize, usize)> = (self.stores.iter().map(|s| &s.store))
            .chain(self.experts.iter())
            .flat_map(PinStore::spans)
            .collect();
        crate::diag::maps_overlapping(&spans)
    }

    /// Measures every class's stores.
    pub(crate) fn measure(&self) -> Result<Vec<ClassMeasured>> {
        let mut out: Vec<ClassMeasured> = Vec::new();
        let stores = self
            .stores
            .iter()
            .map(|s| {
                (
                    s.class,
                    &s.store,
                    s.reads,
                    (s.bounced, s.direct),
                    s.load_nanos,
                    &s.files,
                )
            })
            .chain(self.experts.iter().map(|s| {
                let nanos = self.expert_load_nanos;
                // The experts' bounced bytes stay in their report (`bounced_bytes` counts
                // the dense classes').
                let (bounced, direct) = (0, self.expert_reads);
                (
                    TensorClass::RoutedExperts,
                    s,
                    0,
                    (bounced, direct),
                    nanos,
                    &self.expert_files,
                )
            }));
        for (class, store, reads, (bounced, direct), load_nanos, files) in stores {
            let stats = store.stats()?;
            let placement = placement_text(store, stats.placement);
            match out.iter_mut().find(|m| m.class == class) {
                Some(m) => {
                    m.mappings += stats.vmas;
                    m.mbind_calls += stats.mbind_calls;
                    m.reads += reads;
                    m.bounced_bytes += bounced;
                    m.direct_reads = m.direct_reads.plus(direct);
                    m.load_nanos += load_nanos;
                    for f in files {
                        super::place::note_file(&mut m.files, f);
                    }
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
                    direct_reads: direct,
                    placement,
                    load_nanos,
                    files: files.clone(),
                }),
            }
        }
        out.sort_by_key(|m| m.class);
        Ok(out)
    }
}

/// Adds the nanoseconds since `started` to `class`'s verify time.
pub(super) fn add_nanos(report: &mut WholeVerify, class: TensorClass, started: std::time::Instant) {
    let nanos = super::report::nanos_since(started);
    match report.class_nanos.iter_mut().find(|(c, _)| *c == class) {
        Some((_, n)) => *n = n.saturating_add(nanos),
        None => report.class_nanos.push((class, nanos)),
    }
}

/// How the bytes `t` holds of `whole` differ from what its slice must hold, computed
/// from the file's shape, bytes and dtype alone ([`slice::check`](crate::model::slice::check)):
/// its pieces in the file (count, offsets from the tensor's start, lengths) and the run
/// its slot holds (rows × the sliced row's bytes, back to back).
pub(super) fn slice_fault(whole: &crate::model::TensorInfo, t: &PlacedTensor) -> Option<String> {
    use crate::model::slice::check::{Part, expected, mismatch};
    let s = t.slice?;
    let shape = normalized_shape(whole);
    // MXFP4 `…_blocks` `[…, C/32, 16]` bytes: its columns are the last two axes' elements.
    let inner = if shape.last() == Some(&s.extent) || s.axis == crate::model::SliceAxis::Rows {
        1
    } else {
        2
    };
    let part = Part {
        bytes: whole.len(),
        outer: shape.first().copied().unwrap_or(1),
        rows: shape[..shape.len().saturating_sub(inner)].iter().product(),
        dtype: whole.dtype(),
    };
    let want = match expected(part, (s.axis, s.start, s.len, s.extent), false) {
        Ok(want) => want,
        Err(why) => return Some(why),
    };
    let (count, stride) = t.rows;
    let per = t.len.checked_div(count).unwrap_or(0);
    let pieces: Vec<(u64, u64)> = (0..count).map(|r| (t.offset + r * stride, per)).collect();
    if let Some(why) = mismatch(&pieces, &want, whole.offset()) {
        return Some(why);
    }
    let held = want.count.saturating_mul(want.len);
    match t.place {
        Place::Dense { len, .. } if len as u64 != held => Some(format!(
            "its slot holds {len} bytes, the slice's geometry {} rows of {} bytes",
            want.count, want.len
        )),
        _ => None,
    }
}

/// The most bytes one verify read of a column slice spans (its rows and the other
/// ranks' columns between them), so that re-reading a big tensor costs few `pread`s
/// and bounded memory.
const VERIFY_SPAN: u64 = 4 << 20;

/// Reads the bytes `t` holds into `buffer` (its `len` bytes): one read, or for a column
/// slice one read per run of rows spanning at most [`VERIFY_SPAN`], each row's piece
/// then packed back to back as the slot holds them. Returns the reads.
pub(super) fn read_held(
    file: &crate::model::CheckpointFile,
    t: &PlacedTensor,
    buffer: &mut [u8],
    (reader, scratch): (&Reader<'_>, &mut Scratch),
) -> Result<usize> {
    let (count, stride) = t.rows;
    let per = usize::try_from(t.len / count.max(1)).unwrap_or(usize::MAX);
    let name = || format!("{} in {}", quote(&t.name), file.path().display());
    if count <= 1 || per == 0 {
        reader.read(file.file(), t.offset, buffer, scratch, &name)?;
        return Ok(1);
    }
    let what = &t.name;
    let read = |at: u64, into: &mut [u8]| reader.read(file.file(), at, into, scratch, &name);
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
