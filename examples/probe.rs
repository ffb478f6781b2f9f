//! Prints what numapin finds on this machine, and one line saying what placement does
//! here: `cargo run --example probe` (`-- --json` for one JSON object, `-- --help`).

mod support;

use std::process::ExitCode;
use support::outln;

use clap::Parser;
use support::args::ProbeArgs;
use support::report::{ProbeJson, verdict};

fn main() -> ExitCode {
    let args = ProbeArgs::parse();
    let support = match numapin::probe() {
        Ok(support) => support,
        Err(e) => {
            eprintln!("probe failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        match serde_json::to_string(&ProbeJson::new(&support)) {
            Ok(text) => outln!("{text}"),
            Err(e) => {
                eprintln!("probe: JSON: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        outln!("{support}\n\n{}", verdict(&support));
    }
    ExitCode::SUCCESS
}
