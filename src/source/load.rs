//! The parallel loader: fills slots from their sources with the calling thread and a few
//! helper threads, reading adjacent file pieces with one `pread`.

use std::collections::BTreeSet;
use std::fs::File;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread::Scope;

pub(crate) use super::progress::Meter;
pub(crate) use super::read::{Reader, Scratch, Segment};
use super::{Kind, Piece, Tensor};
use crate::error::{Error, Result};
use crate::node::Node;

mod on_node;

pub(crate) use on_node::{OnNode, running_on};

/// The longest single `pread` the loader issues.
pub const MAX_READ: usize = 1 << 30;

/// Mappings one loader thread adds while it runs, measured on this host (test
/// `loader_thread_map_cost` in tests/hostile.rs): its stack and guard page, the signal
/// stack and guard page Rust's runtime maps inside the new thread, and the glibc malloc
/// arena (2 mappings, never freed; up to 8 × cores of them) its first allocation creates.
/// A thread spawned after another has exited reuses the cached stack and arena and adds
/// only 2; the budget assumes a fresh one.
pub const LOADER_THREAD_MAPS: usize = 6;

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
fn gather_run(reads: &[Read<'_>]) -> usize {
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
fn gather_read(
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

/// A slot to fill.
pub(crate) struct Job<'a> {
    pub(crate) dest: &'a mut [u8],
    pub(crate) tensor: Tensor<'a>,
    /// Says which slot this is, for error messages (`"layer 3 expert 7 weights"`).
    pub(crate) what: (usize, usize, Kind),
}

/// Helper threads a fill of `jobs` jobs with `threads` loader threads may spawn (the
/// calling thread is one of the loaders).
pub(crate) fn helpers(threads: usize, jobs: usize) -> usize {
    threads.clamp(1, jobs.max(1)) - 1
}

/// How a fill reads and reports: the per-file readers, the caller's bounce buffer, and
/// the progress meter.
pub(crate) struct Loading<'r, 'a> {
    pub(crate) reader: &'r Reader<'a>,
    /// The calling thread's bounce buffer ([`Reader::scratch`]; helpers make their own).
    pub(crate) scratch: Scratch,
    pub(crate) meter: Option<&'r Meter<'r>>,
    /// The node an expert's slots are bound to (by expert index), when one: a loader
    /// runs on that node's CPUs while it fills them (see [`OnNode`]).
    pub(crate) target: &'r (dyn Fn(usize) -> Option<Node> + Sync),
    /// Nodes to spread the loader threads over when slots have no single node
    /// (interleaved memory): loader `w` runs on the CPUs of `spread[w % len]` for the
    /// whole fill. Empty: loaders stay where the scheduler puts them.
    pub(crate) spread: &'r [Node],
}

/// What a fill did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Filled {
    /// `pread` calls (planned reads, after coalescing).
    pub(crate) reads: usize,
    /// Slot bytes the direct reads copied out of the loaders' bounce buffers (not landed
    /// in place).
    pub(crate) bounced_bytes: u64,
    /// Bytes written by a loader that was on the CPUs filling the slot's target node (its
    /// own, or the nearest node's for a node without CPUs) when it finished it.
    pub(crate) local_bytes: u64,
    /// Loader threads that could not be moved onto the node's CPUs (none of them in the
    /// thread's allowed set, or `sched_setaffinity` refused) and loaded from where they
    /// were.
    pub(crate) off_node_loaders: usize,
    /// The nodes whose CPUs the loader threads were moved onto, spread
    /// ([`Loading::spread`]) or following their slots' node ([`Loading::target`]); a node
    /// without CPUs is loaded from the nearest node with some. Distinct and sorted; empty
    /// when no loader moved.
    pub(crate) loader_nodes: Vec<Node>,
}

/// Fills every job's slot with the calling thread and up to `threads - 1` helpers,
/// each on the CPUs of the node its slots are bound to ([`Loading::target`]) (see [`OnNode`]); returns the `pread`
/// count (planned reads, after coalescing) and the bytes written on the node. Stops at
/// the first error. Ends with the reader's end-of-fill advice and, on success, the final progress
/// report.
///
/// Each helper is spawned under a `permit(helper_number)`, held until the helper runs and
/// has made its first allocation (and its bounce buffer, for direct reads): by then its
/// stack, signal stack and malloc arena exist, and whoever grants the next permit counts
/// them (the store's map budget). A helper without a permit, or that cannot be spawned,
/// is not started and leaves its share to the others: the fill itself never fails for
/// want of threads.
pub(crate) fn fill<P>(
    jobs: Vec<Job<'_>>,
    threads: usize,
    loading: Loading<'_, '_>,
    permit: impl Fn(usize) -> Option<P>,
) -> Result<Filled> {
    let helpers = helpers(threads, jobs.len());
    let (fill, scratch) = Fill::new(jobs, loading);
    std::thread::scope(|scope| {
        fill.spawn_helpers(scope, helpers, permit);
        fill.work(0, scratch);
    });
    fill.finish()
}

/// What the loader threads of one [`fill`] share: the queue of jobs, how to read, and
/// what they did.
struct Fill<'j, 'r, 'a> {
    reader: &'r Reader<'a>,
    meter: Option<&'r Meter<'r>>,
    target: &'r (dyn Fn(usize) -> Option<Node> + Sync),
    spread: &'r [Node],
    /// The most bytes of consecutive slots a loader takes at once ([`take`]; 0: one).
    batch: usize,
    /// The jobs, reversed: taken from the end in the order given.
    queue: Mutex<Vec<Job<'j>>>,
    first_error: Mutex<Option<Error>>,
    /// Helpers that have started (made their first allocation), and the signal for it.
    started: (Mutex<usize>, Condvar),
    reads: AtomicUsize,
    bounced: AtomicU64,
    local_bytes: AtomicU64,
    off_node: AtomicUsize,
    loader_nodes: Mutex<BTreeSet<Node>>,
}

