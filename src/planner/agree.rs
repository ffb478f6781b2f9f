//! The store, the dry run and the planner take their figures from one call: every answer
//! [`Placer::arrange`](crate::store::Placer::arrange) gives is recorded (on this thread, in
//! tests only), and for every layout the three callers' recorded answers for the routed
//! experts' layers are the same objects — blocks, bytes per node, mappings, `mbind`
//! calls — not figures each derived on its own and compared. On the suite's fixtures
//! (the store places them on this machine's first node) and on DeepSeek-V3's expert
//! layers priced for four nodes.

use std::io::Write;

use crate::model::{Checkpoint, DenseLayout, PlacementPlan};
use crate::node::NodeSet;
use crate::planner::{self, Candidate, Machine, MachineNode, ModelSizes, PlanOptions};
use crate::store::{ARRANGED, LayerPlacement, Layout, StoreOptions};

/// The answers recorded since the last call, the routed experts' only (a dense group is
/// one slot, an expert layer more).
fn take() -> Vec<LayerPlacement> {
    let all = ARRANGED.with(|a| std::mem::take(&mut *a.borrow_mut()));
    all.into_iter()
        .filter(|p| p.blocks.iter().any(|b| b.slots.end > 1))
        .collect()
}

/// Every layout over `set`.
fn layouts(set: NodeSet) -> [Layout; 6] {
    [
        Layout::Interleave(set),
        Layout::LayerPerNode(set),
        Layout::Replicate(set),
        Layout::ReplicateDomains(set),
        Layout::SplitExperts(set),
        Layout::Unplaced,
    ]
}

/// The planner's row for `layout` (none for [`Layout::Unplaced`]).
fn candidate(layout: Layout) -> Option<Candidate> {
    Some(match layout {
        Layout::Interleave(_) => Candidate::Interleave,
        Layout::LayerPerNode(_) => Candidate::LayerPerNode,
        Layout::Replicate(_) => Candidate::ReplicatePerNode,
        Layout::ReplicateDomains(_) => Candidate::ReplicatePerDomain,
        Layout::SplitExperts(_) => Candidate::SplitByIndex,
        Layout::Unplaced => return None,
    })
}

/// A described machine of `set`'s nodes, grouped in domains as this machine groups
/// them (the dry run reads the live domains), with room for anything.
fn machine(set: NodeSet) -> Machine {
    let groups = crate::topology::Topology::get()
        .unwrap()
        .domains_within(&set);
    let nodes: Vec<MachineNode> = set
        .iter()
        .map(|node| MachineNode {
            node,
            domain: groups.iter().position(|g| g.contains(node)).unwrap(),
            free_bytes: u64::MAX / 4,
            cpus: true,
        })
        .collect();
    let n = nodes.len();
    Machine {
        nodes,
        distances: (0..n)
            .map(|i| (0..n).map(|j| if i == j { 10 } else { 20 }).collect())
            .collect(),
        map_limit: usize::MAX / 4,
    }
}

/// The planner's answers for `layout`'s row: the candidates ask one answer per MoE layer
/// each, in [`Candidate::ALL`] order.
fn planner_answers(checkpoint: &Checkpoint, set: NodeSet, layout: Layout) -> Vec<LayerPlacement> {
    let sizes = ModelSizes::from_checkpoint(checkpoint).unwrap();
    let layers = sizes.moe_layers.len();
    take();
    planner::plan(&sizes, &machine(set), None, &PlanOptions::default()).unwrap();
    let all = ARRANGED.with(|a| std::mem::take(&mut *a.borrow_mut()));
    assert_eq!(
        all.len(),
        layers * Candidate::ALL.len(),
        "one answer per layer per row"
    );
    let Some(c) = candidate(layout) else {
        return Vec::new();
    };
    let at = Candidate::ALL.iter().position(|&x| x == c).unwrap();
    all[at * layers..(at + 1) * layers].to_vec()
}

/// The dry run's answers for the routed experts under `layout`.
fn dry_run_answers(checkpoint: &Checkpoint, plan: &PlacementPlan) -> Vec<LayerPlacement> {
    take();
    checkpoint
        .placement_cost(plan, &StoreOptions::default())
        .unwrap();
    take()
}

