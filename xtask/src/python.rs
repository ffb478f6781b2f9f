//! `cargo xtask test-python`: the Python package's pytest suite.
//!
//! Reuses the fixture venv (`target/fixtures-venv`: numpy and safetensors are already
//! there, the tests compare against them), adds maturin and pytest from PyPI, builds the
//! extension into it with `maturin develop` (a debug build, sharing the target dir), and
//! runs `python/tests` with `NUMAPIN_FIXTURES`. The container stage runs the same suite
//! again in each sandbox ([`pytest_args`]). torch is never installed here: the tests that
//! need it (`python/tests/frameworks`) are `cargo xtask test-frameworks`'s, ignored here.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use crate::{fixtures, root, run};

/// What the Python tests need besides the fixture writers' packages (tqdm: the default
/// progress bar is tested on a pseudo-terminal).
const PACKAGES: &[&str] = &["maturin>=1.9,<2", "pytest", "tqdm"];

fn venv() -> PathBuf {
    fixtures::venv()
}

/// The venv's interpreter, once `run` has installed numapin into it.
pub fn installed() -> Option<PathBuf> {
    let python = venv().join("bin").join("python");
    let marker = venv().join("numapin-python-installed");
    (python.is_file() && marker.is_file()).then_some(python)
}

/// The pytest invocation, as arguments after the interpreter: quiet, no cache directory
/// (the sandboxes may not write the checkout), the package's tests but the frameworks'
/// (they need torch: `cargo xtask test-frameworks`).
pub fn pytest_args() -> Vec<String> {
    let tests = root().join("python").join("tests");
    vec![
        "-m".into(),
        "pytest".into(),
        "-q".into(),
        "-p".into(),
        "no:cacheprovider".into(),
        format!("--ignore={}", tests.join("frameworks").display()),
        tests.display().to_string(),
    ]
}

/// Builds and installs the package into the venv (fixtures first: the venv is theirs).
pub fn install() -> Result<PathBuf, String> {
    let fixtures = fixtures::run_fixtures()?;
    let venv = venv();
    let python = venv.join("bin").join("python");
    fixtures::pip_install(&python, PACKAGES)?;
    let start = Instant::now();
    run(Command::new(venv.join("bin").join("maturin"))
        .current_dir(root().join("python"))
        .env("VIRTUAL_ENV", &venv)
        .args(["develop", "--quiet"]))?;
    eprintln!(
        "xtask: numapin built into {} in {:.0} s",
        venv.display(),
        start.elapsed().as_secs_f64()
    );
    std::fs::write(venv.join("numapin-python-installed"), "")
        .map_err(|e| format!("{}: {e}", venv.display()))?;
    Ok(fixtures)
}

/// Installs the package and runs the suite on this host; prints the stage's time.
pub fn run_tests() -> Result<(), String> {
    let start = Instant::now();
    let fixtures = install()?;
    let python = venv().join("bin").join("python");
    let tests = Instant::now();
    run(Command::new(&python)
        .current_dir(root())
        .env("NUMAPIN_FIXTURES", fixtures)
        .args(pytest_args()))?;
    eprintln!(
        "xtask: test-python: pytest {:.1} s, the stage (venv, build, tests) {:.0} s",
        tests.elapsed().as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
