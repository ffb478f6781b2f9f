//! `numapin.Checkpoint` (headers, tensors, experts) and `PlacedModel`, what
//! `Checkpoint.pack` returns: the experts in a store, read through views that carry each
//! role's dtype and shape.
//!
//! The whole-model plan (`Checkpoint.place(experts=..., dense=...)`, issue 22) returns a
//! placed model too; its `tensor(name)` then reads the dense tensors the same way.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use numapin::model::{ExpertPlan, Format, LayerPlan, ModelReport, PieceRole, TensorPiece};
use numapin::store::Kind;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{CheckpointError, IntoPy, InvalidArgument};
use crate::store::{Options, StoreCell, to_dict};
use crate::view::{Elem, RAW, View, elem_of};

/// A checkpoint's headers: safetensors (one file, shards with their index, fused
/// experts) or GGUF (one file or a split set). Opening reads headers only.
#[pyclass(frozen, module = "numapin")]
pub struct Checkpoint {
    inner: Arc<numapin::model::Checkpoint>,
}

/// A tensor's shape outermost first (numpy's order; GGUF states it innermost first).
fn numpy_shape(checkpoint: &numapin::model::Checkpoint, shape: &[u64]) -> Vec<u64> {
    match checkpoint.format() {
        Format::Gguf => shape.iter().rev().copied().collect(),
        _ => shape.to_vec(),
    }
}

/// The element type and shape of one expert's piece of a tensor: the tensor's own when
/// the piece is all of it, its shape without the experts dimension when the tensor
/// holds every expert; raw bytes when DLPack has no such dtype or the sizes disagree.
fn piece_layout(checkpoint: &numapin::model::Checkpoint, piece: &TensorPiece) -> (Elem, Vec<u64>) {
    let raw = (RAW, vec![piece.len()]);
    let Some(tensor) = checkpoint.tensors().get(piece.tensor()) else {
        return raw;
    };
    let Some(elem) = elem_of(&tensor.dtype().to_string()) else {
        return raw;
    };
    let full = numpy_shape(checkpoint, tensor.shape());
    let shape = if piece.len() == tensor.len() {
        full
    } else {
        full.get(1..).map(<[u64]>::to_vec).unwrap_or_default()
    };
    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    if elements.and_then(|n| n.checked_mul(elem.size as u64)) == Some(piece.len()) {
        (elem, shape)
    } else {
        raw
    }
}

#[pymethods]
impl Checkpoint {
    /// Opens a checkpoint: a `.safetensors` file, a directory of shards, or a GGUF file.
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Checkpoint> {
        let inner = py
            .detach(|| numapin::model::Checkpoint::open(&path))
            .py_err()?;
        Ok(Checkpoint {
            inner: Arc::new(inner),
        })
    }

