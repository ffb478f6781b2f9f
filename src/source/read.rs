//! The loader's file reads in each [`ReadMode`]: one [`Reader`] per fill keeps, per
//! source file, how it is read (its `O_DIRECT` descriptor and alignment, or its
//! drop-behind bookkeeping); each loader thread has its own [`Scratch`] bounce buffer for
//! direct reads of unaligned pieces.
//!
//! Direct reads have no readahead, so the loaders take consecutive slots in batches of
//! up to [`DIRECT_BATCH`] bytes ([`Reader::read_segments`]): a run of pieces that continue
//! each other is read with one `preadv` straight into the slots when every piece is
//! aligned, or in aligned windows through the bounce buffer and copied out when not.
//! A single piece ([`Reader::read`]) goes straight into its slot where its address,
//! offset and length are aligned, and through the bounce buffer elsewhere (only its head,
//! when the slot is aligned after it).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::num::NonZeroU64;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::Mutex;

use rustix::fs::{Advice, AtFlags, StatxFlags};
use rustix::io::Errno;

use super::mode::{ReadFallback, ReadMode};
use crate::error::{Error, Result};

/// Bytes read from one file between two drop-behind advices.
///
/// `POSIX_FADV_DONTNEED` walks the advised range of the page cache and, when it finds
/// pages it could not drop, drains the per-CPU LRU caches of every CPU: a call costs
/// from microseconds to milliseconds. Every 64 MiB keeps that under about 30 calls per
/// second at 2 GB/s (a few percent of the load at worst) while the cache holds at most
/// about 64 MiB per file plus the 2 MiB edges, the reads in flight and the kernel's
/// readahead past them (`read_ahead_kb`, 8 MiB on this machine's disk).
pub const DROP_BEHIND_EVERY: u64 = 64 << 20;

/// Drop-behind advice is rounded out to this: `POSIX_FADV_DONTNEED` skips a large folio
/// that reaches past the advised range, and folios are at most a PMD (2 MiB) here.
const FOLIO_MAX: u64 = 2 << 20;

/// The bounce buffer of one loader thread for direct reads (at least two alignment
/// units): an unaligned 1 MiB expert takes one read, and a batch of small unaligned
/// slots one window.
const BOUNCE: usize = 8 << 20;

/// The most file bytes one loader takes at once, as consecutive slots, for direct reads:
/// large requests are what a device reads fast, and `O_DIRECT` has no readahead to merge
/// small ones.
pub(crate) const DIRECT_BATCH: usize = 8 << 20;

/// Segments per `preadv` (`IOV_MAX`).
const IOV_MAX: usize = 1024;

/// The longest single direct read into a slot.
const MAX_DIRECT: usize = 64 << 20;

/// A file opened again with `O_DIRECT`, and its alignment.
struct Direct {
    file: File,
    /// `stx_dio_mem_align`: buffer addresses.
    mem_align: usize,
    /// `stx_dio_offset_align`: file offsets and lengths.
    offset_align: usize,
}

/// How one source file is read.
enum How {
    Buffered,
    Direct(Direct),
    DropBehind(Mutex<Behind>),
}

/// What a drop-behind file has been read over since its last advice.
#[derive(Default)]
struct Behind {
    /// The lowest and highest offsets read so far (by this fill).
    low: u64,
    high: u64,
    /// Bytes read since the last advice.
    pending: u64,
}

struct Source<'a> {
    file: &'a File,
    how: How,
}

/// How every file of one fill is read.
pub(crate) struct Reader<'a> {
    files: Vec<Source<'a>>,
    /// File address → index in `files`.
    index: HashMap<usize, usize>,
    requested: ReadMode,
    fallback: Option<ReadFallback>,
}

fn key(file: &File) -> usize {
    file as *const File as usize
}

impl<'a> Reader<'a> {
    /// Plain buffered reads of whatever file (single-slot loads).
    pub(crate) fn buffered() -> Self {
        Reader {
            files: Vec::new(),
            index: HashMap::new(),
            requested: ReadMode::Buffered,
            fallback: None,
        }
    }

