//! Drop-behind for the reads of one fill, file by file: what to evict, and when.
//!
//! The fill announces the byte ranges it is going to read of each file ([`Stream::new`]).
//! Every [`DROP_BEHIND_EVERY`] bytes read, everything up to the highest offset read that
//! no loader still has to read is advised away (`POSIX_FADV_DONTNEED`), and later what a
//! slow loader finished below that mark. Ranges still to be read are never advised, so a
//! loader that stalls (descheduled on a busy machine) keeps its own slot cached, not the
//! file read past it. Evicting the span of everything read so far, as before, also
//! evicted pages the kernel had read ahead for the other loader; waiting for the lowest
//! unread byte, as a first version here did, kept a whole layer cached behind one stalled
//! slot.
//!
//! Tried and measured, then left out: requesting the next 16 MiB of the announced ranges
//! ahead of the loaders with `POSIX_FADV_WILLNEED` (in chunks of the device's readahead
//! cap). On this machine's disk it made cold drop-behind loads slower, 0.82× against
//! 1.09× a cold `cat` without it (5 alternating rounds; 0.49× against 0.97× with
//! `read_ahead_kb` at 128): the kernel's own readahead follows the loaders well enough.
//! Nor does replacing the kernel's readahead (`POSIX_FADV_RANDOM`) by such requests in a
//! window of 4, 8 or 16 MiB ahead of the highest read pay: the page cache then peaked at
//! 0.8–1.6% of a 1.03 GiB model instead of 2.1%, but the load ran at 0.47–0.52× a cold
//! `cat` instead of 1.07× (9 alternating rounds).

use std::collections::{BTreeMap, HashMap};
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
/// microseconds to a millisecond. Every 2 MiB is about 1,000 calls per second at 2 GB/s;
/// against 8 MiB, a cold load of the 1.03 GiB synthetic model was no slower (median
/// 1.45 against 1.37 GB/s, 11 alternating rounds) and its page cache peaked at 1.9% of
/// the file against 2.3%. What a drop-behind load holds in the page cache is this, the
/// reads in flight, a large folio straddling the last advice and, most of it, the
/// kernel's readahead ahead of the loaders (up to twice `read_ahead_kb`: 16 of the 20 MiB
/// peak with this disk's 8 MiB).
pub const DROP_BEHIND_EVERY: u64 = 2 << 20;

/// Drop-behind advice starts again at a multiple of this: `POSIX_FADV_DONTNEED` skips a
/// large folio that reaches past the advised range, and folios are at most a PMD (2 MiB)
/// here.
pub(crate) const FOLIO_MAX: u64 = 2 << 20;

/// What one file of a fill still has to read, and what was advised away.
pub(crate) struct Stream {
    state: Mutex<State>,
}

struct State {
    /// Ranges to be read and not yet read (start → end), merged.
    unread: BTreeMap<u64, u64>,
    /// Below this offset everything was advised away but what was unread at the time
    /// (a slot a slow loader was still reading).
    cursor: u64,
    /// Ranges below the cursor read since it passed them: advised at the next advice.
    late: Vec<(u64, u64)>,
    /// The highest offset read to.
    high: u64,
    /// The end of the last range announced: nothing past it (or past `high`) is advised,
    /// so what the kernel read ahead for the next fill of this file stays cached for it.
    end: u64,
    /// Bytes read since the last advice.
    since: u64,
    /// For a record shared by every fill of a placement ([`Shared`]): the ranges of the
    /// fills that have not begun ([`Stream::begin`]). Nothing at or past the first of them
    /// is advised: a later fill's reads start there, and the kernel's readahead from them
    /// runs forward over what earlier fills read above it, which must still be cached or
    /// it is read from the device again. `None`: the stream of one fill.
    future: Option<BTreeMap<u64, u64>>,
    /// How far past a read the kernel may read ahead ([`readahead_reach`]); 0: no guard.
    reach: u64,
    /// Ranges read (or gaps between them) not advised yet because the kernel's readahead
    /// from a range still to be read below them could reach them ([`State::guard`]).
    held: Vec<(u64, u64)>,
}

impl Stream {
    /// The stream of a fill that reads `ranges` of one file (offset, length; in any
    /// order, overlapping or not).
    pub(crate) fn new(ranges: impl IntoIterator<Item = (u64, u64)>) -> Stream {
        Stream {
            state: Mutex::new(State::new(ranges)),
        }
    }