    /// `"safetensors"` or `"gguf"`.
    #[getter]
    fn format(&self) -> &'static str {
        match self.inner.format() {
            Format::Gguf => "gguf",
            _ => "safetensors",
        }
    }

    /// Every tensor as `(name, dtype, shape)`, the shape outermost first.
    fn tensors(&self) -> Vec<(String, String, Vec<u64>)> {
        self.inner
            .tensors()
            .iter()
            .map(|t| {
                let shape = numpy_shape(&self.inner, t.shape());
                (t.name().to_owned(), t.dtype().to_string(), shape)
            })
            .collect()
    }

    /// The MoE layers: `{layer: experts}` (the detected expert naming's plan).
    #[getter]
    fn experts(&self, py: Python<'_>) -> PyResult<BTreeMap<usize, usize>> {
        let plan = py.detach(|| self.inner.expert_plan()).py_err()?;
        Ok(plan
            .layers()
            .iter()
            .map(|l| (l.layer(), l.experts().len()))
            .collect())
    }

    /// Packs every MoE layer's experts into a new store with `layout` (the short string
    /// form, e.g. `"split:all"`), one region per (layer, kind), each bound once, straight
    /// from the files. The GIL is released while loading. `progress(Progress)` is called
    /// from the loader threads (None: a tqdm bar when tqdm is installed and stderr is a
    /// terminal; False: nothing; anything else not callable: TypeError before loading);
    /// if it raises, the load stops and this raises that exception. The placed memory is
    /// read-only once loaded unless `writable=True`. Returns the placed model.
    #[pyo3(signature = (layout = "interleave:all", *, huge_pages = true, populate = true,
                        loader_threads = None, read_mode = "auto", progress = None,
                        writable = false))]
    #[allow(clippy::too_many_arguments)]
    fn pack(
        &self,
        py: Python<'_>,
        layout: &str,
        huge_pages: bool,
        populate: bool,
        loader_threads: Option<usize>,
        read_mode: &str,
        progress: Option<Bound<'_, PyAny>>,
        writable: bool,
    ) -> PyResult<PlacedModel> {
        let options = Options {
            huge_pages,
            populate,
            loader_threads,
            read_mode: read_mode.to_owned(),
            writable,
        };
        let cell = StoreCell::new(layout, &options)?;
        let plan = Arc::new(py.detach(|| self.inner.expert_plan()).py_err()?);
        let layers: Vec<usize> = plan.layers().iter().map(LayerPlan::layer).collect();
        let total: u64 = plan
            .layers()
            .iter()
            .map(|l| (l.weight_bytes() + l.scale_bytes()) * l.experts().len() as u64)
            .sum();
        let callback = crate::progress::callback_of(py, progress, || Ok(total))?;
        let registration = cell.callbacks().register(py, &layers, callback.as_ref());
        let checkpoint = &self.inner;
        let result = py.detach(|| checkpoint.pack(&cell.read()));
        let outcome = match result {
            Ok(report) => Ok(report),
            Err(e) => Err(registration.error(e)),
        };
        drop(registration);
        if let Some(cb) = &callback
            && cb.bind(py).hasattr("close")?
        {
            cb.bind(py).call_method0("close")?;
        }
        let report = outcome?;
        Ok(PlacedModel {
            cell,
            checkpoint: self.inner.clone(),
            plan,
            report,
        })
    }

    /// Places the whole checkpoint: routed experts under `experts` (`"split:all"`,
    /// `"interleave:0-3"`, ...), every dense class under `dense` (`"replicate:all"`,
    /// `"interleave:all"`, `"bind:0"`, `"unplaced"`); `plan` is the text form
    /// (`"experts=split:all,dense=replicate:all,*.self_attn.*=interleave:all"`), whose
    /// items override `experts`/`dense` (`"default"`: the checkpoint's default plan over
    /// every node, `"default;norms=unplaced"` with items over it); keyword arguments named after a class
    /// (`embeddings="interleave:all"`, `attention=...`, `head=...`; also `shared`, `dense_mlp`, `norms`, `global`) override last.
    /// Each of those keywords is parsed as one layout for its class, and the plan built
    /// with typed calls (a value such as `"bind:0;experts=unplaced"` is a bad layout for
    /// that keyword: several items go in `plan`).
    /// A rank's share (docs/distributed.md): `experts_held` the routed experts this rank
    /// holds (`"0-63"`, `"0-3,8"`, `"1/4"`: the second of four equal parts), looked up by
    /// their global ids; `expert_slice` a slice of each held expert's tensors
    /// (`"rows:0/2"`, `"columns:128:256"`); `dense_slice` the rows of every sliceable
    /// dense tensor (`"rows:1/2"`: tensor parallelism; norms and 1-D tensors stay whole);
    /// `whole` classes every rank keeps whole under `dense_slice` (`["embeddings"]`);
    /// `tensor_parallel="k/n"` rank k of a tensor-parallel group of n, as Megatron, vLLM
    /// and SGLang split the weights (column-parallel linears, embeddings and head by
    /// rows; row-parallel `o_proj`/`down_proj` by columns; expert gate/up by rows and
    /// down by columns; norms and routers whole; docs/distributed.md).
    /// `slice_class={"attention": "rows:0/2"}` a class's slice and
    /// `slice_pattern={"*.o_proj.*": "columns:1/2"}` the slice of the tensors a name
    /// pattern matches (the last matching pattern wins), over `dense_slice` and
    /// `tensor_parallel`; a value is a slice's text (`"rows:k/n"`, `"columns:k/n"`,
    /// `"rows:START:LEN"`) or `slice(start, stop)`: the rows numpy's `t[start:stop]` holds.
    /// `framework_plan={"layers.*.self_attn.q_proj": "colwise", ...}` with `rank="k/n"`:
    /// the framework's own tensor-parallel plan (transformers' `tp_plan` vocabulary:
    /// colwise rows, rowwise columns, embedding_rowwise vocabulary rows, replicate or
    /// unnamed whole) as this rank's share of the dense tensors, the routed experts whole
    /// under `experts_held`, or cut (gate and up by rows, down by columns) where the plan
    /// names every expert role (`FrameworkPlan::share`); not with `tensor_parallel`,
    /// `dense_slice` or `expert_slice`.
    /// `convert_class={"norms": "float32"}` and `convert_pattern={"*.mlp.gate.weight":
    /// "float32"}` place those tensors in that dtype (a str, `numpy.dtype` or
    /// `torch.dtype`): BF16/F16 converted to F32 once, at placement, their views F32.
    /// Map budget and node memory are checked before anything is reserved. The GIL is
    /// released while loading; `progress` as in `pack`. Once loaded, the placed memory is
    /// read-only (`PROT_READ`: a write through a pointer made from a view faults);
    /// `writable=True` keeps it writable. `serve_as=name` places memfd-backed stores and
    /// serves the model under `name` as long as the returned `WholeModel` lives: other
    /// processes of this uid `numapin.attach(name)` it with no copy. Returns a
    /// `WholeModel`. `role_major`: `True` asks role-major expert slots (each role of a
    /// layer's experts back to back; DBRX gets them without asking, docs/whole-model.md),
    /// an int the weight roles it expects; refused by name where they cannot be kept.
    #[pyo3(signature = (experts = "split:all", dense = "replicate:all", *, plan = None,
                        experts_held = None, expert_slice = None, dense_slice = None,
                        whole = None, tensor_parallel = None, slice_class = None,
                        slice_pattern = None, framework_plan = None, rank = None,
                        convert_class = None, convert_pattern = None,
                        huge_pages = true, populate = true,
                        loader_threads = None, read_mode = "auto", progress = None,
                        writable = false, serve_as = None, role_major = None, **classes))]
    #[allow(clippy::too_many_arguments)]
    fn place(
        &self,
        py: Python<'_>,
        experts: &str,
        dense: &str,
        plan: Option<&str>,
        experts_held: Option<&str>,
        expert_slice: Option<&str>,
        dense_slice: Option<&str>,
        whole: Option<Vec<String>>,
        tensor_parallel: Option<&str>,
        slice_class: Option<Bound<'_, PyDict>>,
        slice_pattern: Option<Bound<'_, PyDict>>,
        framework_plan: Option<Bound<'_, PyDict>>,
        rank: Option<&str>,
        convert_class: Option<Bound<'_, PyDict>>,
        convert_pattern: Option<Bound<'_, PyDict>>,
        huge_pages: bool,
        populate: bool,
        loader_threads: Option<usize>,
        read_mode: &str,
        progress: Option<Bound<'_, PyAny>>,
        writable: bool,
        serve_as: Option<&str>,
        role_major: Option<Bound<'_, PyAny>>,
        classes: Option<Bound<'_, PyDict>>,
    ) -> PyResult<crate::whole::WholeModel> {
        let roles = crate::role_major::roles(&self.inner, role_major.as_ref())?;
        let mut overrides = Vec::new();
        if let Some(classes) = classes {
            for (k, v) in classes.iter() {
                // The name first: a keyword typo (`huge_page=False`) is named as one,
                // not reported as a bool that is not a str.
                let key = k.extract::<String>()?;
                crate::whole::dense_class(&key)?;
                let value = v.extract::<String>().map_err(|_| {
                    pyo3::exceptions::PyTypeError::new_err(format!(
                        "place: {key}= takes a layout string (\"interleave:all\"), not {}",
                        crate::whole::type_name(&v)
                    ))
                })?;
                overrides.push((key, value));
            }
        }
        let plan = crate::whole::build_plan(&self.inner, experts, dense, plan, &overrides)?;
        let share = crate::whole::RankShare {
            experts_held,
            expert_slice,
            dense_slice,
            whole: whole.as_deref().unwrap_or_default(),
            tensor_parallel,
            class_slices: crate::whole::class_slices(slice_class.as_ref())?,
            pattern_slices: crate::whole::pattern_slices(slice_pattern.as_ref())?,
        };
        let mut plan = share.apply(plan)?;
        if let Some(framework) = framework_plan {
            plan = crate::whole::framework_share(&self.inner, plan, &framework, rank, &share)?;
        } else if rank.is_some() {
            return Err(crate::errors::InvalidArgument::new_err(
                "place: rank= is the rank of a framework_plan= (tensor_parallel=\"k/n\" is \
                 the preset's)",
            ));
        }
        let plan = crate::convert::apply(plan, convert_class.as_ref(), convert_pattern.as_ref())?;
        let options = Options {
            huge_pages,
            populate,
            loader_threads,
            read_mode: read_mode.to_owned(),
            writable,
        };
        let served = (serve_as, roles);
        crate::whole::place(py, &self.inner, plan, &options, progress, served)
    }

    fn __repr__(&self) -> String {
        format!(
            "Checkpoint({} file(s), {} tensors, {})",
            self.inner.files().len(),
            self.inner.tensors().len(),
            self.format()
        )
    }
}