    /// Prepares `files` for `mode`: for [`ReadMode::Direct`] opens each one again with
    /// `O_DIRECT` (or notes why it falls back to buffered reads).
    ///
    /// # Errors
    /// `statx` or the `O_DIRECT` open fails with an errno that is not a reason to fall
    /// back, or the file system reports an alignment that is not a power of two.
    pub(crate) fn new(mode: ReadMode, files: impl IntoIterator<Item = &'a File>) -> Result<Self> {
        let mut reader = Reader {
            requested: mode,
            ..Reader::buffered()
        };
        if mode == ReadMode::Buffered {
            return Ok(reader);
        }
        for file in files {
            if reader.index.contains_key(&key(file)) {
                continue;
            }
            let how = match mode {
                ReadMode::Buffered => How::Buffered,
                ReadMode::DropBehind => How::DropBehind(Mutex::new(Behind {
                    low: u64::MAX,
                    ..Behind::default()
                })),
                ReadMode::Direct => match open_direct(file)? {
                    Ok(direct) => How::Direct(direct),
                    Err(why) => {
                        reader.fallback.get_or_insert(why);
                        How::Buffered
                    }
                },
            };
            reader.index.insert(key(file), reader.files.len());
            reader.files.push(Source { file, how });
        }
        Ok(reader)
    }

    /// What ran: the requested mode, or [`ReadMode::Buffered`] when a file fell back
    /// (with the first file's reason).
    pub(crate) fn outcome(&self) -> (ReadMode, Option<ReadFallback>) {
        match self.fallback {
            Some(why) => (ReadMode::Buffered, Some(why)),
            None => (self.requested, None),
        }
    }

    /// A bounce buffer for one loader thread (empty unless a file is read directly).
    pub(crate) fn scratch(&self) -> Scratch {
        let align = self
            .files
            .iter()
            .filter_map(|s| match &s.how {
                How::Direct(d) => Some((d.mem_align, d.offset_align)),
                _ => None,
            })
            .fold(None, |acc: Option<(usize, usize)>, (m, o)| {
                Some(acc.map_or((m, o), |(am, ao)| (am.max(m), ao.max(o))))
            });
        match align {
            None => Scratch::default(),
            Some((mem, offset)) => Scratch::new(mem.max(crate::page::page_size()), offset),
        }
    }

    /// Whether the threads need a bounce buffer (one more heap mapping each).
    pub(crate) fn needs_scratch(&self) -> bool {
        self.files.iter().any(|s| matches!(s.how, How::Direct(_)))
    }

    /// Reads `dest.len()` bytes of `file` at `offset` into `dest`.
    ///
    /// # Errors
    /// The read fails or ends early; the error names `what`, the offset and the length
    /// (and the alignment, for a direct read).
    pub(crate) fn read(
        &self,
        file: &File,
        offset: u64,
        dest: &mut [u8],
        scratch: &mut Scratch,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let source = self.index.get(&key(file)).map(|&i| &self.files[i]);
        match source.map(|s| &s.how) {
            None | Some(How::Buffered) => buffered(file, offset, dest, what),
            Some(How::Direct(direct)) => direct.read(offset, dest, scratch, what),
            Some(How::DropBehind(behind)) => {
                buffered(file, offset, dest, what)?;
                let advise = {
                    let mut b = behind.lock().unwrap_or_else(|e| e.into_inner());
                    b.low = b.low.min(offset);
                    b.high = b.high.max(offset + dest.len() as u64);
                    b.pending += dest.len() as u64;
                    (b.pending >= DROP_BEHIND_EVERY).then(|| {
                        b.pending = 0;
                        (b.low, b.high)
                    })
                };
                match advise {
                    Some((low, high)) => {
                        let low = low - low % FOLIO_MAX;
                        let high = high.saturating_add(FOLIO_MAX - 1) / FOLIO_MAX * FOLIO_MAX;
                        dont_need(file, low, high - low)
                    }
                    None => Ok(()),
                }
            }
        }
    }

    /// Whether loaders should take consecutive slots in batches ([`DIRECT_BATCH`]).
    pub(crate) fn batches(&self) -> bool {
        self.needs_scratch()
    }

