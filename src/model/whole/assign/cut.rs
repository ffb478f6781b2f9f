//! The rows of each dense tensor a rank holds under a dense slice: a weight's rows, and
//! a block-scale grid's rows where its weight's are cut.

use std::ops::Range;

use super::DenseCut;
use crate::error::{Error, Result};
use crate::model::whole::views;
use crate::model::{Checkpoint, SliceAxis, TensorInfo, TensorSlice};

/// The weight a block-scale grid belongs to: DeepSeek's FP8 `X.weight_scale_inv` (one
/// entry per 128×128 block of `X.weight`), when that weight exists and is 2-D.
pub(super) fn scale_of<'a>(checkpoint: &'a Checkpoint, t: &TensorInfo) -> Option<&'a TensorInfo> {
    let weight = t.name().strip_suffix("_scale_inv")?;
    checkpoint
        .tensor(weight)
        .filter(|w| w.shape().len() >= 2 && t.shape().len() >= 2)
}

/// A scale grid cut where its weight's rows are cut: the weight's rows `a..b` under
/// blocks of `B` rows are the grid's rows `a/B..⌈b/B⌉`; a cut inside a block is refused
/// naming the block size (the block's scale would be shared by two ranks).
pub(super) fn scale_cut(
    t: &TensorInfo,
    weight: &TensorInfo,
    slice: &TensorSlice,
) -> Result<Option<DenseCut>> {
    let Some(wcut) = dense_cut(weight, slice)? else {
        return Ok(None);
    };
    let (n, rows) = (wcut.slice.extent, views::normalized_shape(t)[0]);
    let block = if rows == 0 { 0 } else { n.div_ceil(rows) };
    let (start, end) = (wcut.slice.start, wcut.slice.start + wcut.slice.len);
    let on_edge = |x: u64| block > 0 && (x.is_multiple_of(block) || x == n);
    if block == 0
        || n.div_ceil(block) != rows
        || !t.len().is_multiple_of(rows)
        || !on_edge(start)
        || !on_edge(end)
    {
        return Err(Error::bad_value(
            "PlacementPlan::dense_slice",
            "tensor slice",
            slice,
            format!(
                "{} {:?}: rows {start}..{end} of its weight's {n} cut through its scale \
                 blocks of {block} rows: a cut falls on a multiple of {block} (keep the \
                 class whole with PlacementPlan::whole)",
                crate::error::quote(t.name()),
                t.shape()
            ),
        ));
    }
    let range = start / block..end.div_ceil(block);
    Ok(Some(rows_cut(t, range, rows)))
}

/// The rows of `t` that `slice` holds: `Ok(None)` for a 1-D (or 0-D) tensor, kept whole.
pub(super) fn dense_cut(t: &TensorInfo, slice: &TensorSlice) -> Result<Option<DenseCut>> {
    let dims = views::normalized_shape(t);
    if dims.len() < 2 {
        return Ok(None);
    }
    let bad = |why: String| {
        Error::bad_value(
            "PlacementPlan::dense_slice",
            "tensor slice",
            slice,
            format!("{} {dims:?}: {why}", crate::error::quote(t.name())),
        )
    };
    if slice.axis() != SliceAxis::Rows {
        return Err(bad(
            "dense tensors are sliced by rows only (a column slice of a dense tensor is \
             not placed yet)"
                .into(),
        ));
    }
    let rows = dims[0];
    if rows == 0 || !t.len().is_multiple_of(rows) {
        return Err(bad(format!("{} bytes are not {rows} equal rows", t.len())));
    }
    let range = slice.resolve(rows).map_err(bad)?;
    Ok(Some(rows_cut(t, range, rows)))
}

/// The cut holding rows `range` of `t`'s `rows` equal rows.
fn rows_cut(t: &TensorInfo, range: Range<u64>, rows: u64) -> DenseCut {
    let stride = t.len() / rows;
    DenseCut {
        offset: range.start * stride,
        len: (range.end - range.start) * stride,
        slice: views::DenseSlice {
            axis: SliceAxis::Rows,
            start: range.start,
            len: range.end - range.start,
            extent: rows,
        },
    }
}
