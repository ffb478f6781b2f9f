//! `cargo xtask fixtures`: checkpoint fixtures written by the official writers.
//!
//! A venv under the target directory (`target/fixtures-venv`) gets `safetensors`, `numpy`,
//! `gguf` (llama.cpp's gguf-py) and `ml-dtypes` (float8 for numpy) from PyPI, then `xtask/fixtures/make_fixtures.py`
//! writes the models and their expected slot bytes into `target/fixtures`. Tests find
//! them through `NUMAPIN_FIXTURES`: the host stage sets it, the container stage passes it
//! into the sandbox, the VM stage copies the directory into its initramfs. No Python, no
//! venv module or no registry is a failure.

use std::path::PathBuf;
use std::process::Command;

use crate::{root, run};

/// The packages the generator imports.
const PACKAGES: &[&str] = &["safetensors", "numpy", "gguf", "ml-dtypes"];

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// The fixture directory `run` writes (what `NUMAPIN_FIXTURES` should name).
pub fn dir() -> PathBuf {
    target_dir().join("fixtures")
}

/// The fixtures the test stages hand on: `NUMAPIN_FIXTURES` when set, else [`dir`] when
/// `run_fixtures` has written it; `None` (the fixture tests print NOT RUN) otherwise.
pub fn existing() -> Option<PathBuf> {
    let dir = std::env::var_os("NUMAPIN_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(dir);
    if dir.join("ggml_quant_sizes.json").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "xtask: no fixtures in {}: the checkpoint fixture tests print NOT RUN              (`cargo xtask fixtures` writes them; `cargo xtask test` always does)",
            dir.display()
        );
        None
    }
}

/// The venv the fixture writers (and the Python tests) run in.
pub fn venv() -> PathBuf {
    target_dir().join("fixtures-venv")
}

/// `python -m pip install --quiet --no-cache-dir PACKAGES` (from PyPI). No cache: the
/// venv is made once per target directory, and torch's CUDA wheels would keep ~3.5 GB of
/// downloads in `~/.cache/pip` beside the ~5.6 GB they install (a CI machine ran out of
/// disk there).
pub fn pip_install(python: &std::path::Path, packages: &[&str]) -> Result<(), String> {
    run(Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-cache-dir",
        ])
        .args(packages))
    .map_err(|e| format!("{e}\ninstalling {packages:?} from PyPI failed"))
}

/// Creates the venv if needed, installs the writers, and writes the fixtures.
pub fn run_fixtures() -> Result<PathBuf, String> {
    let venv = venv();
    let python = venv.join("bin").join("python");
    if !python.exists() {
        let version = Command::new("python3").arg("--version").output();
        if !version.is_ok_and(|o| o.status.success()) {
            return Err("fixtures need python3 (3.9 or later): install it, e.g. \
                        `apt-get install -y python3 python3-venv`"
                .into());
        }
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv)).map_err(|e| {
            format!(
                "{e}\ncreating the fixture venv failed: as root, `apt-get install -y python3-venv` \
                 (Debian/Ubuntu ship venv separately), then run `cargo xtask fixtures` again"
            )
        })?;
    }
    pip_install(&python, PACKAGES).map_err(|e| format!("{e}: the fixtures need the registry"))?;
    let out = dir();
    run(Command::new(&python)
        .arg(
            root()
                .join("xtask")
                .join("fixtures")
                .join("make_fixtures.py"),
        )
        .arg(&out))?;
    eprintln!("xtask: fixtures in {} (NUMAPIN_FIXTURES)", out.display());
    Ok(out)
}
