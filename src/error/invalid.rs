//! [`Invalid`]: what was wrong with an argument, the typed detail of
//! [`Error::InvalidArgument`](super::Error::InvalidArgument).

use std::fmt;

use super::quote::{REASON_MAX, clip_owned};

#[cfg(doc)]
use super::Error;

/// What was wrong with an argument: the detail of [`Error::InvalidArgument`].
///
/// The conditions a caller can react to are variants with the offending figures as
/// fields; [`Invalid::Other`] is free text for the rest. The `what` fields name the
/// argument for people (with its context: `"layer 3 expert 5 weights"`); match on the
/// variant and the numbers, not on that text.
///
/// ```
/// use numapin::{Error, Invalid, Region};
/// let mut r = Region::anonymous(numapin::page_size()).unwrap();
/// match r.release(1..numapin::page_size()) {
///     Err(Error::InvalidArgument { reason: Invalid::Misaligned { value: 1, .. }, .. }) => {}
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalid {
    /// An address, offset or length that must be a multiple of `align` is not.
    Misaligned {
        /// What it is (`"address"`, `"start"`).
        what: String,
        /// The value given.
        value: u64,
        /// The alignment it needs, in bytes (the page size, a huge page, direct I/O's).
        align: u64,
    },
    /// A byte range (or a single offset: `start == end`) that does not lie inside what it
    /// addresses: it runs past the end, or it is reversed (`start > end`).
    OutOfBounds {
        /// What it is (`"range"`, `"offset"`, with context).
        what: String,
        /// Its first byte.
        start: u64,
        /// Its end (exclusive); `start` for a single offset.
        end: u64,
        /// Bytes in what it should lie inside.
        len: u64,
        /// What it should lie inside (`"the region"`, `"the file"`).
        within: &'static str,
    },
    /// Arithmetic on the arguments overflows (`usize` or `u64`): sizes that cannot exist.
    Overflow {
        /// The computation (`"len 4096 + align 2097152"`).
        what: String,
    },
    /// An option or argument has a value it does not take.
    BadValue {
        /// The option or argument (`"SlotAlign"`, `"piece_align"`, `"read mode"`).
        what: &'static str,
        /// The value given, formatted.
        value: String,
        /// What it should be, or why it is refused.
        why: String,
    },
    /// Bytes that do not fit where they must go.
    TooLarge {
        /// What they are (`"layer 0 expert 3 weights"`).
        what: String,
        /// Their size, in bytes.
        size: u64,
        /// The room there is, in bytes.
        max: u64,
        /// Where they must go (`"the slot"`, `"the buffer"`).
        within: &'static str,
    },
    /// Two counts that must agree do not.
    Mismatch {
        /// What is counted, and against what.
        what: String,
        /// The count needed.
        expected: u64,
        /// The count given.
        found: u64,
    },
    /// Something that needs at least one (a node set, a length, a thread count) has none.
    Empty {
        /// What there is none of (`"nodes in the cache's node set"`).
        what: String,
    },
    /// A node id that cannot exist: beyond the ids a kernel mask holds, or beyond this
    /// machine's possible nodes.
    NoSuchNode {
        /// What named it (a policy, a target set).
        what: String,
        /// The node id.
        node: usize,
        /// Ids below this one can exist.
        limit: usize,
        /// This machine's possible node ids and nodes with memory, when `limit` is the
        /// machine's; `None` when it is the kernel mask's (`MAX_NODES`).
        machine: Option<String>,
    },
    /// The mapping (or store) is not of a kind this operation works on: read-only, sealed,
    /// lost, not a memfd, a shared file mapping that the page cache places.
    WrongBacking {
        /// What it is (with the addresses or file when they are known).
        found: String,
        /// What the operation needs.
        needed: &'static str,
    },
    /// Anything else, in words.
    Other(String),
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Invalid::Misaligned { what, value, align } => {
                write!(f, "{what} {value:#x} is not aligned to {align} bytes")
            }
            Invalid::OutOfBounds {
                what,
                start,
                end,
                len,
                within,
            } => {
                if start > end {
                    write!(
                        f,
                        "{what} {start}..{end} is reversed ({within} has {len} bytes)"
                    )
                } else if start == end {
                    write!(
                        f,
                        "{what} {start} is past the end of {within} ({len} bytes)"
                    )
                } else {
                    write!(
                        f,
                        "{what} {start}..{end} runs past the end of {within} ({len} bytes)"
                    )
                }
            }
            Invalid::Overflow { what } => write!(f, "{what} overflows"),
            Invalid::BadValue { what, value, why } => write!(f, "{what} {value}: {why}"),
            Invalid::TooLarge {
                what,
                size,
                max,
                within,
            } => write!(f, "{what}: {size} bytes but {within} holds {max}"),
            Invalid::Mismatch {
                what,
                expected,
                found,
            } => write!(f, "{what}: {expected} expected but {found} given"),
            Invalid::Empty { what } => write!(f, "no {what}"),
            Invalid::NoSuchNode {
                what,
                node,
                limit,
                machine,
            } => match machine {
                Some(machine) => write!(
                    f,
                    "{what}: node {node} does not exist on this machine, whose kernel has {machine}"
                ),
                None => write!(
                    f,
                    "{what}: node {node} is beyond the {limit} node ids a kernel mask holds"
                ),
            },
            Invalid::WrongBacking { found, needed } => write!(f, "{found}; this needs {needed}"),
            Invalid::Other(text) => f.write_str(text),
        }
    }
}

impl Invalid {
    /// Its text fields, its subject first (`what`, the bad value, the backing found, the
    /// free text), then `why` or the machine's nodes where it has them.
    fn texts(&mut self) -> [Option<&mut String>; 2] {
        match self {
            Invalid::Misaligned { what, .. }
            | Invalid::OutOfBounds { what, .. }
            | Invalid::Overflow { what }
            | Invalid::TooLarge { what, .. }
            | Invalid::Mismatch { what, .. }
            | Invalid::Empty { what }
            | Invalid::WrongBacking { found: what, .. }
            | Invalid::Other(what) => [Some(what), None],
            Invalid::BadValue { value, why, .. } => [Some(value), Some(why)],
            Invalid::NoSuchNode { what, machine, .. } => [Some(what), machine.as_mut()],
        }
    }

    /// The same detail, its subject followed by `context` in parentheses (free text
    /// after it): where a caller met it (`"ModelManifest::parse of the model served as
    /// \"m\""`). The variant and its figures are kept, so a caller still matches on them.
    pub(crate) fn within(mut self, context: &str) -> Invalid {
        match &mut self {
            Invalid::Other(text) => *text = format!("{context}: {text}"),
            other => {
                if let [Some(subject), _] = other.texts() {
                    subject.push_str(&format!(" ({context})"));
                }
            }
        }
        self.bounded()
    }

    /// Each text field cut to [`REASON_MAX`] bytes (with its length): the backstop behind
    /// the call sites' [`quote`](super::quote), so that no message repeats the megabytes a
    /// caller or a file chose.
    pub(super) fn bounded(mut self) -> Invalid {
        for text in self.texts().into_iter().flatten() {
            if text.len() > REASON_MAX {
                *text = clip_owned(std::mem::take(text), REASON_MAX);
            }
        }
        self
    }
}

/// A size or count as `u64` (saturating: no size of this crate exceeds it on Linux).
pub(crate) fn wide(n: impl TryInto<u64>) -> u64 {
    n.try_into().unwrap_or(u64::MAX)
}
