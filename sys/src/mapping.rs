//! The calls about mappings that are not memory policy: protection (`mprotect`),
//! anonymous names (`prctl(PR_SET_VMA)`), and what is resident or mapped where
//! (`mincore`, the `PROCMAP_QUERY` ioctl, `cachestat`). Re-exported at the crate root.

use core::ffi::{c_int, c_long, c_uint, c_ulong, c_void};

use linux_raw_sys::general as g;
use rustix::io::Errno;

use super::check;

/// `PROT_READ`: pages may be read.
pub const PROT_READ: c_int = g::PROT_READ as c_int;
/// `PROT_WRITE`: pages may be written.
pub const PROT_WRITE: c_int = g::PROT_WRITE as c_int;
/// `PROT_NONE`: pages may not be accessed.
pub const PROT_NONE: c_int = g::PROT_NONE as c_int;

/// `int mprotect(void *addr, size_t len, int prot)` — sets the access protection of the
/// pages of a range (a write to a page without `PROT_WRITE` raises `SIGSEGV`).
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `EINVAL`: `addr` not page-aligned, or `prot` has bits the kernel does not know;
/// - `ENOMEM`: part of the range is not mapped, or the change would split a mapping
///   beyond `vm.max_map_count`;
/// - `EACCES`: the protection asked is more than the mapping allows (`PROT_WRITE` on a
///   file opened read-only, or on a memfd sealed against writing);
/// - `EPERM`: a seccomp profile, or `PROT_EXEC` where the system forbids it.
///
/// # Safety
///
/// `[addr, addr + len)` belongs to the caller. Removing `PROT_WRITE` (or `PROT_READ`)
/// makes a later write (or read) of the range fault: no live reference may write (or
/// read) it meanwhile.
///
/// # References
/// - [`mprotect(2)`](https://man7.org/linux/man-pages/man2/mprotect.2.html)
#[inline]
pub unsafe fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> Result<(), Errno> {
    // SAFETY: the caller owns the range and keeps references within the new protection.
    let ret = unsafe { libc::syscall(g::__NR_mprotect as c_long, addr, len, prot as c_long) };
    check(ret).map(drop)
}

/// `PR_SET_VMA` (since Linux 5.17): the `prctl` option that names anonymous mappings.
pub const PR_SET_VMA: c_int = 0x5356_4d41;
/// `PR_SET_VMA_ANON_NAME`: the `PR_SET_VMA` sub-option that sets the name.
pub const PR_SET_VMA_ANON_NAME: c_ulong = 0;
/// The kernel's `ANON_VMA_NAME_MAX_LEN`: a name and its NUL fit in 80 bytes.
pub const ANON_VMA_NAME_MAX_LEN: usize = 80;

/// `prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, addr, len, name)` — names the anonymous
/// mappings in `[addr, addr + len)`; `/proc/PID/maps` then shows `[anon:name]`. A null
/// `name` removes the name.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `EINVAL`: a kernel built without `CONFIG_ANON_VMA_NAME` (or before 5.17), `addr`
///   not page-aligned, a name of 80 bytes or more, or a byte that is not printable or is
///   one of `[ ] \ $` and backtick;
/// - `ENOMEM`: part of the range is not mapped;
/// - `EBADF`: part of the range is a file mapping (only anonymous memory can be named);
/// - `EFAULT`: `name` is not readable.
///
/// # Safety
///
/// `name` is null or points to a NUL-terminated string. The call changes no memory; the
/// range is only split or merged by name.
///
/// # References
/// - [`PR_SET_VMA(2const)`](https://man7.org/linux/man-pages/man2/PR_SET_VMA.2const.html)
#[doc(alias = "PR_SET_VMA_ANON_NAME")]
#[inline]
pub unsafe fn prctl_set_vma_anon_name(
    addr: *mut c_void,
    len: usize,
    name: *const core::ffi::c_char,
) -> Result<(), Errno> {
    // SAFETY: the kernel reads at most ANON_VMA_NAME_MAX_LEN bytes of `name`, which the
    // caller guarantees is null or NUL-terminated, and changes no memory.
    let ret = unsafe {
        libc::syscall(
            g::__NR_prctl as c_long,
            PR_SET_VMA as c_long,
            PR_SET_VMA_ANON_NAME,
            addr,
            len,
            name,
        )
    };
    check(ret).map(drop)
}

