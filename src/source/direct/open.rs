//! Opening a source file again with `O_DIRECT` through `/proc/self/fd`, with the file
//! system's `STATX_DIOALIGN` alignment, or the reason to read it buffered.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use rustix::fs::{AtFlags, OFlags, StatxFlags};
use rustix::io::Errno;

use super::Direct;
use crate::error::{Error, Result};
use crate::source::mode::ReadFallback;

/// Opens `file` again with `O_DIRECT` through `/proc/self/fd`, with its alignment; or
/// the reason to read it buffered.
pub(crate) fn open_direct(file: &File) -> Result<std::result::Result<Direct, ReadFallback>> {
    open_direct_in(file, "/proc/self/fd")
}

/// Whether `file` can be read through: its access mode (`F_GETFL & O_ACCMODE`) is
/// `O_RDONLY` or `O_RDWR`, and it is not an `O_PATH` descriptor (which `F_GETFL` reports
/// with access mode 0, `O_RDONLY`, so the bit is tested on its own). A descriptor that
/// cannot be read through is not reopened for direct reads: the reopen would read what
/// the caller's descriptor refuses.
///
/// # Errors
/// `fcntl(F_GETFL)` fails.
pub(crate) fn readable(file: &File) -> Result<bool> {
    let flags = rustix::fs::fcntl_getfl(file).map_err(|errno| {
        Error::os(
            "fcntl",
            errno,
            format_args!("fd={} F_GETFL", file.as_raw_fd()),
        )
    })?;
    let access = flags & OFlags::ACCMODE;
    Ok(!flags.contains(OFlags::PATH) && (access == OFlags::RDONLY || access == OFlags::RDWR))
}

/// [`open_direct`] through `fd_dir` (`/proc/self/fd`; another directory in tests).
pub(super) fn open_direct_in(
    file: &File,
    fd_dir: &str,
) -> Result<std::result::Result<Direct, ReadFallback>> {
    let fd = file.as_raw_fd();
    let stat = match rustix::fs::statx(file, c"", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
        Ok(stat) => stat,
        Err(Errno::NOSYS) => return Ok(Err(ReadFallback::NoDirectIoAlignment)),
        Err(errno) => {
            return Err(Error::os(
                "statx",
                errno,
                format_args!("fd={fd} AT_EMPTY_PATH mask=STATX_DIOALIGN"),
            ));
        }
    };
    let (mem, offset) = (stat.stx_dio_mem_align, stat.stx_dio_offset_align);
    if stat.stx_mask & StatxFlags::DIOALIGN.bits() == 0 || mem == 0 || offset == 0 {
        return Ok(Err(ReadFallback::NoDirectIoAlignment));
    }
    if !mem.is_power_of_two() || !offset.is_power_of_two() {
        return Err(Error::invalid(
            "O_DIRECT read",
            format!(
                "fd {fd}: statx reports direct-I/O alignments that are not powers of two \
                 (memory {mem}, offset {offset})"
            ),
        ));
    }
    let path = format!("{fd_dir}/{fd}");
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
    {
        Ok(file) => Ok(Ok(Direct {
            file,
            mem_align: mem as usize,
            offset_align: offset as usize,
        })),
        Err(e) => match e.raw_os_error() {
            Some(libc::EINVAL) => Ok(Err(ReadFallback::DirectOpenRefused)),
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => Ok(Err(ReadFallback::NoProcFs)),
            _ => Err(Error::io("open O_DIRECT", path, e)),
        },
    }
}

/// The alignment a slot address must share with a file offset for a direct read of
/// `file` to land in the slot in place: `stx_dio_mem_align` as `statx` reports it
/// (`STATX_DIOALIGN`, Linux 6.1). Not the offset alignment: a read goes straight in from
/// the first file offset that is a multiple of `stx_dio_offset_align` (the head before it
/// through the bounce buffer), and there only the buffer's address must be aligned, to
/// `stx_dio_mem_align`; so the address must follow the file offset modulo the memory
/// alignment alone (4 on many NVMe devices, 512 on this machine's virtio disk). `None`
/// where `statx` reports no alignment (no direct I/O on that file system, an older
/// kernel): such a file is read buffered ([`open_direct`] falls back), so no layout
/// helps it.
pub(crate) fn dio_mem_alignment(file: &File) -> Option<usize> {
    let stat = rustix::fs::statx(file, c"", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN).ok()?;
    let (mem, offset) = (stat.stx_dio_mem_align, stat.stx_dio_offset_align);
    let reported = stat.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && mem > 0 && offset > 0;
    let mem = usize::try_from(mem).ok()?;
    (reported && mem.is_power_of_two()).then_some(mem)
}
