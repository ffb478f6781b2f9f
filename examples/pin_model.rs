//! The main job as an example: `numapin place`'s flags without the subcommand, plus the
//! slab-per-expert baseline (`--baseline`), which lives in the dev-only testkit.
//!
//! `cargo run --release --example pin_model` writes a 16 layers × 64 experts model
//! (1 MiB weights + 32 KiB scales each) to a temp dir, packs it interleaved over the
//! allowed nodes, verifies every slot against the file, and prints a report;
//! `-- --help` lists the flags, `--json` prints one object (docs/cli.md). The code is
//! `numapin::cli` (the `numapin` binary's); this file only adds the baseline.

mod support;

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: numapin::jemalloc::Jemalloc = numapin::jemalloc::Jemalloc;

#[cfg(feature = "jemalloc")]
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8; 13] = b"retain:false\0";

use numapin::cli::Hooks;

fn main() -> std::process::ExitCode {
    let hooks = Hooks {
        baseline: Some(|model, file, layout| {
            support::run_baseline(model, file, layout).map(|(run, _slabs)| run)
        }),
    };
    let status = numapin::cli::pin_model(std::env::args_os(), &hooks);
    std::process::ExitCode::from(u8::try_from(status).unwrap_or(1))
}
