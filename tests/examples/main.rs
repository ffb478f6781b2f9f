//! The examples' flags and JSON (`examples/support/`), without running the examples:
//! the clap types parse as the README and docs/cli.md say, `pin_model`'s JSON from
//! a real (small) load carries the schema and both expert counts where xtask's VM check
//! reads them, and `probe`'s JSON is `Support` in the form the library's `serde` feature
//! gives it. Here the JSON of real loads and the output's end on a closed pipe; `flags`
//! the flags, `probe` the support report.

#[path = "../common/mod.rs"]
mod common;
mod flags;
mod probe;
#[path = "../../examples/support/mod.rs"]
mod support;

use std::path::PathBuf;

use common::{degrade_here, nodes};
use numapin::store::{Layout, StoreOptions};
use numapin::{Node, NodeSet};

use numapin::policy::Placement;
use numapin_testkit::synthetic::SyntheticModel;
use serde_json::Value;
use support::args::{LayoutArg, PinModelArgs};
use support::report::{BaselineJson, PIN_MODEL_SCHEMA, PinModelJson, RunJson};
use support::{run_baseline, run_store};

fn parse(args: &[&str]) -> Result<PinModelArgs, clap::Error> {
    PinModelArgs::try_parse_checked(std::iter::once("pin_model").chain(args.iter().copied()))
}

fn set(ids: &[usize]) -> NodeSet {
    NodeSet::from_nodes(ids.iter().copied()).unwrap()
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
