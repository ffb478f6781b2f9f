//! ExpertCache and StagingPool: a randomized Zipf workload over 4 threads in which every
//! entry must hold exactly its expert's bytes, a single-threaded run that must match a
//! reference CLOCK model hit for hit (and one with concurrent phases), mappings that must not change with churn, and the
//! edge cases (capacity 0, every slot held, a source larger than a slot, the largest
//! keys, a failed load) as errors.
//!
//! `NUMAPIN_CACHE_OPS` sets the randomized runs' operation count (default 1,000,000; the
//! container and VM stages set 100,000).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Barrier};

use common::{Expect, expect, need_nodes, nodes};
use numapin::cache::{CacheOptions, ExpertCache, StagingPool};
use numapin::store::ExpertSource;
use numapin::{Error, Invalid, Node, NodeSet, diag};

use numapin::policy::{DegradeReason, Observed, Placement};

const LAYERS: usize = 64;
const EXPERTS: usize = 256;
const WEIGHT_BYTES: usize = 4096;
const SCALE_BYTES: usize = 4096;
const CACHE_SLOTS: usize = 128;
const THREADS: usize = 4;

fn ops() -> usize {
    std::env::var("NUMAPIN_CACHE_OPS")
        .ok()
        .map(|v| v.parse().expect("NUMAPIN_CACHE_OPS is a number"))
        .unwrap_or(1_000_000)
}

/// xorshift64*: a tiny seeded generator.
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

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s = 1.0) over `n` ranks by inverse CDF; ranks map to keys through a seeded
/// shuffle so that hot experts are scattered over layers.
struct Zipf {
    cdf: Vec<f64>,
    keys: Vec<(usize, usize)>,
}

impl Zipf {
    fn new(layers: usize, experts: usize, seed: u64) -> Zipf {
        let n = layers * experts;
        let mut cdf = Vec::with_capacity(n);
        let mut sum = 0.0;
        for rank in 1..=n {
            sum += 1.0 / rank as f64;
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        let mut keys: Vec<(usize, usize)> = (0..layers)
            .flat_map(|l| (0..experts).map(move |e| (l, e)))
            .collect();
        let mut rng = XorShift(seed);
        for i in (1..n).rev() {
            keys.swap(i, rng.below(i + 1));
        }
        Zipf { cdf, keys }
    }

    fn sample(&self, rng: &mut XorShift) -> (usize, usize) {
        let u = rng.unit();
        let rank = self
            .cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1);
        self.keys[rank]
    }
}

/// Every expert's bytes, derived from its key: a window of a random pattern starting at
/// a per-key offset, so that no two experts hold the same bytes and checking an entry is
/// one comparison.
struct Experts {
    weights: Vec<u8>,
    scales: Vec<u8>,
}

impl Experts {
    fn new(seed: u64) -> Experts {
        let mut rng = XorShift(seed);
        let len = LAYERS * EXPERTS * 8 + WEIGHT_BYTES.max(SCALE_BYTES);
        let mut pattern = |len: usize| -> Vec<u8> {
            (0..len.div_ceil(8))
                .flat_map(|_| rng.next().to_le_bytes())
                .collect()
        };
        Experts {
            weights: pattern(len),
            scales: pattern(len),
        }
    }

    fn source(&self, (layer, expert): (usize, usize)) -> ExpertSource<'_> {
        let start = ((layer % LAYERS) * EXPERTS + expert % EXPERTS) * 8;
        ExpertSource::Memory {
            weights: &self.weights[start..start + WEIGHT_BYTES],
            scales: &self.scales[start..start + SCALE_BYTES],
        }
    }

    fn check(&self, entry: &numapin::cache::Entry<'_>) {
        let ExpertSource::Memory { weights, scales } = self.source(entry.key()) else {
            unreachable!()
        };
        assert!(entry.weights() == weights, "weights of {:?}", entry.key());
        assert!(entry.scales() == scales, "scales of {:?}", entry.key());
    }
}

fn cache_nodes() -> NodeSet {
    nodes()
}

fn new_cache(nodes: NodeSet, slots_per_node: usize) -> ExpertCache {
    ExpertCache::new(
        nodes,
        slots_per_node,
        WEIGHT_BYTES,
        SCALE_BYTES,
        CacheOptions::default(),
    )
    .unwrap()
}

fn expected_placement() -> Placement {
    match expect() {
        Expect::Full => Placement::Bound,
        Expect::Denied => Placement::Degraded(DegradeReason::Denied),
        Expect::Unsupported => Placement::Degraded(DegradeReason::Unsupported),
    }
}

/// One operation of a stream: a `get`, or a `get_or_load` with a hint.
#[derive(Clone, Copy)]
enum Op {
    Get((usize, usize)),
    Load((usize, usize), Node),
}

