//! The edge cases as typed errors, shrinking, staging buffers, slots on their nodes.

use super::*;

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
    // ops()/5: 20,000 on the host's default, 4,000 under TCG (NUMAPIN_CACHE_OPS in the
    // VM): many times the 96 slots either way, so every slot is reused.
    let mut rng = XorShift(99);
    for _ in 0..(ops() / 5).clamp(1_000, 20_000) {
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
