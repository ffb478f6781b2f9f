//! `cargo xtask fixtures`: checkpoint fixtures written by the official writers.
//!
//! A venv under the target directory (`target/fixtures-venv`) gets `safetensors`, `numpy`
//! and `gguf` (llama.cpp's gguf-py) from PyPI, then `xtask/fixtures/make_fixtures.py`
//! writes the models and their expected slot bytes into `target/fixtures`. Tests find
//! them through `NUMAPIN_FIXTURES`. No Python, no venv module or no registry is a failure.

use std::path::PathBuf;
use std::process::Command;

use crate::{root, run};

/// The packages the generator imports.
const PACKAGES: &[&str] = &["safetensors", "numpy", "gguf"];

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// The fixture directory `run` writes (what `NUMAPIN_FIXTURES` should name).
pub fn dir() -> PathBuf {
    target_dir().join("fixtures")
}

/// Creates the venv if needed, installs the writers, and writes the fixtures.
pub fn run_fixtures() -> Result<PathBuf, String> {
    let venv = target_dir().join("fixtures-venv");
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
    run(Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(PACKAGES))
    .map_err(|e| {
        format!("{e}\ninstalling {PACKAGES:?} from PyPI failed: the fixtures need the registry")
    })?;
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
