//! Sources of expert bytes, their validation, and the parallel loader that fills slots.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use super::arena::Kind;
use super::budget::MapGate;
use crate::error::{Error, Result};

/// The longest single `pread` the loader issues.
pub const MAX_READ: usize = 1 << 30;

/// Where one expert's bytes come from.
#[derive(Debug, Clone)]
pub enum ExpertSource<'a> {
    /// Bytes already in memory.
    Memory {
        /// The weights.
        weights: &'a [u8],
        /// The scales (may be empty).
        scales: &'a [u8],
    },
    /// Pieces of a file, `(offset, len)`, concatenated into the slot in order (e.g. gate,
    /// up, down). Adjacent pieces are read with one `pread`.
    File {
        /// The open file.
        file: &'a File,
        /// Pieces of the weights.
        weights: Vec<(u64, usize)>,
        /// Pieces of the scales.
        scales: Vec<(u64, usize)>,
    },
}

/// One kind of one expert's source.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Part<'a> {
    Memory(&'a [u8]),
    File(&'a File, &'a [(u64, usize)]),
}

impl<'a> ExpertSource<'a> {
    pub(crate) fn part(&'a self, kind: Kind) -> Part<'a> {
        match (self, kind) {
            (ExpertSource::Memory { weights, .. }, Kind::Weights) => Part::Memory(weights),
            (ExpertSource::Memory { scales, .. }, Kind::Scales) => Part::Memory(scales),
            (ExpertSource::File { file, weights, .. }, Kind::Weights) => Part::File(file, weights),
            (ExpertSource::File { file, scales, .. }, Kind::Scales) => Part::File(file, scales),
        }
    }
}

impl Part<'_> {
    /// The byte count, checking pieces against overflow and the file's length.
    pub(crate) fn checked_len(&self, what: &dyn Fn() -> String) -> Result<usize> {
        const OP: &str = "PinStore::pack_layer";
        match *self {
            Part::Memory(bytes) => Ok(bytes.len()),
            Part::File(file, pieces) => {
                let size = file
                    .metadata()
                    .map_err(|e| Error::io("fstat", what(), e))?
                    .len();
                let mut total: usize = 0;
                for &(offset, len) in pieces {
                    let end = offset.checked_add(len as u64);
                    if end.is_none_or(|end| end > size) {
                        return Err(Error::invalid(
                            OP,
                            format!(
                                "{}: piece at file offset {offset} of {len} bytes runs past the end of the file ({size} bytes)",
                                what()
                            ),
                        ));
                    }
                    total = total.checked_add(len).ok_or_else(|| {
                        Error::invalid(OP, format!("{}: piece lengths overflow", what()))
                    })?;
                }
                Ok(total)
            }
        }
    }
}

/// Adjacent pieces merged, then split at [`MAX_READ`]: `(file offset, slot offset, len)`.
pub(crate) fn plan_reads(pieces: &[(u64, usize)]) -> Vec<(u64, usize, usize)> {
    let mut merged: Vec<(u64, usize, usize)> = Vec::new();
    let mut dest = 0;
    for &(offset, len) in pieces.iter().filter(|p| p.1 > 0) {
        match merged.last_mut() {
            Some(last) if last.0 + last.2 as u64 == offset => last.2 += len,
            _ => merged.push((offset, dest, len)),
        }
        dest += len;
    }
    merged
        .into_iter()
        .flat_map(|(offset, dest, len)| {
            (0..len)
                .step_by(MAX_READ)
                .map(move |done| (offset + done as u64, dest + done, MAX_READ.min(len - done)))
        })
        .collect()
}

/// A slot to fill.
pub(crate) struct Job<'a> {
    pub(crate) dest: &'a mut [u8],
    pub(crate) part: Part<'a>,
    pub(crate) expert: usize,
    pub(crate) kind: Kind,
}

/// Mappings one loader thread adds while it runs, measured on this host (test
/// `loader_thread_map_cost` in tests/hostile.rs): its stack and guard page, the signal
/// stack and guard page Rust's runtime maps inside the new thread, and the glibc malloc
/// arena (2 mappings, never freed; up to 8 × cores of them) its first allocation creates.
/// A thread spawned after another has exited reuses the cached stack and arena and adds
/// only 2; the budget assumes a fresh one.
pub const MAPS_PER_THREAD: usize = 6;

/// Helper threads a fill of `jobs` jobs with `threads` loader threads may spawn (the
/// calling thread is one of the loaders).
pub(crate) fn helpers(threads: usize, jobs: usize) -> usize {
    threads.clamp(1, jobs.max(1)) - 1
}

