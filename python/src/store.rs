//! The shared store behind every Python object that reads it, the layer pins that keep
//! views valid, and `numapin.PinStore` for callers with their own sources.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use numapin::store::{ExpertSource, Kind, LayerSpec, Layout, ReadMode, StoreOptions};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::{IntoPy, ViewsAlive};
use crate::progress::Callbacks;
use crate::view::{RAW, View};

/// A JSON value as the Python object `json.loads` makes of it.
pub fn json_to_py(py: Python<'_>, value: &serde_json::Value) -> PyResult<Py<PyAny>> {
    let text = value.to_string();
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
}

/// A serializable report as a Python dict.
pub fn to_dict(py: Python<'_>, value: &impl serde::Serialize) -> PyResult<Py<PyAny>> {
    let value = serde_json::to_value(value)
        .map_err(|e| crate::errors::NumapinError::new_err(format!("report as JSON: {e}")))?;
    json_to_py(py, &value)
}

/// One store, shared by its Python owner and every view into it.
pub struct StoreCell {
    store: RwLock<numapin::store::PinStore>,
    /// Layer → live views into it. Lock order: `pins`, then `store`.
    pins: Mutex<HashMap<usize, usize>>,
    callbacks: Callbacks,
}

/// A live view's hold on its layer: the store cannot release the layer's slots while
/// one exists.
pub struct LayerPin {
    cell: Arc<StoreCell>,
    layer: usize,
}

impl Drop for LayerPin {
    fn drop(&mut self) {
        let mut pins = self.cell.pins();
        if let Some(n) = pins.get_mut(&self.layer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                pins.remove(&self.layer);
            }
        }
    }
}

/// Store options from the Python keywords.
pub struct Options {
    pub huge_pages: bool,
    pub populate: bool,
    pub loader_threads: Option<usize>,
    pub read_mode: String,
    /// Keep the regions writable once loaded (`StoreOptions::writable`).
    pub writable: bool,
}

impl Options {
    pub(crate) fn build(&self, callbacks: &Callbacks) -> PyResult<StoreOptions> {
        let mode = match self.read_mode.as_str() {
            "auto" => ReadMode::Auto,
            "buffered" => ReadMode::Buffered,
            "direct" => ReadMode::Direct,
            "drop-behind" | "drop_behind" => ReadMode::DropBehind,
            other => {
                return Err(crate::errors::InvalidArgument::new_err(format!(
                    "read_mode {:?}: expected auto, buffered, direct or drop-behind",
                    crate::errors::clip(other)
                )));
            }
        };
        let mut options = StoreOptions::default()
            .huge_pages(self.huge_pages)
            .populate(self.populate)
            .read_mode(mode)
            .writable(self.writable)
            .progress(Some(callbacks.hook()));
        if let Some(threads) = self.loader_threads {
            options = options.loader_threads(threads);
        }
        Ok(options)
    }
}

impl StoreCell {
    /// A new store with `layout` (the short string form) and `options`.
    pub fn new(layout: &str, options: &Options) -> PyResult<Arc<StoreCell>> {
        let layout: Layout = layout.parse().py_err()?;
        let callbacks = Callbacks::default();
        let store = numapin::store::PinStore::new(layout, options.build(&callbacks)?).py_err()?;
        Ok(Arc::new(StoreCell {
            store: RwLock::new(store),
            pins: Mutex::new(HashMap::new()),
            callbacks,
        }))
    }

    fn pins(&self) -> std::sync::MutexGuard<'_, HashMap<usize, usize>> {
        self.pins.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The store, for reading (and packing: `pack_layer` takes `&self`), from a thread
    /// that does not hold the GIL (inside `py.detach`).
    pub fn read(&self) -> RwLockReadGuard<'_, numapin::store::PinStore> {
        self.store.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The store, for reading, from a thread holding the GIL. Never waits with the GIL
    /// held: a writer queued behind a load would otherwise block this read while the
    /// load's progress callback waits for the GIL. Waits detached, then takes the lock.
    pub fn read_gil(&self, py: Python<'_>) -> RwLockReadGuard<'_, numapin::store::PinStore> {
        loop {
            match self.store.try_read() {
                Ok(guard) => return guard,
                Err(std::sync::TryLockError::Poisoned(e)) => return e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    py.detach(|| drop(self.read()));
                }
            }
        }
    }

