//! The `numapin` binary run as a user runs it (`CARGO_BIN_EXE_numapin`): `probe --json`
//! against what /proc says, `plan` against the library's planner on the same header and
//! topology, `place --json` against a library load of the same model, `stat PID` of a
//! child holding a shared store against an independent parse of its numa_maps, and bad
//! input: a named error, a non-zero status, no panic.
#![cfg(feature = "cli")]

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};

use numapin::NodeSet;
use numapin::planner::{self, Machine, ModelSizes, PlanOptions};
use numapin::store::{Layout, PinStore, StoreOptions};
use numapin_testkit::synthetic::SyntheticModel;
use serde_json::Value;

/// The binary: `NUMAPIN_BIN` where the test runs away from the build (the VM's
/// initramfs has it at /x/numapin), else the one cargo built for this test.
fn binary() -> std::ffi::OsString {
    std::env::var_os("NUMAPIN_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_numapin").into())
}

fn numapin(args: &[&str]) -> Output {
    Command::new(binary()).args(args).output().unwrap()
}

/// The standard output of a run that must succeed, as JSON.
fn json_of(args: &[&str]) -> Value {
    let out = numapin(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "numapin {args:?}: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A temp dir removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("numapin-cli-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `/proc/self/status`'s `Mems_allowed_list`, read here.
fn mems_allowed_list() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Mems_allowed_list:"))
        .unwrap();
    line.trim().to_owned()
}

#[test]
fn probe_json_says_what_proc_says() {
    let json = json_of(&["probe", "--json"]);
    assert_eq!(json["schema"], 1);
    let support = &json["support"];
    for field in [
        "mempolicy",
        "page_calls",
        "possible_nodes",
        "nodes_with_memory",
        "mems_allowed",
        "distances",
        "free_bytes",
        "thp",
        "max_map_count",
        "map_count",
        "cap_sys_nice",
        "anon_vma_names",
    ] {
        assert!(
            !support[field].is_null(),
            "probe --json lacks {field}: {json}"
        );
    }
    let max_map_count = std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap();
    assert_eq!(
        support["max_map_count"].as_u64(),
        max_map_count.trim().parse::<u64>().ok()
    );
    let mems: NodeSet = NodeSet::parse(&mems_allowed_list()).unwrap();
    assert_eq!(support["mems_allowed"], mems.to_string());
    assert!(json["verdict"].as_str().is_some_and(|v| !v.is_empty()));
}

/// A safetensors file: MoE layers 0 and 3, 8 experts of gate/up/down (3 × 2048 bytes)
/// with a 256-byte scale each, and a 4096-byte embedding.
fn checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    common::moe_safetensors(dir, 4096, &[0, 3], 8, (2048, 256))
}

#[test]
fn plan_is_the_planners_table_for_the_header_and_topology() {
    let dir = TempDir::new("plan");
    let path = checkpoint(&dir.0);
    // Compiled in and written here: the VM runs the test without the source tree.
    let topology_path = dir.0.join("nps4_2socket.json");
    let described = include_str!("../docs/planner/nps4_2socket.json");
    std::fs::write(&topology_path, described).unwrap();
    let topology = topology_path.to_str().unwrap();
    let model = path.to_str().unwrap();
    let json = json_of(&["plan", model, "--topology", topology, "--json"]);

    let checkpoint = numapin::model::Checkpoint::open(&path).unwrap();
    let sizes = ModelSizes::from_checkpoint(&checkpoint).unwrap();
    let machine = Machine::from_file(std::path::Path::new(topology)).unwrap();
    let table = planner::plan(&sizes, &machine, None, &PlanOptions::default()).unwrap();
    assert_eq!(json, table.to_json());
    assert_eq!(sizes.shape(), vec![(0, 8), (3, 8)]);

    // `place --model --plan-only`, the example's form, prints the same table.
    let place = json_of(&[
        "place",
        "--model",
        model,
        "--plan-only",
        "--topology",
        topology,
        "--json",
    ]);
    assert_eq!(place, json);

    // The text form names the checkpoint's layers and experts.
    let out = numapin(&["plan", model, "--topology", topology]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("2 MoE layers, 16 experts"), "{text}");
}

