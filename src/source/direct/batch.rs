//! Many direct reads in flight for a batch of pieces: each piece whose slot address
//! follows its file offset ([`Direct::lands`]) is read as its aligned interior straight
//! into the slot, and its partial alignment units at both ends (the head before its first
//! aligned file offset, the tail after its last) as whole units into the loader's bounce
//! buffer, every request of the batch submitted to the loader's ring together; the few
//! head and tail bytes are then copied to the slot. Nothing outside a piece's own bytes is
//! written (the bytes around it may be another piece's, being read by another loader).
//! A piece that does not land (too short for an aligned unit, or an address that does
//! not follow its offset) is read as before ([`Direct::read`]).

use super::{CHUNK, Direct, Scratch, Segment};
use crate::error::{Error, Result};
use crate::source::uring::Request;

/// The aligned interior of `len` bytes at `offset`: `(first, end)` aligned file offsets,
/// `None` when no whole unit lies inside.
fn interior(offset: u64, len: usize, align: usize) -> Option<(u64, u64)> {
    let align = align as u64;
    let first = offset.checked_next_multiple_of(align)?;
    let end = offset.checked_add(len as u64)? / align * align;
    (first < end).then_some((first, end))
}

impl Direct {
    /// Whether `dest` at `offset` lands in place: a whole aligned unit inside, at an
    /// address aligned for direct I/O.
    pub(crate) fn lands(&self, offset: u64, dest: &[u8]) -> bool {
        interior(offset, dest.len(), self.offset_align).is_some_and(|(first, _)| {
            (dest.as_ptr() as usize)
                .wrapping_add((first - offset) as usize)
                .is_multiple_of(self.mem_align)
        })
    }

    /// Reads every segment (all of this file) with the loader's ring, many reads in
    /// flight: see the module docs. Without a ring, each segment as [`Direct::read`].
    pub(crate) fn read_queued(
        &self,
        segments: &mut [Segment<'_, '_>],
        scratch: &mut Scratch,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let unit = self.offset_align;
        let mut i = 0;
        while i < segments.len() {
            let s = &mut segments[i];
            if scratch.ring.is_none() || !self.lands(s.offset, s.dest) {
                self.read(s.offset, s.dest, scratch, what)?;
                i += 1;
                continue;
            }
            // A round: the segments from `i` on that land, as many as the bounce buffer
            // holds the partial units of.
            let mut j = i;
            let mut room = scratch.len;
            while let Some(s) = segments.get(j) {
                if !self.lands(s.offset, s.dest) {
                    break;
                }
                let units = partial_units(s.offset, s.dest.len(), unit);
                if units * unit > room {
                    break;
                }
                room -= units * unit;
                j += 1;
            }
            if j == i {
                // The bounce buffer holds two units at least (`Scratch::new`): only a
                // scratch without one gets here.
                let s = &mut segments[i];
                self.read(s.offset, s.dest, scratch, what)?;
                i += 1;
                continue;
            }
            self.round(&mut segments[i..j], scratch, what)?;
            i = j;
        }
        Ok(())
    }

