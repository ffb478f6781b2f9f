//! A whole placement served by name: a parent places it shared and serves it
//! (`PlacedModel::serve`); child processes (this binary re-run in a child mode) attach
//! by name (`PlacedModel::attach_served`, `Checkpoint::place_or_attach`) and compare
//! every tensor's bytes with numpy's (`tensors.json`, not numapin's views); a child with
//! another checkpoint is refused by name with nothing mapped; readers keep reading after
//! the server is SIGKILLed.
#![cfg(feature = "model")]

#[path = "common/mod.rs"]
mod common;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use common::{fixtures, open_fixture};
use numapin::model::{Checkpoint, PlacedModel};
use numapin::serve::{Access, Limits};
use numapin::store::StoreOptions;
use numapin::{Error, ServeFault};

const FIXTURE: &str = "st-sharded";
const OTHER: &str = "gguf-single";

/// Tests that map memfds in this process, or count its memfd mappings, run one at a time.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ALONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn limits() -> Limits {
    Limits::default().timeout(Duration::from_secs(30))
}

fn options() -> StoreOptions {
    StoreOptions::default().loader_threads(2).shared(true)
}

fn unique(tag: &str) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "ms{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn var(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key}: set by the parent test"))
}

/// This binary as the child mode `child`, with `env`; stdin and stdout piped.
fn spawn(child: &str, env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--ignored",
        "--exact",
        child,
        "--nocapture",
        "--test-threads=1",
    ])
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// The child's stdout up to the line holding `tag`, from the tag on.
fn wait_line(out: &mut BufReader<ChildStdout>, tag: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).unwrap();
        assert!(n > 0, "the child ended before printing {tag}");
        if let Some(at) = line.find(tag) {
            return line[at..].trim_end().to_string();
        }
    }
}

/// Mappings of numapin's memfds in this process.
fn memfd_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:numapin"))
        .count()
}

/// Every tensor of the fixture at `root` read through `model` (a dense tensor whole, an
/// expert piece as its tensor's per-expert chunk) equal to numpy's bytes; every numpy
/// tensor covered. Returns (tensors, expert pieces) checked.
fn check_against_numpy(model: &PlacedModel, root: &Path) -> (usize, usize) {
    let numpy: HashMap<String, (Vec<u64>, Vec<u8>)> = common::numpy_tensors(root)
        .into_iter()
        .map(|(n, s, b)| (n, (s, b)))
        .collect();
    let mut covered = HashSet::new();
    let mut tensors = 0;
    for (name, (_, whole)) in &numpy {
        let view = match model.tensor(name) {
            Ok(v) => v,
            Err(Error::NotHeld { .. } | Error::InvalidArgument { .. }) => continue,
            Err(e) => panic!("{name}: {e}"),
        };
        let Some(bytes) = view.bytes() else { continue };
        assert!(
            view.slice().is_none(),
            "{name}: sliced in a whole placement"
        );
        assert!(bytes == &whole[..], "{name}: the attached bytes differ");
        covered.insert(name.clone());
        tensors += 1;
    }
    let mut pieces = 0;
    for layer in 0..4096 {
        let Ok(ids) = model.expert_ids(layer) else {
            continue;
        };
        for e in ids {
            for p in model.expert(layer, e).unwrap() {
                let (shape, whole) = &numpy[p.tensor];
                let chunk = whole.len() / shape[0].max(1) as usize;
                let want = if p.bytes.len() == whole.len() {
                    &whole[..]
                } else {
                    &whole[e * chunk..(e + 1) * chunk]
                };
                assert!(p.bytes == want, "layer {layer} expert {e} {}", p.role);
                covered.insert(p.tensor.to_owned());
                pieces += 1;
            }
        }
    }
    let missing: Vec<_> = numpy.keys().filter(|n| !covered.contains(*n)).collect();
    assert!(missing.is_empty(), "tensors never read: {missing:?}");
    (tensors, pieces)
}

fn placed(dir: &Path) -> (Checkpoint, PlacedModel) {
    let checkpoint = open_fixture(dir, FIXTURE);
    let plan = checkpoint.default_plan(common::nodes()).unwrap();
    let model = checkpoint.place(&plan, options()).unwrap();
    (checkpoint, model)
}

