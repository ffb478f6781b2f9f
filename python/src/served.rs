//! `numapin.attach(name)`: a whole model another process serves by name
//! (`Checkpoint.place(..., serve_as=name)`), attached read-only with no copy.

use pyo3::prelude::*;

use crate::errors::{IntoPy, InvalidArgument};
use crate::whole::WholeModel;

/// `numapin.attach(name, timeout=30.0)`: the model another process placed with
/// `Checkpoint.place(..., serve_as=name)`, fetched over its socket and mapped read-only:
/// the same pages, no file read, no copy. A `WholeModel` as `place` returns (its
/// `report()` is empty and `verify()` needs the checkpoint: the placer's).
#[pyfunction]
#[pyo3(signature = (name, *, timeout = 30.0))]
pub fn attach(py: Python<'_>, name: &str, timeout: f64) -> PyResult<WholeModel> {
    let timeout = std::time::Duration::try_from_secs_f64(timeout).map_err(|_| {
        InvalidArgument::new_err(format!(
            "attach: timeout={timeout} is not a number of seconds >= 0"
        ))
    })?;
    let limits = numapin::serve::Limits::default().timeout(timeout);
    let model = py
        .detach(|| numapin::model::PlacedModel::attach_served(name, &limits))
        .py_err()?;
    Ok(crate::whole::attached(model))
}
