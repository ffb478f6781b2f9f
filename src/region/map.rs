//! Making a region: anonymous (plain, aligned, fenced between guard pages) and read-only
//! file mappings.

use std::ffi::c_void;
use std::fs::File;
use std::os::fd::AsFd;

use rustix::mm::{MapFlags, ProtFlags};

use super::{Backing, Region};
use crate::error::{Error, Result};
use crate::page::page_size;

impl Region {
    /// A private anonymous mapping of `len` bytes rounded up to whole pages.
    ///
    /// # Errors
    /// `len` is 0 or overflows when rounded, or `mmap` fails.
    #[doc(alias = "mmap")]
    pub fn anonymous(len: usize) -> Result<Region> {
        let len = round_len("Region::anonymous", len, page_size())?;
        Ok(Region::owned(map_anonymous(len)?, len, Backing::Anonymous))
    }

    /// A private anonymous mapping whose start is a multiple of `align` (a power of two,
    /// at least the page size), e.g. 2 MiB so transparent huge pages can back it whole.
    /// Over-maps by `align` and unmaps the excess.
    ///
    /// # Errors
    /// `len` is 0, `align` is not a power of two ≥ the page size, sizes overflow, or `mmap`
    /// fails.
    pub fn anonymous_aligned(len: usize, align: usize) -> Result<Region> {
        const OP: &str = "Region::anonymous_aligned";
        check_align(OP, align)?;
        let page = page_size();
        let len = round_len(OP, len, page)?;
        let span = len
            .checked_add(align)
            .ok_or_else(|| Error::overflow(OP, format!("len {len} + align {align}")))?;
        let base = map_anonymous(span)?;
        let start = (base as usize).next_multiple_of(align);
        let head = start - base as usize;
        let tail = span - head - len;
        // SAFETY: head and tail are page-aligned pieces of the mapping just made that no
        // one references; unmapping them leaves exactly [start, start + len).
        unsafe {
            if head > 0 {
                let _ = rustix::mm::munmap(base, head);
            }
            if tail > 0 {
                let _ = rustix::mm::munmap((start + len) as *mut c_void, tail);
            }
        }
        Ok(Region::owned(start as *mut c_void, len, Backing::Anonymous))
    }

    /// A private anonymous mapping of `len` bytes (rounded up to whole pages) kept apart
    /// from every other mapping: an inaccessible (`PROT_NONE`) guard page right before it
    /// and one right after it, made in the same `mmap` and unmapped with it.
    ///
    /// A plain anonymous mapping merges with a neighbour that has the same flags and
    /// policy — any thread's, at any time — and `/proc/self/numa_maps` and `smaps` then
    /// report the two as one: the region's pages can no longer be told apart
    /// ([`NodeHistogram::merged`](super::NodeHistogram::merged)). That matters where `move_pages` is denied (Docker
    /// with `CAP_SYS_NICE`) and placement is read from `numa_maps`, and wherever the
    /// policy cannot tell the mappings apart (an unbound region, or `mbind` denied). The
    /// guards cannot merge with the region (another protection), so its figures are its
    /// own. The price is two more mappings and two pages of address space (no memory).
    ///
    /// # Errors
    /// `len` is 0 or overflows with the guards, or `mmap`/`mprotect` fails.
    ///
    /// # Example
    /// ```
    /// let region = numapin::Region::anonymous_fenced(4 * numapin::page_size())?;
    /// let (start, end) = (region.as_ptr() as usize, region.as_ptr() as usize + region.len());
    /// let maps = numapin::diag::maps_entries_in(start, end)?;
    /// // One mapping, exactly the region: nothing merged into it.
    /// assert_eq!((maps.len(), maps[0].start, maps[0].end), (1, start, end));
    /// # Ok::<(), numapin::Error>(())
    /// ```
    #[doc(alias = "mmap")]
    #[doc(alias = "PROT_NONE")]
    pub fn anonymous_fenced(len: usize) -> Result<Region> {
        map_fenced("Region::anonymous_fenced", len, page_size())
    }

