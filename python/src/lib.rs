//! numapin for Python: place a checkpoint's experts with numapin and read them through
//! zero-copy views. The `numapin` Python package re-exports this module (`_numapin`).
//!
//! Long calls release the GIL; errors are Python exceptions, one subclass of `NumapinError` per kind.

use pyo3::prelude::*;

mod cache;
mod checkpoint;
mod convert;
mod errors;
mod experts_view;
mod progress;
mod reads;
mod role_major;
mod served;
mod store;
mod view;
mod whole;

/// `numapin.probe()`: what this process may do here, as a dict (the crate's `Support`:
/// the mempolicy verdict, nodes, mems_allowed, distances, THP, map counts, ...), plus
/// `"summary"`, the crate's one-paragraph report.
#[pyfunction]
fn probe(py: Python<'_>) -> PyResult<Py<PyAny>> {
    let support = py.detach(numapin::probe).map_err(errors::to_py)?;
    let mut value = serde_json::to_value(&support)
        .map_err(|e| errors::NumapinError::new_err(format!("probe: {e}")))?;
    if let Some(map) = value.as_object_mut() {
        map.insert("summary".into(), support.to_string().into());
    }
    store::json_to_py(py, &value)
}

/// `numapin._numapin.main(argv)`: the `numapin` command (`probe`, `plan`, `place`,
/// `stat PID`; docs/cli.md), the body of the package's console script. Runs the code the
/// Rust binary runs (`numapin::cli`) on `argv` (the program name first), with the GIL
/// released, and returns the exit status: 0, 1 for an error, 2 for a usage error. It
/// writes to the process's standard output and error directly, past `sys.stdout`.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> i32 {
    py.detach(|| numapin::cli::main(argv))
}

/// The extension module.
#[pymodule]
fn _numapin(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(probe, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(served::attach, m)?)?;
    m.add_class::<view::View>()?;
    m.add_class::<progress::Progress>()?;
    m.add_class::<store::PinStore>()?;
    m.add_class::<checkpoint::Checkpoint>()?;
    m.add_class::<checkpoint::PlacedModel>()?;
    m.add_class::<whole::WholeModel>()?;
    m.add_class::<cache::ExpertCache>()?;
    m.add_class::<cache::CacheEntry>()?;
    Ok(())
}
