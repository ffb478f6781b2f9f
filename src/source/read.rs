//! The loader's file reads in each [`ReadMode`]: one [`Reader`] per fill keeps, per
//! source file, how it is read (its `O_DIRECT` descriptor and alignment, or its
//! drop-behind bookkeeping); each loader thread has its own [`Scratch`] bounce buffer for
//! direct reads of unaligned pieces.
//!
//! Direct reads have no readahead, so the loaders take consecutive slots in batches of
//! up to [`URING_BATCH`] bytes ([`Reader::read_segments`]), read with several requests in
//! flight: on the loader's `io_uring`, or where that cannot be used on its short-lived
//! read threads ([`Pool`]). A single piece ([`Reader::read`]) goes straight into its slot where its address,
//! offset and length are aligned, and through the bounce buffer elsewhere (only its head,
//! when the slot is aligned after it).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use super::behind::{self, Advised, DROP_BEHIND_EVERY, Shared, Stream, dont_need};
pub(crate) use super::direct::Scratch;
use super::direct::{Direct, open_direct, readable};
use super::mode::{DirectIo, FileRead, IoUringFallback, ReadFallback, ReadMode};
use super::pool::{self, POOL_MAPS, Pool, Queue, ThreadRoom};
use super::resident::residency;
pub(crate) use super::segment::Segment;
use super::segment::path_of;
use super::uring::{self, Ring};
use crate::error::{Error, Result};

/// Drop-behind advice of a file the fill did not announce is rounded out to this.
const FOLIO_MAX: u64 = behind::FOLIO_MAX;

/// The most file bytes one loader takes at once for direct reads (large requests are what
/// a device reads fast, and `O_DIRECT` has no readahead to merge small ones): enough slots
/// to keep [`uring::DEPTH`] reads in flight on a ring, [`POOL_DEPTH`](pool::POOL_DEPTH)
/// of [`CHUNK`](uring::CHUNK) bytes on read threads.
pub(crate) const URING_BATCH: usize = 32 << 20;

/// How one source file is read.
enum How {
    Buffered,
    Direct(Direct),
    DropBehind(Mutex<Behind>),
}

