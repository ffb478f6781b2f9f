//! The examples' flags and JSON (`examples/support/`), without running the examples:
//! the clap types parse as the README and docs/cli.md say, `pin_model`'s JSON from
//! a real (small) load carries the schema and both expert counts where xtask's VM check
//! reads them, and `probe`'s JSON is `Support` in the form the library's `serde` feature
//! gives it.

mod common;

#[path = "../examples/support/mod.rs"]
mod support;

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use common::{degrade_here, expect, nodes};
use numapin::store::{Layout, StoreOptions};
use numapin::{MempolicySupport, Node, NodeSet, Support, ThpMode};

use numapin::policy::Placement;
use numapin_testkit::synthetic::SyntheticModel;
use serde_json::Value;
use support::args::{LayoutArg, PinModelArgs, ProbeArgs};
use support::report::{
    BaselineJson, PIN_MODEL_SCHEMA, PROBE_SCHEMA, PinModelJson, ProbeJson, RunJson, verdict,
};
use support::{run_baseline, run_store};

fn parse(args: &[&str]) -> Result<PinModelArgs, clap::Error> {
    PinModelArgs::try_parse_checked(std::iter::once("pin_model").chain(args.iter().copied()))
}

fn set(ids: &[usize]) -> NodeSet {
    NodeSet::from_nodes(ids.iter().copied()).unwrap()
}

#[test]
fn pin_model_without_flags_is_the_readme_run() {
    let args = parse(&[]).unwrap();
    assert_eq!(args.synthetic(), SyntheticModel::default());
    assert_eq!(args.layout, LayoutArg::Interleave);
    assert_eq!(args.nodes, NodeSet::allowed().unwrap());
    assert_eq!(
        args.layout(),
        Layout::Interleave(NodeSet::allowed().unwrap())
    );
    assert_eq!(args.file, None);
    assert_eq!(args.threads, None);
    assert!(!args.no_huge_pages && !args.baseline && !args.json);
    assert_eq!(args.purge(), cfg!(feature = "jemalloc"));
}

#[test]
fn every_pin_model_flag_keeps_its_meaning() {
    let args = parse(&[
        "--layers",
        "3",
        "--experts",
        "5",
        "--weight-bytes",
        "4096",
        "--scale-bytes",
        "0",
        "--layout",
        "layer-per-node",
        "--nodes",
        "0",
        "--file",
        "/nowhere/model.bin",
        "--threads",
        "7",
        "--no-huge-pages",
        "--baseline",
        "--json",
        "--no-purge",
    ])
    .unwrap();
    assert_eq!(
        args.synthetic(),
        SyntheticModel {
            layers: 3,
            experts: 5,
            weight_bytes: 4096,
            scale_bytes: 0,
        }
    );
    assert_eq!(args.layout(), Layout::LayerPerNode(set(&[0])));
    assert_eq!(args.file, Some(PathBuf::from("/nowhere/model.bin")));
    assert_eq!(args.threads, Some(7));
    assert!(args.no_huge_pages && args.baseline && args.json);
    assert!(!args.purge());
    assert_eq!(args.read, numapin::store::ReadMode::Auto, "the default");
    assert_eq!(args.model, None);
    model_and_plan_flags_keep_their_meaning();
    read_and_layout_flags_keep_their_meaning();
}