/// A checkpoint's experts placed in a store: `expert(layer, e)` gives `{role: view}`,
/// `layer(layer, role)` a `[experts, ...]` view over the layer's region; `stats()`,
/// `report()`, `verify()`. Views keep the store alive (also after `del placed`).
#[pyclass(frozen, module = "numapin")]
pub struct PlacedModel {
    cell: Arc<StoreCell>,
    checkpoint: Arc<numapin::model::Checkpoint>,
    plan: Arc<ExpertPlan>,
    report: ModelReport,
}

impl PlacedModel {
    fn layer_plan(&self, layer: usize) -> PyResult<&LayerPlan> {
        self.plan.layer(layer).ok_or_else(|| {
            let layers: Vec<usize> = self.plan.layers().iter().map(LayerPlan::layer).collect();
            crate::errors::NotPacked::new_err(format!(
                "layer {layer} is not a MoE layer of this checkpoint (MoE layers: {layers:?})"
            ))
        })
    }

    /// The layer's roles in slot order with their kind and position within the kind.
    fn roles_of(plan: &LayerPlan) -> Vec<(String, Kind, usize)> {
        let (mut w, mut s) = (0, 0);
        plan.roles()
            .map(|(role, name)| match role {
                PieceRole::Weight => {
                    w += 1;
                    (name.to_owned(), Kind::Weights, w - 1)
                }
                PieceRole::Scale => {
                    s += 1;
                    (name.to_owned(), Kind::Scales, s - 1)
                }
            })
            .collect()
    }

