//! Raw Linux NUMA memory-policy syscalls.
//!
//! One `unsafe fn` per syscall, mirroring the kernel's arguments. Each function converts
//! nothing it does not have to, makes the call through `libc::syscall`, and reads `errno`
//! right after it (the raw `syscall(2)` wrapper returns `-1` and leaves the code in
//! `errno`; reading the return value as a negative errno is the classic probe bug).
//! Nothing here allocates, retries or interprets an error: that is the typed crate's job.
//! [`cpu`] answers which CPU and node the calling thread runs on (`getcpu`, rseq), safe
//! to call.
//!
//! # The `maxnode` rule
//!
//! `mbind`, `set_mempolicy`, `get_mempolicy` and `migrate_pages` take a node mask as an
//! array of `unsigned long` plus `maxnode`. The kernel reads `maxnode - 1` bits of it
//! (`get_nodes()` in `mm/mempolicy.c` decrements `maxnode` first), while the man pages
//! describe `maxnode` bits. The call that is correct under either reading: size the mask
//! in whole 64-bit words with at least one spare bit above the highest possible node,
//! and pass `maxnode = 64 * words`. `get_mempolicy` additionally fails with `EINVAL`
//! when `maxnode` is below the kernel's possible node count (`nr_node_ids`).
//!
//! # Safety
//!
//! Every function here passes raw pointers to the kernel. The kernel validates user
//! addresses and reports `EFAULT` rather than faulting the process, but some calls
//! *change* memory the caller may hold references to: `madvise(MADV_DONTNEED)` zeroes
//! private pages, `mbind(MPOL_MF_MOVE*)`, `move_pages` and `migrate_pages` move pages
//! (contents preserved, physical location changed). Each function's `# Safety` section
//! names what the caller must guarantee.
//!
//! # References
//! - [`mbind(2)`](https://man7.org/linux/man-pages/man2/mbind.2.html)
//! - [`set_mempolicy(2)`](https://man7.org/linux/man-pages/man2/set_mempolicy.2.html)
//! - [`get_mempolicy(2)`](https://man7.org/linux/man-pages/man2/get_mempolicy.2.html)
//! - [`move_pages(2)`](https://man7.org/linux/man-pages/man2/move_pages.2.html)
//! - [`migrate_pages(2)`](https://man7.org/linux/man-pages/man2/migrate_pages.2.html)
//! - [`madvise(2)`](https://man7.org/linux/man-pages/man2/madvise.2.html)
//! - [`mprotect(2)`](https://man7.org/linux/man-pages/man2/mprotect.2.html)

#![no_std]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

use core::ffi::{c_int, c_long, c_uint, c_ulong, c_void};

pub mod cpu;
mod mapping;

pub use mapping::*;

use linux_raw_sys::general as g;
use linux_raw_sys::mempolicy as mp;
pub use rustix::io::Errno;

/// `MPOL_DEFAULT`: remove a range's policy (fall back to the thread's), or the thread's
/// (fall back to local allocation).
pub const MPOL_DEFAULT: c_int = mp::MPOL_DEFAULT as c_int;
/// `MPOL_PREFERRED`: allocate on one node, fall back to others when it is full.
pub const MPOL_PREFERRED: c_int = mp::MPOL_PREFERRED as c_int;
/// `MPOL_BIND`: allocate only on the given nodes.
pub const MPOL_BIND: c_int = mp::MPOL_BIND as c_int;
/// `MPOL_INTERLEAVE`: allocate page by page round robin over the given nodes.
pub const MPOL_INTERLEAVE: c_int = mp::MPOL_INTERLEAVE as c_int;
/// `MPOL_LOCAL`: allocate on the node of the CPU that faults (since Linux 3.8).
pub const MPOL_LOCAL: c_int = mp::MPOL_LOCAL as c_int;
/// `MPOL_PREFERRED_MANY`: prefer a set of nodes (since Linux 5.15).
pub const MPOL_PREFERRED_MANY: c_int = mp::MPOL_PREFERRED_MANY as c_int;
/// `MPOL_WEIGHTED_INTERLEAVE`: interleave by per-node weights from sysfs (since Linux 6.9).
pub const MPOL_WEIGHTED_INTERLEAVE: c_int = mp::MPOL_WEIGHTED_INTERLEAVE as c_int;
/// One past the highest mode this crate knows; the kernel answers `EINVAL` from here on.
pub const MPOL_MAX: c_int = mp::MPOL_MAX as c_int;

