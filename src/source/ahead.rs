//! Readahead and drop-behind for the buffered reads of one fill, file by file.
//!
//! The loader threads read one file at interleaved offsets through one open file
//! description, so the kernel's readahead, which follows one sequential stream per
//! description, sees jumps and reads only what each `pread` asks for, synchronously: two
//! loader threads kept about two reads in flight, and a cold buffered load ran at a
//! fraction of `cat`'s pace. So the fill announces the byte ranges it is going to read
//! ([`Stream::new`]) and keeps up to [`READ_AHEAD`] bytes of them requested and not yet
//! read, in file order, with `POSIX_FADV_WILLNEED`, which starts the reads and returns.
//! The kernel caps one such call at the device's readahead size (the larger of
//! `read_ahead_kb` and `max_sectors_kb`), so requests go in chunks of [`chunk_for`].
//!
//! Drop-behind evicts, every [`DROP_BEHIND_EVERY`] bytes read, everything up to the
//! highest offset read that no loader still has to read, and later what a slow loader
//! finished below that mark. Ranges still to be read are never advised, so a loader that
//! stalls (descheduled on a busy machine) keeps its own slot cached, not the file read
//! past it; evicting the span of everything read so far, as before, also evicted pages
//! requested for the other loader, and waiting for the lowest unread byte, as a first
//! version here did, kept a whole layer cached behind one stalled slot.

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
    /// Requested up to here (file order).
    frontier: u64,
    /// Bytes requested and not yet read: kept at most [`READ_AHEAD`].
    in_flight: u64,
    /// Ranges to be read and not yet read (start → end), merged.
    unread: BTreeMap<u64, u64>,
    /// Below this offset everything was advised away but what was unread at the time
    /// (a slot a slow loader was still reading).
    cursor: u64,
    /// Ranges below the cursor read since it passed them: advised at the next advice.
    late: Vec<(u64, u64)>,
    /// The highest offset read to.
    high: u64,
    /// Bytes read since the last advice.
    since: u64,
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
                frontier: merged.first().map_or(0, |r| r.0),
                in_flight: 0,
                cursor: merged.first().map_or(0, |r| r.0),
                late: Vec::new(),
                high: 0,
                since: 0,
                unread: merged.iter().copied().collect(),
                unrequested: merged.into(),
            }),
        }
    }

    /// Before a read: the ranges to request next, in file order, so that up to
    /// [`READ_AHEAD`] bytes the fill still has to read are on their way (each range is
    /// requested by one reader only). Requests follow the file whatever order the slots
    /// are read in; a read that finds its range not requested yet reads it itself.
    pub(crate) fn before_read(&self) -> Vec<(u64, u64)> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        while state.in_flight < READ_AHEAD {
            let Some(&(start, stop)) = state.unrequested.front() else {
                break;
            };
            let upto = stop.min(start.saturating_add(READ_AHEAD - state.in_flight));
            // What a loader read before it was requested is not requested.
            let unread = inside(&state.unread, (start, upto));
            state.in_flight += unread.iter().map(|(s, e)| e - s).sum::<u64>();
            state.frontier = upto;
            out.extend(unread);
            if upto == stop {
                state.unrequested.pop_front();
            } else {
                state.unrequested[0].0 = upto;
            }
        }
        out
    }

    /// After `[offset, end)` is read: once [`DROP_BEHIND_EVERY`] bytes were read since
    /// the last advice, the ranges to evict — everything up to the highest offset read
    /// (down to a folio boundary) that no loader still has to read, and the ranges a
    /// slow loader finished below that mark since (widened by a folio on each side, so
    /// that a folio straddling their edge, left by the kernel before, goes too).
    /// Ranges still to be read are never advised: a loader that stalls on one slot
    /// keeps that slot cached, not everything read past it.
    pub(crate) fn after_read(&self, offset: u64, end: u64) -> Vec<(u64, u64)> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *state;
        let requested = remove(&mut state.unread, offset, end, state.frontier);
        state.in_flight = state.in_flight.saturating_sub(requested);
        if offset < state.cursor {
            state.late.push((offset, end.min(state.cursor)));
        }
        state.high = state.high.max(end);
        state.since = state.since.saturating_add(end.saturating_sub(offset));
        let all_read = state.unread.is_empty();
        if state.since < DROP_BEHIND_EVERY && !all_read {
            return Vec::new();
        }
        state.since = 0;
        let mark = if all_read {
            u64::MAX
        } else {
            state.high - state.high % FOLIO_MAX
        };
        let mut out = Vec::new();
        for (start, stop) in std::mem::take(&mut state.late) {
            let wide = (
                start.saturating_sub(FOLIO_MAX),
                stop.saturating_add(FOLIO_MAX),
            );
            out.extend(outside(&state.unread, wide));
        }
        if mark > state.cursor {
            out.extend(outside(&state.unread, (state.cursor, mark)));
            state.cursor = mark;
        }
        out
    }

    /// The chunk the requests are cut into.
    pub(crate) fn chunk(&self) -> u64 {
        self.chunk
    }
}