/// `--model`, `--no-progress`, and `--plan-only` with what needs it.
fn model_and_plan_flags_keep_their_meaning() {
    let more = parse(&["--read", "direct", "--model", "/m/ckpt", "--no-progress"]).unwrap();
    assert_eq!(more.read, numapin::store::ReadMode::Direct);
    assert_eq!(more.model, Some(PathBuf::from("/m/ckpt")));
    assert!(more.no_progress);
    assert!(!more.plan_only && more.topology.is_none() && more.routing.is_none());
    let plan = parse(&[
        "--model",
        "/m/ckpt",
        "--plan-only",
        "--topology",
        "/t.json",
        "--routing",
        "/r.json",
        "--budget",
        "192G",
    ])
    .unwrap();
    assert!(plan.plan_only);
    assert_eq!(plan.topology, Some(PathBuf::from("/t.json")));
    assert_eq!(plan.routing, Some(PathBuf::from("/r.json")));
    assert_eq!(plan.budget, Some(192 << 30));
    assert_eq!(
        parse(&["--model", "/m", "--plan-only", "--budget", "4096"])
            .unwrap()
            .budget,
        Some(4096)
    );
    // --plan-only needs --model; --topology, --routing and --budget need --plan-only.
    for alone in [
        &["--plan-only"][..],
        &["--model", "/m", "--topology", "/t"],
        &["--model", "/m", "--routing", "/r"],
        &["--model", "/m", "--budget", "1G"],
    ] {
        assert_eq!(
            parse(alone).unwrap_err().kind(),
            ErrorKind::MissingRequiredArgument,
            "{alone:?}"
        );
    }
    for bad in ["x", "-1G", "99999999999T"] {
        assert!(
            parse(&["--model", "/m", "--plan-only", "--budget", bad]).is_err(),
            "{bad}"
        );
    }
}

/// `--read` and `--layout`, each value.
fn read_and_layout_flags_keep_their_meaning() {
    assert_eq!(
        parse(&["--read", "drop-behind"]).unwrap().read,
        numapin::store::ReadMode::DropBehind
    );
    assert!(parse(&["--read", "mmap"]).is_err());
    assert_eq!(
        parse(&["--layout", "unplaced"]).unwrap().layout(),
        Layout::Unplaced
    );
    for layout in [
        LayoutArg::Interleave,
        LayoutArg::LayerPerNode,
        LayoutArg::Unplaced,
        LayoutArg::Replicate,
        LayoutArg::Split,
    ] {
        assert_eq!(parse(&["--layout", layout.name()]).unwrap().layout, layout);
    }
}

#[test]
fn purge_needs_jemalloc_and_the_last_purge_flag_wins() {
    assert!(!parse(&["--purge", "--no-purge"]).unwrap().purge());
    let last_purge = parse(&["--no-purge", "--purge"]);
    if cfg!(feature = "jemalloc") {
        assert!(last_purge.unwrap().purge());
        assert!(parse(&["--purge"]).unwrap().purge());
    } else {
        assert_eq!(last_purge.unwrap_err().kind(), ErrorKind::ArgumentConflict);
        let err = parse(&["--purge"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ArgumentConflict);
        assert!(err.to_string().contains("--features jemalloc"), "{err}");
    }
}

#[test]
fn bad_pin_model_flags_are_usage_errors() {
    let kind = |args: &[&str]| parse(args).unwrap_err().kind();
    assert_eq!(kind(&["--layout", "spread"]), ErrorKind::InvalidValue);
    for zero in ["--layers", "--experts", "--weight-bytes", "--threads"] {
        assert_eq!(kind(&[zero, "0"]), ErrorKind::ValueValidation, "{zero}");
        assert_eq!(kind(&[zero, "x"]), ErrorKind::ValueValidation, "{zero}");
    }
    assert_eq!(kind(&["--scale-bytes", "-1"]), ErrorKind::UnknownArgument);
    assert_eq!(kind(&["--nodes", "0-"]), ErrorKind::ValueValidation);
    assert_eq!(kind(&["--layers"]), ErrorKind::InvalidValue);
    assert_eq!(kind(&["--experts-total", "3"]), ErrorKind::UnknownArgument);
    assert_eq!(kind(&["--help"]), ErrorKind::DisplayHelp);
    // The exit status clap gives a usage error, and 0 for --help.
    assert_eq!(parse(&["--layout", "spread"]).unwrap_err().exit_code(), 2);
    assert_eq!(parse(&["--help"]).unwrap_err().exit_code(), 0);
}

/// The `--help` text of one flag: from its line to the next flag's.
fn flag_help<'a>(help: &'a str, flag: &str) -> &'a str {
    let start = help
        .find(&format!("\n      {flag} "))
        .or_else(|| help.find(&format!("\n      {flag}\n")))
        .unwrap_or_else(|| panic!("{flag} missing from:\n{help}"));
    let rest = &help[start + 1..];
    let end = rest[1..].find("\n      --").map_or(rest.len(), |e| e + 1);
    &rest[..end]
}