/// `MPOL_F_STATIC_NODES`: mode flag, nodes are not remapped when the cpuset changes.
pub const MPOL_F_STATIC_NODES: c_int = mp::MPOL_F_STATIC_NODES as c_int;
/// `MPOL_F_RELATIVE_NODES`: mode flag, nodes are relative to the allowed set.
pub const MPOL_F_RELATIVE_NODES: c_int = mp::MPOL_F_RELATIVE_NODES as c_int;
/// `MPOL_F_NUMA_BALANCING`: mode flag, let NUMA balancing move pages (since Linux 5.12).
pub const MPOL_F_NUMA_BALANCING: c_int = mp::MPOL_F_NUMA_BALANCING as c_int;
/// Mask of all mode flags, as the kernel strips them from the mode.
pub const MPOL_MODE_FLAGS: c_int = mp::MPOL_MODE_FLAGS as c_int;

/// `get_mempolicy` flag `MPOL_F_NODE`: return a node id instead of a mode.
pub const MPOL_F_NODE: c_ulong = mp::MPOL_F_NODE as c_ulong;
/// `get_mempolicy` flag `MPOL_F_ADDR`: report the policy of the range holding `addr`.
pub const MPOL_F_ADDR: c_ulong = mp::MPOL_F_ADDR as c_ulong;
/// `get_mempolicy` flag `MPOL_F_MEMS_ALLOWED`: return the allowed node set.
pub const MPOL_F_MEMS_ALLOWED: c_ulong = mp::MPOL_F_MEMS_ALLOWED as c_ulong;

/// `mbind` flag `MPOL_MF_STRICT`: fail with `EIO` if existing pages violate the policy.
pub const MPOL_MF_STRICT: c_uint = mp::MPOL_MF_STRICT;
/// `mbind` flag `MPOL_MF_MOVE`: move this process's existing pages to comply.
pub const MPOL_MF_MOVE: c_uint = mp::MPOL_MF_MOVE;
/// `mbind` flag `MPOL_MF_MOVE_ALL`: also move shared pages; needs `CAP_SYS_NICE`.
pub const MPOL_MF_MOVE_ALL: c_uint = mp::MPOL_MF_MOVE_ALL;
/// All `mbind` flags the kernel accepts from user space.
pub const MPOL_MF_VALID: c_uint = mp::MPOL_MF_VALID;

/// `move_pages` flag `MPOL_MF_MOVE` (same value as for `mbind`).
pub const MOVE_PAGES_MOVE: c_int = mp::MPOL_MF_MOVE as c_int;
/// `move_pages` flag `MPOL_MF_MOVE_ALL`; needs `CAP_SYS_NICE`.
pub const MOVE_PAGES_MOVE_ALL: c_int = mp::MPOL_MF_MOVE_ALL as c_int;

/// `MADV_NORMAL`.
pub const MADV_NORMAL: c_int = g::MADV_NORMAL as c_int;
/// `MADV_RANDOM`.
pub const MADV_RANDOM: c_int = g::MADV_RANDOM as c_int;
/// `MADV_SEQUENTIAL`.
pub const MADV_SEQUENTIAL: c_int = g::MADV_SEQUENTIAL as c_int;
/// `MADV_WILLNEED`.
pub const MADV_WILLNEED: c_int = g::MADV_WILLNEED as c_int;
/// `MADV_DONTNEED`: drop the pages; private anonymous memory reads back as zeroes.
pub const MADV_DONTNEED: c_int = g::MADV_DONTNEED as c_int;
/// `MADV_REMOVE`: free a range's backing store (shmem/memfd: punch a hole).
pub const MADV_REMOVE: c_int = g::MADV_REMOVE as c_int;
/// `MADV_HUGEPAGE`: ask for transparent huge pages (since Linux 2.6.38).
pub const MADV_HUGEPAGE: c_int = g::MADV_HUGEPAGE as c_int;
/// `MADV_NOHUGEPAGE` (since Linux 2.6.38).
pub const MADV_NOHUGEPAGE: c_int = g::MADV_NOHUGEPAGE as c_int;
/// `MADV_DONTDUMP` (since Linux 3.4).
pub const MADV_DONTDUMP: c_int = g::MADV_DONTDUMP as c_int;
/// `MADV_DODUMP` (since Linux 3.4).
pub const MADV_DODUMP: c_int = g::MADV_DODUMP as c_int;
/// `MADV_POPULATE_READ`: fault pages in readable (since Linux 5.14).
pub const MADV_POPULATE_READ: c_int = g::MADV_POPULATE_READ as c_int;
/// `MADV_POPULATE_WRITE`: fault pages in writable (since Linux 5.14).
pub const MADV_POPULATE_WRITE: c_int = g::MADV_POPULATE_WRITE as c_int;

