//! The `madvise` calls: harmless [`Advice`], populating, and releasing pages (which
//! zeroes them, so it takes `&mut self` or an `unsafe` contract).

use std::ops::Range;

use numapin_sys as sys;

use super::{Backing, Region};
use crate::error::{Errno, Error, Result};
use crate::page::page_size;

/// Harmless advice: nothing here changes the bytes a reader sees. Advice that can zero
/// memory (`MADV_DONTNEED`) is [`Region::release`], which takes `&mut self`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// `MADV_NORMAL`.
    Normal,
    /// `MADV_RANDOM`: no readahead.
    Random,
    /// `MADV_SEQUENTIAL`: aggressive readahead.
    Sequential,
    /// `MADV_WILLNEED`: read ahead now.
    WillNeed,
    /// `MADV_HUGEPAGE`: back with transparent huge pages where aligned.
    HugePage,
    /// `MADV_NOHUGEPAGE`.
    NoHugePage,
    /// `MADV_DONTDUMP`: leave out of core dumps.
    DontDump,
    /// `MADV_DODUMP`.
    DoDump,
}

impl Advice {
    fn raw(self) -> i32 {
        match self {
            Advice::Normal => sys::MADV_NORMAL,
            Advice::Random => sys::MADV_RANDOM,
            Advice::Sequential => sys::MADV_SEQUENTIAL,
            Advice::WillNeed => sys::MADV_WILLNEED,
            Advice::HugePage => sys::MADV_HUGEPAGE,
            Advice::NoHugePage => sys::MADV_NOHUGEPAGE,
            Advice::DontDump => sys::MADV_DONTDUMP,
            Advice::DoDump => sys::MADV_DODUMP,
        }
    }
}

impl Region {
    /// Gives the kernel harmless advice about the whole region.
    ///
    /// # Errors
    /// `madvise` fails (`EINVAL` for advice the kernel does not know).
    pub fn advise(&self, advice: Advice) -> Result<()> {
        // SAFETY: our own range; none of these advice values changes contents.
        unsafe { sys::madvise(self.as_ptr().cast(), self.map_len(), advice.raw()) }
            .map_err(|e| self.madvise_error(e, advice.raw()))
    }

    /// Faults every page in, writable, under the region's policy (`MADV_POPULATE_WRITE`,
    /// Linux 5.14); on kernels without it (`EINVAL`), touches each page instead. Contents
    /// are unchanged.
    ///
    /// # Errors
    /// A read-only file mapping, or the kernel cannot supply the pages (`ENOMEM`:
    /// the bound nodes are full; `EFAULT`).
    pub fn populate_write(&mut self) -> Result<()> {
        self.writable("Region::populate_write")?;
        // SAFETY: our own range; populating preserves contents.
        match unsafe {
            sys::madvise(
                self.as_ptr().cast(),
                self.map_len(),
                sys::MADV_POPULATE_WRITE,
            )
        } {
            Ok(()) => Ok(()),
            Err(Errno::INVAL) => {
                let page = page_size();
                for offset in (0..self.len).step_by(page) {
                    // SAFETY: offset < len, inside our writable mapping; `&mut self`
                    // excludes concurrent readers; the byte is written back unchanged.
                    unsafe {
                        let p = self.as_ptr().add(offset);
                        p.write_volatile(p.read_volatile());
                    }
                }
                Ok(())
            }
            Err(e) => Err(self.madvise_error(e, sys::MADV_POPULATE_WRITE)),
        }
    }