    /// The record of a file read by many fills (one per store and layer of a placement):
    /// `ranges` are what all of them read. Each fill says what it reads when it begins
    /// ([`Stream::begin`]).
    pub(crate) fn shared(ranges: impl IntoIterator<Item = (u64, u64)>) -> Stream {
        let mut state = State::new(ranges);
        state.future = Some(state.unread.clone());
        Stream {
            state: Mutex::new(state),
        }
    }

    /// Holds back what the kernel's readahead could still reach from a range that is
    /// still to be read below it: `reach` bytes past its end ([`readahead_reach`]).
    pub(crate) fn with_reach(mut self, reach: u64) -> Stream {
        self.state
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .reach = reach;
        self
    }

    /// A fill of a shared record begins: it reads `ranges` (offset, length) now.
    pub(crate) fn begin(&self, ranges: impl IntoIterator<Item = (u64, u64)>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(future) = &mut state.future {
            for (offset, len) in ranges {
                remove(future, offset, offset.saturating_add(len));
            }
        }
    }

    /// At the end of a fill of a shared record: what it read and did not advise yet (the
    /// advice [`Stream::after_read`] gives, whatever was read since the last one). At the
    /// end of the last fill (every fill has begun), also what the readahead guard still
    /// holds: no read follows, even where a range announced was never read.
    pub(crate) fn flush(&self) -> Vec<(u64, u64)> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = state.advice();
        if state.future.as_ref().is_some_and(BTreeMap::is_empty) {
            out.append(&mut state.held);
        }
        out
    }
}

impl State {
    fn new(ranges: impl IntoIterator<Item = (u64, u64)>) -> State {
        let mut sorted: Vec<(u64, u64)> = ranges
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .map(|(offset, len)| (offset, offset.saturating_add(len)))
            .collect();
        sorted.sort_unstable();
        let end = sorted.iter().map(|&(_, e)| e).max().unwrap_or(0);
        let mut unread: BTreeMap<u64, u64> = BTreeMap::new();
        let mut last: Option<(u64, u64)> = None;
        for (start, end) in sorted {
            match &mut last {
                Some(l) if start <= l.1 => l.1 = l.1.max(end),
                _ => {
                    if let Some((s, e)) = last.replace((start, end)) {
                        unread.insert(s, e);
                    }
                }
            }
        }
        if let Some((s, e)) = last {
            unread.insert(s, e);
        }
        State {
            cursor: unread.first_key_value().map_or(0, |(&s, _)| s),
            late: Vec::new(),
            high: 0,
            since: 0,
            end,
            unread,
            future: None,
            reach: 0,
            held: Vec::new(),
        }
    }

    /// Splits `ranges` (each outside what is unread) into what may go now and what the
    /// kernel's readahead could still reach: a read of an unread range `[s, e)` makes the
    /// kernel read ahead up to `reach` bytes past `e`, so a page read and advised away
    /// there is read from the device again. Only the nearest unread range below a range
    /// matters (the others end lower). The held parts go to `held`, looked at again at
    /// every advice; once nothing is unread below them, they go.
    fn guard(&mut self, ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
        if self.reach == 0 {
            return ranges;
        }
        let mut candidates = ranges;
        candidates.append(&mut self.held);
        candidates.sort_unstable();
        let mut out = Vec::new();
        let mut held: Vec<(u64, u64)> = Vec::new();
        for (start, end) in candidates {
            let guarded = self
                .unread
                .range(..start)
                .next_back()
                .map_or(0, |(_, &e)| e.saturating_add(self.reach));
            let split = guarded.clamp(start, end);
            if split > start {
                match held.last_mut() {
                    Some(last) if start <= last.1 => last.1 = last.1.max(split),
                    _ => held.push((start, split)),
                }
            }
            if split < end {
                out.push((split, end));
            }
        }
        self.held = held;
        out
    }

    /// The ranges to advise now (see [`Stream::after_read`]), and the cursor moved past
    /// them.
    fn advice(&mut self) -> Vec<(u64, u64)> {
        self.since = 0;
        let all_read = self.unread.is_empty();
        // Where the first fill still to begin reads (shared records): nothing from there on.
        let limit = self
            .future
            .as_ref()
            .and_then(|f| f.first_key_value())
            .map_or(u64::MAX, |(&s, _)| s);
        let mark = if all_read {
            self.end.max(self.high)
        } else {
            self.high.min(limit)
        };
        let mut out = Vec::new();
        for (start, stop) in std::mem::take(&mut self.late) {
            let wide = (
                start.saturating_sub(FOLIO_MAX),
                stop.saturating_add(FOLIO_MAX).min(limit.max(stop)),
            );
            out.extend(outside(&self.unread, wide));
        }
        if mark > self.cursor {
            out.extend(outside(&self.unread, (self.cursor, mark)));
            // The next advice starts again at the folio `mark` falls in: a large folio
            // reaching past `mark` was skipped by this one.
            let restart = if all_read {
                mark
            } else {
                mark - mark % FOLIO_MAX
            };
            self.cursor = self.cursor.max(restart);
        }
        self.guard(out)
    }
}

