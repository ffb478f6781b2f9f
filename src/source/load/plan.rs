//! How a slot's pieces are read: adjacent pieces of one file merged into one `pread`,
//! split at [`MAX_READ`], and the strided rows of a column slice gathered into one read
//! of their span.

use std::fs::File;

use super::{Error, MAX_READ, Piece, Reader, Result, Scratch};

/// One read of a plan: `len` bytes of `file` at `offset` into the slot at `dest`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Read<'a> {
    pub(crate) file: &'a File,
    pub(crate) offset: u64,
    pub(crate) dest: usize,
    pub(crate) len: usize,
}

impl PartialEq for Read<'_> {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.file, other.file)
            && (self.offset, self.dest, self.len) == (other.offset, other.dest, other.len)
    }
}

/// The most bytes one gathered read spans (below glibc's mmap threshold, so the
/// buffer never costs a mapping the store's map budget did not count).
pub(crate) const GATHER_SPAN: u64 = 64 << 10;

/// Strided reads gathered at least this many at once (fewer are read one by one).
const GATHER_MIN: usize = 4;

/// How many of `reads` (from the first) one `pread` of their span serves: the rows of a
/// column slice, one piece a row with the other ranks' columns between — at least
/// [`GATHER_MIN`] reads of one file, of one length, at one stride, whose span (gaps
/// included) is at most [`GATHER_SPAN`]; else 1. Only that pattern: the few pieces of a
/// whole expert are read as they are, without reading what lies between them.
pub(super) fn gather_run(reads: &[Read<'_>]) -> usize {
    let (Some(first), Some(second)) = (reads.first(), reads.get(1)) else {
        return reads.len();
    };
    let Some(stride) = second.offset.checked_sub(first.offset) else {
        return 1;
    };
    if stride < first.len as u64 {
        return 1;
    }
    let mut n = 1;
    for (i, r) in reads.iter().enumerate().skip(1) {
        let at = (i as u64)
            .checked_mul(stride)
            .and_then(|d| first.offset.checked_add(d));
        // At its place on the stride, so at or after the first: the span cannot wrap.
        let span = r
            .offset
            .saturating_add(r.len as u64)
            .saturating_sub(first.offset);
        if !std::ptr::eq(r.file, first.file)
            || r.len != first.len
            || at != Some(r.offset)
            || span > GATHER_SPAN
        {
            break;
        }
        n += 1;
    }
    if n >= GATHER_MIN { n } else { 1 }
}

/// One read of the span of `run` into `buffer`, each piece then copied to its place in
/// `dest`.
pub(super) fn gather_read(
    run: &[Read<'_>],
    dest: &mut [u8],
    buffer: &mut Vec<u8>,
    (reader, scratch): (&Reader<'_>, &mut Scratch),
    what: &dyn Fn() -> String,
) -> Result<()> {
    let (Some(first), Some(last)) = (run.first(), run.last()) else {
        return Ok(());
    };
    // `gather_run` keeps the span within GATHER_SPAN.
    let span = (last.offset + last.len as u64 - first.offset) as usize;
    buffer.resize(span, 0);
    reader.read(first.file, first.offset, &mut buffer[..span], scratch, what)?;
    for r in run {
        let from = (r.offset - first.offset) as usize;
        let room = dest.len();
        let window = r
            .dest
            .checked_add(r.len)
            .and_then(|end| dest.get_mut(r.dest..end))
            .ok_or_else(|| {
                Error::invalid(
                    "load",
                    format!(
                        "{}: {} bytes at {} do not fit a slot of {room}",
                        what(),
                        r.len,
                        r.dest
                    ),
                )
            })?;
        window.copy_from_slice(&buffer[from..from + r.len]);
    }
    Ok(())
}

/// Pieces merged where one continues the previous one in the same file, then split at
/// [`MAX_READ`].
pub(crate) fn plan_reads<'a>(pieces: &[Piece<'a>]) -> Vec<Read<'a>> {
    let mut merged: Vec<Read<'a>> = Vec::new();
    let mut dest = 0;
    for piece in pieces.iter().filter(|p| p.len > 0) {
        match merged.last_mut() {
            Some(last)
                if std::ptr::eq(last.file, piece.file)
                    && last.offset.checked_add(last.len as u64) == Some(piece.offset) =>
            {
                last.len += piece.len
            }
            _ => merged.push(Read {
                file: piece.file,
                offset: piece.offset,
                dest,
                len: piece.len,
            }),
        }
        dest += piece.len;
    }
    merged
        .into_iter()
        .flat_map(|r| {
            (0..r.len).step_by(MAX_READ).map(move |done| Read {
                offset: r.offset + done as u64,
                dest: r.dest + done,
                len: MAX_READ.min(r.len - done),
                ..r
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;

    fn plan(file: &File, pieces: &[(u64, usize)]) -> Vec<(u64, usize, usize)> {
        let pieces: Vec<Piece> = pieces
            .iter()
            .map(|&(o, l)| Piece::new(file, o, l))
            .collect();
        plan_reads(&pieces)
            .iter()
            .map(|r| (r.offset, r.dest, r.len))
            .collect()
    }

    #[test]
    fn strided_reads_gather_within_the_span_and_stop_at_its_edge() {
        let f = File::open("/proc/self/exe").unwrap();
        let g = File::open("/proc/self/exe").unwrap();
        let read = |file, offset, len| Read {
            file,
            offset,
            dest: 0,
            len,
        };
        // Every other 1 KiB: 32 rows fit 64 KiB (the last ends at 63 KiB).
        let rows: Vec<Read> = (0..40).map(|i| read(&f, i * 2048, 1024)).collect();
        assert_eq!(gather_run(&rows), 32);
        assert_eq!(gather_run(&rows[32..]), 8);
        // Another file, a step back, a span too wide, another length or stride, fewer
        // than GATHER_MIN: each its own read.
        let strided = |n: u64, len| (0..n).map(|i| read(&f, i * 100, len)).collect::<Vec<_>>();
        assert_eq!(gather_run(&strided(4, 10)), 4);
        assert_eq!(gather_run(&strided(3, 10)), 1);
        let mut other_file = strided(4, 10);
        other_file[2].file = &g;
        assert_eq!(gather_run(&other_file), 1);
        let mut longer = strided(5, 10);
        longer[4].len = 11;
        assert_eq!(gather_run(&longer), 4);
        let mut off_stride = strided(5, 10);
        off_stride[3].offset += 1;
        assert_eq!(gather_run(&off_stride), 1);
        assert_eq!(gather_run(&[read(&f, 100, 10), read(&f, 0, 10)]), 1);
        // A run that jumps back after a stride (the next tensor earlier in the file).
        let mut back = strided(6, 10);
        back[4].offset = 0;
        assert_eq!(gather_run(&back), 4);
        let top = read(&f, u64::MAX - 20, 10);
        assert_eq!(
            gather_run(&[top, read(&f, u64::MAX - 10, 10), read(&f, 0, 10)]),
            1
        );
        assert_eq!(gather_run(&[read(&f, 0, 10), read(&f, 5, 10)]), 1);
        let wide: Vec<Read> = (0..4).map(|i| read(&f, i * GATHER_SPAN / 2, 10)).collect();
        assert_eq!(gather_run(&wide), 1);
        assert_eq!(gather_run(&[]), 0);
        assert_eq!(gather_run(&strided(1, 10)), 1);
    }

    #[test]
    fn a_gathered_read_puts_each_piece_where_the_plain_reads_would() {
        let f = File::open("/proc/self/exe").unwrap();
        let pieces: Vec<Piece> = (0..20)
            .map(|i| Piece::new(&f, 4096 + i * 300, 100))
            .collect();
        let mut gathered = vec![0u8; 2000];
        let job = Job {
            dest: &mut gathered,
            tensor: Tensor::File(&pieces),
            what: (0, 0, Kind::Weights),
        };
        let reads = AtomicUsize::new(0);
        fill_one(job, &reads, &Reader::buffered(), &mut Scratch::default()).unwrap();
        assert_eq!(reads.load(Ordering::Relaxed), 1);
        let mut want = Vec::new();
        for p in &pieces {
            let mut buf = vec![0u8; p.len];
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, p.offset).unwrap();
            want.extend(buf);
        }
        assert_eq!(gathered, want);
    }

    #[test]
    fn adjacent_pieces_coalesce_and_others_do_not() {
        let f = File::open("/proc/self/exe").unwrap();
        assert_eq!(
            plan(&f, &[(0, 10), (10, 5), (20, 5)]),
            vec![(0, 0, 15), (20, 15, 5)]
        );
        assert_eq!(plan(&f, &[(20, 5), (0, 10)]), vec![(20, 0, 5), (0, 5, 10)]);
        assert_eq!(plan(&f, &[(0, 0), (4, 4)]), vec![(4, 0, 4)]);
        assert!(plan(&f, &[]).is_empty());
    }

    #[test]
    fn pieces_of_two_files_never_coalesce() {
        let (a, b) = (
            File::open("/proc/self/exe").unwrap(),
            File::open("/proc/self/exe").unwrap(),
        );
        let pieces = [Piece::new(&a, 0, 10), Piece::new(&b, 10, 10)];
        let plan = plan_reads(&pieces);
        assert_eq!(plan.len(), 2);
        assert!(std::ptr::eq(plan[1].file, &b));
        assert_eq!((plan[1].offset, plan[1].dest), (10, 10));
    }

    #[test]
    fn reads_split_at_one_gib() {
        let f = File::open("/proc/self/exe").unwrap();
        let big = MAX_READ * 2 + 7;
        assert_eq!(
            plan(&f, &[(100, big)]),
            vec![
                (100, 0, MAX_READ),
                (100 + MAX_READ as u64, MAX_READ, MAX_READ),
                (100 + 2 * MAX_READ as u64, 2 * MAX_READ, 7)
            ]
        );
    }
}
