//! `Checkpoint.place(...)` (the whole-model plan) and `WholeModel`, what it returns:
//! every tensor of the checkpoint in its class's store, read by name through views that
//! carry the tensor's dtype and shape.
//!
//! The placed model has no call that gives memory back (its stores live as long as it),
//! so a view holding it alive is enough: nothing can release bytes under a live view.

use std::sync::Arc;

use numapin::NodeSet;
use numapin::model::{
    Checkpoint, DenseLayout, Dtype, ExpertShare, FrameworkPlan, PlacementPlan, Share, TensorClass,
    TensorSlice,
};
use numapin::store::{Layout, StoreOptions};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{IntoPy, InvalidArgument, clip};
use crate::progress::Callbacks;
use crate::store::Options;
use crate::view::{View, tensor_layout};

/// The plan from the keywords, built with the typed API: `experts` and `dense` first,
/// then `plan` (the text form, whose items override them), then the per-class keywords.
/// Each keyword's value is parsed as one layout for that keyword, so a value cannot
/// carry plan items of its own (`attention="bind:0;experts=unplaced"` is a bad layout
/// for `attention`, not an item for the experts). A `plan` whose first item is
/// `default` starts from [`Checkpoint::default_plan`] over every node (as `numapin
/// place --plan default` does), the items after it applied over it.
pub fn build_plan(
    checkpoint: &Checkpoint,
    experts: &str,
    dense: &str,
    plan: Option<&str>,
    classes: &[(String, String)],
) -> PyResult<PlacementPlan> {
    let experts = experts
        .trim()
        .parse::<Layout>()
        .map_err(|e| not_one_layout("experts", experts, &e))?;
    let mut built = PlacementPlan::new(experts, dense_layout("dense", dense)?);
    if let Some(text) = plan {
        let rest = match default_prefix(text) {
            Some(rest) => {
                let nodes = NodeSet::parse("all").py_err()?;
                built = checkpoint.default_plan(nodes).py_err()?;
                rest
            }
            None => text,
        };
        if !rest.trim().is_empty() {
            built = built.apply(rest).py_err()?;
        }
    }
    for (name, layout) in classes {
        built = built.class(dense_class(name)?, dense_layout(name, layout)?);
    }
    Ok(built)
}

/// The items after a leading `default` item (`"default"`, `"default;attention=bind:0"`),
/// or `None` when the plan does not start with it.
fn default_prefix(text: &str) -> Option<&str> {
    let rest = text.trim_start().strip_prefix("default")?;
    let rest = rest.trim_start();
    if rest.is_empty() {
        return Some(rest);
    }
    rest.strip_prefix([';', ','])
}

/// `value` as the layout of a dense keyword (`dense`, a class name).
fn dense_layout(key: &str, value: &str) -> PyResult<DenseLayout> {
    value
        .parse::<DenseLayout>()
        .map_err(|e| not_one_layout(key, value, &e))
}

fn not_one_layout(key: &str, value: &str, e: &numapin::Error) -> PyErr {
    InvalidArgument::new_err(format!(
        "place: {key}={:?} is not one layout for {key} (several items go in `plan`): {e}",
        clip(value)
    ))
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
    /// `slice_class=`: a class's slice (`PlacementPlan::slice_class`).
    pub class_slices: Vec<(TensorClass, TensorSlice)>,
    /// `slice_pattern=`: the slice of the tensors a name pattern matches, in the dict's
    /// order (`PlacementPlan::slice_pattern`; the last matching pattern wins).
    pub pattern_slices: Vec<(String, TensorSlice)>,
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
        for (class, slice) in &self.class_slices {
            plan = plan.slice_class(*class, *slice);
        }
        for (glob, slice) in &self.pattern_slices {
            plan = plan.slice_pattern(glob.clone(), *slice);
        }
        Ok(plan)
    }
}

