//! The verify's reads: ranges of the files compared with the bytes placed from them,
//! re-read in the load's read mode with many reads in flight.
//!
//! Every range ([`Compare`]) is cut into parts of at most [`WINDOW`] bytes, the parts
//! sorted by file and offset and joined into windows of the file (gaps of at most
//! [`GAP`] bytes read through), and the windows shared out to a few threads. Each thread
//! reads a window into its own buffer, aligned for direct I/O and starting at an aligned
//! file offset, so that a direct read lands in it with the whole window on the thread's
//! `io_uring` at once ([`uring::CHUNK`](super::uring::CHUNK) a request), and compares it
//! with every copy of every part it holds, in place: no tensor-sized buffer is allocated,
//! and the page cache is not filled by a direct verify. A failed read stops every thread;
//! the first error is returned.

use std::fs::File;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::DirectReads;
use super::read::{Reader, Scratch};
use crate::error::{Error, Result};
use crate::region::{Advice, Region};

/// The most file bytes one thread reads and compares at once.
pub(crate) const WINDOW: usize = 32 << 20;

/// The most bytes between two ranges of one file read through to join them in a window.
pub(crate) const GAP: u64 = 64 << 10;

/// Threads a verify reads with: the CPUs (as the load's default loader threads), at
/// least 2 so that one compares while the other's reads are in flight.
pub(crate) fn threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8))
}

/// Bytes of a file that every copy must hold.
pub(crate) struct Compare<'a> {
    pub(crate) file: &'a File,
    pub(crate) offset: u64,
    /// Each copy of the bytes (all of one length).
    pub(crate) copies: Vec<&'a [u8]>,
    /// Who the bytes belong to (reported with a difference).
    pub(crate) tag: usize,
    /// Where these bytes start in the tag's bytes.
    pub(crate) at: usize,
    /// What the bytes are counted under in [`Compared::busy`] (a class).
    pub(crate) group: usize,
}

impl Compare<'_> {
    fn len(&self) -> usize {
        self.copies.first().map_or(0, |b| b.len())
    }
}

/// The first difference found in one copy of a tag's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Difference {
    pub(crate) tag: usize,
    pub(crate) copy: usize,
    /// The first differing byte, from the start of the tag's bytes.
    pub(crate) at: usize,
    /// Its file offset.
    pub(crate) file_offset: u64,
}

/// What [`compare`] did and found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Compared {
    /// Windows read (one [`Reader::read`] each).
    pub(crate) reads: usize,
    /// File bytes read (gaps and alignment included).
    pub(crate) read_bytes: u64,
    /// How the direct reads were issued.
    pub(crate) direct: DirectReads,
    /// The first difference per tag and copy, sorted by tag then copy.
    pub(crate) differences: Vec<Difference>,
    /// Per group ([`Compare::group`]): the threads' nanoseconds reading and comparing
    /// its bytes, each window's shared out by the bytes of its parts.
    pub(crate) busy: Vec<u64>,
}

/// The threads' window buffers, kept for every [`compare`] of one verify: fresh memory
/// costs its first touch (much of a verify's time on a VM that backs guest pages on
/// first use), so each buffer is faulted in once.
///
/// Each is an anonymous mapping aligned to 2 MiB and advised `MADV_HUGEPAGE`, as the
/// stores' slots are: a direct read into huge pages is a few long segments, where one into
/// base pages is a segment per 4 KiB page and a 4 MiB request splits into several (the
/// disk here takes 254 segments a request).
#[derive(Default)]
pub(crate) struct Buffers(Mutex<Vec<Region>>);

/// The alignment of a window buffer: a huge page.
const HUGE_PAGE: usize = 2 << 20;

impl Buffers {
    fn take(&self) -> Option<Region> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    fn put(&self, buffer: Option<Region>) {
        if let Some(buffer) = buffer {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(buffer);
        }
    }
}

/// A window buffer of at least `len` bytes, aligned to 2 MiB and advised to huge pages
/// (where the kernel has them).
fn window_buffer(len: usize) -> Result<Region> {
    let region = Region::anonymous_aligned(len.next_multiple_of(HUGE_PAGE), HUGE_PAGE)?;
    // Only advice: a kernel without transparent huge pages reads into base pages.
    let _ = region.advise(Advice::HugePage);
    Ok(region)
}

/// A run of one file read at once, and the parts it holds.
struct Window {
    file: usize,
    start: u64,
    end: u64,
    parts: std::ops::Range<usize>,
}

