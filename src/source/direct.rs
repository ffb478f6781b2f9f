//! Direct reads: a source file opened again with `O_DIRECT` through `/proc/self/fd`
//! (the caller's descriptor is never changed), read at the file system's `STATX_DIOALIGN`
//! alignment, straight into a slot where it is aligned and through a loader thread's
//! [`Scratch`] bounce buffer elsewhere.
//!
//! The reopen is a new open file description, with access checked against the file's
//! permissions, not against the caller's descriptor: so the caller's descriptor is checked
//! first ([`readable`]), and one that could not be read through (write-only, `O_PATH`) is
//! not reopened.

use std::fs::File;
use std::os::fd::AsRawFd;

use rustix::io::Errno;

use super::segment::{Segment, path_of};
use super::uring::{CHUNK, MAX_BUFS, Request, Ring};
use crate::error::{Error, Result};

mod batch;
mod open;

pub(crate) use open::{dio_mem_alignment, open_direct, readable};

/// The bounce buffer of one loader thread for direct reads (at least two alignment
/// units): an unaligned 1 MiB expert takes one read, and a batch of small unaligned
/// slots one window.
const BOUNCE: usize = 8 << 20;

/// Segments per `preadv` (`IOV_MAX`).
const IOV_MAX: usize = 1024;

/// The longest single direct read into a slot.
const MAX_DIRECT: usize = 64 << 20;

/// A file opened again with `O_DIRECT`, and its alignment.
pub(crate) struct Direct {
    file: File,
    /// `stx_dio_mem_align`: buffer addresses.
    pub(crate) mem_align: usize,
    /// `stx_dio_offset_align`: file offsets and lengths.
    pub(crate) offset_align: usize,
}

/// A loader thread's bounce buffer: `len` bytes aligned for direct I/O inside `buf`; and
/// its `io_uring`, when direct reads go through one.
#[derive(Default)]
pub(crate) struct Scratch {
    buf: Vec<u8>,
    start: usize,
    len: usize,
    ring: Option<Ring>,
    /// Slot bytes copied out of `buf` so far (the bytes a direct read did not land in
    /// place).
    bounced: u64,
    /// Slot bytes direct reads wrote in place so far.
    in_place: u64,
    /// Blocking `pread`/`preadv` calls so far.
    blocking: u64,
}

impl Scratch {
    pub(crate) fn new(mem_align: usize, offset_align: usize) -> Self {
        let len = BOUNCE.max(2 * offset_align).next_multiple_of(offset_align);
        let buf = vec![0u8; len + mem_align];
        let start = buf.as_ptr().align_offset(mem_align);
        Scratch {
            buf,
            start,
            len,
            ring: None,
            bounced: 0,
            in_place: 0,
            blocking: 0,
        }
    }

    /// Slot bytes this thread's direct reads copied out of the bounce buffer.
    pub(crate) fn bounced(&self) -> u64 {
        self.bounced
    }

    /// Whether direct reads go through this thread's `io_uring`.
    pub(crate) fn has_ring(&self) -> bool {
        self.ring.is_some()
    }

    /// What this thread's direct reads did: (bytes in place, blocking calls, ring
    /// requests, the most ring requests in flight at once).
    pub(crate) fn counts(&self) -> (u64, u64, u64, usize) {
        let (submitted, peak) = self.ring.as_ref().map_or((0, 0), |r| (r.submitted, r.peak));
        (self.in_place, self.blocking, submitted, peak)
    }