/// `framework_plan=` with `rank="k/n"`: the framework's plan as this rank's share of the
/// dense tensors, over `plan` (the routed experts whole under `experts_held`). Refuses
/// the keywords that cut another way.
pub fn framework_share(
    checkpoint: &Checkpoint,
    plan: PlacementPlan,
    framework: &Bound<'_, PyDict>,
    rank: Option<&str>,
    share: &RankShare<'_>,
) -> PyResult<PlacementPlan> {
    let others = [
        ("tensor_parallel", share.tensor_parallel.is_some()),
        ("dense_slice", share.dense_slice.is_some()),
        ("expert_slice", share.expert_slice.is_some()),
    ];
    if let Some((other, _)) = others.iter().find(|(_, given)| *given) {
        return Err(InvalidArgument::new_err(format!(
            "place: framework_plan= with {other}=: the framework's plan says how each tensor \
             is cut, {other} another way"
        )));
    }
    let rank = rank.ok_or_else(|| {
        InvalidArgument::new_err("place: framework_plan= needs rank=\"k/n\" (rank k of n)")
    })?;
    let (k, n) = PlacementPlan::parse_rank(rank).py_err()?;
    let mut built = FrameworkPlan::new();
    for (glob, style) in framework.iter() {
        let glob: String = glob.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(
                "place: framework_plan= keys are module globs (str)",
            )
        })?;
        let style: String = style.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "place: framework_plan[{:?}] is a style (str, \"colwise\")",
                clip(&glob)
            ))
        })?;
        built = built.style(&glob, &style);
    }
    built.share(checkpoint, plan, k, n).py_err()
}

/// `slice_class=`: `{class: slice}`, each key a dense class, each value a slice
/// ([`tensor_slice`]).
pub fn class_slices(dict: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(TensorClass, TensorSlice)>> {
    let mut slices = Vec::new();
    for (key, value) in dict.into_iter().flat_map(|d| d.iter()) {
        let name = key.extract::<String>()?;
        let class = dense_class(&name)?;
        slices.push((class, tensor_slice("slice_class", &name, &value)?));
    }
    Ok(slices)
}

/// `slice_pattern=`: `{glob: slice}`, in the dict's order.
pub fn pattern_slices(dict: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, TensorSlice)>> {
    let mut slices = Vec::new();
    for (key, value) in dict.into_iter().flat_map(|d| d.iter()) {
        let glob = key.extract::<String>()?;
        let slice = tensor_slice("slice_pattern", &glob, &value)?;
        slices.push((glob, slice));
    }
    Ok(slices)
}

/// A slice keyword's value: `TensorSlice`'s text (`"rows:0/2"`, `"columns:1/4"`,
/// `"rows:START:LEN"`), or a Python `slice(start, stop)`: rows `start..stop`, what
/// numpy's `t[start:stop]` holds (no step, no negative index: the plan is made before
/// the tensor's extent is known).
fn tensor_slice(keyword: &str, key: &str, value: &Bound<'_, PyAny>) -> PyResult<TensorSlice> {
    let bad =
        |why: String| InvalidArgument::new_err(format!("place: {keyword}[{:?}]: {why}", clip(key)));
    if let Ok(text) = value.extract::<String>() {
        return TensorSlice::parse(&text).map_err(|e| bad(e.to_string()));
    }
    if !value.is_instance_of::<pyo3::types::PySlice>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "place: {keyword}[{:?}] takes a slice (\"rows:0/2\" or slice(start, stop)), not {}",
            clip(key),
            type_name(value)
        )));
    }
    let bound = |name: &str| -> PyResult<Option<u64>> {
        let v = value.getattr(name)?;
        if v.is_none() {
            return Ok(None);
        }
        v.extract::<u64>().map(Some).map_err(|_| {
            bad(format!(
                "slice {name} {}: row indices are integers ≥ 0",
                shown(&v)
            ))
        })
    };
    if !matches!(bound("step")?, None | Some(1)) {
        return Err(bad("a slice of rows has no step".into()));
    }
    let start = bound("start")?.unwrap_or(0);
    let stop = bound("stop")?.ok_or_else(|| bad("slice(start, stop) needs a stop".into()))?;
    if stop <= start {
        return Err(bad(format!("slice({start}, {stop}) holds no row")));
    }
    TensorSlice::span(numapin::model::SliceAxis::Rows, start, stop - start)
        .map_err(|e| bad(e.to_string()))
}