/// Compares every range with the files, read through `reader` by up to `threads`
/// threads into `buffers`. `what` names the verify in errors.
///
/// # Errors
/// A read fails (or the file ends before a range): the first one.
pub(crate) fn compare(
    (reader, buffers): (&Reader<'_>, &Buffers),
    threads: usize,
    compares: Vec<Compare<'_>>,
    what: &(dyn Fn() -> String + Sync),
) -> Result<Compared> {
    let mut parts: Vec<Compare<'_>> = Vec::with_capacity(compares.len());
    for c in compares {
        let len = c.len();
        for from in (0..len).step_by(WINDOW) {
            let to = (from + WINDOW).min(len);
            parts.push(Compare {
                file: c.file,
                offset: c.offset + from as u64,
                copies: c.copies.iter().map(|b| &b[from..to]).collect(),
                tag: c.tag,
                at: c.at + from,
                group: c.group,
            });
        }
    }
    let key = |f: &File| f as *const File as usize;
    parts.sort_by_key(|p| (key(p.file), p.offset));
    let windows = windows(&parts, &|f| key(f));
    let threads = threads
        .clamp(1, windows.len().max(1))
        .min(crate::diag::threads_in_address_space().saturating_add(1));
    let shared = Shared {
        next: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        error: Mutex::new(None),
        done: Mutex::new(Compared::default()),
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|| shared.work((reader, buffers), &parts, &windows, what));
        }
        shared.work((reader, buffers), &parts, &windows, what);
    });
    if let Some(e) = shared.error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    let mut done = shared.done.into_inner().unwrap_or_else(|e| e.into_inner());
    done.differences.sort_by_key(|d| (d.tag, d.copy, d.at));
    done.differences.dedup_by_key(|d| (d.tag, d.copy));
    Ok(done)
}

/// The parts (sorted by file and offset) joined into windows of at most [`WINDOW`]
/// bytes of one file with gaps of at most [`GAP`].
fn windows(parts: &[Compare<'_>], key: &dyn Fn(&File) -> usize) -> Vec<Window> {
    let mut out: Vec<Window> = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        let end = p.offset + p.len() as u64;
        if let Some(w) = out.last_mut() {
            let same = key(parts[w.parts.start].file) == key(p.file);
            if same && p.offset <= w.end.saturating_add(GAP) && end - w.start <= WINDOW as u64 {
                w.end = w.end.max(end);
                w.parts.end = i + 1;
                continue;
            }
        }
        out.push(Window {
            file: i,
            start: p.offset,
            end,
            parts: i..i + 1,
        });
    }
    out
}

struct Shared {
    next: AtomicUsize,
    stop: AtomicBool,
    error: Mutex<Option<Error>>,
    done: Mutex<Compared>,
}