#[test]
fn place_json_is_the_librarys_load_of_the_same_model() {
    let model = SyntheticModel {
        layers: 3,
        experts: 5,
        weight_bytes: 3 * 4096 + 100,
        scale_bytes: 4096,
    };
    let dir = TempDir::new("place");
    let path = dir.0.join("model.bin");
    model.write(&path).unwrap();
    let json = json_of(&[
        "place",
        "--layers",
        "3",
        "--experts",
        "5",
        "--weight-bytes",
        &model.weight_bytes.to_string(),
        "--scale-bytes",
        "4096",
        "--file",
        path.to_str().unwrap(),
        "--no-huge-pages",
        "--no-purge",
        "--json",
    ]);
    // The library's load of the same file, same layout and options.
    let file = std::fs::File::open(&path).unwrap();
    let nodes = NodeSet::allowed().unwrap();
    let store = PinStore::new(
        Layout::Interleave(nodes),
        StoreOptions::default().huge_pages(false),
    )
    .unwrap();
    for layer in 0..model.layers {
        store
            .pack_layer(layer, &model.spec(), &model.sources(&file, layer))
            .unwrap();
    }
    let stats = store.stats().unwrap();
    assert_eq!(json["schema"], 2);
    assert_eq!(json["verified"], true);
    assert_eq!(json["layers"].as_u64(), Some(stats.layers as u64));
    assert_eq!(json["experts_total"].as_u64(), Some(15));
    assert_eq!(json["experts_per_layer"].as_u64(), Some(5));
    assert_eq!(json["bytes"].as_u64(), Some(stats.bytes));
    assert_eq!(
        stats.bytes,
        (model.layers * model.experts * (model.weight_bytes + model.scale_bytes)) as u64
    );
    assert_eq!(json["mbind_calls"].as_u64(), Some(stats.mbind_calls as u64));
    // Mappings are counted in /proc/self/maps, where a region may merge with its
    // neighbour in one process and not in the other: at most one per region, both ways.
    let regions = (2 * model.layers) as u64;
    for vmas in [json["vmas"].as_u64().unwrap(), stats.vmas as u64] {
        assert!(
            (1..=regions).contains(&vmas),
            "{vmas} mappings for {regions} regions"
        );
    }
    assert_eq!(json["nodes"], nodes.to_string());
    assert_eq!(json["layout"], "interleave");
    // Every byte placed is in some node's pages, as in the library's load.
    let pages: u64 = stats.pages_per_node.values().sum();
    let json_pages: u64 = json["pages_per_node"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(json_pages, pages);
}

#[test]
fn place_baseline_names_the_example_that_has_it() {
    let out = numapin(&[
        "place",
        "--layers",
        "1",
        "--experts",
        "1",
        "--baseline",
        "--json",
    ]);
    // The store's load runs and is reported; the baseline's place says where it lives.
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let error = json["baseline"]["error"].as_str().unwrap();
    assert!(error.contains("--example pin_model"), "{error}");
}

/// Pages per node of every mapping of `pid`, read straight from `/proc/PID/numa_maps`
/// here: start address → (node → pages (the `N<node>=<pages>` words), page bytes).
fn numa_maps_pages(pid: u32) -> BTreeMap<u64, (BTreeMap<u64, u64>, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/numa_maps")).unwrap();
    text.lines()
        .map(|line| {
            let start = u64::from_str_radix(line.split(' ').next().unwrap(), 16).unwrap();
            let number = |w: &str, key: &str| w.strip_prefix(key)?.parse::<u64>().ok();
            let page_kib = line
                .split(' ')
                .find_map(|w| number(w, "kernelpagesize_kB="))
                // A mapping with no page present prints no page size.
                .unwrap_or(numapin::page_size() as u64 / 1024);
            let pages = line
                .split(' ')
                .filter_map(|w| {
                    let (key, value) = w.split_once('=')?;
                    let node = key.strip_prefix('N')?.parse::<u64>().ok()?;
                    Some((node, value.parse::<u64>().ok()?))
                })
                .collect();
            (start, (pages, page_kib * 1024))
        })
        .collect()
}

/// The child of [`stat_reads_a_process_holding_a_shared_store`]: packs a shared (memfd)
/// store, says `ready`, and holds it until its stdin closes.
#[test]
fn child_holding_a_shared_store() {
    if std::env::var_os("NUMAPIN_CLI_STAT_CHILD").is_none() {
        return;
    }
    let model = SyntheticModel {
        layers: 2,
        experts: 3,
        weight_bytes: 2 * 4096,
        scale_bytes: 4096,
    };
    let dir = TempDir::new("stat-child");
    let path = dir.0.join("model.bin");
    model.write(&path).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let options = StoreOptions::default().shared(true).huge_pages(false);
    let store = PinStore::new(Layout::Interleave(NodeSet::allowed().unwrap()), options).unwrap();
    for layer in 0..model.layers {
        store
            .pack_layer(layer, &model.spec(), &model.sources(&file, layer))
            .unwrap();
    }
    println!("ready");
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).unwrap() > 0 {}
    drop(store);
}

