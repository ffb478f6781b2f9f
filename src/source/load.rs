//! The parallel loader: fills slots from their sources with the calling thread and a few
//! helper threads, reading adjacent file pieces with one `pread`.

use std::collections::BTreeSet;
use std::fs::File;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread::Scope;

pub(crate) use super::behind::{Advised, Shared as SharedBehind};
pub(crate) use super::progress::Meter;
pub(crate) use super::read::{Reader, Scratch, Segment};
use super::{DirectReads, Kind, Piece, Tensor};
use crate::error::{Error, Result};
use crate::node::Node;

mod on_node;
mod plan;

pub(crate) use on_node::{OnNode, running_on};
pub(crate) use plan::plan_reads;
use plan::{gather_read, gather_run};

/// The longest single `pread` the loader issues.
pub const MAX_READ: usize = 1 << 30;

/// Mappings one loader thread adds while it runs, measured on this host (test
/// `loader_thread_map_cost` in tests/hostile.rs): its stack and guard page, the signal
/// stack and guard page Rust's runtime maps inside the new thread, and the glibc malloc
/// arena (2 mappings, never freed; up to 8 × cores of them) its first allocation creates.
/// A thread spawned after another has exited reuses the cached stack and arena and adds
/// only 2; the budget assumes a fresh one.
pub const LOADER_THREAD_MAPS: usize = 6;

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
    /// What the direct reads did.
    pub(crate) direct: DirectReads,
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
    /// Whether a batch may join slots whose pieces do not continue each other in the
    /// file (direct reads through `io_uring`: the whole batch is in flight at once).
    loose: bool,
    /// The jobs, reversed: taken from the end in the order given.
    queue: Mutex<Vec<Job<'j>>>,
    first_error: Mutex<Option<Error>>,
    /// Helpers that have started (made their first allocation), and the signal for it.
    started: (Mutex<usize>, Condvar),
    reads: AtomicUsize,
    bounced: AtomicU64,
    in_place: AtomicU64,
    blocking: AtomicU64,
    ring_reads: AtomicU64,
    peak: AtomicUsize,
    blocking_peak: AtomicUsize,
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
            loose: reader.queued(),
            queue: Mutex::new(jobs),
            first_error: Mutex::new(None),
            started: (Mutex::new(0), Condvar::new()),
            reads: AtomicUsize::new(0),
            bounced: AtomicU64::new(0),
            in_place: AtomicU64::new(0),
            blocking: AtomicU64::new(0),
            ring_reads: AtomicU64::new(0),
            peak: AtomicUsize::new(0),
            blocking_peak: AtomicUsize::new(0),
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
            if crate::diag::threads_in_address_space() == 0 {
                break;
            }
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
        let counts = scratch.counts();
        self.in_place
            .fetch_add(counts.in_place_bytes, Ordering::Relaxed);
        self.blocking
            .fetch_add(counts.blocking_reads, Ordering::Relaxed);
        self.ring_reads
            .fetch_add(counts.uring_reads, Ordering::Relaxed);
        self.peak.fetch_max(counts.uring_depth, Ordering::Relaxed);
        self.blocking_peak
            .fetch_max(counts.blocking_depth, Ordering::Relaxed);
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
                Ok(mut q) => take(&mut q, self.batch, self.loose.then_some(self.target)),
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
        let single = batch.len() == 1 && !(self.reader.queued() && queueable(&batch[0]));
        let result = if single {
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
            direct: DirectReads {
                in_place_bytes: self.in_place.into_inner(),
                blocking_reads: self.blocking.into_inner(),
                uring_reads: self.ring_reads.into_inner(),
                uring_depth: self.peak.into_inner(),
                blocking_depth: self.blocking_peak.into_inner(),
            },
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
/// whose file pieces continue it in the same file, up to `batch` bytes in all. With
/// `loose` (the slots' target node, for direct reads through `io_uring`), any file jobs
/// after it whose slots have the same target node.
fn take<'a>(
    queue: &mut Vec<Job<'a>>,
    batch_bytes: usize,
    loose: Option<&(dyn Fn(usize) -> Option<Node> + Sync)>,
) -> Vec<Job<'a>> {
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
        let continues = match loose {
            Some(target) => target(next.what.1) == target(batch[0].what.1),
            None => pieces
                .iter()
                .find(|p| p.len > 0)
                .is_some_and(|p| std::ptr::eq(p.file, file) && p.offset == at),
        };
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

/// Whether a single job is read with the batch path (file pieces, no strided rows
/// to gather).
fn queueable(job: &Job<'_>) -> bool {
    match job.tensor {
        Tensor::Memory(_) => false,
        Tensor::File(pieces) => {
            let planned = plan_reads(pieces);
            (0..planned.len()).all(|at| gather_run(&planned[at..]) <= 1)
        }
    }
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
