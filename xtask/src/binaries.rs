//! The workspace's test binaries, built once and listed from cargo's JSON messages.

use std::path::PathBuf;
use std::process::Stdio;

/// A test binary: its target name and path.
#[derive(Debug, Clone)]
pub struct TestBinary {
    pub name: String,
    pub path: PathBuf,
    /// Arguments after the path (the pytest run: the interpreter's).
    pub args: Vec<String>,
}

/// Builds the test binaries of the numapin package (`--release` when asked) and lists them.
pub fn build(release: bool) -> Result<Vec<TestBinary>, String> {
    let mut cmd = crate::cargo();
    cmd.current_dir(crate::root())
        .args([
            "test",
            "--package",
            "numapin",
            "--all-features",
            "--no-run",
            "--message-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if release {
        cmd.arg("--release");
    }
    eprintln!("xtask: running {cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo test --no-run failed: {}", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut found: Vec<TestBinary> = text
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && is_test_harness(l))
        .filter_map(|l| {
            let path = json_field(l, "executable")?;
            let name = json_field(l, "name")?;
            let kind = if l.contains("\"kind\":[\"lib\"]") {
                "lib"
            } else {
                &name
            };
            Some(TestBinary {
                name: if kind == "lib" {
                    format!("{name} (unit)")
                } else {
                    name
                },
                path: PathBuf::from(path),
                args: Vec::new(),
            })
        })
        .collect();
    found.sort_by(|a, b| a.name.cmp(&b.name));
    found.dedup_by(|a, b| a.path == b.path);
    if found.is_empty() {
        return Err("cargo listed no test binaries".into());
    }
    Ok(found)
}

/// Whether an artifact line is a test harness: its profile says `"test":true`. The
/// target's own `"test":true` (every bin target is testable) is not enough: the plain
/// `numapin` binary, built for tests/cli's `CARGO_BIN_EXE_numapin`, carries it too and
/// is no test binary.
fn is_test_harness(line: &str) -> bool {
    line.split_once("\"profile\":{")
        .and_then(|(_, rest)| rest.split_once('}'))
        .is_some_and(|(profile, _)| profile.contains("\"test\":true"))
}

/// Builds one example of the numapin package in release mode and returns its executable,
/// as cargo reports it (so `CARGO_TARGET_DIR` and `build.target-dir` are honoured).
pub fn build_example(name: &str) -> Result<PathBuf, String> {
    build_release("example", name)
}

/// Builds one binary of the numapin package (`numapin`) in release mode and returns its
/// executable, as [`build_example`] does.
pub fn build_bin(name: &str) -> Result<PathBuf, String> {
    build_release("bin", name)
}

/// `cargo build --release --package numapin --KIND NAME`: the executable cargo reports.
fn build_release(kind: &str, name: &str) -> Result<PathBuf, String> {
    let mut cmd = crate::cargo();
    cmd.current_dir(crate::root())
        .args([
            "build",
            "--release",
            "--package",
            "numapin",
            &format!("--{kind}"),
            name,
            "--message-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    eprintln!("xtask: running {cmd:?}");
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed: {}", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter(|l| {
            l.contains("\"reason\":\"compiler-artifact\"")
                && l.contains(&format!("\"kind\":[\"{kind}\"]"))
        })
        .filter(|l| json_field(l, "name").is_some_and(|n| n == name))
        .find_map(|l| json_field(l, "executable"))
        .map(PathBuf::from)
        .ok_or_else(|| format!("cargo reported no executable for {kind} {name}"))
}

/// The string value of `"key":"..."` (first occurrence), unescaping `\"` and `\\`.
pub fn json_field(line: &str, key: &str) -> Option<String> {
    let start = line.find(&format!("\"{key}\":\""))? + key.len() + 4;
    let mut out = String::new();
    let mut chars = line[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => out.push(chars.next()?),
            c => out.push(c),
        }
    }
    None
}