/// A parent serves; three children attach by name, one joins with
/// `place_or_attach` (and must attach, not place): every byte equal to numpy's.
#[test]
fn four_processes_attach_by_name_equal_to_numpy() {
    let Some(dir) = fixtures("four_processes_attach_by_name_equal_to_numpy") else {
        return;
    };
    let _alone = alone();
    let (_, mut model) = placed(&dir);
    let name = unique("four");
    let server = model.serve(&name, Access::same_uid()).unwrap();
    let root = dir.join(FIXTURE);
    let root = root.to_str().unwrap();
    let mut children: Vec<_> = (0..3)
        .map(|_| spawn("child_attach", &[("MS_NAME", &name), ("MS_ROOT", root)]))
        .collect();
    children.push(spawn(
        "child_join",
        &[
            ("MS_NAME", &name),
            ("MS_ROOT", root),
            ("MS_DIR", dir.to_str().unwrap()),
        ],
    ));
    let mut checked = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}");
        let line = text
            .lines()
            .find_map(|l| l.find("CHECKED").map(|at| l[at..].to_owned()))
            .unwrap_or_else(|| panic!("the child did not check: {text}"));
        checked.push(line);
    }
    // Every child read the same tensors and pieces, and the exporter reads them too.
    let (t, p) = check_against_numpy(&model, Path::new(root));
    for line in &checked {
        assert_eq!(
            line,
            &format!("CHECKED {t} tensors {p} pieces"),
            "{checked:?}"
        );
    }
    assert!(t + p > 0);
    eprintln!("each of 4 children: {}", checked[0]);
    let stats = server.stats();
    assert_eq!(stats.refused, 0);
}

/// Attaches by name and checks every byte against numpy's; with `MS_HOLD`, checks again
/// after the parent writes a line.
#[test]
#[ignore = "a child process of the model_served tests"]
fn child_attach() {
    let model = PlacedModel::attach_served(&var("MS_NAME"), &limits()).unwrap();
    let root = PathBuf::from(var("MS_ROOT"));
    let (t, p) = check_against_numpy(&model, &root);
    println!("CHECKED {t} tensors {p} pieces");
    if std::env::var_os("MS_HOLD").is_none() {
        return;
    }
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let (t, p) = check_against_numpy(&model, &root);
    println!("RECHECKED {t} tensors {p} pieces");
}

/// Joins by `place_or_attach` with the same checkpoint: it must attach (the parent
/// serves), not place.
#[test]
#[ignore = "a child process of the model_served tests"]
fn child_join() {
    let dir = PathBuf::from(var("MS_DIR"));
    let checkpoint = open_fixture(&dir, FIXTURE);
    let plan = checkpoint.default_plan(common::nodes()).unwrap();
    let (model, server) = checkpoint
        .place_or_attach(
            &var("MS_NAME"),
            &plan,
            options(),
            Access::same_uid(),
            &limits(),
        )
        .unwrap();
    assert!(server.is_none(), "placed although the name was served");
    let (t, p) = check_against_numpy(&model, &PathBuf::from(var("MS_ROOT")));
    println!("CHECKED {t} tensors {p} pieces");
}

/// `place_or_attach` on a free name places and serves; a child that joins with another
/// checkpoint is refused by name, nothing mapped.
#[test]
fn another_checkpoint_is_refused_by_name() {
    let Some(dir) = fixtures("another_checkpoint_is_refused_by_name") else {
        return;
    };
    let _alone = alone();
    // The first to join an unserved name places and serves.
    let name = unique("other");
    let checkpoint = open_fixture(&dir, FIXTURE);
    let plan = checkpoint.default_plan(common::nodes()).unwrap();
    let (model, server) = checkpoint
        .place_or_attach(&name, &plan, options(), Access::same_uid(), &limits())
        .unwrap();
    let server = server.expect("the name was free: this process places");
    assert_eq!(model.len(), checkpoint.tensors().len());
    let out = spawn(
        "child_other",
        &[("MS_NAME", &name), ("MS_DIR", dir.to_str().unwrap())],
    )
    .wait_with_output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("REFUSED"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("Checkpoint::place_or_attach"), "{line}");
    assert!(line.contains(&name), "{line}");
    assert!(line.contains("another model"), "{line}");
    // The server counts a peer after its last write, which the child may have read.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while server.stats().served < 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(server.stats().served, 1);
}

#[test]
#[ignore = "a child process of the model_served tests"]
fn child_other() {
    let dir = PathBuf::from(var("MS_DIR"));
    let checkpoint = open_fixture(&dir, OTHER);
    let plan = checkpoint.default_plan(common::nodes()).unwrap();
    let before = memfd_mappings();
    let e = checkpoint
        .place_or_attach(
            &var("MS_NAME"),
            &plan,
            options(),
            Access::same_uid(),
            &limits(),
        )
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert_eq!(memfd_mappings(), before, "mapped after a refusal: {e}");
    println!("REFUSED {e}");
}