    fn role(&self, plan: &LayerPlan, role: &str) -> PyResult<(Kind, usize)> {
        let roles = PlacedModel::roles_of(plan);
        roles
            .iter()
            .find(|(name, _, _)| name == role)
            .map(|(_, kind, i)| (*kind, *i))
            .ok_or_else(|| {
                let names: Vec<&str> = roles.iter().map(|(n, _, _)| n.as_str()).collect();
                InvalidArgument::new_err(format!(
                    "layer {}: no role {:?} (roles: {names:?})",
                    plan.layer(),
                    crate::errors::clip(role)
                ))
            })
    }

    /// The element type and shape of pieces `first..=last` of `kind` joined along their
    /// first dimension; an error unless every expert has one piece layout, the pieces
    /// are back to back, share a dtype and their inner dimensions.
    fn joined_layout(
        &self,
        py: Python<'_>,
        plan: &LayerPlan,
        kind: Kind,
        first: usize,
        last: usize,
    ) -> PyResult<(Elem, Vec<u64>)> {
        let layer = plan.layer();
        let role = match kind {
            Kind::Weights => PieceRole::Weight,
            Kind::Scales => PieceRole::Scale,
        };
        let pieces = plan.experts()[0].pieces(role);
        let store = self.cell.read_gil(py);
        let map = store.slot_map(layer).py_err()?;
        let places = map.uniform(kind).ok_or_else(|| {
            CheckpointError::new_err(format!(
                "layer {layer}: the experts' {} pieces do not share one layout",
                kind.name()
            ))
        })?;
        let head = pieces
            .get(first)
            .ok_or_else(|| CheckpointError::new_err("a role without its piece"))?;
        let (elem, mut shape) = piece_layout(&self.checkpoint, head);
        for (i, piece) in pieces.iter().enumerate().take(last + 1).skip(first + 1) {
            let (e, s) = piece_layout(&self.checkpoint, piece);
            let adjacent = places
                .get(i - 1)
                .zip(places.get(i))
                .is_some_and(|(a, b)| a.end() == b.offset);
            if e.name != elem.name || s.get(1..) != shape.get(1..) || s.is_empty() || !adjacent {
                return Err(InvalidArgument::new_err(format!(
                    "layer {layer}: pieces {first}..={i} of the {} slot cannot be joined \
                     (dtypes {} and {}, shapes {shape:?} and {s:?}, back to back: {adjacent})",
                    kind.name(),
                    elem.name,
                    e.name
                )));
            }
            shape[0] += s[0];
        }
        Ok((elem, shape))
    }

