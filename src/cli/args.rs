//! The command's flags (clap derive): `--help` prints each flag with its default.

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, ValueEnum};

use super::synthetic::SyntheticModel;
use crate::model::{ExpertShare, PlacementPlan, Share, TensorSlice};
use crate::nodeset::NodeSet;
use crate::store::{Layout, ReadMode};

/// How the store spreads the layers over `--nodes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LayoutArg {
    /// Each layer's pages spread over all the nodes, page by page.
    Interleave,
    /// Each layer bound whole to one node, the layers round robin over the nodes.
    LayerPerNode,
    /// No binding: pages land where the kernel puts first touches.
    Unplaced,
    /// A copy of every layer on each node, each bound to its node (nodes × the memory).
    Replicate,
    /// A copy of every layer per domain (socket), interleaved over the domain's nodes.
    ReplicateDomains,
    /// Each layer's experts in contiguous blocks, one block bound to each node.
    Split,
}

impl LayoutArg {
    /// The store's layout over `nodes` (ignored by `Unplaced`).
    pub fn layout(self, nodes: NodeSet) -> Layout {
        match self {
            LayoutArg::Interleave => Layout::Interleave(nodes),
            LayoutArg::LayerPerNode => Layout::LayerPerNode(nodes),
            LayoutArg::Unplaced => Layout::Unplaced,
            LayoutArg::Replicate => Layout::Replicate(nodes),
            LayoutArg::ReplicateDomains => Layout::ReplicateDomains(nodes),
            LayoutArg::Split => Layout::SplitExperts(nodes),
        }
    }

    /// The word on the command line: `interleave`, `layer-per-node`, `unplaced`,
    /// `replicate`, `replicate-domains` or `split`.
    pub fn name(self) -> &'static str {
        match self {
            LayoutArg::Interleave => "interleave",
            LayoutArg::LayerPerNode => "layer-per-node",
            LayoutArg::Unplaced => "unplaced",
            LayoutArg::Replicate => "replicate",
            LayoutArg::ReplicateDomains => "replicate-domains",
            LayoutArg::Split => "split",
        }
    }
}

/// A count that must be at least 1.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `--experts`: a count for the synthetic model, a share with --model (see
/// [`PinModelArgs::experts`]).
#[derive(Debug, Clone)]
pub(crate) struct ExpertsArg {
    /// The text as a count, when it is one (at least 1).
    pub(crate) count: Option<usize>,
    /// The text as a share (`5` is expert 5 alone).
    pub(crate) share: ExpertShare,
}

impl ExpertsArg {
    fn count(n: usize) -> ExpertsArg {
        ExpertsArg {
            count: Some(n),
            share: ExpertShare::list([n]).unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for ExpertsArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.count {
            Some(n) => write!(f, "{n}"),
            None => write!(f, "{}", self.share),
        }
    }
}

fn experts_arg(text: &str) -> Result<ExpertsArg, String> {
    if text.parse::<usize>() == Ok(0) {
        return Err("must be at least 1 (expert 0 alone: 0-0, with --model)".into());
    }
    let share = ExpertShare::parse(text).map_err(|e| e.to_string())?;
    Ok(ExpertsArg {
        count: text.parse::<usize>().ok(),
        share,
    })
}

/// `--slice`: one slice for every tensor, or `tp:k/n`, the tensor-parallel preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SliceArg {
    /// `rows:k/n`, `columns:k/n`, `AXIS:START:LEN`.
    Slice(TensorSlice),
    /// `tp:k/n`: rank k of a tensor-parallel group of n.
    Tp(u64, u64),
}

fn slice_arg(text: &str) -> Result<SliceArg, String> {
    if let Some(rest) = text.trim().strip_prefix("tp:") {
        let (k, n) = PlacementPlan::parse_rank(rest)
            .map_err(|e| format!("{text}: tp:k/n (rank k of n): {e}"))?;
        return Ok(SliceArg::Tp(k, n));
    }
    TensorSlice::parse(text)
        .map(SliceArg::Slice)
        .map_err(|e| e.to_string())
}

