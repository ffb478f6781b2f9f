//! `pin_model`'s flags as the README and docs/cli.md give them: each flag's meaning and
//! default, the `--help` text, usage errors, and the share flags parsed to the share
//! placed.

use super::{parse, set};
use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use numapin::NodeSet;
use numapin::store::Layout;

use super::support::args::{LayoutArg, PinModelArgs, ProbeArgs};
use numapin_testkit::synthetic::SyntheticModel;

#[test]
fn pin_model_without_flags_is_the_readme_run() {
    let args = parse(&[]).unwrap();
    assert_eq!(args.synthetic(), SyntheticModel::default());
    assert_eq!(args.layout, LayoutArg::Interleave);
    assert_eq!(args.nodes, NodeSet::allowed().unwrap());
    assert_eq!(
        args.layout(),
        Layout::Interleave(NodeSet::allowed().unwrap())
    );
    assert_eq!(args.file, None);
    assert_eq!(args.threads, None);
    assert!(!args.no_huge_pages && !args.baseline && !args.json);
    assert_eq!(args.purge(), cfg!(feature = "jemalloc"));
}

#[test]
fn every_pin_model_flag_keeps_its_meaning() {
    let args = parse(&[
        "--layers",
        "3",
        "--experts",
        "5",
        "--weight-bytes",
        "4096",
        "--scale-bytes",
        "0",
        "--layout",
        "layer-per-node",
        "--nodes",
        "0",
        "--file",
        "/nowhere/model.bin",
        "--threads",
        "7",
        "--no-huge-pages",
        "--baseline",
        "--json",
        "--no-purge",
    ])
    .unwrap();
    assert_eq!(
        args.synthetic(),
        SyntheticModel {
            layers: 3,
            experts: 5,
            weight_bytes: 4096,
            scale_bytes: 0,
        }
    );
    assert_eq!(args.layout(), Layout::LayerPerNode(set(&[0])));
    assert_eq!(args.file, Some(PathBuf::from("/nowhere/model.bin")));
    assert_eq!(args.threads, Some(7));
    assert!(args.no_huge_pages && args.baseline && args.json);
    assert!(!args.purge());
    assert_eq!(args.read, numapin::store::ReadMode::Auto, "the default");
    assert_eq!(args.model, None);
    model_and_plan_flags_keep_their_meaning();
    read_and_layout_flags_keep_their_meaning();
}

/// `--model`, `--no-progress`, and `--plan-only` with what needs it.
fn model_and_plan_flags_keep_their_meaning() {
    let more = parse(&["--read", "direct", "--model", "/m/ckpt", "--no-progress"]).unwrap();
    assert_eq!(more.read, numapin::store::ReadMode::Direct);
    assert_eq!(more.model, Some(PathBuf::from("/m/ckpt")));
    assert!(more.no_progress);
    assert!(!more.plan_only && more.topology.is_none() && more.routing.is_none());
    let plan = parse(&[
        "--model",
        "/m/ckpt",
        "--plan-only",
        "--topology",
        "/t.json",
        "--routing",
        "/r.json",
        "--budget",
        "192G",
    ])
    .unwrap();
    assert!(plan.plan_only);
    assert_eq!(plan.topology, Some(PathBuf::from("/t.json")));
    assert_eq!(plan.routing, Some(PathBuf::from("/r.json")));
    assert_eq!(plan.budget, Some(192 << 30));
    assert_eq!(
        parse(&["--model", "/m", "--plan-only", "--budget", "4096"])
            .unwrap()
            .budget,
        Some(4096)
    );
    // --plan-only needs --model; --topology, --routing and --budget need --plan-only.
    for alone in [
        &["--plan-only"][..],
        &["--model", "/m", "--topology", "/t"],
        &["--model", "/m", "--routing", "/r"],
        &["--model", "/m", "--budget", "1G"],
    ] {
        assert_eq!(
            parse(alone).unwrap_err().kind(),
            ErrorKind::MissingRequiredArgument,
            "{alone:?}"
        );
    }
    for bad in ["x", "-1G", "99999999999T"] {
        assert!(
            parse(&["--model", "/m", "--plan-only", "--budget", bad]).is_err(),
            "{bad}"
        );
    }
}

/// `--read` and `--layout`, each value.
fn read_and_layout_flags_keep_their_meaning() {
    assert_eq!(
        parse(&["--read", "drop-behind"]).unwrap().read,
        numapin::store::ReadMode::DropBehind
    );
    assert!(parse(&["--read", "mmap"]).is_err());
    assert_eq!(
        parse(&["--layout", "unplaced"]).unwrap().layout(),
        Layout::Unplaced
    );
    for layout in [
        LayoutArg::Interleave,
        LayoutArg::LayerPerNode,
        LayoutArg::Unplaced,
        LayoutArg::Replicate,
        LayoutArg::Split,
    ] {
        assert_eq!(parse(&["--layout", layout.name()]).unwrap().layout, layout);
    }
}