/// Turns a raw `syscall(2)` return into a result, reading `errno` on `-1`.
#[inline]
fn check(ret: c_long) -> Result<c_long, Errno> {
    if ret == -1 {
        // SAFETY: `__errno_location` returns this thread's errno slot, always valid.
        let code = unsafe { *libc::__errno_location() };
        Err(Errno::from_raw_os_error(code))
    } else {
        Ok(ret)
    }
}

/// `int mbind(void *addr, unsigned long len, int mode, const unsigned long *nodemask,
/// unsigned long maxnode, unsigned int flags)` — set the memory policy of a range.
///
/// `mode` may carry `MPOL_F_STATIC_NODES` / `MPOL_F_RELATIVE_NODES` / `MPOL_F_NUMA_BALANCING`.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `EINVAL`: `addr` not page-aligned, an unknown mode or flag, an empty mask for a mode
///   that needs nodes, `maxnode` above the kernel's limit, no node of the mask online,
///   in the cpuset and with memory, or both `MPOL_F_STATIC_NODES` and
///   `MPOL_F_RELATIVE_NODES`;
/// - `EFAULT`: the range has unmapped holes, or the mask is not readable;
/// - `ENOMEM`: out of kernel memory, or splitting the range off its mapping would cross
///   `vm.max_map_count` (the per-slab binding failure this project exists for);
/// - `EIO`: `MPOL_MF_STRICT` and pages that are elsewhere (and could not be moved);
/// - `EPERM`: `MPOL_MF_MOVE_ALL` without `CAP_SYS_NICE`, or a seccomp profile;
/// - `ENOSYS`: a kernel built without `CONFIG_NUMA`.
///
/// # Safety
///
/// `nodemask` is null or points to `ceil((maxnode - 1) / 64)` readable words. With
/// `MPOL_MF_MOVE` or `MPOL_MF_MOVE_ALL`, pages in `[addr, addr + len)` may be migrated:
/// contents are preserved, but the caller must not rely on their physical placement.
/// Without those flags the call changes no memory contents.
///
/// # References
/// - [`mbind(2)`](https://man7.org/linux/man-pages/man2/mbind.2.html)
#[inline]
pub unsafe fn mbind(
    addr: *mut c_void,
    len: usize,
    mode: c_int,
    nodemask: *const c_ulong,
    maxnode: c_ulong,
    flags: c_uint,
) -> Result<(), Errno> {
    // SAFETY: the caller upholds the pointer contract above; the kernel validates the
    // range itself and answers EFAULT/EINVAL instead of touching unmapped memory.
    let ret = unsafe {
        libc::syscall(
            g::__NR_mbind as c_long,
            addr,
            len as c_ulong,
            mode as c_long,
            nodemask,
            maxnode,
            flags as c_ulong,
        )
    };
    check(ret).map(drop)
}

/// `long set_mempolicy(int mode, const unsigned long *nodemask, unsigned long maxnode)` —
/// set the calling thread's memory policy.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `EINVAL`: an unknown mode or flag, an empty mask for a mode that needs nodes,
///   `maxnode` above the kernel's limit, no allowed node in the mask, or both
///   `MPOL_F_STATIC_NODES` and `MPOL_F_RELATIVE_NODES`;
/// - `EFAULT`: the mask is not readable;
/// - `ENOMEM`: out of kernel memory;
/// - `EPERM`: a seccomp profile (the call itself checks no capability);
/// - `ENOSYS`: a kernel built without `CONFIG_NUMA`.
///
/// # Safety
///
/// `nodemask` is null or points to `ceil((maxnode - 1) / 64)` readable words. The policy
/// applies to the calling thread only.
///
/// # References
/// - [`set_mempolicy(2)`](https://man7.org/linux/man-pages/man2/set_mempolicy.2.html)
#[inline]
pub unsafe fn set_mempolicy(
    mode: c_int,
    nodemask: *const c_ulong,
    maxnode: c_ulong,
) -> Result<(), Errno> {
    // SAFETY: the caller guarantees `nodemask` covers `maxnode - 1` bits or is null.
    let ret = unsafe {
        libc::syscall(
            g::__NR_set_mempolicy as c_long,
            mode as c_long,
            nodemask,
            maxnode,
        )
    };
    check(ret).map(drop)
}

