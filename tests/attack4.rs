//! Hostile inputs for round 4's surface: the share and slice parsers, the placement plan's
//! text form and globs, `Layout`'s string form, routing statistics and the planner's
//! machine description as JSON, `routing::balance` at the edges. Each probe asserts a
//! named error (or the exact right answer), never a panic.

use numapin::model::{DenseLayout, ExpertShare, PlacementPlan, SliceAxis, TensorSlice};
use numapin::planner::Machine;
use numapin::routing::{RoutingStats, balance, node_loads};
use numapin::store::Layout;
use numapin::{Error, NodeContext, NodeSet};

/// Every error a parser may give for bad text: typed, with the input named.
fn named(e: &Error) -> bool {
    matches!(e, Error::Parse { .. } | Error::InvalidArgument { .. })
}

#[test]
fn expert_share_parse_refuses_hostile_text() {
    let bad = [
        "",
        " ",
        ",",
        "0,,1",
        "-",
        "-5",
        "5-",
        "9-3",
        "1/0",
        "0/0",
        "5/3",
        "1/",
        "/4",
        "1/2/3",
        "0-3,2",
        "0-3,3-5",
        "18446744073709551615",
        "0-18446744073709551615",
        "18446744073709551616",
        "٣",
        "０",
        "0x10",
        "1e3",
        "ALL",
        "all,1",
        "0\u{0}",
    ];
    for text in bad {
        let e = ExpertShare::parse(text).unwrap_err();
        assert!(named(&e), "{text:?}: {e:?}");
    }
    // Whitespace around the pieces is allowed; the result holds exactly what was asked.
    let s = ExpertShare::parse(" 0 - 2 , 7 ").unwrap();
    assert_eq!(s.resolve(0, 8).unwrap(), vec![0, 1, 2, 7]);
    let e = s.resolve(3, 7).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e:?}");
    assert!(e.to_string().contains("layer 3"), "{e}");
    // k/n with more parts than experts: some rank holds nothing, named.
    let e = ExpertShare::parse("1/4")
        .unwrap()
        .resolve(1, 2)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    // The largest id, alone.
    let e = ExpertShare::parse("18446744073709551614")
        .unwrap()
        .resolve(0, 4)
        .unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e:?}");
    // The parts of n cover every expert exactly once, even for n near usize::MAX.
    for (n, experts) in [(1, 0), (3, 10), (7, 3), (usize::MAX, 5)] {
        let mut all = Vec::new();
        for k in [0, 1, 2, n / 2, n - 1] {
            if k >= n {
                continue;
            }
            if let Ok(ids) = ExpertShare::part(k, n).unwrap().resolve(0, experts) {
                all.extend(ids);
            }
        }
        assert!(
            all.iter().all(|&e| e < experts.max(1)),
            "{n} {experts}: {all:?}"
        );
    }
}

#[test]
fn expert_share_constructors_at_the_edges() {
    assert!(ExpertShare::ranges(Vec::<std::ops::Range<usize>>::new()).is_err());
    assert!(ExpertShare::range(5..5).is_err());
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 9..3;
    assert!(ExpertShare::range(reversed).is_err());
    assert!(ExpertShare::list([]).is_err());
    assert!(ExpertShare::list([3, 3]).is_err());
    assert!(ExpertShare::list([usize::MAX]).is_err());
    assert!(ExpertShare::part(0, 0).is_err());
    assert!(ExpertShare::part(usize::MAX, usize::MAX).is_err());
    let e = ExpertShare::ranges([0..4, 2..3]).unwrap_err();
    assert!(
        e.to_string().contains("0-3") && e.to_string().contains("2-2"),
        "{e}"
    );
    // A range past a layer of 0 experts: out of range, not an underflow.
    let e = ExpertShare::range(0..1).unwrap().resolve(0, 0).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e:?}");
}

#[test]
fn tensor_slice_parse_refuses_hostile_text() {
    let bad = [
        "",
        ":",
        "rows",
        "rows:",
        "rows:0/0",
        "rows:1/1",
        "rows:0:0",
        "rows:0/2/3",
        "rows:0:1:2",
        "rows:18446744073709551615:1",
        "rows:1:18446744073709551615",
        "rows:18446744073709551616/2",
        "ROWS:0/2",
        "rows: 0/2",
        "diagonal:0/2",
        "rows:-1/2",
        "rows:٠/٢",
    ];
    for text in bad {
        let e = TensorSlice::parse(text).unwrap_err();
        assert!(named(&e), "{text:?}: {e:?}");
    }
    let s = TensorSlice::parse(" cols:1/2 ").unwrap();
    assert_eq!(s.axis(), SliceAxis::Columns);
    assert_eq!(s.resolve(8), Ok(4..8));
    assert!(s.resolve(0).is_err());
    assert!(s.resolve(7).is_err());
    // The last of u64::MAX parts of an axis of u64::MAX: no overflow.
    let s = TensorSlice::part(SliceAxis::Rows, u64::MAX - 1, u64::MAX).unwrap();
    assert_eq!(s.resolve(u64::MAX), Ok(u64::MAX - 1..u64::MAX));
    let s = TensorSlice::span(SliceAxis::Rows, u64::MAX - 1, 1).unwrap();
    assert_eq!(s.resolve(u64::MAX), Ok(u64::MAX - 1..u64::MAX));
    assert!(s.resolve(u64::MAX - 1).is_err());
}