impl<'j, 'r, 'a> Fill<'j, 'r, 'a> {
    /// The shared state of a fill of `jobs`, and the calling thread's bounce buffer.
    fn new(mut jobs: Vec<Job<'j>>, loading: Loading<'r, 'a>) -> (Self, Scratch) {
        let Loading {
            reader,
            scratch,
            meter,
            target,
            spread,
        } = loading;
        // Jobs are taken from the end: reversed, they are taken in the order given (file
        // order, usually, which the kernel's readahead rewards on a cold file).
        jobs.reverse();
        let fill = Fill {
            reader,
            meter,
            target,
            spread,
            batch: reader.batch_bytes(),
            queue: Mutex::new(jobs),
            first_error: Mutex::new(None),
            started: (Mutex::new(0), Condvar::new()),
            reads: AtomicUsize::new(0),
            bounced: AtomicU64::new(0),
            local_bytes: AtomicU64::new(0),
            off_node: AtomicUsize::new(0),
            loader_nodes: Mutex::new(BTreeSet::new()),
        };
        (fill, scratch)
    }

    /// Spawns up to `helpers` helper threads in `scope`, each under its permit, held
    /// until the helper has started; stops at the first permit refused or spawn failed.
    fn spawn_helpers<'scope, P>(
        &'scope self,
        scope: &'scope Scope<'scope, '_>,
        helpers: usize,
        permit: impl Fn(usize) -> Option<P>,
    ) {
        for spawned in 0..helpers {
            let Some(permit) = permit(spawned) else {
                break;
            };
            if std::thread::Builder::new()
                .name("numapin-loader".into())
                .spawn_scoped(scope, move || self.helper(spawned + 1))
                .is_err()
            {
                break;
            }
            let (count, ready) = &self.started;
            let mut count = count.lock().unwrap_or_else(|e| e.into_inner());
            while *count <= spawned {
                count = ready.wait(count).unwrap_or_else(|e| e.into_inner());
            }
            drop(permit);
        }
    }

    /// A helper thread: says it has started once its mappings exist, then works.
    fn helper(&self, worker: usize) {
        // The first allocation gives this thread its malloc arena now, under the
        // spawner's permit, not later outside it; so does the bounce buffer.
        drop(std::hint::black_box(Box::new(0u8)));
        let scratch = match self.reader.scratch() {
            Ok(scratch) => scratch,
            Err(e) => {
                if let Ok(mut slot) = self.first_error.lock() {
                    slot.get_or_insert(e);
                }
                Scratch::default()
            }
        };
        let (count, ready) = &self.started;
        *count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        ready.notify_all();
        self.work(worker, scratch);
    }

    /// Loader `worker`: takes batches until the queue is empty or a loader has failed,
    /// then counts what its bounce buffer copied.
    fn work(&self, worker: usize, mut scratch: Scratch) {
        self.take_batches(worker, &mut scratch);
        self.bounced.fetch_add(scratch.bounced(), Ordering::Relaxed);
    }

    fn take_batches(&self, worker: usize, scratch: &mut Scratch) {
        // Spread over the nodes of interleaved memory: each loader stays on one node's
        // CPUs for the whole fill (its affinity comes back when `_spread` drops).
        let _spread = self.enter_spread(worker);
        // The node this thread was moved to (or tried to be), and the guard that moves it
        // back.
        let mut on_node: Option<(Node, OnNode)> = None;
        let mut counted_off_node = false;
        loop {
            if self.first_error.lock().is_ok_and(|e| e.is_some()) {
                return;
            }
            let batch = match self.queue.lock() {
                Ok(mut q) => take(&mut q, self.batch),
                Err(_) => Vec::new(),
            };
            if batch.is_empty() {
                return;
            }
            // A batch is consecutive slots of one file; it may cross a block boundary of
            // a split layer, and is then loaded from its first slot's node.
            let node = (self.target)(batch[0].what.1);
            if let Some(node) = node
                && on_node.as_ref().is_none_or(|(n, _)| *n != node)
            {
                drop(on_node.take()); // back to the thread's own affinity first
                let entered = OnNode::enter(node);
                if !entered.moved() && !counted_off_node {
                    counted_off_node = true;
                    self.off_node.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(host) = entered.node()
                    && let Ok(mut nodes) = self.loader_nodes.lock()
                {
                    nodes.insert(host);
                }
                on_node = Some((node, entered));
            }
            // Local: written from the CPUs that fill the node (its own, or the nearest
            // node's for a node without CPUs; see `OnNode`).
            let host = node.map(|n| {
                on_node
                    .as_ref()
                    .and_then(|(_, guard)| guard.node())
                    .unwrap_or(n)
            });
            self.load(batch, host, scratch);
        }
    }

    /// Moves loader `worker` onto its node of [`Loading::spread`], if there is one.
    fn enter_spread(&self, worker: usize) -> Option<OnNode> {
        let spread = self.spread;
        spread.get(worker % spread.len().max(1)).map(|&node| {
            let entered = OnNode::enter(node);
            if let Some(host) = entered.node()
                && let Ok(mut nodes) = self.loader_nodes.lock()
            {
                nodes.insert(host);
            }
            entered
        })
    }

    /// Fills one batch and accounts for it: the bytes written from `host` (the node whose
    /// CPUs fill its first slot's node, if it is bound to one) and the progress, or the
    /// first error.
    fn load(&self, batch: Vec<Job<'_>>, host: Option<Node>, scratch: &mut Scratch) {
        // A cancelled load takes no new slot; `finish` reports the cancellation.
        if self.meter.is_some_and(|m| m.cancelled()) {
            return;
        }
        let sizes: Vec<usize> = batch.iter().map(|job| job.tensor.len()).collect();
        let batch_bytes: u64 = sizes.iter().map(|&n| n as u64).sum();
        let result = if batch.len() == 1 {
            batch
                .into_iter()
                .try_for_each(|job| fill_one(job, &self.reads, self.reader, scratch))
        } else {
            fill_batch(batch, &self.reads, self.reader, scratch)
        };
        match result {
            Ok(()) => {
                if host.is_some_and(running_on) {
                    self.local_bytes.fetch_add(batch_bytes, Ordering::Relaxed);
                }
                if let Some(meter) = self.meter {
                    for bytes in sizes {
                        meter.slot_done(bytes as u64);
                    }
                }
            }
            Err(e) => {
                if let Ok(mut slot) = self.first_error.lock() {
                    slot.get_or_insert(e);
                }
            }
        }
    }

    /// After every loader has returned: the reader's end-of-fill advice, then the first
    /// error, or the final progress report and what the fill did.
    fn finish(self) -> Result<Filled> {
        let finished = self.reader.finish();
        if let Some(e) = self.first_error.into_inner().ok().flatten() {
            return Err(e);
        }
        finished?;
        if let Some(meter) = self.meter {
            if !meter.cancelled() {
                meter.finish();
            }
            if meter.cancelled() {
                return Err(Error::Cancelled {
                    op: "PinStore::pack_layer",
                    layer: meter.layer(),
                });
            }
        }
        Ok(Filled {
            reads: self.reads.into_inner(),
            bounced_bytes: self.bounced.into_inner(),
            local_bytes: self.local_bytes.into_inner(),
            off_node_loaders: self.off_node.into_inner(),
            loader_nodes: self
                .loader_nodes
                .into_inner()
                .map(|n| n.into_iter().collect())
                .unwrap_or_default(),
        })
    }
}