fn stream(seed: u64, n: usize, nodes: &[Node]) -> Vec<Op> {
    let zipf = Zipf::new(LAYERS, EXPERTS, 0x5eed);
    let mut rng = XorShift(seed);
    (0..n)
        .map(|_| {
            let key = zipf.sample(&mut rng);
            let hint = nodes[rng.below(nodes.len())];
            if rng.below(4) == 0 {
                Op::Get(key)
            } else {
                Op::Load(key, hint)
            }
        })
        .collect()
}

#[test]
fn randomized_four_threads_every_entry_holds_its_experts_bytes() {
    let nodes = cache_nodes();
    let node_list: Vec<Node> = nodes.iter().collect();
    let slots_per_node = (CACHE_SLOTS / node_list.len()).max(1);
    let cache = new_cache(nodes, slots_per_node);
    let experts = Experts::new(7);
    let before = cache.stats().unwrap();
    assert_eq!(
        before.mappings,
        diag::maps_overlapping(&cache.spans()).unwrap()
    );
    assert!(before.mappings >= 1 && before.mappings <= 2 * node_list.len());
    for n in &before.nodes {
        assert_eq!(n.placement, expected_placement());
        assert_eq!(n.resident_bytes, 0, "nothing touched yet");
    }

    let total = ops();
    let per_thread = total / THREADS;
    let start = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (cache, experts, start, node_list) = (&cache, &experts, &start, &node_list);
            s.spawn(move || {
                let ops = stream(100 + t as u64, per_thread, node_list);
                start.wait();
                for op in ops {
                    match op {
                        Op::Get(key) => {
                            if let Some(entry) = cache.get(key.0, key.1) {
                                assert_eq!(entry.key(), key);
                                experts.check(&entry);
                            }
                        }
                        Op::Load(key, hint) => {
                            let entry = cache
                                .get_or_load(key.0, key.1, &experts.source(key), Some(hint))
                                .unwrap();
                            assert_eq!(entry.key(), key);
                            experts.check(&entry);
                        }
                    }
                }
            });
        }
    });

    let after = cache.stats().unwrap();
    assert_eq!(after.hits + after.misses, (per_thread * THREADS) as u64);
    assert_eq!(after.load_failures, 0);
    let used: usize = after.nodes.iter().map(|n| n.used).sum();
    // Every load took a free slot or evicted one: the cache starts empty.
    assert_eq!(after.loads, after.evictions + used as u64);
    assert_eq!(
        after.bytes_loaded,
        after.loads * (WEIGHT_BYTES + SCALE_BYTES) as u64
    );
    assert!(after.evictions > 0, "the run churned: {after:?}");
    assert_eq!(
        after.mappings, before.mappings,
        "mappings in the cache's regions changed with churn"
    );
    // Whatever is cached at the end still holds its bytes.
    let mut cached = 0;
    for l in 0..LAYERS {
        for e in 0..EXPERTS {
            if let Some(entry) = cache.get(l, e) {
                experts.check(&entry);
                cached += 1;
            }
        }
    }
    assert_eq!(cached, used);
}

/// The reference: the documented replacement policy, CLOCK per node, written plainly.
/// Each node has its slots (key, reference bit), a free stack (slot 0 first) and a hand.
/// A hit sets the bit; a miss on a full node moves the hand, clearing set bits, to the
/// first slot whose bit is clear, and evicts it; a fresh load starts with a clear bit.
struct Model {
    nodes: HashMap<Node, ClockNode>,
    hits: u64,
    misses: u64,
    evictions: u64,
    loads: u64,
}

struct ClockNode {
    slots: Vec<Option<((usize, usize), bool)>>,
    free: Vec<usize>,
    hand: usize,
}

impl Model {
    fn new(nodes: &[Node], slots_per_node: usize) -> Model {
        let node = || ClockNode {
            slots: vec![None; slots_per_node],
            free: (0..slots_per_node).rev().collect(),
            hand: 0,
        };
        Model {
            nodes: nodes.iter().map(|&n| (n, node())).collect(),
            hits: 0,
            misses: 0,
            evictions: 0,
            loads: 0,
        }
    }

    /// The node and slot (within the node) holding `key`.
    fn find(&self, key: (usize, usize)) -> Option<(Node, usize)> {
        self.nodes.iter().find_map(|(&n, c)| {
            c.slots
                .iter()
                .position(|s| matches!(s, Some((k, _)) if *k == key))
                .map(|i| (n, i))
        })
    }