fn set(ids: &[u16]) -> NodeSet {
    let mut s = NodeSet::default();
    for &i in ids {
        s.insert(numapin::Node(i));
    }
    s
}

fn ctx4() -> NodeContext {
    NodeContext::new(4, set(&[0, 1, 2, 3]))
}

#[test]
fn layout_string_form_refuses_hostile_text() {
    let ctx = ctx4();
    let bad = [
        "",
        ":",
        "split",
        "split:",
        "split:all:all",
        "split:4",
        "split:65535",
        "split:0-18446744073709551615",
        "unplaced:",
        "unplaced:all",
        "splït:0",
        "SPLIT:0",
        "split;0",
        "interleave:0-",
        "interleave:3-0",
    ];
    for text in bad {
        let e = Layout::parse_in(text, &ctx).unwrap_err();
        assert!(named(&e), "{text:?}: {e:?}");
    }
    // Every layout's text form reads back as itself.
    let set = set(&[0, 2, 3]);
    for layout in [
        Layout::Interleave(set),
        Layout::LayerPerNode(set),
        Layout::Replicate(set),
        Layout::ReplicateDomains(set),
        Layout::SplitExperts(set),
        Layout::Unplaced,
    ] {
        let text = layout.to_string();
        assert_eq!(Layout::parse_in(&text, &ctx).unwrap(), layout, "{text}");
    }
}

#[test]
fn placement_plan_text_refuses_hostile_items() {
    let base = || PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced);
    let bad = [
        "x",
        "=replicate:0",
        "dense",
        "dense=",
        "dense=bind:",
        "dense=bind:-1",
        "dense=bind:65536",
        "dense=bind:0,1",
        "dense=unplaced:0",
        "dense=replicate",
        "dense=replicate:",
        "attention=scatter:0",
        "experts=split",
        "experts=bogus:0",
        "*.weight=bind:x",
    ];
    for text in bad {
        match base().apply(text) {
            Err(e) => assert!(named(&e), "{text:?}: {e:?}"),
            Ok(p) => panic!("{text:?} accepted: {p}"),
        }
    }
    // Empty text and separators only: the plan as it was.
    for text in ["", ",", ";;", " , ; "] {
        assert_eq!(base().apply(text).unwrap().to_string(), base().to_string());
    }
}

#[test]
fn placement_plan_text_round_trips() {
    let plan = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
        .apply(
            "experts=split:0; dense=replicate:0; attention=interleave:0; \
             blk.?.ffn_*=bind:0; *norm*=unplaced; *=interleave:0",
        )
        .unwrap();
    let text = plan.to_string();
    let back = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
        .apply(&text)
        .unwrap();
    assert_eq!(back.to_string(), text);
    assert_eq!(plan.experts_layout(), Layout::SplitExperts(set(&[0])));
    assert_eq!(plan.patterns().len(), 3);
}

#[test]
fn routing_json_refuses_hostile_documents() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_obj = format!(
        "{{\"numapin_routing\":1,\"layers\":{}{}}}",
        "[".repeat(50_000),
        "]".repeat(50_000)
    );
    let bad = [
        "",
        "null",
        "[]",
        "{}",
        "{\"numapin_routing\":2,\"layers\":[]}",
        "{\"numapin_routing\":1}",
        "{\"numapin_routing\":1,\"layers\":{}}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":-1,\"counts\":[1]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0.5,\"counts\":[1]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0,\"counts\":[]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0,\"counts\":[-1]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0,\"counts\":[1.5]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0,\"counts\":[18446744073709551616]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0,\"counts\":[1e30]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0,\"counts\":[\"1\"]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0,\"counts\":[18446744073709551615]},\
          {\"layer\":0,\"counts\":[1]}]}",
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":0,\"counts\":[1,2]},\
          {\"layer\":0,\"counts\":[1]}]}",
        &deep,
        &deep_obj,
    ];
    for text in bad {
        let e = RoutingStats::from_json(text).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "{:?}: {e:?}",
            &text[..text.len().min(80)]
        );
    }
    // The largest layer index is a key, not an allocation.
    let s = RoutingStats::from_json(
        "{\"numapin_routing\":1,\"layers\":[{\"layer\":18446744073709551615,\"counts\":[0,3]},\
         {\"layer\":18446744073709551615,\"counts\":[1,3]}]}",
    )
    .unwrap();
    assert_eq!(s.layer(usize::MAX), Some(&[1u64, 6][..]));
    assert!(s.check_against(&[(0, 2)]).is_err());
}