impl Shared {
    fn work(
        &self,
        (reader, buffers): (&Reader<'_>, &Buffers),
        parts: &[Compare<'_>],
        windows: &[Window],
        what: &(dyn Fn() -> String + Sync),
    ) {
        let mut mine = Compared::default();
        let mut buffer = buffers.take();
        let result = reader.scratch().and_then(|mut scratch| {
            let io = (reader, &mut scratch, &mut buffer);
            let result = self.take(io, parts, windows, &mut mine, what);
            mine.direct = scratch.counts();
            result
        });
        buffers.put(buffer);
        if let Err(e) = result {
            self.stop.store(true, Ordering::Relaxed);
            self.error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(e);
        }
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        done.reads += mine.reads;
        done.read_bytes += mine.read_bytes;
        done.direct = done.direct.plus(mine.direct);
        done.differences.append(&mut mine.differences);
        if done.busy.len() < mine.busy.len() {
            done.busy.resize(mine.busy.len(), 0);
        }
        for (all, own) in done.busy.iter_mut().zip(&mine.busy) {
            *all += own;
        }
    }

    fn take(
        &self,
        (reader, scratch, buffer): (&Reader<'_>, &mut Scratch, &mut Option<Region>),
        parts: &[Compare<'_>],
        windows: &[Window],
        mine: &mut Compared,
        what: &(dyn Fn() -> String + Sync),
    ) -> Result<()> {
        while !self.stop.load(Ordering::Relaxed) {
            let Some(w) = windows.get(self.next.fetch_add(1, Ordering::Relaxed)) else {
                return Ok(());
            };
            let started = std::time::Instant::now();
            let file = parts[w.file].file;
            let (mem, offset_align) = reader.alignment(file);
            // An aligned start: a direct read lands in the buffer with no bounced head.
            let start = w.start - w.start % offset_align as u64;
            let len = usize::try_from(w.end - start).unwrap_or(usize::MAX);
            let need = len + mem.saturating_sub(HUGE_PAGE);
            if buffer.as_ref().is_none_or(|b| b.len() < need) {
                *buffer = Some(window_buffer((WINDOW + offset_align).max(need))?);
            }
            let Some(region) = buffer.as_mut() else {
                return Ok(());
            };
            let memory = region.as_mut_slice()?;
            let base = memory.as_ptr().align_offset(mem);
            let bytes = &mut memory[base..base + len];
            reader.read(file, start, bytes, scratch, what)?;
            mine.reads += 1;
            mine.read_bytes += len as u64;
            for p in &parts[w.parts.clone()] {
                let from = (p.offset - start) as usize;
                for (copy, held) in p.copies.iter().enumerate() {
                    let file_bytes = &bytes[from..from + held.len()];
                    if *held != file_bytes {
                        let i = (0..held.len())
                            .find(|&i| held[i] != file_bytes[i])
                            .unwrap_or(0);
                        mine.differences.push(Difference {
                            tag: p.tag,
                            copy,
                            at: p.at + i,
                            file_offset: p.offset + i as u64,
                        });
                    }
                }
            }
            let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let parts = &parts[w.parts.clone()];
            let total: u64 = parts.iter().map(|p| p.len() as u64).sum::<u64>().max(1);
            for p in parts {
                if mine.busy.len() <= p.group {
                    mine.busy.resize(p.group + 1, 0);
                }
                let share = u128::from(nanos) * p.len() as u128 / u128::from(total);
                mine.busy[p.group] += u64::try_from(share).unwrap_or(u64::MAX);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::ReadMode;

    /// A file of `len` bytes `(i * 7 + i / 251) % 256` on the target directory's disk.
    fn pattern(name: &str, len: usize) -> (std::path::PathBuf, File, Vec<u8>) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target")
            .join(format!("compare-unit-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| ((i * 7 + i / 251) % 256) as u8).collect();
        let path = dir.join("f");
        std::fs::write(&path, &bytes).unwrap();
        (dir, File::open(&path).unwrap(), bytes)
    }

    #[test]
    fn every_difference_is_found_at_its_first_byte_in_every_mode() {
        let len = 2 * WINDOW + 3 * 4096 + 123;
        let (dir, file, bytes) = pattern("diff", len);
        // Ranges: unaligned, across windows, overlapping, adjacent, at the file's end,
        // one larger than a window, one past a gap larger than GAP.
        let ranges: [(usize, usize); 7] = [
            (17, 1000),
            (1017, 5000),
            (3000, 9000),
            (WINDOW - 100, 300),
            (WINDOW + 50, WINDOW + 4096),
            (2 * WINDOW + 8192, 4096 + 123 + 4096 - 8192 + 4096),
            (9000 + GAP as usize * 3, 77),
        ];
        // Copies: the file's bytes, and copies with one byte changed (copy 1) or two.
        let mut held: Vec<Vec<Vec<u8>>> = Vec::new();
        for (t, &(o, n)) in ranges.iter().enumerate() {
            let good = bytes[o..o + n].to_vec();
            let mut one = good.clone();
            let mut two = good.clone();
            one[(t * 131) % n] ^= 1;
            two[n - 1] ^= 0x80;
            two[n / 2] ^= 0x40;
            held.push(vec![good, one, two]);
        }
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            let reader = Reader::new(mode, [&file]).unwrap();
            let compares: Vec<Compare<'_>> = ranges
                .iter()
                .zip(&held)
                .enumerate()
                .map(|(t, (&(o, _), copies))| Compare {
                    file: &file,
                    offset: o as u64,
                    copies: copies.iter().map(|c| &c[..]).collect(),
                    tag: t,
                    at: 10,
                    group: t % 2,
                })
                .collect();
            let buffers = Buffers::default();
            let done = compare((&reader, &buffers), 3, compares, &|| "t".into()).unwrap();
            // The reference: a byte loop over the file's bytes.
            let mut want = Vec::new();
            for (t, (&(o, _), copies)) in ranges.iter().zip(&held).enumerate() {
                for (copy, c) in copies.iter().enumerate() {
                    if let Some(i) = (0..c.len()).find(|&i| c[i] != bytes[o + i]) {
                        want.push(Difference {
                            tag: t,
                            copy,
                            at: 10 + i,
                            file_offset: (o + i) as u64,
                        });
                    }
                }
            }
            assert_eq!(done.differences, want, "{mode:?}");
            assert_eq!(want.len(), 2 * ranges.len());
            assert!(
                done.busy.len() == 2 && done.busy.iter().all(|&n| n > 0),
                "{done:?}"
            );
            // The gap-separated range and the window limit: at least 4 windows.
            assert!(done.reads >= 4, "{mode:?}: {done:?}");
            let (_, unit) = reader.alignment(&file);
            if reader.outcome().0 == ReadMode::Direct && unit > 1 {
                let d = done.direct;
                // On the ring at most one blocking read a window (its bounced tail);
                // where io_uring is denied (seccomp), every read is a blocking one.
                if d.uring_reads > 0 {
                    assert!(d.blocking_reads <= done.reads as u64, "{d:?}");
                }
                assert!(
                    d.in_place_bytes + done.reads as u64 * unit as u64 >= done.read_bytes,
                    "{done:?}"
                );
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_shorter_than_a_range_is_an_error_naming_the_read() {
        let (dir, file, bytes) = pattern("short", 10_000);
        let held = bytes[9000..].to_vec();
        let mut longer = held.clone();
        longer.extend_from_slice(&[0; 100]);
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            let reader = Reader::new(mode, [&file]).unwrap();
            let compares = vec![Compare {
                file: &file,
                offset: 9000,
                copies: vec![&longer[..]],
                tag: 0,
                at: 0,
                group: 0,
            }];
            let e = compare((&reader, &Buffers::default()), 2, compares, &|| {
                "verify t".into()
            })
            .unwrap_err();
            assert!(e.to_string().contains("verify t"), "{mode:?}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
