//! The planner end to end: sizes read from a real safetensors header (written here with
//! known sizes), the committed topology description of docs/planner.md (compiled in), routing
//! statistics from their JSON, and the live machine. The figures themselves are checked
//! on hand-computed cases in the unit tests (src/planner/tests.rs).
#![cfg(feature = "model")]

mod common;

use numapin::planner::{self, Candidate, Machine, ModelSizes, PlanOptions};
use numapin::routing::RoutingStats;

/// A safetensors file: MoE layers 1 and 2 with 4 experts of gate/up/down (3 × 1000
/// bytes each) plus one 500-byte scale per projection, and a 7000-byte embedding.
fn checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    common::moe_safetensors(dir, 7000, &[1, 2], 4, (1000, 500))
}

#[test]
fn sizes_from_a_header_and_a_plan_for_the_described_machine() {
    let dir = std::env::temp_dir().join(format!("numapin-planner-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = checkpoint(&dir);
    let sizes =
        ModelSizes::from_checkpoint(&numapin::model::Checkpoint::open(&path).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(sizes.other_bytes, 7000);
    assert_eq!(sizes.shape(), vec![(1, 4), (2, 4)]);
    assert_eq!(sizes.moe_layers[0].weight_bytes, 3000);
    assert_eq!(sizes.moe_layers[0].scale_bytes, 1500);
    // A page per kind per expert in the store.
    assert_eq!(sizes.expert_bytes(), 2 * 4 * 2 * 4096);

    // Compiled in: the VM and the containers run the binary without the source tree.
    let machine = Machine::from_json(include_str!("../docs/planner/nps4_2socket.json")).unwrap();
    assert_eq!(machine.nodes.len(), 8);
    assert_eq!(machine.domains(), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(machine.distances[0][1], 12);
    assert_eq!(machine.distances[0][4], 32);

    let stats = RoutingStats::from_json(
        r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":[90,5,3,2]}]}"#,
    )
    .unwrap();
    let table = planner::plan(&sizes, &machine, Some(&stats), &PlanOptions::default()).unwrap();
    // 180 GiB per node holds this tiny model everywhere: a copy per node reads nothing
    // remotely and wins.
    assert_eq!(table.recommended(), Some(Candidate::ReplicatePerNode));
    assert_eq!(table.rows.len(), Candidate::ALL.len());
    assert!(table.statistics);
    let json = table.to_json();
    assert_eq!(json["recommended"], "replicate-node");
    assert_eq!(json["rows"][0]["layout"], "interleave");
    // Statistics for a layer the checkpoint lacks: refused, naming the layer.
    let wrong = RoutingStats::from_counts([(7, vec![1, 2, 3, 4])]).unwrap();
    let e = planner::plan(&sizes, &machine, Some(&wrong), &PlanOptions::default()).unwrap_err();
    assert!(e.to_string().contains("no MoE layer 7"), "{e}");
}

/// The live machine: in every environment (host, containers, the VM) the planner reads
/// it without loading anything, and each node is its own domain until the topology
/// reads sockets.
#[test]
fn live_machine() {
    let machine = Machine::live().unwrap();
    assert!(!machine.nodes.is_empty());
    assert_eq!(machine.domains().len(), machine.nodes.len());
    assert_eq!(machine.distances.len(), machine.nodes.len());
    let sizes = ModelSizes {
        moe_layers: vec![planner::MoeLayerSizes {
            layer: 0,
            experts: 8,
            weight_bytes: 4096,
            scale_bytes: 0,
        }],
        other_bytes: 4096,
    };
    let table = planner::plan(&sizes, &machine, None, &PlanOptions::default()).unwrap();
    // 9 pages fit anywhere: something is recommended, and with one node every layout
    // reads locally.
    assert!(table.recommended().is_some(), "{table}");
    if machine.nodes.len() == 1 {
        assert!(table.rows.iter().all(|r| r.remote_fraction == 0.0));
    }
}