#[test]
fn machine_json_refuses_hostile_documents() {
    let bad = [
        "",
        "{\"numapin_topology\":1,\"nodes\":[]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0}]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":65535,\"free_bytes\":1}]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":18446744073709551615,\"free_bytes\":1}]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":1},{\"id\":0,\"free_bytes\":1}]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":1,\"cpus\":false}]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":-1}]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":1,\"cpus\":1}]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":1}],\"distances\":[]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":1}],\"distances\":[[]]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":1}],\"distances\":[[10,10]]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":1}],\"distances\":[[-1]]}",
        "{\"numapin_topology\":1,\"nodes\":[{\"id\":0,\"free_bytes\":1}],\"max_map_count\":-5}",
    ];
    for text in bad {
        let e = Machine::from_json(text).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{text}: {e:?}");
    }
    // Free bytes summing past u64::MAX over nodes: no overflow panic.
    let m = Machine::from_json(
        "{\"numapin_topology\":1,\"nodes\":[\
         {\"id\":0,\"free_bytes\":18446744073709551615},\
         {\"id\":1,\"free_bytes\":18446744073709551615,\"domain\":7}]}",
    );
    assert!(m.is_ok(), "{m:?}");
}

#[test]
fn machine_json_keeps_a_node_without_domain_apart_from_explicit_domains() {
    // Node 0 names no domain (its own); node 1 names domain u64::MAX. They are two domains.
    let m = Machine::from_json(
        "{\"numapin_topology\":1,\"nodes\":[\
         {\"id\":0,\"free_bytes\":1024},\
         {\"id\":1,\"free_bytes\":1024,\"domain\":18446744073709551615}]}",
    )
    .unwrap();
    assert_eq!(m.domains(), vec![vec![0], vec![1]]);
}

#[test]
fn balance_at_the_edges() {
    assert!(balance(&[1], &[]).is_err());
    assert!(balance(&[1, 2, 3], &[1, 1]).is_err());
    assert!(balance(&[1], &[0, 0]).is_err());
    assert_eq!(balance(&[], &[0]).unwrap(), Vec::<usize>::new());
    // Caps summing past usize::MAX saturate; zero counts go somewhere allowed.
    let got = balance(&[0, 0, 0], &[usize::MAX, usize::MAX, 0]).unwrap();
    assert!(got.iter().all(|&n| n < 2), "{got:?}");
    // u64::MAX counts: loads in u128, caps held.
    let counts = [u64::MAX; 6];
    let got = balance(&counts, &[1, 0, 5]).unwrap();
    assert_eq!(got.iter().filter(|&&n| n == 0).count(), 1, "{got:?}");
    assert!(got.iter().all(|&n| n != 1), "{got:?}");
    let loads = node_loads(&counts, &got, 3);
    assert_eq!(loads[2], 5 * u128::from(u64::MAX));
    // Node index past the list: ignored, not a panic.
    assert_eq!(node_loads(&[5], &[9], 2), vec![0, 0]);
}

#[test]
fn balance_on_many_experts_finishes_and_respects_caps() {
    // 4096 experts of skewed counts over 8 nodes of 512 each: caps exactly full.
    let counts: Vec<u64> = (0..4096u64)
        .map(|e| (e * 2_654_435_761) % 100_003)
        .collect();
    let caps = [512usize; 8];
    let got = balance(&counts, &caps).unwrap();
    for node in 0..8 {
        assert_eq!(got.iter().filter(|&&n| n == node).count(), 512);
    }
}

/// A throwaway `/sys/devices/system` stand-in.
struct Tree(std::path::PathBuf);