    /// [`Region::anonymous_fenced`] whose start is a multiple of `align` (a power of two,
    /// at least the page size), as [`Region::anonymous_aligned`].
    ///
    /// # Errors
    /// `len` is 0, `align` is not a power of two ≥ the page size, sizes overflow, or
    /// `mmap`/`mprotect` fails.
    pub fn anonymous_fenced_aligned(len: usize, align: usize) -> Result<Region> {
        const OP: &str = "Region::anonymous_fenced_aligned";
        check_align(OP, align)?;
        map_fenced(OP, len, align)
    }

    /// A read-only shared mapping of `len` bytes of `file` from `offset` (page-aligned).
    /// Such pages belong to the page cache: [`Region::bind`] refuses them (copy into an
    /// anonymous or memfd region to place data).
    ///
    /// # Safety
    ///
    /// The region hands out `&[u8]` over the file's pages. While the region lives, no one
    /// — this process or another — may truncate the file below `offset + len` (reading
    /// the lost pages raises SIGBUS) or write to that range of it (the bytes would change
    /// under a shared borrow, which Rust assumes cannot happen; the optimiser may then
    /// return stale values). This is memmap2's contract for `Mmap::map`. For memory that
    /// must be shared safely, use a memfd sealed with `F_SEAL_WRITE | F_SEAL_SHRINK |
    /// F_SEAL_GROW` and [`Region::attach_shared`], which checks the seals.
    ///
    /// # Errors
    /// `len` is 0, `offset` is not page-aligned, the range runs past the end of the file
    /// (touching it would raise SIGBUS), or `mmap` fails.
    ///
    /// # Example
    /// A safe function cannot map a file: the call needs `unsafe` and its contract.
    /// ```compile_fail,E0133
    /// let file = std::fs::File::open("/proc/self/exe").unwrap();
    /// let region = numapin::Region::map_file(&file, 0, 4096).unwrap();
    /// ```
    /// ```no_run
    /// let file = std::fs::File::open("/etc/hostname").unwrap();
    /// // SAFETY: nothing truncates or writes /etc/hostname while `region` lives.
    /// let region = unsafe { numapin::Region::map_file(&file, 0, 4)? };
    /// println!("{:?}", &region.as_slice()[..4]);
    /// # Ok::<(), numapin::Error>(())
    /// ```
    pub unsafe fn map_file(file: &File, offset: u64, len: usize) -> Result<Region> {
        let (ptr, map_len) =
            map_read_only("Region::map_file", file, offset, len, MapFlags::SHARED)?;
        let mut region = Region::owned(ptr, map_len, Backing::File);
        region.len = len;
        Ok(region)
    }
}

