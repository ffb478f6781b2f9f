//! Hostile pass 7: the planner, the whole-model plan text, routing and assignments, and
//! shares, fed what a hostile user would feed them. Each test says whether it found a
//! bug (and the fix) or is an attack that held, kept as a regression test.
//! Here the planner's descriptions and flags; `checkpoint` the whole-model plan on an odd
//! checkpoint, `routing` routing statistics, assignments and shares.
#![cfg(feature = "model")]

mod checkpoint;
mod routing;
#[path = "../../examples/support/mod.rs"]
mod support;

use numapin::planner::{self, Machine, MachineNode, ModelSizes, MoeLayerSizes, PlanOptions};
use numapin::routing::RoutingStats;
use numapin::store::Layout;
use numapin::{Error, Node};

/// A DeepSeek-V3-shaped model: 58 MoE layers (3..61) of 256 experts of ~44 MB.
fn deepseek_sizes() -> ModelSizes {
    ModelSizes {
        moe_layers: (3..61)
            .map(|layer| MoeLayerSizes {
                layer,
                experts: 256,
                weight_bytes: 3 * 7168 * 2048,
                scale_bytes: 3 * 56 * 16 * 4,
            })
            .collect(),
        other_bytes: 17 << 30,
    }
}

/// A described machine of `n` nodes, 1 TiB free each, one domain per 4 nodes.
fn machine_json(n: usize) -> String {
    let nodes: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#"{{"id":{i},"domain":{},"free_bytes":1099511627776}}"#,
                i / 4
            )
        })
        .collect();
    format!(r#"{{"numapin_topology":1,"nodes":[{}]}}"#, nodes.join(","))
}

/// Bug (fixed): the figures summed every reader over every node for every expert, so
/// a described 256-node machine took 114 s per table in a debug build (1024 nodes, the
/// most a description may name: about half an hour). Now each place's cost is computed
/// once per machine. The figures are checked against hand-computed values for the
/// default distances (10 local, 20 remote), 1024 readers and domains of 4 nodes.
#[test]
fn a_1024_node_description_is_planned_with_hand_computed_figures() {
    let n = 1024usize;
    let machine = Machine::from_json(&machine_json(n)).unwrap();
    assert_eq!(machine.domains().len(), n / 4);
    let table = planner::plan(&deepseek_sizes(), &machine, None, &PlanOptions::default()).unwrap();
    let nf = n as f64;
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    let row = |c: planner::Candidate| table.rows.iter().find(|r| r.candidate == c).unwrap();
    let i = row(planner::Candidate::Interleave);
    assert!(
        close(i.remote_fraction, (nf - 1.0) / nf),
        "{}",
        i.remote_fraction
    );
    assert!(close(i.cross_domain_fraction, (nf - 4.0) / nf));
    assert!(close(i.mean_distance, (10.0 + 20.0 * (nf - 1.0)) / nf));
    let r = row(planner::Candidate::ReplicatePerNode);
    assert!(close(r.remote_fraction, 0.0) && close(r.mean_distance, 10.0));
    let d = row(planner::Candidate::ReplicatePerDomain);
    assert!(close(d.remote_fraction, 0.75) && close(d.cross_domain_fraction, 0.0));
    assert!(close(d.mean_distance, (10.0 + 3.0 * 20.0) / 4.0));
    // Split by index: each expert on one node, read from there by every node.
    let s = row(planner::Candidate::SplitByIndex);
    assert!(close(s.remote_fraction, (nf - 1.0) / nf));
    assert!(close(s.cross_domain_fraction, (nf - 4.0) / nf));
    // 256 experts over 1024 nodes: a quarter of the nodes run every layer's experts.
    assert!(close(s.imbalance, 4.0), "{}", s.imbalance);
}

fn node(id: u16, domain: usize) -> MachineNode {
    MachineNode {
        node: Node(id),
        domain,
        free_bytes: 1 << 40,
        cpus: true,
    }
}

fn reason(e: Error) -> String {
    match e {
        Error::InvalidArgument { .. } => e.to_string(),
        other => panic!("not an invalid argument: {other:?}"),
    }
}