#[test]
fn help_shows_every_flag_with_its_default() {
    let help = PinModelArgs::command().render_long_help().to_string();
    let model = SyntheticModel::default();
    for (flag, default) in [
        ("--layers", model.layers.to_string()),
        ("--experts", model.experts.to_string()),
        ("--weight-bytes", model.weight_bytes.to_string()),
        ("--scale-bytes", model.scale_bytes.to_string()),
        ("--layout", LayoutArg::Interleave.name().to_string()),
        ("--nodes", "all".to_string()),
    ] {
        let text = flag_help(&help, flag);
        assert!(
            text.contains(&format!("[default: {default}]")),
            "{flag}:\n{text}"
        );
    }
    for word in [
        "interleave",
        "layer-per-node",
        "unplaced",
        "replicate",
        "split",
    ] {
        assert!(flag_help(&help, "--layout").contains(word), "{word}");
    }
    for flag in [
        "--file",
        "--threads",
        "--no-huge-pages",
        "--baseline",
        "--json",
        "--purge",
        "--no-purge",
    ] {
        assert!(!flag_help(&help, flag).trim().is_empty(), "{flag}");
    }
    assert!(flag_help(&help, "--threads").contains("[default: "));
    assert!(flag_help(&help, "--purge").contains("[default: "));
    // The old --help printed the source's `//!` lines.
    assert!(!help.contains("//!"), "{help}");

    let probe = ProbeArgs::command().render_long_help().to_string();
    assert!(flag_help(&probe, "--json").contains("JSON"), "{probe}");
    let probe_args = |args: &[&str]| ProbeArgs::try_parse_from(args.iter().copied());
    assert!(probe_args(&["probe", "--json"]).unwrap().json);
    assert!(!probe_args(&["probe"]).unwrap().json);
    assert_eq!(
        probe_args(&["probe", "--jsno"]).unwrap_err().kind(),
        ErrorKind::UnknownArgument
    );
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn pin_model_json_from_a_real_load() {
    let dir =
        TempDir(std::env::temp_dir().join(format!("numapin-examples-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let model = SyntheticModel {
        layers: 2,
        experts: 8,
        weight_bytes: 16 << 10,
        scale_bytes: 1 << 10,
    };
    let path = dir.0.join("model.bin");
    model.write(&path).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let layout = Layout::Interleave(nodes());
    let options = StoreOptions::default().loader_threads(2);
    let (run, store) = run_store(&model, &file, layout, options, true).unwrap();
    drop(store);
    let baseline = run_baseline(&model, &file, layout).map(|(run, _slabs)| run);
    assert!(baseline.is_ok(), "{baseline:?}");

    let json = PinModelJson {
        schema: PIN_MODEL_SCHEMA,
        run: RunJson::new(&run),
        nodes: nodes().to_string(),
        layout: LayoutArg::Interleave.name(),
        verified: true,
        purge: None,
        model: None,
        baseline: Some(BaselineJson::new(&baseline)),
    };
    let text = serde_json::to_string(&json).unwrap();
    let value: Value = serde_json::from_str(&text).unwrap();

    // The schema comes first; the total is no longer called `experts`.
    assert!(
        text.starts_with(&format!("{{\"schema\":{PIN_MODEL_SCHEMA},")),
        "{text}"
    );
    assert_eq!(value.get("experts"), None);
    let total = (model.layers * model.experts) as u64;
    let placement = match degrade_here() {
        None => Placement::Bound.to_string(),
        Some(reason) => Placement::Degraded(reason).to_string(),
    };
    for (name, load) in [("store", &value), ("baseline", &value["baseline"])] {
        assert_eq!(load["layers"], model.layers as u64, "{name}");
        assert_eq!(load["experts_per_layer"], model.experts as u64, "{name}");
        assert_eq!(load["experts_total"], total, "{name}");
        assert_eq!(load["bytes"], model.total_bytes().unwrap(), "{name}");
        assert_eq!(load["placement"], placement.as_str(), "{name}");
    }
    // Everything else is the Run, field for field.
    assert_eq!(value["vmas"], run.vmas as u64);
    assert_eq!(value["mbind_calls"], run.mbind_calls as u64);
    assert_eq!(value["rss_bytes"], run.rss_bytes);
    assert_eq!(value["minor_faults"], run.minor_faults);
    assert_eq!(value["anon_huge_bytes"], run.anon_huge_bytes);
    assert_eq!(value["pages_merged"], run.pages_merged);
    assert_eq!(value["pages_source"], run.pages_source_name());
    let pages: Vec<(Node, u64)> = value["pages_per_node"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, p)| (Node(n.parse().unwrap()), p.as_u64().unwrap()))
        .collect();
    assert_eq!(
        pages,
        run.pages_per_node
            .iter()
            .map(|(n, p)| (*n, *p))
            .collect::<Vec<_>>()
    );
    assert_eq!(value["nodes"], nodes().to_string());
    assert_eq!(value["layout"], "interleave");
    assert_eq!(value["verified"], true);
    assert_eq!(value.get("purge"), None);
    assert_eq!(value.get("model"), None, "only with --model");
    assert_eq!(value["read_mode"], "buffered");
    assert_eq!(value["fallback"], Value::Null);
    // xtask's VM check reads the first `"pages_per_node":{` and `"placement":"bound"`
    // from the compact text: the store's, before the baseline's.
    let first_pages = text.find("\"pages_per_node\":{").unwrap();
    assert!(first_pages < text.find("\"baseline\":").unwrap(), "{text}");
    assert_eq!(
        text.contains("\"placement\":\"bound\""),
        degrade_here().is_none(),
        "{text}"
    );

    // A failed baseline is its error.
    let failed = Err("mbind: ENOMEM after 3 slabs".to_string());
    assert_eq!(
        serde_json::to_value(BaselineJson::new(&failed)).unwrap(),
        serde_json::json!({ "error": "mbind: ENOMEM after 3 slabs" })
    );
}

fn support(
    mempolicy: MempolicySupport,
    page_calls: MempolicySupport,
    memory: &[usize],
    allowed: &[usize],
) -> Support {
    Support {
        mempolicy,
        page_calls,
        possible_nodes: 4,
        nodes_with_memory: set(memory),
        nodes_with_cpus: set(&memory[..1]),
        mems_allowed: set(allowed),
        distances: Vec::new(),
        free_bytes: Vec::new(),
        numa_balancing: None,
        thp: ThpMode::Never,
        max_map_count: 65530,
        map_count: 40,
        cap_sys_nice: false,
        populate_write: true,
        anon_vma_names: false,
    }
}

/// A four-node machine: distances of two and three digits, free memory of several widths.
fn four_nodes() -> Support {
    use MempolicySupport::Available;
    let mut s = support(Available, Available, &[0, 1, 2, 3], &[0, 1, 2, 3]);
    s.distances = vec![
        (Node(0), vec![10, 21, 31, 120]),
        (Node(1), vec![21, 10, 21, 31]),
        (Node(2), vec![31, 21, 10, 21]),
        (Node(3), vec![120, 31, 21, 10]),
    ];
    s.free_bytes = vec![
        (Node(0), 3 << 30),
        (Node(1), 120 << 30),
        (Node(2), 1 << 29),
        (Node(3), 0),
    ];
    s.numa_balancing = Some(1);
    s.thp = ThpMode::Madvise;
    s
}

#[test]
fn the_verdict_says_what_placement_does_here() {
    use MempolicySupport::{Available, Denied, Unsupported};
    let cases = [
        (
            support(Available, Available, &[0], &[0]),
            "one memory node: placement is a no-op here",
        ),
        (
            support(Available, Available, &[0, 1, 2, 3], &[0, 1, 2, 3]),
            "placement works on nodes 0-3",
        ),
        (
            support(Available, Available, &[0, 1, 2, 3], &[2]),
            "one allowed memory node (2 of 0-3): placement is a no-op here",
        ),
        (
            support(Available, Denied, &[0, 1, 2, 3], &[0, 1, 2, 3]),
            "placement works on nodes 0-3; page calls denied (EPERM): placement proven \
             through numa_maps",
        ),
        (
            support(Denied, Denied, &[0, 1, 2, 3], &[0, 1, 2, 3]),
            "NUMA calls denied (EPERM): running unplaced",
        ),
        (
            support(Unsupported, Unsupported, &[0], &[0]),
            "kernel without NUMA (ENOSYS): running unplaced",
        ),
    ];
    for (support, want) in cases {
        assert_eq!(verdict(&support), want, "{support:?}");
    }
}

/// Checks that every line of a `Support` report starts its value in one column, and
/// that the distance table's columns end in the same places on every row.
fn assert_aligned(text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    let first = lines[0];
    let column = first.len() - first[first.find(' ').unwrap()..].trim_start().len();
    for line in &lines {
        assert!(line.len() > column, "{line:?} in:\n{text}");
        assert_eq!(&line[column - 1..column], " ", "{line:?} in:\n{text}");
        assert!(
            !line[..column].trim_end().contains("  "),
            "{line:?} in:\n{text}"
        );
        assert!(
            !line[..column].trim_end().is_empty(),
            "{line:?} in:\n{text}"
        );
    }
    let ends = |line: &str| -> Vec<usize> {
        let mut ends = Vec::new();
        let bytes = line.as_bytes();
        for i in column..line.len() {
            if bytes[i] != b' ' && (i + 1 == line.len() || bytes[i + 1] == b' ') {
                ends.push(i);
            }
        }
        ends
    };
    let table: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("distance"))
        .collect();
    for line in &table {
        assert_eq!(ends(line), ends(table[0]), "{line:?} in:\n{text}");
    }
    let free: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("free on node"))
        .collect();
    for line in &free {
        assert_eq!(line.len(), free[0].len(), "{line:?} in:\n{text}");
    }
}

