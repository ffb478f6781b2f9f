//! Hostile pass on round 9's additions: role-major slots under an expert share (DBRX's
//! `w1`/`v1`/`w2` held experts as one run), their export + attach with forged manifests,
//! direct reads without `io_uring` (the read threads) on files that shrink or end early,
//! and the CLI's share slices. Every expectation is computed here from the file's bytes
//! (its safetensors header parsed by the test) or by integer arithmetic: a bad input is
//! refused by name or gives exactly the file's bytes, never a panic or wrong bytes.
#![cfg(feature = "model")]

#[path = "../common/mod.rs"]
mod common;

use std::path::Path;

use numapin_testkit::scratch::ScratchDir;

mod cli;
mod export;
mod reads;
mod share;

/// The test's directory, removed when the test ends (passed or panicked).
fn scratch(test: &str) -> ScratchDir {
    ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("attack_r9-{test}"),
    )
}

use common::dbrx_files::{ROLES, Spec, base, dbrx, dup, file_tensor, options, role, safetensors};
