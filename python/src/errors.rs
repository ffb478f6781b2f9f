//! The crate's errors as Python exceptions: one subclass of `NumapinError` per condition
//! a caller reacts to, each carrying the crate's message.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    numapin,
    NumapinError,
    PyException,
    "Every numapin error: the message names the call, the errno and the arguments."
);
create_exception!(
    numapin,
    CheckpointError,
    NumapinError,
    "A checkpoint file is truncated, malformed, or its experts are incomplete."
);
create_exception!(
    numapin,
    CacheFull,
    NumapinError,
    "Every slot of the cache's chosen node is held by a live entry or view."
);
create_exception!(
    numapin,
    NodeNotAllowed,
    NumapinError,
    "A node this process may not use (outside its cpuset's mems_allowed)."
);
create_exception!(
    numapin,
    MissingCapability,
    NumapinError,
    "The kernel's capability check refused a call the probe found allowed (CAP_SYS_NICE)."
);
create_exception!(
    numapin,
    InvalidArgument,
    NumapinError,
    "A bad argument: misaligned, out of bounds, overflowing, empty, or unparsable."
);
create_exception!(
    numapin,
    NotPacked,
    NumapinError,
    "A layer that is not packed, or a slot that is released, was asked for."
);
create_exception!(
    numapin,
    NotHeld,
    NumapinError,
    "An expert this rank's share does not hold (the message names the id and the ids held)."
);
create_exception!(
    numapin,
    MapBudget,
    NumapinError,
    "The mappings would cross vm.max_map_count (the message names both numbers)."
);
create_exception!(
    numapin,
    ViewsAlive,
    NumapinError,
    "Release or re-pack refused: views into the bytes are alive (drop them first)."
);
create_exception!(
    numapin,
    Cancelled,
    NumapinError,
    "A load stopped by its progress callback (raised when the callback did not raise)."
);

/// At most 200 bytes of `text` (cut at a character boundary), for an error message.
pub fn clip(text: &str) -> &str {
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The Python exception for a crate error, with the crate's message.
pub fn to_py(err: numapin::Error) -> PyErr {
    use numapin::Error as E;
    let message = err.to_string();
    match err {
        E::Checkpoint { .. } => CheckpointError::new_err(message),
        E::CacheFull { .. } => CacheFull::new_err(message),
        E::NodeNotAllowed { .. } => NodeNotAllowed::new_err(message),
        E::MissingCapability { .. } => MissingCapability::new_err(message),
        E::InvalidArgument { .. } | E::Parse { .. } | E::OutOfRange { .. } => {
            InvalidArgument::new_err(message)
        }
        E::NotPacked { .. } | E::Released { .. } => NotPacked::new_err(message),
        E::NotHeld { .. } => NotHeld::new_err(message),
        E::MapBudget { .. } => MapBudget::new_err(message),
        E::Cancelled { .. } => Cancelled::new_err(message),
        _ => NumapinError::new_err(message),
    }
}

/// `Result<T, numapin::Error>` → `PyResult<T>`.
pub trait IntoPy<T> {
    /// The Python exception for the error.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for numapin::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// Adds the exception types to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("NumapinError", py.get_type::<NumapinError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("CacheFull", py.get_type::<CacheFull>())?;
    m.add("NodeNotAllowed", py.get_type::<NodeNotAllowed>())?;
    m.add("MissingCapability", py.get_type::<MissingCapability>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("NotPacked", py.get_type::<NotPacked>())?;
    m.add("NotHeld", py.get_type::<NotHeld>())?;
    m.add("MapBudget", py.get_type::<MapBudget>())?;
    m.add("ViewsAlive", py.get_type::<ViewsAlive>())?;
    m.add("Cancelled", py.get_type::<Cancelled>())?;
    Ok(())
}
