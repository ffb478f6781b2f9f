//! A whole placement exported (`PlacedModel::export`) and attached in another process
//! (`PlacedModel::attach`): for each layout the suite places (the default plan,
//! replicate, split, hybrid, a TP share, an EP share), the test binary re-runs itself as
//! a child (`NUMAPIN_EXPORT_CHILD`) that inherits the sealed memfds (close-on-exec
//! cleared in the child only) and reads the manifest from a file; every tensor's bytes
//! there equal numpy's (`tensors.json`, not numapin's views), writes to the memfds and
//! their mappings are refused (sealed). Bad manifests and files are refused by name with
//! nothing mapped ([`bad`]). In the VM, a reader pinned to each node reads its node's
//! replica and a split or hybrid placement's experts stay on their homes (`move_pages`).
#![cfg(feature = "model")]

mod bad;
mod child;
#[path = "../common/mod.rs"]
mod common;
mod role_major;

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use common::{fixtures, open_fixture};
use numapin::model::{
    Checkpoint, DenseLayout, ExpertShare, ModelExport, PlacedModel, PlacementPlan, Share,
};
use numapin::store::{ExpertAssignment, Home, Layout, StoreOptions};
use numapin::{Node, NodeSet};

/// Set in a child: the directory holding its `manifest`, `fixture` and `sliced` files.
pub const CHILD: &str = "NUMAPIN_EXPORT_CHILD";
/// Set in a child: its inherited fds, comma-separated, in the manifest's order.
pub const FDS: &str = "NUMAPIN_EXPORT_FDS";
/// Set in a VM child: the node it pins itself to, and the layout's name.
pub const NODE: &str = "NUMAPIN_EXPORT_NODE";

/// The tests that count this process's mappings run one at a time.
pub static ALONE: Mutex<()> = Mutex::new(());

const FIXTURES: [&str; 2] = ["st-sharded", "gguf-single"];

pub fn options() -> StoreOptions {
    StoreOptions::default().loader_threads(2).shared(true)
}

/// Each layout the suite places, by name.
pub fn layouts(
    checkpoint: &Checkpoint,
    nodes: NodeSet,
) -> Vec<(&'static str, PlacementPlan, StoreOptions)> {
    let split = PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes));
    let first = nodes.nth(0).unwrap();
    let mut hybrid = ExpertAssignment::new();
    for layer in checkpoint.expert_plan().unwrap().layers() {
        // Expert 0 hot (a copy per node), the others on the nodes in turn.
        let homes = (0..layer.experts().len())
            .map(|e| match e {
                0 => Home::Hot,
                e => Home::Node(nodes.nth(e % nodes.len()).unwrap_or(first)),
            })
            .collect();
        hybrid = hybrid.layer(layer.layer(), homes);
    }
    let half = |k| Share::default().experts(ExpertShare::part(k, 2).unwrap());
    vec![
        (
            "default",
            checkpoint.default_plan(nodes).unwrap(),
            options(),
        ),
        (
            "replicate",
            PlacementPlan::new(Layout::Replicate(nodes), DenseLayout::Replicate(nodes)),
            options(),
        ),
        ("split", split.clone(), options()),
        ("hybrid", split.clone(), options().assignment(Some(hybrid))),
        (
            "tp",
            split.clone().tensor_parallel(1, 2).unwrap().share(half(1)),
            options(),
        ),
        ("ep", split.share(half(0)), options()),
    ]
}