/// `int mincore(void *addr, size_t len, unsigned char *vec)` — which pages of a range
/// are resident: bit 0 of `vec[i]` for page `i`.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `EINVAL`: `addr` is not page-aligned;
/// - `ENOMEM`: part of the range is not mapped, or `addr + len` overflows;
/// - `EFAULT`: `vec` is not writable;
/// - `EAGAIN`: the kernel was short of memory.
///
/// # Safety
///
/// `vec` points to at least `len.div_ceil(page size)` writable bytes. The call only reads
/// page tables; it faults nothing in and changes no memory of the range.
///
/// # References
/// - [`mincore(2)`](https://man7.org/linux/man-pages/man2/mincore.2.html)
#[inline]
pub unsafe fn mincore(addr: *mut c_void, len: usize, vec: *mut u8) -> Result<(), Errno> {
    // SAFETY: the caller guarantees `vec` holds a byte per page of the range.
    let ret = unsafe { libc::syscall(g::__NR_mincore as c_long, addr, len, vec) };
    check(ret).map(drop)
}

/// `_IOWR('f', 17, struct procmap_query)`: the `PROCMAP_QUERY` ioctl of `/proc/PID/maps`.
pub const PROCMAP_QUERY: c_ulong = 0xC068_6611;

/// `struct procmap_query` (Linux 6.11): one `PROCMAP_QUERY` request and its answer.
pub use linux_raw_sys::general::procmap_query;

/// `int ioctl(int fd, PROCMAP_QUERY, struct procmap_query *q)` — asks `/proc/PID/maps`
/// (`fd`) about the mapping at or after `q.query_addr` (since Linux 6.11): its range,
/// flags, inode and, into `q.vma_name_addr`, its name.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `ENOENT`: no mapping matches at or after the address;
/// - `ENOTTY`, `EINVAL`: a kernel before 6.11, or a `size` it does not know;
/// - `E2BIG`: `vma_name_size` is too small for the name;
/// - `EFAULT`: `q` or the name buffer is not writable.
///
/// # Safety
///
/// `q` points to a valid `procmap_query` whose `size` is its size, and `vma_name_addr`
/// is null (with size 0) or points to `vma_name_size` writable bytes.
///
/// # References
/// - [`PROCMAP_QUERY` in `Documentation/filesystems/proc.rst`](https://docs.kernel.org/filesystems/proc.html)
#[doc(alias = "PROCMAP_QUERY")]
#[inline]
pub unsafe fn ioctl_procmap_query(fd: c_int, q: *mut procmap_query) -> Result<(), Errno> {
    // SAFETY: the caller guarantees `q` and its name buffer; the kernel writes only there.
    let ret = unsafe { libc::syscall(g::__NR_ioctl as c_long, fd as c_long, PROCMAP_QUERY, q) };
    check(ret).map(drop)
}

/// `struct cachestat_range` (Linux 6.5): `len` bytes at `off`; `len` 0 reaches the end of
/// the file.
pub use linux_raw_sys::general::cachestat_range;

/// `struct cachestat` (Linux 6.5): pages of a range in the page cache (`nr_cache`),
/// dirty, under writeback, evicted and recently evicted.
pub use linux_raw_sys::general::cachestat;

/// `int cachestat(unsigned int fd, struct cachestat_range *range, struct cachestat
/// *cstat, unsigned int flags)` — how many pages of a file's range are in the page cache
/// (since Linux 6.5). `flags` must be 0.
///
/// # Errors
///
/// The kernel's errno, unchanged:
/// - `ENOSYS`: a kernel before 6.5 (or a filter that answers so);
/// - `EBADF`: `fd` is not an open descriptor;
/// - `EOPNOTSUPP`: `fd` is a hugetlbfs file;
/// - `EINVAL`: `flags` is not 0;
/// - `EFAULT`: `range` or `cstat` is not accessible.
///
/// # Safety
///
/// `range` points to a readable `cachestat_range` and `cstat` to a writable `cachestat`;
/// the call reads the first and writes only the second.
///
/// # References
/// - [`cachestat(2)`](https://man7.org/linux/man-pages/man2/cachestat.2.html)
#[inline]
pub unsafe fn cachestat(
    fd: c_int,
    range: *const cachestat_range,
    cstat: *mut cachestat,
    flags: c_uint,
) -> Result<(), Errno> {
    // SAFETY: the caller guarantees `range` and `cstat`; the kernel writes only `cstat`.
    let ret = unsafe {
        libc::syscall(
            g::__NR_cachestat as c_long,
            fd as c_long,
            range,
            cstat,
            flags as c_long,
        )
    };
    check(ret).map(drop)
}