#[test]
fn the_support_report_is_in_columns() {
    let machine = four_nodes();
    let text = machine.to_string();
    assert_aligned(&text);
    // A header of node ids over a row per node.
    assert_eq!(
        text.lines().filter(|l| l.starts_with("distance")).count(),
        machine.distances.len() + 1,
        "{text}"
    );
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("free on node"))
            .count(),
        machine.free_bytes.len(),
        "{text}"
    );
    assert_aligned(&numapin::probe().unwrap().to_string());
}

fn state_word(state: MempolicySupport) -> &'static str {
    match state {
        MempolicySupport::Available => "available",
        MempolicySupport::Denied => "denied",
        MempolicySupport::Unsupported => "unsupported",
    }
}

#[test]
fn probe_json_has_the_schema_the_support_and_the_verdict() {
    let here = numapin::probe().unwrap();
    let value = serde_json::to_value(ProbeJson::new(&here)).unwrap();
    assert_eq!(value["schema"], PROBE_SCHEMA);
    assert_eq!(value["verdict"], verdict(&here));
    assert_eq!(value["allowed"], here.allowed().to_string());
    let want = match expect() {
        common::Expect::Full => MempolicySupport::Available,
        common::Expect::Denied => MempolicySupport::Denied,
        common::Expect::Unsupported => MempolicySupport::Unsupported,
    };
    assert_eq!(value["support"]["mempolicy"], state_word(want));
    assert_eq!(value["support"]["page_calls"], state_word(here.page_calls));

    let machine = four_nodes();
    let value = serde_json::to_value(ProbeJson::new(&machine)).unwrap();
    assert_eq!(value["allowed"], "0-3");
    assert_eq!(value["support"]["thp"], "madvise");
    assert_eq!(
        value["support"]["distances"][3],
        serde_json::json!([3, machine.distances[3].1])
    );
    assert_eq!(
        value["support"]["free_bytes"][1],
        serde_json::json!([1, machine.free_bytes[1].1])
    );
}