/// The parts of `[start, end)` outside a set of disjoint ranges.
fn outside(set: &BTreeMap<u64, u64>, (start, end): (u64, u64)) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = start;
    // The range that may begin before `start` and reach into it, then those inside.
    let before = set.range(..start).next_back().map(|(&s, &e)| (s, e));
    for (s, e) in before
        .into_iter()
        .chain(set.range(start..end).map(|(&s, &e)| (s, e)))
    {
        if e <= at {
            continue;
        }
        if s > at {
            out.push((at, s.min(end)));
        }
        at = at.max(e);
        if at >= end {
            break;
        }
    }
    if at < end {
        out.push((at, end));
    }
    out
}

/// The parts of `[start, end)` inside a set of disjoint ranges.
fn inside(set: &BTreeMap<u64, u64>, (start, end): (u64, u64)) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = start;
    for (gap_start, gap_end) in outside(set, (start, end)).into_iter().chain([(end, end)]) {
        if gap_start > at {
            out.push((at, gap_start));
        }
        at = gap_end;
    }
    out
}

/// Removes `[start, end)` from a set of disjoint ranges; returns how many of the bytes
/// removed lie below `below`.
fn remove(set: &mut BTreeMap<u64, u64>, start: u64, end: u64, below: u64) -> u64 {
    if start >= end {
        return 0;
    }
    let mut removed = 0;
    let overlapping: Vec<(u64, u64)> = set
        .range(..end)
        .rev()
        .take_while(|&(_, &e)| e > start)
        .map(|(&s, &e)| (s, e))
        .collect();
    for (s, e) in overlapping {
        removed += e.min(end).min(below).saturating_sub(s.max(start));
        set.remove(&s);
        if s < start {
            set.insert(s, start);
        }
        if e > end {
            set.insert(end, e);
        }
    }
    removed
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
    fn requests_keep_read_ahead_bytes_in_flight_and_each_range_goes_once() {
        let s = Stream::with_chunk(MIB, [(0, 64 * MIB)]);
        assert_eq!(s.before_read(), vec![(0, READ_AHEAD)]);
        // A second reader asks nothing more while nothing was read.
        assert_eq!(s.before_read(), vec![]);
        // Each read frees its bytes for the next request.
        let _ = s.after_read(0, MIB);
        assert_eq!(s.before_read(), vec![(READ_AHEAD, READ_AHEAD + MIB)]);
        let _ = s.after_read(MIB, 4 * MIB);
        assert_eq!(
            s.before_read(),
            vec![(READ_AHEAD + MIB, READ_AHEAD + 4 * MIB)]
        );
        // The end of the ranges bounds the requests.
        let _ = s.after_read(4 * MIB, 60 * MIB);
        // What a loader read before it was requested is not requested at all.
        assert_eq!(s.before_read(), vec![(60 * MIB, 64 * MIB)]);
        assert_eq!(s.before_read(), vec![]);
    }

    #[test]
    fn gaps_are_never_requested_and_what_was_read_is_not_requested_again() {
        let s = Stream::with_chunk(MIB, [(10 * MIB, MIB), (0, MIB), (40 * MIB, 30 * MIB)]);
        // A loader read the range at 10 MiB before anything was requested.
        let _ = s.after_read(10 * MIB, 11 * MIB);
        assert_eq!(
            s.before_read(),
            vec![(0, MIB), (40 * MIB, 40 * MIB + READ_AHEAD - MIB)]
        );
    }

    #[test]
    fn a_stalled_loader_keeps_only_its_own_range_cached() {
        let s = Stream::with_chunk(MIB, [(0, 64 * MIB)]);
        // One loader is on [0, 1 MiB) for a long time; the other reads on.
        assert_eq!(s.after_read(MIB, 4 * MIB), vec![]);
        assert_eq!(
            s.after_read(4 * MIB, 12 * MIB),
            vec![(MIB, 12 * MIB - 12 * MIB % FOLIO_MAX)]
        );
        // The stalled range finishes: it goes at the next advice, widened by a folio
        // on each side (clipped at nothing unread), with the next stretch.
        assert_eq!(s.after_read(0, MIB), vec![]);
        assert_eq!(
            s.after_read(12 * MIB, 20 * MIB),
            vec![(0, MIB + FOLIO_MAX), (12 * MIB, 20 * MIB)]
        );
    }

    #[test]
    fn nothing_a_loader_still_has_to_read_is_advised() {
        let s = Stream::with_chunk(MIB, [(0, 64 * MIB)]);
        // Read out of order: [8, 9) and [30, 40) MiB read, the rest not.
        assert_eq!(s.after_read(8 * MIB, 9 * MIB), vec![]);
        assert_eq!(
            s.after_read(30 * MIB, 40 * MIB),
            vec![(8 * MIB, 9 * MIB), (30 * MIB, 40 * MIB)]
        );
        // Everything read: the rest of the file goes.
        let mut last = Vec::new();
        for (a, b) in [(0, 8), (9, 30), (40, 64)] {
            last = s.after_read(a * MIB, b * MIB);
        }
        assert_eq!(last.last(), Some(&(40 * MIB, u64::MAX)));
    }

    #[test]
    fn empty_and_overflowing_ranges_are_harmless() {
        let s = Stream::with_chunk(0, [(u64::MAX - 5, 100), (7, 0)]);
        assert!(s.chunk() >= 4096);
        assert_eq!(s.before_read(), vec![(u64::MAX - 5, u64::MAX)]);
        assert_eq!(
            s.after_read(u64::MAX - 5, u64::MAX),
            vec![(u64::MAX - 5, u64::MAX)]
        );
        // Nothing announced: nothing requested; the first read lets everything go, and a
        // read after that lets its own pages go again.
        let none = Stream::with_chunk(MIB, []);
        assert_eq!(none.before_read(), vec![]);
        assert_eq!(none.after_read(0, 10), vec![(0, u64::MAX)]);
        assert_eq!(none.after_read(0, 10), vec![(0, 10 + FOLIO_MAX)]);
    }

    #[test]
    fn range_sets_split_cover_and_complement_exactly() {
        let mut set: BTreeMap<u64, u64> = [(0, 10), (20, 30)].into_iter().collect();
        assert_eq!(inside(&set, (5, 25)), vec![(5, 10), (20, 25)]);
        assert_eq!(inside(&set, (10, 20)), vec![]);
        assert_eq!(outside(&set, (5, 35)), vec![(10, 20), (30, 35)]);
        assert_eq!(remove(&mut set, 5, 25, 22), 7);
        assert_eq!(set.into_iter().collect::<Vec<_>>(), vec![(0, 5), (25, 30)]);
    }
}