    /// One piece's view: expert `expert`'s role `index` of `kind`.
    fn piece_view(
        &self,
        py: Python<'_>,
        plan: &LayerPlan,
        expert: usize,
        kind: Kind,
        index: usize,
    ) -> PyResult<View> {
        let layer = plan.layer();
        let pieces = plan.experts().get(expert).ok_or_else(|| {
            InvalidArgument::new_err(format!(
                "layer {layer}: expert {expert} is out of range: there are {}",
                plan.experts().len()
            ))
        })?;
        let piece = pieces
            .pieces(match kind {
                Kind::Weights => PieceRole::Weight,
                Kind::Scales => PieceRole::Scale,
            })
            .get(index)
            .ok_or_else(|| CheckpointError::new_err("a role without its piece"))?;
        let (elem, shape) = piece_layout(&self.checkpoint, piece);
        let pin = self.cell.pin(layer);
        let address = {
            let store = self.cell.read_gil(py);
            let slot = match kind {
                Kind::Weights => store.weights(layer, expert),
                Kind::Scales => store.scales(layer, expert),
            }
            .py_err()?;
            let place = store
                .slot_map(layer)
                .py_err()?
                .pieces(expert, kind)
                .and_then(|p| p.get(index).copied())
                .filter(|p| p.end() <= slot.len() && p.len as u64 == piece.len())
                .ok_or_else(|| CheckpointError::new_err("a piece outside its slot"))?;
            slot.as_ptr() as usize + place.offset
        };
        // SAFETY: the piece lies inside its slot (checked above), in the store's region,
        // which the pin keeps mapped and unreleased.
        Ok(unsafe { View::contiguous(address, elem, &shape, Arc::new(pin)) })
    }
}

#[pymethods]
impl PlacedModel {
    /// The MoE layers packed, by increasing layer number.
    #[getter]
    fn layers(&self) -> Vec<usize> {
        self.plan.layers().iter().map(LayerPlan::layer).collect()
    }

    /// The store's layout, in the short string form.
    #[getter]
    fn layout(&self, py: Python<'_>) -> String {
        self.cell.read_gil(py).layout().to_string()
    }

    /// The roles of a layer's experts in slot order (`"gate_proj"`, ..., scales last).
    fn roles(&self, layer: usize) -> PyResult<Vec<String>> {
        let plan = self.layer_plan(layer)?;
        Ok(PlacedModel::roles_of(plan)
            .into_iter()
            .map(|(n, _, _)| n)
            .collect())
    }

