//! What the readers of every mode share: one destination of a batched read
//! ([`Segment`]) and a file's name for messages ([`path_of`]). A leaf: the buffered
//! reader ([`super::read`]) and the direct one ([`super::direct`]) both use it, and
//! neither the other through it.

use std::fs::File;
use std::os::fd::AsRawFd;

/// One destination of a batch: `dest.len()` bytes of `file` at `offset`.
pub(crate) struct Segment<'f, 'd> {
    pub(crate) file: &'f File,
    pub(crate) offset: u64,
    pub(crate) dest: &'d mut [u8],
}

/// The file's path as `/proc/self/fd` names it, for error messages (`fd N` without
/// procfs, or for a descriptor that has no path).
pub(crate) fn path_of(file: &File) -> String {
    let fd = file.as_raw_fd();
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map_or_else(|_| format!("fd {fd}"), |p| p.display().to_string())
}
