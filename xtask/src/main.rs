//! `cargo xtask <task>`: the project's build and test tasks, in plain Rust.
//!
//! - `test`: the workspace tests on this host (unit, integration, doc).

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

fn try_main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => test(&args[1..]),
        Some("help") | Some("--help") | None => {
            println!("usage: cargo xtask test [-- <cargo test args>]");
            Ok(())
        }
        Some(other) => Err(format!("unknown task {other:?}; try `cargo xtask help`")),
    }
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {status}"))
    }
}

/// The host suite.
fn test(extra: &[String]) -> Result<(), String> {
    run(cargo().args(["test", "--workspace"]).args(extra))
}
