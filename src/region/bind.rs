//! `mbind` for regions and for memory other crates own.

use std::ffi::c_void;
use std::ops::Range;

use numapin_sys as sys;

use super::{Backing, Region};
use crate::calls::{MempolicySupport, NumaCall};
use crate::error::{Errno, Error, Result};
use crate::page::page_size;
use crate::policy::{MbindFlags, MemPolicy, ModeFlags, Placement};

impl Region {
    /// Sets the memory policy of the whole region (`mbind(2)`). Bind before the first
    /// touch with no flags; `MOVE` is for pages that already exist.
    ///
    /// # Errors
    /// The region is a shared file mapping (the page cache ignores VMA policy), the policy
    /// has an empty node set, `MOVE_ALL` without `CAP_SYS_NICE` (`EPERM`), or any errno
    /// but `EPERM`/`ENOSYS` (which give [`Placement::Degraded`]). Checked before the call,
    /// so in every environment (never `Degraded`): `flags` or mode flags with bits the
    /// kernel refuses, a node this machine cannot have (the error names it and the
    /// machine's nodes), or a policy with no node this process may allocate on
    /// ([`Error::NodeNotAllowed`]).
    #[doc(alias = "mbind")]
    pub fn bind(&self, policy: &MemPolicy, flags: MbindFlags) -> Result<Placement> {
        self.bind_with(policy, ModeFlags::empty(), flags)
    }

    /// [`Region::bind`] with mode flags (`STATIC_NODES`, ...).
    ///
    /// # Errors
    /// As [`Region::bind`].
    pub fn bind_with(
        &self,
        policy: &MemPolicy,
        mode_flags: ModeFlags,
        flags: MbindFlags,
    ) -> Result<Placement> {
        if let Backing::File = self.backing {
            return Err(Error::wrong_backing(
                "mbind",
                "the region is a shared file mapping, placed by the page cache, which ignores \
                 VMA policy: pages stay where they were first read",
                "an anonymous or memfd region: copy the data into one bound before the copy",
            ));
        }
        // SAFETY: the whole range is this region's own mapping; MOVE flags only migrate
        // pages, keeping their contents.
        unsafe { mbind_checked(self.as_ptr().cast(), self.len, policy, mode_flags, flags) }
    }

    /// Sets the memory policy of part of the region (`mbind(2)` over `range`, whose ends
    /// must be page-aligned offsets): a region bound block by block, each block to its
    /// own node, costs one mapping per block.
    ///
    /// # Errors
    /// The range is not page-aligned or not inside the region, or as [`Region::bind`].
    #[doc(alias = "mbind")]
    pub fn bind_part(
        &self,
        range: Range<usize>,
        policy: &MemPolicy,
        flags: MbindFlags,
    ) -> Result<Placement> {
        let page = crate::page::page_size();
        self.check_range("mbind", &range)?;
        for (what, value) in [("start", range.start), ("end", range.end)] {
            if !value.is_multiple_of(page) {
                return Err(Error::misaligned("mbind", what, value, page));
            }
        }
        if let Backing::File = self.backing {
            return self.bind(policy, flags);
        }
        // SAFETY: the range was checked to lie inside this region's own mapping; MOVE
        // flags only migrate pages, keeping their contents.
        unsafe {
            mbind_checked(
                self.as_ptr().add(range.start).cast(),
                range.end - range.start,
                policy,
                ModeFlags::empty(),
                flags,
            )
        }
    }
}

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
/// anything [`crate::Region::bind`] refuses before the call (unknown flag bits, nodes that
/// cannot exist or that this process may not use; in every environment),
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
        return Err(Error::misaligned(
            "bind_range",
            "address",
            ptr as usize,
            page,
        ));
    }
    if (ptr as usize).checked_add(len).is_none() {
        return Err(Error::overflow(
            "bind_range",
            format!("address {ptr:p} + len {len}"),
        ));
    }
    refuse_page_cache(ptr as usize, len)?;
    // SAFETY: forwarded from the caller.
    unsafe { mbind_checked(ptr.cast(), len, policy, ModeFlags::empty(), flags) }
}

/// The answer [`crate::Region::bind`] gives a shared file mapping, for memory other crates
/// own: a `MAP_SHARED` mapping of a regular file is placed by the page cache, which
/// ignores VMA policy, so binding it would return `Bound` and place nothing. Shared memory
/// (memfd, SysV, tmpfs, hugetlbfs) keeps a shared policy and is fine.
fn refuse_page_cache(start: usize, len: usize) -> Result<()> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    let end = start.saturating_add(len);
    for (vma_start, vma_end, path) in shared_file_mappings(start, end)? {
        if path.starts_with("/memfd:") || path.starts_with("/SYSV") {
            continue;
        }
        let live = path.strip_suffix(" (deleted)").unwrap_or(&path);
        // f_type's integer type differs between architectures.
        #[allow(clippy::unnecessary_cast)]
        let fs = rustix::fs::statfs(live).map(|s| s.f_type as i64);
        if matches!(fs, Ok(TMPFS_MAGIC | HUGETLBFS_MAGIC)) {
            continue;
        }
        return Err(Error::wrong_backing(
            "bind_range",
            format!(
                "{vma_start:#x}-{vma_end:#x} is a shared mapping of {path:?}, a file placed by \
                 the page cache, which ignores VMA policy: pages stay where they were first \
                 read"
            ),
            "anonymous or memfd memory: copy the data into some bound before the copy",
        ));
    }
    Ok(())
}