    fn get(&mut self, key: (usize, usize)) -> Option<Node> {
        match self.find(key) {
            Some((node, i)) => {
                self.hits += 1;
                self.nodes.get_mut(&node).unwrap().slots[i] = Some((key, true));
                Some(node)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    fn get_or_load(&mut self, key: (usize, usize), hint: Node) -> Node {
        if let Some(node) = self.get(key) {
            return node;
        }
        let c = self.nodes.get_mut(&hint).unwrap();
        let slot = match c.free.pop() {
            Some(slot) => slot,
            None => loop {
                let i = c.hand;
                c.hand = (i + 1) % c.slots.len();
                match &mut c.slots[i] {
                    Some((_, referenced)) if *referenced => *referenced = false,
                    Some(_) => {
                        self.evictions += 1;
                        break i;
                    }
                    None => {}
                }
            },
        };
        c.slots[slot] = Some((key, false));
        self.loads += 1;
        hint
    }

    fn used(&self, node: Node) -> usize {
        self.nodes[&node].slots.iter().flatten().count()
    }

    fn cached(&self) -> Vec<(usize, usize)> {
        let mut keys: Vec<_> = self
            .nodes
            .values()
            .flat_map(|c| c.slots.iter().flatten().map(|(k, _)| *k))
            .collect();
        keys.sort();
        keys
    }
}

/// Runs `ops` on the cache and the model alike, one thread, comparing every answer.
fn run_against_model(cache: &ExpertCache, model: &mut Model, experts: &Experts, ops: &[Op]) {
    for &op in ops {
        match op {
            Op::Get(key) => {
                let got = cache.get(key.0, key.1).map(|e| e.node());
                assert_eq!(got, model.get(key), "get {key:?}");
            }
            Op::Load(key, hint) => {
                let entry = cache
                    .get_or_load(key.0, key.1, &experts.source(key), Some(hint))
                    .unwrap();
                assert_eq!(entry.node(), model.get_or_load(key, hint), "{key:?}");
                experts.check(&entry);
            }
        }
    }
}

fn assert_same_as_model(cache: &ExpertCache, model: &Model) {
    let stats = cache.stats().unwrap();
    assert_eq!(
        (stats.hits, stats.misses, stats.evictions, stats.loads),
        (model.hits, model.misses, model.evictions, model.loads)
    );
    for n in &stats.nodes {
        assert_eq!(n.used, model.used(n.node));
    }
}

/// Every key the model holds is cached, with its bytes, on the model's node (these `get`s
/// set reference bits: call it last).
fn assert_holds(cache: &ExpertCache, model: &Model, experts: &Experts) {
    for key in model.cached() {
        let entry = cache.get(key.0, key.1).expect("the model holds it");
        experts.check(&entry);
        assert_eq!(Some(entry.node()), model.find(key).map(|(n, _)| n));
    }
}

#[test]
fn single_thread_hits_and_misses_equal_a_reference_clock_model() {
    let nodes = cache_nodes();
    let node_list: Vec<Node> = nodes.iter().collect();
    let slots_per_node = (CACHE_SLOTS / node_list.len()).max(1);
    let cache = new_cache(nodes, slots_per_node);
    let experts = Experts::new(11);
    let mut model = Model::new(&node_list, slots_per_node);
    // A quarter of the run: the model's lookups are linear, the cache's are not.
    let ops = stream(42, ops() / 4, &node_list);
    run_against_model(&cache, &mut model, &experts, &ops);
    assert_same_as_model(&cache, &model);
    assert!(model.hits > 0 && model.evictions > 0);
    assert_holds(&cache, &model, &experts);
}

/// The same comparison with a concurrent phase in the middle: threads look up keys at
/// once (hits set reference bits, misses of `get` change nothing else), which leaves the
/// cache in one state whatever the interleaving — the model's, after the same lookups in
/// any order. The single-threaded phase after it, with evictions, must then match the
/// model step for step: the concurrent hits left exactly the reference bits CLOCK says.
#[test]
fn concurrent_hits_leave_the_state_a_reference_clock_predicts() {
    const LOOKERS: usize = 4;
    let nodes = cache_nodes();
    let node_list: Vec<Node> = nodes.iter().collect();
    let slots_per_node = (CACHE_SLOTS / node_list.len()).max(1);
    let cache = new_cache(nodes, slots_per_node);
    let experts = Experts::new(5);
    let mut model = Model::new(&node_list, slots_per_node);
    let n = (ops() / 40).max(2000);
    run_against_model(&cache, &mut model, &experts, &stream(7, n, &node_list));
    for round in 0..4u64 {
        let lookups: Vec<Vec<(usize, usize)>> = (0..LOOKERS as u64)
            .map(|t| {
                let zipf = Zipf::new(LAYERS, EXPERTS, 0x5eed);
                let mut rng = XorShift(1000 + round * 10 + t);
                (0..n).map(|_| zipf.sample(&mut rng)).collect()
            })
            .collect();
        let start = Barrier::new(LOOKERS);
        std::thread::scope(|s| {
            for keys in &lookups {
                let (cache, experts, start) = (&cache, &experts, &start);
                s.spawn(move || {
                    start.wait();
                    for &(l, e) in keys {
                        if let Some(entry) = cache.get(l, e) {
                            experts.check(&entry);
                        }
                    }
                });
            }
        });
        for &key in lookups.iter().flatten() {
            model.get(key);
        }
        assert_same_as_model(&cache, &model);
        let ops = stream(50 + round, n, &node_list);
        run_against_model(&cache, &mut model, &experts, &ops);
        assert_same_as_model(&cache, &model);
    }
    assert!(model.evictions > 0 && model.hits > 0);
    assert_holds(&cache, &model, &experts);
}

/// Threads loading and hitting disjoint keys at once, with room for all of them: the
/// reference is a set (no evictions), so misses = distinct keys and hits = the rest,
/// exactly, whatever the interleaving.
#[test]
fn concurrent_loads_without_evictions_count_exactly() {
    let nodes = cache_nodes();
    let node_list: Vec<Node> = nodes.iter().collect();
    let per_thread = 64 * 40;
    // Every node can hold every key: the hints spread keys unevenly over 3 nodes.
    let slots_per_node = THREADS * 64;
    let cache = new_cache(nodes, slots_per_node);
    let experts = Experts::new(3);
    let start = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (cache, experts, start, node_list) = (&cache, &experts, &start, &node_list);
            s.spawn(move || {
                let mut rng = XorShift(77 + t as u64);
                start.wait();
                for _ in 0..per_thread {
                    // Thread t's keys: layer t, experts 0..64.
                    let key = (t, rng.below(64));
                    let hint = node_list[key.1 % node_list.len()];
                    let entry = cache
                        .get_or_load(key.0, key.1, &experts.source(key), Some(hint))
                        .unwrap();
                    experts.check(&entry);
                    assert_eq!(entry.node(), hint);
                }
            });
        }
    });
    let stats = cache.stats().unwrap();
    let distinct = (THREADS * 64) as u64;
    assert_eq!(stats.misses, distinct);
    assert_eq!(stats.loads, distinct);
    assert_eq!(stats.hits, (THREADS * per_thread) as u64 - distinct);
    assert_eq!(stats.evictions, 0);
}