/// A byte count.
fn bytes(text: &str) -> Result<usize, String> {
    text.parse::<usize>().map_err(|e| e.to_string())
}

/// Pin a synthetic MoE model with a PinStore and show where it went.
///
/// Writes a deterministic model of LAYERS × EXPERTS × (WEIGHT_BYTES + SCALE_BYTES) to a
/// temp dir (or reads --file), packs it with one weights region and one scales region
/// per layer, each bound once, verifies every slot against the file, and prints nodes,
/// bytes, load time, mappings, mbind calls, pages per node, RSS and the placement (or
/// one JSON object with --json).
#[derive(Debug, Clone, Parser)]
#[command(name = "pin_model")]
pub struct PinModelArgs {
    /// Layers in the model.
    #[arg(long, default_value_t = SyntheticModel::default().layers, value_parser = at_least_one)]
    pub layers: usize,
    /// Experts in each layer.
    ///
    /// With --model: the experts of each MoE layer this rank places (a rank's share
    /// under expert parallelism): global ids and inclusive ranges `0-63,96`, or `k/n`
    /// for the k-th of n equal parts (`1/4`); every expert when absent.
    #[arg(long, value_name = "N|SHARE", value_parser = experts_arg,
          default_value_t = ExpertsArg::count(SyntheticModel::default().experts))]
    pub(crate) experts: ExpertsArg,
    /// Whether --experts was given (its default is the synthetic model's count).
    #[arg(skip)]
    pub experts_given: bool,
    /// Weight bytes of each expert.
    #[arg(long, default_value_t = SyntheticModel::default().weight_bytes, value_parser = at_least_one)]
    pub weight_bytes: usize,
    /// Scale bytes of each expert (0: no scales).
    #[arg(long, default_value_t = SyntheticModel::default().scale_bytes, value_parser = bytes)]
    pub scale_bytes: usize,
    /// How the layers are spread over --nodes.
    #[arg(long, value_enum, default_value_t = LayoutArg::Interleave)]
    pub layout: LayoutArg,
    /// The nodes to place on, in numactl's syntax (`0-3`, `0,2`, `0-3,!2`); `all` is the
    /// nodes with memory this process may use.
    #[arg(long, default_value = "all", value_parser = NodeSet::parse)]
    pub nodes: NodeSet,
    /// A model file to read instead of writing a temporary one; it needs at least the
    /// model's bytes.
    #[arg(long, value_name = "PATH")]
    pub file: Option<PathBuf>,
    /// Loader threads [default: one per CPU this process may run on].
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub threads: Option<usize>,
    /// Do not ask for transparent huge pages (`MADV_HUGEPAGE`) on the regions.
    #[arg(long)]
    pub no_huge_pages: bool,
    /// Also load the model one slab per expert, each bound on its own (as engines did
    /// before), and print both.
    #[arg(long)]
    pub baseline: bool,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    pub json: bool,
    /// Purge every jemalloc arena after the load and print RSS before and after
    /// [default: on when built with `--features jemalloc`, which it needs].
    #[arg(long, overrides_with = "no_purge")]
    pub purge: bool,
    /// Do not purge jemalloc's arenas after the load.
    #[arg(long, overrides_with = "purge")]
    pub no_purge: bool,
    /// How the loaders read the file: `auto` (per file: buffered when the page cache
    /// holds most of it, else direct; the report says which and why), `buffered` (through the page cache), `direct`
    /// (O_DIRECT: the page cache stays empty; falls back to buffered where the file
    /// system cannot, and says so) or `drop-behind` (buffered, evicted as it goes).
    #[arg(long, value_name = "MODE", default_value_t = ReadMode::Auto, value_parser = parse_read_mode)]
    pub read: ReadMode,
    /// With `--read direct`: blocking reads on the loader threads instead of `io_uring`
    /// (which is used where the kernel allows it; the report says which ran).
    #[arg(long)]
    pub no_io_uring: bool,
    /// A checkpoint to pin instead of the synthetic model: a `.safetensors` file, a
    /// directory of safetensors shards (with or without `model.safetensors.index.json`),
    /// a `.gguf` file or the first part of a split GGUF. The MoE experts are packed, every
    /// slot is re-read from the files (with --read's mode) and compared: "verified" means
    /// the slots hold what the plan named. The plan itself must be complete (every expert
    /// has every role of its naming: gate, up, down or gate_up, down, and their scales;
    /// every MoE layer a config.json beside it names), or nothing is packed; `--json`
    /// says `"complete":true`.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// With --model: place every tensor of the checkpoint, not only the experts, under a
    /// plan: the default plan over --nodes (`default`), changed by `KEY=VALUE` items
    /// separated by `,` or `;`. KEY: `experts`, `dense` (every dense class), a class
    /// (`shared`, `attention`, `dense_mlp`, `norms`, `embeddings`, `head`, `global`) or a
    /// name pattern (`*.self_attn.*`, `?` one character). VALUE: `split:NODES`,
    /// `interleave:NODES`, `replicate:NODES`, `layer-per-node:NODES` (experts),
    /// `replicate:NODES`, `interleave:NODES`, `bind:NODE`, `unplaced` (dense). E.g.
    /// `experts=split:all,dense=replicate:all,embeddings=interleave:all`
    /// (docs/whole-model.md).
    #[arg(long, value_name = "PLAN", requires = "model")]
    pub plan: Option<String>,
    /// With --model: the slice of every expert tensor this rank places (tensor
    /// parallelism): `rows:k/n` or `columns:k/n` (the k-th of n equal parts of the
    /// outermost or innermost axis), or `rows:START:LEN`. A cut through a quantization or
    /// scale block is refused, naming the block. With --plan: the rows of every 2-D
    /// dense tensor of the sliceable classes (attention, dense MLP, shared experts,
    /// embeddings, head; 1-D tensors and norms whole), the routed experts then held whole
    /// under --experts' share. `tp:k/n`: rank k of a tensor-parallel group of n, as
    /// vLLM and SGLang split weights (column-parallel q/k/v/gate/up, embeddings and head
    /// by rows, row-parallel o/down by columns, norms and routers whole; routed experts
    /// gate/up by rows, down by columns; docs/distributed.md).
    #[arg(long, value_name = "AXIS:k/n|AXIS:START:LEN|tp:k/n", value_parser = slice_arg)]
    pub(crate) slice: Option<SliceArg>,
    /// With --plan and `--slice tp:k/n`: rank k of n's share is the framework's own
    /// tensor-parallel plan instead of the preset — a JSON object of module glob → style
    /// in transformers' vocabulary (`{"layers.*.self_attn.q_proj": "colwise",
    /// "layers.*.self_attn.o_proj": "rowwise", "embed_tokens": "embedding_rowwise"}`):
    /// colwise rows k/n, rowwise columns k/n, embedding_rowwise vocabulary rows,
    /// replicate or unnamed whole; routed experts whole under --experts' share. An
    /// unknown style, a cut that does not divide its axis or splits an attention head
    /// is refused by name before anything is reserved (docs/distributed.md).
    #[arg(long, value_name = "FILE", requires = "plan")]
    pub framework_plan: Option<PathBuf>,
    /// No progress bar (one is drawn on stderr when it is a terminal, never with --json).
    #[arg(long)]
    pub no_progress: bool,
    /// With --model: load nothing; print the planner's table of candidate layouts for the
    /// checkpoint's header on this machine (or --topology's) and its recommendation
    /// (docs/planner.md).
    #[arg(long, requires = "model")]
    pub plan_only: bool,
    /// With --plan-only: plan for the machine a topology description file describes
    /// (nodes, domains, distances, free bytes, map limit) instead of this one.
    #[arg(long, value_name = "FILE", requires = "plan_only")]
    pub topology: Option<PathBuf>,
    /// With --plan-only: routing statistics (counts per layer and expert, JSON).
    #[arg(long, value_name = "FILE", requires = "plan_only")]
    pub routing: Option<PathBuf>,
    /// With --plan-only: bytes per node the layouts may use [default: each node's free
    /// memory].
    #[arg(long, value_name = "BYTES", requires = "plan_only", value_parser = budget_bytes)]
    pub budget: Option<u64>,
}

