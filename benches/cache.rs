//! `cargo bench --bench cache`: ExpertCache against what engines do today, one slab per
//! entry (`posix_memalign` for weights and scales, `mbind` each, copy in, `free` both on
//! eviction), on the same Zipf(1.0) stream of (layer, expert) keys: 64 layers × 256
//! experts, 4 KiB weights + 4 KiB scales, 128 entries, one thread.
//!
//! Prints the hit latency (ns per lookup of a cached key), the miss cost (ns per
//! get-or-load of a key never cached: evict, load), and the process's mappings after
//! 10k, 100k and 1M operations of the stream for both (`NUMAPIN_BENCH_CACHE_OPS` sets the
//! last figure). Figures are printed, never asserted: the machine is shared and noisy.
//!
//! Then hit scaling (the serving workload): 64 cached keys, `get` and drop, one
//! thread against two, in alternating rounds in one process (`NUMAPIN_BENCH_ROUNDS`,
//! default 7); prints each round, the best and the median of hits/s and the ratio 2 : 1,
//! and the single-thread ns per hit. `NUMAPIN_BENCH_ONLY=scaling` runs this part alone.

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::time::{Duration, Instant};

use numapin::cache::{CacheOptions, CacheStats, ExpertCache};
use numapin::store::ExpertSource;
use numapin::{Node, NodeSet, diag};

use numapin::policy::{MbindFlags, MemPolicy};

const LAYERS: usize = 64;
const EXPERTS: usize = 256;
const BYTES: usize = 4096;
const ENTRIES: usize = 128;
type Key = (usize, usize);

/// xorshift64*.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Zipf(1.0) keys by inverse CDF, ranks shuffled over the keys.
fn zipf_stream(n: usize, seed: u64) -> Vec<Key> {
    let count = LAYERS * EXPERTS;
    let mut cdf: Vec<f64> = (1..=count)
        .scan(0.0, |sum, rank| {
            *sum += 1.0 / rank as f64;
            Some(*sum)
        })
        .collect();
    let total = cdf[count - 1];
    cdf.iter_mut().for_each(|c| *c /= total);
    let mut keys: Vec<Key> = (0..LAYERS)
        .flat_map(|l| (0..EXPERTS).map(move |e| (l, e)))
        .collect();
    let mut rng = XorShift(seed);
    for i in (1..count).rev() {
        keys.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    (0..n)
        .map(|_| {
            let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
            keys[cdf.partition_point(|&c| c <= u).min(count - 1)]
        })
        .collect()
}

/// Bytes of every expert: windows of one pattern.
struct Experts(Vec<u8>);

impl Experts {
    fn source(&self, (layer, expert): Key) -> ExpertSource<'_> {
        let start = (layer * EXPERTS + expert) * 8;
        ExpertSource::Memory {
            weights: &self.0[start..start + BYTES],
            scales: &self.0[start + 1..start + 1 + BYTES],
        }
    }
}

/// One `posix_memalign` block, bound on its own, freed on drop.
struct Slab(*mut u8);

impl Slab {
    fn new(policy: &MemPolicy, from: &[u8]) -> Slab {
        let mut raw: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the page size is a power-of-two multiple of the
        // pointer size.
        let rc = unsafe { libc::posix_memalign(&mut raw, numapin::page_size(), BYTES) };
        assert_eq!(rc, 0, "posix_memalign");
        // SAFETY: our fresh page-aligned block of BYTES (a whole page).
        let _ = unsafe { numapin::bind_range(raw.cast(), BYTES, policy, MbindFlags::empty()) }
            .expect("mbind");
        // SAFETY: the block holds BYTES bytes and nothing else refers to it.
        unsafe { std::slice::from_raw_parts_mut(raw.cast::<u8>(), BYTES) }.copy_from_slice(from);
        Slab(raw.cast())
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: BYTES bytes written at creation, alive until drop.
        unsafe { std::slice::from_raw_parts(self.0, BYTES) }
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: from posix_memalign, freed once.
        unsafe { libc::free(self.0.cast()) };
    }
}

