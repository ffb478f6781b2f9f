//! Read-only at rest: `mprotect` of a whole region, and the write windows that open it
//! for a fill and close it after.
//!
//! Protection always changes for the whole region, never for a slot: a region keeps one
//! protection at rest, so it never splits into more mappings than it had (while a window
//! is open the region is read-write as a whole, and closing it lets the kernel merge it
//! back with equal neighbours). Windows are counted: the region becomes writable when the
//! first window opens and read-only again when the last one closes, so that concurrent
//! fills of different slots never close the region under each other. Readers need no
//! window.

use std::sync::MutexGuard;

use numapin_sys as sys;

use super::Region;
use crate::error::{Error, Result};

/// A region's protection at rest and the write windows open on it.
#[derive(Debug, Default)]
pub(super) struct Protection {
    /// Read-only at rest ([`Region::set_read_only`]).
    read_only: bool,
    /// Write windows open now ([`Region::open_write`]).
    open: usize,
}

impl Protection {
    /// Whether a write may be made now: the region is writable at rest, or a window is
    /// open.
    pub(super) fn writable_now(&self) -> bool {
        !self.read_only || self.open > 0
    }
}

/// An open write window of a read-only region: the region is read-write (as a whole)
/// until the last window of it closes. Close it with [`WriteWindow::close`] to see an
/// error; dropping it closes it too (an error is then lost: the region stays writable).
#[derive(Debug)]
#[must_use = "the region is writable only while the window lives"]
pub struct WriteWindow<'a> {
    region: &'a Region,
    /// Whether this window counts (a region writable at rest needs none).
    counted: bool,
}

impl WriteWindow<'_> {
    /// Closes the window: the last one to close makes the region read-only again.
    ///
    /// # Errors
    /// `mprotect` fails (the error names the call, errno, address and length).
    pub fn close(mut self) -> Result<()> {
        self.close_inner()
    }

    fn close_inner(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.counted) {
            return Ok(());
        }
        let mut state = self.region.protection_state();
        state.open = state.open.saturating_sub(1);
        if state.open == 0 && state.read_only {
            self.region.protect_all("WriteWindow::close", false)?;
        }
        Ok(())
    }
}

impl Drop for WriteWindow<'_> {
    fn drop(&mut self) {
        // A destructor has no one to report to; `close` is the way to see the error.
        let _ = self.close_inner();
    }
}

impl Region {
    pub(super) fn protection_state(&self) -> MutexGuard<'_, Protection> {
        // The state is two integers, consistent after every statement: a panic elsewhere
        // leaves nothing half-done in it.
        self.protection.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `mprotect` of the whole mapping: `PROT_READ`, or `PROT_READ | PROT_WRITE`.
    fn protect_all(&self, op: &'static str, writable: bool) -> Result<()> {
        let (prot, name) = if writable {
            (sys::PROT_READ | sys::PROT_WRITE, "PROT_READ|PROT_WRITE")
        } else {
            (sys::PROT_READ, "PROT_READ")
        };
        let (addr, len) = (self.as_ptr(), self.map_len());
        // SAFETY: the whole range is our own mapping. Making it read-only: the callers
        // ensure that no write is under way (`&mut self`, or the last window closing,
        // whose writers are done); making it writable changes no byte.
        unsafe { sys::mprotect(addr.cast(), len, prot) }.map_err(|e| {
            Error::os(
                "mprotect",
                e,
                format_args!("{op}: addr={addr:p} len={len} {name}"),
            )
        })
    }

    /// Makes the region read-only at rest (`mprotect(PROT_READ)` of the whole mapping: a
    /// write then raises `SIGSEGV`, as on a frozen store), or writable again
    /// (`PROT_READ | PROT_WRITE`). A read-only region is written only inside a
    /// [`Region::open_write`] window; [`Region::as_mut_slice`] and
    /// [`Region::slot_mut_unchecked`] refuse it outside one. Releasing pages
    /// ([`Region::release`]) needs no window.
    ///
    /// # Errors
    /// A file mapping or a sealed view asked to become writable, a region whose mapping
    /// was lost, or `mprotect` fails (the error names the call, errno, address and
    /// length).
    #[doc(alias = "mprotect")]
    pub fn set_read_only(&mut self, read_only: bool) -> Result<()> {
        const OP: &str = "Region::set_read_only";
        if let Err(e) = self.backing_writable(OP) {
            // A file mapping or a sealed view is read-only already.
            return if read_only && !self.is_empty() {
                Ok(())
            } else {
                Err(e)
            };
        }
        // `&mut self`: no window is open and no slice lives.
        self.protect_all(OP, !read_only)?;
        self.protection_state().read_only = read_only;
        Ok(())
    }

    /// Whether the region is read-only at rest ([`Region::set_read_only`]), or is a
    /// read-only file mapping or sealed view.
    pub fn is_read_only(&self) -> bool {
        self.backing_writable("Region::is_read_only").is_err() || self.protection_state().read_only
    }

    /// Opens the region for writing: the first open window makes a read-only region
    /// read-write (`mprotect(PROT_READ | PROT_WRITE)` of the whole mapping), and it
    /// stays so until the last window closes. A region writable at rest gets a window
    /// that changes nothing. Windows may be opened by several threads at once (each fill
    /// of its own slot); readers need none.
    ///
    /// # Errors
    /// A file mapping, a sealed view or a lost mapping, or `mprotect` fails.
    #[doc(alias = "mprotect")]
    pub fn open_write(&self) -> Result<WriteWindow<'_>> {
        const OP: &str = "Region::open_write";
        self.backing_writable(OP)?;
        let mut state = self.protection_state();
        if !state.read_only {
            return Ok(WriteWindow {
                region: self,
                counted: false,
            });
        }
        if state.open == 0 {
            self.protect_all(OP, true)?;
        }
        state.open += 1;
        Ok(WriteWindow {
            region: self,
            counted: true,
        })
    }
}
