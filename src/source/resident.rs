//! How much of a file the page cache holds, for [`ReadMode::Auto`](super::ReadMode::Auto):
//! `cachestat(2)` where the kernel has it (Linux 6.5), else `mincore(2)` on a read-only
//! shared mapping of the file (which faults nothing in: it reads the page cache's state
//! through the mapping's page tables and the file's mapping tree).
//!
//! # Safety
//! The one mapping here (a [`Region`](crate::Region) of the file, for `mincore`) is
//! never read through.
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;

use numapin_sys as sys;
use rustix::io::Errno;

use super::mode::{Residency, ResidencyProbe};
use crate::error::{Error, Result};

/// The page-cache residency of the whole of `file`.
///
/// # Errors
/// `fstat`, `cachestat` (with an errno other than `ENOSYS`/`EOPNOTSUPP`), `mmap` or
/// `mincore` fails; the error names the call and the file.
pub(crate) fn residency(file: &File) -> Result<Residency> {
    let fd = file.as_raw_fd();
    let size = rustix::fs::fstat(file)
        .map_err(|errno| Error::os("fstat", errno, format_args!("fd={fd}")))?
        .st_size as u64;
    let page = crate::page::page_size() as u64;
    let pages = size.div_ceil(page);
    match cachestat(file) {
        Ok(cached) => Ok(Residency {
            cached_pages: cached.min(pages),
            pages,
            probe: ResidencyProbe::Cachestat,
        }),
        Err(Errno::NOSYS | Errno::OPNOTSUPP) => Ok(Residency {
            cached_pages: mincore(file, size)?,
            pages,
            probe: ResidencyProbe::Mincore,
        }),
        Err(errno) => Err(Error::os(
            "cachestat",
            errno,
            format_args!(
                "fd={fd} ({}) off=0 len=0 flags=0",
                super::segment::path_of(file)
            ),
        )),
    }
}

/// `cachestat` over the whole file: its pages in the page cache.
fn cachestat(file: &File) -> std::result::Result<u64, Errno> {
    let range = sys::cachestat_range { off: 0, len: 0 };
    // SAFETY: all-zero is a valid `struct cachestat` (plain integers).
    let mut stat: sys::cachestat = unsafe { std::mem::zeroed() };
    // SAFETY: `range` is readable and `stat` writable for the call; the kernel writes
    // only `stat`.
    unsafe { sys::cachestat(file.as_raw_fd(), &range, &mut stat, 0) }?;
    Ok(stat.nr_cache)
}

/// `mincore` over a read-only shared mapping of the file's `size` bytes.
fn mincore(file: &File, size: u64) -> Result<u64> {
    let fd = file.as_raw_fd();
    let Ok(len) = usize::try_from(size) else {
        return Err(Error::os(
            "mmap",
            Errno::OVERFLOW,
            format_args!("fd={fd} len={size}: larger than the address space"),
        ));
    };
    if len == 0 {
        return Ok(0);
    }
    // SAFETY: nothing reads the mapping (mincore looks at page tables and the page
    // cache only), so a concurrent write or truncation is never observed through it.
    let map = unsafe { crate::region::Region::map_file(file, 0, len) }?;
    Ok(crate::region::resident_pages(map.as_ptr() as usize, len)? as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    /// Both probes count the same pages: none after `POSIX_FADV_DONTNEED` of a synced
    /// file, then exactly the pages of the first half once it is read.
    #[test]
    fn cachestat_and_mincore_count_the_same_pages() {
        let path = std::env::temp_dir().join(format!("numapin-resident-{}", std::process::id()));
        let len = 1usize << 20;
        let mut file = File::create(&path).unwrap();
        file.write_all(&vec![7u8; len]).unwrap();
        file.sync_all().unwrap();
        drop(file);
        let file = File::open(&path).unwrap();
        // tmpfs and ramfs (the VM's TMPDIR and root) keep their pages: nothing there can be
        // evicted.
        if !numapin_testkit::cache::evictable(&file) {
            std::fs::remove_file(&path).unwrap();
            eprintln!(
                "NOT RUN: {} is on tmpfs or ramfs, whose pages cannot be evicted",
                path.display()
            );
            return;
        }
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        let page = crate::page::page_size() as u64;
        let pages = len as u64 / page;
        let cold = residency(&file).unwrap();
        assert_eq!(cold.pages, pages);
        assert_eq!(mincore(&file, len as u64).unwrap(), cold.cached_pages);
        let mut half = vec![0u8; len / 2];
        file.read_exact_at(&mut half, 0).unwrap();
        let warm = residency(&file).unwrap();
        let by_mincore = mincore(&file, len as u64).unwrap();
        std::fs::remove_file(&path).unwrap();
        // Readahead may add pages past the half; both probes see the same ones.
        assert!(warm.cached_pages >= pages / 2, "{warm:?}");
        assert_eq!(by_mincore, warm.cached_pages);
        assert_eq!(cold.cached_pages, 0, "{cold:?}");
    }
}