/// Places and serves until killed.
#[test]
#[ignore = "a child process of the model_served tests"]
fn child_server() {
    let dir = PathBuf::from(var("MS_DIR"));
    let (_, mut model) = placed(&dir);
    let _server = model.serve(&var("MS_NAME"), Access::same_uid()).unwrap();
    println!("SERVING");
    std::thread::sleep(Duration::from_secs(120));
}

/// The server is SIGKILLed once the readers attached: they keep reading every byte; the
/// name is no longer served.
#[test]
fn readers_keep_reading_after_the_server_is_killed() {
    let Some(dir) = fixtures("readers_keep_reading_after_the_server_is_killed") else {
        return;
    };
    let name = unique("killed");
    let d = dir.to_str().unwrap();
    let mut server = spawn("child_server", &[("MS_NAME", &name), ("MS_DIR", d)]);
    wait_line(
        &mut BufReader::new(server.stdout.take().unwrap()),
        "SERVING",
    );
    let root = dir.join(FIXTURE);
    let env = [
        ("MS_NAME", name.as_str()),
        ("MS_ROOT", root.to_str().unwrap()),
        ("MS_HOLD", "1"),
    ];
    let mut readers: Vec<_> = (0..2).map(|_| spawn("child_attach", &env)).collect();
    let mut outs: Vec<_> = readers
        .iter_mut()
        .map(|r| BufReader::new(r.stdout.take().unwrap()))
        .collect();
    let first: Vec<_> = outs.iter_mut().map(|o| wait_line(o, "CHECKED")).collect();
    server.kill().unwrap();
    server.wait().unwrap();
    // The name went with its server.
    let e = PlacedModel::attach_served(&name, &limits()).unwrap_err();
    assert_eq!(e.serve_fault(), Some(ServeFault::NotServed), "{e}");
    for (r, (out, before)) in readers.iter_mut().zip(outs.iter_mut().zip(&first)) {
        writeln!(r.stdin.as_mut().unwrap()).unwrap();
        let again = wait_line(out, "RECHECKED");
        assert_eq!(again, format!("RE{before}"));
        assert!(r.wait().unwrap().success());
    }
}

/// A parcel with another file count than its manifest, or a store's parcel served under
/// the name: refused by name, nothing mapped.
#[test]
fn a_wrong_parcel_is_refused_by_name_with_nothing_mapped() {
    let Some(dir) = fixtures("a_wrong_parcel_is_refused_by_name_with_nothing_mapped") else {
        return;
    };
    let _alone = alone();
    let (_, mut model) = placed(&dir);
    let export = model.export().unwrap();
    let before = memfd_mappings();
    let mut files: Vec<_> = export
        .files
        .iter()
        .map(|f| f.try_clone().unwrap())
        .collect();
    files.pop();
    let parcel = numapin::serve::Parcel {
        manifest: export.manifest.to_bytes(),
        files,
    };
    let e = PlacedModel::attach_parcel(parcel).unwrap_err().to_string();
    assert!(e.contains("files in the served parcel"), "{e}");
    assert_eq!(memfd_mappings(), before, "{e}");
    // The same parcel served by name: the typed kind kept, the name added.
    let mut files: Vec<_> = export
        .files
        .iter()
        .map(|f| f.try_clone().unwrap())
        .collect();
    files.pop();
    let parcel = numapin::serve::Parcel {
        manifest: export.manifest.to_bytes(),
        files,
    };
    let name = unique("short");
    let server = numapin::serve::Server::bind(&name, parcel, Access::same_uid()).unwrap();
    let e = PlacedModel::attach_served(&name, &limits()).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::InvalidArgument {
                op: "PlacedModel::attach_served",
                reason: numapin::Invalid::Mismatch { expected, found, .. },
            } if *expected == *found + 1
        ),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(text.contains(&name), "{text}");
    assert!(text.contains("files in the served parcel"), "{text}");
    assert_eq!(memfd_mappings(), before, "{text}");
    drop(server);
    // A store's parcel under the name: not a model manifest, named with the name.
    let mut store = numapin::store::PinStore::new(
        numapin::store::Layout::Unplaced,
        StoreOptions::default().shared(true),
    )
    .unwrap();
    let (w, s) = (vec![7u8; 4096], vec![1u8; 64]);
    let spec = numapin::store::LayerSpec {
        experts: 1,
        weight_bytes: 4096,
        scale_bytes: 64,
    };
    store
        .pack_layer(
            0,
            &spec,
            &[numapin::store::ExpertSource::Memory {
                weights: &w,
                scales: &s,
            }],
        )
        .unwrap();
    let name = unique("store");
    let _server = store.serve(&name, Access::same_uid()).unwrap();
    let before = memfd_mappings();
    let e = PlacedModel::attach_served(&name, &limits())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a numapin model manifest"), "{e}");
    assert!(e.contains(&name), "{e}");
    assert_eq!(memfd_mappings(), before, "{e}");
}

