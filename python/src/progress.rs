//! Progress callbacks from the loader threads into Python.
//!
//! A store's hook is made once, at construction; callbacks are registered per layer for
//! the length of a pack call. The hook takes the GIL, calls the layer's callback with a
//! [`Progress`], and when the callback raises keeps the exception and returns `Break`:
//! the crate stops that layer's load (`Error::Cancelled`), and the pack call raises the
//! callback's own exception. The store stays as it was before the call.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

use numapin::store::ProgressHook;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBool;

/// The callback a `progress=` keyword asks for: `False` none, `None` the automatic tqdm
/// bar over `total()` bytes (or none; `total` is asked only then), a callable itself. Anything else (`True`, a number,
/// a string) is a `TypeError` now, before anything is loaded: taken as the callback, it
/// would fail in a loader thread halfway through the load.
pub fn callback_of(
    py: Python<'_>,
    progress: Option<Bound<'_, PyAny>>,
    total: impl FnOnce() -> PyResult<u64>,
) -> PyResult<Option<Py<PyAny>>> {
    match progress {
        Some(p) if p.is_instance_of::<PyBool>() && !p.is_truthy()? => Ok(None),
        Some(p) if !p.is_instance_of::<PyBool>() && p.is_callable() => Ok(Some(p.unbind())),
        Some(p) => Err(PyTypeError::new_err(format!(
            "progress must be a callable taking a Progress, False or None, not {}",
            p.repr().map_or_else(
                |_| "this".to_owned(),
                |r| crate::errors::clip(&r.to_string()).to_owned()
            )
        ))),
        None => {
            let auto = py
                .import("numapin._progress")?
                .call_method1("auto_bar", (total()?,))?;
            Ok((!auto.is_none()).then(|| auto.unbind()))
        }
    }
}

/// Where one layer's load stands, as passed to a progress callback.
#[pyclass(frozen, get_all, module = "numapin")]
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// The reporting store's number in the process: with `layer`, it names one load
    /// where a whole-model placement's stores (one per class and layout, each numbering
    /// its layers from 0) share a callback.
    pub store: u64,
    /// The model layer being loaded (a dense store's group).
    pub layer: usize,
    /// Bytes copied into its slots so far.
    pub bytes_done: u64,
    /// Bytes the layer loads in all.
    pub bytes_total: u64,
    /// Slots filled so far.
    pub slots_done: usize,
    /// Slots the layer fills in all.
    pub slots_total: usize,
}

#[pymethods]
impl Progress {
    fn __repr__(&self) -> String {
        format!(
            "Progress(store={}, layer={}, bytes_done={}, bytes_total={}, slots_done={}, slots_total={})",
            self.store,
            self.layer,
            self.bytes_done,
            self.bytes_total,
            self.slots_done,
            self.slots_total
        )
    }
}

#[derive(Default)]
struct Table {
    /// Layer → the callback of the pack call loading it.
    callbacks: HashMap<usize, Py<PyAny>>,
    /// Layer → the exception its callback raised.
    raised: HashMap<usize, PyErr>,
}

/// The per-layer callbacks of one store, and the hook that calls them.
#[derive(Clone, Default)]
pub struct Callbacks(Arc<Mutex<Table>>);

impl Callbacks {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The crate hook for the store's options.
    pub fn hook(&self) -> ProgressHook {
        let this = self.clone();
        ProgressHook::cancellable(move |p| this.call(p))
    }

    fn call(&self, p: &numapin::store::Progress) -> ControlFlow<()> {
        // The GIL first, then the table: no one holds the table while waiting for the GIL.
        let callback = Python::attach(|py| {
            let table = self.table();
            if table.raised.contains_key(&p.layer) {
                return None;
            }
            table.callbacks.get(&p.layer).map(|cb| cb.clone_ref(py))
        });
        let Some(callback) = callback else {
            let raised = self.table().raised.contains_key(&p.layer);
            return if raised {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            };
        };
        let progress = Progress {
            store: p.store,
            layer: p.layer,
            bytes_done: p.bytes_done,
            bytes_total: p.bytes_total,
            slots_done: p.slots_done,
            slots_total: p.slots_total,
        };
        let result = Python::attach(|py| callback.call1(py, (progress,)).map(drop));
        match result {
            Ok(()) => ControlFlow::Continue(()),
            Err(err) => {
                self.table().raised.insert(p.layer, err);
                ControlFlow::Break(())
            }
        }
    }

    /// Registers `callback` for `layers` until the guard drops.
    pub fn register(
        &self,
        py: Python<'_>,
        layers: &[usize],
        callback: Option<&Py<PyAny>>,
    ) -> Registration {
        let mut table = self.table();
        for &layer in layers {
            table.raised.remove(&layer);
            if let Some(cb) = callback {
                table.callbacks.insert(layer, cb.clone_ref(py));
            }
        }
        drop(table);
        Registration {
            callbacks: self.clone(),
            layers: layers.to_vec(),
        }
    }
}

/// A pack call's callbacks; dropping it unregisters them.
pub struct Registration {
    callbacks: Callbacks,
    layers: Vec<usize>,
}

impl Registration {
    /// The first exception a callback of these layers raised, if any (taken).
    pub fn raised(&self) -> Option<PyErr> {
        let mut table = self.callbacks.table();
        self.layers.iter().find_map(|l| table.raised.remove(l))
    }

    /// The error to raise for a failed pack: the callback's own exception when it
    /// cancelled the load, else the crate's.
    pub fn error(&self, err: numapin::Error) -> PyErr {
        match self.raised() {
            Some(raised) if matches!(err, numapin::Error::Cancelled { .. }) => raised,
            _ => crate::errors::to_py(err),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut table = self.callbacks.table();
        for layer in &self.layers {
            // Dropped with the GIL held (the pack call re-attached before this drop).
            table.callbacks.remove(layer);
            table.raised.remove(layer);
        }
    }
}
