//! Prints what numapin finds on this machine, and one line saying what placement does
//! here: `cargo run --example probe` (`-- --json` for one JSON object, `-- --help`).
//! The same as `numapin probe`, whose code it calls.

fn main() -> std::process::ExitCode {
    let argv = ["numapin".into(), "probe".into()]
        .into_iter()
        .chain(std::env::args_os().skip(1));
    let status = numapin::cli::main(argv);
    std::process::ExitCode::from(u8::try_from(status).unwrap_or(1))
}