    /// Faults the pages of `range` in readable (`MADV_POPULATE_READ`, Linux 5.14), so
    /// that they are mapped (and show in `numa_maps`) without being written; on kernels
    /// without it (`EINVAL`), reads one byte of each page instead. Contents are
    /// unchanged. `range` is rounded out to whole pages.
    ///
    /// # Errors
    /// The range is outside the region, or `madvise` fails (`EFAULT`, `ENOMEM`).
    pub fn populate_read(&self, range: Range<usize>) -> Result<()> {
        self.check_range("Region::populate_read", &range)?;
        if range.is_empty() {
            return Ok(());
        }
        let page = page_size();
        let start = range.start - range.start % page;
        let end = range.end.next_multiple_of(page).min(self.map_len());
        // SAFETY: inside our own mapping; populating for reading changes no contents.
        let result = unsafe {
            sys::madvise(
                self.as_ptr().add(start).cast(),
                end - start,
                sys::MADV_POPULATE_READ,
            )
        };
        match result {
            Ok(()) => Ok(()),
            Err(Errno::INVAL) => {
                for offset in (start..end).step_by(page) {
                    // SAFETY: offset < map_len, inside our readable mapping.
                    unsafe { self.as_ptr().add(offset).read_volatile() };
                }
                Ok(())
            }
            Err(e) => Err(self.madvise_error(e, sys::MADV_POPULATE_READ)),
        }
    }

    /// Gives the pages of `range` back to the kernel. The address range and its policy
    /// stay: a later write faults a fresh page under the same policy. Anonymous memory
    /// reads back as zeroes (`MADV_DONTNEED`); a memfd region's pages are freed from the
    /// file too (`MADV_REMOVE`).
    ///
    /// `range.start` must be page-aligned; `range.end` is rounded up to the page.
    ///
    /// # Errors
    /// The range is outside the region or unaligned, the region is a file mapping, or
    /// `madvise` fails.
    pub fn release(&mut self, range: Range<usize>) -> Result<()> {
        // SAFETY: `&mut self` guarantees no slice of the region lives during the call.
        unsafe { self.release_pages("Region::release", range) }
    }

    /// [`Region::release`] of one range through `&self`: gives its pages back
    /// (`MADV_DONTNEED`; `MADV_REMOVE` for a memfd) while other ranges are read. The
    /// address range and its policy stay.
    ///
    /// # Safety
    ///
    /// The range reads back as zeroes afterwards: no reference to any byte of it (see
    /// [`Region::slot_mut_unchecked`]) may live during the call, and the caller must not
    /// rely on its old contents after it. `range.end` is rounded up to the page, so the
    /// page-rounded range is what must be free of references.
    ///
    /// # Errors
    /// As [`Region::release`].
    pub unsafe fn release_unchecked(&self, range: Range<usize>) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.release_pages("Region::release_unchecked", range) }
    }

    /// The one implementation of [`Region::release`] and [`Region::release_unchecked`].
    ///
    /// # Safety
    /// As [`Region::release_unchecked`]: no reference to the page-rounded range may live
    /// during the call.
    unsafe fn release_pages(&self, op: &'static str, range: Range<usize>) -> Result<()> {
        // Giving pages back is no write: a region read-only at rest releases as it is.
        self.backing_writable(op)?;
        self.check_range(op, &range)?;
        let page = page_size();
        if !range.start.is_multiple_of(page) {
            return Err(Error::misaligned(op, "start", range.start, page));
        }
        let end = range.end.next_multiple_of(page).min(self.map_len());
        if end == range.start {
            return Ok(());
        }
        let advice = match self.backing {
            Backing::Memfd(_) => sys::MADV_REMOVE,
            _ => sys::MADV_DONTNEED,
        };
        // Kernels before 6.7 refuse MADV_REMOVE on a mapping without PROT_WRITE (EACCES):
        // a memfd region read-only at rest is opened for the call.
        let window = match self.backing {
            Backing::Memfd(_) => Some(self.open_write()?),
            _ => None,
        };
        // SAFETY: inside our own mapping; the caller guarantees no reference to the
        // (page-rounded) range lives during the call.
        unsafe {
            sys::madvise(
                self.as_ptr().add(range.start).cast(),
                end - range.start,
                advice,
            )
        }
        .map_err(|e| self.madvise_error(e, advice))?;
        window.map_or(Ok(()), super::WriteWindow::close)
    }

    fn madvise_error(&self, errno: Errno, advice: i32) -> Error {
        Error::os(
            "madvise",
            errno,
            format_args!(
                "addr={:p} len={} advice={advice}",
                self.as_ptr(),
                self.map_len()
            ),
        )
    }
}
