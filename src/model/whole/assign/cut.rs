//! The part of each dense tensor a rank holds under a slice: a weight's rows (one
//! contiguous piece) or columns (one strided piece per row), and a block-scale grid's
//! entries where its weight is cut.

use std::ops::Range;

use super::DenseCut;
use crate::error::{Error, Result};
use crate::model::slice::{Geometry, Run, tensor_geometry};
use crate::model::whole::shape::{DenseSlice, normalized_shape};
use crate::model::{Checkpoint, SliceAxis, TensorInfo, TensorSlice};

const OP: &str = "PlacementPlan::dense_slice";

/// The weight a block-scale grid belongs to: DeepSeek's FP8 `X.weight_scale_inv` (one
/// entry per 128×128 block of `X.weight`), when that weight exists and is 2-D.
pub(super) fn scale_of<'a>(checkpoint: &'a Checkpoint, t: &TensorInfo) -> Option<&'a TensorInfo> {
    let weight = t.name().strip_suffix("_scale_inv")?;
    checkpoint
        .tensor(weight)
        .filter(|w| w.shape().len() >= 2 && t.shape().len() >= 2)
}

fn bad(t: &TensorInfo, slice: &TensorSlice, why: String) -> Error {
    Error::bad_value(
        OP,
        "tensor slice",
        slice,
        format!(
            "{} {:?}: {why}",
            crate::error::quote(t.name()),
            normalized_shape(t)
        ),
    )
}

/// A scale grid cut where its weight is cut, along the same axis: the weight's entries
/// `a..b` under blocks of `B` are the grid's `a/B..⌈b/B⌉`; a cut inside a block is
/// refused naming the block size (the block's scale would be shared by two ranks).
pub(super) fn scale_cut(
    t: &TensorInfo,
    weight: &TensorInfo,
    slice: &TensorSlice,
) -> Result<Option<DenseCut>> {
    let Some(wcut) = dense_cut(weight, slice, false)? else {
        return Ok(None);
    };
    let g = tensor_geometry(t, t.len())?;
    let axis = slice.axis();
    let (n, s) = (wcut.slice.extent, g.extent(axis));
    let block = if s == 0 { 0 } else { n.div_ceil(s) };
    let (start, end) = (wcut.slice.start, wcut.slice.start + wcut.slice.len);
    let on_edge = |x: u64| block > 0 && (x.is_multiple_of(block) || x == n);
    if block == 0 || n.div_ceil(block) != s || !on_edge(start) || !on_edge(end) {
        return Err(bad(
            t,
            slice,
            format!(
                "{} {start}..{end} of its weight's {n} cut through its scale blocks of \
                 {block}: a cut falls on a multiple of {block} (keep the class whole with \
                 PlacementPlan::whole)",
                axis.name()
            ),
        ));
    }
    let range = start / block..end.div_ceil(block);
    cut_of(t, &g, slice, range).map(Some)
}

/// The part of `t` that `slice` holds. A 1-D (or 0-D) tensor: `Ok(None)` (kept whole),
/// unless `explicit` (a slice asked for by name), then an error naming it; a 1-D
/// tensor's one axis is its rows ([`SliceAxis::Rows`] of a bias is its entries).
pub(crate) fn dense_cut(
    t: &TensorInfo,
    slice: &TensorSlice,
    explicit: bool,
) -> Result<Option<DenseCut>> {
    let g = tensor_geometry(t, t.len())?;
    if g.dims.len() < 2 && !(g.dims.len() == 1 && explicit_rows(slice, explicit)) {
        if explicit {
            return Err(bad(
                t,
                slice,
                "a 1-D tensor has only rows to slice (a column slice of it is asked for by \
                 name)"
                    .into(),
            ));
        }
        return Ok(None);
    }
    let range = slice
        .resolve(g.extent(slice.axis()))
        .map_err(|why| bad(t, slice, why))?;
    cut_of(t, &g, slice, range).map(Some)
}

/// A row slice asked for by name cuts a 1-D tensor (a column-parallel layer's bias).
fn explicit_rows(slice: &TensorSlice, explicit: bool) -> bool {
    explicit && slice.axis() == SliceAxis::Rows
}

/// The cut holding `range` of `slice`'s axis of `t`.
fn cut_of(
    t: &TensorInfo,
    g: &Geometry,
    slice: &TensorSlice,
    range: Range<u64>,
) -> Result<DenseCut> {
    let axis = slice.axis();
    let run: Run = g.run(axis, &range).map_err(|why| bad(t, slice, why))?;
    Ok(DenseCut {
        run,
        slice: DenseSlice {
            axis,
            start: range.start,
            len: range.end - range.start,
            extent: g.extent(axis),
        },
    })
}
