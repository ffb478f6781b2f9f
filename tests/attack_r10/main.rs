//! Hostile pass on round 10's changes: the 24-byte `TensorPiece` (u32 indices) as an
//! export manifest's attach builds it from a forged plan (indices at and past 2^32, past
//! the checkpoint's file table, ranges past a file's end), and the read threads' map-room
//! claims under a tight `vma_budget` (given back after a failed load and after a panicking
//! progress hook). Every expectation is computed here from the file's bytes or by integer
//! arithmetic: a bad input is refused by name or gives exactly the file's bytes.
#![cfg(feature = "model")]

#[path = "../common/mod.rs"]
mod common;

use std::path::Path;

use numapin_testkit::scratch::ScratchDir;

mod export;
mod reads;

/// The test's directory, removed when the test ends (passed or panicked).
fn scratch(test: &str) -> ScratchDir {
    ScratchDir::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("attack_r10-{test}"),
    )
}

use common::dbrx_files::{ROLES, base, dbrx, dup, file_tensor, options, role};
