//! One error type that keeps the story: which call, which errno, which arguments.

mod build;
mod errno;
mod invalid;
mod number;
mod quote;
mod serve;

use std::fmt;

use errno::{errno_meaning, errno_name};
pub use invalid::Invalid;
use invalid::wide;
pub(crate) use number::decimal;
pub(crate) use quote::{QUOTE_MAX, clip, clip_owned, quote, quote_list, shown};
pub use serve::ServeFault;

use crate::nodeset::{Node, NodeSet};

pub use rustix::io::Errno;

/// Everything numapin can fail with.
///
/// Kernel failures keep the operation name and the errno ([`Error::errno`]) plus the
/// arguments that explain them; checks done in Rust before any call are
/// [`Error::InvalidArgument`] and carry no errno. `EPERM` and `ENOSYS` from the policy
/// calls are not errors at all: they come back as a
/// [`Placement::Degraded`](crate::policy::Placement::Degraded) value.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A syscall failed.
    #[error("{op}({args}) failed: {errno_name} ({errno_code}): {meaning}", errno_name = errno_name(*.errno), errno_code = .errno.raw_os_error(), meaning = errno_meaning(op, *.errno))]
    Os {
        /// The call, as its C name (`"mbind"`).
        op: &'static str,
        /// What the kernel answered.
        errno: Errno,
        /// The arguments that matter, formatted (`addr=0x7f.. len=4096 policy=bind:1`).
        args: String,
    },
    /// An argument was rejected before any call was made.
    ///
    /// One variant with a typed [`Invalid`] detail, not one top-level variant per
    /// condition: a caller that only wants "was this my argument?" matches
    /// `InvalidArgument { .. }` (as before, and as `From<Error> for io::Error` does for
    /// `InvalidInput`), and a caller that reacts to a condition matches the detail
    /// (`reason: Invalid::Misaligned { .. }`) — hwlocality keeps Rust-side validation apart
    /// from OS errors the same way.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The operation that refused.
        op: &'static str,
        /// What was wrong, with the offending values.
        reason: Invalid,
    },
    /// A text argument did not parse: a node string, an expert share, a tensor slice, a
    /// rank.
    #[error("invalid {what} {input:?}: {reason} (at {part:?})")]
    Parse {
        /// What the parser reads (`"node string"`, `"expert share"`, `"tensor slice"`,
        /// `"tensor-parallel rank"`).
        what: &'static str,
        /// The whole input (clipped).
        input: String,
        /// The piece that is wrong.
        part: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The kernel's capability check refused a call the probe found allowed here: a
    /// missing capability, not a container's denial (which is
    /// [`Placement::Degraded`](crate::policy::Placement::Degraded)).
    #[error(
        "{op}: needs {cap}, which this process lacks here: {why}. Run as root outside a user \
         namespace, grant the capability (`setcap cap_sys_nice+ep`, or `--cap-add SYS_NICE` \
         for a container), or leave out what needs it"
    )]
    MissingCapability {
        /// The operation that needs it (`"mbind"`, `"migrate_pages"`).
        op: &'static str,
        /// The capability, as its C name (`"CAP_SYS_NICE"`).
        cap: &'static str,
        /// What needed it, with the arguments.
        why: String,
    },
    /// Locking would exceed `RLIMIT_MEMLOCK`.
    #[error(
        "mlock of {wanted} bytes would exceed RLIMIT_MEMLOCK: {locked} bytes already locked, limit {limit} bytes \
         (raise it with `ulimit -l`, LimitMEMLOCK= in systemd, or grant CAP_IPC_LOCK)"
    )]
    MemlockLimit {
        /// Bytes this call wanted to lock.
        wanted: u64,
        /// Bytes the process had locked already (`VmLck`).
        locked: u64,
        /// The soft limit.
        limit: u64,
    },
    /// Too few hugetlbfs pages are reserved for a huge-page memfd.
    #[error(
        "{wanted} huge pages of {page_bytes} bytes wanted, {available} free{}: reserve them with \
         `sysctl -w vm.nr_hugepages=N` (2 MiB pages) or \
         /sys/kernel/mm/hugepages/hugepages-<size>kB/nr_hugepages, or at boot with hugepages=N",
        if *offered { "" } else { " (this kernel offers no pages of that size)" }
    )]
    HugePages {
        /// Bytes per huge page.
        page_bytes: usize,
        /// Pages the region needs.
        wanted: usize,
        /// Pages free and unreserved.
        available: usize,
        /// Whether the kernel has a pool of that size at all.
        offered: bool,
    },
    /// Reserving more mappings would cross `vm.max_map_count`.
    #[error(
        "{what} needs {needed} more mappings (its regions and its loader threads' stacks), but \
         only {available} are left: vm.max_map_count (or the store's budget) is {limit} and \
         this process already has {current} \
         (raise it with `sysctl -w vm.max_map_count=N`, or load fewer layers)"
    )]
    MapBudget {
        /// What was being reserved.
        what: String,
        /// Mappings it needs.
        needed: usize,
        /// `limit - current`, saturating.
        available: usize,
        /// `vm.max_map_count`, or the budget set in the store's options.
        limit: usize,
        /// Mappings the process has now.
        current: usize,
    },
    /// Memory bound to nodes (the replicas of [`Layout::Replicate`]) would not fit in
    /// what those nodes have available: refused before anything is mapped, instead of an
    /// OOM kill halfway.
    ///
    /// [`Layout::Replicate`]: crate::store::Layout::Replicate
    #[error(
        "{what} needs {needed} bytes on each of the nodes {}, but {}: the figure is {figure}",
        nodes_of(.available),
        short_of(.available, *.needed)
    )]
    NodeMemory {
        /// What was being placed.
        what: String,
        /// Bytes it needs on each node.
        needed: u64,
        /// Bytes available on each node it needs, by the figure below.
        available: Vec<(Node, u64)>,
        /// Which per-node figure `available` is (and why that one).
        figure: &'static str,
    },
    /// A layer that is not packed (or not attached) was asked for.
    #[error("{op}: layer {layer} is not packed")]
    NotPacked {
        /// The operation.
        op: &'static str,
        /// The layer.
        layer: usize,
    },
    /// A layer was packed twice, or is being packed by another thread right now.
    #[error("{op}: layer {layer} is {}", if *.in_progress { "being packed by another thread" } else { "already packed" })]
    AlreadyPacked {
        /// The operation.
        op: &'static str,
        /// The layer.
        layer: usize,
        /// Another thread's `pack_layer` of the same layer has not finished.
        in_progress: bool,
    },
    /// A layer's load was stopped by its progress hook
    /// ([`ProgressHook::cancellable`](crate::store::ProgressHook::cancellable) returned
    /// `Break`): the layer is not packed, and the store is as before the call.
    #[error("{op}: the progress hook cancelled the load of layer {layer}; it is not packed")]
    Cancelled {
        /// The operation.
        op: &'static str,
        /// The layer whose load stopped.
        layer: usize,
    },
    /// A released slot was read: [`PinStore::ensure`](crate::store::PinStore::ensure)
    /// loads it again.
    #[error("{op}: layer {layer} expert {expert} {kind} is released; ensure() loads it again")]
    Released {
        /// The operation.
        op: &'static str,
        /// The layer.
        layer: usize,
        /// The expert.
        expert: usize,
        /// Which tensor, by its kind's name (`"weights"`, `"scales"`: `Kind::name`; a
        /// string so that this leaf module names no store type).
        kind: &'static str,
    },
    /// Every slot of the cache's chosen node is held by a live entry: nothing can be
    /// evicted for a miss (drop entries, or build a larger cache).
    #[error(
        "{op}: layer {layer} expert {expert}: every one of the {capacity} slots on node {node} \
         is held by a live Entry; drop entries or build a larger cache"
    )]
    CacheFull {
        /// The operation.
        op: &'static str,
        /// The layer asked for.
        layer: usize,
        /// The expert asked for.
        expert: usize,
        /// The node whose slots are all held.
        node: Node,
        /// Slots per node.
        capacity: usize,
    },
    /// An index past the end: an expert of a layer, a slot, a node of a set.
    #[error("{op}: {what} {index} is out of range: there are {len}")]
    OutOfRange {
        /// The operation.
        op: &'static str,
        /// What was indexed (`"expert of layer 3"`).
        what: String,
        /// The index asked for.
        index: usize,
        /// How many there are.
        len: usize,
    },
    /// An expert this store (or plan) does not hold: it packed a share of the layer's
    /// experts (a rank's, see `numapin::model::ExpertShare`), and the id asked for is
    /// another rank's.
    #[error("{op}: layer {layer} expert {expert} is not in this share (held: {held})")]
    NotHeld {
        /// The operation.
        op: &'static str,
        /// The layer.
        layer: usize,
        /// The global expert id asked for.
        expert: usize,
        /// The ids held, as ranges (`"0-63,70"`, shortened when long).
        held: String,
    },
    /// A policy names only nodes this process may not allocate on (outside
    /// `mems_allowed`, or without memory): what the kernel's `EINVAL` meant
    /// ([`Error::errno`] says `EINVAL`).
    #[error("{op}: node {node} is not one this process may allocate on (allowed: {allowed})")]
    NodeNotAllowed {
        /// The operation.
        op: &'static str,
        /// The first node that is not allowed.
        node: Node,
        /// The nodes that are (boxed: a `NodeSet` is 128 bytes, and every `Result` of
        /// this crate would carry them).
        allowed: Box<NodeSet>,
    },
    /// A kernel file (procfs, sysfs) held something this crate cannot read.
    #[error("{path}: cannot parse {what}: {found:?}")]
    Unparsable {
        /// The file.
        path: String,
        /// What was expected.
        what: &'static str,
        /// What was there (truncated).
        found: String,
    },
    /// The store was exported (or attached): its memory is sealed, read-only and shared
    /// with other processes, so it no longer changes.
    #[error(
        "{op}: the store is frozen: it was exported or attached, and its memory is sealed \
         read-only and shared with other processes (release, ensure and pack_layer are refused)"
    )]
    Frozen {
        /// The refused operation.
        op: &'static str,
    },
    /// A failed export lost the store's mappings: nothing can be read from it any more
    /// (every read is this error, never a fault).
    #[error("{op}: the store is unusable: {why}")]
    Unusable {
        /// The refused operation.
        op: &'static str,
        /// What went wrong earlier.
        why: String,
    },
    /// A model checkpoint (safetensors or GGUF) is malformed or does not fit the naming.
    #[error("{file}{}: {kind}: {reason}", match tensor { Some(t) => format!(" (tensor {t:?})"), None => String::new() })]
    Checkpoint {
        /// The file (or directory) at fault.
        file: String,
        /// The tensor at fault, when one is.
        tensor: Option<String>,
        /// What kind of fault, for callers that match.
        kind: CheckpointFault,
        /// What is wrong, quoting the offending values.
        reason: String,
    },
    /// Serving or fetching a placement by name (`numapin::serve`) failed: the name, the
    /// socket, the peer, the message or the file descriptors; [`ServeFault`] says which.
    #[error("{op} {name:?}: {fault}: {detail}")]
    Serve {
        /// The operation (`"serve::fetch"`, `"Server::bind"`).
        op: &'static str,
        /// The name served or asked for (clipped).
        name: String,
        /// What went wrong, for callers that match.
        fault: ServeFault,
        /// The values that explain it (clipped).
        detail: String,
    },
    /// Reading a file (a procfs/sysfs entry or a data file) failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`"read"`, `"pread"`).
        op: &'static str,
        /// The file.
        path: String,
        /// The underlying error (shared, so that an `Error` is `Clone`: the threads that
        /// waited for a failed load each get the loader's own error).
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
}

