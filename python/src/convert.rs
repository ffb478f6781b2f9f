//! `Checkpoint.place`'s `convert_class=` and `convert_pattern=`: tensors placed in the
//! dtype the framework holds (`PlacementPlan::convert_class`/`convert_pattern`).

use numapin::model::{Dtype, PlacementPlan};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{InvalidArgument, clip};

/// `convert_class=` (`{class: dtype}`) and `convert_pattern=` (`{glob: dtype}`, in the
/// dict's order, the last matching pattern wins) applied to `plan`.
pub fn apply(
    mut plan: PlacementPlan,
    classes: Option<&Bound<'_, PyDict>>,
    patterns: Option<&Bound<'_, PyDict>>,
) -> PyResult<PlacementPlan> {
    for (key, value) in classes.into_iter().flat_map(|d| d.iter()) {
        let name = key.extract::<String>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(
                "place: convert_class= keys are class names (str)",
            )
        })?;
        let class = crate::whole::dense_class(&name)?;
        plan = plan.convert_class(class, dtype("convert_class", &name, &value)?);
    }
    for (key, value) in patterns.into_iter().flat_map(|d| d.iter()) {
        let glob = key.extract::<String>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(
                "place: convert_pattern= keys are name globs (str)",
            )
        })?;
        let dtype = dtype("convert_pattern", &glob, &value)?;
        plan = plan.convert_pattern(glob, dtype);
    }
    Ok(plan)
}

/// A dtype keyword value: a str (`"float32"`, `"F32"`), a `numpy.dtype` or a
/// `torch.dtype` (anything else is a TypeError).
fn dtype(keyword: &str, key: &str, value: &Bound<'_, PyAny>) -> PyResult<Dtype> {
    let text = if let Ok(text) = value.extract::<String>() {
        text
    } else if value.hasattr("itemsize")? && !value.is_instance_of::<pyo3::types::PyType>() {
        // numpy.dtype("float32") prints `float32`, torch.float32 `torch.float32`.
        value.str()?.extract::<String>()?
    } else {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "place: {keyword}[{:?}] takes a dtype (\"float32\", numpy.dtype or torch.dtype), not {}",
            clip(key),
            crate::whole::type_name(value)
        )));
    };
    text.parse::<Dtype>()
        .map_err(|e| InvalidArgument::new_err(format!("place: {keyword}[{:?}]: {e}", clip(key))))
}
