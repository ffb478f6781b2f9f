//! The store, the dry run and the planner take their figures from one call: every answer
//! [`Placer::arrange`](crate::store::Placer::arrange) gives is recorded (on this thread, in
//! tests only), and for every layout the three callers' recorded answers for the routed
//! experts' layers are the same objects — blocks, bytes per node, mappings, `mbind`
//! calls — not figures each derived on its own and compared. On the suite's fixtures
//! (the store places them on this machine's first node) and on DeepSeek-V3's expert
//! layers priced for four nodes; for the plain layouts and for the planner's own
//! assignments (split by load, hybrid, hybrid per domain: the rows' `assignment()`
//! given to the dry run and the store). Where the store places, the answers' `mbind`
//! calls are the calls the store counted making, and its mappings bound the mappings
//! counted in `/proc/self/smaps` (equal where the kernel names mappings: no region
//! merges with another).

use std::io::Write;

use crate::model::{Checkpoint, DenseLayout, PlacementPlan};
use crate::node::NodeSet;
use crate::planner::{self, Candidate, Machine, MachineNode, ModelSizes, PlanOptions};
use crate::routing::RoutingStats;
use crate::store::ReadMode;
use crate::store::{ARRANGED, ExpertAssignment, LayerPlacement, Layout, StoreOptions};

/// The answers recorded since the last call, the routed experts' only (a dense group is
/// one slot, an expert layer more).
fn take() -> Vec<LayerPlacement> {
    let all = ARRANGED.with(|a| std::mem::take(&mut *a.borrow_mut()));
    all.into_iter()
        .filter(|p| p.blocks.iter().any(|b| b.slots.end > 1))
        .collect()
}

/// Every layout over `set`, with the planner's row for it (none for
/// [`Layout::Unplaced`]).
fn layouts(set: NodeSet) -> [(Layout, Option<Candidate>); 6] {
    [
        (Layout::Interleave(set), Some(Candidate::Interleave)),
        (Layout::LayerPerNode(set), Some(Candidate::LayerPerNode)),
        (Layout::Replicate(set), Some(Candidate::ReplicatePerNode)),
        (
            Layout::ReplicateDomains(set),
            Some(Candidate::ReplicatePerDomain),
        ),
        (Layout::SplitExperts(set), Some(Candidate::SplitByIndex)),
        (Layout::Unplaced, None),
    ]
}