fn nodes_of(available: &[(Node, u64)]) -> String {
    let nodes: Vec<String> = available.iter().map(|(n, _)| n.to_string()).collect();
    nodes.join(",")
}

fn short_of(available: &[(Node, u64)], needed: u64) -> String {
    let short: Vec<String> = available
        .iter()
        .filter(|(_, free)| *free < needed)
        .map(|(n, free)| format!("node {n} has {free}"))
        .collect();
    short.join(", ")
}

impl Error {
    /// The kernel's errno, if this error came from a syscall or file operation;
    /// `EPERM` for a [`Error::MissingCapability`] (the errno the call gets, or would).
    pub fn errno(&self) -> Option<Errno> {
        match self {
            Error::Os { errno, .. } => Some(*errno),
            Error::MissingCapability { .. } => Some(Errno::PERM),
            Error::Io { source, .. } => source.raw_os_error().map(Errno::from_raw_os_error),
            Error::NodeNotAllowed { .. } => Some(Errno::INVAL),
            _ => None,
        }
    }
}

impl From<Error> for std::io::Error {
    /// OS errors become [`std::io::Error::from_raw_os_error`], so that
    /// [`raw_os_error`](std::io::Error::raw_os_error) and `kind()` work as for any
    /// syscall (the operation and arguments are lost: log the numapin error first if
    /// you need them); file errors give back their own `io::Error`. Everything else keeps
    /// its message, as [`std::io::ErrorKind::InvalidInput`] for bad arguments,
    /// `PermissionDenied` for a missing capability, a serve fault as its kind (`TimedOut`,
    /// `NotFound`, `InvalidData`, ...), `Other` otherwise.
    fn from(e: Error) -> Self {
        let kind = match e {
            Error::Io { source, .. } => {
                // The error itself when this was its last holder, else an equal one.
                return std::sync::Arc::try_unwrap(source).unwrap_or_else(|shared| {
                    match shared.raw_os_error() {
                        Some(code) => std::io::Error::from_raw_os_error(code),
                        None => std::io::Error::new(shared.kind(), shared.to_string()),
                    }
                });
            }
            Error::Os { errno, .. } => {
                return std::io::Error::from_raw_os_error(errno.raw_os_error());
            }
            Error::InvalidArgument { .. }
            | Error::Parse { .. }
            | Error::OutOfRange { .. }
            | Error::NotHeld { .. }
            | Error::NodeNotAllowed { .. } => std::io::ErrorKind::InvalidInput,
            Error::MissingCapability { .. } => std::io::ErrorKind::PermissionDenied,
            Error::Serve { fault, .. } => fault.io_kind(),
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, e)
    }
}

