//! Locking a region in memory (`mlock`), with the errors `RLIMIT_MEMLOCK` and user
//! namespaces call for.

use std::sync::atomic::Ordering;

use super::Region;
use crate::diag;
use crate::error::{Errno, Error, Result};

impl Region {
    /// Locks the region in RAM (`mlock(2)`), after checking `RLIMIT_MEMLOCK` against
    /// what the process has locked already (unless it holds `CAP_IPC_LOCK`).
    ///
    /// # Errors
    /// [`Error::MemlockLimit`] naming the bytes wanted, locked and the limit; or `mlock`
    /// fails.
    #[doc(alias = "mlock")]
    pub fn lock(&self) -> Result<()> {
        let wanted = self.map_len() as u64;
        check_memlock(wanted)?;
        self.mlock(wanted)?;
        self.locked.store(true, Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn mlock(&self, wanted: u64) -> Result<()> {
        // SAFETY: our own range; locking changes no contents.
        unsafe { rustix::mm::mlock(self.as_ptr().cast(), self.map_len()) }.map_err(|e| {
            // The second line of defence: a capability the pre-check trusted that the
            // kernel did not (or a limit lowered meanwhile) ends here, at the limit.
            if matches!(e, Errno::NOMEM | Errno::PERM)
                && let Some(limit_error) = memlock_exceeded(wanted)
            {
                return limit_error;
            }
            Error::os(
                "mlock",
                e,
                format_args!("addr={:p} len={}", self.as_ptr(), self.map_len()),
            )
        })
    }

    /// Unlocks the region (`munlock(2)`).
    ///
    /// # Errors
    /// `munlock` fails.
    pub fn unlock(&self) -> Result<()> {
        // SAFETY: our own range; unlocking changes no contents.
        unsafe { rustix::mm::munlock(self.as_ptr().cast(), self.map_len()) }.map_err(|e| {
            Error::os(
                "munlock",
                e,
                format_args!("addr={:p} len={}", self.as_ptr(), self.map_len()),
            )
        })?;
        self.locked.store(false, Ordering::Relaxed);
        Ok(())
    }
}

/// Refuses a lock the kernel would refuse for `RLIMIT_MEMLOCK`, naming the figures.
/// `CAP_IPC_LOCK` lifts the limit only in the initial user namespace: the kernel checks
/// it there (`capable()`), so the capability root holds in a child namespace (`unshare
/// -U -r`, a rootless container) does not count.
fn check_memlock(wanted: u64) -> Result<()> {
    let privileged = caps::has_cap(
        None,
        caps::CapSet::Effective,
        caps::Capability::CAP_IPC_LOCK,
    )
    .unwrap_or(false)
        && in_initial_user_namespace();
    if privileged {
        return Ok(());
    }
    match memlock_exceeded(wanted) {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// [`Error::MemlockLimit`] when locking `wanted` more bytes crosses the soft limit.
fn memlock_exceeded(wanted: u64) -> Option<Error> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock).current?;
    // Unreadable VmLck: no figures to name; the caller keeps the kernel's errno.
    let locked = diag::status_kib("VmLck").ok()?.unwrap_or(0) * 1024;
    (locked.saturating_add(wanted) > limit).then_some(Error::MemlockLimit {
        wanted,
        locked,
        limit,
    })
}

/// Whether this process is in the initial user namespace, whose `uid_map` maps the whole
/// id range onto itself (`0 0 4294967295`). Unreadable: assume a child namespace, the
/// cautious answer (the limit is then checked, not skipped).
fn in_initial_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map").is_ok_and(|map| {
        let lines: Vec<Vec<&str>> = map
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        lines == [vec!["0", "0", "4294967295"]]
    })
}