    /// Why placement degraded here, as a Python value (`"denied"`, `"unsupported"`), or
    /// None.
    pub fn degraded(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.read_gil(py)
            .degraded()
            .map(|d| to_dict(py, &d))
            .transpose()
    }

    /// The progress callbacks of this store.
    pub fn callbacks(&self) -> &Callbacks {
        &self.callbacks
    }

    /// Pins `layer` for a view being made.
    pub fn pin(self: &Arc<Self>, layer: usize) -> LayerPin {
        *self.pins().entry(layer).or_insert(0) += 1;
        LayerPin {
            cell: self.clone(),
            layer,
        }
    }

    /// Runs `change` on the store for writing, unless views into `layer` are alive.
    pub fn change<T>(
        &self,
        py: Python<'_>,
        layer: usize,
        what: &str,
        change: impl FnOnce(&mut numapin::store::PinStore) -> numapin::Result<T> + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        // The write lock first (waiting detached), then the pins: nothing waits for
        // anything while holding the pins lock, so this order cannot deadlock. A view
        // pinned after the check waits for the read lock and then finds the slot released.
        py.detach(|| {
            let mut store = self.store.write().unwrap_or_else(|e| e.into_inner());
            let pins = self.pins().get(&layer).copied().unwrap_or(0);
            if pins > 0 {
                return Err(pins);
            }
            Ok(change(&mut store))
        })
        .map_err(|n| {
            ViewsAlive::new_err(format!(
                "{what}: layer {layer} has {n} live view(s) into it; drop them (and the \
                 arrays and tensors made from them) first"
            ))
        })?
        .py_err()
    }

    /// A view of one slot's bytes (`uint8`), or of `piece` of it with `elem` and `shape`.
    pub fn slot_view(
        self: &Arc<Self>,
        py: Python<'_>,
        layer: usize,
        expert: usize,
        kind: Kind,
    ) -> PyResult<View> {
        let pin = self.pin(layer);
        let (address, len) = {
            let store = self.read_gil(py);
            let bytes = match kind {
                Kind::Weights => store.weights(layer, expert),
                Kind::Scales => store.scales(layer, expert),
            }
            .py_err()?;
            (bytes.as_ptr() as usize, bytes.len())
        };
        // SAFETY: the slot's bytes lie in the store's region, which the pin keeps mapped
        // (it holds the store) and unreleased (the store refuses to release a pinned layer).
        Ok(unsafe { View::contiguous(address, RAW, &[len as u64], Arc::new(pin)) })
    }

    /// Where slot `expert` of `layer` starts, and the layer's slot stride (the distance
    /// between consecutive experts' slots), checked over every expert.
    pub fn layer_geometry(
        &self,
        py: Python<'_>,
        layer: usize,
        kind: Kind,
    ) -> PyResult<(usize, usize, usize)> {
        let store = self.read_gil(py);
        let map = store.slot_map(layer).py_err()?;
        let experts = map.experts();
        let at = |e: usize| -> PyResult<usize> {
            let bytes = match kind {
                Kind::Weights => store.weights(layer, e),
                Kind::Scales => store.scales(layer, e),
            }
            .py_err()?;
            Ok(bytes.as_ptr() as usize)
        };
        let first = at(0)?;
        let stride = if experts > 1 { at(1)? - first } else { 0 };
        for e in 0..experts {
            if at(e)? != first + e * stride {
                return Err(crate::errors::NumapinError::new_err(format!(
                    "layer {layer}: the {} slots are not at one stride",
                    kind.name()
                )));
            }
        }
        Ok((first, stride, experts))
    }
}