impl Stream {
    /// After `[offset, end)` is read: once [`DROP_BEHIND_EVERY`] bytes were read since
    /// the last advice, the ranges to evict — everything up to the highest offset read
    /// that no loader still has to read (the next advice starts again at the folio that
    /// offset falls in), and the ranges a slow loader finished below since (widened by a
    /// folio on each side, so that a folio straddling their edge, left by the kernel
    /// before, goes too). Ranges still to be read are never advised: a loader that stalls
    /// on one slot keeps that slot cached, not everything read past it. Once everything
    /// announced is read, the rest up to its end goes, and nothing past it: what the
    /// kernel read ahead there is for the next fill.
    pub(crate) fn after_read(&self, offset: u64, end: u64) -> Vec<(u64, u64)> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *state;
        remove(&mut state.unread, offset, end);
        if let Some(future) = &mut state.future {
            remove(future, offset, end);
        }
        if offset < state.cursor {
            state.late.push((offset, end.min(state.cursor)));
        }
        state.high = state.high.max(end);
        state.since = state.since.saturating_add(end.saturating_sub(offset));
        if state.since < DROP_BEHIND_EVERY && !state.unread.is_empty() {
            return Vec::new();
        }
        state.advice()
    }

    /// Where the fill's reads of this file end: the end of the last range announced, or
    /// of the last read past it.
    pub(crate) fn end(&self) -> u64 {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.end.max(state.high)
    }
}

/// One drop-behind record per file for every fill of a placement, whatever store each
/// fill is of ([`Stream::shared`]): a file range is advised away only once every piece in
/// it was read, by whichever store owns it, and nothing at or past the first piece of a
/// fill that has not begun. Per store, a fill of one class evicted what another class's
/// store had not read yet, and that store read it from the device again.
#[derive(Default)]
pub(crate) struct Shared {
    /// File address → its record.
    streams: HashMap<usize, Stream>,
}

