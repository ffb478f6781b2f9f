//! Feature `serde`: the reports, the manifest and the vocabulary types as JSON, and back.

mod common;

use std::collections::BTreeMap;

use common::{degrade_here, nodes};
use numapin::store::{
    DirectIo, ExpertSource, FileRead, IoUringFallback, Kind, LayerReport, LayerSpec, Layout,
    Manifest, ManifestRegion, PinStore, ReadFallback, ReadMode, Residency, ResidencyProbe,
    StoreOptions, StoreStats,
};
use numapin::{Node, NodeSet};

use numapin::policy::{DegradeReason, MemPolicy, Placement};
use proptest::prelude::*;

fn set(ids: &[usize]) -> NodeSet {
    NodeSet::from_nodes(ids.iter().copied()).unwrap()
}

fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap()
}

fn back<T: serde::de::DeserializeOwned>(text: &str) -> T {
    serde_json::from_str(text).unwrap()
}

#[test]
fn node_sets_and_policies_are_their_display_strings() {
    assert_eq!(json(&Node(3)), "3");
    assert_eq!(back::<Node>("3"), Node(3));
    assert_eq!(json(&set(&[0, 1, 2, 5, 1023])), r#""0-2,5,1023""#);
    assert_eq!(json(&NodeSet::new()), r#""""#);
    assert_eq!(back::<NodeSet>(r#""""#), NodeSet::new());
    // Nodes this machine does not have still deserialize: it is data, not a request.
    assert_eq!(back::<NodeSet>(r#""0-3,1023""#), set(&[0, 1, 2, 3, 1023]));
    let policies = [
        (MemPolicy::Default, r#""default""#),
        (MemPolicy::Local, r#""local""#),
        (MemPolicy::Preferred(Node(7)), r#""prefer:7""#),
        (
            MemPolicy::PreferredMany(set(&[0, 1])),
            r#""prefer (many):0,1""#,
        ),
        (MemPolicy::Bind(set(&[0, 1, 2])), r#""bind:0-2""#),
        (
            MemPolicy::Interleave(set(&[0, 1, 2, 3])),
            r#""interleave:0-3""#,
        ),
        (
            MemPolicy::WeightedInterleave(set(&[4])),
            r#""weighted interleave:4""#,
        ),
    ];
    for (policy, text) in policies {
        assert_eq!(json(&policy), text);
        assert_eq!(back::<MemPolicy>(text), policy);
    }
}

#[test]
fn topology_words_and_bad_strings_do_not_deserialize() {
    for bad in [
        r#""all""#,
        r#""!0""#,
        r#""+0""#,
        r#""1024""#,
        r#""0-""#,
        "3",
    ] {
        assert!(serde_json::from_str::<NodeSet>(bad).is_err(), "{bad}");
    }
    for bad in [
        r#""interleave:all""#,
        r#""bind:""#,
        r#""prefer:0-1""#,
        r#""local:0""#,
        r#""spread:0""#,
    ] {
        let err = serde_json::from_str::<MemPolicy>(bad).unwrap_err();
        assert!(err.is_data(), "{bad}: {err}");
    }
}

#[test]
fn small_enums_are_lowercase_names() {
    assert_eq!(json(&Kind::Weights), r#""weights""#);
    assert_eq!(json(&Kind::Scales), r#""scales""#);
    assert_eq!(json(&DegradeReason::Denied), r#""denied""#);
    assert_eq!(json(&DegradeReason::Unsupported), r#""unsupported""#);
    assert_eq!(json(&Placement::Bound), r#""bound""#);
    assert_eq!(
        json(&Placement::Degraded(DegradeReason::Denied)),
        r#"{"degraded":"denied"}"#
    );
    for p in [
        Placement::Bound,
        Placement::Degraded(DegradeReason::Denied),
        Placement::Degraded(DegradeReason::Unsupported),
    ] {
        assert_eq!(back::<Placement>(&json(&p)), p);
    }
    assert_eq!(back::<Kind>(r#""scales""#), Kind::Scales);
}

#[test]
fn stats_and_report_have_fixed_field_names() {
    let stats = StoreStats {
        layers: 2,
        experts_loaded: 3,
        bytes: 4,
        node_bytes: BTreeMap::from([(Node(1), 13)]),
        vmas: 5,
        mbind_calls: 6,
        pages_per_node: BTreeMap::from([(Node(0), 7), (Node(2), 8)]),
        pages_source: Some(numapin::PagesSource::NumaMaps),
        pages_merged: 0,
        sample_step: 1,
        resident_bytes: 9,
        anon_huge_bytes: 10,
        shared_bytes: 11,
        private_bytes: 12,
        placement: Some(Placement::Bound),
    };
    assert_eq!(
        json(&stats),
        r#"{"layers":2,"experts_loaded":3,"bytes":4,"node_bytes":{"1":13},"vmas":5,"mbind_calls":6,"pages_per_node":{"0":7,"2":8},"pages_source":"numa_maps","pages_merged":0,"sample_step":1,"resident_bytes":9,"anon_huge_bytes":10,"shared_bytes":11,"private_bytes":12,"placement":"bound"}"#
    );
    assert_eq!(back::<StoreStats>(&json(&stats)), stats);
    let report = LayerReport {
        layer: 1,
        experts: 2,
        weight_stride: 4096,
        scale_stride: 0,
        bytes: 3,
        regions: 1,
        mbind_calls: 1,
        reads: 0,
        bounced_bytes: 5,
        direct_reads: numapin::store::DirectReads {
            in_place_bytes: 6,
            uring_reads: 7,
            blocking_reads: 8,
            uring_depth: 9,
            blocking_depth: 2,
        },
        read_mode: ReadMode::Buffered,
        read_fallback: Some(ReadFallback::NoDirectIoAlignment),
        direct_io: Some(DirectIo::Threads(IoUringFallback::Denied)),
        files: vec![FileRead {
            path: "/m/a".into(),
            mode: ReadMode::Direct,
            residency: Some(Residency {
                cached_pages: 1,
                pages: 4,
                probe: ResidencyProbe::Cachestat,
            }),
            fallback: None,
        }],
        policy: Some(MemPolicy::Interleave(set(&[0, 1]))),
        replicas: 1,
        local_bytes: 0,
        off_node_loaders: 0,
        loader_nodes: vec![Node(0), Node(1)],
        placement: Some(Placement::Degraded(DegradeReason::Unsupported)),
    };
    assert_eq!(
        json(&report),
        r#"{"layer":1,"experts":2,"weight_stride":4096,"scale_stride":0,"bytes":3,"regions":1,"mbind_calls":1,"reads":0,"bounced_bytes":5,"direct_reads":{"in_place_bytes":6,"uring_reads":7,"blocking_reads":8,"uring_depth":9,"blocking_depth":2},"read_mode":"buffered","read_fallback":"no-direct-io-alignment","direct_io":{"threads":"denied"},"files":[{"path":"/m/a","mode":"direct","residency":{"cached_pages":1,"pages":4,"probe":"cachestat"},"fallback":null}],"policy":"interleave:0,1","replicas":1,"local_bytes":0,"off_node_loaders":0,"loader_nodes":[0,1],"placement":{"degraded":"unsupported"}}"#
    );
    assert_eq!(back::<LayerReport>(&json(&report)), report);
}

#[test]
fn a_packed_store_reports_round_trip() {
    let (experts, weight_bytes, scale_bytes) = (4, 8192, 100);
    let data: Vec<(Vec<u8>, Vec<u8>)> = (0..experts)
        .map(|e| (vec![e as u8; weight_bytes], vec![!(e as u8); scale_bytes]))
        .collect();
    let sources: Vec<ExpertSource<'_>> = data
        .iter()
        .map(|(w, s)| ExpertSource::Memory {
            weights: w,
            scales: s,
        })
        .collect();
    let store = PinStore::new(Layout::Interleave(nodes()), StoreOptions::default()).unwrap();
    let spec = LayerSpec {
        experts,
        weight_bytes,
        scale_bytes,
    };
    let report = store.pack_layer(0, &spec, &sources).unwrap();
    let stats = store.stats().unwrap();
    let placement = match degrade_here() {
        None => r#""bound""#.to_string(),
        Some(reason) => format!(r#"{{"degraded":{}}}"#, json(&reason)),
    };
    let report_json = json(&report);
    assert!(
        report_json.contains(&format!(r#""policy":"interleave:{}""#, nodes())),
        "{report_json}"
    );
    assert!(
        report_json.contains(&format!(r#""placement":{placement}"#)),
        "{report_json}"
    );
    assert_eq!(back::<LayerReport>(&report_json), report);
    let stats_json = json(&stats);
    let want_bytes = (experts * (weight_bytes + scale_bytes)).to_string();
    assert!(
        stats_json.contains(&format!(r#""bytes":{want_bytes},"#)),
        "{stats_json}"
    );
    assert_eq!(back::<StoreStats>(&stats_json), stats);
}

#[test]
fn manifests_round_trip() {
    let manifest = Manifest {
        regions: vec![
            ManifestRegion {
                layer: 0,
                kind: Kind::Weights,
                len: 8192,
                stride: 4096,
                slot_bytes: 4000,
                loaded: vec![Some(4000), None],
            },
            ManifestRegion {
                layer: 0,
                kind: Kind::Scales,
                len: 8192,
                stride: 4096,
                slot_bytes: 10,
                loaded: vec![Some(10), Some(3)],
            },
        ],
    };
    let text = json(&manifest);
    assert_eq!(
        text,
        r#"{"regions":[{"layer":0,"kind":"weights","len":8192,"stride":4096,"slot_bytes":4000,"loaded":[4000,null]},{"layer":0,"kind":"scales","len":8192,"stride":4096,"slot_bytes":10,"loaded":[10,3]}]}"#
    );
    assert_eq!(back::<Manifest>(&text), manifest);
}

fn policy() -> impl Strategy<Value = MemPolicy> {
    let ids = proptest::collection::btree_set(0usize..numapin::MAX_NODES, 1..20);
    (0usize..7, 0u16..1024, ids).prop_map(|(variant, id, ids)| {
        let s = NodeSet::from_nodes(ids).unwrap();
        match variant {
            0 => MemPolicy::Default,
            1 => MemPolicy::Local,
            2 => MemPolicy::Preferred(Node(id)),
            3 => MemPolicy::PreferredMany(s),
            4 => MemPolicy::Bind(s),
            5 => MemPolicy::Interleave(s),
            _ => MemPolicy::WeightedInterleave(s),
        }
    })
}

proptest! {
    #[test]
    fn every_policy_round_trips_through_json(p in policy()) {
        let text = json(&p);
        prop_assert_eq!(&text, &format!("{:?}", p.to_string()));
        prop_assert_eq!(back::<MemPolicy>(&text), p);
    }
}