/// The example builds its JSON without the library's `serde` feature; where the feature
/// is on, the two must be the same document, and it must read back as the `Support`.
#[cfg(feature = "serde")]
#[test]
fn probe_json_is_supports_serde_form() {
    use MempolicySupport::{Available, Denied, Unsupported};
    let mut machines = vec![
        numapin::probe().unwrap(),
        four_nodes(),
        support(Denied, Denied, &[0], &[0]),
        support(Unsupported, Unsupported, &[0], &[0]),
        support(Available, Denied, &[0, 1], &[1]),
    ];
    machines[2].thp = ThpMode::Always;
    machines[3].thp = ThpMode::Unknown;
    machines[3].nodes_with_cpus = NodeSet::new();
    for machine in machines {
        let example = serde_json::to_value(ProbeJson::new(&machine)).unwrap();
        let library = serde_json::to_value(&machine).unwrap();
        assert_eq!(example["support"], library, "{machine:?}");
        let back: Support = serde_json::from_value(example["support"].clone()).unwrap();
        assert_eq!(back, machine);
    }
}

#[test]
fn pin_model_share_flags_parse_to_the_share_placed() {
    let args = parse(&[
        "--model",
        "/m",
        "--experts",
        "0-63,96",
        "--slice",
        "rows:0/2",
    ])
    .unwrap();
    assert_eq!(args.share().to_string(), "experts 0-63,96, slice rows:0/2");
    // The synthetic model's count is unchanged by a share-looking --model run.
    assert_eq!(args.synthetic().experts, SyntheticModel::default().experts);
    let k_of_n = parse(&[
        "--model",
        "/m",
        "--experts",
        "1/4",
        "--slice",
        "columns:128:256",
    ])
    .unwrap();
    assert_eq!(
        k_of_n.share().to_string(),
        "experts 1/4, slice columns:128:256"
    );
    assert!(parse(&["--model", "/m"]).unwrap().share().is_whole());
    let kind = |args: &[&str]| parse(args).unwrap_err().kind();
    assert_eq!(kind(&["--slice", "rows:0/2"]), ErrorKind::ArgumentConflict);
    assert_eq!(kind(&["--experts", "0-3"]), ErrorKind::ValueValidation);
    assert_eq!(
        kind(&["--model", "/m", "--experts", "0-9,5-12"]),
        ErrorKind::ValueValidation
    );
    assert_eq!(
        kind(&["--model", "/m", "--slice", "diagonal:0/2"]),
        ErrorKind::ValueValidation
    );
    assert_eq!(
        kind(&["--model", "/m", "--slice", "rows:2/2"]),
        ErrorKind::ValueValidation
    );
}