/// The next job from the (reversed) queue; with a `batch` of bytes, also the jobs after it
/// whose file pieces continue it in the same file, up to `batch` bytes in all.
fn take<'a>(queue: &mut Vec<Job<'a>>, batch_bytes: usize) -> Vec<Job<'a>> {
    let Some(first) = queue.pop() else {
        return Vec::new();
    };
    let mut bytes = first.tensor.len();
    let mut end = last_end(&first.tensor);
    let mut batch = vec![first];
    if batch_bytes == 0 {
        return batch;
    }
    while let Some(next) = queue.last() {
        let (Some((file, at)), Tensor::File(pieces)) = (end, next.tensor) else {
            break;
        };
        let continues = pieces
            .iter()
            .find(|p| p.len > 0)
            .is_some_and(|p| std::ptr::eq(p.file, file) && p.offset == at);
        let len = next.tensor.len();
        if !continues || bytes + len > batch_bytes {
            break;
        }
        bytes += len;
        end = last_end(&next.tensor);
        batch.extend(queue.pop());
    }
    batch
}

/// Where a file tensor's last piece ends: its file and offset.
fn last_end<'a>(tensor: &Tensor<'a>) -> Option<(&'a File, u64)> {
    match *tensor {
        Tensor::Memory(_) => None,
        Tensor::File(pieces) => pieces
            .iter()
            .rev()
            .find(|p| p.len > 0)
            .map(|p| (p.file, p.offset + p.len as u64)),
    }
}

