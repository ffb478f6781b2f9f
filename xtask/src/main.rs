//! `cargo xtask <task>`: the project's build and test tasks, in plain Rust.
//!
//! - `test`: `check-layers`, the checkpoint fixtures, the host suite, the Python suite,
//!   the frameworks suite, then `test-container`, then `test-numa`.
//! - `test-python`: the Python package built into the fixture venv, and its pytest suite.
//! - `test-frameworks`: torch, transformers and accelerate in a venv of their own
//!   (`target/frameworks-venv`), fixtures written by transformers' `save_pretrained`, and
//!   `python/tests/frameworks` (`numapin.transformers` against transformers' own load).
//! - `check-layers`: the import graph points down a declared list of layers; every
//!   syscall is in `sys/`.
//! - `fixtures`: checkpoint fixtures written by the official safetensors and gguf-py
//!   writers into `target/fixtures` (tests read them through `NUMAPIN_FIXTURES`).
//! - `test-container`: every test binary in unshared user/mount/pid namespaces, plain and
//!   under seccomp filters that answer the NUMA syscalls with EPERM (Docker's default
//!   profile) or ENOSYS (a kernel without NUMA).
//! - `test-numa`: every test binary in a 4-node qemu VM (TCG), plus the map-limit
//!   scenario and the main-job example.

mod binaries;
mod container;
mod cpio;
mod fixtures;
mod frameworks;
mod layering;
mod numa_vm;
mod python;
mod report;
mod vm_provision;
mod vm_shape;

use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    match try_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

const USAGE: &str = "usage: cargo xtask <task>
  test              check-layers, fixtures, host tests, test-python,
                    test-frameworks, then test-container, then test-numa
  test-python       the Python package (maturin develop into the fixture venv) and its
                    pytest suite; the container stage runs the suite again
  test-frameworks   torch, transformers, accelerate in target/frameworks-venv, fixtures
                    by save_pretrained, and python/tests/frameworks
  fixtures          checkpoint fixtures (safetensors, GGUF) into target/fixtures, written
                    by the official writers in a venv (target/fixtures-venv)
  test-host         the workspace tests on this host only
  check-layers      the import graph points down a declared list of layers, lib.rs
                    holds only modules and re-exports, syscalls only in sys/
  test-container    test binaries in namespaces: userns | docker-default | no-numa
                    (--env NAME runs one environment; --repeat N runs
                    every round N times, each in full: a flake fails it)
  test-numa         test binaries in a 4-node qemu VM (NUMAPIN_REQUIRE_VM=1: a VM that
                    cannot be provisioned is a failure, not a skip)";

fn try_main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or(&[]);
    match args.first().map(String::as_str) {
        Some("test") => {
            layering::run()?;
            fixtures::run_fixtures()?;
            test_host()?;
            python::run_tests()?;
            frameworks::run_tests()?;
            container::run(&[])?;
            numa_vm::run()
        }
        Some("test-host") => test_host(),
        Some("test-python") => python::run_tests(),
        Some("test-frameworks") => frameworks::run_tests(),
        Some("check-layers") => layering::run(),
        Some("fixtures") => fixtures::run_fixtures().map(|_| ()),
        Some("test-container") => container::run(rest),
        Some("test-numa") => numa_vm::run(),
        Some(container::SANDBOX) => container::sandbox(rest),
        Some("help" | "--help" | "-h") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown task {other:?}\n{USAGE}")),
    }
}

pub fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

pub fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {status}"))
    }
}

/// The workspace root (xtask lives one level below it).
pub fn root() -> std::path::PathBuf {
    let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(|p| p.to_path_buf())
        .unwrap_or(manifest)
}

/// Cargo's target directory for this workspace (`CARGO_TARGET_DIR`, `build.target-dir`
/// or `<root>/target`), as `cargo metadata` reports it; asked once.
pub fn target_dir() -> Result<std::path::PathBuf, String> {
    static TARGET: std::sync::OnceLock<Result<std::path::PathBuf, String>> =
        std::sync::OnceLock::new();
    TARGET
        .get_or_init(|| {
            let mut cmd = cargo();
            cmd.current_dir(root())
                .args(["metadata", "--format-version", "1", "--no-deps"]);
            let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "{cmd:?} failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let text = String::from_utf8_lossy(&out.stdout);
            binaries::json_field(&text, "target_directory")
                .map(std::path::PathBuf::from)
                .ok_or_else(|| format!("{cmd:?} printed no target_directory"))
        })
        .clone()
}