/// `pin_model --plan --json`'s timings: per class the load and verify seconds and the
/// class's bytes over its load seconds; the classes' loads add up to no more than the
/// whole placement's wall time, and every class with bytes was timed.
#[cfg(feature = "model")]
#[test]
fn pin_model_plan_json_has_load_and_verify_times_per_class() {
    use numapin::model::Checkpoint;
    use numapin::store::ReadMode;
    use support::whole::{WholeJson, WholeTimes};
    let Some(dir) = std::env::var_os("NUMAPIN_FIXTURES").map(PathBuf::from) else {
        eprintln!("NOT RUN: pin_model_plan_json_has_load_and_verify_times_per_class");
        return;
    };
    let path = dir.join("st-sharded/model");
    let checkpoint = Checkpoint::open(&path).unwrap();
    let plan = checkpoint.default_plan(nodes()).unwrap();
    let started = std::time::Instant::now();
    let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();
    let load = started.elapsed();
    let started = std::time::Instant::now();
    let verify = model.verify(&checkpoint).unwrap();
    let times = WholeTimes {
        load,
        verify: started.elapsed(),
    };
    let report = model.report().unwrap();
    let json = WholeJson::new(&path, report, &verify, ReadMode::Auto, times);
    assert_eq!(json.read_mode, "auto");
    assert!(json.classes.len() >= 2, "{json:?}");
    let mut loads = 0.0;
    for c in &json.classes {
        if c.bytes > 0 {
            assert!(c.load_seconds > 0.0, "{}: not timed", c.class);
            assert!(c.verify_seconds > 0.0, "{}: verify not timed", c.class);
            let rate = c.bytes as f64 / c.load_seconds / 1e9;
            assert!((c.load_gb_per_s - rate).abs() <= rate * 1e-9, "{}", c.class);
            // Each file its loads read, with the default (auto) mode's reason.
            assert!(!c.files.is_empty(), "{}: no file reads", c.class);
            for f in &c.files {
                assert!(f.contains(".safetensors: ") && f.contains("(auto: "), "{f}");
            }
        }
        loads += c.load_seconds;
    }
    assert!(
        loads <= json.load_seconds,
        "{loads} > {}",
        json.load_seconds
    );
    let verifies: f64 = json.classes.iter().map(|c| c.verify_seconds).sum();
    assert!(
        verifies <= json.verify_seconds,
        "{verifies} > {}",
        json.verify_seconds
    );
    let text = serde_json::to_string(&json).unwrap();
    for key in [
        "\"load_seconds\"",
        "\"load_gb_per_s\"",
        "\"verify_seconds\"",
    ] {
        assert!(
            text.matches(key).count() > json.classes.len(),
            "{key}: {text}"
        );
    }
}