/// The engines' LRU: an entry is two bound slabs; eviction frees them.
struct SlabLru {
    policy: MemPolicy,
    entries: HashMap<Key, (Slab, Slab, u64)>,
    order: BTreeMap<u64, Key>,
    clock: u64,
}

impl SlabLru {
    fn get(&mut self, key: Key) -> Option<(&[u8], &[u8])> {
        let (_, _, stamp) = self.entries.get_mut(&key)?;
        self.order.remove(stamp);
        self.clock += 1;
        *stamp = self.clock;
        self.order.insert(self.clock, key);
        let (w, s, _) = &self.entries[&key];
        Some((w.bytes(), s.bytes()))
    }

    fn get_or_load(&mut self, key: Key, source: &ExpertSource<'_>) -> usize {
        if let Some((w, _)) = self.get(key) {
            return w[0] as usize;
        }
        if self.entries.len() == ENTRIES
            && let Some((_, old)) = self.order.pop_first()
        {
            self.entries.remove(&old);
        }
        let ExpertSource::Memory { weights, scales } = source else {
            unreachable!()
        };
        let w = Slab::new(&self.policy, weights);
        let s = Slab::new(&self.policy, scales);
        let first = w.bytes()[0] as usize;
        self.clock += 1;
        self.entries.insert(key, (w, s, self.clock));
        self.order.insert(self.clock, key);
        first
    }
}

fn ns_per(start: Instant, n: usize) -> f64 {
    start.elapsed().as_nanos() as f64 / n as f64
}

/// A hit: the first byte of the key's weights (0 on a miss).
type Lookup<'a> = dyn Fn(Key) -> usize + Sync + 'a;

/// The old hit path's shape, as a same-run baseline: one global mutex over the index and
/// the pin counts, taken to pin and taken again to unpin (the entry's drop).
struct MutexBaseline {
    state: std::sync::Mutex<(HashMap<Key, usize>, Vec<u32>)>,
    first: Vec<u8>,
}

impl MutexBaseline {
    fn get(&self, key: Key) -> usize {
        let slot = {
            let mut state = self.state.lock().expect("lock");
            let Some(&slot) = state.0.get(&key) else {
                return 0;
            };
            state.1[slot] += 1;
            slot
        };
        let byte = self.first[slot] as usize;
        self.state.lock().expect("lock").1[slot] -= 1;
        byte
    }
}

/// `NUMAPIN_BENCH_FIFO=1`: each worker thread runs `SCHED_FIFO` on a CPU of its own for
/// its round (a fraction of a second), so that two threads really run at once on a
/// machine busy with other work; without it, a loaded machine interleaves them and no
/// contention shows, whatever the design. Needs root (or CAP_SYS_NICE); the kernel's RT
/// throttling still leaves 5% of each second to everything else.
fn realtime() -> bool {
    std::env::var("NUMAPIN_BENCH_FIFO").is_ok_and(|v| v == "1")
}

fn run_alone_on_cpu(t: usize) {
    let cpus = rustix::thread::sched_getaffinity(None).expect("affinity");
    let cpu = (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| cpus.is_set(c))
        .nth(t)
        .expect("a CPU per thread");
    let mut one = rustix::thread::CpuSet::new();
    one.set(cpu);
    rustix::thread::sched_setaffinity(None, &one).expect("sched_setaffinity");
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: a valid sched_param; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    assert_eq!(rc, 0, "SCHED_FIFO: {}", std::io::Error::last_os_error());
}