    /// The same bounce buffer, with aligned reads submitted through `ring`.
    pub(crate) fn with_ring(mut self, ring: Ring) -> Self {
        self.ring = Some(ring);
        self
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
                "{}: {}: O_DIRECT read of {len} bytes at file offset {offset} ended at the end of \
                 the file (was it truncated during the load?)",
                what(),
                path_of(&self.file)
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
                "{}: {}: O_DIRECT fd={} offset={offset} len={len} alignment: offset and length {}, memory {}",
                what(),
                path_of(&self.file),
                self.file.as_raw_fd(),
                self.offset_align,
                self.mem_align,
            ),
        )
    }

    /// Reads a run of segments that continue each other in the file.
    pub(crate) fn read_run(
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
        if aligned && let Some(ring) = scratch.ring.as_mut() {
            let total: usize = run.iter().map(|s| s.dest.len()).sum();
            self.read_ring(ring, requests(run), what)?;
            scratch.in_place += total as u64;
            return Ok(());
        }
        if aligned {
            for group in run.chunks_mut(IOV_MAX) {
                self.read_vectored(group, scratch, what)?;
            }
            return Ok(());
        }
        if run.iter().all(|s| self.in_place(s.offset, s.dest)) {
            // Each segment's address follows its offset: its aligned interior goes
            // straight in, only its partial units at both ends through the bounce buffer
            // (never past its own ends: the slots around it belong to other reads).
            for s in run.iter_mut() {
                self.read(s.offset, s.dest, scratch, what)?;
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
        let mut copied = 0u64;
        while window_start < end {
            let want = ((end - window_start) as usize)
                .next_multiple_of(align)
                .min(scratch.len);
            scratch.blocking += 1;
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
                    copied += (b - a) as u64;
                }
                if s_end <= window_end {
                    next += 1;
                } else {
                    break;
                }
            }
            scratch.bounced += copied;
            copied = 0;
            if got < want && window_end < end {
                return Err(self.eof(window_end, (end - window_end) as usize, what));
            }
            window_start = window_end;
        }
        Ok(())
    }

    /// Whether [`Direct::read`] reads `dest` at `offset` mostly in place: after the head
    /// up to the first aligned file offset (through the bounce buffer), the address is
    /// aligned for direct I/O and at least one whole aligned unit follows. That is, the
    /// address follows the offset modulo the memory alignment (where it is no larger
    /// than the offset alignment).
    fn in_place(&self, offset: u64, dest: &[u8]) -> bool {
        let (mem, align) = (self.mem_align, self.offset_align);
        let head = (offset % align as u64) as usize;
        let to_boundary = (align - head) % align;
        (dest.as_ptr() as usize)
            .wrapping_add(to_boundary)
            .is_multiple_of(mem)
            && dest.len() >= to_boundary.saturating_add(align)
    }

    /// Aligned reads through the loader's ring, several in flight.
    fn read_ring(
        &self,
        ring: &mut Ring,
        requests: Vec<Request<'_>>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        ring.read_all(
            &self.file,
            requests,
            self.offset_align as u64,
            &|errno, offset, len| self.failed("io_uring read", errno, offset, len, what),
            &|offset, len| self.eof(offset, len, what),
        )
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
        scratch.blocking += 1;
        scratch.in_place += got as u64;
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
    pub(crate) fn read(
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
                if let Some(ring) = scratch.ring.as_mut() {
                    let len = dest.len() / align * align;
                    let (now, rest) = std::mem::take(&mut dest).split_at_mut(len);
                    self.read_ring(ring, chunks(offset, now).collect(), what)?;
                    scratch.in_place += len as u64;
                    dest = rest;
                    offset += len as u64;
                    continue;
                }
                let len = (dest.len() / align * align).min(MAX_DIRECT);
                let got = pread(&self.file, &mut dest[..len], offset)
                    .map_err(|e| failed(e, offset, len))?;
                scratch.blocking += 1;
                scratch.in_place += got as u64;
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
            scratch.blocking += 1;
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
            scratch.bounced += n as u64;
            dest = &mut dest[n..];
            offset += n as u64;
        }
        Ok(())
    }
}

/// `dest` as ring requests of at most [`CHUNK`] bytes, from file offset `offset` on.
fn chunks(offset: u64, dest: &mut [u8]) -> impl Iterator<Item = Request<'_>> {
    dest.chunks_mut(CHUNK)
        .enumerate()
        .map(move |(i, buf)| Request::full(offset + (i * CHUNK) as u64, vec![buf]))
}