    /// One ring submission of `segments`, which all land and whose partial units fit the
    /// bounce buffer.
    fn round(
        &self,
        segments: &mut [Segment<'_, '_>],
        scratch: &mut Scratch,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let unit = self.offset_align;
        let Scratch {
            buf,
            start,
            len,
            ring,
            bounced,
            in_place,
            ..
        } = scratch;
        let Some(ring) = ring.as_mut() else {
            return Err(Error::invalid(
                "O_DIRECT read",
                format!("{}: the loader thread has no ring", what()),
            ));
        };
        let mut bounce: &mut [u8] = &mut buf[*start..*start + *len];
        let mut requests: Vec<Request<'_>> = Vec::new();
        // (slot bytes, where they are in the bounce buffer)
        let mut copies: Vec<(&mut [u8], usize)> = Vec::new();
        let mut used = 0usize;
        let mut landed = 0u64;
        for s in segments.iter_mut() {
            let Some((first, end)) = interior(s.offset, s.dest.len(), unit) else {
                continue; // `lands` said there is one
            };
            let head = (first - s.offset) as usize;
            let middle = (end - first) as usize;
            let (head_bytes, rest) = s.dest.split_at_mut(head);
            let (body, tail_bytes) = rest.split_at_mut(middle);
            if head > 0 {
                let (window, more) = std::mem::take(&mut bounce).split_at_mut(unit);
                bounce = more;
                requests.push(Request::full(first - unit as u64, vec![window]));
                copies.push((head_bytes, used + unit - head));
                used += unit;
            }
            landed += middle as u64;
            requests.extend(
                body.chunks_mut(CHUNK)
                    .enumerate()
                    .map(|(k, b)| Request::full(first + (k * CHUNK) as u64, vec![b])),
            );
            if !tail_bytes.is_empty() {
                let (window, more) = std::mem::take(&mut bounce).split_at_mut(unit);
                bounce = more;
                // The unit may run past the end of the file: only the tail must be read.
                let need = tail_bytes.len();
                requests.push(Request {
                    offset: end,
                    bufs: vec![window],
                    need,
                });
                copies.push((tail_bytes, used));
                used += unit;
            }
        }
        let op = ring.op();
        ring.read_all(
            &self.file,
            requests,
            unit as u64,
            &|errno, offset, len| self.failed(op, errno, offset, len, what),
            &|offset, len| self.eof(offset, len, what),
        )?;
        let bounce = &buf[*start..*start + *len];
        for (dest, at) in copies {
            dest.copy_from_slice(&bounce[at..at + dest.len()]);
            *bounced += dest.len() as u64;
        }
        *in_place += landed;
        Ok(())
    }
}