#[test]
fn stat_reads_a_process_holding_a_shared_store() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_holding_a_shared_store", "--nocapture"])
        .env("NUMAPIN_CLI_STAT_CHILD", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.trim() == "ready")),
        "the child never held its store"
    );
    // numapin's read between two of the test's own that agree: the child's other
    // mappings (its harness threads' arenas and stacks) can fault a page in between
    // reads (a container run: 4 -> 5 pages), so a total compared across a change would
    // compare two moments.
    let (json, independent) = (0..50)
        .find_map(|_| {
            let before = numa_maps_pages(pid);
            let json = json_of(&["stat", &pid.to_string(), "--all", "--json"]);
            (numa_maps_pages(pid) == before).then_some((json, before))
        })
        .expect("the child's numa_maps changed across each of 50 reads");
    let text = numapin(&["stat", &pid.to_string()]);
    drop(child.stdin.take());
    child.wait().unwrap();

    // The table names the store's memfds, and says when the kernel cannot name its
    // anonymous regions.
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("/memfd:numapin-layer1-scales"), "{text}");
    assert_eq!(
        text.contains("does not name anonymous mappings"),
        !numapin::anon_vma_names_supported(),
        "{text}"
    );
    assert_eq!(json["pid"].as_u64(), Some(u64::from(pid)));
    assert_eq!(
        json["anonymous_names"].as_bool(),
        Some(numapin::anon_vma_names_supported())
    );
    let mappings = json["mappings"].as_array().unwrap();
    // Every mapping listed is one numa_maps lists, with the pages numa_maps gives it,
    // node by node.
    for m in mappings {
        let start =
            u64::from_str_radix(m["start"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
        let pages: BTreeMap<u64, u64> = m["pages"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(n, p)| (n.parse().unwrap(), p.as_u64().unwrap()))
            .collect();
        let theirs = independent.get(&start).map(|i| &i.0);
        assert!(theirs.is_some(), "mapping {m}: not in numa_maps");
        assert_eq!(Some(&pages), theirs, "mapping {m}");
    }
    // The store's four memfds (2 layers × weights, scales) are named numapin's, each
    // holding its layer's bytes.
    let ours: Vec<&Value> = mappings.iter().filter(|m| m["numapin"] == true).collect();
    let names: Vec<&str> = ours.iter().map(|m| m["name"].as_str().unwrap()).collect();
    for layer in 0..2 {
        for kind in ["weights", "scales"] {
            let want = format!("/memfd:numapin-layer{layer}-{kind}");
            assert!(
                names.iter().any(|n| n.starts_with(&want)),
                "{want} in {names:?}"
            );
        }
    }
    assert_eq!(json["numapin_mappings"].as_u64(), Some(ours.len() as u64));
    let page = numapin::page_size() as u64;
    let held: u64 = ours
        .iter()
        .flat_map(|m| m["pages"].as_object().unwrap().values())
        .map(|p| p.as_u64().unwrap() * page)
        .sum();
    assert_eq!(held, 2 * 3 * (2 * 4096 + 4096));
    let numapin_bytes: u64 = json["numapin_bytes"]
        .as_object()
        .unwrap()
        .values()
        .map(|b| b.as_u64().unwrap())
        .sum();
    assert_eq!(numapin_bytes, held);
    // The process's totals per node are numa_maps' pages × their size, summed.
    let mut total: BTreeMap<String, u64> = BTreeMap::new();
    for (pages, page_bytes) in independent.values() {
        for (node, p) in pages {
            *total.entry(node.to_string()).or_insert(0) += p * page_bytes;
        }
    }
    let json_total: BTreeMap<String, u64> = json["total_bytes"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, b)| (n.clone(), b.as_u64().unwrap()))
        .collect();
    assert_eq!(json_total, total);
}