/// A byte count, with an optional binary suffix (`512G`, `192GiB`, `4096`, `4096B`):
/// decimal digits, then nothing, `B`, or one of `KMGT` (either case) alone or with `B`
/// or `iB`. Anything else (`5iB`, `5BB`, `+5`, `1.5G`) is refused.
fn budget_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let (shift, rest) = match unit.chars().next() {
        Some('K' | 'k') => (10, &unit[1..]),
        Some('M' | 'm') => (20, &unit[1..]),
        Some('G' | 'g') => (30, &unit[1..]),
        Some('T' | 't') => (40, &unit[1..]),
        _ => (0, unit),
    };
    let unit_ok = if shift == 0 {
        matches!(rest, "" | "B")
    } else {
        matches!(rest, "" | "B" | "iB")
    };
    if digits.is_empty() || !unit_ok {
        return Err(format!(
            "{text:?}: a byte count is decimal digits and an optional unit (B, K, M, G, T, \
             KiB, ...)"
        ));
    }
    let n = digits.parse::<u64>().map_err(|e| format!("{text}: {e}"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text}: more than 2^64 bytes"))
}

fn parse_read_mode(text: &str) -> Result<ReadMode, String> {
    text.parse::<ReadMode>().map_err(|e| e.to_string())
}

impl PinModelArgs {
    /// Parses and checks `args` (the program name first), as `main` does with the
    /// process's arguments.
    ///
    /// # Errors
    /// clap's error for a bad or unknown flag, `--help` (kind `DisplayHelp`), or
    /// `--purge` without the `jemalloc` feature (kind `ArgumentConflict`).
    pub fn try_parse_checked<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Self::from_matches_checked(&Self::command().try_get_matches_from(args)?, Self::command)
    }

    /// [`PinModelArgs::try_parse_checked`] for matches already made (`numapin place`'s);
    /// `command` makes the command a usage error names (`pin_model`, `numapin place`).
    ///
    /// # Errors
    /// As [`PinModelArgs::try_parse_checked`].
    pub(crate) fn from_matches_checked(
        matches: &ArgMatches,
        command: impl Fn() -> clap::Command,
    ) -> Result<Self, clap::Error> {
        let mut args = Self::from_arg_matches(matches)?;
        args.experts_given =
            matches.value_source("experts") == Some(clap::parser::ValueSource::CommandLine);
        if args.model.is_none() {
            if args.slice.is_some() {
                return Err(command().error(
                    ErrorKind::ArgumentConflict,
                    "--slice needs --model: the synthetic model has no tensors to slice",
                ));
            }
            if args.experts.count.is_none() {
                return Err(command().error(
                    ErrorKind::ValueValidation,
                    "--experts takes a count (at least 1) for the synthetic model; a share (ids, ranges, k/n) needs --model",
                ));
            }
        }
        if args.purge && !cfg!(feature = "jemalloc") {
            return Err(command().error(
                ErrorKind::ArgumentConflict,
                "--purge needs jemalloc: build with `--features jemalloc`",
            ));
        }
        Ok(args)
    }

    /// The synthetic model the flags describe.
    pub fn synthetic(&self) -> SyntheticModel {
        SyntheticModel {
            layers: self.layers,
            experts: self
                .experts
                .count
                .unwrap_or(SyntheticModel::default().experts),
            weight_bytes: self.weight_bytes,
            scale_bytes: self.scale_bytes,
        }
    }

    /// Whether to purge jemalloc after the load: `--purge`, `--no-purge` (the last one
    /// given wins), else on exactly when built with jemalloc.
    pub fn purge(&self) -> bool {
        self.purge || (!self.no_purge && cfg!(feature = "jemalloc"))
    }

    /// With --model: the share `--experts` and `--slice` ask for (the whole checkpoint
    /// without either).
    pub fn share(&self) -> Share {
        let mut share = Share::default();
        if self.experts_given {
            share = share.experts(self.experts.share.clone());
        }
        match self.slice {
            Some(SliceArg::Slice(slice)) => share = share.slice(slice),
            // Checked when parsed (n > 0, k < n).
            Some(SliceArg::Tp(k, n)) => {
                share = share.clone().tensor_parallel(k, n).unwrap_or(share);
            }
            None => {}
        }
        share
    }

    /// `--layout` over `--nodes`.
    pub fn layout(&self) -> Layout {
        self.layout.layout(self.nodes)
    }
}

