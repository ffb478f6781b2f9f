//! Direct reads: a source file opened again with `O_DIRECT` through `/proc/self/fd`
//! (the caller's descriptor is never changed), read at the file system's `STATX_DIOALIGN`
//! alignment, straight into a slot where it is aligned and through a loader thread's
//! [`Scratch`] bounce buffer elsewhere.
//!
//! The reopen is a new open file description, with access checked against the file's
//! permissions, not against the caller's descriptor: so the caller's descriptor is checked
//! first ([`readable`]), and one that could not be read through (write-only, `O_PATH`) is
//! not reopened.
//!
//! The rooms: `open` (the reopen and its alignment, or the reason to read buffered),
//! `scratch` (a loader thread's bounce buffer, ring and counts), this file (one piece:
//! in place where aligned, through the bounce buffer elsewhere), `run` (consecutive
//! slots that continue each other in the file, read together) and `batch` (many pieces
//! in flight on the loader's ring).

use std::fs::File;
use std::os::fd::AsRawFd;

use rustix::io::Errno;

use super::pool::Queue;
use super::segment::{Segment, path_of};
use super::uring::{CHUNK, Request};
use crate::error::{Error, Result};

mod batch;
mod open;
mod run;
mod scratch;

pub(crate) use open::{dio_mem_alignment, open_direct, readable};
pub(crate) use scratch::Scratch;

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

    /// Aligned reads through the loader's ring or read threads, several in flight.
    fn read_ring(
        &self,
        ring: &mut Queue,
        requests: Vec<Request<'_>>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let op = ring.op();
        ring.read_all(
            &self.file,
            requests,
            self.offset_align as u64,
            &|errno, offset, len| self.failed(op, errno, offset, len, what),
            &|offset, len| self.eof(offset, len, what),
        )
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