#[test]
fn threads_missing_on_the_same_keys_load_each_once() {
    const KEYS: usize = 1000;
    const RACERS: usize = 8;
    let cache = ExpertCache::new(
        NodeSet::from_nodes([nodes().iter().next().unwrap().index()]).unwrap(),
        KEYS,
        WEIGHT_BYTES,
        SCALE_BYTES,
        CacheOptions::default(),
    )
    .unwrap();
    let experts = Experts::new(3);
    let start = Barrier::new(RACERS);
    std::thread::scope(|s| {
        for _ in 0..RACERS {
            s.spawn(|| {
                start.wait();
                for i in 0..KEYS {
                    let key = (i / EXPERTS, i % EXPERTS);
                    let entry = cache
                        .get_or_load(key.0, key.1, &experts.source(key), None)
                        .unwrap();
                    experts.check(&entry);
                }
            });
        }
    });
    let stats = cache.stats().unwrap();
    assert_eq!(
        stats.loads, KEYS as u64,
        "a key was loaded twice: {stats:?}"
    );
    assert_eq!(stats.evictions, 0);
    assert_eq!(stats.hits + stats.misses, (KEYS * RACERS) as u64);
}

#[test]
fn capacity_zero_and_empty_shapes_are_errors() {
    let one = NodeSet::from_nodes([0]).unwrap();
    let opts = CacheOptions::default();
    for (slots, weights, scales, nodes) in [
        (0, 4096, 4096, one),
        (4, 0, 4096, one),
        (4, 4096, 4096, NodeSet::new()),
        (usize::MAX, 4096, 0, one),
        (4, usize::MAX, 0, one),
        (1 << 40, 1 << 30, 0, one),
    ] {
        let result = ExpertCache::new(nodes, slots, weights, scales, opts);
        assert!(
            matches!(result, Err(Error::InvalidArgument { .. })),
            "{slots} × ({weights}, {scales}) on {nodes}: {result:?}"
        );
    }
}

#[test]
fn every_slot_held_is_an_error_naming_the_node_and_capacity() {
    let cache = new_cache(NodeSet::from_nodes([0]).unwrap(), 2);
    let experts = Experts::new(5);
    let a = cache
        .get_or_load(0, 0, &experts.source((0, 0)), Some(Node(0)))
        .unwrap();
    let b = cache
        .get_or_load(0, 1, &experts.source((0, 1)), Some(Node(0)))
        .unwrap();
    let err = cache
        .get_or_load(0, 2, &experts.source((0, 2)), Some(Node(0)))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::CacheFull {
                layer: 0,
                expert: 2,
                node: Node(0),
                capacity: 2,
                ..
            }
        ),
        "{err:?}"
    );
    // A hit on a held entry still works; dropping one frees its slot for the miss.
    assert!(cache.get(0, 0).is_some());
    drop(a);
    let c = cache
        .get_or_load(0, 2, &experts.source((0, 2)), Some(Node(0)))
        .unwrap();
    experts.check(&c);
    experts.check(&b);
    assert!(cache.get(0, 0).is_none(), "(0, 0) was the one unheld entry");
    let stats = cache.stats().unwrap();
    assert_eq!((stats.loads, stats.evictions), (3, 1));
}