/// Each Python object's bytes, held (and their exporters pinned) for the call.
pub fn buffers(objects: &[Bound<'_, PyAny>]) -> PyResult<Vec<PyUntypedBuffer>> {
    objects
        .iter()
        .map(|o| {
            let buffer = PyUntypedBuffer::get(o)?;
            if !buffer.is_c_contiguous() {
                return Err(PyValueError::new_err(
                    "a source must be C-contiguous (numpy.ascontiguousarray)",
                ));
            }
            Ok(buffer)
        })
        .collect()
}

/// The bytes of a C-contiguous buffer from [`buffers`].
pub fn bytes(buffer: &PyUntypedBuffer) -> &[u8] {
    if buffer.len_bytes() == 0 {
        return &[];
    }
    // SAFETY: a C-contiguous buffer of `len_bytes` at `buf_ptr`, held (and its exporter
    // pinned) by `buffer` for the slice's lifetime; the caller does not write it during
    // the call (documented on the methods that take sources).
    unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, buffer.len_bytes()) }
}

/// A store for callers with their own sources: one region per (layer, kind), experts
/// at a fixed stride, bound once before first touch.
///
/// `layout` is the short string form: `"interleave:all"`, `"layer-per-node:0-3"`,
/// `"replicate:all"`, `"split:0,2"`, `"unplaced"` (node sets in numactl's syntax).
#[pyclass(frozen, module = "numapin")]
pub struct PinStore {
    cell: Arc<StoreCell>,
}