/// Fills every job's slot with the calling thread and up to `threads - 1` helpers;
/// returns the `pread` count. Stops at the first error.
///
/// Each helper is spawned under a reservation of [`MAPS_PER_THREAD`] mappings from
/// `maps`, held until the helper runs and has made its first allocation: by then its
/// stack, signal stack and malloc arena exist, and the next reservation (this fill's or a
/// concurrent pack's) counts them. A helper whose mappings do not fit, or that cannot be
/// spawned, is not started and leaves its share to the others: the fill itself never
/// fails for want of threads.
pub(crate) fn fill(jobs: Vec<Job<'_>>, threads: usize, maps: &MapGate) -> Result<usize> {
    let reads = AtomicUsize::new(0);
    let helpers = helpers(threads, jobs.len());
    let queue = Mutex::new(jobs);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let started = (Mutex::new(0usize), Condvar::new());
    let work = || {
        loop {
            if first_error.lock().is_ok_and(|e| e.is_some()) {
                return;
            }
            let Some(job) = queue.lock().ok().and_then(|mut q| q.pop()) else {
                return;
            };
            if let Err(e) = fill_one(job, &reads)
                && let Ok(mut slot) = first_error.lock()
            {
                slot.get_or_insert(e);
            }
        }
    };
    let helper = || {
        // The first allocation gives this thread its malloc arena now, under the
        // spawner's reservation, not later outside it.
        drop(std::hint::black_box(Box::new(0u8)));
        let (count, ready) = &started;
        *count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        ready.notify_all();
        work();
    };
    std::thread::scope(|scope| {
        for spawned in 0..helpers {
            let what = || format!("loader thread {} of {threads}", spawned + 2);
            let Ok(reservation) = maps.reserve(what, MAPS_PER_THREAD) else {
                break;
            };
            if std::thread::Builder::new()
                .name("numapin-loader".into())
                .spawn_scoped(scope, helper)
                .is_err()
            {
                break;
            }
            let (count, ready) = &started;
            let mut count = count.lock().unwrap_or_else(|e| e.into_inner());
            while *count <= spawned {
                count = ready.wait(count).unwrap_or_else(|e| e.into_inner());
            }
            drop(reservation);
        }
        work();
    });
    match first_error.into_inner().ok().flatten() {
        Some(e) => Err(e),
        None => Ok(reads.into_inner()),
    }
}

/// Fills one slot on the calling thread.
pub(crate) fn fill_slot(dest: &mut [u8], part: Part<'_>, expert: usize, kind: Kind) -> Result<()> {
    fill_one(
        Job {
            dest,
            part,
            expert,
            kind,
        },
        &AtomicUsize::new(0),
    )
}

fn fill_one(job: Job<'_>, reads: &AtomicUsize) -> Result<()> {
    match job.part {
        Part::Memory(bytes) => {
            job.dest[..bytes.len()].copy_from_slice(bytes);
            Ok(())
        }
        Part::File(file, pieces) => {
            for (offset, dest, len) in plan_reads(pieces) {
                reads.fetch_add(1, Ordering::Relaxed);
                file.read_exact_at(&mut job.dest[dest..dest + len], offset)
                    .map_err(|e| {
                        Error::io(
                            "pread",
                            format!(
                                "expert {} {}: {len} bytes at file offset {offset}",
                                job.expert,
                                job.kind.name()
                            ),
                            e,
                        )
                    })?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_pieces_coalesce_and_others_do_not() {
        assert_eq!(
            plan_reads(&[(0, 10), (10, 5), (20, 5)]),
            vec![(0, 0, 15), (20, 15, 5)]
        );
        assert_eq!(
            plan_reads(&[(20, 5), (0, 10)]),
            vec![(20, 0, 5), (0, 5, 10)]
        );
        assert_eq!(plan_reads(&[(0, 0), (4, 4)]), vec![(4, 0, 4)]);
        assert!(plan_reads(&[]).is_empty());
    }

    #[test]
    fn reads_split_at_one_gib() {
        let big = MAX_READ * 2 + 7;
        assert_eq!(
            plan_reads(&[(100, big)]),
            vec![
                (100, 0, MAX_READ),
                (100 + MAX_READ as u64, MAX_READ, MAX_READ),
                (100 + 2 * MAX_READ as u64, 2 * MAX_READ, 7)
            ]
        );
    }
}
