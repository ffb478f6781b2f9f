//! Randomized and concurrent runs: every entry holds its expert's bytes, and the hits,
//! misses and state equal a reference CLOCK model's.

use super::*;

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