/// Bug (fixed): `Machine`'s fields are public, and `plan` trusted them: no nodes divided
/// by zero, a distance matrix shorter than the nodes indexed past it, a domain number of
/// `usize::MAX` overflowed in `domains()`. Each is now the error `from_json` gives.
#[test]
fn a_machine_built_by_hand_is_checked_like_a_description() {
    let plan = |machine: &Machine| {
        planner::plan(&deepseek_sizes(), machine, None, &PlanOptions::default())
    };
    let mut machine = Machine {
        nodes: vec![],
        distances: vec![],
        map_limit: 65530,
    };
    assert!(reason(plan(&machine).unwrap_err()).contains("nodes"));
    machine.nodes = vec![node(0, 0), node(1, 7)];
    machine.distances = vec![vec![10]];
    assert!(reason(plan(&machine).unwrap_err()).contains("rows of distances"));
    machine.distances = vec![vec![10, 20], vec![20]];
    assert!(reason(plan(&machine).unwrap_err()).contains("columns of distances[1]"));
    machine.distances = vec![vec![10, 0], vec![20, 10]];
    assert!(reason(plan(&machine).unwrap_err()).contains("distances[0][1] = 0"));
    machine.distances = vec![vec![10, 20], vec![20, 10]];
    machine.nodes = vec![node(1, 0), node(0, 1)];
    assert!(reason(plan(&machine).unwrap_err()).contains("increasing id"));
    machine.nodes = vec![node(0, usize::MAX), node(1, usize::MAX)];
    assert_eq!(machine.domains(), vec![vec![0, 1]]);
    let table = plan(&machine).unwrap();
    assert_eq!(table.rows.len(), planner::Candidate::ALL.len());
    machine.nodes = vec![node(0, 5), node(1, 2)];
    assert_eq!(
        machine.domains(),
        vec![vec![1], vec![0]],
        "by domain number"
    );
}

fn layer(layer: usize, experts: usize) -> MoeLayerSizes {
    MoeLayerSizes {
        layer,
        experts,
        weight_bytes: 4096,
        scale_bytes: 0,
    }
}

