//! Hostile use of the newest public APIs: checkpoints changed under the library between
//! `open` and `pack`, directories with odd contents, split names at the edge, store
//! alignments at the edge of `usize`, cache and staging sizes at the edge, manifests of
//! garbage. Each must end in a value or an error: never a panic, an abort, a signal or a
//! hang.
//!
//! Every probe runs in a child process (this binary again, selected by
//! `NUMAPIN_HOSTILE2_ROLE`): a signal or an abort fails the probe's test with the child's
//! status instead of killing the whole run.
#![cfg(feature = "model")]

#[path = "../common/mod.rs"]
mod common;
mod edges;

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use numapin::cache::{CacheOptions, ExpertCache, StagingPool};
use numapin::model::Checkpoint;
use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, SlotAlign, StoreOptions};
use numapin::store::{Manifest, Piece, ReadMode};
use numapin::{CheckpointFault, Error, NodeSet};

const ROLE: &str = "NUMAPIN_HOSTILE2_ROLE";

/// Runs `test` again in a child with the role set and asserts it exited successfully.
fn run_child(test: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, test)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child {test} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // `--exact` with a name that is not the test's full path runs nothing and passes:
    // a probe in a submodule must be named `module::test`.
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("test result: ok. 1 passed"),
        "child {test} ran no test:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// True in the child; in the parent, runs the child and returns false.
fn child(test: &str) -> bool {
    if std::env::var(ROLE).is_ok_and(|r| r == test) {
        return true;
    }
    run_child(test);
    false
}

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("hostile2")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn st_file(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

fn expert(l: usize, e: usize, p: &str) -> String {
    format!("model.layers.{l}.mlp.experts.{e}.{p}_proj.weight")
}

/// A Mixtral-style safetensors file: one layer, two experts, gate/up/down F16 [64, 64]
/// (8 KiB each); the data bytes are `i % 251`. Returns the data offset in the file.
fn write_moe(path: &Path) -> u64 {
    let mut header = String::from("{");
    let mut at = 0u64;
    let bytes = 64 * 64 * 2;
    for e in 0..2 {
        for p in ["gate", "up", "down"] {
            if at > 0 {
                header.push(',');
            }
            header.push_str(&format!(
                r#""{}":{{"dtype":"F16","shape":[64,64],"data_offsets":[{at},{}]}}"#,
                expert(0, e, p),
                at + bytes
            ));
            at += bytes;
        }
    }
    header.push('}');
    let data: Vec<u8> = (0..at).map(|i| (i % 251) as u8).collect();
    std::fs::write(path, st_file(header.as_bytes(), &data)).unwrap();
    8 + header.len() as u64
}

fn store(mode: ReadMode) -> PinStore {
    PinStore::new(
        Layout::Unplaced,
        StoreOptions::default().read_mode(mode).loader_threads(2),
    )
    .unwrap()
}

const MODES: [ReadMode; 3] = [ReadMode::Buffered, ReadMode::Direct, ReadMode::DropBehind];

// ---------------------------------------------------------------------------------------
// Checkpoint: the files change after open

/// The shard is truncated (by "another process") between `open` and `pack`: the pack is
/// an error naming the short read, in every read mode; never SIGBUS or a panic.
#[test]
fn checkpoint_truncated_after_open_pack_is_an_error() {
    const NAME: &str = "checkpoint_truncated_after_open_pack_is_an_error";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    let path = dir.join("m.safetensors");
    let data_at = write_moe(&path);
    for mode in MODES {
        write_moe(&path);
        let checkpoint = Checkpoint::open(&path).unwrap();
        // Cut in the middle of expert 1's up projection.
        let cut = data_at + 4 * 8192 + 100;
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let err = checkpoint.pack(&store(mode)).unwrap_err();
        let text = err.to_string();
        // Refused before anything is read, naming the file and both lengths (hostile8).
        assert!(
            matches!(
                err,
                Error::Checkpoint {
                    kind: numapin::CheckpointFault::Truncated,
                    ..
                }
            ),
            "{mode:?}: {err:?}"
        );
        assert!(
            text.contains(&path.display().to_string()) && text.contains(&cut.to_string()),
            "{mode:?}: {text}"
        );
        println!("{mode:?}: {text}");
    }
}

/// The shard grows to zero length after a pack: `verify_in_mode` is an error in every
/// mode, not a panic, and not a report of "all equal".
#[test]
fn checkpoint_truncated_after_pack_verify_is_an_error() {
    const NAME: &str = "checkpoint_truncated_after_pack_verify_is_an_error";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    let path = dir.join("m.safetensors");
    for mode in MODES {
        let data_at = write_moe(&path);
        let checkpoint = Checkpoint::open(&path).unwrap();
        let store = store(mode);
        checkpoint.pack(&store).unwrap();
        let naming = numapin::model::Naming::detect(&checkpoint).unwrap();
        assert!(
            checkpoint
                .verify_in_mode(&store, &naming, mode)
                .unwrap()
                .verified()
        );
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(data_at + 10)
            .unwrap();
        let result = checkpoint.verify_in_mode(&store, &naming, mode);
        assert!(result.is_err(), "{mode:?}: {result:?}");
        println!("{mode:?}: {}", result.unwrap_err());
    }
}

/// The shard's bytes are rewritten after a pack: verify says which slot differs.
#[test]
fn checkpoint_rewritten_after_pack_verify_reports_the_mismatch() {
    const NAME: &str = "checkpoint_rewritten_after_pack_verify_reports_the_mismatch";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    let path = dir.join("m.safetensors");
    let data_at = write_moe(&path);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let store = store(ReadMode::Buffered);
    checkpoint.pack(&store).unwrap();
    let f = File::options().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xff], data_at + 3 * 8192 + 7).unwrap();
    drop(f);
    let report = checkpoint.verify(&store).unwrap();
    assert!(!report.verified(), "{report:?}");
    println!("{report:?}");
}