/// This thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`): what a hit costs the core that
/// runs it, whether or not the other thread was scheduled at the same moment.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; the clock id is a constant the kernel knows.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// `threads` threads, each doing `per_thread` `get`s over the cached `keys` (each thread
/// its own order), started together: `(hits per second of wall time, hits per second of
/// CPU time summed over the threads)`. Contention shows in both (a bounced cache line
/// costs cycles); a busy machine that runs the threads one after the other hurts only
/// the first.
fn hit_rate(lookup: &Lookup<'_>, keys: &[Key], threads: usize, per_thread: usize) -> (f64, f64) {
    let start = std::sync::Barrier::new(threads + 1);
    let (wall, cpu) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let start = &start;
                s.spawn(move || {
                    let mut sum = 0usize;
                    if realtime() {
                        run_alone_on_cpu(t);
                    }
                    start.wait();
                    let (began, cpu) = (Instant::now(), thread_cpu());
                    for i in 0..per_thread {
                        let k = keys[(i * 7 + t * 31) % keys.len()];
                        sum += lookup(black_box(k));
                    }
                    black_box(sum);
                    (began.elapsed(), thread_cpu() - cpu)
                })
            })
            .collect();
        start.wait();
        let times: Vec<(Duration, Duration)> = workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect();
        let wall = times.iter().map(|t| t.0).max().expect("a thread");
        let cpu: Duration = times.iter().map(|t| t.1).sum();
        (wall, cpu)
    });
    let hits = (threads * per_thread) as f64;
    // CPU-time rate scaled to `threads` cores: what the threads would do side by side.
    (
        hits / wall.as_secs_f64(),
        hits / cpu.as_secs_f64() * threads as f64,
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// 64 cached keys, one thread against two, alternating rounds.
fn hit_scaling(node: Node, experts: &Experts) {
    const KEYS: usize = 64;
    const PER_THREAD: usize = 2_000_000;
    let rounds: usize = std::env::var("NUMAPIN_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let mut set = NodeSet::new();
    set.insert(node);
    let cache = ExpertCache::new(set, KEYS, BYTES, BYTES, CacheOptions::default())
        .expect("ExpertCache::new");
    let keys: Vec<Key> = (0..KEYS).map(|e| (3, e)).collect();
    for &k in &keys {
        drop(
            cache
                .get_or_load(k.0, k.1, &experts.source(k), Some(node))
                .expect("get_or_load"),
        );
    }
    println!();
    println!(
        "hit scaling: {KEYS} cached keys, get + drop, {PER_THREAD} hits per thread, \
         {rounds} alternating rounds, SCHED_FIFO {} (2 cores shared with other builds: load {})",
        realtime(),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let lookup = |k: Key| cache.get(k.0, k.1).map_or(0, |e| e.weights()[0] as usize);
    scaling_table("ExpertCache", &lookup, &keys, rounds, PER_THREAD);
    let baseline = MutexBaseline {
        state: std::sync::Mutex::new((
            keys.iter().enumerate().map(|(i, &k)| (k, i)).collect(),
            vec![0; keys.len()],
        )),
        first: keys
            .iter()
            .map(|&k| cache.get(k.0, k.1).map_or(0, |e| e.weights()[0]))
            .collect(),
    };
    // The ceiling: a lookup that writes nothing shared (the same keys, a read-only
    // table). If this does not scale either, the machine did not run two threads at once.
    let first = &baseline.first;
    scaling_table(
        "control: read-only table, no shared writes (what the machine allows)",
        &|k: Key| first[black_box(k.1)] as usize,
        &keys,
        rounds,
        PER_THREAD,
    );
    scaling_table(
        "global mutex, taken to pin and to unpin (the old hit path's shape)",
        &|k| baseline.get(k),
        &keys,
        rounds,
        PER_THREAD,
    );
    let stats = cache.stats().expect("stats");
    println!(
        "cache after: hits {} misses {} (the {KEYS} loads)",
        stats.hits, stats.misses
    );
}

/// One thread against two, alternating rounds: hits/s of wall and of CPU time per round,
/// then best and median.
fn scaling_table(name: &str, lookup: &Lookup<'_>, keys: &[Key], rounds: usize, per_thread: usize) {
    println!("{name}:");
    println!(
        "{:<6} {:>14} {:>14} {:>7} {:>14} {:>14} {:>7}",
        "round", "1 thr hits/s", "2 thr hits/s", "2 : 1", "1 thr cpu", "2 thr cpu", "2 : 1"
    );
    let (mut one, mut two, mut one_cpu, mut two_cpu) = (vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        let (a, a_cpu) = hit_rate(lookup, keys, 1, per_thread);
        let (b, b_cpu) = hit_rate(lookup, keys, 2, per_thread);
        println!(
            "{round:<6} {a:>14.3e} {b:>14.3e} {:>7.2} {a_cpu:>14.3e} {b_cpu:>14.3e} {:>7.2}",
            b / a,
            b_cpu / a_cpu
        );
        one.push(a);
        two.push(b);
        one_cpu.push(a_cpu);
        two_cpu.push(b_cpu);
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    for (what, one, two) in [("wall", &one, &two), ("cpu", &one_cpu, &two_cpu)] {
        let (b1, b2) = (best(one), best(two));
        let (m1, m2) = (median(one.clone()), median(two.clone()));
        println!(
            "{what:<5} best: 1 thread {b1:.3e} hits/s ({:.1} ns/hit), 2 threads {b2:.3e}: \
             {:.2}x; median: 1 thread {m1:.3e} ({:.1} ns/hit), 2 threads {m2:.3e}: {:.2}x",
            1e9 / b1,
            b2 / b1,
            1e9 / m1,
            m2 / m1
        );
    }
}

/// One contender's figures on the Zipf stream, the hot keys and the cold keys.
struct Figures {
    /// ns per operation of the Zipf stream, per hit of a cached key, per miss.
    stream_ns: f64,
    hit_ns: f64,
    miss_ns: f64,
    /// Mappings added after each checkpoint of the stream, and after the misses.
    maps: Vec<isize>,
    after: isize,
}

/// What the contenders share: the node, the keys, their bytes.
struct Workload<'a> {
    node: Node,
    policy: MemPolicy,
    set: NodeSet,
    experts: &'a Experts,
    stream: Vec<Key>,
    /// Stream positions after which the mappings are counted.
    checkpoints: Vec<usize>,
    /// Keys never cached by a miss run: every op a miss once the cache is full.
    cold: Vec<Key>,
}

/// The process's mappings now, less `base`.
fn maps_since(base: usize) -> isize {
    diag::map_count().expect("maps") as isize - base as isize
}

/// ExpertCache on the workload; also its counters after the stream.
fn run_cache(w: &Workload<'_>) -> (Figures, CacheStats) {
    let ops = w.stream.len();
    let base = diag::map_count().expect("maps");
    let cache = ExpertCache::new(w.set, ENTRIES, BYTES, BYTES, CacheOptions::default())
        .expect("ExpertCache::new");
    let mut maps = Vec::new();
    let start = Instant::now();
    let mut sink = 0usize;
    for (i, &key) in w.stream.iter().enumerate() {
        let entry = cache
            .get_or_load(key.0, key.1, &w.experts.source(key), Some(w.node))
            .expect("get_or_load");
        sink += entry.weights()[0] as usize;
        drop(entry);
        if w.checkpoints.contains(&(i + 1)) {
            maps.push(maps_since(base));
        }
    }
    let stream_ns = ns_per(start, ops);
    let stats = cache.stats().expect("stats");
    let hot: Vec<Key> = (0..LAYERS)
        .flat_map(|l| (0..EXPERTS).map(move |e| (l, e)))
        .filter(|k| cache.get(k.0, k.1).is_some())
        .collect();
    let start = Instant::now();
    for i in 0..ops {
        let k = hot[i % hot.len()];
        sink += cache.get(k.0, k.1).map_or(0, |e| e.weights()[0] as usize);
    }
    let hit_ns = ns_per(start, ops);
    let start = Instant::now();
    for &key in &w.cold {
        sink += cache
            .get_or_load(key.0 + LAYERS, key.1, &w.experts.source(key), Some(w.node))
            .expect("get_or_load")
            .weights()[0] as usize;
    }
    let miss_ns = ns_per(start, w.cold.len());
    let after = maps_since(base);
    drop(cache);
    black_box(sink);
    let figures = Figures {
        stream_ns,
        hit_ns,
        miss_ns,
        maps,
        after,
    };
    (figures, stats)
}

/// One bound slab per entry on the workload.
fn run_slab(w: &Workload<'_>) -> Figures {
    let ops = w.stream.len();
    let base = diag::map_count().expect("maps");
    let mut lru = SlabLru {
        policy: w.policy,
        entries: HashMap::new(),
        order: BTreeMap::new(),
        clock: 0,
    };
    let mut maps = Vec::new();
    let mut sink = 0usize;
    let start = Instant::now();
    for (i, &key) in w.stream.iter().enumerate() {
        sink += lru.get_or_load(key, &w.experts.source(key));
        if w.checkpoints.contains(&(i + 1)) {
            maps.push(maps_since(base));
        }
    }
    let stream_ns = ns_per(start, ops);
    let hot: Vec<Key> = lru.entries.keys().copied().collect();
    let start = Instant::now();
    for i in 0..ops {
        sink += lru
            .get(hot[i % hot.len()])
            .map_or(0, |(w, _)| w[0] as usize);
    }
    let hit_ns = ns_per(start, ops);
    let start = Instant::now();
    for &key in &w.cold {
        sink += lru.get_or_load((key.0 + LAYERS, key.1), &w.experts.source(key));
    }
    let miss_ns = ns_per(start, w.cold.len());
    let after = maps_since(base);
    drop(lru);
    black_box(sink);
    Figures {
        stream_ns,
        hit_ns,
        miss_ns,
        maps,
        after,
    }
}

/// The two contenders side by side.
fn print_comparison(w: &Workload<'_>, stats: &CacheStats, cache: &Figures, slab: &Figures) {
    println!(
        "cache stream: hits {} misses {} evictions {} ({:.1}% hits)",
        stats.hits,
        stats.misses,
        stats.evictions,
        100.0 * stats.hits as f64 / (stats.hits + stats.misses) as f64
    );
    println!("{:<28} {:>14} {:>14}", "", "ExpertCache", "slab per entry");
    println!(
        "{:<28} {:>14.0} {:>14.0}",
        "hit (ns/lookup)", cache.hit_ns, slab.hit_ns
    );
    println!(
        "{:<28} {:>14.0} {:>14.0}",
        "miss (ns/load, evicting)", cache.miss_ns, slab.miss_ns
    );
    println!(
        "{:<28} {:>14.0} {:>14.0}",
        "Zipf stream (ns/op)", cache.stream_ns, slab.stream_ns
    );
    for (i, c) in w.checkpoints.iter().enumerate() {
        println!(
            "{:<28} {:>14} {:>14}",
            format!("+mappings after {c} ops"),
            cache.maps[i],
            slab.maps[i]
        );
    }
    println!(
        "{:<28} {:>14} {:>14}",
        format!("+mappings after {} misses", w.cold.len()),
        cache.after,
        slab.after
    );
}

fn main() {
    let only = std::env::var("NUMAPIN_BENCH_ONLY").unwrap_or_default();
    let ops: usize = std::env::var("NUMAPIN_BENCH_CACHE_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let node = NodeSet::allowed()
        .expect("allowed nodes")
        .iter()
        .next()
        .unwrap_or(Node(0));
    let mut set = NodeSet::new();
    set.insert(node);
    let mut rng = XorShift(1);
    let experts = Experts(
        (0..(LAYERS * EXPERTS * 8 + BYTES + 8).div_ceil(8))
            .flat_map(|_| rng.next().to_le_bytes())
            .collect(),
    );
    if only == "scaling" {
        hit_scaling(node, &experts);
        return;
    }
    let workload = Workload {
        node,
        policy: MemPolicy::Bind(set),
        set,
        experts: &experts,
        stream: zipf_stream(ops, 7),
        checkpoints: [10_000, 100_000, ops]
            .into_iter()
            .filter(|&c| c <= ops)
            .collect(),
        cold: (0..LAYERS * EXPERTS)
            .map(|i| (i / EXPERTS, i % EXPERTS))
            .cycle()
            .take(100_000)
            .collect(),
    };
    println!(
        "ExpertCache vs one bound slab per entry: {LAYERS}×{EXPERTS} experts, {BYTES} B weights + \
         {BYTES} B scales, {ENTRIES} entries on node {node}, Zipf(1.0), {ops} ops"
    );
    let (cache, stats) = run_cache(&workload);
    let slab = run_slab(&workload);
    print_comparison(&workload, &stats, &cache, &slab);
    hit_scaling(node, &experts);
}
