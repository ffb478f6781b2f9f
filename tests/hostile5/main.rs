//! Hostile inputs for round 5's surface: `StoreOptions::piece_congruence` with direct
//! reads landing in place, drop-behind's bookkeeping, and the layer reports' bounced
//! bytes. Every load is compared with the file's own bytes (read back with std), and
//! every bad option must be a named error, never a panic.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use numapin::Error;
use numapin::store::{
    ExpertSource, Kind, LayerSpec, Layout, PinStore, ReadMode, SlotAlign, StoreOptions,
};
use numapin_testkit::scratch::ScratchDir;

#[cfg(feature = "model")]
#[path = "../common/mod.rs"]
mod common;
mod congruent_loads;
mod direct_reads;
mod drop_behind;
#[cfg(feature = "model")]
mod placed_models;

fn dir(name: &str) -> ScratchDir {
    ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("hostile5-{name}"),
    )
}

/// A small deterministic generator (xorshift64*), so that a failure replays.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

fn write_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let mut f = File::create(path).unwrap();
    f.write_all(&bytes).unwrap();
    f.sync_all().unwrap();
    bytes
}

/// One expert's file pieces: weights, scales (offset, length).
type Pieces = (Vec<(u64, usize)>, Vec<(u64, usize)>);

const MODES: [ReadMode; 3] = [ReadMode::Buffered, ReadMode::Direct, ReadMode::DropBehind];

/// Packs `weights`/`scales` pieces of `file` for `experts` experts and checks every piece's
/// bytes against `bytes` at the slot map's offsets, and the padding zero.
fn pack_and_check(
    options: StoreOptions,
    file: &File,
    bytes: &[u8],
    experts: &[Pieces],
    what: &str,
) -> Result<numapin::store::LayerReport, Error> {
    pack_and_check_in(Layout::Unplaced, options, file, bytes, experts, what)
}

/// [`pack_and_check`] under `layout`.
fn pack_and_check_in(
    layout: Layout,
    options: StoreOptions,
    file: &File,
    bytes: &[u8],
    experts: &[Pieces],
    what: &str,
) -> Result<numapin::store::LayerReport, Error> {
    let store = PinStore::new(layout, options)?;
    let sources: Vec<ExpertSource<'_>> = experts
        .iter()
        .map(|(w, s)| ExpertSource::from_file(file, w, s))
        .collect();
    let spec = LayerSpec::fitting(&sources)?;
    let report = store.pack_layer(0, &spec, &sources)?;
    let map = store.slot_map(0)?;
    for (e, (w, s)) in experts.iter().enumerate() {
        for (kind, pieces) in [(Kind::Weights, w), (Kind::Scales, s)] {
            let slot = match kind {
                Kind::Weights => store.weights(0, e)?,
                Kind::Scales => store.scales(0, e)?,
            };
            let places = map.pieces(e, kind).unwrap_or(&[]);
            assert_eq!(places.len(), pieces.len(), "{what}: expert {e} {kind:?}");
            let mut covered = vec![false; slot.len()];
            for (p, (off, len)) in places.iter().zip(pieces) {
                assert_eq!(p.len, *len, "{what}");
                let want = &bytes[*off as usize..*off as usize + *len];
                let got = &slot[p.offset..p.offset + p.len];
                assert!(
                    want == got,
                    "{what}: expert {e} {kind:?} piece at file {off} len {len} slot {} differs \
                     (first diff at {:?})",
                    p.offset,
                    want.iter().zip(got).position(|(a, b)| a != b)
                );
                covered[p.offset..p.end()]
                    .iter_mut()
                    .for_each(|c| *c = true);
            }
            for (i, c) in covered.iter().enumerate() {
                if !c {
                    assert_eq!(slot[i], 0, "{what}: expert {e} {kind:?} padding byte {i}");
                }
            }
        }
    }
    Ok(report)
}

/// `expert_cache` writing into a pipe already closed (`expert_cache | true`): the program
/// ends with status 141 as `SIGPIPE` would end it, not a panic in `println!`. The example
/// binary is the one `cargo test` builds beside this test's (`target/<profile>/examples`).
#[test]
fn expert_cache_into_a_closed_pipe_ends_with_141() {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples")
        .join("expert_cache");
    // Every example prints through `outln!`: no `print!`/`println!` to stdout anywhere.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    if !examples.is_dir() {
        println!(
            "NOT RUN: expert_cache_into_a_closed_pipe_ends_with_141 reads the examples' sources, not at {} here (the VM)",
            examples.display()
        );
        return;
    }
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            for (i, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                assert!(
                    !code.contains("println!(") || code.contains("eprintln!("),
                    "{}:{}: println! panics on a closed pipe; use support::outln!",
                    path.display(),
                    i + 1
                );
                assert!(
                    !code.contains(" print!(") && !code.starts_with("print!("),
                    "{}:{}: print! to stdout",
                    path.display(),
                    i + 1
                );
            }
        }
    }
    let source = examples.join("expert_cache.rs");
    let fresh = |bin: &Path| {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((modified(bin), modified(&source)), (Some(b), Some(s)) if b >= s)
    };
    if !fresh(&bin) {
        println!(
            "NOT RUN (the run; the source check above ran): {} is missing or older than its \
             source (`cargo test` builds it; `--test hostile5` alone does not)",
            bin.display()
        );
        return;
    }
    let mut child = std::process::Command::new(&bin)
        .args([
            "--ops",
            "1000",
            "--slots",
            "4",
            "--layers",
            "2",
            "--experts",
            "8",
        ])
        .args(["--weight-bytes", "4096"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