#[test]
fn a_source_larger_than_a_slot_is_an_error_and_takes_no_slot() {
    let cache = new_cache(NodeSet::from_nodes([0]).unwrap(), 2);
    let big = vec![1u8; WEIGHT_BYTES + 1];
    let scales = vec![2u8; 16];
    let err = cache
        .get_or_load(
            1,
            1,
            &ExpertSource::Memory {
                weights: &big,
                scales: &scales,
            },
            None,
        )
        .unwrap_err();
    // The tensor that does not fit is named, with both figures.
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                reason: Invalid::TooLarge {
                    size: 4097,
                    max: 4096,
                    ..
                },
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("layer 1 expert 1 weights: 4097 bytes but a slot holds 4096"),
        "{err}"
    );
    let stats = cache.stats().unwrap();
    assert_eq!((stats.loads, stats.nodes[0].used), (0, 0));
    // A shorter source is fine: the entry has its source's length.
    let entry = cache
        .get_or_load(
            1,
            1,
            &ExpertSource::Memory {
                weights: &big[..100],
                scales: &scales,
            },
            None,
        )
        .unwrap();
    assert_eq!(entry.weights(), &big[..100]);
    assert_eq!(entry.scales(), &scales[..]);
}

#[test]
fn the_largest_keys_are_keys_like_any_other() {
    let cache = new_cache(NodeSet::from_nodes([0]).unwrap(), 2);
    let experts = Experts::new(9);
    let key = (usize::MAX, usize::MAX);
    assert!(cache.get(key.0, key.1).is_none());
    let entry = cache
        .get_or_load(key.0, key.1, &experts.source(key), None)
        .unwrap();
    experts.check(&entry);
    drop(entry);
    let entry = cache.get(key.0, key.1).unwrap();
    assert_eq!(entry.key(), key);
    experts.check(&entry);
}

