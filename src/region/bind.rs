//! `mbind` for regions and for memory other crates own.

use std::ffi::c_void;

use numapin_sys as sys;

use crate::error::{Errno, Error, Result};
use crate::page_size;
use crate::policy::{MbindFlags, MemPolicy, ModeFlags, Placement};
use crate::probe::{MempolicySupport, NumaCall};

/// Sets the memory policy of memory another crate owns (`mbind(2)`), checking alignment
/// first so that a misaligned pointer is a clear error, not the kernel's bare `EINVAL`.
///
/// # Safety
///
/// `[ptr, ptr + len)` must be memory the caller may re-place: a policy outlives the
/// caller's use of the memory (an allocator reusing bound pages keeps the policy), and
/// `MOVE` flags migrate pages that others may be using (contents are preserved).
///
/// # Errors
/// `ptr` is not page-aligned, `len` overflows, the range is a shared mapping of a regular
/// file (placed by the page cache, which ignores the policy), the policy has an empty set,
/// [`Error::MissingCapability`] for `MOVE_ALL` without `CAP_SYS_NICE`, or `mbind` fails
/// with an errno other than `EPERM`/`ENOSYS` where the probe found the policy calls
/// denied or unsupported (those give [`Placement::Degraded`]).
#[doc(alias = "mbind")]
pub unsafe fn bind_range(
    ptr: *mut u8,
    len: usize,
    policy: &MemPolicy,
    flags: MbindFlags,
) -> Result<Placement> {
    let page = page_size();
    if !(ptr as usize).is_multiple_of(page) {
        return Err(Error::invalid(
            "bind_range",
            format!("address {ptr:p} is not aligned to the page size {page}"),
        ));
    }
    if (ptr as usize).checked_add(len).is_none() {
        return Err(Error::invalid(
            "bind_range",
            format!("address {ptr:p} + len {len} overflows"),
        ));
    }
    refuse_page_cache(ptr as usize, len)?;
    // SAFETY: forwarded from the caller.
    unsafe { mbind_checked(ptr.cast(), len, policy, ModeFlags::empty(), flags) }
}

/// The answer [`crate::Region::bind`] gives a shared file mapping, for memory other crates
/// own: a `MAP_SHARED` mapping of a regular file is placed by the page cache, which
/// ignores VMA policy, so binding it would return `Bound` and place nothing. Shared memory
/// (memfd, SysV, tmpfs, hugetlbfs) keeps a shared policy and is fine. `/proc/self/maps`
/// tells the backing of the range.
fn refuse_page_cache(start: usize, len: usize) -> Result<()> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    let end = start.saturating_add(len);
    for entry in crate::diag::maps_entries_in(start, end)? {
        if !entry.is_shared() || entry.inode == 0 {
            continue;
        }
        let path = entry.path.as_deref().unwrap_or("");
        if path.starts_with("/memfd:") || path.starts_with("/SYSV") {
            continue;
        }
        let live = path.strip_suffix(" (deleted)").unwrap_or(path);
        // f_type's integer type differs between architectures.
        #[allow(clippy::unnecessary_cast)]
        let fs = rustix::fs::statfs(live).map(|s| s.f_type as i64);
        if matches!(fs, Ok(TMPFS_MAGIC | HUGETLBFS_MAGIC)) {
            continue;
        }
        return Err(Error::invalid(
            "bind_range",
            format!(
                "{:#x}-{:#x} is a shared mapping of {path:?}, a file placed by the page cache, \
                 which ignores VMA policy: pages stay where they were first read. Copy the \
                 data into anonymous or memfd memory bound before the copy",
                entry.start, entry.end
            ),
        ));
    }
    Ok(())
}

/// `mbind` with validation and errno handling shared by every binding entry point.
///
/// # Safety
/// As [`bind_range`].
pub(crate) unsafe fn mbind_checked(
    addr: *mut c_void,
    len: usize,
    policy: &MemPolicy,
    mode_flags: ModeFlags,
    flags: MbindFlags,
) -> Result<Placement> {
    policy.validate_here()?;
    // Only where the call can run: a profile's denial or a kernel without NUMA degrades
    // whatever the capabilities.
    if flags.contains(MbindFlags::MOVE_ALL)
        && NumaCall::Mbind.support()? == MempolicySupport::Available
        && !crate::capability::sys_nice()
    {
        return Err(crate::capability::missing_sys_nice(
            "mbind",
            "MPOL_MF_MOVE_ALL moves pages other processes share",
        ));
    }
    let mask = policy.kernel_mask();
    let args = || {
        format!(
            "addr={addr:p} len={len} policy={policy} mode_flags={mode_flags:?} flags={flags:?} maxnode={}",
            mask.maxnode()
        )
    };
    // SAFETY: `mask` holds `maxnode / 64` words; the caller vouches for the range.
    let result = unsafe {
        sys::mbind(
            addr,
            len,
            policy.mode() | mode_flags.bits(),
            mask.words().as_ptr(),
            mask.maxnode(),
            flags.bits(),
        )
    };
    // With MOVE_ALL, an EPERM where the probe passed is the kernel's CAP_SYS_NICE check (a
    // capability held in a child user namespace passes the check above but not the
    // kernel's): the helper names the capability; where the probe was denied too it is a
    // container's denial, which degrades.
    if result == Err(Errno::INVAL)
        && let Some(e) = crate::policy::not_allowed("mbind", policy, mode_flags)
    {
        return Err(e);
    }
    Placement::from_call(NumaCall::Mbind, result, args)
}