/// Bug (fixed): a hand-built `ModelSizes` naming a layer twice (with another expert
/// count) gave the second the first's statistics and indexed past them (a panic in the
/// hybrid row); a layer of `usize::MAX` experts would allocate a place per expert. Both
/// are refused, naming the layer.
#[test]
fn model_sizes_built_by_hand_are_checked() {
    let machine = Machine::from_json(&machine_json(2)).unwrap();
    let stats = RoutingStats::from_counts([(1, vec![5u64, 1])]).unwrap();
    let plan =
        |sizes: &ModelSizes| planner::plan(sizes, &machine, Some(&stats), &PlanOptions::default());
    let twice = ModelSizes {
        moe_layers: vec![layer(1, 2), layer(1, 4)],
        other_bytes: 0,
    };
    assert!(reason(plan(&twice).unwrap_err()).contains("strictly increasing"));
    let backwards = ModelSizes {
        moe_layers: vec![layer(2, 2), layer(1, 2)],
        other_bytes: 0,
    };
    assert!(reason(plan(&backwards).unwrap_err()).contains("(2 then 1)"));
    let huge = ModelSizes {
        moe_layers: vec![layer(1, 2), layer(2, usize::MAX)],
        other_bytes: 0,
    };
    assert!(reason(plan(&huge).unwrap_err()).contains("layer 2"));
    let fine = ModelSizes {
        moe_layers: vec![layer(1, 2), layer(2, 4)],
        other_bytes: 0,
    };
    assert!(plan(&fine).is_ok());
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("numapin-hostile7-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Held: `balance` at the edges. Counts of `u64::MAX` sum in `u128` (no wrap), caps of
/// 0 leave a node empty, caps of `usize::MAX` do not overflow the room, no nodes or too
/// few places are errors, equal counts give the same answer twice.
#[test]
fn balance_at_the_edges() {
    use numapin::routing::{balance, node_loads};
    let huge = [u64::MAX; 8];
    let a = balance(&huge, &[4, 4]).unwrap();
    assert_eq!(a, balance(&huge, &[4, 4]).unwrap(), "deterministic");
    let loads = node_loads(&huge, &a, 2);
    assert_eq!(loads, vec![4 * u128::from(u64::MAX); 2]);
    assert_eq!(balance(&[3, 2, 1], &[0, 3]).unwrap(), vec![1, 1, 1]);
    assert_eq!(
        balance(&[3, 2, 1], &[usize::MAX, usize::MAX])
            .unwrap()
            .len(),
        3
    );
    assert!(balance(&[1], &[0, 0]).is_err());
    assert!(balance(&[], &[]).is_err());
    assert_eq!(balance(&[], &[0]).unwrap(), Vec::<usize>::new());
    // 256 equal experts over 1024 nodes: one each on the first 256 nodes.
    let a = balance(&[7u64; 256], &[1; 1024]).unwrap();
    assert_eq!(a, (0..256).collect::<Vec<_>>());
}

/// Bug (fixed): a node string's parse error echoed the whole input and the whole bad
/// part (`"split:all"` repeated 1000 times gave an 18 KB message; a megabyte, a
/// megabyte): clipped now as the share and slice parsers clip theirs.
#[test]
fn a_huge_node_string_is_refused_with_a_short_message() {
    let huge = "all".repeat(1 << 18) + "x";
    let e = numapin::NodeSet::parse(&huge).unwrap_err();
    assert!(matches!(e, Error::Parse { .. }), "{e:?}");
    assert!(e.to_string().len() < 1000, "{} bytes", e.to_string().len());
    let e = "split:all".repeat(1000).parse::<Layout>().unwrap_err();
    assert!(e.to_string().len() < 1000, "{} bytes", e.to_string().len());
}

/// Bug (fixed): `pin_model --budget` trimmed any trailing `iB` and `B`s before the
/// unit, so `5iB` and `5BB` were 5 bytes and `+5` parsed; now digits and one unit.
#[test]
fn budget_flags_are_digits_and_one_unit() {
    let parse = |b: &str| {
        support::args::PinModelArgs::try_parse_checked([
            "pin_model",
            "--model",
            "/m",
            "--plan-only",
            "--budget",
            b,
        ])
        .map(|a| a.budget)
    };
    for (good, bytes) in [
        ("0", 0u64),
        ("1", 1),
        ("4096B", 4096),
        ("2k", 2048),
        ("3KiB", 3072),
        ("192G", 192 << 30),
        ("192GiB", 192 << 30),
        ("1TB", 1 << 40),
        (" 7M ", 7 << 20),
        ("18446744073709551615", u64::MAX),
    ] {
        assert_eq!(parse(good).unwrap(), Some(bytes), "{good}");
    }
    for bad in [
        "5iB",
        "5BB",
        "+5",
        "1.5G",
        "-1",
        "",
        "G",
        "16E",
        "18446744073709551616",
        "16777216T",
        "5 G",
        "٣",
    ] {
        assert!(parse(bad).is_err(), "{bad}");
    }
}

/// Bug (fixed): a 100 MB routing file took 2.5 GB of memory to be refused (the JSON
/// tree of 50M counts; the 4-node VM has 768 MiB per node), and `/dev/zero` as a file
/// read without end. Both description formats are refused past 16 MiB of text, before
/// more is read; a large but real-sized file (100k counts) still reads.
#[test]
fn descriptions_past_16_mib_are_refused_before_they_are_parsed() {
    let dir = temp("bigjson");
    let path = dir.join("routing.json");
    let mut text = String::from(r#"{"numapin_routing":1,"layers":[{"layer":1,"counts":["#);
    text.push_str(&"1,".repeat(9 << 20));
    text.push_str("1]}]}");
    std::fs::write(&path, &text).unwrap();
    let e = RoutingStats::from_file(&path).unwrap_err().to_string();
    assert!(e.contains("16 MiB"), "{e}");
    let e = RoutingStats::from_json(&text).unwrap_err().to_string();
    assert!(e.contains("16 MiB"), "{e}");
    for zero in [
        RoutingStats::from_file("/dev/zero").map(drop),
        Machine::from_file("/dev/zero").map(drop),
    ] {
        assert!(zero.unwrap_err().to_string().contains("16 MiB"));
    }
    let mut topology = machine_json(1);
    topology.push_str(&" ".repeat(17 << 20));
    assert!(
        Machine::from_json(&topology)
            .unwrap_err()
            .to_string()
            .contains("16 MiB")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Held: equal counts (and counts of `u64::MAX`) give the same table twice, with the
/// same assignments, on the committed 2-socket NPS4 description under a budget that
/// makes the hybrid choose; the budget at one copy of the non-expert bytes is allowed,
/// one byte less is refused.
#[test]
fn equal_counts_plan_the_same_twice() {
    let machine = Machine::from_json(include_str!("../../docs/planner/nps4_2socket.json")).unwrap();
    let sizes = ModelSizes {
        moe_layers: (1..5).map(|l| layer(l, 16)).collect(),
        other_bytes: 1 << 20,
    };
    for count in [7u64, u64::MAX] {
        let stats = RoutingStats::from_counts((1..5).map(|l| (l, vec![count; 16]))).unwrap();
        let options = PlanOptions::default().budget((1 << 20) + 6 * 4096);
        let a = planner::plan(&sizes, &machine, Some(&stats), &options).unwrap();
        let b = planner::plan(&sizes, &machine, Some(&stats), &options).unwrap();
        assert_eq!(a.rows, b.rows);
        assert_eq!(a.recommended(), b.recommended());
        assert_eq!(a.to_json(), b.to_json());
    }
    let at = PlanOptions::default().budget(1 << 20);
    assert!(planner::plan(&sizes, &machine, None, &at).is_ok());
    let under = PlanOptions::default().budget((1 << 20) - 1);
    assert!(planner::plan(&sizes, &machine, None, &under).is_err());
}