/// The `MAP_SHARED` file mappings overlapping `[start, end)`: `(start, end, path)`. Asks
/// the kernel about just these addresses with `PROCMAP_QUERY` (Linux 6.11) — one ioctl
/// per mapping in the range whatever the process's map count, which matters to a caller
/// binding tens of thousands of slabs one by one — and on older kernels lists
/// `/proc/self/map_files`, reading `/proc/self/maps` only for a file-backed range.
fn shared_file_mappings(start: usize, end: usize) -> Result<Vec<(usize, usize, String)>> {
    if let Some(found) = procmap_query(start, end) {
        return Ok(found);
    }
    // Before 6.11: list the file-backed mappings first (cheap), and read the maps file
    // only when one of them overlaps the range.
    if let Ok(ranges) = crate::diag::file_backed_ranges()
        && !ranges.iter().any(|&(a, b)| a < end && start < b)
    {
        return Ok(Vec::new());
    }
    Ok(crate::diag::maps_entries_in(start, end)?
        .into_iter()
        .filter(|e| e.is_shared() && e.inode != 0)
        .map(|e| (e.start, e.end, e.path.unwrap_or_default()))
        .collect())
}

/// `PROCMAP_QUERY` over `[start, end)`: `None` when the kernel does not know the ioctl (or
/// `/proc` cannot be opened), so the caller falls back to reading the maps file.
fn procmap_query(start: usize, end: usize) -> Option<Vec<(usize, usize, String)>> {
    use linux_raw_sys::general::procmap_query_flags::{
        PROCMAP_QUERY_COVERING_OR_NEXT_VMA, PROCMAP_QUERY_VMA_SHARED,
    };
    use numapin_sys::procmap_query;
    use std::os::fd::AsRawFd;
    // Opened per call, not cached: after a fork, a cached /proc/self/maps would still
    // describe the parent.
    let maps = std::fs::File::open("/proc/self/maps").ok()?;
    let mut found = Vec::new();
    let mut name = vec![0u8; 4096 + 64];
    let mut addr = start;
    while addr < end {
        // SAFETY: procmap_query is plain old data; all-zero is a valid value.
        let mut q: procmap_query = unsafe { std::mem::zeroed() };
        q.size = std::mem::size_of::<procmap_query>() as u64;
        // Every mapping from `addr` on, not only shared file ones: a filter makes the
        // kernel walk past every other mapping to the next match (tens of thousands in a
        // process binding slab by slab), while this costs one ioctl per mapping in range.
        q.query_flags = u64::from(PROCMAP_QUERY_COVERING_OR_NEXT_VMA as u32);
        q.query_addr = addr as u64;
        q.vma_name_addr = name.as_mut_ptr() as u64;
        q.vma_name_size = name.len() as u32;
        // SAFETY: `q` is a valid procmap_query whose `size` says so; the kernel writes at
        // most `vma_name_size` bytes of the name into `name`, which outlives the call.
        let asked = unsafe { numapin_sys::ioctl_procmap_query(maps.as_raw_fd(), &mut q) };
        if let Err(errno) = asked {
            return match errno {
                // No mapping at or after `addr`.
                numapin_sys::Errno::NOENT => Some(found),
                // ENOTTY/EINVAL: a kernel before 6.11.
                _ => None,
            };
        }
        let (vma_start, vma_end) = (q.vma_start as usize, q.vma_end as usize);
        if vma_start >= end || vma_end <= addr {
            break;
        }
        let shared = q.vma_flags & u64::from(PROCMAP_QUERY_VMA_SHARED as u32) != 0;
        if shared && q.inode != 0 {
            let len = (q.vma_name_size as usize).min(name.len());
            let text = name[..len].split(|&b| b == 0).next().unwrap_or(&[]);
            found.push((
                vma_start,
                vma_end,
                String::from_utf8_lossy(text).into_owned(),
            ));
        }
        addr = vma_end;
    }
    Some(found)
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
    crate::policy::check_policy_call("mbind", policy, mode_flags)?;
    crate::policy::check_mbind_flags(flags)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn procmap_query_agrees_with_the_maps_file() {
        let path = std::env::temp_dir().join(format!("numapin-pmq-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 3 * page_size()]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a new read-only shared mapping of our own file, unmapped below.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                3 * page_size(),
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::SHARED,
                &file,
                0,
            )
        }
        .unwrap();
        let (start, end) = (ptr as usize, ptr as usize + 3 * page_size());
        let from_file: Vec<(usize, usize, String)> = crate::diag::maps_entries_in(start, end)
            .unwrap()
            .into_iter()
            .filter(|e| e.is_shared() && e.inode != 0)
            .map(|e| (e.start, e.end, e.path.unwrap_or_default()))
            .collect();
        assert_eq!(from_file.len(), 1, "{from_file:?}");
        assert_eq!(from_file[0].2, path.display().to_string());
        match procmap_query(start, end) {
            Some(found) => assert_eq!(found, from_file),
            None => println!("NOT RUN: PROCMAP_QUERY needs Linux 6.11; the maps file served"),
        }
        // Anonymous memory has no shared file mapping.
        let anon = crate::region::Region::anonymous(page_size()).unwrap();
        let a = anon.as_ptr() as usize;
        assert!(shared_file_mappings(a, a + page_size()).unwrap().is_empty());
        // SAFETY: unmapping the mapping made above.
        unsafe { rustix::mm::munmap(ptr, 3 * page_size()) }.unwrap();
        std::fs::remove_file(&path).unwrap();
    }
}