/// Print what numapin finds on this machine and what this process may do there.
///
/// The NUMA calls (each group probed once, in a form that needs no capability), the
/// nodes, their distances and free memory, numa_balancing, THP, the mapping budget and
/// the capabilities that matter; then one line saying what placement will do here.
#[derive(Debug, Clone, Parser)]
#[command(name = "probe")]
pub struct ProbeArgs {
    /// Print one JSON object (`numapin::Support` field by field, the allowed nodes and
    /// the verdict) instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Which layout for a checkpoint, and why (nothing is loaded).
///
/// The planner's table of candidate layouts for the checkpoint's header on this machine
/// or --topology's, and its recommendation (docs/planner.md). `place --model PATH
/// --plan-only` does the same.
#[derive(Debug, Clone, Parser)]
#[command(name = "plan")]
pub(crate) struct PlanArgs {
    /// The checkpoint, as `place --model` takes it (a `.safetensors` file, a directory of
    /// shards, a `.gguf` file or the first part of a split GGUF).
    #[arg(value_name = "MODEL")]
    pub(crate) model: PathBuf,
    /// Plan for the machine a topology description file describes (nodes, domains,
    /// distances, free bytes, map limit) instead of this one.
    #[arg(long, value_name = "FILE")]
    pub(crate) topology: Option<PathBuf>,
    /// Routing statistics (counts per layer and expert, JSON).
    #[arg(long, value_name = "FILE")]
    pub(crate) routing: Option<PathBuf>,
    /// Bytes per node the layouts may use [default: each node's free memory].
    #[arg(long, value_name = "BYTES", value_parser = budget_bytes)]
    pub(crate) budget: Option<u64>,
    /// Print the table as one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
}

impl PinModelArgs {
    /// `--plan-only`'s request, in the form `numapin plan` takes; `None` without --model.
    pub(crate) fn plan_args(&self) -> Option<PlanArgs> {
        Some(PlanArgs {
            model: self.model.clone()?,
            topology: self.topology.clone(),
            routing: self.routing.clone(),
            budget: self.budget,
            json: self.json,
        })
    }
}

/// The largest process id the kernel hands out (`PID_MAX_LIMIT` on 64-bit: 2^22).
pub(crate) const PID_MAX_LIMIT: u64 = 1 << 22;

/// Where a running process's memory is, per mapping and per node.
///
/// Reads `/proc/PID/numa_maps` (each mapping's policy and pages per node) and
/// `/proc/PID/maps` (its name), like `numastat -p PID` but per mapping: numapin's
/// mappings first (a shared store's memfds, `memfd:numapin-layer3-weights`; anonymous
/// regions as `[anon:numapin …]` where the kernel names anonymous mappings), then the
/// totals per node of numapin's mappings and of the whole process.
#[derive(Debug, Clone, Parser)]
#[command(name = "stat")]
pub(crate) struct StatArgs {
    /// The process to read (decimal, 1 to 4194304).
    #[arg(value_name = "PID", value_parser = pid_arg)]
    pub(crate) pid: u32,
    /// List every mapping with pages, not only numapin's.
    #[arg(long)]
    pub(crate) all: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// A process id: decimal digits, 1 to [`PID_MAX_LIMIT`].
fn pid_arg(text: &str) -> Result<u32, String> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err("a process id is decimal digits".into());
    }
    match text.parse::<u64>() {
        Ok(0) => Err("0 is not a process id (they start at 1)".into()),
        Ok(n) if n <= PID_MAX_LIMIT => u32::try_from(n).map_err(|e| e.to_string()),
        _ => Err(format!(
            "larger than any process id (the kernel's limit is {PID_MAX_LIMIT})"
        )),
    }
}