/// `long get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode,
/// void *addr, unsigned long flags)` — read the thread's or a range's policy.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `EINVAL`: `maxnode` below the kernel's possible node count, unknown flags, `addr`
///   given without `MPOL_F_ADDR` (or missing with it), `MPOL_F_NODE` alone while the
///   thread's policy is not interleave, or `MPOL_F_MEMS_ALLOWED` with another flag;
/// - `EFAULT`: with `MPOL_F_ADDR`, `addr` is not mapped; or an output is not writable;
/// - `EPERM`: a seccomp profile;
/// - `ENOSYS`: a kernel built without `CONFIG_NUMA`.
///
/// # Safety
///
/// `mode` is null or writable; `nodemask` is null or points to `ceil(maxnode / 64)`
/// writable words. With `MPOL_F_ADDR`, `addr` names a mapped address of this process
/// (otherwise the kernel answers `EFAULT`).
///
/// # References
/// - [`get_mempolicy(2)`](https://man7.org/linux/man-pages/man2/get_mempolicy.2.html)
#[inline]
pub unsafe fn get_mempolicy(
    mode: *mut c_int,
    nodemask: *mut c_ulong,
    maxnode: c_ulong,
    addr: *mut c_void,
    flags: c_ulong,
) -> Result<(), Errno> {
    // SAFETY: the caller guarantees the output pointers are null or writable and sized.
    let ret = unsafe {
        libc::syscall(
            g::__NR_get_mempolicy as c_long,
            mode,
            nodemask,
            maxnode,
            addr,
            flags,
        )
    };
    check(ret).map(drop)
}

/// `long set_mempolicy_home_node(unsigned long start, unsigned long len,
/// unsigned long home_node, unsigned long flags)` — set the home node of the
/// `MPOL_BIND` / `MPOL_PREFERRED_MANY` policies of a range (since Linux 5.17).
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `EINVAL`: `start` not page-aligned, `flags` not 0, `home_node` not an online node,
///   or the range wraps around;
/// - `EOPNOTSUPP`: a mapping in the range has a policy other than `MPOL_BIND` or
///   `MPOL_PREFERRED_MANY`;
/// - `ENOMEM`: out of kernel memory, or a split would cross `vm.max_map_count`;
/// - `EPERM`: a seccomp profile;
/// - `ENOSYS`: before Linux 5.17, or a kernel built without `CONFIG_NUMA`.
///
/// # Safety
///
/// Changes no memory contents; the range must belong to this process (else `EFAULT`).
/// It is `unsafe` only because it takes a raw address.
///
/// # References
/// - [`set_mempolicy_home_node(2)`](https://docs.kernel.org/admin-guide/mm/numa_memory_policy.html)
#[inline]
pub unsafe fn set_mempolicy_home_node(
    start: c_ulong,
    len: c_ulong,
    home_node: c_ulong,
    flags: c_ulong,
) -> Result<(), Errno> {
    // SAFETY: plain integers; the kernel validates the range.
    let ret = unsafe {
        libc::syscall(
            g::__NR_set_mempolicy_home_node as c_long,
            start,
            len,
            home_node,
            flags,
        )
    };
    check(ret).map(drop)
}

