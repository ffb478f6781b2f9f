//! The page cache a load leaves, as a count: evict a file's cached pages, and count how
//! many of them are resident with `mincore` on a read-only mapping of it.
//!
//! `mincore` on a file mapping reports the page cache, without faulting anything in, for
//! a caller that owns the file or may write it (root, here); for anyone else the kernel
//! reports every page resident, so the count only means something for the file's owner.

use std::fs::File;
use std::os::fd::AsRawFd;

use numapin::{Error, Region, Result};

/// Whether the page cache can drop `file`'s pages: not on tmpfs or ramfs (the VM's
/// TMPDIR and root), whose pages are the file itself. A file system that cannot be asked
/// (`fstatfs` fails) counts as evictable.
pub fn evictable(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    // SAFETY: all-zero is a valid `struct statfs` (plain integers).
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is open and `fs` is writable for the call.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } != 0 {
        return true;
    }
    !matches!(fs.f_type as i64, TMPFS_MAGIC | RAMFS_MAGIC)
}

/// Writes back and evicts `file` from the page cache: `fdatasync`, then
/// `POSIX_FADV_DONTNEED` on the whole file.
///
/// # Errors
/// Either call fails (the error names it and the descriptor).
pub fn evict(file: &File) -> Result<()> {
    file.sync_data().map_err(|e| Error::Io {
        op: "fdatasync",
        path: format!("fd {}", file.as_raw_fd()),
        source: e.into(),
    })?;
    // SAFETY: posix_fadvise reads no memory of ours; the descriptor is open.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(Error::Io {
            op: "posix_fadvise(POSIX_FADV_DONTNEED)",
            path: format!("fd {}", file.as_raw_fd()),
            source: std::io::Error::from_raw_os_error(rc).into(),
        });
    }
    Ok(())
}

/// `(resident, total)` pages of `file` in the page cache, counted with `mincore` on a
/// read-only mapping of the whole file (the mapping itself faults nothing in). An empty
/// file is `(0, 0)`.
///
/// # Errors
/// The file's size cannot be read, the mapping or `mincore` fails.
pub fn cached_pages(file: &File) -> Result<(usize, usize)> {
    let len = file
        .metadata()
        .map_err(|e| Error::Io {
            op: "fstat",
            path: format!("fd {}", file.as_raw_fd()),
            source: e.into(),
        })?
        .len() as usize;
    if len == 0 {
        return Ok((0, 0));
    }
    // SAFETY: nothing reads the mapping (mincore looks at the page cache only), so a
    // concurrent write or truncation cannot be observed through a borrow of it.
    let mapping = unsafe { Region::map_file(file, 0, len) }?;
    let resident = numapin::resident_pages(mapping.as_ptr() as usize, len)?;
    Ok((resident, len.div_ceil(numapin::page_size())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_read_file_is_cached_and_an_evicted_one_is_not() {
        let dir = std::env::temp_dir().join(format!("numapin-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![7u8; 64 << 10]).unwrap();
        drop(f);
        let file = File::open(&path).unwrap();
        let pages = (64 << 10) / numapin::page_size();
        // Root may write the file, so mincore tells the truth about it.
        evict(&file).unwrap();
        assert_eq!(cached_pages(&file).unwrap(), (0, pages));
        std::fs::read(&path).unwrap();
        assert_eq!(cached_pages(&file).unwrap(), (pages, pages));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