/// Asserts the three callers' answers are the same for every layout over `set`; `place`:
/// also place the checkpoint (the store's answers).
fn agree(name: &str, checkpoint: &Checkpoint, set: NodeSet, place: bool) {
    for layout in layouts(set) {
        let plan = PlacementPlan::new(layout, DenseLayout::Replicate(set));
        let dry = dry_run_answers(checkpoint, &plan);
        assert!(!dry.is_empty(), "{name} {layout}: no expert layer priced");
        if candidate(layout).is_some() {
            let rows = planner_answers(checkpoint, set, layout);
            assert_eq!(rows, dry, "{name} {layout}: the planner's row");
        }
        if place {
            take();
            let options = StoreOptions::default().loader_threads(2);
            let model = checkpoint.place(&plan, options).unwrap();
            // `place` prices the plan first (the dry run's answers), then each store
            // asks again as it packs.
            let answers = take();
            assert_eq!(answers.len(), 2 * dry.len(), "{name} {layout}");
            let (priced, packed) = answers.split_at(dry.len());
            assert_eq!(priced, dry, "{name} {layout}: place's own pricing");
            assert_eq!(packed, dry, "{name} {layout}: the store's packing");
            drop(model);
        }
    }
}

#[test]
fn the_store_the_dry_run_and_the_planner_answer_from_one_call() {
    let Some(dir) = std::env::var_os("NUMAPIN_FIXTURES") else {
        let _ = writeln!(
            std::io::stderr(),
            "NOT RUN (fixtures): set NUMAPIN_FIXTURES (`cargo xtask fixtures`)"
        );
        return deepseek_v3();
    };
    let dir = std::path::PathBuf::from(dir);
    let first: NodeSet = std::iter::once(crate::node::Node(0)).collect();
    for name in [
        "st-sharded",
        "gguf-single",
        "gguf-split",
        "fam-deepseek-v3-fp8",
    ] {
        let root = dir.join(name);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(root.join("fixture.json")).unwrap()).unwrap();
        let checkpoint = Checkpoint::open(root.join(json["path"].as_str().unwrap())).unwrap();
        agree(name, &checkpoint, first, true);
    }
    deepseek_v3();
}

/// DeepSeek-V3's expert layers (256 FP8 experts with their scale grids, three MoE
/// layers of the real shapes) as a header over a hole, priced for four nodes.
fn deepseek_v3() {
    let dir = std::env::temp_dir().join(format!("numapin-agree-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    let mut tensors: Vec<(String, &str, [u64; 2], u64)> = Vec::new();
    tensors.push((
        "model.embed_tokens.weight".into(),
        "BF16",
        [129280, 7168],
        129280 * 7168 * 2,
    ));
    for l in 3..6 {
        for e in 0..256 {
            for (proj, rows, cols) in [
                ("gate_proj", 2048, 7168),
                ("up_proj", 2048, 7168),
                ("down_proj", 7168, 2048),
            ] {
                let p = format!("model.layers.{l}.mlp.experts.{e}.{proj}");
                tensors.push((format!("{p}.weight"), "F8_E4M3", [rows, cols], rows * cols));
                let grid = [rows.div_ceil(128), cols.div_ceil(128)];
                let scale = (
                    format!("{p}.weight_scale_inv"),
                    "F32",
                    grid,
                    grid[0] * grid[1] * 4,
                );
                tensors.push(scale);
            }
        }
    }
    let mut at = 0u64;
    let entries: Vec<String> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let s = format!(
                r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
                at + bytes
            );
            at += bytes;
            s
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(&(header.len() as u64).to_le_bytes())
        .unwrap();
    file.write_all(header.as_bytes()).unwrap();
    file.set_len(8 + header.len() as u64 + at).unwrap();
    drop(file);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let four = NodeSet::from_nodes(0..4).unwrap();
    agree("DeepSeek-V3", &checkpoint, four, false);
    std::fs::remove_dir_all(&dir).unwrap();
}