#[test]
fn a_failed_load_caches_nothing_and_frees_its_slot() {
    let cache = new_cache(NodeSet::from_nodes([0]).unwrap(), 1);
    let file = std::fs::File::open("/proc/self/exe").unwrap();
    let size = file.metadata().unwrap().len();
    // A piece that runs past the end of the file: the read ends early.
    let source = ExpertSource::from_file(&file, &[(size - 10, 100)], &[]);
    let err = cache.get_or_load(4, 4, &source, None).unwrap_err();
    assert!(!matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(cache.get(4, 4).is_none());
    let stats = cache.stats().unwrap();
    assert_eq!(
        (stats.loads, stats.load_failures, stats.nodes[0].used),
        (0, 1, 0)
    );
    // The one slot is free again.
    let experts = Experts::new(1);
    let entry = cache
        .get_or_load(4, 4, &experts.source((4, 4)), None)
        .unwrap();
    experts.check(&entry);
}

#[test]
fn shrink_gives_pages_back_and_keeps_mappings_and_entries_reload() {
    let cache = new_cache(NodeSet::from_nodes([0]).unwrap(), 16);
    let experts = Experts::new(13);
    let mappings = cache.stats().unwrap().mappings;
    for e in 0..16 {
        drop(
            cache
                .get_or_load(0, e, &experts.source((0, e)), None)
                .unwrap(),
        );
    }
    let page = numapin::page_size() as u64;
    let full = 16 * (WEIGHT_BYTES + SCALE_BYTES) as u64 / page * page;
    assert_eq!(cache.stats().unwrap().nodes[0].resident_bytes, full);
    let held = cache.get(0, 15).unwrap();
    // Keep 4: CLOCK from the hand (slot 0) evicts unreferenced unheld entries in slot
    // order (15 is held and referenced, so entries 0..=11 go), then releases every free
    // slot.
    assert_eq!(cache.shrink(4).unwrap(), 12);
    let stats = cache.stats().unwrap();
    assert_eq!(stats.nodes[0].used, 4);
    assert_eq!(stats.evictions, 12);
    assert_eq!(stats.nodes[0].resident_bytes, 4 * full / 16);
    assert_eq!(stats.mappings, mappings);
    experts.check(&held);
    for e in 0..12 {
        assert!(cache.get(0, e).is_none(), "{e}");
    }
    for e in 12..16 {
        experts.check(&cache.get(0, e).unwrap());
    }
    // A second shrink releases nothing more; a reload faults fresh pages in place.
    assert_eq!(cache.shrink(4).unwrap(), 0);
    experts.check(
        &cache
            .get_or_load(0, 3, &experts.source((0, 3)), None)
            .unwrap(),
    );
    assert_eq!(cache.stats().unwrap().mappings, mappings);
}

#[test]
fn a_cache_without_scales_has_one_region_per_node() {
    let cache = ExpertCache::new(
        NodeSet::from_nodes([0]).unwrap(),
        3,
        5000,
        0,
        CacheOptions::default().populate(true).huge_pages(false),
    )
    .unwrap();
    assert_eq!(cache.spans().len(), 1);
    let stats = cache.stats().unwrap();
    assert_eq!(stats.mappings, 1);
    let page = numapin::page_size();
    assert_eq!(
        stats.nodes[0].resident_bytes,
        (3 * 5000usize.next_multiple_of(page)) as u64,
        "populated"
    );
    let weights = vec![9u8; 5000];
    let entry = cache
        .get_or_load(
            0,
            0,
            &ExpertSource::Memory {
                weights: &weights,
                scales: &[],
            },
            None,
        )
        .unwrap();
    assert_eq!(entry.weights(), &weights[..]);
    assert!(entry.scales().is_empty());
}

#[test]
fn staging_buffers_recycle_without_new_mappings() {
    let pool = StagingPool::new(4, 10_000).unwrap();
    assert_eq!(pool.placement(), None);
    let (start, end) = pool.span();
    let mappings = diag::maps_in_range(start, end).unwrap();
    assert_eq!(mappings, 1);
    let mut taken: Vec<_> = (0..4).map(|_| pool.take().unwrap()).collect();
    assert!(pool.take().is_none());
    assert!(
        pool.take_timeout(std::time::Duration::from_millis(1))
            .is_none()
    );
    for (i, buffer) in taken.iter_mut().enumerate() {
        assert_eq!(buffer.as_slice().len(), 10_000);
        assert_eq!(
            buffer.as_slice().as_ptr() as usize % numapin::page_size(),
            0
        );
        buffer.as_mut_slice().fill(i as u8 + 1);
    }
    for (i, buffer) in taken.iter().enumerate() {
        assert!(buffer.as_slice().iter().all(|&b| b == i as u8 + 1));
    }
    drop(taken);
    assert_eq!(pool.available(), 4);
    // Many passes through the pool from several threads, some waiting for a buffer.
    let pool = Arc::new(pool);
    std::thread::scope(|s| {
        for t in 0..8u8 {
            let pool = &pool;
            s.spawn(move || {
                for _ in 0..2_000 {
                    let mut buffer = pool.take_wait();
                    buffer.as_mut_slice().fill(t);
                    assert!(buffer.as_slice().iter().all(|&b| b == t));
                }
            });
        }
    });
    assert_eq!(pool.available(), 4);
    assert_eq!(diag::maps_in_range(start, end).unwrap(), mappings);
}

#[test]
fn a_bound_staging_pool_says_whether_the_bind_took() {
    let node = nodes().iter().next().unwrap();
    let pool = StagingPool::bound(2, 4096, node).unwrap();
    assert_eq!(pool.placement(), Some(expected_placement()));
    let mut buffer = pool.take().unwrap();
    buffer.as_mut_slice()[0] = 1;
    assert_eq!(buffer.as_slice()[0], 1);
    assert!(matches!(
        StagingPool::new(0, 4096),
        Err(Error::InvalidArgument {
            reason: Invalid::Empty { .. },
            ..
        })
    ));
    assert!(matches!(
        StagingPool::new(1, 0),
        Err(Error::InvalidArgument {
            reason: Invalid::Empty { .. },
            ..
        })
    ));
    assert!(matches!(
        StagingPool::new(usize::MAX, 4096),
        Err(Error::InvalidArgument {
            reason: Invalid::Overflow { .. },
            ..
        })
    ));
}

/// VM: a cache over nodes 0-2 keeps every slot's pages on its node across evictions.
#[test]
fn numa_cache_slots_stay_on_their_nodes_across_evictions() {
    let Some(nodes) = need_nodes("numa_cache_slots_stay_on_their_nodes_across_evictions", 3) else {
        return;
    };
    let nodes = NodeSet::from_nodes(nodes.iter().take(3).map(|n| n.index())).unwrap();
    let node_list: Vec<Node> = nodes.iter().collect();
    let cache = new_cache(nodes, 32);
    let experts = Experts::new(17);
    let mappings = cache.stats().unwrap().mappings;
    // Hints spread over the nodes; many more keys than slots, so slots are reused.
    let mut rng = XorShift(99);
    for _ in 0..20_000 {
        let key = (rng.below(LAYERS), rng.below(EXPERTS));
        let hint = node_list[rng.below(node_list.len())];
        let entry = cache
            .get_or_load(key.0, key.1, &experts.source(key), Some(hint))
            .unwrap();
        experts.check(&entry);
    }
    let stats = cache.stats().unwrap();
    assert!(stats.evictions > 0);
    assert_eq!(stats.mappings, mappings);
    // spans(): per node in order, weights then scales.
    let spans = cache.spans();
    assert_eq!(spans.len(), 2 * node_list.len());
    for (i, node) in node_list.iter().enumerate() {
        assert_eq!(stats.nodes[i].placement, Placement::Bound);
        for &(start, end) in &spans[2 * i..2 * i + 2] {
            // SAFETY: the span is the cache's live region.
            let observed = unsafe { numapin::range_placement(start as *const u8, end - start) };
            let h = match observed.unwrap() {
                Observed::Known(h) => h,
                Observed::Degraded(why) => panic!("placement degraded on a NUMA machine: {why}"),
            };
            assert_eq!(h.present(), (end - start) / numapin::page_size(), "{h:?}");
            assert_eq!(h.on(*node), h.present(), "node {node}: {h:?}");
        }
    }
}

#[test]
fn region_per_slot_accessors_check_their_ranges() {
    let page = numapin::page_size();
    let region = numapin::Region::anonymous(4 * page).unwrap();
    assert!(matches!(
        region.slot(0..4 * page + 1),
        Err(Error::InvalidArgument { .. })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 8..4;
    assert!(matches!(
        region.slot(reversed),
        Err(Error::InvalidArgument { .. })
    ));
    // SAFETY: no other reference to the region's bytes lives in this test.
    let a = unsafe { region.slot_mut_unchecked(0..page) }.unwrap();
    // SAFETY: a range apart from `a`'s.
    let b = unsafe { region.slot_mut_unchecked(page..3 * page) }.unwrap();
    a.fill(1);
    b.fill(2);
    assert_eq!(region.slot(0..page).unwrap(), &vec![1u8; page][..]);
    assert_eq!(
        region.slot(page..3 * page).unwrap(),
        &vec![2u8; 2 * page][..]
    );
    assert_eq!(
        numapin::resident_pages(region.as_ptr() as usize, 4 * page).unwrap(),
        3
    );
    // SAFETY: no slice of the range lives any more (`a` is not used after this).
    let err = unsafe { region.release_unchecked(1..page) }.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    // SAFETY: as above.
    unsafe { region.release_unchecked(0..page) }.unwrap();
    // Counted before reading: a read maps the zero page, which mincore counts.
    assert_eq!(
        numapin::resident_pages(region.as_ptr() as usize, 4 * page).unwrap(),
        2
    );
    assert_eq!(region.slot(0..page).unwrap(), &vec![0u8; page][..]);
    // SAFETY: nothing references bytes past the region (the call refuses the range).
    let err = unsafe { region.slot_mut_unchecked(3 * page..5 * page) }.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    let (start, end, len) = (3 * page as u64, 5 * page as u64, 4 * page as u64);
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                reason: Invalid::OutOfBounds { start: s, end: e, len: l, .. },
                ..
            } if (s, e, l) == (start, end, len)
        ),
        "{err:?}"
    );
}

