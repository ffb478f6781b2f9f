//! `WholeModel.layer(l, role)` and `WholeModel.tensor(name)` of a tensor holding every
//! expert of a layer: one strided view over the experts' slots, where the layout keeps
//! the experts' pieces at one stride.

use std::sync::Arc;

use numapin::model::{ExpertPieceView, ExpertTensorRef, PlacedModel, TensorView};
use pyo3::prelude::*;

use crate::errors::clip;
use crate::errors::{IntoPy, InvalidArgument};
use crate::view::tensor_layout;
use crate::view::{Elem, View};

/// The pieces from role `role` to `through` (or `role` alone) of one expert, in slot
/// order, each found by its canonical name or the file's; an error naming the roles where
/// either is missing or `through` comes first.
pub fn role_run<'p, 'a>(
    pieces: &'p [ExpertPieceView<'a>],
    layer: usize,
    role: &str,
    through: Option<&str>,
) -> PyResult<&'p [ExpertPieceView<'a>]> {
    let find = |name: &str| {
        let at = pieces.iter().position(|p| p.canonical == name);
        at.or_else(|| pieces.iter().position(|p| p.role == name))
            .ok_or_else(|| {
                let names: Vec<&str> = pieces.iter().map(|p| p.canonical).collect();
                InvalidArgument::new_err(format!(
                    "layer {layer}: no role {:?} (roles: {names:?})",
                    clip(name)
                ))
            })
    };
    let first = find(role)?;
    let last = match through {
        Some(t) => find(t)?,
        None => first,
    };
    if last < first || pieces[first].slot != pieces[last].slot {
        return Err(InvalidArgument::new_err(format!(
            "layer {layer}: {:?} does not follow {role:?} in the same slot",
            through.unwrap_or(role)
        )));
    }
    Ok(&pieces[first..=last])
}

/// The element type, shape and bytes of pieces joined along their first dimension: one
/// dtype, back to back, the same inner dimensions (raw bytes for GGML quant blocks).
pub fn joined_layout(
    run: &[ExpertPieceView<'_>],
    layer: usize,
) -> PyResult<(Elem, Vec<u64>, usize)> {
    let head = &run[0];
    let (elem, mut shape) = tensor_layout(head.dtype, &head.shape, head.bytes.len());
    let mut len = head.bytes.len();
    for pair in run.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let (e, s) = tensor_layout(b.dtype, &b.shape, b.bytes.len());
        let adjacent = a.bytes.as_ptr() as usize + a.bytes.len() == b.bytes.as_ptr() as usize;
        let same_inner = shape.get(1..) == s.get(1..) && e.name == elem.name;
        if !adjacent || !same_inner || shape.is_empty() {
            return Err(InvalidArgument::new_err(format!(
                "layer {layer}: {:?} ({} {:?}) and {:?} ({} {:?}) cannot be joined: not back \
                 to back, or another dtype or inner shape",
                a.role, a.dtype, a.shape, b.role, b.dtype, b.shape
            )));
        }
        shape[0] += s[0];
        len += b.bytes.len();
    }
    Ok((elem, shape, len))
}

/// The run `role..through` of every expert of `layer` the model holds: its first byte,
/// element type, per-expert shape and bytes, the experts held and the slot stride.
struct Strided {
    first: usize,
    elem: Elem,
    inner: Vec<u64>,
    len: usize,
    experts: usize,
    stride: usize,
}

