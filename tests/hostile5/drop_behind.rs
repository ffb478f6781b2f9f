//! Drop-behind keeps the page cache near `DROP_BEHIND_EVERY` during a load and empties
//! it after, where the file system lets a file be evicted.

use super::*;

/// Drop-behind with experts whose pieces run backwards through the file (expert 0 reads
/// the end, the last expert the start), each piece also read again by its neighbour:
/// the cache must stay near `DROP_BEHIND_EVERY` during the load and empty after it.
#[test]
fn drop_behind_keeps_its_bound_when_slots_read_the_file_backwards() {
    use numapin::store::{DROP_BEHIND_EVERY, ProgressHook};
    let Some(d) = evictable_dir(
        "backwards",
        "drop_behind_keeps_its_bound_when_slots_read_the_file_backwards",
    ) else {
        return;
    };
    let path = d.join("data.bin");
    let chunk = (1usize << 20) + 333;
    let experts = 96usize;
    let len = chunk * experts;
    let bytes = write_file(&path, len, 21);
    let file = open_uncached(&path);
    // Sampled at each progress report of the load.
    let peak = CachePeak::new(&file);
    let sampler = {
        let peak = peak.clone();
        ProgressHook::new(move |_| peak.sample())
    };
    let layout: Vec<_> = (0..experts)
        .map(|e| {
            let at = ((experts - 1 - e) * chunk) as u64;
            (vec![(at, chunk)], vec![])
        })
        .collect();
    let options = StoreOptions::default()
        .huge_pages(false)
        .loader_threads(2)
        .read_mode(ReadMode::DropBehind)
        .progress(Some(sampler));
    pack_and_check(options, &file, &bytes, &layout, "backwards").unwrap();
    let bound = DROP_BEHIND_EVERY as usize + 2 * (2 << 20) + 2 * (2 * chunk);
    peak.assert_bounded("backwards", bound);
}

/// Drop-behind over many tiny pieces spread thinly over a large file: few bytes are read,
/// but each read brings the kernel's readahead with it. The cache, sampled by a thread of
/// the test's own during the load, must stay near `DROP_BEHIND_EVERY` as promised, not
/// grow with the span of the file read over.
#[test]
fn drop_behind_over_sparse_tiny_pieces_keeps_its_bound() {
    use numapin::store::DROP_BEHIND_EVERY;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(d) = evictable_dir(
        "sparse",
        "drop_behind_over_sparse_tiny_pieces_keeps_its_bound",
    ) else {
        return;
    };
    let path = d.join("data.bin");
    let len = 128usize << 20;
    {
        let mut f = File::create(&path).unwrap();
        let block: Vec<u8> = (0..1 << 20)
            .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        for _ in 0..len >> 20 {
            f.write_all(&block).unwrap();
        }
        f.sync_all().unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    let file = open_uncached(&path);
    // Experts of 64 pieces of 64 bytes, one every STRIDE bytes: 64 B read per STRIDE.
    const STRIDE: u64 = 8 << 10;
    let experts: Vec<Pieces> = (0..(len as u64 / STRIDE / 64))
        .map(|e| {
            (
                (0..64u64)
                    .map(|p| ((e * 64 + p) * STRIDE + 100, 64))
                    .collect(),
                vec![],
            )
        })
        .collect();
    // Sampled by a thread of the test's own every 2 ms: one layer of tiny pieces makes
    // few progress reports.
    let (done, peak) = (Arc::new(AtomicBool::new(false)), CachePeak::new(&file));
    let sampler = {
        let (done, peak) = (done.clone(), peak.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                peak.sample();
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        })
    };
    let options = StoreOptions::default()
        .huge_pages(false)
        .loader_threads(2)
        .read_mode(ReadMode::DropBehind);
    let result = pack_and_check(options, &file, &bytes, &experts, "sparse");
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    result.unwrap();
    peak.assert_bounded("sparse", DROP_BEHIND_EVERY as usize + 2 * (2 << 20));
}

/// `dir(name)` where evicting a file from the page cache works; `None` (after saying
/// NOT RUN for `test`) where it cannot.
fn evictable_dir(name: &str, test: &str) -> Option<ScratchDir> {
    let d = dir(name);
    if !evicts_here(&d) {
        println!(
            "NOT RUN: {test} needs a file system whose page cache can be evicted; {} keeps its files in memory (the VM's initramfs)",
            d.display()
        );
        return None;
    }
    Some(d)
}

/// `path` opened with no kernel readahead (as tests/read_modes) and evicted: what stays
/// cached during a load is drop-behind's doing.
fn open_uncached(path: &Path) -> File {
    let file = File::open(path).unwrap();
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random).unwrap();
    numapin_testkit::cache::evict(&file).unwrap();
    file
}

/// The most pages of a file seen cached by [`CachePeak::sample`], from any thread.
#[derive(Clone)]
struct CachePeak {
    file: std::sync::Arc<File>,
    peak: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl CachePeak {
    fn new(file: &File) -> CachePeak {
        CachePeak {
            file: std::sync::Arc::new(file.try_clone().unwrap()),
            peak: Default::default(),
        }
    }

    /// Counts the file's cached pages now.
    fn sample(&self) {
        let (resident, _) = numapin_testkit::cache::cached_pages(&self.file).unwrap();
        self.peak
            .fetch_max(resident, std::sync::atomic::Ordering::SeqCst);
    }

    /// After the load: at most 1 in 50 pages still cached, and never more than `bound`
    /// bytes of pages cached during it.
    fn assert_bounded(&self, what: &str, bound: usize) {
        let (after, total) = numapin_testkit::cache::cached_pages(&self.file).unwrap();
        let peak = self.peak.load(std::sync::atomic::Ordering::SeqCst);
        let bound = bound / numapin::page_size();
        println!("{what}: {after} of {total} pages cached after, {peak} at most during");
        assert!(
            after * 50 <= total,
            "{what}: {after} of {total} cached after the load"
        );
        assert!(
            peak <= bound,
            "{what}: {peak} pages cached during the load, more than {bound} (total {total})"
        );
    }
}

/// Whether evicting a file of `dir` from the page cache works here: false on ramfs and
/// tmpfs, whose page cache is the file itself (the VM's initramfs).
fn evicts_here(dir: &Path) -> bool {
    use numapin_testkit::cache::{cached_pages, evict};
    let probe = dir.join("evict-probe.bin");
    std::fs::write(&probe, vec![1u8; 64 << 10]).unwrap();
    let file = std::fs::File::open(&probe).unwrap();
    let evicted =
        evict(&file).is_ok() && cached_pages(&file).is_ok_and(|(resident, _)| resident == 0);
    let _ = std::fs::remove_file(&probe);
    evicted
}
