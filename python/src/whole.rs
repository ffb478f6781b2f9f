//! `Checkpoint.place(...)` (the whole-model plan) and `WholeModel`, what it returns:
//! every tensor of the checkpoint in its class's store, read by name through views that
//! carry the tensor's dtype and shape.
//!
//! The placed model has no call that gives memory back (its stores live as long as it),
//! so a view holding it alive is enough: nothing can release bytes under a live view.

use std::sync::Arc;

use numapin::model::{
    Dtype, ExpertPieceView, ExpertShare, PlacementPlan, Share, TensorClass, TensorSlice,
};
use numapin::store::{Layout, StoreOptions};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{IntoPy, InvalidArgument};
use crate::progress::Callbacks;
use crate::store::{Options, to_dict};
use crate::view::{Elem, RAW, View, elem_of};

/// The plan from the keywords: `experts` and `dense` first, then `plan` (the text form,
/// whose items override them), then the per-class keywords.
pub fn build_plan(
    experts: &str,
    dense: &str,
    plan: Option<&str>,
    classes: &[(String, String)],
) -> PyResult<PlacementPlan> {
    // Each keyword is one layout: a value holding the text form's item separators
    // would smuggle items of its own (`attention="bind:0;experts=unplaced"` re-laid the
    // experts). Commas stay: they separate the nodes of a list.
    let keywords = [("experts", experts), ("dense", dense)];
    for (key, value) in keywords
        .into_iter()
        .chain(classes.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    {
        if value.contains([';', '=']) {
            return Err(InvalidArgument::new_err(format!(
                "place: {key}={:?} must be one layout (no ';' or '='); several items go in `plan`",
                clip(value)
            )));
        }
    }
    let mut text = format!("experts={experts};dense={dense}");
    if let Some(plan) = plan {
        text.push(';');
        text.push_str(plan);
    }
    for (class, layout) in classes {
        check_class(class)?;
        text.push_str(&format!(";{class}={layout}"));
    }
    // The starting layouts are replaced by the text's `experts=` and `dense=` items.
    let start = PlacementPlan::new(Layout::Unplaced, numapin::model::DenseLayout::Unplaced);
    start.apply(&text).py_err()
}

/// A rank's share of the whole model, from `Checkpoint.place`'s keywords.
pub struct RankShare<'a> {
    /// `ExpertShare` text: the routed experts held.
    pub experts_held: Option<&'a str>,
    /// `TensorSlice` text: the slice of each held expert's tensors.
    pub expert_slice: Option<&'a str>,
    /// `TensorSlice` text: the slice of the sliceable dense tensors.
    pub dense_slice: Option<&'a str>,
    /// Class names kept whole under the dense slice.
    pub whole: &'a [String],
    /// `k/n`: rank k of a tensor-parallel group of n (`PlacementPlan::tensor_parallel`).
    pub tensor_parallel: Option<&'a str>,
}

impl RankShare<'_> {
    /// `plan` with this share (unchanged when every keyword is absent).
    pub fn apply(&self, mut plan: PlacementPlan) -> PyResult<PlacementPlan> {
        let mut share = Share::default();
        if let Some(text) = self.experts_held {
            share = share.experts(ExpertShare::parse(text).py_err()?);
        }
        if let Some(text) = self.expert_slice {
            share = share.slice(TensorSlice::parse(text).py_err()?);
        }
        plan = plan.share(share);
        if let Some(text) = self.dense_slice {
            plan = plan.dense_slice(TensorSlice::parse(text).py_err()?);
        }
        if let Some(text) = self.tensor_parallel {
            let (k, n) = PlacementPlan::parse_rank(text).py_err()?;
            plan = plan.tensor_parallel(k, n).py_err()?;
        }
        for name in self.whole {
            let class = TensorClass::from_name(name).ok_or_else(|| {
                InvalidArgument::new_err(format!(
                    "place: whole={:?} is not a tensor class (classes: shared, attention, \
                     dense_mlp, norms, embeddings, head, global)",
                    clip(name)
                ))
            })?;
            plan = plan.whole(class);
        }
        Ok(plan)
    }
}

/// A `place` keyword that is not a dense class's name is an error naming it.
pub fn check_class(class: &str) -> PyResult<()> {
    match numapin::model::TensorClass::from_name(class) {
        Some(c) if c != numapin::model::TensorClass::RoutedExperts => Ok(()),
        _ => Err(InvalidArgument::new_err(format!(
            "place: {:?} is not a tensor class (classes: shared, attention, dense_mlp, norms, \
             embeddings, head, global; name patterns go in `plan`)",
            clip(class)
        ))),
    }
}