    /// Reads every segment; runs of segments that continue each other in one directly
    /// read file are read together (one `preadv` straight into the slots when every
    /// segment is aligned, else aligned windows through the bounce buffer).
    ///
    /// # Errors
    /// As [`Reader::read`].
    pub(crate) fn read_segments(
        &self,
        segments: &mut [Segment<'_, '_>],
        scratch: &mut Scratch,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let mut i = 0;
        while i < segments.len() {
            let mut j = i + 1;
            while j < segments.len()
                && std::ptr::eq(segments[j].file, segments[i].file)
                && Some(segments[j].offset)
                    == segments[j - 1]
                        .offset
                        .checked_add(segments[j - 1].dest.len() as u64)
            {
                j += 1;
            }
            let run = &mut segments[i..j];
            let source = self.index.get(&key(run[0].file)).map(|&k| &self.files[k]);
            match source.map(|s| &s.how) {
                Some(How::Direct(direct)) if run.len() > 1 => {
                    direct.read_run(run, scratch, what)?
                }
                _ => {
                    for segment in run.iter_mut() {
                        self.read(segment.file, segment.offset, segment.dest, scratch, what)?;
                    }
                }
            }
            i = j;
        }
        Ok(())
    }

    /// The end of a fill: drop-behind files are advised whole.
    ///
    /// # Errors
    /// `posix_fadvise` fails.
    pub(crate) fn finish(&self) -> Result<()> {
        for source in &self.files {
            if let How::DropBehind(_) = source.how {
                dont_need(source.file, 0, 0)?;
            }
        }
        Ok(())
    }
}

fn buffered(file: &File, offset: u64, dest: &mut [u8], what: &dyn Fn() -> String) -> Result<()> {
    file.read_exact_at(dest, offset).map_err(|e| {
        Error::io(
            "pread",
            format!("{}: {} bytes at file offset {offset}", what(), dest.len()),
            e,
        )
    })
}

/// `posix_fadvise(POSIX_FADV_DONTNEED)` over `len` bytes at `offset` (0: to the end).
fn dont_need(file: &File, offset: u64, len: u64) -> Result<()> {
    rustix::fs::fadvise(file, offset, NonZeroU64::new(len), Advice::DontNeed).map_err(|errno| {
        Error::os(
            "posix_fadvise",
            errno,
            format_args!(
                "fd={} offset={offset} len={len} advice=POSIX_FADV_DONTNEED",
                file.as_raw_fd()
            ),
        )
    })
}

/// Opens `file` again with `O_DIRECT` through `/proc/self/fd`, with its alignment; or
/// the reason to read it buffered.
fn open_direct(file: &File) -> Result<std::result::Result<Direct, ReadFallback>> {
    open_direct_in(file, "/proc/self/fd")
}

