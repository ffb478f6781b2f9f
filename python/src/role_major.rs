//! `place(role_major=...)`: role-major expert slots (`StoreOptions::role_major`) from
//! Python. `None` or `"auto"`: the default (role-major where the checkpoint keeps each
//! role of a layer's experts flattened as one tensor, DBRX, and nothing orders the slots
//! otherwise); `True`: asked, with the layers' weight roles; an int `R`: asked with `R`
//! (refused by the placement unless `R` is the weight roles). Anything else is refused
//! here, naming `role_major`.

use numapin::model::Checkpoint;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyString};

use crate::errors::{IntoPy, InvalidArgument};

/// The `StoreOptions::role_major` count for `value` (1: the default).
pub fn roles(checkpoint: &Checkpoint, value: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(1);
    };
    if value.is_instance_of::<PyBool>() {
        if !value.extract::<bool>()? {
            return Err(InvalidArgument::new_err(
                "place: role_major=False: there is no switch to turn the automatic \
                 role-major order off (it applies only where a layer's experts are one \
                 tensor per role, DBRX); omit role_major",
            ));
        }
        let plan = checkpoint.expert_plan().py_err()?;
        let first = plan.layers().iter().find_map(|l| l.experts().first());
        return match first.map(|e| e.weights().len()) {
            Some(r) => Ok(r),
            None => Err(InvalidArgument::new_err(
                "place: role_major=True: the checkpoint's MoE layers hold no expert",
            )),
        };
    }
    if value.is_instance_of::<PyString>() {
        let text: String = value.extract()?;
        if text == "auto" {
            return Ok(1);
        }
        return Err(InvalidArgument::new_err(format!(
            "place: role_major={:?}: takes True, \"auto\", None or the count of weight \
             roles (an int)",
            crate::errors::clip(&text)
        )));
    }
    if value.is_instance_of::<PyInt>() {
        return match value.extract::<usize>() {
            Ok(r) => Ok(r),
            Err(_) => Err(InvalidArgument::new_err(format!(
                "place: role_major={}: a count of weight roles is at least 1 and at most \
                 {}",
                crate::errors::clip(&value.str()?.to_string()),
                usize::MAX
            ))),
        };
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "place: role_major= takes True, \"auto\", None or an int, not {}",
        crate::whole::type_name(value)
    )))
}