/// A process id no process has now: counting down from the kernel's pid_max.
fn free_pid() -> u32 {
    let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (1..max)
        .rev()
        .find(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
        .unwrap()
}

#[test]
fn stat_of_bad_pids_is_a_named_error() {
    let missing = free_pid().to_string();
    let u64_max = u64::MAX.to_string();
    let cases: [(&str, i32, &str); 5] = [
        (&missing, 1, "no process"),
        ("abc", 2, "a process id is decimal digits"),
        ("-1", 2, ""),
        (&u64_max, 2, "larger than any process id"),
        ("0", 2, "0 is not a process id"),
    ];
    for (pid, status, says) in cases {
        let out = numapin(&["stat", pid]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(status), "stat {pid}: {stderr}");
        assert!(stderr.contains(says), "stat {pid}: {stderr}");
        assert!(!stderr.contains("panicked"), "stat {pid}: {stderr}");
        assert!(out.stdout.is_empty(), "stat {pid}");
    }
    // No subcommand: usage, status 2.
    let out = numapin(&[]);
    assert_eq!(out.status.code(), Some(2));
    // place's own checks name `numapin place`, not the example.
    let out = numapin(&["place", "--slice", "rows:0/2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--slice needs --model"), "{stderr}");
    assert!(stderr.contains("Usage: numapin place"), "{stderr}");
}

/// `place --plan default --read direct` with `NUMAPIN_IO_URING=off`: each class's JSON
/// says its direct reads went out as blocking calls, none through a ring, and the most a
/// loader had in flight at once (1 to `POOL_DEPTH`); the text prints the same figure.
#[test]
fn place_says_how_many_blocking_reads_were_in_flight() {
    let dir = TempDir::new("blocking-depth");
    let path = checkpoint(&dir.0);
    let run = |json: bool| {
        let mut cmd = Command::new(binary());
        cmd.args(["place", "--model"]).arg(&path);
        cmd.args(["--plan", "default", "--read", "direct", "--no-progress"]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.env("NUMAPIN_IO_URING", "off").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        String::from_utf8(out.stdout).unwrap()
    };
    let json: Value = serde_json::from_str(&run(true)).unwrap();
    let classes = json["classes"].as_array().unwrap();
    let direct: Vec<&Value> = classes
        .iter()
        .filter(|c| {
            c["in_place_bytes"].as_u64().unwrap() + c["bounced_bytes"].as_u64().unwrap() > 0
        })
        .collect();
    if direct.is_empty() {
        println!(
            "NOT RUN: no direct reads here (the temp dir's file system has no direct I/O): {json}"
        );
        return;
    }
    for c in classes {
        assert_eq!(c["uring_reads"], 0, "{c}");
    }
    let max = numapin::store::POOL_DEPTH as u64;
    for c in &direct {
        assert!(c["blocking_reads"].as_u64().unwrap() > 0, "{c}");
        let depth = c["blocking_depth"].as_u64().unwrap();
        assert!((1..=max).contains(&depth), "{c}");
    }
    let text = run(false);
    let depths: Vec<u64> = text
        .split("blocking (up to ")
        .skip(1)
        .map(|rest| rest.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(!depths.is_empty(), "{text}");
    assert!(depths.iter().all(|d| (1..=max).contains(d)), "{text}");
}
