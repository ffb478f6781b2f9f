//! The map-limit failure this crate exists to prevent, reproduced: binding one slab per
//! expert crosses `vm.max_map_count` and fails with ENOMEM, while a PinStore holding the
//! same model costs two mappings; and the store's budget check refuses a model that
//! cannot fit up front, with the figures, instead of failing mid-load.
//!
//! Runs against the real limit: 65,530 on a default host; the VM scenario of
//! `cargo xtask test-numa` lowers it to 4,096 and sets `NUMAPIN_MAP_LIMIT` to say so.
//! A process-wide figure, so this binary is its own.

mod common;

use common::{Expect, expect};
use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, StoreOptions};
use numapin::{Advice, Errno, Error, NodeSet, Region, diag};

use numapin::policy::MemPolicy;
use numapin_testkit::baseline::SlabPerExpert;

fn limit() -> usize {
    let limit = diag::max_map_count().unwrap();
    if let Ok(promised) = std::env::var("NUMAPIN_MAP_LIMIT") {
        assert_eq!(
            limit.to_string(),
            promised,
            "vm.max_map_count is not the scenario's"
        );
    }
    limit
}

/// One test, in order: the budget checks need free map slots, and the slab-per-expert
/// run leaves the process's map table nearly full (freed heap keeps its policies and
/// splits), so it comes last.
#[test]
fn the_map_limit_scenario() {
    budget_refuses_a_model_that_cannot_fit_up_front();
    slab_per_expert_hits_the_map_limit_where_pinstore_does_not();
}

fn slab_per_expert_hits_the_map_limit_where_pinstore_does_not() {
    let limit = limit();
    // Two slabs per expert, about two mappings per bound slab: enough experts to need
    // more mappings than the limit allows.
    let experts = (limit / 2 + 64).max(4096);
    let (w, s) = (vec![3u8; 4096], vec![4u8; 4096]);
    let sources: Vec<ExpertSource> = (0..experts)
        .map(|_| ExpertSource::Memory {
            weights: &w,
            scales: &s,
        })
        .collect();
    let spec = LayerSpec {
        experts,
        weight_bytes: 4096,
        scale_bytes: 4096,
    };
    let nodes = NodeSet::allowed().unwrap();

    let store = PinStore::new(Layout::Interleave(nodes), StoreOptions::default()).unwrap();
    store.pack_layer(0, &spec, &sources).unwrap();
    let stats = store.stats().unwrap();
    assert!(
        stats.vmas <= 2 + 4,
        "PinStore: {} mappings for one layer",
        stats.vmas
    );
    assert_eq!(store.weights(0, experts - 1).unwrap(), &w[..]);

    let mut slabs = SlabPerExpert::new();
    let result = slabs.load_layer(0, &spec, &sources, Some(&MemPolicy::Interleave(nodes)));
    match (expect(), result) {
        (Expect::Full, Err(e)) => {
            assert_eq!(e.errno(), Some(Errno::NOMEM), "{e}");
            assert!(slabs.slabs() < 2 * experts);
            eprintln!(
                "slab per expert failed as expected after {} slabs: {e}",
                slabs.slabs()
            );
        }
        (Expect::Full, Ok(())) => panic!(
            "{} bound slabs fit under vm.max_map_count {limit}",
            slabs.slabs()
        ),
        // Unplaced, slabs do not split their mappings: nothing to hit.
        (_, Ok(())) => assert_eq!(slabs.slabs(), 2 * experts),
        (e, Err(err)) => panic!("{e:?}: {err}"),
    }
}

fn budget_refuses_a_model_that_cannot_fit_up_front() {
    let limit = limit();
    let nodes = NodeSet::allowed().unwrap();
    let spec = LayerSpec {
        experts: 2,
        weight_bytes: 4096,
        scale_bytes: 4096,
    };
    let store = PinStore::new(
        Layout::Interleave(nodes),
        StoreOptions::default().huge_pages(false),
    )
    .unwrap();
    match store.check_model_budget(limit / 2 + 1, &spec) {
        Err(e @ Error::MapBudget { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains(&limit.to_string()) && text.contains("vm.max_map_count"),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
    store.check_model_budget(4, &spec).unwrap();

    // Layer by layer against the real limit when it is small (the VM scenario), else
    // against a budget a few mappings above the current count: the store stops with
    // MapBudget, never ENOMEM, and keeps serving what it packed.
    let budget = (limit > 8192).then(|| diag::map_count().unwrap() + 16);
    let store = PinStore::new(
        Layout::Interleave(nodes),
        StoreOptions::default()
            .huge_pages(false)
            .vma_budget(budget)
            .loader_threads(2),
    )
    .unwrap();
    let data = [vec![1u8; 4096], vec![2u8; 4096]];
    let sources: Vec<ExpertSource> = data
        .iter()
        .map(|d| ExpertSource::Memory {
            weights: d,
            scales: d,
        })
        .collect();
    // Adjacent layers with equal policies merge into one mapping, so the test puts an
    // unmergeable mapping of its own between layers, as a process's other allocations
    // would be: the map count grows until the budget speaks.
    let mut spacers = Vec::new();
    let mut packed = 0;
    let error = loop {
        match store.pack_layer(packed, &spec, &sources) {
            Ok(_) => packed += 1,
            Err(e) => break e,
        }
        let spacer = Region::anonymous(4096).unwrap();
        spacer.advise(Advice::DontDump).unwrap();
        spacers.push(spacer);
        assert!(
            packed <= limit,
            "packed {packed} layers without meeting the budget"
        );
    };
    assert!(
        matches!(error, Error::MapBudget { needed: 4, .. }),
        "{error}"
    );
    assert!(packed > 0);
    assert_eq!(store.weights(packed - 1, 1).unwrap(), &data[1][..]);
    assert_eq!(store.stats().unwrap().layers, packed);
}