impl Tree {
    fn new(tag: &str) -> Tree {
        let root = std::env::temp_dir().join(format!("numapin-atk4-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        Tree(root)
    }

    fn write(&self, relative: &str, text: &str) -> &Tree {
        let path = self.0.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
        self
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn topology_refuses_hostile_sysfs_files_by_name() {
    use numapin::topology::Topology;
    let cases: [(&str, &str, &str); 6] = [
        ("online", "node/online", "0-18446744073709551616"),
        ("online2", "node/online", "garbage"),
        ("cpulist", "node/node0/cpulist", "0-1048576"),
        ("cpulist2", "node/node0/cpulist", "3-1"),
        ("cpulist3", "node/node0/cpulist", "0,,1"),
        ("package", "cpu/cpu0/topology/physical_package_id", "zero"),
    ];
    for (tag, file, text) in cases {
        let t = Tree::new(tag);
        t.write("node/online", "0\n")
            .write("node/node0/cpulist", "0\n")
            .write("node/node0/distance", "10\n")
            .write("cpu/cpu0/topology/physical_package_id", "0\n")
            .write(file, text);
        let e = Topology::read_from(&t.0).unwrap_err();
        assert!(
            matches!(e, Error::Unparsable { .. }) && e.to_string().contains(file),
            "{file}={text:?}: {e:?}"
        );
    }
    // A directory where a file should be: an I/O error naming it, not a panic.
    let t = Tree::new("dir");
    t.write("node/online", "0\n")
        .write("node/node0/cpulist/x", "");
    let e = Topology::read_from(&t.0).unwrap_err();
    assert!(e.to_string().contains("cpulist"), "{e:?}");
}

#[test]
fn topology_refuses_a_garbage_distance_row() {
    use numapin::topology::Topology;
    // "10 x 20": dropping the `x` would shift node 2's distance onto node 1.
    let t = Tree::new("distance");
    t.write("node/online", "0-2\n");
    for n in 0..3 {
        t.write(&format!("node/node{n}/cpulist"), &format!("{n}\n"))
            .write(&format!("node/node{n}/distance"), "10 20 20\n");
    }
    t.write("node/node0/distance", "10 x 20\n");
    let e = Topology::read_from(&t.0).unwrap_err();
    assert!(
        matches!(e, Error::Unparsable { .. }) && e.to_string().contains("node0/distance"),
        "{e:?}"
    );
}

#[test]
fn topology_of_odd_but_valid_trees() {
    use numapin::topology::Topology;
    // Online nodes whose directories are missing, a CPU claimed by two nodes, CPU ids at
    // the bound, a distance row shorter than the node count.
    let t = Tree::new("odd");
    t.write("node/online", "0-3\n")
        .write("node/node0/cpulist", "0,1048575\n")
        .write("node/node1/cpulist", "0\n")
        .write("node/node0/distance", "10\n")
        .write("cpu/cpu0/topology/physical_package_id", "-1\n");
    let topo = Topology::read_from(&t.0).unwrap();
    let all: usize = topo.domains().iter().map(|d| d.nodes().len()).sum();
    assert_eq!(
        all,
        4,
        "every online node in one domain: {:?}",
        topo.domains()
    );
    assert_eq!(topo.distance(numapin::Node(0), numapin::Node(3)), None);
}

#[test]
fn expert_share_resolve_refuses_absurd_expert_counts() {
    for share in [
        ExpertShare::all(),
        ExpertShare::part(0, 1).unwrap(),
        ExpertShare::range(0..usize::MAX).unwrap(),
    ] {
        let e = share.resolve(0, usize::MAX).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    }
}

// Rust's integer `from_str` takes a leading '+', which no text form here means: a signed
// number is a named error quoting it, like any other bad number. (Node lists and so
// `Layout`'s text read digits only already: `+` there is numactl's relative prefix.)

#[test]
fn expert_share_parse_refuses_a_signed_id() {
    for text in ["+1", " +1 ", "+0-3", "0-+3", "+1/2", "1/+2", "0,+7"] {
        match ExpertShare::parse(text) {
            Err(Error::Parse { part, .. }) => assert!(part.contains('+'), "{text:?}: {part:?}"),
            other => panic!("{text:?} gave {other:?}"),
        }
    }
    assert!(ExpertShare::parse("1").is_ok());
}

#[test]
fn tensor_slice_parse_refuses_a_signed_number() {
    for text in ["rows:+0/2", "rows:0/+2", "columns:+0:4", "columns:0:+4"] {
        match TensorSlice::parse(text) {
            Err(Error::Parse { part, .. }) => assert!(part.starts_with('+'), "{text:?}: {part:?}"),
            other => panic!("{text:?} gave {other:?}"),
        }
    }
    assert!(TensorSlice::parse("rows:0/2").is_ok());
}

#[test]
fn placement_plan_bind_refuses_a_signed_node() {
    let plan = || PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced);
    for text in ["dense=bind:+0", "*.weight=bind:+0"] {
        match plan().apply(text) {
            Err(e @ Error::InvalidArgument { .. }) => {
                assert!(e.to_string().contains("+0"), "{text:?}: {e}")
            }
            other => panic!("{text:?} gave {:?}", other.map(|p| p.to_string())),
        }
    }
    assert!(plan().apply("dense=bind:0").is_ok());
}
