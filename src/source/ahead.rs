//! Readahead and drop-behind for the buffered reads of one fill, file by file.
//!
//! The loader threads read one file at interleaved offsets through one open file
//! description, so the kernel's readahead, which follows one sequential stream per
//! description, sees jumps and reads only what each `pread` asks for, a readahead unit
//! at a time, synchronously: two loader threads kept about two units in flight, and a
//! cold buffered load ran at a fraction of `cat`'s pace. So the fill announces the byte
//! ranges it is going to read ([`Stream::new`]) and keeps [`READ_AHEAD`] bytes of them
//! requested ahead of the reads with `POSIX_FADV_WILLNEED`, which starts the reads and
//! returns. The kernel caps one such call at the device's readahead size (the larger of
//! `read_ahead_kb` and `max_sectors_kb`), so the window is requested in chunks of
//! [`chunk_for`].
//!
//! Drop-behind evicts exactly what every loader has finished reading: the ranges still
//! unread are kept, and everything below the lowest of them (the low-water mark) is
//! advised away with `POSIX_FADV_DONTNEED` once [`DROP_BEHIND_EVERY`] bytes have
//! accumulated. Evicting the span of everything read so far, as before, also evicted the
//! pages one loader had read ahead for another.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::num::NonZeroU64;
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use rustix::fs::Advice;

use crate::error::{Error, Result};

/// Bytes read from one file between two drop-behind advices.
///
/// `POSIX_FADV_DONTNEED` walks the advised range of the page cache and, when it finds
/// pages it could not drop (the last few read are still in a per-CPU batch on their way
/// to the LRU lists), drains the per-CPU LRU caches of every CPU: a call costs from
/// microseconds to a millisecond. Every 8 MiB is about 250 calls per second at 2 GB/s.
/// What a drop-behind load holds in the page cache is this, the [`READ_AHEAD`] requested
/// ahead, and the reads in flight.
pub const DROP_BEHIND_EVERY: u64 = 8 << 20;

/// Bytes of a file requested ahead of the loaders' reads (buffered and drop-behind loads
/// of a store): two of this machine's 8 MiB readahead units, about what the kernel keeps
/// in flight for one sequential reader.
pub const READ_AHEAD: u64 = 16 << 20;

/// Drop-behind advice stops at a multiple of this: `POSIX_FADV_DONTNEED` skips a large
/// folio that reaches past the advised range, and folios are at most a PMD (2 MiB) here.
pub(crate) const FOLIO_MAX: u64 = 2 << 20;

/// The largest `POSIX_FADV_WILLNEED` chunk issued, whatever the device allows.
const CHUNK_MAX: u64 = 2 << 20;

/// The chunk when the device's limits cannot be read: the kernel's default readahead.
const CHUNK_DEFAULT: u64 = 128 << 10;

/// What one file of a fill still has to read and request.
pub(crate) struct Stream {
    chunk: u64,
    state: Mutex<State>,
}

struct State {
    /// Ranges to be read and not yet requested, in file order.
    unrequested: VecDeque<(u64, u64)>,
    /// Ranges to be read and not yet read (start → end), merged.
    unread: BTreeMap<u64, u64>,
    /// Advised away below this offset.
    dropped: u64,
}

impl Stream {
    /// The stream of `file` for a fill that reads `ranges` of it (offset, length; in any
    /// order, overlapping or not).
    pub(crate) fn new(file: &File, ranges: impl IntoIterator<Item = (u64, u64)>) -> Stream {
        Stream::with_chunk(chunk_for(file), ranges)
    }

