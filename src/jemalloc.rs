//! jemalloc as part of the memory story (feature `jemalloc`): purge, stats, retain.
//!
//! A loader churns through buffers; glibc malloc keeps much of that churn resident.
//! jemalloc with `retain:false` gives unused extents back to the kernel, and a purge
//! of all arenas right after a load brings RSS down to the live bytes at once.
//!
//! # Making jemalloc the global allocator, with `retain:false` baked in
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: numapin::jemalloc::Jemalloc = numapin::jemalloc::Jemalloc;
//!
//! // jemalloc reads this C string at start-up (the build's symbol prefix is `_rjem_`).
//! #[allow(non_upper_case_globals)]
//! #[unsafe(export_name = "_rjem_malloc_conf")]
//! pub static malloc_conf: &[u8; 13] = b"retain:false\0";
//! ```
//!
//! `retain:false` makes jemalloc unmap extents it no longer needs instead of keeping
//! them mapped for reuse, so purged memory leaves the process. Prefer it over
//! `dirty_decay_ms:0`, which purges on every free and costs the loader a madvise per
//! deallocation; with `retain:false` the purge happens once, when [`purge_all`] asks.
//! The environment variable `_RJEM_MALLOC_CONF` sets the same options at run time.
//!
//! # When jemalloc is not the global allocator
//!
//! The calls still work, on jemalloc's own arenas only: [`stats`] then counts just
//! what was allocated through jemalloc explicitly (for a program that only links it,
//! close to nothing), and [`purge_all`] purges those arenas. They say nothing about glibc
//! malloc's heap.
//!
//! # Safety
//!
//! `mallctl` takes raw pointers; each call here passes either NULLs or a local value
//! whose size is passed alongside it.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_void};
use std::ptr;

pub use tikv_jemallocator::Jemalloc;

use crate::error::{Errno, Error, Result};

fn mallctl_error(key: &CStr, code: i32) -> Error {
    Error::os(
        "mallctl",
        Errno::from_raw_os_error(code),
        format_args!("{}", key.to_string_lossy()),
    )
}

/// `mallctl(key, NULL, NULL, NULL, 0)`: a command that reads and writes nothing.
fn command(key: &CStr) -> Result<()> {
    // SAFETY: a NUL-terminated key; with all four pointers NULL jemalloc reads and writes
    // nothing (any non-NULL pointer makes the purge commands answer EPERM).
    let code = unsafe {
        tikv_jemalloc_sys::mallctl(
            key.as_ptr(),
            ptr::null_mut(),
            ptr::null_mut(),
            ptr::null_mut(),
            0,
        )
    };
    match code {
        0 => Ok(()),
        code => Err(mallctl_error(key, code)),
    }
}

/// Reads a `T`-sized value (`size_t`, `bool`, `uint64_t`).
fn read<T: Copy + Default>(key: &CStr) -> Result<T> {
    let mut value = T::default();
    let mut len = std::mem::size_of::<T>();
    // SAFETY: `value` is writable and `len` says its size; jemalloc checks that the size
    // matches the key's type (EINVAL otherwise).
    let code = unsafe {
        tikv_jemalloc_sys::mallctl(
            key.as_ptr(),
            (&raw mut value).cast::<c_void>(),
            &mut len,
            ptr::null_mut(),
            0,
        )
    };
    match code {
        0 => Ok(value),
        code => Err(mallctl_error(key, code)),
    }
}

/// Flushes the calling thread's cache (`thread.tcache.flush`), then purges every arena
/// (`arena.4096.purge`, 4096 being `MALLCTL_ARENAS_ALL`), returning unused dirty pages to
/// the kernel.
///
/// # Errors
/// `mallctl` fails (`EFAULT`/`EPERM` would mean a bug here; `ENOENT` a jemalloc built
/// without the command).
///
/// # Example
/// ```
/// numapin::jemalloc::purge_all().unwrap();
/// ```
pub fn purge_all() -> Result<()> {
    // The thread cache holds freed blocks that the arena cannot purge until flushed.
    // Without a tcache (opt.tcache:false) the command answers EFAULT: nothing to flush.
    match command(c"thread.tcache.flush") {
        Ok(()) => {}
        Err(e) if e.errno() == Some(Errno::FAULT) => {}
        Err(e) => return Err(e),
    }
    command(c"arena.4096.purge")
}

/// jemalloc's counters, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Bytes allocated by the application.
    pub allocated: usize,
    /// Bytes in active pages (≥ allocated).
    pub active: usize,
    /// Bytes in physically resident data pages mapped by the allocator.
    pub resident: usize,
    /// Bytes in active extents mapped by the allocator.
    pub mapped: usize,
    /// Bytes in virtual memory mappings retained (not returned to the OS).
    pub retained: usize,
}

/// Refreshes jemalloc's statistics (`epoch`) and reads them.
///
/// # Errors
/// `mallctl` fails (`ENOENT`: jemalloc built without statistics).
pub fn stats() -> Result<Stats> {
    let mut epoch: u64 = 1;
    let mut len = std::mem::size_of::<u64>();
    let key = c"epoch";
    // SAFETY: `epoch` is a valid u64 for both reading and writing, sized by `len`.
    let code = unsafe {
        tikv_jemalloc_sys::mallctl(
            key.as_ptr(),
            (&raw mut epoch).cast::<c_void>(),
            &mut len,
            (&raw mut epoch).cast::<c_void>(),
            len,
        )
    };
    if code != 0 {
        return Err(mallctl_error(key, code));
    }
    Ok(Stats {
        allocated: read(c"stats.allocated")?,
        active: read(c"stats.active")?,
        resident: read(c"stats.resident")?,
        mapped: read(c"stats.mapped")?,
        retained: read(c"stats.retained")?,
    })
}

/// Whether jemalloc keeps unused virtual memory mapped (`opt.retain`).
///
/// # Errors
/// `mallctl` fails.
pub fn retain_enabled() -> Result<bool> {
    read::<bool>(c"opt.retain")
}