/// Runs the child on `export`: writes the manifest, the fixture's name and the
/// exporter's digests of its sliced expert pieces into a fresh directory, spawns this
/// binary's `child::export_child` with the fds inherited, and returns its stdout.
pub fn run_child(
    dir: &Path,
    fixture: &str,
    model: &PlacedModel,
    export: &ModelExport,
    node: Option<(Node, &str)>,
) -> String {
    let work = tempdir(&format!("{fixture}-{}", std::process::id()));
    std::fs::write(work.join("manifest"), export.manifest.to_bytes()).unwrap();
    std::fs::write(work.join("fixture"), dir.join(fixture).to_str().unwrap()).unwrap();
    std::fs::write(work.join("sliced"), child::sliced_digests(model)).unwrap();
    let fds: Vec<RawFd> = export.files.iter().map(File::as_raw_fd).collect();
    let list = fds
        .iter()
        .map(|f| f.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--exact",
            "child::export_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &work)
        .env(FDS, list);
    if let Some((node, layout)) = node {
        command.env(NODE, format!("{} {layout}", node.0));
    }
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and calls only fcntl,
    // which is async-signal-safe; it allocates nothing (the fds are copied in).
    unsafe {
        command.pre_exec(move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "child for {fixture}: {}\n{stdout}\n{stderr}",
        out.status
    );
    let _ = std::fs::remove_dir_all(&work);
    stdout
}

pub fn tempdir(name: &str) -> PathBuf {
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("model-export-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every layout of every fixture: exported, attached in a child that checks every
/// tensor against numpy's bytes and that nothing can be written.
#[test]
fn every_layout_attaches_in_another_process_equal_to_the_files() {
    let Some(dir) = fixtures("every_layout_attaches_in_another_process_equal_to_the_files") else {
        return;
    };
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let nodes = common::nodes();
    for fixture in FIXTURES {
        let checkpoint = open_fixture(&dir, fixture);
        for (name, plan, options) in layouts(&checkpoint, nodes) {
            let mut model = checkpoint
                .place(&plan, options)
                .unwrap_or_else(|e| panic!("{fixture} {name}: {e}"));
            let export = model.export().unwrap();
            assert_eq!(export.files.len(), export.manifest.file_count());
            // The exporter still reads after freezing.
            assert_eq!(model.len(), checkpoint.tensors().len());
            let out = run_child(&dir, fixture, &model, &export, None);
            let line = out
                .lines()
                .find_map(|l| l.find("CHILD CHECKED").map(|at| &l[at..]))
                .unwrap_or_else(|| panic!("{fixture} {name}: the child did not run: {out}"));
            let counts: Vec<usize> = line
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            // tensors, expert pieces, copies, write attempts refused
            assert!(counts[0] > 0 && counts[3] == 4, "{fixture} {name}: {line}");
            if name == "default" || name == "replicate" {
                let held = checkpoint.tensors().len();
                assert!(
                    counts[0] + counts[1] >= held / 2,
                    "{fixture} {name}: {line}"
                );
            }
            eprintln!("{fixture} {name}: {line}");
        }
    }
}

/// In the VM: a replicated placement exported once; a reader pinned to each node reads
/// that node's copy of every replicated tensor; a split and a hybrid placement's experts
/// lie on their homes (a hot expert on the reader's node) as the reader sees them.
#[test]
fn vm_each_reader_reads_its_nodes_copy_and_experts_stay_home() {
    let test = "vm_each_reader_reads_its_nodes_copy_and_experts_stay_home";
    let Some(nodes) = common::need_nodes(test, 2) else {
        return;
    };
    if common::expect_pages() != common::Expect::Full {
        eprintln!("NOT RUN: {test}: move_pages is not available here");
        return;
    }
    let Some(dir) = fixtures(test) else {
        return;
    };
    let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let fixture = "st-sharded";
    let checkpoint = open_fixture(&dir, fixture);
    for (name, plan, options) in layouts(&checkpoint, nodes) {
        if !matches!(name, "replicate" | "split" | "hybrid") {
            continue;
        }
        let mut model = checkpoint.place(&plan, options).unwrap();
        let export = model.export().unwrap();
        for node in nodes.iter() {
            let out = run_child(&dir, fixture, &model, &export, Some((node, name)));
            let line = out
                .lines()
                .find_map(|l| l.find("CHILD ON NODE").map(|at| &l[at..]))
                .unwrap_or_else(|| panic!("{name} node {}: {out}", node.0));
            // A replicated placement's dense tensors were each checked on the node.
            if name == "replicate" {
                assert!(!line.contains("(0 replicated"), "{line}");
            }
            eprintln!("{name}: {line}");
        }
    }
}