/// The conditions a caller reacts to are typed details of `InvalidArgument`, with the
/// figures: a cache with no slots or no nodes, a source larger than a slot.
#[test]
fn invalid_cache_arguments_are_typed() {
    let none = |result: numapin::Result<ExpertCache>| match result {
        Err(Error::InvalidArgument {
            op: "ExpertCache::new",
            reason: reason @ Invalid::Empty { .. },
        }) => reason.to_string(),
        other => panic!("{:?}", other.map(|_| ())),
    };
    let one = NodeSet::from_nodes([0]).unwrap();
    let options = CacheOptions::default;
    let text = none(ExpertCache::new(one, 0, 4096, 0, options()));
    assert!(text.contains("slots per node (capacity 0)"), "{text}");
    none(ExpertCache::new(NodeSet::new(), 1, 4096, 0, options()));
    none(ExpertCache::new(one, 1, 0, 0, options()));
    assert!(matches!(
        ExpertCache::new(one, 2, usize::MAX, 0, options()),
        Err(Error::InvalidArgument {
            reason: Invalid::Overflow { .. },
            ..
        })
    ));

    let cache = ExpertCache::new(one, 1, 4096, 64, options()).unwrap();
    let big = vec![0u8; 4097];
    let source = ExpertSource::Memory {
        weights: &big,
        scales: &[],
    };
    match cache.get_or_load(3, 5, &source, None) {
        Err(Error::InvalidArgument {
            reason:
                reason @ Invalid::TooLarge {
                    size: 4097,
                    max: 4096,
                    ..
                },
            ..
        }) => assert_eq!(
            reason.to_string(),
            "layer 3 expert 5 weights: 4097 bytes but a slot holds 4096"
        ),
        other => panic!("{:?}", other.map(|e| e.key())),
    }
}

