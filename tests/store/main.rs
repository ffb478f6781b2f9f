//! PinStore: packing, content, release/ensure, the map budget, bad input, concurrency.

mod bad_input;
#[path = "../common/mod.rs"]
mod common;

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use common::degrade_here;
use numapin::store::{ExpertSource, Kind, LayerSpec, Layout, PinStore, StoreOptions};
use numapin::{Error, Invalid, NodeSet, diag};

use numapin::policy::{MemPolicy, Observed, Placement};

fn byte(layer: usize, expert: usize, kind: usize, i: usize) -> u8 {
    ((layer * 131 + expert * 31 + kind * 17 + i * 7 + i / 4096) % 251) as u8
}

fn tensor(layer: usize, expert: usize, kind: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| byte(layer, expert, kind, i)).collect()
}

/// Weights and scales of every expert of a layer, in memory.
fn layer_data(layer: usize, experts: usize, w: usize, s: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..experts)
        .map(|e| (tensor(layer, e, 0, w), tensor(layer, e, 1, s)))
        .collect()
}

fn memory_sources(data: &[(Vec<u8>, Vec<u8>)]) -> Vec<ExpertSource<'_>> {
    data.iter()
        .map(|(w, s)| ExpertSource::Memory {
            weights: w,
            scales: s,
        })
        .collect()
}

fn interleave() -> Layout {
    Layout::Interleave(NodeSet::allowed().unwrap())
}

fn expected_placement() -> Option<Placement> {
    Some(degrade_here().map_or(Placement::Bound, Placement::Degraded))
}

#[test]
fn sixty_five_thousand_slots_cost_two_mappings_per_layer() {
    let (layers, experts, w, s) = (64, 1024, 4096, 4096);
    let store = PinStore::new(interleave(), StoreOptions::default()).unwrap();
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: s,
    };
    for layer in 0..layers {
        let data = layer_data(layer, experts, w, s);
        let report = store
            .pack_layer(layer, &spec, &memory_sources(&data))
            .unwrap();
        assert_eq!((report.regions, report.mbind_calls), (2, 2));
    }
    let stats = store.stats().unwrap();
    assert_eq!(stats.layers, layers);
    assert_eq!(stats.experts_loaded, layers * experts);
    assert_eq!(stats.bytes, (layers * experts * (w + s)) as u64);
    assert!(
        stats.vmas <= 2 * layers + 4,
        "{} mappings for {layers} layers",
        stats.vmas
    );
    assert_eq!(stats.mbind_calls, 2 * layers);
    assert_eq!(stats.placement, expected_placement());
    assert_eq!(stats.pages_source, common::pages_source_here());
    let present: u64 = stats.pages_per_node.values().sum();
    let total = (layers * experts * (w + s) / numapin::page_size()) as u64;
    match stats.pages_source {
        // Sampled: every page is present, estimated within one sample step per region.
        Some(numapin::PagesSource::MovePages) => {
            assert_eq!(stats.pages_merged, 0);
            assert!(
                present.abs_diff(total) <= (stats.sample_step * 2 * layers) as u64,
                "{present} vs {total}"
            );
        }
        // Counted whole; pages in a mapping merged across the store's edge are unknown.
        Some(numapin::PagesSource::NumaMaps) => {
            assert_eq!(stats.sample_step, 1);
            assert_eq!(present + stats.pages_merged, total, "{stats:?}");
        }
        None => assert!(stats.pages_per_node.is_empty()),
    }
    // Spot-check content across the store.
    for (layer, expert) in [(0, 0), (17, 1023), (63, 511)] {
        assert_eq!(
            store.weights(layer, expert).unwrap(),
            &tensor(layer, expert, 0, w)[..]
        );
        assert_eq!(
            store.scales(layer, expert).unwrap(),
            &tensor(layer, expert, 1, s)[..]
        );
    }
}