impl Shared {
    /// The records of every file `pieces` (file, offset, length) name: what all the
    /// placement's fills read.
    pub(crate) fn new<'f>(pieces: impl IntoIterator<Item = (&'f File, u64, usize)>) -> Shared {
        let mut ranges: HashMap<usize, (u64, Vec<(u64, u64)>)> = HashMap::new();
        for (file, offset, len) in pieces {
            ranges
                .entry(file as *const File as usize)
                .or_insert_with(|| (readahead_reach(file), Vec::new()))
                .1
                .push((offset, len as u64));
        }
        Shared {
            streams: ranges
                .into_iter()
                .map(|(file, (reach, ranges))| (file, Stream::shared(ranges).with_reach(reach)))
                .collect(),
        }
    }

    /// The record of `file`, if the placement reads it.
    pub(crate) fn stream(&self, file: &File) -> Option<&Stream> {
        self.streams.get(&(file as *const File as usize))
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("files", &self.streams.len())
            .finish()
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

/// How far earlier fills advised each file away (by device and inode), for the fills of
/// one store. A fill ends by advising its file from 0 to the end of what it read
/// ([`Reader::finish`](super::read::Reader::finish)), keeping what the kernel read ahead
/// past that end for the next fill. When the fills go backwards through a file (layers
/// loaded last first), the kernel reads ahead into the layer loaded before, which no
/// later fill reads or advises again: each fill left one readahead window cached, and a
/// 24-layer load left almost the whole file (tests/hostile6.rs). The end of a fill is
/// therefore advised up to the furthest end any earlier fill of the store reached: past
/// that, nothing was read yet and the readahead is kept.
#[derive(Debug, Default)]
pub(crate) struct Advised(Mutex<HashMap<(u64, u64), u64>>);

impl Advised {
    /// Notes that a fill of `file` ends at `end`; returns how far its end-of-fill advice
    /// goes: `end`, or the furthest end an earlier fill of the same file reached.
    /// A file whose identity cannot be read (`fstat` fails) is advised to `end` only.
    pub(crate) fn reach(&self, file: &File, end: u64) -> u64 {
        let Ok(stat) = rustix::fs::fstat(file) else {
            return end;
        };
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let furthest = map.entry((stat.st_dev, stat.st_ino)).or_insert(0);
        *furthest = (*furthest).max(end);
        *furthest
    }
}

/// The readahead window assumed where the file's backing device does not say
/// (`/sys/class/bdi/MAJ:MIN/read_ahead_kb` missing: a file system on no block device
/// of its own, such as overlayfs or btrfs): 8 MiB, a common cloud disk's, larger than
/// the kernel's default 128 KiB, so a guess errs on caching a little more, not on
/// reading twice.
const READ_AHEAD_GUESS: u64 = 8 << 20;

/// How far past the end of a read the kernel's readahead may read `file`: twice the
/// device's readahead window (`read_ahead_kb`: the synchronous window and the
/// asynchronous one started at its marker) and a large folio's rounding. A drop-behind
/// fill keeps what it read that far above a range still to be read ([`Stream::with_reach`]):
/// advising it away had the kernel read it from the device again when the lower range
/// was read (a cold GGUF placement read 1.12x its file with one loader, 1.24x with two,
/// each expert layer's gate, up and down tensors read side by side, the readahead from
/// the last gate pieces running into the up pieces read and dropped already).
pub(crate) fn readahead_reach(file: &File) -> u64 {
    let window = rustix::fs::fstat(file)
        .ok()
        .and_then(|stat| {
            let dev = stat.st_dev;
            let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
            std::fs::read_to_string(format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb")).ok()
        })
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map_or(READ_AHEAD_GUESS, |kb| kb.saturating_mul(1024));
    window.saturating_mul(2).saturating_add(FOLIO_MAX)
}

/// `posix_fadvise(POSIX_FADV_DONTNEED)` over `len` bytes at `offset` (0: to the end).
pub(crate) fn dont_need(file: &File, offset: u64, len: u64) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    // The steps below count in 2 MiB advices.
    const _: () = assert!(DROP_BEHIND_EVERY == 2 * MIB && FOLIO_MAX == 2 * MIB);

    #[test]
    fn a_stalled_loader_keeps_only_its_own_range_cached() {
        let s = Stream::new([(0, 64 * MIB)]);
        // One loader is on [0, 1 MiB) for a long time; the other reads on.
        assert_eq!(s.after_read(MIB, 4 * MIB), vec![(MIB, 4 * MIB)]);
        // The stalled range finishes: it goes at the next advice, widened by a folio
        // on each side (clipped at nothing unread), with the next stretch.
        assert_eq!(s.after_read(0, MIB), vec![]);
        assert_eq!(
            s.after_read(4 * MIB, 7 * MIB),
            vec![(0, 3 * MIB), (4 * MIB, 7 * MIB)]
        );
        // The next advice starts again at the folio the last one ended in.
        assert_eq!(s.after_read(7 * MIB, 9 * MIB), vec![(6 * MIB, 9 * MIB)]);
    }

    #[test]
    fn nothing_a_loader_still_has_to_read_is_advised() {
        let s = Stream::new([(0, 64 * MIB)]);
        // Read out of order: [8, 9) and [30, 40) MiB read, the rest not.
        assert_eq!(s.after_read(8 * MIB, 9 * MIB), vec![]);
        assert_eq!(
            s.after_read(30 * MIB, 40 * MIB),
            vec![(8 * MIB, 9 * MIB), (30 * MIB, 40 * MIB)]
        );
        // The gaps, read late, go widened, but not into what is still unread.
        assert_eq!(s.after_read(0, 8 * MIB), vec![(0, 9 * MIB)]);
        assert_eq!(s.after_read(9 * MIB, 30 * MIB), vec![(7 * MIB, 32 * MIB)]);
        // Everything read: the rest of what was announced goes, and nothing past it
        // (the kernel's readahead for the next fill).
        assert_eq!(s.after_read(40 * MIB, 64 * MIB), vec![(40 * MIB, 64 * MIB)]);
        assert_eq!(s.end(), 64 * MIB);
    }

    #[test]
    fn gaps_between_the_ranges_read_are_advised_with_them() {
        let s = Stream::new([(10 * MIB, 4 * MIB), (0, 4 * MIB), (40 * MIB, 30 * MIB)]);
        assert_eq!(s.after_read(0, MIB), vec![]);
        assert_eq!(s.after_read(MIB, 4 * MIB), vec![(0, 4 * MIB)]);
        assert_eq!(s.after_read(10 * MIB, 14 * MIB), vec![(4 * MIB, 14 * MIB)]);
    }

    #[test]
    fn empty_and_overflowing_ranges_are_harmless() {
        let s = Stream::new([(u64::MAX - 5, 100), (7, 0)]);
        assert_eq!(
            s.after_read(u64::MAX - 5, u64::MAX),
            vec![(u64::MAX - 5, u64::MAX)]
        );
        // Nothing announced: the first read lets itself go, and a read after that lets
        // its own pages go again.
        let none = Stream::new([]);
        assert_eq!(none.after_read(0, 10), vec![(0, 10)]);
        assert_eq!(none.after_read(0, 10), vec![(0, 10 + FOLIO_MAX)]);
        assert_eq!(none.end(), 10);
    }

    #[test]
    fn a_shared_record_keeps_what_a_later_fill_reads_and_what_lies_past_it() {
        // A placement: a dense fill reads [0, 1) and [20, 24) MiB, the experts' fill
        // [1, 20) MiB, then a second layer's dense fill [24, 40) MiB.
        let s = Stream::shared([
            (0, MIB),
            (20 * MIB, 4 * MIB),
            (MIB, 19 * MIB),
            (24 * MIB, 16 * MIB),
        ]);
        s.begin([(0, MIB), (20 * MIB, 4 * MIB)]);
        assert_eq!(s.after_read(0, MIB), vec![]);
        // Nothing at or past the experts' first byte goes: the kernel's readahead from
        // their reads runs over [20, 24), which must still be cached then. The end of the
        // fill advises the folio the mark fell in again.
        assert_eq!(s.after_read(20 * MIB, 24 * MIB), vec![(0, MIB)]);
        assert_eq!(s.flush(), vec![(0, MIB)]);
        // The experts' fill: up to the next fill's first byte, but what it still reads.
        s.begin([(MIB, 19 * MIB)]);
        assert_eq!(
            s.after_read(MIB, 4 * MIB),
            vec![(0, 4 * MIB), (20 * MIB, 24 * MIB)]
        );
        // Read behind that mark: it goes, widened by a folio each side.
        assert_eq!(s.after_read(4 * MIB, 20 * MIB), vec![(2 * MIB, 22 * MIB)]);
        // The last fill: everything read, up to the end of what was announced.
        s.begin([(24 * MIB, 16 * MIB)]);
        assert_eq!(s.after_read(24 * MIB, 40 * MIB), vec![(24 * MIB, 40 * MIB)]);
        assert_eq!(s.flush(), vec![]);
        // A record for one fill is not limited by any other.
        let own = Stream::new([(0, 8 * MIB)]);
        assert_eq!(own.after_read(2 * MIB, 5 * MIB), vec![(2 * MIB, 5 * MIB)]);
    }

    #[test]
    fn the_furthest_end_is_kept_per_file_not_per_descriptor() {
        let dir = std::env::temp_dir().join(format!("numapin-advised-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::write(&a, b"a").unwrap();
        std::fs::write(&b, b"b").unwrap();
        let advised = Advised::default();
        let (a1, a2, b1) = (
            File::open(&a).unwrap(),
            File::open(&a).unwrap(),
            File::open(&b).unwrap(),
        );
        // Backwards through `a`: the later, lower ends reach the first one's.
        assert_eq!(advised.reach(&a1, 64 * MIB), 64 * MIB);
        assert_eq!(advised.reach(&a2, 60 * MIB), 64 * MIB);
        // Forwards: each end its own.
        assert_eq!(advised.reach(&a1, 68 * MIB), 68 * MIB);
        // Another file keeps its own.
        assert_eq!(advised.reach(&b1, 4 * MIB), 4 * MIB);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn what_readahead_from_an_unread_range_reaches_is_held_until_it_is_read() {
        // Merged experts, one loader: gate pieces [0, 24) MiB, up pieces [24, 48) MiB,
        // read side by side (gate 0, up 0, gate 1, up 1, ...), 3 MiB each; readahead
        // reaches 10 MiB past a read.
        let s = Stream::new([(0, 48 * MIB)]).with_reach(10 * MIB);
        assert_eq!(s.after_read(0, 3 * MIB), vec![(0, 3 * MIB)]);
        // Up 0 is within 10 MiB of gate 1..7's end (24 MiB): held, not advised (the
        // folio below the last mark goes again).
        assert_eq!(s.after_read(24 * MIB, 27 * MIB), vec![(2 * MIB, 3 * MIB)]);
        let mut advised = Vec::new();
        for k in 1..7 {
            advised.extend(s.after_read(3 * k * MIB, 3 * (k + 1) * MIB));
            advised.extend(s.after_read((24 + 3 * k) * MIB, (27 + 3 * k) * MIB));
        }
        // Gate pieces go as read (the unread ones above them are not below them); of the
        // up pieces only what lies 10 MiB past gate 7's end or further.
        assert!(covers(&advised, 3 * MIB, 21 * MIB), "{advised:?}");
        assert!(covers(&advised, 34 * MIB, 45 * MIB), "{advised:?}");
        assert!(
            !advised.iter().any(|&(a, b)| a < 34 * MIB && b > 24 * MIB),
            "{advised:?}"
        );
        // Gate 7 read: nothing is unread below the held up pieces any more.
        let last = s.after_read(21 * MIB, 24 * MIB);
        assert!(covers(&last, 24 * MIB, 34 * MIB), "{last:?}");
        assert!(covers(
            &s.after_read(45 * MIB, 48 * MIB),
            45 * MIB,
            48 * MIB
        ));
    }

    /// Whether the ranges together cover `[lo, hi)`.
    fn covers(ranges: &[(u64, u64)], lo: u64, hi: u64) -> bool {
        let mut sorted = ranges.to_vec();
        sorted.sort_unstable();
        let mut at = lo;
        for (a, b) in sorted {
            if a <= at {
                at = at.max(b);
            }
        }
        at >= hi
    }

    #[test]
    fn no_reach_advises_as_before_and_a_huge_one_holds_without_overflow() {
        let plain = Stream::new([(0, 8 * MIB), (16 * MIB, 8 * MIB)]);
        // The gap between the ranges goes with what was read.
        assert_eq!(
            plain.after_read(16 * MIB, 19 * MIB),
            vec![(8 * MIB, 19 * MIB)]
        );
        let huge = Stream::new([(0, 8 * MIB), (16 * MIB, 8 * MIB)]).with_reach(u64::MAX);
        assert_eq!(huge.after_read(16 * MIB, 19 * MIB), vec![]);
        // All read: everything goes, held or not.
        let all = huge.after_read(0, 8 * MIB);
        assert!(covers(&all, 8 * MIB, 19 * MIB), "{all:?}");
    }

    #[test]
    fn the_reach_is_twice_the_devices_readahead_and_a_folio() {
        let file = File::open(std::env::current_exe().unwrap()).unwrap();
        let reach = readahead_reach(&file);
        // Whatever the device: at least twice the kernel's smallest sensible window
        // (4 KiB) and a folio, a multiple of 2 KiB, and not absurd.
        assert!(reach >= 2 * 4096 + FOLIO_MAX, "{reach}");
        assert_eq!(reach % 2048, 0, "{reach}");
        assert!(reach < (1 << 40), "{reach}");
    }

    #[test]
    fn the_last_fill_of_a_shared_record_lets_go_of_what_it_held() {
        // Two fills: [0, 8) and [16, 24) MiB; the first never reads [0, 1) MiB (announced,
        // not read: a piece another path read), so its reads above stay held.
        let s = Stream::shared([(0, 8 * MIB), (16 * MIB, 8 * MIB)]).with_reach(64 * MIB);
        s.begin([(0, 8 * MIB)]);
        assert_eq!(s.after_read(MIB, 8 * MIB), vec![]);
        assert_eq!(s.flush(), vec![]);
        s.begin([(16 * MIB, 8 * MIB)]);
        assert_eq!(s.after_read(16 * MIB, 24 * MIB), vec![]);
        // The last fill ends: everything read goes, the unread [0, 1) MiB stays.
        let last = s.flush();
        assert!(covers(&last, MIB, 24 * MIB), "{last:?}");
        assert!(!last.iter().any(|&(a, _)| a < MIB), "{last:?}");
    }

    #[test]
    fn range_sets_split_and_complement_exactly() {
        let mut set: BTreeMap<u64, u64> = [(0, 10), (20, 30)].into_iter().collect();
        assert_eq!(outside(&set, (5, 35)), vec![(10, 20), (30, 35)]);
        assert_eq!(outside(&set, (0, 10)), vec![]);
        remove(&mut set, 5, 25);
        assert_eq!(set.into_iter().collect::<Vec<_>>(), vec![(0, 5), (25, 30)]);
    }
}