/// What is placed: a layout alone (with its planner row), or a planner row's
/// assignment of the experts.
#[derive(Clone)]
enum Case {
    Plain(Layout, Option<Candidate>),
    Assigned(Candidate, ExpertAssignment),
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

/// Skewed routing counts for every MoE layer (expert `e` of layer `l` routed
/// `10^6 / ((e · 7 + l) mod E + 1)` times: each layer's hot experts elsewhere), and a
/// per-node budget that leaves room for some hot copies but not all: the non-expert
/// bytes, an even split of the experts and `extra` slots more.
fn skewed(sizes: &ModelSizes, nodes: usize, extra: u64) -> (RoutingStats, PlanOptions) {
    let stats = RoutingStats::from_counts(sizes.moe_layers.iter().map(|l| {
        let counts: Vec<u64> = (0..l.experts)
            .map(|e| 1_000_000 / ((e * 7 + l.layer) % l.experts + 1) as u64)
            .collect();
        (l.layer, counts)
    }))
    .unwrap();
    let even: u64 = (sizes.moe_layers.iter())
        .map(|l| l.slot_bytes() * l.experts.div_ceil(nodes) as u64)
        .sum();
    let slot = sizes
        .moe_layers
        .iter()
        .map(|l| l.slot_bytes())
        .max()
        .unwrap();
    let budget = sizes.other_bytes + even + extra * slot;
    (stats, PlanOptions::default().budget(budget))
}

/// The planner's answers for every row: the candidates ask one answer per MoE layer
/// each, in [`Candidate::ALL`] order; with each row's assignment.
fn planner_rows(
    checkpoint: &Checkpoint,
    set: NodeSet,
    stats: &(RoutingStats, PlanOptions),
) -> Vec<(Candidate, Option<ExpertAssignment>, Vec<LayerPlacement>)> {
    let sizes = ModelSizes::from_checkpoint(checkpoint).unwrap();
    let layers = sizes.moe_layers.len();
    take();
    let table = planner::plan(&sizes, &machine(set), Some(&stats.0), &stats.1).unwrap();
    let all = ARRANGED.with(|a| std::mem::take(&mut *a.borrow_mut()));
    assert_eq!(
        all.len(),
        layers * Candidate::ALL.len(),
        "one answer per layer per row"
    );
    (Candidate::ALL.iter().enumerate())
        .map(|(at, &c)| {
            let row = table.rows.iter().find(|r| r.candidate == c).unwrap();
            let answers = all[at * layers..(at + 1) * layers].to_vec();
            (c, row.assignment().cloned(), answers)
        })
        .collect()
}

/// The dry run's answers for the routed experts under `plan` and `options`.
fn dry_run_answers(
    checkpoint: &Checkpoint,
    plan: &PlacementPlan,
    options: &StoreOptions,
) -> Vec<LayerPlacement> {
    take();
    checkpoint.placement_cost(plan, options).unwrap();
    take()
}

/// Places `plan` (the store's answers: `place` prices the plan first, as the dry run
/// does, then each store asks again as it packs) and holds the answers against `dry`
/// and against the `mbind` calls and mappings the experts' store counted.
fn place_and_count(
    name: &str,
    checkpoint: &Checkpoint,
    plan: &PlacementPlan,
    options: StoreOptions,
    dry: &[LayerPlacement],
) {
    take();
    let model = checkpoint.place(plan, options.loader_threads(2)).unwrap();
    let answers = take();
    assert_eq!(answers.len(), 2 * dry.len(), "{name}");
    let (priced, packed) = answers.split_at(dry.len());
    assert_eq!(priced, dry, "{name}: place's own pricing");
    assert_eq!(packed, dry, "{name}: the store's packing");
    let stats = model.experts.as_ref().unwrap().stats().unwrap();
    let mbinds: usize = dry.iter().map(|p| p.mbind_calls).sum();
    let mappings: usize = dry.iter().map(|p| p.mappings).sum();
    assert_eq!(stats.mbind_calls, mbinds, "{name}: mbind calls made");
    assert!(
        (1..=mappings).contains(&stats.vmas),
        "{name}: {} mappings counted for {mappings}",
        stats.vmas
    );
    if crate::calls::anon_vma_names_supported() {
        assert_eq!(stats.vmas, mappings, "{name}: mappings counted");
    }
}

/// Asserts the three callers' answers are the same for every layout over `set` and
/// for the planner's assignments (routing counts and budget from [`skewed`] with
/// `extra` slots of room); `place`: also place the checkpoint (the store's answers and
/// counts).
fn agree(name: &str, checkpoint: &Checkpoint, set: NodeSet, extra: u64, place: bool) {
    let sizes = ModelSizes::from_checkpoint(checkpoint).unwrap();
    let stats = skewed(&sizes, set.len(), extra);
    let rows = planner_rows(checkpoint, set, &stats);
    if extra > 0 {
        // The hybrids' answers hold hot copies (a placer's hot groups), not a split alone.
        for c in [Candidate::Hybrid, Candidate::HybridPerDomain] {
            let (_, a, _) = rows.iter().find(|(x, _, _)| *x == c).unwrap();
            let a = a.as_ref().unwrap();
            let hot = (sizes.moe_layers.iter())
                .flat_map(|l| (0..l.experts).map(|e| a.home(l.layer, e)))
                .filter(|h| *h == Some(crate::store::Home::Hot))
                .count();
            assert!(
                hot > 0 && hot < sizes.moe_layers.len() * 256,
                "{name} {c:?}: {hot} hot"
            );
        }
    }
    let mut cases: Vec<Case> = (layouts(set).into_iter())
        .map(|(l, c)| Case::Plain(l, c))
        .collect();
    for (c, assignment, _) in &rows {
        if let Some(a) = assignment {
            cases.push(Case::Assigned(*c, a.clone()));
        }
    }
    let assigned = cases.len() - layouts(set).len();
    assert_eq!(assigned, 3, "{name}: split by load and the two hybrids");
    for case in cases {
        // Buffered reads: the planner prices the layout of buffered reads. Direct reads
        // (and Auto on a file mostly not in the page cache, as this test's header over a
        // hole is) lay each expert piece out congruent to its file offset, up to one
        // alignment unit more per piece: the dry run and the store answer for that
        // layout below, the planner does not know the read mode.
        let buffered = StoreOptions::default().read_mode(ReadMode::Buffered);
        let (layout, options, row, what) = match case {
            Case::Plain(layout, row) => (layout, buffered, row, layout.to_string()),
            Case::Assigned(c, a) => (
                Layout::SplitExperts(set),
                buffered.assignment(Some(a)),
                Some(c),
                c.name().to_string(),
            ),
        };
        let what = format!("{name} {what}");
        let plan = PlacementPlan::new(layout, DenseLayout::Replicate(set));
        let dry = dry_run_answers(checkpoint, &plan, &options);
        assert!(!dry.is_empty(), "{what}: no expert layer priced");
        if let Some(c) = row {
            let (_, _, answers) = rows.iter().find(|(x, _, _)| *x == c).unwrap();
            assert_eq!(answers, &dry, "{what}: the planner's row");
        }
        if place {
            let direct = options.clone().read_mode(ReadMode::Direct);
            place_and_count(&what, checkpoint, &plan, options, &dry);
            let dry = dry_run_answers(checkpoint, &plan, &direct);
            place_and_count(&format!("{what} (direct)"), checkpoint, &plan, direct, &dry);
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
        agree(name, &checkpoint, first, 0, true);
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
    agree("DeepSeek-V3", &checkpoint, four, 20, false);
    std::fs::remove_dir_all(&dir).unwrap();
}