    /// Expert `expert` of layer `layer`: `{role: view}`, each view with the tensor's
    /// dtype and shape (raw `uint8` where DLPack has no such dtype: GGML quant blocks).
    fn expert<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        expert: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        let plan = self.layer_plan(layer)?;
        let dict = PyDict::new(py);
        for (name, kind, index) in PlacedModel::roles_of(plan) {
            dict.set_item(name, self.piece_view(py, plan, expert, kind, index)?)?;
        }
        Ok(dict)
    }

    /// Role `role` of every expert of layer `layer`: one `[experts, ...]` view over the
    /// layer's region, the slot stride as the outer stride, so that a fused-experts
    /// parameter is assigned without a copy. With `through`, the view spans the roles
    /// from `role` to `through` (back to back in each slot, one dtype, the same inner
    /// dimensions), joined along their first dimension: `layer(l, "gate_proj",
    /// through="up_proj")` is transformers' `[E, 2I, H]` `gate_up_proj` of a checkpoint
    /// saved per expert.
    #[pyo3(signature = (layer, role, *, through = None))]
    fn layer(
        &self,
        py: Python<'_>,
        layer: usize,
        role: &str,
        through: Option<&str>,
    ) -> PyResult<View> {
        let plan = self.layer_plan(layer)?;
        let (kind, index) = self.role(plan, role)?;
        let last = match through {
            Some(t) => match self.role(plan, t)? {
                (k, i) if k == kind && i >= index => i,
                _ => {
                    return Err(InvalidArgument::new_err(format!(
                        "layer {layer}: {t:?} does not follow {role:?} in the same slot"
                    )));
                }
            },
            None => index,
        };
        let first = self.piece_view(py, plan, 0, kind, index)?;
        let (elem, inner) = self.joined_layout(py, plan, kind, index, last)?;
        let pin = self.cell.pin(layer);
        let (_, stride, experts) = self.cell.layer_geometry(py, layer, kind)?;
        let (shape, strides) = crate::view::experts_layout(elem, experts, stride, &inner);
        // SAFETY: expert e's pieces `index..=last` start at `first + e × stride` (every
        // slot at one stride, one piece layout for all, the pieces back to back: checked
        // by `layer_geometry` and `joined_layout`) and lie inside its slot, in the layer's
        // region, which the pin keeps mapped and unreleased.
        Ok(unsafe { View::new(first.address_of(), elem, shape, strides, Arc::new(pin)) })
    }

    /// Expert `expert`'s whole weight slot (`kind="weights"`) or scale slot, raw `uint8`.
    #[pyo3(signature = (layer, expert, kind = "weights"))]
    fn slot(&self, py: Python<'_>, layer: usize, expert: usize, kind: &str) -> PyResult<View> {
        self.cell
            .slot_view(py, layer, expert, crate::store::parse_kind(kind)?)
    }

    /// Gives expert `expert`'s pages of layer `layer` back. Refused (`ViewsAlive`) while
    /// views into the layer are alive.
    fn release(&self, py: Python<'_>, layer: usize, expert: usize) -> PyResult<()> {
        self.cell.change(py, layer, "PlacedModel.release", |s| {
            s.release(layer, expert)
        })
    }

    /// The store's statistics as a dict (layers, bytes, VMAs, mbind calls, pages per
    /// node, placement).
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let stats = py.detach(|| self.cell.read().stats()).py_err()?;
        to_dict(py, &stats)
    }

    /// The pack report: one line (`naming ...: N MoE layers × E experts packed ...`).
    fn report(&self) -> String {
        self.report.to_string()
    }

    /// The pack report as a dict (per-layer reports included).
    fn report_dict(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_dict(py, &self.report)
    }

    /// Re-reads every expert piece from the files and compares: a dict with
    /// `mismatched_slots` (0: verified).
    fn verify(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let report = py
            .detach(|| self.checkpoint.verify(&self.cell.read()))
            .py_err()?;
        to_dict(py, &report)
    }

    /// Why placement degraded here, or None.
    #[getter]
    fn degraded(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.cell.degraded(py)
    }

    fn __repr__(&self) -> String {
        format!("PlacedModel({})", self.report)
    }
}