// ---------------------------------------------------------------------------------------
// Checkpoint: directories with odd contents

fn checkpoint_err(result: numapin::Result<Checkpoint>) -> Error {
    match result {
        Ok(c) => panic!("expected an error, got a checkpoint of {:?}", c.files()),
        Err(e) => e,
    }
}

/// A directory named `x.safetensors` inside the checkpoint directory, and opened directly.
#[test]
fn checkpoint_directory_named_safetensors() {
    const NAME: &str = "checkpoint_directory_named_safetensors";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    std::fs::create_dir(dir.join("x.safetensors")).unwrap();
    let err = checkpoint_err(Checkpoint::open(&dir));
    println!("dir: {err}");
    // Opened by name: a directory with a .safetensors name is itself opened as a
    // directory of shards: it holds none.
    let err = checkpoint_err(Checkpoint::open(dir.join("x.safetensors")));
    assert!(
        matches!(
            err,
            Error::Checkpoint {
                kind: CheckpointFault::Missing,
                ..
            }
        ),
        "{err:?}"
    );
    // Beside a real shard: the directory is not taken for a shard silently.
    write_moe(&dir.join("m.safetensors"));
    let err = checkpoint_err(Checkpoint::open(&dir));
    println!("dir + shard: {err}");
}

/// A symlink loop named like a shard, a dangling symlink, a FIFO named like a shard (a
/// FIFO open would block forever).
#[test]
fn checkpoint_symlink_loop_dangling_link_and_fifo() {
    const NAME: &str = "checkpoint_symlink_loop_dangling_link_and_fifo";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    std::os::unix::fs::symlink("a.safetensors", dir.join("a.safetensors")).unwrap();
    let err = checkpoint_err(Checkpoint::open(&dir));
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    println!("loop: {err}");
    let err = checkpoint_err(Checkpoint::open(dir.join("a.safetensors")));
    println!("loop by name: {err}");

    let dir = scratch("checkpoint_dangling");
    std::os::unix::fs::symlink("nowhere.bin", dir.join("a.safetensors")).unwrap();
    let err = checkpoint_err(Checkpoint::open(&dir));
    println!("dangling: {err}");

    let dir = scratch("checkpoint_fifo");
    let fifo = dir.join("a.safetensors");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    // A watchdog: if open blocks on the FIFO, the child exits with a distinct status.
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(20));
        let _ = writeln!(
            std::io::stderr(),
            "HANG: Checkpoint::open blocked on a FIFO"
        );
        std::process::exit(3);
    });
    for err in [
        checkpoint_err(Checkpoint::open(&dir)),
        checkpoint_err(Checkpoint::open(&fifo)),
    ] {
        println!("fifo: {err}");
        assert!(
            matches!(
                &err,
                Error::Checkpoint {
                    kind: CheckpointFault::Header,
                    reason,
                    ..
                } if reason.contains("a FIFO")
            ),
            "{err:?}"
        );
    }
}