/// The partial units of `len` bytes at `offset` (0, 1 or 2): its head and its tail.
fn partial_units(offset: u64, len: usize, unit: usize) -> usize {
    let end = offset.saturating_add(len as u64);
    usize::from(!offset.is_multiple_of(unit as u64)) + usize::from(!end.is_multiple_of(unit as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::mode::ReadMode;
    use crate::source::read::Reader;
    use std::fs::File;

    #[test]
    fn interiors_and_partial_units() {
        assert_eq!(interior(100, 1000, 512), Some((512, 1024)));
        assert_eq!(interior(100, 400, 512), None);
        assert_eq!(interior(512, 512, 512), Some((512, 1024)));
        assert_eq!(interior(u64::MAX - 10, 5, 512), None);
        assert_eq!(partial_units(100, 1000, 512), 2);
        assert_eq!(partial_units(512, 1000, 512), 1);
        assert_eq!(partial_units(512, 512, 512), 0);
    }

    /// A file of `len` bytes `i % 251` on the target directory's disk (not tmpfs).
    fn pattern_file(name: &str, len: usize) -> (std::path::PathBuf, File, Vec<u8>) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target")
            .join(format!("queued-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.join("f"), &bytes).unwrap();
        let file = File::open(dir.join("f")).unwrap();
        (dir, file, bytes)
    }

    /// Reads `pieces` (offset, length, skew of the address from congruence) as one batch,
    /// each in its own window of one buffer of `0xee`: the buffer and each window's start.
    fn read_batch(
        reader: &Reader<'_>,
        file: &File,
        unit: usize,
        pieces: &[(u64, usize, usize)],
    ) -> (Result<()>, Vec<u8>, Vec<usize>, Scratch) {
        let stride = (pieces.iter().map(|p| p.1).max().unwrap() + 4 * unit).next_multiple_of(unit);
        let mut buf = vec![0xeeu8; stride * pieces.len() + unit];
        let base = buf.as_ptr().align_offset(unit);
        let starts: Vec<usize> = (pieces.iter().enumerate())
            .map(|(i, &(offset, _, skew))| {
                base + i * stride + unit + (offset % unit as u64) as usize + skew
            })
            .collect();
        let mut segments = Vec::new();
        let mut rest: &mut [u8] = &mut buf;
        let mut consumed = 0;
        for (&(offset, n, _), &at) in pieces.iter().zip(&starts) {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(at - consumed);
            let (dest, tail) = tail.split_at_mut(n);
            rest = tail;
            consumed = at + n;
            segments.push(Segment { file, offset, dest });
        }
        let mut scratch = reader.scratch().unwrap();
        let result = reader.read_segments(&mut segments, &mut scratch, &|| "t".into());
        drop(segments);
        (result, buf, starts, scratch)
    }

    #[test]
    fn a_batch_lands_in_place_and_touches_nothing_around_its_pieces() {
        let len = (1 << 20) + 300;
        let (dir, file, bytes) = pattern_file("batch", len);
        let Ok(Ok(direct)) = super::super::open_direct(&file) else {
            println!("NOT RUN: no O_DIRECT on the target directory's file system");
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        };
        let unit = direct.offset_align.max(direct.mem_align);
        // Odd offsets and lengths, one aligned, one not congruent (skew 1: through the
        // bounce buffer), one whose last unit runs past the end of the file.
        let pieces = [
            (100u64, 300_000usize, 0usize),
            (300_100, 70_001, 0),
            (unit as u64 * 700, 5 * unit, 0),
            (400_007, 3 * unit + 5, 1),
            (len as u64 - 100_003, 100_003, 0),
        ];
        // With io_uring where this process may use it, and on read threads (forced).
        for threads in [false, true] {
            let mut reader = Reader::new(ReadMode::Direct, [&file]).unwrap();
            if threads {
                reader = reader.without_io_uring();
            }
            let (result, buf, starts, scratch) = read_batch(&reader, &file, unit, &pieces);
            result.unwrap();
            let mut outside = vec![true; buf.len()];
            for (&(offset, n, _), &at) in pieces.iter().zip(&starts) {
                let o = offset as usize;
                assert!(buf[at..at + n] == bytes[o..o + n], "piece at {offset}");
                outside[at..at + n].iter_mut().for_each(|b| *b = false);
            }
            assert!(buf.iter().zip(&outside).all(|(&b, &out)| !out || b == 0xee));
            assert!(scratch.has_ring(), "several reads in flight either way");
            let counts = scratch.counts();
            // The four congruent pieces: all but their partial units in place, in one
            // round with several reads in flight.
            let congruent: usize = [0, 1, 2, 4].iter().map(|&i| pieces[i].1).sum();
            let in_place = counts.in_place_bytes;
            assert!(in_place + 8 * unit as u64 >= congruent as u64, "{in_place}");
            // The non-congruent piece bounced whole, the others at most a unit at each end.
            let bounced = scratch.bounced();
            assert!(bounced >= pieces[3].1 as u64, "{bounced}");
            assert!(bounced < pieces[3].1 as u64 + 8 * unit as u64, "{bounced}");
            // Every byte of the pieces was read in place or bounced, none twice.
            let total: usize = pieces.iter().map(|p| p.1).sum();
            assert_eq!(in_place + bounced, total as u64, "{counts:?}");
            if scratch.has_io_uring() {
                assert!(!threads);
                let (reads, depth) = (counts.uring_reads, counts.uring_depth);
                assert!(reads >= 4 && depth > 1, "{reads} {depth}");
            } else {
                // The round's requests (four interiors, their partial units) on the read
                // threads: how many ran at once depends on the scheduler, at most the
                // pool's depth; the non-congruent piece one blocking read at a time.
                assert_eq!(counts.uring_reads, 0, "{counts:?}");
                // Four interiors and the non-congruent piece's read, at least.
                assert!(counts.blocking_reads >= 5, "{counts:?}");
                let depth = counts.blocking_depth;
                assert!(
                    (1..=crate::source::POOL_DEPTH).contains(&depth),
                    "{counts:?}"
                );
                if !threads {
                    println!("NOT RUN (ring part): io_uring is not allowed here");
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_shorter_than_a_piece_is_an_error_not_wrong_bytes() {
        let len = 200_000;
        let (dir, file, _) = pattern_file("short", len);
        let Ok(Ok(direct)) = super::super::open_direct(&file) else {
            println!("NOT RUN: no O_DIRECT on the target directory's file system");
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        };
        let unit = direct.offset_align.max(direct.mem_align);
        let reader = Reader::new(ReadMode::Direct, [&file]).unwrap();
        // As if the file had shrunk after the layout was made: pieces past its end, one
        // ending mid-unit past it, one wholly past it.
        for piece in [
            (100_000u64, 150_000usize, 0usize),
            (199_001, 3 * unit, 0),
            (250_001, 3 * unit, 0),
        ] {
            let (result, buf, starts, _) = read_batch(&reader, &file, unit, &[piece]);
            let e = result.unwrap_err().to_string();
            assert!(e.contains("end of the file"), "{e}");
            // Nothing outside the piece was written.
            let at = starts[0];
            assert!(buf[..at].iter().all(|&b| b == 0xee));
            assert!(buf[at + piece.1..].iter().all(|&b| b == 0xee));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