/// What a drop-behind file the fill did not announce ([`Reader::expect`]) has been read
/// over since its last advice.
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
    /// How direct reads are issued (`None`: no file is read directly).
    io: Option<DirectIo>,
    /// A loader whose ring could not be set up although the probe passed: its reason.
    late: Mutex<Option<IoUringFallback>>,
    /// File address → what the fill announced it reads of it, for drop-behind reads
    /// ([`Reader::expect`]).
    streams: HashMap<usize, Stream>,
    /// How far earlier fills of the same store advised their files away.
    advised: Option<&'a Advised>,
    /// The drop-behind records of a whole placement, shared by every fill of its stores
    /// ([`Reader::shared`]).
    shared: Option<Arc<Shared>>,
    /// How each file is read and why, in first-use order, for the report.
    reads: Vec<FileRead>,
    /// Where the store sets map slots aside for read threads ([`Reader::room`]).
    room: Option<ThreadRoom>,
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
            io: None,
            late: Mutex::new(None),
            streams: HashMap::new(),
            advised: None,
            shared: None,
            reads: Vec::new(),
            room: None,
        }
    }

    /// Drop-behind through the records of a whole placement ([`Shared`]) for the files
    /// they hold, in place of this fill's own ([`Reader::expect`] then begins this fill
    /// in them).
    pub(crate) fn shared(mut self, shared: Option<Arc<Shared>>) -> Self {
        self.shared = shared;
        self
    }

    /// The drop-behind record of `file`: this fill's own, or the placement's.
    fn stream(&self, file: &File) -> Option<&Stream> {
        self.streams
            .get(&key(file))
            .or_else(|| self.shared.as_deref()?.stream(file))
    }

    /// Ends each drop-behind file's advice at the furthest end the earlier fills noted
    /// in `advised` reached, when that is past this fill's ([`Advised`]).
    pub(crate) fn advised(mut self, advised: &'a Advised) -> Self {
        self.advised = Some(advised);
        self
    }

    /// Announces what the fill reads: `pieces` (file, offset, length). Drop-behind then
    /// evicts exactly what no loader still has to read ([`behind`]).
    pub(crate) fn expect(
        mut self,
        pieces: impl IntoIterator<Item = (&'a File, u64, usize)>,
    ) -> Self {
        let mut ranges: HashMap<usize, Vec<(u64, u64)>> = HashMap::new();
        let mut files: Vec<&'a File> = Vec::new();
        for (file, offset, len) in pieces {
            let list = ranges.entry(key(file)).or_insert_with(|| {
                files.push(file);
                Vec::new()
            });
            list.push((offset, len as u64));
        }
        for file in files {
            let k = key(file);
            let drop_behind = self
                .index
                .get(&k)
                .is_some_and(|&i| matches!(self.files[i].how, How::DropBehind(_)));
            let Some(ranges) = ranges.remove(&k).filter(|_| drop_behind) else {
                continue;
            };
            match self.shared.as_deref().and_then(|s| s.stream(file)) {
                Some(shared) => shared.begin(ranges),
                None => {
                    self.streams.insert(
                        k,
                        Stream::new(ranges).with_reach(behind::readahead_reach(file)),
                    );
                }
            }
        }
        self
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
        let mut seen = std::collections::HashSet::new();
        for file in files {
            if !seen.insert(key(file)) {
                continue;
            }
            let mut read = FileRead {
                path: path_of(file),
                mode,
                residency: None,
                fallback: None,
            };
            let how = match mode {
                ReadMode::Buffered => How::Buffered,
                ReadMode::DropBehind => How::DropBehind(Mutex::new(Behind {
                    low: u64::MAX,
                    ..Behind::default()
                })),
                // A descriptor that cannot be read through (write-only, `O_PATH`) is
                // read as given: the kernel refuses it (`EBADF`) exactly as in the other
                // modes, where reopening it would read what it refuses.
                ReadMode::Direct | ReadMode::Auto if !readable(file)? => How::Buffered,
                ReadMode::Direct | ReadMode::Auto => {
                    let cached = match mode {
                        ReadMode::Auto => {
                            let r = residency(file)?;
                            read.residency = Some(r);
                            r.mostly_cached()
                        }
                        _ => false,
                    };
                    if cached {
                        How::Buffered
                    } else {
                        match open_direct(file)? {
                            Ok(direct) => How::Direct(direct),
                            Err(why) => {
                                reader.fallback.get_or_insert(why);
                                read.fallback = Some(why);
                                How::Buffered
                            }
                        }
                    }
                }
            };
            read.mode = match how {
                How::Buffered => ReadMode::Buffered,
                How::Direct(_) => ReadMode::Direct,
                How::DropBehind(_) => ReadMode::DropBehind,
            };
            reader.reads.push(read);
            if mode == ReadMode::Buffered {
                continue;
            }
            reader.index.insert(key(file), reader.files.len());
            reader.files.push(Source { file, how });
        }
        if reader.needs_scratch() {
            // The environment variable first: what turned io_uring off here, whether or
            // not this process could have used it.
            reader.io = Some(if pool::turned_off_by_env() {
                DirectIo::Threads(IoUringFallback::Environment)
            } else {
                match uring::probe()? {
                    Ok(()) => DirectIo::IoUring {
                        depth: uring::DEPTH,
                    },
                    Err(why) => DirectIo::Threads(why),
                }
            });
        }
        Ok(reader)
    }

    /// Each pool of read threads [`Reader::scratch`] makes claims [`POOL_MAPS`] slots of
    /// `room` (the store's map budget) until it drops: call `scratch` under the store's
    /// map lock, after checking that [`Reader::scratch_maps`] fit.
    pub(crate) fn room(mut self, room: ThreadRoom) -> Self {
        self.room = Some(room);
        self
    }

    /// Direct reads with blocking calls on the loader threads, `io_uring` or not.
    pub(crate) fn without_io_uring(mut self) -> Self {
        if self.io.is_some() {
            self.io = Some(DirectIo::Threads(IoUringFallback::Off));
        }
        self
    }

    /// How the direct reads were issued (`None`: no file was read directly). A loader
    /// whose ring could not be set up makes it [`DirectIo::Threads`] with its reason.
    pub(crate) fn direct_io(&self) -> Option<DirectIo> {
        let late = *self.late.lock().unwrap_or_else(|e| e.into_inner());
        match (self.io, late) {
            (Some(_), Some(why)) => Some(DirectIo::Threads(why)),
            (io, _) => io,
        }
    }

    /// What ran: the requested mode, or [`ReadMode::Buffered`] when a file fell back
    /// (with the first file's reason). For [`ReadMode::Auto`]: the one mode every file
    /// was read in, or `Auto` where some were read buffered and some directly.
    pub(crate) fn outcome(&self) -> (ReadMode, Option<ReadFallback>) {
        if let Some(why) = self.fallback {
            return (ReadMode::Buffered, Some(why));
        }
        if self.requested != ReadMode::Auto {
            return (self.requested, None);
        }
        let direct = self
            .reads
            .iter()
            .filter(|r| r.mode == ReadMode::Direct)
            .count();
        let mode = match direct {
            0 => ReadMode::Buffered,
            n if n == self.reads.len() => ReadMode::Direct,
            _ => ReadMode::Auto,
        };
        (mode, None)
    }

    /// How each file was read and why, in the order the fill named them.
    pub(crate) fn file_reads(&self) -> Vec<FileRead> {
        self.reads.clone()
    }

    /// A bounce buffer for one loader thread (empty unless a file is read directly), with
    /// its own ring when direct reads go through `io_uring`, its pool of read threads
    /// ([`Pool`]) when they do not.
    ///
    /// # Errors
    /// `io_uring_setup` failed with an errno other than `EPERM` or `ENOSYS`, or the
    /// address space has no room for the bounce buffer.
    pub(crate) fn scratch(&self) -> Result<Scratch> {
        let scratch = self.bounce()?;
        let pool = || {
            Queue::Pool(Pool {
                _claim: self.room.as_ref().map(|room| room.claim(POOL_MAPS)),
                ..Pool::default()
            })
        };
        match self.io {
            None => Ok(scratch),
            Some(DirectIo::Threads(_)) => Ok(scratch.with_ring(pool())),
            Some(DirectIo::IoUring { .. }) => match Ring::new()? {
                Ok(ring) => Ok(scratch.with_ring(Queue::Ring(Box::new(ring)))),
                Err(why) => {
                    self.late
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(why);
                    Ok(scratch.with_ring(pool()))
                }
            },
        }
    }

    /// Mappings one loader thread's [`Reader::scratch`] adds: its bounce buffer and its
    /// ring, or while it reads, its read threads (each a stack and its guard, a signal
    /// stack and its guard: counted as a loader thread's).
    pub(crate) fn scratch_maps(&self) -> usize {
        let ring = match self.io {
            None => 0,
            Some(DirectIo::IoUring { .. }) => uring::RING_MAPS,
            Some(DirectIo::Threads(_)) => POOL_MAPS,
        };
        usize::from(self.needs_scratch()) + ring
    }

    /// Mappings of [`Reader::scratch_alone`]: its bounce buffer.
    pub(crate) fn scratch_maps_alone(&self) -> usize {
        usize::from(self.needs_scratch())
    }

    /// A bounce buffer without a ring or read threads: direct reads one blocking call at
    /// a time, for a loader whose map budget has no room for more ([`Reader::scratch`]).
    ///
    /// # Errors
    /// No room in the address space for the bounce buffer.
    pub(crate) fn scratch_alone(&self) -> Result<Scratch> {
        self.bounce()
    }

    fn bounce(&self) -> Result<Scratch> {
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
            None => Ok(Scratch::default()),
            Some((mem, offset)) => Scratch::new(mem.max(crate::page::page_size()), offset),
        }
    }

    /// The memory and file-offset alignment of direct reads of `file` ((1, 1) when it is
    /// not read directly): a buffer at a multiple of the first, read from a multiple of
    /// the second, is read in place ([`Direct::read`]).
    pub(crate) fn alignment(&self, file: &File) -> (usize, usize) {
        match self.index.get(&key(file)).map(|&i| &self.files[i].how) {
            Some(How::Direct(d)) => (
                d.mem_align.max(d.offset_align).max(1),
                d.offset_align.max(1),
            ),
            _ => (1, 1),
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
        let how = source.map(|s| &s.how);
        if let Some(How::Direct(direct)) = how {
            return direct.read(offset, dest, scratch, what);
        }
        let end = offset.saturating_add(dest.len() as u64);
        buffered(file, offset, dest, what)?;
        let Some(How::DropBehind(behind)) = how else {
            return Ok(());
        };
        let advice = match self.stream(file) {
            Some(stream) => stream.after_read(offset, end),
            None => unannounced(behind, offset, end).into_iter().collect(),
        };
        advise(file, advice)
    }

    /// The most bytes of consecutive slots a loader takes at once: [`URING_BATCH`] for
    /// direct reads (through `io_uring` or a loader's read threads), 0 (one slot at a
    /// time) otherwise.
    pub(crate) fn batch_bytes(&self) -> usize {
        match self.io {
            None => 0,
            Some(_) => URING_BATCH,
        }
    }

    /// Whether batches are read with many reads in flight (direct reads, through
    /// `io_uring` or a loader's read threads): a loader then takes consecutive slots
    /// whether or not their pieces continue each other in the file.
    pub(crate) fn queued(&self) -> bool {
        self.io.is_some()
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
            let source = self
                .index
                .get(&key(segments[i].file))
                .map(|&k| &self.files[k]);
            if let (Some(How::Direct(direct)), true) = (source.map(|s| &s.how), scratch.has_ring())
            {
                // Every segment of this file up to the next file's, in flight together.
                let mut j = i + 1;
                while j < segments.len() && std::ptr::eq(segments[j].file, segments[i].file) {
                    j += 1;
                }
                direct.read_queued(&mut segments[i..j], scratch, what)?;
                i = j;
                continue;
            }
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

    /// The end of a fill: each drop-behind file is advised from its start to the end of
    /// what the fill read of it. What the kernel read ahead past that end stays cached for
    /// the next fill (the next layer: usually the next bytes of the file), at most the
    /// device's readahead window (`read_ahead_kb`, twice with asynchronous readahead).
    /// Advising the whole file here threw that window away at every layer boundary: a
    /// cold load of a 16-layer 1 GiB model read 11% more from the device than `cat`
    /// (`getrusage`'s `ru_inblock`: 1,179 against 1,059 MiB) and ran at 0.61× its speed.
    /// With [`Reader::advised`], the advice reaches up to where earlier fills of the
    /// file ended when that is further: what the kernel read ahead there was read already.
    ///
    /// # Errors
    /// `posix_fadvise` fails.
    pub(crate) fn finish(&self) -> Result<()> {
        for source in &self.files {
            if let How::DropBehind(behind) = &source.how {
                let own = self.streams.get(&key(source.file));
                if let (None, Some(shared)) = (own, self.stream(source.file)) {
                    // The placement's record: what this fill read and did not advise,
                    // never what another fill still reads.
                    advise(source.file, shared.flush())?;
                    continue;
                }
                let end = match own {
                    Some(stream) => stream.end(),
                    None => behind.lock().unwrap_or_else(|e| e.into_inner()).high,
                };
                let end = self.advised.map_or(end, |a| a.reach(source.file, end));
                if end > 0 {
                    dont_need(source.file, 0, end)?;
                }
            }
        }
        Ok(())
    }
}

/// `POSIX_FADV_DONTNEED` on each range (one ending at `u64::MAX`: to the end of the file).
fn advise(file: &File, ranges: Vec<(u64, u64)>) -> Result<()> {
    for (low, high) in ranges {
        let len = if high == u64::MAX { 0 } else { high - low };
        dont_need(file, low, len)?;
    }
    Ok(())
}

fn buffered(file: &File, offset: u64, dest: &mut [u8], what: &dyn Fn() -> String) -> Result<()> {
    file.read_exact_at(dest, offset).map_err(|e| {
        Error::io(
            "pread",
            format!(
                "{}: {}: {} bytes at file offset {offset}",
                what(),
                path_of(file),
                dest.len()
            ),
            e,
        )
    })
}

/// A drop-behind read of a file the fill did not announce: the span read so far, rounded
/// out to whole folios, once [`DROP_BEHIND_EVERY`] bytes were read since the last advice.
fn unannounced(behind: &Mutex<Behind>, offset: u64, end: u64) -> Option<(u64, u64)> {
    let mut b = behind.lock().unwrap_or_else(|e| e.into_inner());
    b.low = b.low.min(offset);
    b.high = b.high.max(end);
    b.pending += end - offset;
    if b.pending < DROP_BEHIND_EVERY {
        return None;
    }
    b.pending = 0;
    let low = b.low - b.low % FOLIO_MAX;
    let high = b.high.saturating_add(FOLIO_MAX - 1) / FOLIO_MAX * FOLIO_MAX;
    Some((low, high))
}