    pub(crate) fn with_chunk(chunk: u64, ranges: impl IntoIterator<Item = (u64, u64)>) -> Stream {
        let mut sorted: Vec<(u64, u64)> = ranges
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .map(|(offset, len)| (offset, offset.saturating_add(len)))
            .collect();
        sorted.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
        for (start, end) in sorted {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        Stream {
            chunk: chunk.max(crate::page::page_size() as u64),
            state: Mutex::new(State {
                dropped: merged.first().map_or(0, |r| r.0),
                unread: merged.iter().copied().collect(),
                unrequested: merged.into(),
            }),
        }
    }

    /// Before reading `[offset, end)`: the ranges to request so that [`READ_AHEAD`] bytes past
    /// `end` are on their way (each range is requested by one reader only).
    pub(crate) fn before_read(&self, offset: u64, end: u64) -> Vec<(u64, u64)> {
        let target = end.saturating_add(READ_AHEAD);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        // What lies below this read is read (or being read) without help by now.
        while let Some(&(start, stop)) = state.unrequested.front() {
            if stop <= offset {
                state.unrequested.pop_front();
            } else if start < offset {
                state.unrequested[0].0 = offset;
                break;
            } else {
                break;
            }
        }
        while let Some(&(start, stop)) = state.unrequested.front() {
            if start >= target {
                break;
            }
            let upto = stop.min(target);
            out.push((start, upto));
            if upto == stop {
                state.unrequested.pop_front();
            } else {
                state.unrequested[0].0 = upto;
            }
        }
        out
    }

    /// After `[offset, end)` is read: the range every reader is done with, to evict, when
    /// [`DROP_BEHIND_EVERY`] bytes of it have gathered (`finish`: whatever has).
    pub(crate) fn after_read(&self, offset: u64, end: u64) -> Option<(u64, u64)> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        remove(&mut state.unread, offset, end);
        // Everything below the first range still unread is done with; a folio that
        // straddles the mark is left for later.
        let low = match state.unread.first_key_value() {
            Some((&start, _)) => start - start % FOLIO_MAX,
            None => u64::MAX,
        };
        if low != u64::MAX && low.saturating_sub(state.dropped) < DROP_BEHIND_EVERY {
            return None;
        }
        let from = state.dropped;
        if low <= from {
            return None;
        }
        state.dropped = low;
        Some((from, low))
    }

    /// The chunk the requests are cut into.
    pub(crate) fn chunk(&self) -> u64 {
        self.chunk
    }
}

/// Removes `[start, end)` from a set of disjoint ranges.
fn remove(set: &mut BTreeMap<u64, u64>, start: u64, end: u64) {
    if start >= end {
        return;
    }
    let overlapping: Vec<(u64, u64)> = set
        .range(..end)
        .rev()
        .take_while(|&(_, &e)| e > start)
        .map(|(&s, &e)| (s, e))
        .collect();
    for (s, e) in overlapping {
        set.remove(&s);
        if s < start {
            set.insert(s, start);
        }
        if e > end {
            set.insert(end, e);
        }
    }
}

/// `POSIX_FADV_WILLNEED` over `[start, end)` in chunks of `chunk`: each call starts the
/// reads and returns.
///
/// # Errors
/// `posix_fadvise` fails (stops at the first chunk refused).
pub(crate) fn request(file: &File, (start, end): (u64, u64), chunk: u64) -> Result<()> {
    let mut at = start;
    while at < end {
        let len = (end - at).min(chunk);
        advise(file, at, len, Advice::WillNeed)?;
        at += len;
    }
    Ok(())
}

/// `posix_fadvise(POSIX_FADV_DONTNEED)` over `len` bytes at `offset` (0: to the end).
pub(crate) fn dont_need(file: &File, offset: u64, len: u64) -> Result<()> {
    advise(file, offset, len, Advice::DontNeed)
}

fn advise(file: &File, offset: u64, len: u64, advice: Advice) -> Result<()> {
    rustix::fs::fadvise(file, offset, NonZeroU64::new(len), advice).map_err(|errno| {
        Error::os(
            "posix_fadvise",
            errno,
            format_args!(
                "fd={} offset={offset} len={len} advice={}",
                file.as_raw_fd(),
                match advice {
                    Advice::WillNeed => "POSIX_FADV_WILLNEED",
                    _ => "POSIX_FADV_DONTNEED",
                }
            ),
        )
    })
}