/// The dense class a `place` keyword names, or an error naming the keyword.
pub fn dense_class(class: &str) -> PyResult<TensorClass> {
    match TensorClass::from_name(class) {
        Some(c) if c != TensorClass::RoutedExperts => Ok(c),
        _ => Err(InvalidArgument::new_err(format!(
            "place: {:?} is not a tensor class (classes: shared, attention, dense_mlp, norms, \
             embeddings, head, global; name patterns go in `plan`)",
            clip(class)
        ))),
    }
}

/// A Python value's type name for an error message, clipped: a class may be made with a
/// name of any length (`type("x" * 10**6, (), {})`).
pub fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "this".to_owned(), |n| clip(&n.to_string()).to_owned())
}

/// A Python value's `str()` for an error message, clipped (a slice's bounds may be any
/// object, a megabyte string included).
pub fn shown(value: &Bound<'_, PyAny>) -> String {
    value
        .str()
        .map_or_else(|_| "this".to_owned(), |s| clip(&s.to_string()).to_owned())
}

/// A view of `bytes`, which the placed model `keep` owns.
pub fn view_of(
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

/// Places `checkpoint` whole under `plan` (`roles`: `StoreOptions::role_major`); the
/// progress callback as in `Checkpoint.pack`.
pub fn place(
    py: Python<'_>,
    checkpoint: &Arc<numapin::model::Checkpoint>,
    plan: PlacementPlan,
    options: &Options,
    progress: Option<Bound<'_, PyAny>>,
    (serve_as, roles): (Option<&str>, usize),
) -> PyResult<WholeModel> {
    let callbacks = Callbacks::default();
    let mut store_options: StoreOptions = options.build(&callbacks)?.role_major(roles);
    if serve_as.is_some() {
        // Serving exports the stores: they must be memfd-backed.
        store_options = store_options.shared(true);
    }
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
    let mut model = outcome?;
    let server = match serve_as {
        Some(name) => Some(
            py.detach(|| model.serve(name, numapin::serve::Access::same_uid()))
                .py_err()?,
        ),
        None => None,
    };
    Ok(WholeModel {
        inner: Arc::new(model),
        checkpoint: Some(checkpoint.clone()),
        server: std::sync::Mutex::new(server),
        served_as: serve_as.map(str::to_owned),
    })
}

/// A model attached by name (`numapin.attach`): no checkpoint, no server.
pub fn attached(model: numapin::model::PlacedModel) -> WholeModel {
    WholeModel {
        inner: Arc::new(model),
        checkpoint: None,
        server: std::sync::Mutex::new(None),
        served_as: None,
    }
}

/// A checkpoint placed whole by `Checkpoint.place`: `tensor(name)` gives any tensor as a
/// read-only zero-copy view (this thread's node's copy where the class is replicated),
/// `expert(layer, e)` an expert's `{role: view}`; `report()`, `stats()`, `verify()`.
/// Views keep the placed memory alive (also after `del model`); a placed model has no
/// call that releases memory.
#[pyclass(frozen, module = "numapin")]
pub struct WholeModel {
    inner: Arc<numapin::model::PlacedModel>,
    /// `None` for a model attached by name (`numapin.attach`).
    checkpoint: Option<Arc<numapin::model::Checkpoint>>,
    /// The server of `place(..., serve_as=name)`: serves as long as this model lives
    /// (held for its `Drop`, which stops serving).
    #[allow(dead_code)]
    server: std::sync::Mutex<Option<numapin::serve::Server>>,
    served_as: Option<String>,
}

#[pymethods]
impl WholeModel {
    /// Tensor `name` with its dtype and shape (numpy's order; raw `uint8` for GGML quant
    /// blocks). A per-expert tensor is the part of it the share holds (sliced under a
    /// slice, as `expert(layer, e)` gives it); one of an expert outside the share raises
    /// `NotHeld`. A tensor holding every expert of a layer (`experts.gate_up_proj`) is
    /// one view with the file's shape, strided by the slot, where the layout keeps it
    /// whole (every expert held unsliced, its pieces at one stride); DBRX's flattened
    /// `[E·I, H]` is one contiguous view of its role's run (role-major slots, unless a
    /// share orders them); elsewhere `InvalidArgument`: read it with `expert(layer, e)`
    /// or `layer(l, role)`.
    fn tensor(&self, name: &str) -> PyResult<View> {
        let t = self.inner.tensor(name).py_err()?;
        match t.held_bytes() {
            Ok(bytes) => Ok(view_of(&self.inner, bytes, t.dtype(), t.shape())),
            Err(e) => {
                if t.bytes().is_none()
                    && let Ok(Some(at)) = self.inner.locate(name)
                    && at.expert.is_none()
                    && let Some(view) = crate::experts_view::whole_tensor(&self.inner, &t, &at)?
                {
                    return Ok(view);
                }
                Err(e).py_err()
            }
        }
    }

    /// The MoE layers whose routed experts were placed, ascending.
    #[getter]
    fn layers(&self) -> Vec<usize> {
        self.inner.layers()
    }

    /// MoE layer `layer`'s roles in slot order under their canonical names, the same
    /// for every naming: `gate`, `up`, `gate_up`, `down`, and `.scale` / `.bias` after
    /// a role (`"gate_up.bias"`).
    fn roles(&self, layer: usize) -> PyResult<Vec<String>> {
        let roles = self.inner.roles(layer).py_err()?;
        Ok(roles.iter().map(|r| r.canonical.to_owned()).collect())
    }

    /// `{canonical role: the file's name for it}` of MoE layer `layer`
    /// (`{"up": "w3", "gate_up.bias": "gate_up bias"}`).
    fn role_names<'py>(&self, py: Python<'py>, layer: usize) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        for r in self.inner.roles(layer).py_err()? {
            dict.set_item(r.canonical, r.file)?;
        }
        Ok(dict)
    }

    /// The global ids of MoE layer `layer`'s experts this model holds, ascending.
    fn expert_ids(&self, layer: usize) -> PyResult<Vec<usize>> {
        self.inner.expert_ids(layer).py_err()
    }

    /// `(layer, expert, role)` of a routed expert's tensor (`expert` None for a tensor
    /// holding every expert of the layer; `role` canonical), None for any other tensor;
    /// `InvalidArgument` for a name the checkpoint does not have.
    fn locate(&self, name: &str) -> PyResult<Option<(usize, Option<usize>, String)>> {
        let at = self.inner.locate(name).py_err()?;
        Ok(at.map(|a| (a.layer, a.expert, a.role)))
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
    /// The experts' pieces must lie at one stride, as every layout keeps them (a layer
    /// split over nodes is one range, bound node block by node block); not where an
    /// expert assignment orders the slots or direct reads place each piece congruent to
    /// its file offset (`NumapinError`: read its experts with `expert(layer, e)`).
    #[pyo3(signature = (layer, role, *, through = None))]
    fn layer(&self, layer: usize, role: &str, through: Option<&str>) -> PyResult<View> {
        crate::experts_view::role_view(&self.inner, layer, role, through)
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
    /// Each measured class also has the direct-read counts under the CLI JSON's names
    /// (`in_place_bytes`, `bounced_bytes`, `uring_reads`, `blocking_reads`,
    /// `uring_depth`, `blocking_depth`), and the dict `direct_io` (`crate::reads`).
    fn report_dict(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let value = crate::reads::report_value(self.inner.report())
            .map_err(|e| crate::errors::NumapinError::new_err(format!("report as JSON: {e}")))?;
        crate::store::json_to_py(py, &value)
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
    /// An attached model (`numapin.attach`) raises `InvalidArgument`: it has no
    /// checkpoint to read.
    fn verify(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(checkpoint) = &self.checkpoint else {
            return Err(InvalidArgument::new_err(
                "verify: a model attached by name has no checkpoint to compare with (verify \
                 in the placer)",
            ));
        };
        let report = py.detach(|| self.inner.verify(checkpoint)).py_err()?;
        let mut value = serde_json::to_value(&report)
            .map_err(|e| crate::errors::NumapinError::new_err(format!("verify: {e}")))?;
        if let Some(map) = value.as_object_mut() {
            map.insert("verified".into(), report.verified().into());
        }
        crate::store::json_to_py(py, &value)
    }

    /// The name this model is served as (`place(..., serve_as=name)`), or None.
    #[getter]
    fn served_as(&self) -> Option<String> {
        self.served_as.clone()
    }

    /// Whether this model was attached by name (`numapin.attach`).
    #[getter]
    fn attached(&self) -> bool {
        self.checkpoint.is_none()
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