/// At most 200 bytes of `text` (cut at a character boundary), for an error message.
pub fn clip(text: &str) -> &str {
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The element type and shape of a tensor of `len` bytes: its own where DLPack has the
/// dtype and the sizes agree, else raw bytes (GGML quant blocks, sub-byte types).
fn tensor_layout(dtype: Dtype, shape: &[u64], len: usize) -> (Elem, Vec<u64>) {
    let raw = (RAW, vec![len as u64]);
    let Some(elem) = elem_of(&dtype.to_string()) else {
        return raw;
    };
    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    if elements.and_then(|n| n.checked_mul(elem.size as u64)) == Some(len as u64) {
        (elem, shape.to_vec())
    } else {
        raw
    }
}

/// A view of `bytes`, which the placed model `keep` owns.
fn view_of(
    keep: &Arc<numapin::model::PlacedModel>,
    bytes: &[u8],
    dtype: Dtype,
    shape: &[u64],
) -> View {
    let (elem, shape) = tensor_layout(dtype, shape, bytes.len());
    // SAFETY: `bytes` lies in one of the placed model's stores; the model never releases
    // or re-packs them (no such call) and lives as long as `keep`, which the view holds.
    unsafe { View::contiguous(bytes.as_ptr() as usize, elem, &shape, keep.clone()) }
}

/// The pieces from role `role` to `through` (or `role` alone) of one expert, in slot
/// order; an error naming the roles where either is missing or `through` comes first.
fn role_run<'p, 'a>(
    pieces: &'p [ExpertPieceView<'a>],
    layer: usize,
    role: &str,
    through: Option<&str>,
) -> PyResult<&'p [ExpertPieceView<'a>]> {
    let find = |name: &str| {
        pieces.iter().position(|p| p.role == name).ok_or_else(|| {
            let names: Vec<&str> = pieces.iter().map(|p| p.role).collect();
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
fn joined_layout(run: &[ExpertPieceView<'_>], layer: usize) -> PyResult<(Elem, Vec<u64>, usize)> {
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

/// Places `checkpoint` whole under `plan`; the progress callback as in `Checkpoint.pack`.
pub fn place(
    py: Python<'_>,
    checkpoint: &Arc<numapin::model::Checkpoint>,
    plan: PlacementPlan,
    options: &Options,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<WholeModel> {
    let callbacks = Callbacks::default();
    let store_options: StoreOptions = options.build(&callbacks)?;
    // The bytes the stores will read (one copy; a share's part): the plan's cost.
    let total = || {
        let cost = py
            .detach(|| checkpoint.placement_cost(&plan, &store_options))
            .py_err()?;
        Ok(cost.classes.iter().map(|c| c.bytes).sum())
    };
    let callback = crate::progress::callback_of(py, progress, total)?;
    // Stores number their layers: the expert store by MoE layer, a dense store by group
    // ordinal (fewer groups than tensors); the callback is registered for all of them.
    let mut layers: Vec<usize> = (0..checkpoint.tensors().len()).collect();
    if let Ok(experts) = py.detach(|| checkpoint.expert_plan()) {
        layers.extend(
            experts
                .layers()
                .iter()
                .map(numapin::model::LayerPlan::layer),
        );
    }
    layers.sort_unstable();
    layers.dedup();
    let registration = callbacks.register(py, &layers, callback.as_ref());
    let result = py.detach(|| checkpoint.place(&plan, store_options));
    let outcome = result.map_err(|e| registration.error(e));
    drop(registration);
    if let Some(cb) = &callback
        && cb.bind(py).hasattr("close")?
    {
        cb.bind(py).call_method0("close")?;
    }
    Ok(WholeModel {
        inner: Arc::new(outcome?),
        checkpoint: checkpoint.clone(),
    })
}

/// A checkpoint placed whole by `Checkpoint.place`: `tensor(name)` gives any tensor as a
/// read-only zero-copy view (this thread's node's copy where the class is replicated),
/// `expert(layer, e)` an expert's `{role: view}`; `report()`, `stats()`, `verify()`.
/// Views keep the placed memory alive (also after `del model`); a placed model has no
/// call that releases memory.
#[pyclass(frozen, module = "numapin")]
pub struct WholeModel {
    inner: Arc<numapin::model::PlacedModel>,
    checkpoint: Arc<numapin::model::Checkpoint>,
}

#[pymethods]
impl WholeModel {
    /// Tensor `name` with its dtype and shape (numpy's order; raw `uint8` for GGML quant
    /// blocks). A tensor holding every expert of a layer has no single run of bytes:
    /// `InvalidArgument`, read it with `expert(layer, e)`.
    fn tensor(&self, name: &str) -> PyResult<View> {
        let t = self.inner.tensor(name).py_err()?;
        let bytes = t.bytes().ok_or_else(|| {
            InvalidArgument::new_err(format!(
                "tensor {name:?} holds every expert of layer {:?}: read its experts with \
                 expert(layer, e)",
                t.layer()
            ))
        })?;
        Ok(view_of(&self.inner, bytes, t.dtype(), t.shape()))
    }

    /// Every tensor's name, in checkpoint order.
    fn tensors(&self) -> PyResult<Vec<String>> {
        self.inner
            .tensors()
            .map(|t| t.map(|t| t.name().to_owned()))
            .collect::<numapin::Result<_>>()
            .py_err()
    }

    /// Every tensor's `(name, class, layer)`: the class the plan placed it by.
    fn classes(&self) -> PyResult<Vec<(String, &'static str, Option<usize>)>> {
        self.inner
            .tensors()
            .map(|t| t.map(|t| (t.name().to_owned(), t.class().name(), t.layer())))
            .collect::<numapin::Result<_>>()
            .py_err()
    }

    /// Expert `expert` of MoE layer `layer`: `{role: view}` with each piece's dtype and
    /// per-expert shape.
    fn expert<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        expert: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for piece in self.inner.expert(layer, expert).py_err()? {
            let view = view_of(&self.inner, piece.bytes, piece.dtype, &piece.shape);
            dict.set_item(piece.role, view)?;
        }
        Ok(dict)
    }

    /// Role `role` of every expert of MoE layer `layer` this model holds: one
    /// `[experts, ...]` view over the layer's region with the slot stride as the outer
    /// stride (this thread's node's copy where the experts are replicated), so that a
    /// fused-experts parameter is assigned without a copy. With `through`, the roles from
    /// `role` to `through` (back to back in each slot, one dtype, the same inner
    /// dimensions) joined along their first dimension, as transformers' `gate_up_proj`.
    /// The experts' pieces must lie at one stride: a layer split over nodes is in one
    /// block per node (`NumapinError`: read its experts with `expert(layer, e)`).
    #[pyo3(signature = (layer, role, *, through = None))]
    fn layer(&self, layer: usize, role: &str, through: Option<&str>) -> PyResult<View> {
        let ids = self.inner.expert_ids(layer).py_err()?;
        let mut firsts = Vec::with_capacity(ids.len());
        let mut joined = None;
        for &id in &ids {
            let pieces = self.inner.expert(layer, id).py_err()?;
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
                "layer {layer}: the experts' {role:?} pieces are not at one stride (a layout \
                 that splits the layer over nodes keeps one block per node): read them with \
                 expert(layer, e)"
            )));
        }
        let (shape, strides) = crate::view::experts_layout(elem, ids.len(), stride, &inner);
        // SAFETY: expert i's joined pieces are `len` bytes at `firsts[0] + i × stride`
        // (checked above for every held expert, `stride ≥ len`), each inside its slot in
        // the expert store, which the placed model never releases and `self.inner` keeps
        // alive for as long as the view.
        Ok(unsafe { View::new(firsts[0], elem, shape, strides, self.inner.clone()) })
    }

    /// The share this rank placed, in words (`"experts 0-63; dense rows:0/2"`), or None
    /// for the whole model.
    #[getter]
    fn share(&self) -> Option<String> {
        self.inner.report().and_then(|r| r.share.clone())
    }

    /// The plan in its text form.
    #[getter]
    fn plan(&self) -> Option<String> {
        self.inner.report().map(|r| r.plan.clone())
    }

    /// What placing did: plan, cost per class (with why), measured per class.
    fn report(&self) -> String {
        self.inner
            .report()
            .map(ToString::to_string)
            .unwrap_or_default()
    }

    /// The report as a dict.
    fn report_dict(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_dict(py, &self.inner.report())
    }

    /// Statistics of every store: `{"experts": {...} or None, "dense": [{"class": ...,
    /// ...}]}` (layers, bytes, VMAs, mbind calls, pages per node, placement).
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let model = &self.inner;
        let value = py
            .detach(|| -> numapin::Result<serde_json::Value> {
                let experts = match model.expert_store() {
                    Ok(store) => Some(store.stats()?),
                    Err(_) => None,
                };
                let mut dense = Vec::new();
                for class in numapin::model::TensorClass::DENSE {
                    for store in model.class_stores(class) {
                        let mut stats =
                            serde_json::to_value(store.stats()?).unwrap_or(serde_json::Value::Null);
                        if let Some(map) = stats.as_object_mut() {
                            map.insert("class".into(), class.name().into());
                        }
                        dense.push(stats);
                    }
                }
                Ok(serde_json::json!({ "experts": experts, "dense": dense }))
            })
            .py_err()?;
        crate::store::json_to_py(py, &value)
    }

    /// Re-reads every tensor from the files and compares it with every copy: a dict with
    /// `mismatched` (0) and the experts' `mismatched_slots`, plus `verified`.
    fn verify(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let report = py.detach(|| self.inner.verify(&self.checkpoint)).py_err()?;
        let mut value = serde_json::to_value(&report)
            .map_err(|e| crate::errors::NumapinError::new_err(format!("verify: {e}")))?;
        if let Some(map) = value.as_object_mut() {
            map.insert("verified".into(), report.verified().into());
        }
        crate::store::json_to_py(py, &value)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "WholeModel({} tensors, plan {})",
            self.inner.len(),
            self.plan().unwrap_or_default()
        )
    }
}
