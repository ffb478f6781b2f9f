//! Capability checks made before a call, so that a missing capability is named instead
//! of surfacing as a bare `EPERM`.

use crate::error::Error;

/// Whether the calling thread holds `CAP_SYS_NICE` in its effective set. In a child user
/// namespace this can be true while the kernel still refuses host-wide operations; the
/// callers also interpret a later `EPERM`.
pub fn sys_nice() -> bool {
    caps::has_cap(
        None,
        caps::CapSet::Effective,
        caps::Capability::CAP_SYS_NICE,
    )
    .unwrap_or(false)
}

/// The error for an operation that needs `CAP_SYS_NICE`: `why` says what needed it.
pub(crate) fn missing_sys_nice(op: &'static str, why: impl Into<String>) -> Error {
    Error::MissingCapability {
        op,
        cap: "CAP_SYS_NICE",
        why: why.into(),
    }
}