/// [`open_direct`] through `fd_dir` (`/proc/self/fd`; another directory in tests).
fn open_direct_in(file: &File, fd_dir: &str) -> Result<std::result::Result<Direct, ReadFallback>> {
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

/// One destination of a batch: `dest.len()` bytes of `file` at `offset`.
pub(crate) struct Segment<'f, 'd> {
    pub(crate) file: &'f File,
    pub(crate) offset: u64,
    pub(crate) dest: &'d mut [u8],
}

/// A loader thread's bounce buffer: `len` bytes aligned for direct I/O inside `buf`.
#[derive(Default)]
pub(crate) struct Scratch {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Scratch {
    fn new(mem_align: usize, offset_align: usize) -> Self {
        let len = BOUNCE.max(2 * offset_align).next_multiple_of(offset_align);
        let buf = vec![0u8; len + mem_align];
        let start = buf.as_ptr().align_offset(mem_align);
        Scratch { buf, start, len }
    }

    fn get(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

impl Direct {
    fn eof(&self, offset: u64, len: usize, what: &dyn Fn() -> String) -> Error {
        Error::io(
            "pread",
            format!(
                "{}: O_DIRECT read of {len} bytes at file offset {offset} ended at the end of the file",
                what()
            ),
            std::io::ErrorKind::UnexpectedEof.into(),
        )
    }

    fn failed(
        &self,
        op: &'static str,
        errno: Errno,
        offset: u64,
        len: usize,
        what: &dyn Fn() -> String,
    ) -> Error {
        Error::os(
            op,
            errno,
            format_args!(
                "{}: O_DIRECT fd={} offset={offset} len={len} alignment: offset and length {}, memory {}",
                what(),
                self.file.as_raw_fd(),
                self.offset_align,
                self.mem_align,
            ),
        )
    }

    /// Reads a run of segments that continue each other in the file.
    fn read_run(
        &self,
        run: &mut [Segment<'_, '_>],
        scratch: &mut Scratch,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let (mem, align) = (self.mem_align, self.offset_align);
        let aligned = run.iter().all(|s| {
            s.offset.is_multiple_of(align as u64)
                && s.dest.len().is_multiple_of(align)
                && (s.dest.as_ptr() as usize).is_multiple_of(mem)
        });
        if aligned {
            for group in run.chunks_mut(IOV_MAX) {
                self.read_vectored(group, scratch, what)?;
            }
            return Ok(());
        }
        if scratch.len == 0 {
            return Err(no_scratch(what));
        }
        // Aligned windows over the run, each copied out to the segments it covers.
        let start = run[0].offset - run[0].offset % align as u64;
        let end = run.last().map_or(start, |s| s.offset + s.dest.len() as u64);
        let mut window_start = start;
        let mut next = 0; // the first segment not yet fully copied
        while window_start < end {
            let want = ((end - window_start) as usize)
                .next_multiple_of(align)
                .min(scratch.len);
            let bounce = scratch.get();
            let got = pread(&self.file, &mut bounce[..want], window_start)
                .map_err(|e| self.failed("pread", e, window_start, want, what))?;
            let window_end = window_start + got as u64;
            while next < run.len() {
                let s = &mut run[next];
                let (s_start, s_end) = (s.offset, s.offset + s.dest.len() as u64);
                let from = s_start.max(window_start);
                let to = s_end.min(window_end);
                if from < to {
                    let (a, b) = ((from - window_start) as usize, (to - window_start) as usize);
                    let at = (from - s_start) as usize;
                    s.dest[at..at + (b - a)].copy_from_slice(&bounce[a..b]);
                }
                if s_end <= window_end {
                    next += 1;
                } else {
                    break;
                }
            }
            if got < want && window_end < end {
                return Err(self.eof(window_end, (end - window_end) as usize, what));
            }
            window_start = window_end;
        }
        Ok(())
    }

    /// One `preadv` straight into aligned segments; a short read finishes segment by
    /// segment.
    fn read_vectored(
        &self,
        group: &mut [Segment<'_, '_>],
        scratch: &mut Scratch,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let offset = group[0].offset;
        let total: usize = group.iter().map(|s| s.dest.len()).sum();
        let got = {
            let mut iovecs: Vec<std::io::IoSliceMut<'_>> = group
                .iter_mut()
                .map(|s| std::io::IoSliceMut::new(&mut *s.dest))
                .collect();
            loop {
                match rustix::io::preadv(&self.file, &mut iovecs, offset) {
                    Err(Errno::INTR) => continue,
                    other => break other,
                }
            }
            .map_err(|e| self.failed("preadv", e, offset, total, what))?
        };
        if got == total {
            return Ok(());
        }
        let mut skip = got;
        for s in group.iter_mut() {
            let len = s.dest.len();
            if skip >= len {
                skip -= len;
                continue;
            }
            self.read(s.offset + skip as u64, &mut s.dest[skip..], scratch, what)?;
            skip = 0;
        }
        Ok(())
    }

    /// Reads `dest.len()` bytes at `offset`: straight into `dest` where the address, the
    /// offset and the length are aligned, through `scratch` in aligned windows elsewhere.
    fn read(
        &self,
        mut offset: u64,
        mut dest: &mut [u8],
        scratch: &mut Scratch,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let (mem, align) = (self.mem_align, self.offset_align);
        let eof = |offset: u64, len: usize| self.eof(offset, len, what);
        let failed =
            |errno: Errno, offset: u64, len: usize| self.failed("pread", errno, offset, len, what);
        while !dest.is_empty() {
            let address = dest.as_ptr() as usize;
            let head = (offset % align as u64) as usize;
            if head == 0 && address.is_multiple_of(mem) && dest.len() >= align {
                // Aligned: straight into the slot.
                let len = (dest.len() / align * align).min(MAX_DIRECT);
                let got = pread(&self.file, &mut dest[..len], offset)
                    .map_err(|e| failed(e, offset, len))?;
                if got == 0 {
                    return Err(eof(offset, len));
                }
                dest = &mut dest[got..];
                offset += got as u64;
                continue;
            }
            if scratch.len == 0 {
                return Err(no_scratch(what));
            }
            // Through the bounce buffer. Copy only the head when the slot is aligned
            // after it, so that the rest goes straight in.
            let to_boundary = (align - head) % align;
            let copy = if head != 0
                && (address + to_boundary).is_multiple_of(mem)
                && dest.len() >= to_boundary + align
            {
                to_boundary
            } else {
                dest.len().min(scratch.len - head)
            };
            let window = (head + copy).next_multiple_of(align);
            let start = offset - head as u64;
            let bounce = scratch.get();
            let got = pread(&self.file, &mut bounce[..window], start)
                .map_err(|e| failed(e, start, window))?;
            // The last window of a file whose size is not a multiple of the alignment
            // comes back short.
            if got <= head {
                return Err(eof(offset, dest.len()));
            }
            let n = (got - head).min(copy);
            dest[..n].copy_from_slice(&bounce[head..head + n]);
            dest = &mut dest[n..];
            offset += n as u64;
        }
        Ok(())
    }
}

fn no_scratch(what: &dyn Fn() -> String) -> Error {
    Error::invalid(
        "O_DIRECT read",
        format!("{}: the loader thread has no bounce buffer", what()),
    )
}

/// `pread`, again after `EINTR`.
fn pread(file: &File, buf: &mut [u8], offset: u64) -> std::result::Result<usize, Errno> {
    loop {
        match rustix::io::pread(file, &mut *buf, offset) {
            Err(Errno::INTR) => continue,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target_file(name: &str, len: usize) -> (std::path::PathBuf, File) {
        // The crate's target directory: a disk file system here, not tmpfs.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target")
            .join(format!("read-unit-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, vec![5u8; len]).unwrap();
        (dir, File::open(&path).unwrap())
    }

    fn has_dio(file: &File) -> bool {
        rustix::fs::statx(file, c"", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN).is_ok_and(|s| {
            s.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && s.stx_dio_offset_align > 0
        })
    }

    #[test]
    fn without_proc_fd_direct_reads_fall_back_with_the_reason() {
        let (dir, file) = target_file("noproc", 1000);
        if !has_dio(&file) {
            println!("NOT RUN: the target directory's file system reports no STATX_DIOALIGN");
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        }
        let missing = dir.join("no-such-proc").display().to_string();
        assert!(matches!(
            open_direct_in(&file, &missing),
            Ok(Err(ReadFallback::NoProcFs))
        ));
        let direct = open_direct_in(&file, "/proc/self/fd").unwrap().unwrap();
        assert!(direct.offset_align.is_power_of_two() && direct.mem_align.is_power_of_two());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_direct_reader_reads_short_files_and_reports_the_end() {
        let (dir, file) = target_file("short", 1000);
        if !has_dio(&file) {
            println!("NOT RUN: the target directory's file system reports no STATX_DIOALIGN");
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        }
        let reader = Reader::new(ReadMode::Direct, [&file]).unwrap();
        assert_eq!(reader.outcome(), (ReadMode::Direct, None));
        let mut scratch = reader.scratch();
        let mut dest = vec![0u8; 1000];
        reader
            .read(&file, 0, &mut dest, &mut scratch, &|| "t".into())
            .unwrap();
        assert!(dest.iter().all(|&b| b == 5));
        // Past the end: an error naming the read, not a silent short slot.
        let mut dest = vec![0u8; 10];
        let e = reader
            .read(&file, 995, &mut dest, &mut scratch, &|| "t".into())
            .unwrap_err();
        assert!(e.to_string().contains("at file offset 1000"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
