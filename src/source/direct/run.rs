//! A run of segments that continue each other in the file (consecutive slots), read
//! together: through the loader's ring or one `preadv` straight into the slots where every
//! segment is aligned, piece by piece where each lands in place, else in aligned windows
//! through the bounce buffer, copied out to the segments each covers.

use rustix::io::Errno;

use super::{Direct, Scratch, no_scratch, pread};
use crate::error::Result;
use crate::source::segment::Segment;
use crate::source::uring::{CHUNK, MAX_BUFS, Request};

/// Segments per `preadv` (`IOV_MAX`).
const IOV_MAX: usize = 1024;

impl Direct {
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