/// An index naming shards outside its directory, or one shard for every tensor (listed
/// many times).
#[test]
fn checkpoint_index_escaping_paths_and_repeated_shard() {
    const NAME: &str = "checkpoint_index_escaping_paths_and_repeated_shard";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    let index = dir.join("model.safetensors.index.json");
    for shard in [
        "../../etc/passwd",
        "/etc/passwd",
        "..",
        ".",
        "",
        "a/../m.safetensors",
    ] {
        std::fs::write(
            &index,
            format!(r#"{{"metadata":{{}},"weight_map":{{"t":{shard:?}}}}}"#),
        )
        .unwrap();
        let err = checkpoint_err(Checkpoint::open(&dir));
        assert!(
            matches!(
                err,
                Error::Checkpoint {
                    kind: CheckpointFault::Header,
                    ..
                }
            ),
            "{shard:?}: {err:?}"
        );
    }
    write_moe(&dir.join("m.safetensors"));
    let map: Vec<String> = (0..2)
        .flat_map(|e| {
            ["gate", "up", "down"].map(|p| format!("{:?}:\"m.safetensors\"", expert(0, e, p)))
        })
        .collect();
    std::fs::write(&index, format!(r#"{{"weight_map":{{{}}}}}"#, map.join(","))).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    assert_eq!(checkpoint.files().len(), 1);
    assert_eq!(checkpoint.tensors().len(), 6);
}

// ---------------------------------------------------------------------------------------
// GGUF split names at the edge

fn gstr(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

/// A GGUF v3 header with no tensors and `split.no`/`split.count` (u16) when given.
fn gguf(split: Option<(u16, u16)>) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    let kv: Vec<(&str, u16)> = match split {
        Some((no, count)) => vec![("split.no", no), ("split.count", count)],
        None => Vec::new(),
    };
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        out.extend_from_slice(&gstr(k));
        out.extend_from_slice(&2u32.to_le_bytes()); // UINT16
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

#[test]
fn gguf_split_huge_part_counts() {
    const NAME: &str = "gguf_split_huge_part_counts";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    // Named part 1 of 99999 without split keys.
    let p = dir.join("m-00001-of-99999.gguf");
    std::fs::write(&p, gguf(None)).unwrap();
    let err = checkpoint_err(Checkpoint::open(&p));
    assert!(
        matches!(
            err,
            Error::Checkpoint {
                kind: CheckpointFault::Split,
                ..
            }
        ),
        "{err:?}"
    );
    // Keys say 1 of 65535, the name says 1 of 99999.
    std::fs::write(&p, gguf(Some((0, u16::MAX)))).unwrap();
    let err = checkpoint_err(Checkpoint::open(&p));
    println!("65535 vs 99999: {err}");
    // Name and keys agree on 65535 parts; only the first exists: missing part 2, fast.
    let p = dir.join("m-00001-of-65535.gguf");
    std::fs::write(&p, gguf(Some((0, u16::MAX)))).unwrap();
    let err = checkpoint_err(Checkpoint::open(&p));
    assert!(
        matches!(
            err,
            Error::Checkpoint {
                kind: CheckpointFault::Missing,
                ..
            }
        ),
        "{err:?}"
    );
    // Count 0 and part 00000.
    let p = dir.join("m-00000-of-00000.gguf");
    std::fs::write(&p, gguf(Some((0, 0)))).unwrap();
    let err = checkpoint_err(Checkpoint::open(&p));
    println!("0 of 0: {err}");
    // Every part present, each claiming to be part 1 (no 0).
    for i in 1..=3 {
        std::fs::write(
            dir.join(format!("d-{i:05}-of-00003.gguf")),
            gguf(Some((0, 3))),
        )
        .unwrap();
    }
    let err = checkpoint_err(Checkpoint::open(dir.join("d-00001-of-00003.gguf")));
    assert!(
        matches!(
            err,
            Error::Checkpoint {
                kind: CheckpointFault::Split,
                ..
            }
        ),
        "{err:?}"
    );
}