fn write_model_file(
    dir: &std::path::Path,
    layer: usize,
    experts: usize,
    w: usize,
    s: usize,
) -> std::path::PathBuf {
    let path = dir.join(format!("layer{layer}.bin"));
    let mut f = std::fs::File::create(&path).unwrap();
    // Per expert: weights then scales, back to back.
    for e in 0..experts {
        f.write_all(&tensor(layer, e, 0, w)).unwrap();
        f.write_all(&tensor(layer, e, 1, s)).unwrap();
    }
    path
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("numapin-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn file_sources_load_exactly_with_and_without_coalescing() {
    let dir = temp_dir("file-sources");
    let (experts, w, s) = (16, 3 * 4096 + 100, 999);
    let path = write_model_file(&dir, 0, experts, w, s);
    let file = std::fs::File::open(&path).unwrap();
    let store = PinStore::new(interleave(), StoreOptions::default().loader_threads(2)).unwrap();
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: s,
    };
    let base = |e: usize| (e * (w + s)) as u64;

    // Layer 0: weights as three adjacent pieces (gate, up, down): one read each tensor.
    let third = w / 3;
    let adjacent: Vec<ExpertSource> = (0..experts)
        .map(|e| {
            ExpertSource::from_file(
                &file,
                &[
                    (base(e), third),
                    (base(e) + third as u64, third),
                    (base(e) + 2 * third as u64, w - 2 * third),
                ],
                &[(base(e) + w as u64, s)],
            )
        })
        .collect();
    let report = store.pack_layer(0, &spec, &adjacent).unwrap();
    assert_eq!(report.reads, 2 * experts);

    // Layer 1: the same bytes named in reverse order of pieces: no coalescing possible.
    let split = |e: usize| vec![(base(e) + third as u64, w - third), (base(e), third)];
    let reversed: Vec<ExpertSource> = (0..experts)
        .map(|e| ExpertSource::from_file(&file, &split(e), &[(base(e) + w as u64, s)]))
        .collect();
    let report = store.pack_layer(1, &spec, &reversed).unwrap();
    assert_eq!(report.reads, 3 * experts);

    for e in 0..experts {
        let want = tensor(0, e, 0, w);
        assert_eq!(
            store.weights(0, e).unwrap(),
            &want[..],
            "layer 0 expert {e}"
        );
        let mut swapped = want[third..].to_vec();
        swapped.extend_from_slice(&want[..third]);
        assert_eq!(
            store.weights(1, e).unwrap(),
            &swapped[..],
            "layer 1 expert {e}"
        );
        assert_eq!(store.scales(1, e).unwrap(), &tensor(0, e, 1, s)[..]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Resident bytes of a slot's whole stride (mincore: exact per range, unlike smaps,
/// whose mappings merge with equal neighbours such as the layer's other region).
fn slot_rss(ptr: *const u8, stride: usize) -> usize {
    numapin::resident_pages(ptr as usize, stride).unwrap() * numapin::page_size()
}

#[test]
fn release_drops_the_slot_keeps_the_policy_and_ensure_restores() {
    let (experts, w, s) = (8, 5 * 4096, 4096);
    let options = StoreOptions::default().huge_pages(false);
    let mut store = PinStore::new(interleave(), options).unwrap();
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: s,
    };
    let data = layer_data(0, experts, w, s);
    store.pack_layer(0, &spec, &memory_sources(&data)).unwrap();

    let weights_at = store.weights(0, 3).unwrap().as_ptr();
    let scales_at = store.scales(0, 3).unwrap().as_ptr();
    assert_eq!((slot_rss(weights_at, w), slot_rss(scales_at, s)), (w, s));

    store.release_kind(0, 3, Kind::Weights).unwrap();
    assert_eq!((slot_rss(weights_at, w), slot_rss(scales_at, s)), (0, s));
    assert_eq!(
        slot_rss(store.weights(0, 2).unwrap().as_ptr(), w),
        w,
        "neighbours stay"
    );
    assert!(matches!(
        store.weights(0, 3),
        Err(Error::Released {
            layer: 0,
            expert: 3,
            kind: "weights",
            ..
        })
    ));
    assert_eq!(
        store.scales(0, 3).unwrap(),
        &data[3].1[..],
        "scales survive a weights release"
    );
    match store.slot_policy(0, 3, Kind::Weights).unwrap() {
        Observed::Known((p, _)) => {
            assert_eq!(p, MemPolicy::Interleave(NodeSet::allowed().unwrap()))
        }
        Observed::Degraded(reason) => assert_eq!(Some(reason), degrade_here()),
    }

    store.release_kind(0, 3, Kind::Scales).unwrap();
    assert_eq!(slot_rss(scales_at, s), 0);
    let stats = store.stats().unwrap();
    assert_eq!(stats.experts_loaded, experts - 1);
    assert_eq!(stats.bytes, ((experts - 1) * (w + s)) as u64);

    let source = ExpertSource::Memory {
        weights: &data[3].0,
        scales: &data[3].1,
    };
    store.ensure(0, 3, &source).unwrap();
    assert_eq!(store.weights(0, 3).unwrap(), &data[3].0[..]);
    assert_eq!(
        store.weights(0, 3).unwrap().as_ptr(),
        weights_at,
        "same slot"
    );
    assert_eq!(store.scales(0, 3).unwrap(), &data[3].1[..]);
    assert_eq!(slot_rss(weights_at, w), w);

    // Releasing scales only, then ensure: the weights are not reloaded.
    store.release_kind(0, 5, Kind::Scales).unwrap();
    let other = ExpertSource::Memory {
        weights: &data[6].0,
        scales: &data[5].1,
    };
    store.ensure(0, 5, &other).unwrap();
    assert_eq!(store.weights(0, 5).unwrap(), &data[5].0[..]);
    assert_eq!(store.scales(0, 5).unwrap(), &data[5].1[..]);
    // ensure of a loaded expert is a no-op; release of both and ensure restores both.
    store.release(0, 7).unwrap();
    store
        .ensure(
            0,
            7,
            &ExpertSource::Memory {
                weights: &data[7].0,
                scales: &data[7].1,
            },
        )
        .unwrap();
    assert_eq!(store.weights(0, 7).unwrap(), &data[7].0[..]);
}

#[test]
fn the_map_budget_refuses_up_front_and_names_the_figures() {
    // A margin of 3 mappings: alone, so that no other test thread maps or unmaps between
    // the count and the pack.
    if !common::alone("the_map_budget_refuses_up_front_and_names_the_figures") {
        return;
    }
    let current = diag::map_count().unwrap();
    let options = StoreOptions::default()
        // Room for one region and the margin of 2 the store keeps for its own heap
        // allocations: a layer with scales (2 regions) does not fit, one without does.
        .vma_budget(Some(current + 3))
        .loader_threads(1);
    let store = PinStore::new(interleave(), options).unwrap();
    let data = layer_data(0, 4, 4096, 4096);
    let spec = LayerSpec {
        experts: 4,
        weight_bytes: 4096,
        scale_bytes: 4096,
    };
    match store.pack_layer(0, &spec, &memory_sources(&data)) {
        Err(
            e @ Error::MapBudget {
                needed: 4, limit, ..
            },
        ) => {
            assert_eq!(limit, current + 3);
            let text = e.to_string();
            assert!(
                text.contains("vm.max_map_count") && text.contains(&limit.to_string()),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(store.stats().unwrap().layers, 0);
    // Without scales one mapping fits.
    let spec = LayerSpec {
        scale_bytes: 0,
        ..spec
    };
    let weights_only: Vec<ExpertSource> = data
        .iter()
        .map(|(w, _)| ExpertSource::Memory {
            weights: w,
            scales: &[],
        })
        .collect();
    let report = store.pack_layer(0, &spec, &weights_only);
    // The process may have gained a mapping meanwhile (another test thread); both
    // outcomes are the budget speaking, never a half-loaded layer.
    match report {
        Ok(r) => assert_eq!(r.regions, 1),
        Err(Error::MapBudget { needed: 3, .. }) => {}
        Err(e) => panic!("{e}"),
    }

    // Loader threads are not budgeted up front: each is spawned only if its mappings fit
    // when it starts (the map-limit cases are in tests/hostile.rs), so the up-front
    // figure is the regions and the margin.
    let threaded = PinStore::new(
        interleave(),
        StoreOptions::default()
            .vma_budget(Some(0))
            .loader_threads(3),
    )
    .unwrap();
    let spec = LayerSpec {
        scale_bytes: 4096,
        ..spec
    };
    match threaded.pack_layer(0, &spec, &memory_sources(&data)) {
        Err(Error::MapBudget { needed, .. }) => assert_eq!(needed, 2 + 2),
        other => panic!("{other:?}"),
    }
    match threaded.check_model_budget(10, &spec) {
        Err(Error::MapBudget { needed, .. }) => assert_eq!(needed, 20 + 2),
        other => panic!("{other:?}"),
    }
}

#[test]
fn readers_serve_packed_layers_while_another_layer_loads() {
    let (experts, w, s) = (64, 64 * 1024, 4096);
    let store = PinStore::new(interleave(), StoreOptions::default()).unwrap();
    let spec = LayerSpec {
        experts,
        weight_bytes: w,
        scale_bytes: s,
    };
    let first = layer_data(0, experts, w, s);
    store.pack_layer(0, &spec, &memory_sources(&first)).unwrap();
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let readers: Vec<_> = (0..3)
            .map(|t| {
                let (store, first, done) = (&store, &first, &done);
                scope.spawn(move || {
                    let mut checks = 0usize;
                    while !done.load(Ordering::Acquire) || checks < experts {
                        let e = (checks * 7 + t) % experts;
                        assert_eq!(store.weights(0, e).unwrap(), &first[e].0[..]);
                        checks += 1;
                    }
                    checks
                })
            })
            .collect();
        for layer in 1..6 {
            let data = layer_data(layer, experts, w, s);
            store
                .pack_layer(layer, &spec, &memory_sources(&data))
                .unwrap();
        }
        done.store(true, Ordering::Release);
        for r in readers {
            assert!(r.join().unwrap() >= experts);
        }
    });
    assert_eq!(store.stats().unwrap().layers, 6);
}

#[test]
fn layer_per_node_binds_layers_round_robin() {
    let nodes = NodeSet::allowed().unwrap();
    let store = PinStore::new(Layout::LayerPerNode(nodes), StoreOptions::default()).unwrap();
    let spec = LayerSpec {
        experts: 4,
        weight_bytes: 8192,
        scale_bytes: 0,
    };
    for layer in 0..nodes.len() + 1 {
        let data = layer_data(layer, 4, 8192, 0);
        let report = store
            .pack_layer(layer, &spec, &memory_sources(&data))
            .unwrap();
        let node = nodes.nth(layer % nodes.len()).unwrap();
        assert_eq!(
            report.policy,
            Some(MemPolicy::Bind(std::iter::once(node).collect()))
        );
        assert_eq!(report.placement, expected_placement());
        if let Observed::Known((p, _)) = store.slot_policy(layer, 0, Kind::Weights).unwrap() {
            assert_eq!(Some(p), report.policy);
        }
    }
}

#[test]
fn unplaced_binds_nothing() {
    let store = PinStore::new(Layout::Unplaced, StoreOptions::default()).unwrap();
    let data = layer_data(0, 4, 4096, 4096);
    let report = store
        .pack_layer(
            0,
            &LayerSpec {
                experts: 4,
                weight_bytes: 4096,
                scale_bytes: 4096,
            },
            &memory_sources(&data),
        )
        .unwrap();
    assert_eq!(
        (report.mbind_calls, report.placement, report.policy),
        (0, None, None)
    );
    let stats = store.stats().unwrap();
    assert_eq!((stats.mbind_calls, stats.placement), (0, None));
    assert_eq!(store.scales(0, 3).unwrap(), &data[3].1[..]);
}

#[test]
fn store_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<PinStore>();
}

#[test]
fn scales_of_a_layer_without_scales_still_check_the_expert() {
    let store = PinStore::new(Layout::Unplaced, StoreOptions::default()).unwrap();
    let weights = [vec![1u8; 100], vec![2u8; 100]];
    let sources: Vec<ExpertSource> = weights
        .iter()
        .map(|w| ExpertSource::Memory {
            weights: w,
            scales: &[],
        })
        .collect();
    let spec = LayerSpec {
        experts: 2,
        weight_bytes: 100,
        scale_bytes: 0,
    };
    store.pack_layer(0, &spec, &sources).unwrap();
    assert_eq!(store.scales(0, 1).unwrap(), &[] as &[u8]);
    for expert in [2, usize::MAX] {
        for result in [store.scales(0, expert), store.weights(0, expert)] {
            match result {
                Err(Error::OutOfRange { index, len: 2, .. }) => assert_eq!(index, expert),
                other => panic!("{other:?}"),
            }
        }
    }
}

#[test]
fn an_expert_straddling_two_files_loads_exactly_and_the_spec_fits_its_sources() {
    let dir = temp_dir("two-shards");
    let (a, b) = (dir.join("shard-a"), dir.join("shard-b"));
    let bytes_a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let bytes_b: Vec<u8> = (0..10_000u32).map(|i| (i % 241) as u8 ^ 0x5a).collect();
    std::fs::write(&a, &bytes_a).unwrap();
    std::fs::write(&b, &bytes_b).unwrap();
    let (fa, fb) = (
        std::fs::File::open(&a).unwrap(),
        std::fs::File::open(&b).unwrap(),
    );
    // gate and up at the end of shard a, down at the start of shard b (adjacent offsets in
    // two files: two reads, never one), scales from shard b.
    let source = ExpertSource::File {
        weights: vec![
            numapin::store::Piece::new(&fa, 9_000, 500),
            numapin::store::Piece::new(&fa, 9_500, 500),
            numapin::store::Piece::new(&fb, 0, 700),
        ],
        scales: vec![numapin::store::Piece::new(&fb, 9_000, 64)],
    };
    let sources = vec![source.clone(), source];
    let spec = LayerSpec::fitting(&sources).unwrap();
    assert_eq!(
        spec,
        LayerSpec {
            experts: 2,
            weight_bytes: 1700,
            scale_bytes: 64
        }
    );
    let store = PinStore::new(interleave(), StoreOptions::default()).unwrap();
    let report = store.pack_layer(0, &spec, &sources).unwrap();
    assert_eq!(
        report.reads,
        2 * (2 + 1),
        "one read per file run per tensor"
    );
    let mut want = bytes_a[9_000..10_000].to_vec();
    want.extend_from_slice(&bytes_b[..700]);
    for e in 0..2 {
        assert_eq!(store.weights(0, e).unwrap(), &want[..]);
        assert_eq!(store.scales(0, e).unwrap(), &bytes_b[9_000..9_064]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A slot alignment or a loader-thread count the store cannot take is a typed detail
/// naming the option and the value.
#[test]
fn bad_store_options_are_typed() {
    use numapin::store::SlotAlign;
    match SlotAlign::Bytes(3).bytes() {
        Err(Error::InvalidArgument {
            op: "SlotAlign",
            reason:
                reason @ Invalid::BadValue {
                    what: "SlotAlign::Bytes",
                    ..
                },
        }) => {
            let Invalid::BadValue { value, .. } = &reason else {
                unreachable!()
            };
            assert_eq!(value, "3");
            assert!(
                reason
                    .to_string()
                    .starts_with("SlotAlign::Bytes 3: not a power of two")
            );
        }
        other => panic!("{other:?}"),
    }
    let options = StoreOptions::default().loader_threads(0);
    assert!(matches!(
        PinStore::new(Layout::Unplaced, options),
        Err(Error::InvalidArgument {
            reason: Invalid::Empty { .. },
            ..
        })
    ));
}