/// `long move_pages(int pid, unsigned long count, void *pages[.count],
/// const int nodes[.count], int status[.count], int flags)` — move pages or, with a null
/// `nodes`, report the node each page is on without moving or faulting anything in.
///
/// Returns the number of pages that could not be moved (0 when `nodes` is null).
///
/// # Errors
///
/// The kernel's errno for the call as a whole, unchanged (a page that cannot be moved or
/// is not present gets a negative errno in its `status` entry instead):
/// - `ESRCH`: no process `pid`;
/// - `EPERM`: `MPOL_MF_MOVE_ALL`, or another user's process, without `CAP_SYS_NICE`; or a
///   seccomp profile;
/// - `EINVAL`: unknown flags, or `pid` is a kernel thread;
/// - `EACCES`: a target node outside the cpuset; `ENODEV`: a target node not online;
/// - `EFAULT`: an array is not accessible; `E2BIG`: `count` is too large;
/// - `ENOSYS`: a kernel built without `CONFIG_NUMA`.
///
/// # Safety
///
/// `pages` points to `count` readable pointers; `nodes` is null or points to `count`
/// readable ints; `status` points to `count` writable ints. With a non-null `nodes`,
/// pages are migrated (contents preserved).
///
/// # References
/// - [`move_pages(2)`](https://man7.org/linux/man-pages/man2/move_pages.2.html)
#[inline]
pub unsafe fn move_pages(
    pid: c_int,
    count: c_ulong,
    pages: *const *mut c_void,
    nodes: *const c_int,
    status: *mut c_int,
    flags: c_int,
) -> Result<c_long, Errno> {
    // SAFETY: the caller guarantees the three arrays hold `count` elements.
    let ret = unsafe {
        libc::syscall(
            g::__NR_move_pages as c_long,
            pid as c_long,
            count,
            pages,
            nodes,
            status,
            flags as c_long,
        )
    };
    check(ret)
}

/// `long migrate_pages(int pid, unsigned long maxnode, const unsigned long *old_nodes,
/// const unsigned long *new_nodes)` — move all pages of a process from one node set to
/// another. Returns the number of pages that could not be moved.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `ESRCH`: no process `pid`;
/// - `EPERM`: another user's process, or target nodes outside its cpuset, without
///   `CAP_SYS_NICE`; or a seccomp profile;
/// - `EINVAL`: `maxnode` above the kernel's limit, or no allowed node with memory in the
///   masks;
/// - `EFAULT`: a mask is not readable;
/// - `ENOSYS`: a kernel built without `CONFIG_NUMA`.
///
/// # Safety
///
/// Both masks point to `ceil((maxnode - 1) / 64)` readable words. Pages of the target
/// process are migrated (contents preserved).
///
/// # References
/// - [`migrate_pages(2)`](https://man7.org/linux/man-pages/man2/migrate_pages.2.html)
#[inline]
pub unsafe fn migrate_pages(
    pid: c_int,
    maxnode: c_ulong,
    old_nodes: *const c_ulong,
    new_nodes: *const c_ulong,
) -> Result<c_long, Errno> {
    // SAFETY: the caller guarantees both masks are sized for `maxnode`.
    let ret = unsafe {
        libc::syscall(
            g::__NR_migrate_pages as c_long,
            pid as c_long,
            maxnode,
            old_nodes,
            new_nodes,
        )
    };
    check(ret)
}

/// `int madvise(void *addr, size_t len, int advice)` — advise the kernel about a range.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `EINVAL`: `addr` not page-aligned, advice this kernel does not know (e.g.
///   `MADV_POPULATE_WRITE` before Linux 5.14), or advice that cannot apply to the
///   mapping (`MADV_DONTNEED` on locked or `VM_PFNMAP` pages, `MADV_HUGEPAGE` without
///   THP);
/// - `ENOMEM`: part of the range is not mapped, or populating ran out of memory;
/// - `EFAULT`: `MADV_POPULATE_*` would have raised `SIGBUS` (e.g. past the end of a
///   file or a full hugetlbfs pool);
/// - `EAGAIN`, `EINTR`, `EIO`, `EHWPOISON`: transient, interrupted, over the RSS
///   limit, poisoned memory;
/// - `EPERM`: a seccomp profile, or a sealed or privileged operation.
///
/// # Safety
///
/// `[addr, addr + len)` belongs to the caller. Some advice changes contents:
/// `MADV_DONTNEED` (and `MADV_FREE`, `MADV_REMOVE`) make private pages read back as
/// zeroes, so no live reference may read that range expecting the old bytes.
///
/// # References
/// - [`madvise(2)`](https://man7.org/linux/man-pages/man2/madvise.2.html)
#[inline]
pub unsafe fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> Result<(), Errno> {
    // SAFETY: the caller owns the range and accepts the advice's effect on contents.
    let ret = unsafe { libc::syscall(g::__NR_madvise as c_long, addr, len, advice as c_long) };
    check(ret).map(drop)
}
