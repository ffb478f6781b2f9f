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

/// The most bytes the readahead guard holds for one file, in reaches
/// ([`readahead_reach`]): the lowest held ranges stay, the rest goes. Uncapped, a slot
/// order that is not the file's (the even pieces read first, every odd one then unread
/// just below one read) held half the file; merged experts (gate, up and down regions
/// read side by side) hold two reaches.
pub(crate) const HELD_REACHES: u64 = 4;

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
    /// every advice; once nothing is unread below them, they go. At most
    /// [`HELD_REACHES`] reaches are held, the lowest: past that, the rest goes now.
    fn guard(&mut self, ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
        if self.reach == 0 {
            return ranges;
        }
        let mut candidates = ranges;
        candidates.append(&mut self.held);
        let cap = self.reach.saturating_mul(HELD_REACHES);
        let mut total = 0u64;
        let mut out = Vec::new();
        let mut held: Vec<(u64, u64)> = Vec::new();
        for (start, end) in coalesce(candidates) {
            let guarded = self
                .unread
                .range(..start)
                .next_back()
                .map_or(0, |(_, &e)| e.saturating_add(self.reach));
            let room = cap - total;
            let split = guarded.clamp(start, end).min(start.saturating_add(room));
            if split > start {
                held.push((start, split));
                total += split - start;
            }
            if split < end {
                out.push((split, end));
            }
        }
        self.held = held;
        out
    }

    /// What [`State::guard`] holds, taken: to be advised now, whatever is still unread.
    fn release(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.held)
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
        // The late ranges' windows, merged first: complemented one by one, windows that
        // overlap (many small pieces read late) gave each gap between them once per
        // window, 110 million ranges for 100,000 pieces of 100 bytes.
        let windows = coalesce(
            std::mem::take(&mut self.late)
                .into_iter()
                .map(|(start, stop)| {
                    (
                        start.saturating_sub(FOLIO_MAX),
                        stop.saturating_add(FOLIO_MAX).min(limit.max(stop)),
                    )
                })
                .collect(),
        );
        for wide in windows {
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
    /// File address → a descriptor of the file (`dup`), to advise what the records
    /// still hold when the placement ends without reading everything ([`Drop`]). A file
    /// that cannot be duplicated (no descriptor left) has none: its held ranges stay
    /// cached, as ranges read past a later fill's first piece do.
    files: HashMap<usize, File>,
}

impl Shared {
    /// The records of every file `pieces` (file, offset, length) name: what all the
    /// placement's fills read.
    pub(crate) fn new<'f>(pieces: impl IntoIterator<Item = (&'f File, u64, usize)>) -> Shared {
        let mut ranges: HashMap<usize, (u64, Vec<(u64, u64)>)> = HashMap::new();
        let mut files = HashMap::new();
        for (file, offset, len) in pieces {
            ranges
                .entry(file as *const File as usize)
                .or_insert_with(|| {
                    if let Ok(dup) = file.try_clone() {
                        files.insert(file as *const File as usize, dup);
                    }
                    (readahead_reach(file), Vec::new())
                })
                .1
                .push((offset, len as u64));
        }
        Shared {
            files,
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

/// A placement that ends before every piece was read (an error, a cancelled layer, a
/// panic): what the readahead guard held for pieces no fill reads now goes. Before the
/// guard, such a placement left only what it had not read; a cancelled one left up to
/// [`HELD_REACHES`] reaches per file cached besides.
impl Drop for Shared {
    fn drop(&mut self) {
        for (key, stream) in &self.streams {
            let held = stream
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .release();
            if let Some(file) = self.files.get(key) {
                // Best effort: a drop has no caller to report a failed advice to.
                let _ = advise_all(file, held);
            }
        }
    }
}

/// `POSIX_FADV_DONTNEED` on each range (one ending at `u64::MAX`: to the end of the
/// file), stopping at the first that fails.
fn advise_all(file: &File, ranges: Vec<(u64, u64)>) -> Result<()> {
    for (start, end) in ranges {
        let len = if end == u64::MAX { 0 } else { end - start };
        dont_need(file, start, len)?;
    }
    Ok(())
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("files", &self.streams.len())
            .finish()
    }
}

/// `ranges` sorted, those that overlap or touch merged.
fn coalesce(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
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

/// The readahead window assumed where the file's backing device does not say (no
/// `read_ahead_kb` in sysfs for the file's device, or for its disk's when it is a
/// partition: a file system on no block device of its own, such as overlayfs, tmpfs or
/// btrfs): 8 MiB, a common cloud disk's, larger than the kernel's default 128 KiB, so a
/// guess errs on caching a little more, not on reading twice.
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
            device_read_ahead(rustix::fs::major(dev), rustix::fs::minor(dev))
        })
        .unwrap_or(READ_AHEAD_GUESS);
    window.saturating_mul(2).saturating_add(FOLIO_MAX)
}

/// The readahead window of the block device `major:minor`, in bytes: its
/// `read_ahead_kb`, or `None` where sysfs has none for it. A partition (`sda1`,
/// `nvme0n1p2`: where most file systems live) has no bdi of its own in
/// `/sys/class/bdi`, only its disk: its window is the disk's (`queue/read_ahead_kb` of
/// the device above it in `/sys/dev/block`), where the 8 MiB guess was taken before.
fn device_read_ahead(major: u32, minor: u32) -> Option<u64> {
    let read = |path: String| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|kb| kb.trim().parse::<u64>().ok())
            .map(|kb| kb.saturating_mul(1024))
    };
    read(format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb"))
        .or_else(|| {
            read(format!(
                "/sys/dev/block/{major}:{minor}/queue/read_ahead_kb"
            ))
        })
        .or_else(|| {
            let dev = format!("/sys/dev/block/{major}:{minor}");
            std::path::Path::new(&format!("{dev}/partition"))
                .exists()
                .then(|| read(format!("{dev}/../queue/read_ahead_kb")))
                .flatten()
        })
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
mod tests;