/// The most one `POSIX_FADV_WILLNEED` call of `file` reads: the kernel caps it at the
/// larger of the device's `read_ahead_kb` and `max_sectors_kb`
/// (`force_page_cache_ra`), read from `/sys/dev/block/MAJ:MIN` (the queue of the
/// partition's disk for a partition), at most [`CHUNK_MAX`]; 128 KiB where they cannot
/// be read (a file system without a block device of its own, no sysfs).
pub(crate) fn chunk_for(file: &File) -> u64 {
    let Ok(stat) = rustix::fs::fstat(file) else {
        return CHUNK_DEFAULT;
    };
    let (major, minor) = (
        rustix::fs::major(stat.st_dev),
        rustix::fs::minor(stat.st_dev),
    );
    let base = format!("/sys/dev/block/{major}:{minor}");
    let read_kb = |name: &str| -> Option<u64> {
        [
            format!("{base}/queue/{name}"),
            format!("{base}/../queue/{name}"),
        ]
        .iter()
        .find_map(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| text.trim().parse::<u64>().ok())
    };
    match (read_kb("read_ahead_kb"), read_kb("max_sectors_kb")) {
        (None, None) => CHUNK_DEFAULT,
        (ra, io) => (ra.unwrap_or(0).max(io.unwrap_or(0)) << 10).clamp(4096, CHUNK_MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn requests_stay_a_window_ahead_and_each_range_goes_once() {
        let s = Stream::with_chunk(MIB, [(0, 64 * MIB)]);
        assert_eq!(s.before_read(0, MIB), vec![(0, MIB + READ_AHEAD)]);
        // A second reader at the same place asks nothing again.
        assert_eq!(s.before_read(0, MIB), vec![]);
        assert_eq!(
            s.before_read(MIB, 2 * MIB),
            vec![(MIB + READ_AHEAD, 2 * MIB + READ_AHEAD)]
        );
        // A read that jumps ahead: what lies below it is left to the reads (a reader is
        // on it or past it), and the end of the ranges bounds the requests.
        assert_eq!(
            s.before_read(60 * MIB, 64 * MIB),
            vec![(60 * MIB, 64 * MIB)]
        );
        assert_eq!(s.before_read(63 * MIB, 64 * MIB), vec![]);
    }

    #[test]
    fn gaps_between_ranges_are_never_requested() {
        let s = Stream::with_chunk(MIB, [(10 * MIB, MIB), (0, MIB), (40 * MIB, MIB)]);
        assert_eq!(s.before_read(0, MIB), vec![(0, MIB), (10 * MIB, 11 * MIB)]);
        // A read that jumps past a range does not request what lies behind it.
        assert_eq!(
            s.before_read(40 * MIB, 41 * MIB),
            vec![(40 * MIB, 41 * MIB)]
        );
    }

    #[test]
    fn only_what_every_reader_finished_is_dropped() {
        let s = Stream::with_chunk(MIB, [(0, 64 * MIB)]);
        // Read out of order: nothing below the first unread byte is done with.
        assert_eq!(s.after_read(8 * MIB, 20 * MIB), None);
        assert_eq!(s.after_read(MIB, 8 * MIB), None);
        // [0, 20 MiB) is read now: dropped up to 20 MiB.
        assert_eq!(s.after_read(0, MIB), Some((0, 20 * MIB)));
        // Less than DROP_BEHIND_EVERY more: not yet.
        assert_eq!(s.after_read(20 * MIB, 21 * MIB), None);
        assert_eq!(s.after_read(21 * MIB, 64 * MIB), Some((20 * MIB, u64::MAX)));
    }

    #[test]
    fn the_mark_stops_below_a_folio_that_straddles_it() {
        let s = Stream::with_chunk(MIB, [(0, 64 * MIB)]);
        // Unread from 9.5 MiB: the folio from 8 MiB may still be read into.
        assert_eq!(s.after_read(0, 9 * MIB + MIB / 2), Some((0, 8 * MIB)));
    }

    #[test]
    fn empty_and_overflowing_ranges_are_harmless() {
        let s = Stream::with_chunk(0, [(u64::MAX - 5, 100), (7, 0)]);
        assert!(s.chunk() >= 4096);
        assert_eq!(
            s.before_read(u64::MAX - 5, u64::MAX),
            vec![(u64::MAX - 5, u64::MAX)]
        );
        assert_eq!(
            s.after_read(u64::MAX - 5, u64::MAX),
            Some((u64::MAX - 5, u64::MAX))
        );
        // Nothing announced: nothing requested, and the first read lets everything go once.
        let none = Stream::with_chunk(MIB, []);
        assert_eq!(none.before_read(0, 10), vec![]);
        assert_eq!(none.after_read(0, 10), Some((0, u64::MAX)));
        assert_eq!(none.after_read(0, 10), None);
    }

    #[test]
    fn removing_ranges_splits_and_merges_exactly() {
        let mut set: BTreeMap<u64, u64> = [(0, 10), (20, 30)].into_iter().collect();
        remove(&mut set, 5, 25);
        assert_eq!(set.into_iter().collect::<Vec<_>>(), vec![(0, 5), (25, 30)]);
    }
}
