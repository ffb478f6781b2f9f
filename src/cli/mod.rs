//! The `numapin` command: `probe`, `plan`, `place` and `stat PID` (docs/cli.md).
//!
//! This is the program, not the library: it parses flags, prints, and turns every error
//! into a message and an exit status. It is compiled with the `cli` feature (on by
//! default; a library user turns it off with `default-features = false`) and hidden from
//! the docs. Three front ends call [`main`]: the `numapin` binary (`cargo install --path
//! .`), the Python package's console script (`numapin._numapin.main`), and the
//! `pin_model` example ([`pin_model`], the flags of `place` without a subcommand, plus
//! the slab-per-expert baseline from the dev-only testkit through [`Hooks`]).

// The JSON types' fields are described in docs/cli.md, where their users read them.
#![allow(missing_docs)]

/// `println!` for a program whose output may go to a pipe that closes early
/// (`numapin place --json | head -c 100`): a closed pipe ends the process quietly with
/// status 141, as `SIGPIPE` ends `cat`, instead of panicking. In scope in the modules
/// declared below it.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::run::write_line(format_args!($($arg)*))
    };
}

// `args`, `report`, `run`, `synthetic` and `whole` are public for the examples' support
// module (re-exported to tests/examples/, tests/hostile7/ and the benches) and the
// testkit (`synthetic`); everything else is the crate's.
pub mod args;
mod place;
mod plan;
mod probe;
pub mod report;
pub mod run;
mod stat;
pub mod synthetic;
mod text;
pub mod whole;

use std::ffi::OsString;
use std::fs::File;

use clap::{ArgMatches, CommandFactory, FromArgMatches};

use crate::store::Layout;
use args::{PinModelArgs, PlanArgs, ProbeArgs, StatArgs};
use run::Run;
use synthetic::SyntheticModel;

/// The slab-per-expert baseline `place --baseline` compares with: it lives in the
/// dev-only testkit (its `posix_memalign` code is kept out of the library), so only the
/// `pin_model` example passes one.
pub(crate) type BaselineFn = fn(&SyntheticModel, &File, Layout) -> Result<Run, String>;

/// What a front end adds to the command.
#[derive(Debug, Clone, Copy, Default)]
pub struct Hooks {
    /// `place --baseline`'s load (`None`: the flag is refused, naming the example).
    pub baseline: Option<BaselineFn>,
}

/// The command line: one subcommand, each with the flags of its own type.
pub(crate) fn command() -> clap::Command {
    clap::Command::new("numapin")
        .version(env!("CARGO_PKG_VERSION"))
        .about("NUMA placement for large read-mostly data: probe, plan, place, stat")
        .subcommand_required(true)
        .arg_required_else_help(true)
        .subcommand(ProbeArgs::command().name("probe"))
        .subcommand(PlanArgs::command().name("plan"))
        .subcommand(place_command())
        .subcommand(StatArgs::command().name("stat"))
}

/// Runs `numapin ARGV` (the program name first) and returns the exit status: 0, 1 for
/// an error (printed on stderr after `numapin SUBCOMMAND: `), 2 for a usage error
/// (clap's message). `--help` and `--version` print and return 0.
pub fn main<I, T>(argv: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    main_with(argv, &Hooks::default())
}

/// [`main`] with a front end's [`Hooks`].
pub(crate) fn main_with<I, T>(argv: I, hooks: &Hooks) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let matches = match command().try_get_matches_from(argv) {
        Ok(m) => m,
        Err(e) => return usage(&e),
    };
    let Some((name, sub)) = matches.subcommand() else {
        return usage(&command().error(
            clap::error::ErrorKind::MissingSubcommand,
            "a subcommand: probe, plan, place or stat",
        ));
    };
    let done = match name {
        "probe" => parsed::<ProbeArgs>(sub).map(|a| probe::run(&a)),
        "plan" => parsed::<PlanArgs>(sub).map(|a| plan::run(&a)),
        "place" => {
            PinModelArgs::from_matches_checked(sub, place_command).map(|a| place::run(&a, hooks))
        }
        _ => parsed::<StatArgs>(sub).map(|a| stat::run(&a)),
    };
    finish(&format!("numapin {name}"), done)
}

/// The `pin_model` example: `place`'s flags with no subcommand (the program name first).
pub fn pin_model<I, T>(argv: I, hooks: &Hooks) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let done = PinModelArgs::try_parse_checked(argv).map(|a| place::run(&a, hooks));
    finish("pin_model", done)
}

/// `place`'s flags under the name a usage error shows.
fn place_command() -> clap::Command {
    PinModelArgs::command()
        .name("place")
        .bin_name("numapin place")
}

fn parsed<A: FromArgMatches>(matches: &ArgMatches) -> Result<A, clap::Error> {
    A::from_arg_matches(matches)
}

/// Prints clap's message (help and version on stdout, errors on stderr) and returns its
/// status.
fn usage(e: &clap::Error) -> i32 {
    // A failed print of the usage message leaves nothing else to say.
    let _ = e.print();
    e.exit_code()
}

fn finish(name: &str, done: Result<Result<(), String>, clap::Error>) -> i32 {
    match done {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            eprintln!("{name}: {e}");
            1
        }
        Err(e) => usage(&e),
    }
}