/// Fills consecutive file slots with one set of segments, so that runs across slots are
/// read together.
fn fill_batch(
    batch: Vec<Job<'_>>,
    reads: &AtomicUsize,
    reader: &Reader<'_>,
    scratch: &mut Scratch,
) -> Result<()> {
    let first = batch[0].what;
    let last = batch[batch.len() - 1].what;
    let what = || {
        format!(
            "layer {} expert {} {} to expert {} {}",
            first.0,
            first.1,
            first.2.name(),
            last.1,
            last.2.name()
        )
    };
    let mut segments = Vec::new();
    for job in batch {
        let Tensor::File(pieces) = job.tensor else {
            return Err(Error::invalid(
                "load",
                format!("{}: not a file batch", what()),
            ));
        };
        let room = job.dest.len();
        let mut rest: &mut [u8] = job.dest;
        let mut at = 0;
        for read in plan_reads(pieces) {
            reads.fetch_add(1, Ordering::Relaxed);
            let fits = read.dest >= at && read.dest + read.len <= room;
            if !fits {
                return Err(Error::invalid(
                    "load",
                    format!(
                        "{}: {} bytes at file offset {} do not fit a slot of {room}",
                        what(),
                        read.len,
                        read.offset
                    ),
                ));
            }
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(read.dest - at);
            let (dest, tail) = tail.split_at_mut(read.len);
            rest = tail;
            at = read.dest + read.len;
            segments.push(Segment {
                file: read.file,
                offset: read.offset,
                dest,
            });
        }
    }
    reader.read_segments(&mut segments, scratch, &what)
}

/// Fills one slot on the calling thread, with buffered reads.
pub(crate) fn fill_slot(job: Job<'_>) -> Result<()> {
    fill_one(
        job,
        &AtomicUsize::new(0),
        &Reader::buffered(),
        &mut Scratch::default(),
    )
}

fn fill_one(
    job: Job<'_>,
    reads: &AtomicUsize,
    reader: &Reader<'_>,
    scratch: &mut Scratch,
) -> Result<()> {
    let (layer, expert, kind) = job.what;
    match job.tensor {
        Tensor::Memory(bytes) => {
            let room = job.dest.len();
            let dest = job.dest.get_mut(..bytes.len()).ok_or_else(|| {
                Error::too_large(
                    "load",
                    format!("layer {layer} expert {expert} {}", kind.name()),
                    bytes.len(),
                    room,
                    "a slot",
                )
            })?;
            dest.copy_from_slice(bytes);
            Ok(())
        }
        Tensor::File(pieces) => {
            let what = || format!("layer {layer} expert {expert} {}", kind.name());
            let room = job.dest.len();
            let planned = plan_reads(pieces);
            let mut gather = Vec::new();
            let mut at = 0;
            while at < planned.len() {
                let n = gather_run(&planned[at..]);
                if n > 1 {
                    let run = &planned[at..at + n];
                    reads.fetch_add(1, Ordering::Relaxed);
                    gather_read(run, job.dest, &mut gather, (reader, &mut *scratch), &what)?;
                    at += n;
                    continue;
                }
                let read = planned[at];
                at += 1;
                reads.fetch_add(1, Ordering::Relaxed);
                let window = read
                    .dest
                    .checked_add(read.len)
                    .and_then(|end| job.dest.get_mut(read.dest..end))
                    .ok_or_else(|| {
                        Error::invalid(
                            "load",
                            format!(
                                "{}: {} bytes at file offset {} do not fit a slot of {}",
                                what(),
                                read.len,
                                read.offset,
                                room
                            ),
                        )
                    })?;
                reader.read(read.file, read.offset, window, scratch, &what)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
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