/// `pin_model --model F --plan default --experts k/2 --slice rows:k/2`: the flags work
/// together (the plan places the rank's share and verifies every copy against the file);
/// a slice that divides no tensor's rows is an error naming a tensor.
#[test]
fn pin_model_plan_takes_the_share_flags() {
    let Some(dir) = std::env::var_os("NUMAPIN_FIXTURES").map(PathBuf::from) else {
        eprintln!("NOT RUN: pin_model_plan_takes_the_share_flags: set NUMAPIN_FIXTURES");
        return;
    };
    let model = dir.join("gguf-single/model.gguf");
    let model = model.to_str().unwrap();
    for k in ["0", "1"] {
        let (experts, slice) = (format!("{k}/2"), format!("rows:{k}/2"));
        let args = parse(&[
            "--model",
            model,
            "--plan",
            "default",
            "--experts",
            &experts,
            "--slice",
            &slice,
            "--json",
            "--no-progress",
        ])
        .unwrap();
        let plan = args.plan.clone().unwrap();
        support::whole::run_whole(&args, std::path::Path::new(model), &plan).unwrap();
    }
    let args = parse(&["--model", model, "--plan", "default", "--slice", "rows:0/7"]).unwrap();
    let err = support::whole::run_whole(&args, std::path::Path::new(model), "default").unwrap_err();
    assert!(
        err.contains("does not divide") && err.contains("weight"),
        "{err}"
    );
    // `--slice tp:k/n`: the tensor-parallel preset. The sharded safetensors fixture's
    // experts halve on their scale blocks; GGUF's Q8_0 expert down projections (32
    // columns, one block) cannot be cut by columns, and the error names the block.
    let sharded = dir.join("st-sharded/model");
    let sharded = sharded.to_str().unwrap();
    for k in ["0", "1"] {
        let slice = format!("tp:{k}/2");
        let args = parse(&["--model", sharded, "--plan", "default", "--slice", &slice]).unwrap();
        support::whole::run_whole(&args, std::path::Path::new(sharded), "default").unwrap();
    }
    let args = parse(&["--model", model, "--plan", "default", "--slice", "tp:1/2"]).unwrap();
    let err = support::whole::run_whole(&args, std::path::Path::new(model), "default").unwrap_err();
    assert!(err.contains("Q8_0 blocks of 32"), "{err}");
    for bad in ["tp:2/2", "tp:0/0", "tp:x/2", "tp:1", "tp:-1/2"] {
        assert!(
            parse(&["--model", model, "--plan", "default", "--slice", bad]).is_err(),
            "{bad}"
        );
    }
}

/// The examples print through `support::outln!`: output to a pipe closed early
/// (`pin_model --json | head -c 100`) ends the program with status 141, as `SIGPIPE` ends
/// `cat`, where `println!` panicked ("failed printing to stdout: Broken pipe").
#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    const CHILD: &str = "NUMAPIN_TEST_CLOSED_PIPE";
    if std::env::var_os(CHILD).is_some() {
        for line in 0.. {
            support::outln!("line {line} of an output longer than any pipe buffer");
        }
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_closed_pipe_ends_the_output_quietly",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read up to the first line printed (the harness prints its own first), then close
    // the pipe, as `head` does.
    let mut first = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    for _ in 0..8 {
        first.clear();
        std::io::BufRead::read_line(&mut out, &mut first).unwrap();
        if first.starts_with("line ") {
            break;
        }
    }
    drop(out);
    let result = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(first.starts_with("line 0 "), "{first}");
    assert_eq!(result.status.code(), Some(141), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