/// The kinds of [`Error::Checkpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CheckpointFault {
    /// The file ends inside its header (or a header field points past the end).
    Truncated,
    /// The header is not what the format says: magic, version, UTF-8, JSON, a key's type,
    /// an absurd count or length.
    Header,
    /// A tensor's byte range is reversed, overlaps another, lies outside its data section
    /// or file, or is misaligned.
    Range,
    /// A tensor's byte length does not match its dtype and shape (or overflows).
    Size,
    /// A dtype or ggml type this crate does not know.
    UnknownType,
    /// A tensor name appears twice (in one file or across shards).
    Duplicate,
    /// A shard, a split part or an expert is missing.
    Missing,
    /// The parts of a split set disagree (split count, part number, tensor count).
    Split,
    /// Experts of one layer have different shapes, or a naming does not fit a tensor.
    Shape,
    /// No tensor matched any expert naming.
    NoExperts,
}

impl fmt::Display for CheckpointFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CheckpointFault::Truncated => "truncated",
            CheckpointFault::Header => "bad header",
            CheckpointFault::Range => "bad tensor range",
            CheckpointFault::Size => "size mismatch",
            CheckpointFault::UnknownType => "unknown type",
            CheckpointFault::Duplicate => "duplicate tensor",
            CheckpointFault::Missing => "missing",
            CheckpointFault::Split => "inconsistent split",
            CheckpointFault::Shape => "shape mismatch",
            CheckpointFault::NoExperts => "no experts",
        })
    }
}