/// A private anonymous read-write region of `len` bytes starting at a multiple of `align`
/// (a power of two ≥ the page size), with an inaccessible guard page right before and
/// right after it: one `PROT_NONE` mapping, trimmed to the guards and opened in the middle.
fn map_fenced(op: &'static str, len: usize, align: usize) -> Result<Region> {
    let page = page_size();
    let len = round_len(op, len, page)?;
    let span = len
        .checked_add(2 * page)
        .and_then(|l| l.checked_add(align - page))
        .ok_or_else(|| {
            Error::overflow(op, format!("len {len} + align {align} + two guard pages"))
        })?;
    // SAFETY: a fresh inaccessible anonymous mapping at an address the kernel picks;
    // nothing references it.
    let base = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            span,
            ProtFlags::empty(),
            MapFlags::PRIVATE,
        )
    }
    .map_err(|e| {
        Error::os(
            "mmap",
            e,
            format_args!("{op}: len={span} PROT_NONE private"),
        )
    })? as usize;
    let start = (base + page).next_multiple_of(align);
    let (head, tail) = (start - page - base, base + span - (start + len + page));
    // SAFETY: pieces of the mapping just made, outside the region and its guards;
    // nothing references them.
    unsafe {
        if head > 0 {
            let _ = rustix::mm::munmap(base as *mut c_void, head);
        }
        if tail > 0 {
            let _ = rustix::mm::munmap((start + len + page) as *mut c_void, tail);
        }
    }
    // SAFETY: the middle of the mapping just made, which nothing references; it becomes
    // read-write, a mapping of its own between the two guards.
    let opened = unsafe {
        rustix::mm::mprotect(
            start as *mut c_void,
            len,
            rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE,
        )
    };
    if let Err(e) = opened {
        // SAFETY: what is left of the mapping made above, referenced by nothing.
        let _ = unsafe { rustix::mm::munmap((start - page) as *mut c_void, len + 2 * page) };
        return Err(Error::os(
            "mprotect",
            e,
            format_args!("{op}: addr={start:#x} len={len} PROT_READ|PROT_WRITE"),
        ));
    }
    let mut region = Region::owned(start as *mut c_void, len, Backing::Anonymous);
    region.fence = page;
    Ok(region)
}

/// A fresh private anonymous read-write mapping of `len` (page-multiple) bytes.
pub(super) fn map_anonymous(len: usize) -> Result<*mut c_void> {
    // SAFETY: a fresh anonymous mapping aliases nothing.
    unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }
    .map_err(|e| Error::os("mmap", e, format_args!("len={len} anonymous private")))
}

/// Maps `len` bytes of `file` from `offset` read-only and shared, after checking what
/// would otherwise be a bare `EINVAL` or a later SIGBUS: an unaligned offset, a zero
/// length, a range past the end of the file. Returns the address and the mapped length.
pub(super) fn map_read_only(
    op: &'static str,
    file: &File,
    offset: u64,
    len: usize,
    flags: MapFlags,
) -> Result<(*mut c_void, usize)> {
    let page = page_size();
    if !offset.is_multiple_of(page as u64) {
        return Err(Error::misaligned(op, "offset", offset, page));
    }
    if len == 0 {
        return Err(Error::empty(op, "bytes to map (length 0)"));
    }
    let size = file
        .metadata()
        .map_err(|e| Error::io("fstat", "mapped file", e))?
        .len();
    match offset.checked_add(len as u64) {
        None => return Err(Error::overflow(op, format!("offset {offset} + len {len}"))),
        Some(end) if end > size => {
            return Err(Error::out_of_bounds(
                op,
                "range",
                offset..end,
                size,
                "the file",
            ));
        }
        Some(_) => {}
    }
    let map_len = round_len(op, len, page)?;
    // SAFETY: a new read-only mapping at an address the kernel picks; no slice of it
    // exists yet. Whether its bytes can change later is the caller's concern: map_file is
    // unsafe for that reason, attach_shared checks the seals first.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            map_len,
            ProtFlags::READ,
            flags,
            file.as_fd(),
            offset,
        )
    }
    .map_err(|e| {
        Error::os(
            "mmap",
            e,
            format_args!("{op}: offset={offset} len={len} read-only flags={flags:?}"),
        )
    })?;
    Ok((ptr, map_len))
}

pub(super) fn round_len(op: &'static str, len: usize, page: usize) -> Result<usize> {
    if len == 0 {
        return Err(Error::empty(op, "bytes to map (length 0)"));
    }
    len.checked_next_multiple_of(page)
        .ok_or_else(|| Error::overflow(op, format!("length {len} rounded to pages")))
}

/// An alignment the aligned constructors take: a power of two at least the page size.
fn check_align(op: &'static str, align: usize) -> Result<()> {
    let page = page_size();
    if align.is_power_of_two() && align >= page {
        return Ok(());
    }
    Err(Error::bad_value(
        op,
        "align",
        align,
        format!("not a power of two at least the page size {page}"),
    ))
}