/// A thread that waited for another thread's load of the same key, which failed, gets
/// the loader's error: the same variant and the same message, not an `InvalidArgument`
/// wrapping its text (issue 20 §5). Which thread loads and whether the other arrives in
/// time to wait are races: the first piece is 8 MiB (the load takes a while), and rounds
/// repeat until one had a waiter (one load failure for two failed calls); every round
/// checks that both calls failed alike.
#[test]
fn a_waiter_gets_the_loaders_error_kind() {
    const BIG: usize = 8 << 20;
    let path = std::env::temp_dir().join(format!("numapin-waiter-{}", std::process::id()));
    std::fs::write(&path, vec![7u8; BIG]).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    // The first piece reads fine; the second runs past the end of the file: the read
    // ends early, after the 8 MiB copy.
    let source = ExpertSource::from_file(&file, &[(0, BIG), (BIG as u64 - 10, 100)], &[]);
    let cache = ExpertCache::new(
        NodeSet::from_nodes([0]).unwrap(),
        2,
        BIG + 4096,
        0,
        CacheOptions::default(),
    )
    .unwrap();
    let mut waited = 0;
    for round in 0..200 {
        let failures = cache.stats().unwrap().load_failures;
        let start = Barrier::new(2);
        let errors: Vec<Error> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        cache.get_or_load(round, 0, &source, None).map(|_| ())
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap().unwrap_err())
                .collect()
        });
        let (a, b) = (&errors[0], &errors[1]);
        assert!(matches!(a, Error::Io { .. }), "{a:?}");
        assert_eq!(
            std::mem::discriminant(a),
            std::mem::discriminant(b),
            "{a:?} / {b:?}"
        );
        assert_eq!(a.to_string(), b.to_string());
        assert_eq!(a.errno(), b.errno());
        if let (Error::Io { source: x, .. }, Error::Io { source: y, .. }) = (a, b) {
            assert_eq!(x.kind(), y.kind());
        }
        if cache.stats().unwrap().load_failures == failures + 1 {
            waited += 1;
            if waited == 3 {
                break;
            }
        }
    }
    std::fs::remove_file(&path).unwrap();
    assert!(
        waited > 0,
        "no round had a thread wait for the other's load"
    );
    assert!(cache.get(0, 0).is_none());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    /// Small caches (1–4 slots) under short random streams over a few keys, where CLOCK's
    /// corner cases live (every bit set, the hand wrapping, a slot reused at once): the
    /// cache answers as the reference does at every step.
    #[test]
    fn small_caches_follow_the_reference_clock(
        slots in 1usize..5,
        ops in proptest::collection::vec((0usize..7, proptest::bool::ANY), 1..200),
    ) {
        let node = nodes().iter().next().unwrap();
        let cache = new_cache(NodeSet::from_nodes([node.index()]).unwrap(), slots);
        let experts = Experts::new(17);
        let mut model = Model::new(&[node], slots);
        let ops: Vec<Op> = ops
            .into_iter()
            .map(|(e, load)| if load { Op::Load((2, e), node) } else { Op::Get((2, e)) })
            .collect();
        run_against_model(&cache, &mut model, &experts, &ops);
        assert_same_as_model(&cache, &model);
        assert_holds(&cache, &model, &experts);
    }
}

/// Entries held across other threads' churn keep their bytes: each thread keeps a few
/// entries alive for a while (pinned) while all threads load, hit and evict; a held
/// entry is checked again when it is dropped. An eviction or refill of a pinned slot
/// would show as other bytes.
#[test]
fn held_entries_keep_their_bytes_while_others_churn() {
    const HELD: usize = 4;
    let nodes = cache_nodes();
    let node_list: Vec<Node> = nodes.iter().collect();
    // Room for every thread's held entries and one in flight, on every node.
    let slots_per_node = THREADS * (HELD + 1) + 8;
    let cache = new_cache(nodes, slots_per_node);
    let experts = Experts::new(23);
    let per_thread = ops() / THREADS / 4;
    let start = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (cache, experts, start, node_list) = (&cache, &experts, &start, &node_list);
            s.spawn(move || {
                let ops = stream(300 + t as u64, per_thread, node_list);
                let mut rng = XorShift(9 + t as u64);
                let mut held = std::collections::VecDeque::new();
                start.wait();
                for op in ops {
                    let entry = match op {
                        Op::Get(key) => cache.get(key.0, key.1),
                        Op::Load(key, hint) => Some(
                            cache
                                .get_or_load(key.0, key.1, &experts.source(key), Some(hint))
                                .unwrap(),
                        ),
                    };
                    if let Some(entry) = entry {
                        experts.check(&entry);
                        if rng.below(8) == 0 {
                            held.push_back(entry);
                        }
                    }
                    if held.len() > HELD {
                        experts.check(&held.pop_front().unwrap());
                    }
                }
                for entry in held {
                    experts.check(&entry);
                }
            });
        }
    });
    let stats = cache.stats().unwrap();
    assert!(stats.evictions > 0, "the run churned: {stats:?}");
    assert_eq!(stats.load_failures, 0);
}