/// `Result` with numapin's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::quote::{PATH_MAX, REASON_MAX};
    use super::*;

    #[test]
    fn quote_clips_at_a_char_boundary_and_gives_the_length() {
        assert_eq!(quote("abc"), "\"abc\"");
        let long = "é".repeat(QUOTE_MAX); // 2 bytes each
        let q = quote(&long);
        assert_eq!(
            q,
            format!(
                "\"{}…\" ({} bytes)",
                "é".repeat(QUOTE_MAX / 2),
                2 * QUOTE_MAX
            )
        );
        let odd = format!("a{long}");
        let (head, cut) = clip(&odd, QUOTE_MAX);
        assert!(cut);
        assert_eq!(head.len(), QUOTE_MAX - 1);
    }

    #[test]
    fn quote_list_keeps_a_handful_and_the_count() {
        assert_eq!(quote_list(["a", "b"]), "\"a\", \"b\"");
        let names: Vec<String> = (0..100_000).map(|i| format!("n{i}")).collect();
        let q = quote_list(names.iter().map(String::as_str));
        assert_eq!(
            q,
            "\"n0\", \"n1\", \"n2\", \"n3\", \"n4\" and 99995 more (100000 in all)"
        );
    }

    #[test]
    fn checkpoint_errors_are_bounded() {
        let name = "x".repeat(4 << 20);
        let e = Error::checkpoint(&name, Some(&name), CheckpointFault::Header, name.clone());
        let Error::Checkpoint {
            file,
            tensor,
            reason,
            ..
        } = &e
        else {
            unreachable!()
        };
        assert!(file.len() < PATH_MAX + 32, "{}", file.len());
        assert!(file.ends_with("… (4194304 bytes)"));
        assert!(tensor.as_ref().is_some_and(|t| t.len() < QUOTE_MAX + 32));
        assert!(reason.len() < REASON_MAX + 32);
        assert!(e.to_string().len() < PATH_MAX + QUOTE_MAX + REASON_MAX + 200);
    }

    #[test]
    fn a_detail_within_a_context_keeps_its_variant_and_figures() {
        let m = Invalid::Mismatch {
            what: "layer 3 weights: slots".into(),
            expected: 4,
            found: 3,
        };
        assert_eq!(
            m.within("PlacedModel::attach of \"m\""),
            Invalid::Mismatch {
                what: "layer 3 weights: slots (PlacedModel::attach of \"m\")".into(),
                expected: 4,
                found: 3,
            }
        );
        let b = Invalid::BadValue {
            what: "layer",
            value: "2".into(),
            why: "a copy without its node".into(),
        };
        assert_eq!(
            b.within("here").to_string(),
            "layer 2 (here): a copy without its node"
        );
        let long = Invalid::Other("x".repeat(REASON_MAX * 2)).within("here");
        let Invalid::Other(text) = &long else {
            unreachable!()
        };
        assert!(text.starts_with("here: x") && text.len() < REASON_MAX + 32);
    }
}