#[test]
fn purge_needs_jemalloc_and_the_last_purge_flag_wins() {
    assert!(!parse(&["--purge", "--no-purge"]).unwrap().purge());
    let last_purge = parse(&["--no-purge", "--purge"]);
    if cfg!(feature = "jemalloc") {
        assert!(last_purge.unwrap().purge());
        assert!(parse(&["--purge"]).unwrap().purge());
    } else {
        assert_eq!(last_purge.unwrap_err().kind(), ErrorKind::ArgumentConflict);
        let err = parse(&["--purge"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ArgumentConflict);
        assert!(err.to_string().contains("--features jemalloc"), "{err}");
    }
}

#[test]
fn bad_pin_model_flags_are_usage_errors() {
    let kind = |args: &[&str]| parse(args).unwrap_err().kind();
    assert_eq!(kind(&["--layout", "spread"]), ErrorKind::InvalidValue);
    for zero in ["--layers", "--experts", "--weight-bytes", "--threads"] {
        assert_eq!(kind(&[zero, "0"]), ErrorKind::ValueValidation, "{zero}");
        assert_eq!(kind(&[zero, "x"]), ErrorKind::ValueValidation, "{zero}");
    }
    assert_eq!(kind(&["--scale-bytes", "-1"]), ErrorKind::UnknownArgument);
    assert_eq!(kind(&["--nodes", "0-"]), ErrorKind::ValueValidation);
    assert_eq!(kind(&["--layers"]), ErrorKind::InvalidValue);
    assert_eq!(kind(&["--experts-total", "3"]), ErrorKind::UnknownArgument);
    assert_eq!(kind(&["--help"]), ErrorKind::DisplayHelp);
    // The exit status clap gives a usage error, and 0 for --help.
    assert_eq!(parse(&["--layout", "spread"]).unwrap_err().exit_code(), 2);
    assert_eq!(parse(&["--help"]).unwrap_err().exit_code(), 0);
}

/// The `--help` text of one flag: from its line to the next flag's.
fn flag_help<'a>(help: &'a str, flag: &str) -> &'a str {
    let start = help
        .find(&format!("\n      {flag} "))
        .or_else(|| help.find(&format!("\n      {flag}\n")))
        .unwrap_or_else(|| panic!("{flag} missing from:\n{help}"));
    let rest = &help[start + 1..];
    let end = rest[1..].find("\n      --").map_or(rest.len(), |e| e + 1);
    &rest[..end]
}

#[test]
fn help_shows_every_flag_with_its_default() {
    let help = PinModelArgs::command().render_long_help().to_string();
    let model = SyntheticModel::default();
    for (flag, default) in [
        ("--layers", model.layers.to_string()),
        ("--experts", model.experts.to_string()),
        ("--weight-bytes", model.weight_bytes.to_string()),
        ("--scale-bytes", model.scale_bytes.to_string()),
        ("--layout", LayoutArg::Interleave.name().to_string()),
        ("--nodes", "all".to_string()),
    ] {
        let text = flag_help(&help, flag);
        assert!(
            text.contains(&format!("[default: {default}]")),
            "{flag}:\n{text}"
        );
    }
    for word in [
        "interleave",
        "layer-per-node",
        "unplaced",
        "replicate",
        "split",
    ] {
        assert!(flag_help(&help, "--layout").contains(word), "{word}");
    }
    for flag in [
        "--file",
        "--threads",
        "--no-huge-pages",
        "--baseline",
        "--json",
        "--purge",
        "--no-purge",
    ] {
        assert!(!flag_help(&help, flag).trim().is_empty(), "{flag}");
    }
    assert!(flag_help(&help, "--threads").contains("[default: "));
    assert!(flag_help(&help, "--purge").contains("[default: "));
    // The old --help printed the source's `//!` lines.
    assert!(!help.contains("//!"), "{help}");

    let probe = ProbeArgs::command().render_long_help().to_string();
    assert!(flag_help(&probe, "--json").contains("JSON"), "{probe}");
    let probe_args = |args: &[&str]| ProbeArgs::try_parse_from(args.iter().copied());
    assert!(probe_args(&["probe", "--json"]).unwrap().json);
    assert!(!probe_args(&["probe"]).unwrap().json);
    assert_eq!(
        probe_args(&["probe", "--jsno"]).unwrap_err().kind(),
        ErrorKind::UnknownArgument
    );
}

#[test]
fn pin_model_share_flags_parse_to_the_share_placed() {
    let args = parse(&[
        "--model",
        "/m",
        "--experts",
        "0-63,96",
        "--slice",
        "rows:0/2",
    ])
    .unwrap();
    assert_eq!(args.share().to_string(), "experts 0-63,96, slice rows:0/2");
    // The synthetic model's count is unchanged by a share-looking --model run.
    assert_eq!(args.synthetic().experts, SyntheticModel::default().experts);
    let k_of_n = parse(&[
        "--model",
        "/m",
        "--experts",
        "1/4",
        "--slice",
        "columns:128:256",
    ])
    .unwrap();
    assert_eq!(
        k_of_n.share().to_string(),
        "experts 1/4, slice columns:128:256"
    );
    assert!(parse(&["--model", "/m"]).unwrap().share().is_whole());
    let kind = |args: &[&str]| parse(args).unwrap_err().kind();
    assert_eq!(kind(&["--slice", "rows:0/2"]), ErrorKind::ArgumentConflict);
    assert_eq!(kind(&["--experts", "0-3"]), ErrorKind::ValueValidation);
    assert_eq!(
        kind(&["--model", "/m", "--experts", "0-9,5-12"]),
        ErrorKind::ValueValidation
    );
    assert_eq!(
        kind(&["--model", "/m", "--slice", "diagonal:0/2"]),
        ErrorKind::ValueValidation
    );
    assert_eq!(
        kind(&["--model", "/m", "--slice", "rows:2/2"]),
        ErrorKind::ValueValidation
    );
}