/// A run of segments that continue each other in the file as ring requests: consecutive
/// segments together, up to [`CHUNK`] bytes and [`MAX_BUFS`] buffers a request; a segment
/// larger than that over several.
fn requests<'d>(run: &'d mut [Segment<'_, '_>]) -> Vec<Request<'d>> {
    let mut out: Vec<Request<'d>> = Vec::new();
    let mut current: Option<(Request<'d>, usize)> = None;
    for segment in run.iter_mut() {
        let mut offset = segment.offset;
        let mut rest: &'d mut [u8] = &mut *segment.dest;
        while !rest.is_empty() {
            let (mut request, used) = current
                .take()
                .unwrap_or_else(|| (Request::full(offset, Vec::new()), 0));
            let take = (CHUNK - used).min(rest.len());
            let (now, later) = std::mem::take(&mut rest).split_at_mut(take);
            request.need += now.len();
            request.bufs.push(now);
            rest = later;
            offset += take as u64;
            let used = used + take;
            if used == CHUNK || request.bufs.len() == MAX_BUFS {
                out.push(request);
            } else {
                current = Some((request, used));
            }
        }
    }
    out.extend(current.map(|(request, _)| request));
    out
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
    use super::open::open_direct_in;
    use super::*;
    use crate::source::mode::ReadFallback;
    use crate::source::mode::ReadMode;
    use crate::source::read::Reader;
    use rustix::fs::{AtFlags, StatxFlags};

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
        let mut scratch = reader.scratch().unwrap();
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

    /// The memory and offset alignments of direct reads of `file` (`None`: none).
    fn aligns(file: &File) -> Option<(usize, usize)> {
        let direct = open_direct(file).ok()?.ok()?;
        assert_eq!(dio_mem_alignment(file), Some(direct.mem_align));
        Some((direct.mem_align, direct.offset_align))
    }

    /// A file of `len` bytes `i % 251` on the target directory's disk.
    fn pattern_file(name: &str, len: usize) -> (std::path::PathBuf, File, Vec<u8>) {
        let (dir, _) = target_file(name, 0);
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let path = dir.join("f");
        std::fs::write(&path, &bytes).unwrap();
        (dir, File::open(&path).unwrap(), bytes)
    }

    /// `len` bytes of a buffer of `0xee` whose address is congruent to `offset` modulo
    /// `unit` (plus `skew`), with at least `unit` bytes of buffer on each side: (buffer,
    /// start of the window).
    fn window(unit: usize, offset: u64, len: usize, skew: usize) -> (Vec<u8>, usize) {
        let buf = vec![0xeeu8; len + 4 * unit];
        let base = buf.as_ptr().align_offset(unit) + unit;
        (buf, base + (offset % unit as u64) as usize + skew)
    }

    #[test]
    fn a_congruent_read_lands_in_place_and_bounces_only_its_ends() {
        let len = 1 << 20;
        let (dir, file, bytes) = pattern_file("inplace", len);
        let Some((mem, unit)) = aligns(&file) else {
            println!("NOT RUN: the target directory's file system reports no STATX_DIOALIGN");
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        };
        let what = || "t".to_string();
        for ring in [true, false] {
            let mut reader = Reader::new(ReadMode::Direct, [&file]).unwrap();
            if !ring {
                reader = reader.without_io_uring();
            }
            assert_eq!(reader.outcome(), (ReadMode::Direct, None));
            // Offsets inside a unit, on one, and a piece shorter than two units.
            for (offset, n) in [(100u64, 300_000usize), (unit as u64 * 3, 70_000), (7, unit)] {
                for skew in [0, 1] {
                    let mut scratch = reader.scratch().unwrap();
                    let (mut buf, at) = window(unit, offset, n, skew);
                    reader
                        .read(&file, offset, &mut buf[at..at + n], &mut scratch, &what)
                        .unwrap();
                    let o = offset as usize;
                    assert!(buf[at..at + n] == bytes[o..o + n], "{offset} {n} {skew}");
                    // Nothing written outside the destination (neighbours may be in use).
                    assert!(buf[..at].iter().chain(&buf[at + n..]).all(|&b| b == 0xee));
                    let bounced = scratch.bounced();
                    if skew == 0 {
                        // The head and the tail, each less than a unit.
                        assert!(bounced < 2 * unit as u64, "{offset} {n}: {bounced}");
                    } else if mem > 1 {
                        // Not congruent: every byte through the bounce buffer.
                        assert_eq!(bounced, n as u64, "{offset} {n}");
                    }
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_run_of_congruent_segments_lands_in_place_without_touching_between() {
        let (dir, file, bytes) = pattern_file("run", 1 << 20);
        let Some((_, unit)) = aligns(&file) else {
            println!("NOT RUN: the target directory's file system reports no STATX_DIOALIGN");
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        };
        let reader = Reader::new(ReadMode::Direct, [&file]).unwrap();
        // Three pieces that continue each other in the file, each in its own window of
        // one buffer (as consecutive slots are), congruent to their offsets.
        let lens = [3 * unit + 17, 5 * unit + 1, 2 * unit + 9];
        let first = 33u64;
        let stride = 16 * unit;
        let mut buf = vec![0xeeu8; 3 * stride + 2 * unit];
        let base = buf.as_ptr().align_offset(unit);
        let mut starts = Vec::new();
        let mut offset = first;
        for (i, &n) in lens.iter().enumerate() {
            starts.push((
                offset,
                base + i * stride + (offset % unit as u64) as usize,
                n,
            ));
            offset += n as u64;
        }
        let mut rest: &mut [u8] = &mut buf;
        let mut consumed = 0;
        let mut segments = Vec::new();
        for &(offset, at, n) in &starts {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(at - consumed);
            let (dest, tail) = tail.split_at_mut(n);
            rest = tail;
            consumed = at + n;
            segments.push(Segment {
                file: &file,
                offset,
                dest,
            });
        }
        let mut scratch = reader.scratch().unwrap();
        reader
            .read_segments(&mut segments, &mut scratch, &|| "t".into())
            .unwrap();
        drop(segments);
        let mut untouched = vec![true; buf.len()];
        for &(offset, at, n) in &starts {
            let o = offset as usize;
            assert!(buf[at..at + n] == bytes[o..o + n], "{offset}");
            untouched[at..at + n].iter_mut().for_each(|u| *u = false);
        }
        assert!(buf.iter().zip(&untouched).all(|(&b, &u)| !u || b == 0xee));
        let bounced = scratch.bounced();
        assert!(bounced < 2 * unit as u64 * 3, "{bounced}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
