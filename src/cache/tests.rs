//! What only the inside can count: that hits take no lock, that the locked path still
//! finds what the hints miss, and that a pinned slot stays pinned across a refill race.

use std::sync::atomic::Ordering;

use super::{CacheOptions, ExpertCache};
use crate::node::{Node, NodeSet};
use crate::source::ExpertSource;

const KEYS: usize = 64;

/// Each key's `(weights, scales)`.
type Bytes = Vec<(Vec<u8>, Vec<u8>)>;

fn bytes(key: usize) -> (Vec<u8>, Vec<u8>) {
    let w = (0..4096).map(|i| (i * 31 + key * 7) as u8).collect();
    let s = (0..64).map(|i| (i + key * 3) as u8).collect();
    (w, s)
}

fn loaded_cache(slots: usize) -> (ExpertCache, Bytes) {
    let cache = ExpertCache::new(
        NodeSet::from_nodes([0]).unwrap(),
        slots,
        4096,
        64,
        CacheOptions::default(),
    )
    .unwrap();
    let data: Vec<_> = (0..KEYS).map(bytes).collect();
    for (k, (w, s)) in data.iter().enumerate() {
        let source = ExpertSource::Memory {
            weights: w,
            scales: s,
        };
        cache.get_or_load(1, k, &source, Some(Node(0))).unwrap();
    }
    (cache, data)
}

/// The workload: 64 cached keys, two threads hitting them through `get` and
/// `get_or_load`; the cache's lock counter does not move, and every hit is counted.
#[test]
fn hits_take_no_lock() {
    const ROUNDS: usize = 20_000;
    let (cache, data) = loaded_cache(KEYS);
    let before = cache.stats().unwrap();
    let locks = cache.locks.load(Ordering::Relaxed);
    std::thread::scope(|s| {
        for t in 0..2 {
            let (cache, data) = (&cache, &data);
            s.spawn(move || {
                for i in 0..ROUNDS {
                    let k = (i * 7 + t * 13) % KEYS;
                    let entry = if i % 2 == 0 {
                        cache.get(1, k).unwrap()
                    } else {
                        let (w, s) = &data[k];
                        let source = ExpertSource::Memory {
                            weights: w,
                            scales: s,
                        };
                        cache.get_or_load(1, k, &source, None).unwrap()
                    };
                    assert_eq!(entry.weights(), &data[k].0[..]);
                    assert_eq!(entry.scales(), &data[k].1[..]);
                }
            });
        }
    });
    assert_eq!(
        cache.locks.load(Ordering::Relaxed),
        locks,
        "a hit took the lock"
    );
    let after = cache.stats().unwrap();
    assert_eq!(after.hits - before.hits, 2 * ROUNDS as u64);
    assert_eq!(
        (after.misses, after.loads),
        (before.misses, before.loads),
        "no miss"
    );
    // The counter does count: a miss takes the lock.
    assert!(cache.get(2, 0).is_none());
    assert!(cache.locks.load(Ordering::Relaxed) > locks);
    for slot in 0..cache.slots.len() {
        assert_eq!(cache.slots.pins(slot), 0, "every entry dropped");
    }
}

/// Without hints (a key whose window was full) a hit takes the locked path: still a hit,
/// still the right bytes; the next load of a key hints it again.
#[test]
fn the_locked_index_finds_what_the_hints_do_not() {
    let (cache, data) = loaded_cache(KEYS);
    cache.hints.clear();
    let before = cache.stats().unwrap();
    let locks = cache.locks.load(Ordering::Relaxed);
    for (k, (w, _)) in data.iter().enumerate() {
        assert_eq!(cache.get(1, k).unwrap().weights(), &w[..]);
    }
    assert_eq!(
        cache.locks.load(Ordering::Relaxed) - locks,
        KEYS as u64,
        "one lock per hint-less hit"
    );
    let after = cache.stats().unwrap();
    assert_eq!(
        (after.hits - before.hits, after.misses - before.misses),
        (KEYS as u64, 0)
    );
}

/// A held entry keeps its slot: with one slot, a miss on another key is `CacheFull`
/// and the held bytes stay; once dropped, the slot is evicted and refilled.
#[test]
fn a_pinned_slot_is_never_evicted() {
    let (cache, data) = loaded_cache(1);
    // Only the last key of the fill remains.
    let held = cache.get(1, KEYS - 1).unwrap();
    let (w, s) = bytes(500);
    let other = ExpertSource::Memory {
        weights: &w,
        scales: &s,
    };
    assert!(matches!(
        cache.get_or_load(9, 9, &other, None),
        Err(crate::error::Error::CacheFull { .. })
    ));
    assert_eq!(held.weights(), &data[KEYS - 1].0[..]);
    drop(held);
    assert_eq!(
        cache.get_or_load(9, 9, &other, None).unwrap().weights(),
        &w[..]
    );
    assert!(cache.get(1, KEYS - 1).is_none());
}
