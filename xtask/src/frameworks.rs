//! `cargo xtask test-frameworks`: numapin under the frameworks that run the model.
//!
//! A venv of its own under the target directory (`target/frameworks-venv`) gets torch (the
//! PyPI wheel), transformers 5, accelerate, numpy, safetensors, pytest and maturin; the
//! extension is built into it with `maturin develop` as in `test-python`, plus the
//! `numapin.transformers` module. `xtask/fixtures/make_frameworks.py` then writes tiny
//! random models with transformers' own `save_pretrained` (each family's config class,
//! offline) into `target/frameworks-fixtures`, and pytest runs `python/tests/frameworks`
//! with `NUMAPIN_FRAMEWORK_FIXTURES`. This is the only stage that installs torch: the
//! `test-python` suite ignores that directory.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use crate::fixtures::pip_install;
use crate::{root, run};

/// What the stage installs. torch from PyPI is the CUDA build on x86_64 (its wheels pull
/// the CUDA libraries); the tests run it on the CPU.
const PACKAGES: &[&str] = &[
    "torch",
    "transformers>=5,<6",
    "accelerate",
    "numpy>=2",
    "safetensors",
    "pytest",
    "maturin>=1.9,<2",
];

/// Disk the install needs at its peak, measured: torch 2.15's wheels (~3.5 GB downloaded
/// into pip's temporary directory) and the venv they make (~5.6 GB).
const NEEDED_GB: u64 = 10;

/// Free space where the install writes (the venv's file system and the temporary
/// directory pip downloads into), for the stage's messages.
fn free_space() -> String {
    let tmp = std::env::temp_dir();
    [target_dir(), tmp]
        .iter()
        .map(|dir| match free_bytes(dir) {
            Some(bytes) => format!("{:.1} GB in {}", bytes as f64 / 1e9, dir.display()),
            None => format!("unknown in {}", dir.display()),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `statvfs(dir)`'s space available to an unprivileged writer, or `None` when the call
/// fails (the directory does not exist yet).
fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is a NUL-terminated string that outlives the call and `stat` points
    // to writable memory of the struct's size; on success the kernel has filled it.
    let rc = unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised the struct.
    let stat = unsafe { stat.assume_init() };
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// The stage's venv.
pub fn venv() -> PathBuf {
    target_dir().join("frameworks-venv")
}

/// Where the transformers-written fixtures go.
pub fn fixtures_dir() -> PathBuf {
    target_dir().join("frameworks-fixtures")
}

/// Creates the venv, installs the frameworks and numapin, writes the fixtures, runs the
/// suite; prints the time of each step.
pub fn run_tests() -> Result<(), String> {
    let start = Instant::now();
    let venv = venv();
    let python = venv.join("bin").join("python");
    if !python.exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv)).map_err(|e| {
            format!(
                "{e}\ncreating {} failed: `apt-get install -y python3-venv`",
                venv.display()
            )
        })?;
    }
    let step = Instant::now();
    let before = free_space();
    eprintln!("xtask: test-frameworks: free before installing torch: {before}");
    pip_install(&python, PACKAGES).map_err(|e| {
        format!(
            "{e}\nthe frameworks stage needs PyPI and about {NEEDED_GB} GB of disk (torch's CUDA \
             wheels, downloaded then installed); free before: {before}; free now: {}",
            free_space()
        )
    })?;
    eprintln!(
        "xtask: test-frameworks: torch, transformers, accelerate installed in {:.0} s",
        step.elapsed().as_secs_f64()
    );
    let step = Instant::now();
    run(Command::new(venv.join("bin").join("maturin"))
        .current_dir(root().join("python"))
        .env("VIRTUAL_ENV", &venv)
        .args(["develop", "--quiet"]))?;
    eprintln!(
        "xtask: test-frameworks: numapin built into {} in {:.0} s",
        venv.display(),
        step.elapsed().as_secs_f64()
    );
    let fixtures = fixtures_dir();
    let step = Instant::now();
    run(Command::new(&python)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .arg(
            root()
                .join("xtask")
                .join("fixtures")
                .join("make_frameworks.py"),
        )
        .arg(&fixtures))?;
    eprintln!(
        "xtask: test-frameworks: fixtures written by save_pretrained in {:.0} s",
        step.elapsed().as_secs_f64()
    );
    let tests = Instant::now();
    let dir = root().join("python").join("tests").join("frameworks");
    let mut pytest = Command::new(&python);
    pytest
        .current_dir(root())
        .env("NUMAPIN_FRAMEWORK_FIXTURES", &fixtures)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(&dir);
    run(&mut pytest)?;
    eprintln!(
        "xtask: test-frameworks: pytest {:.1} s, the stage (venv, build, fixtures, tests) {:.0} s",
        tests.elapsed().as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