#[pymethods]
impl PinStore {
    #[new]
    #[pyo3(signature = (layout = "interleave:all", *, huge_pages = true, populate = true,
                        loader_threads = None, writable = false))]
    fn new(
        layout: &str,
        huge_pages: bool,
        populate: bool,
        loader_threads: Option<usize>,
        writable: bool,
    ) -> PyResult<PinStore> {
        let options = Options {
            huge_pages,
            populate,
            loader_threads,
            read_mode: "auto".into(),
            writable,
        };
        Ok(PinStore {
            cell: StoreCell::new(layout, &options)?,
        })
    }

    /// The layout, in the short string form.
    #[getter]
    fn layout(&self, py: Python<'_>) -> String {
        self.cell.read_gil(py).layout().to_string()
    }

    /// Packs layer `layer`: expert `e`'s weights are `weights[e]` (and its scales
    /// `scales[e]`), any objects with the buffer protocol (bytes, numpy arrays),
    /// C-contiguous, not written during the call. The GIL is released while loading;
    /// `progress(Progress)` is called from the loader threads, and if it raises, the
    /// load stops, this raises that exception, and the layer is not packed. Returns the
    /// layer's report as a dict.
    #[pyo3(signature = (layer, weights, scales = None, *, progress = None))]
    fn pack_layer(
        &self,
        py: Python<'_>,
        layer: usize,
        weights: Vec<Bound<'_, PyAny>>,
        scales: Option<Vec<Bound<'_, PyAny>>>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        if let Some(p) = &progress
            && !p.bind(py).is_callable()
        {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "pack_layer: progress must be a callable taking a Progress, or None",
            ));
        }
        let weights = buffers(&weights)?;
        let scales = buffers(&scales.unwrap_or_default())?;
        if !scales.is_empty() && scales.len() != weights.len() {
            return Err(crate::errors::InvalidArgument::new_err(format!(
                "pack_layer: {} weights and {} scales",
                weights.len(),
                scales.len()
            )));
        }
        let sources: Vec<ExpertSource<'_>> = weights
            .iter()
            .enumerate()
            .map(|(e, w)| ExpertSource::Memory {
                weights: bytes(w),
                scales: scales.get(e).map_or(&[][..], bytes),
            })
            .collect();
        let spec = LayerSpec::fitting(&sources).py_err()?;
        let registration = self
            .cell
            .callbacks()
            .register(py, &[layer], progress.as_ref());
        let cell = &self.cell;
        let result = py.detach(|| cell.read().pack_layer(layer, &spec, &sources));
        match result {
            Ok(report) => to_dict(py, &report),
            Err(e) => Err(registration.error(e)),
        }
    }

    /// Expert `expert`'s weights in layer `layer`: a read-only `uint8` view.
    fn weights(&self, py: Python<'_>, layer: usize, expert: usize) -> PyResult<View> {
        self.cell.slot_view(py, layer, expert, Kind::Weights)
    }

    /// Expert `expert`'s scales in layer `layer`: a read-only `uint8` view.
    fn scales(&self, py: Python<'_>, layer: usize, expert: usize) -> PyResult<View> {
        self.cell.slot_view(py, layer, expert, Kind::Scales)
    }

    /// Every expert's slot of one kind (`"weights"`, `"scales"`) in layer `layer`: a
    /// `[experts, stride]` `uint8` view, the slot stride as the outer stride.
    #[pyo3(signature = (layer, kind = "weights"))]
    fn layer(&self, py: Python<'_>, layer: usize, kind: &str) -> PyResult<View> {
        let kind = parse_kind(kind)?;
        let pin = self.cell.pin(layer);
        let (first, stride, experts) = self.cell.layer_geometry(py, layer, kind)?;
        let shape = vec![
            experts as isize,
            slot_len(py, &self.cell, layer, kind)? as isize,
        ];
        // SAFETY: row e is expert e's slot (at `first + e × stride`, checked for every
        // expert), inside the layer's region, which the pin keeps mapped and unreleased.
        Ok(unsafe { View::new(first, RAW, shape, vec![stride as isize, 1], Arc::new(pin)) })
    }

    /// Gives expert `expert`'s pages of layer `layer` back (the addresses stay; a later
    /// `ensure` reloads them). Refused with `ViewsAlive` while views into the layer live.
    fn release(&self, py: Python<'_>, layer: usize, expert: usize) -> PyResult<()> {
        self.cell
            .change(py, layer, "PinStore.release", |s| s.release(layer, expert))
    }

    /// Loads a released slot again from `weights` (and `scales`).
    #[pyo3(signature = (layer, expert, weights, scales = None))]
    fn ensure(
        &self,
        py: Python<'_>,
        layer: usize,
        expert: usize,
        weights: Bound<'_, PyAny>,
        scales: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let w = buffers(&[weights])?;
        let s = buffers(&scales.into_iter().collect::<Vec<_>>())?;
        let source = ExpertSource::Memory {
            weights: bytes(&w[0]),
            scales: s.first().map_or(&[][..], bytes),
        };
        // Ensure writes only a released slot, which no view reads (a view of a released
        // slot is refused); the pins rule applies all the same: one rule for every change.
        self.cell.change(py, layer, "PinStore.ensure", |st| {
            st.ensure(layer, expert, &source)
        })
    }

    /// The store's statistics (layers, bytes, VMAs measured, mbind calls, pages per node,
    /// placement) as a dict.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let stats = py.detach(|| self.cell.read().stats()).py_err()?;
        to_dict(py, &stats)
    }

    /// Why placement degraded here (`"denied"`: EPERM, `"unsupported"`: ENOSYS), or None.
    #[getter]
    fn degraded(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.cell.degraded(py)
    }
}

/// Bytes of one slot of `kind` in `layer` (expert 0's).
fn slot_len(py: Python<'_>, cell: &StoreCell, layer: usize, kind: Kind) -> PyResult<usize> {
    let store = cell.read_gil(py);
    Ok(match kind {
        Kind::Weights => store.weights(layer, 0),
        Kind::Scales => store.scales(layer, 0),
    }
    .py_err()?
    .len())
}

/// `"weights"` or `"scales"`.
pub fn parse_kind(kind: &str) -> PyResult<Kind> {
    match kind {
        "weights" => Ok(Kind::Weights),
        "scales" => Ok(Kind::Scales),
        other => Err(crate::errors::InvalidArgument::new_err(format!(
            "kind {:?}: expected \"weights\" or \"scales\"",
            crate::errors::clip(other)
        ))),
    }
}