fn test_host() -> Result<(), String> {
    let mut cmd = cargo();
    cmd.current_dir(root())
        .args(["test", "--workspace", "--all-features"]);
    // Fixture tests run when `fixtures` (or `test`) wrote them; otherwise they say NOT RUN.
    let fixtures = fixtures::dir().join("ggml_quant_sizes.json").is_file();
    if fixtures {
        cmd.env("NUMAPIN_FIXTURES", fixtures::dir());
    }
    run(&mut cmd)?;
    if fixtures {
        main_job_on_checkpoints()?;
    }
    Ok(())
}

/// The main job on real checkpoints: `pin_model --model` on the sharded safetensors
/// fixture and the split GGUF, each read mode once, and on two fused gate_up families
/// (whose report must name the gate_up layout), must pin, complete and verify every slot.
fn main_job_on_checkpoints() -> Result<(), String> {
    let pin_model = binaries::build_example("pin_model")?;
    let dir = fixtures::dir();
    let rows = "\"layer_roles\":{\"1\":{\"roles\":[\"gate_up\",\"down\"],\
                \"gate_up_layout\":\"gate-then-up rows [2I, H]\"}";
    let columns = "\"layer_roles\":{\"1\":{\"roles\":[\"gate_up\",\"down\"],\
                   \"gate_up_layout\":\"gate-then-up columns [H, 2I]\"}";
    let cases = [
        (dir.join("st-sharded/model"), "buffered", ""),
        (dir.join("st-sharded/model"), "direct", ""),
        (
            dir.join("gguf-split/model-00001-of-00003.gguf"),
            "drop-behind",
            "",
        ),
        (dir.join("gguf-single/model.gguf"), "direct", ""),
        (dir.join("gguf-fused-gate-up/model.gguf"), "direct", rows),
        (
            dir.join("fam-qwen3-vl-moe/model.safetensors"),
            "buffered",
            columns,
        ),
    ];
    for (model, read, expected) in cases {
        let mut cmd = Command::new(&pin_model);
        cmd.arg("--model")
            .arg(&model)
            .args(["--read", read, "--json"]);
        eprintln!("xtask: running {cmd:?}");
        let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let ok = out.status.success()
            && text.contains("\"verified\":true")
            && text.contains("\"complete\":true")
            && text.contains("\"model\":{")
            && text.contains("\"experts_per_layer\":{\"1\":4,\"2\":4}")
            && text.contains(expected);
        if !ok {
            return Err(format!(
                "pin_model --model {} --read {read}: {}\n{text}{}",
                model.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        eprintln!(
            "xtask: pin_model --model {} --read {read}: verified",
            model.display()
        );
    }
    whole_model_plans(&pin_model)
}

/// The whole model placed (`pin_model --model … --plan …`): the default plan and one that
/// sets a layout per class, in the read modes that lay pieces out differently, must
/// place every tensor, verify every copy against the files, and cost exactly the
/// mappings the dry run planned.
fn whole_model_plans(pin_model: &std::path::Path) -> Result<(), String> {
    let dir = fixtures::dir();
    let custom = "experts=replicate:all,dense=replicate:all,attention=interleave:all,norms=bind:0";
    let cases = [
        (dir.join("st-sharded/model"), "default", "direct"),
        (
            dir.join("gguf-split/model-00001-of-00003.gguf"),
            custom,
            "drop-behind",
        ),
        (dir.join("fam-deepseek-v3-fp8"), "default", "buffered"),
    ];
    for (model, plan, read) in cases {
        let mut cmd = Command::new(pin_model);
        cmd.arg("--model")
            .arg(&model)
            .args(["--plan", plan, "--read", read, "--json"]);
        eprintln!("xtask: running {cmd:?}");
        let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let report: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let number = |key: &str| report.get(key).and_then(serde_json::Value::as_u64);
        // Every tensor is in one class: the classes' counts add up to the whole's.
        let in_classes: Option<u64> = report
            .get("classes")
            .and_then(serde_json::Value::as_array)
            .map(|classes| {
                classes
                    .iter()
                    .filter_map(|c| c.get("tensors").and_then(serde_json::Value::as_u64))
                    .sum()
            });
        let planned = number("mappings_planned");
        let ok = out.status.success()
            && report.get("verified") == Some(&serde_json::Value::Bool(true))
            && number("tensors").is_some_and(|n| n > 0)
            && in_classes == number("tensors")
            && planned.is_some()
            && number("mappings") == planned;
        if !ok {
            return Err(format!(
                "pin_model --model {} --plan {plan} --read {read}: {}\n{text}{}",
                model.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        eprintln!(
            "xtask: pin_model --model {} --plan {plan} --read {read}: {} tensors placed and \
             verified in {} mappings, as planned",
            model.display(),
            number("tensors").unwrap_or(0),
            planned.unwrap_or(0)
        );
    }
    Ok(())
}