fn strided(
    model: &PlacedModel,
    layer: usize,
    role: &str,
    through: Option<&str>,
) -> PyResult<Strided> {
    let ids = model.expert_ids(layer).py_err()?;
    let mut firsts = Vec::with_capacity(ids.len());
    let mut joined = None;
    for &id in &ids {
        let pieces = model.expert(layer, id).py_err()?;
        let run = role_run(&pieces, layer, role, through)?;
        firsts.push(run[0].bytes.as_ptr() as usize);
        if joined.is_none() {
            joined = Some(joined_layout(run, layer)?);
        }
    }
    let Some((elem, inner, len)) = joined else {
        return Err(InvalidArgument::new_err(format!(
            "layer {layer}: this model holds none of its experts"
        )));
    };
    let stride = firsts.get(1).map_or(len, |&a| a.wrapping_sub(firsts[0]));
    let uniform = firsts
        .iter()
        .enumerate()
        .all(|(e, &a)| Some(a) == e.checked_mul(stride).and_then(|o| firsts[0].checked_add(o)));
    if !uniform || stride < len {
        return Err(crate::errors::NumapinError::new_err(format!(
            "layer {layer}: the experts' {:?} pieces are not at one stride (slots in an \
             expert assignment's order, or pieces placed congruent to their file offsets \
             for direct reads): read them with expert(layer, e)",
            clip(role)
        )));
    }
    Ok(Strided {
        first: firsts[0],
        elem,
        inner,
        len,
        experts: ids.len(),
        stride,
    })
}

/// `WholeModel.layer(layer, role, through=)`: `[experts, ...]`, the slot stride outermost.
pub fn role_view(
    model: &Arc<PlacedModel>,
    layer: usize,
    role: &str,
    through: Option<&str>,
) -> PyResult<View> {
    let run = strided(model, layer, role, through)?;
    let (shape, strides) =
        crate::view::experts_layout(run.elem, run.experts, run.stride, &run.inner);
    // SAFETY: expert i's joined pieces are `len` bytes at `first + i × stride` (checked
    // in `strided` for every held expert, `stride ≥ len`), each inside its slot in the
    // expert store, which the placed model never releases and `model` keeps alive for as
    // long as the view.
    Ok(unsafe { View::new(run.first, run.elem, shape, strides, model.clone()) })
}

/// Tensor `t`, which holds every expert of `at.layer` under one name, as one view with
/// the file's shape, when the model holds every expert whole and its pieces lie at one
/// stride: `[E, ...]` strided by the slot (`experts.gate_up_proj`, Granite's
/// `input_linear`), or, for DBRX's `[E·I, H]`, only where the pieces are back to back
/// (role-major slots make it one run, which `PlacedModel::tensor` gives before this).
/// `None` where the layout does not keep the tensor whole (a share, a slice, a layer
/// whose slots an expert assignment orders, DBRX's pieces a slot apart). A layer split over
/// nodes is one range bound node block by node block, its slots at one stride: a view.
pub fn whole_tensor(
    model: &Arc<PlacedModel>,
    t: &TensorView<'_>,
    at: &ExpertTensorRef,
) -> PyResult<Option<View>> {
    let Ok(run) = strided(model, at.layer, &at.file_role, None) else {
        return Ok(None);
    };
    let Some(total) = run.experts.checked_mul(run.len) else {
        return Ok(None);
    };
    let (elem, shape) = tensor_layout(t.dtype(), t.shape(), total);
    if elem.name != run.elem.name {
        return Ok(None);
    }
    let mut held = vec![run.experts as u64];
    held.extend(&run.inner);
    if shape == held {
        let (shape, strides) =
            crate::view::experts_layout(run.elem, run.experts, run.stride, &run.inner);
        // SAFETY: as in `role_view`: every expert's piece at `first + i × stride`, inside
        // the expert store `model` keeps alive.
        return Ok(Some(unsafe {
            View::new(run.first, run.elem, shape, strides, model.clone())
        }));
    }
    let elements = |s: &[u64]| s.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    let flattened = shape.len() == run.inner.len() && elements(&shape) == elements(&held);
    if run.stride != run.len || !flattened || shape.is_empty() {
        return Ok(None);
    }
    // Back to back: the pieces are the tensor's bytes in the file's order.
    let (shape, strides) = crate::view::experts_layout(
        run.elem,
        shape[0] as usize,
        (run.elem.size as u64).saturating_mul(elements(&shape[1..]).unwrap_or(0)) as usize,
        &shape[1..],
    );
    // SAFETY: `experts × len` bytes from `first`, every expert's piece back to back
    // (`stride == len`), inside the expert store `model` keeps alive.
    Ok(Some(unsafe {
        View::new(run.first, run.elem, shape, strides, model.clone())
    }))
}