/// Open fds of this process.
fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Waits (at most 30 s) for this process's fd count to be `want` again: the server
/// closes a dead peer's socket once its send fails. The count it ends with.
fn fds_back_to(want: usize) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let n = fd_count();
        if n == want || std::time::Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Readers SIGKILLed while attaching the whole model over and over leak nothing in the
/// server (its `/proc/self/fd` count is back to what it was), and the server still
/// serves a new reader every byte of which equals numpy's.
#[test]
fn a_reader_killed_mid_attach_leaks_no_fd_in_the_server() {
    let Some(dir) = fixtures("a_reader_killed_mid_attach_leaks_no_fd_in_the_server") else {
        return;
    };
    let root = dir.join(FIXTURE);
    let out = spawn(
        "child_leak_server",
        &[
            ("MS_DIR", dir.to_str().unwrap()),
            ("MS_ROOT", root.to_str().unwrap()),
        ],
    )
    .wait_with_output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("LEAK-CHECKED"), "{text}");
}

/// Alone in its process, so that its fd count is exact: places and serves, has readers
/// that attach in a loop killed at spread-out instants (so that kills land in the
/// connect, the header, the fds, the manifest and the maps), then a reader that checks
/// every byte; the fd count before and after.
#[test]
#[ignore = "a child process of the model_served tests"]
fn child_leak_server() {
    let dir = PathBuf::from(var("MS_DIR"));
    let (_, mut model) = placed(&dir);
    let name = unique("leak");
    let server = model.serve(&name, Access::same_uid()).unwrap();
    let before = fd_count();
    const KILLED: u64 = 8;
    for i in 0..KILLED {
        let mut c = spawn("child_attach_loop", &[("MS_NAME", &name)]);
        let mut out = BufReader::new(c.stdout.take().unwrap());
        wait_line(&mut out, "LOOPING");
        std::thread::sleep(Duration::from_millis(i * 3));
        c.kill().unwrap();
        c.wait().unwrap();
    }
    let after_kills = fds_back_to(before);
    assert_eq!(after_kills, before, "server fds before and after the kills");
    let killed = server.stats();
    // A new reader after the killed ones (the backlog is served in order: every
    // killed peer's connection was handled before this one's).
    let root = var("MS_ROOT");
    let out = spawn("child_attach", &[("MS_NAME", &name), ("MS_ROOT", &root)])
        .wait_with_output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("CHECKED"), "{text}");
    assert_eq!(
        fds_back_to(before),
        before,
        "server fds after the new reader"
    );
    assert!(
        server.stats().served > killed.served,
        "{:?}",
        server.stats()
    );
    eprintln!("{KILLED} readers killed while attaching: server stats then {killed:?}");
    println!("LEAK-CHECKED");
}

/// Attaches by name over and over until killed.
#[test]
#[ignore = "a child process of the model_served tests"]
fn child_attach_loop() {
    let name = var("MS_NAME");
    println!("LOOPING");
    loop {
        drop(PlacedModel::attach_served(&name, &limits()).unwrap());
    }
}

/// A reader knows the placer's expert naming (a preset's name in the manifest); its
/// report stays the placer's alone.
#[test]
fn a_reader_has_the_placers_naming() {
    let Some(dir) = fixtures("a_reader_has_the_placers_naming") else {
        return;
    };
    let _alone = alone();
    let (checkpoint, mut model) = placed(&dir);
    let detected = numapin::model::Naming::detect(&checkpoint).unwrap();
    let detected = detected.name();
    assert_eq!(model.naming().map(|n| n.name()), Some(detected));
    let name = unique("naming");
    let _server = model.serve(&name, Access::same_uid()).unwrap();
    let attached = PlacedModel::attach_served(&name, &limits()).unwrap();
    assert_eq!(attached.naming().map(|n| n.name()), Some(detected));
    assert!(attached.report().is_none());
}
