//! The constructors every module builds its errors with: one per kind of [`Invalid`]
//! detail, so that a call site names the condition and the values, and the message is
//! worded in one place.

use std::fmt;

use super::quote::{PATH_MAX, REASON_MAX};
use super::{CheckpointFault, Errno, Error, Invalid, QUOTE_MAX, clip, clip_owned, wide};

impl Error {
    pub(crate) fn os(op: &'static str, errno: Errno, args: impl fmt::Display) -> Self {
        Error::Os {
            op,
            errno,
            args: args.to_string(),
        }
    }

    /// An invalid argument of a kind nobody matches on: [`Invalid::Other`]. The
    /// conditions a caller reacts to have their own constructors below.
    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        Self::invalid_because(op, Invalid::Other(reason.into()))
    }

    /// An invalid argument with a typed detail; each of its texts cut to
    /// [`REASON_MAX`] bytes, a backstop behind the call sites' [`quote`](fn@super::quote).
    pub(crate) fn invalid_because(op: &'static str, reason: Invalid) -> Self {
        Error::InvalidArgument {
            op,
            reason: reason.bounded(),
        }
    }

    /// [`Invalid::Misaligned`].
    pub(crate) fn misaligned(
        op: &'static str,
        what: impl Into<String>,
        value: impl TryInto<u64>,
        align: impl TryInto<u64>,
    ) -> Self {
        Self::invalid_because(
            op,
            Invalid::Misaligned {
                what: what.into(),
                value: wide(value),
                align: wide(align),
            },
        )
    }

    /// [`Invalid::OutOfBounds`]: `range` (a single offset is `offset..offset`) is not
    /// inside `within`, which holds `len` bytes.
    pub(crate) fn out_of_bounds(
        op: &'static str,
        what: impl Into<String>,
        range: std::ops::Range<u64>,
        len: impl TryInto<u64>,
        within: &'static str,
    ) -> Self {
        Self::invalid_because(
            op,
            Invalid::OutOfBounds {
                what: what.into(),
                start: range.start,
                end: range.end,
                len: wide(len),
                within,
            },
        )
    }

    /// [`Invalid::Overflow`].
    pub(crate) fn overflow(op: &'static str, what: impl Into<String>) -> Self {
        Self::invalid_because(op, Invalid::Overflow { what: what.into() })
    }

    /// [`Invalid::BadValue`].
    pub(crate) fn bad_value(
        op: &'static str,
        what: &'static str,
        value: impl fmt::Display,
        why: impl Into<String>,
    ) -> Self {
        Self::invalid_because(
            op,
            Invalid::BadValue {
                what,
                value: value.to_string(),
                why: why.into(),
            },
        )
    }

    /// [`Invalid::TooLarge`].
    pub(crate) fn too_large(
        op: &'static str,
        what: impl Into<String>,
        size: impl TryInto<u64>,
        max: impl TryInto<u64>,
        within: &'static str,
    ) -> Self {
        Self::invalid_because(
            op,
            Invalid::TooLarge {
                what: what.into(),
                size: wide(size),
                max: wide(max),
                within,
            },
        )
    }

    /// [`Invalid::Mismatch`].
    pub(crate) fn mismatch(
        op: &'static str,
        what: impl Into<String>,
        expected: impl TryInto<u64>,
        found: impl TryInto<u64>,
    ) -> Self {
        Self::invalid_because(
            op,
            Invalid::Mismatch {
                what: what.into(),
                expected: wide(expected),
                found: wide(found),
            },
        )
    }

    /// [`Invalid::Empty`].
    pub(crate) fn empty(op: &'static str, what: impl Into<String>) -> Self {
        Self::invalid_because(op, Invalid::Empty { what: what.into() })
    }

    /// [`Invalid::NoSuchNode`].
    pub(crate) fn no_such_node(
        op: &'static str,
        what: impl Into<String>,
        node: usize,
        limit: usize,
        machine: Option<String>,
    ) -> Self {
        Self::invalid_because(
            op,
            Invalid::NoSuchNode {
                what: what.into(),
                node,
                limit,
                machine,
            },
        )
    }

    /// [`Invalid::WrongBacking`].
    pub(crate) fn wrong_backing(
        op: &'static str,
        found: impl Into<String>,
        needed: &'static str,
    ) -> Self {
        Self::invalid_because(
            op,
            Invalid::WrongBacking {
                found: found.into(),
                needed,
            },
        )
    }

    /// A checkpoint error. The tensor name is clipped to [`QUOTE_MAX`] bytes (with its
    /// length), the file to [`PATH_MAX`] and the reason to [`REASON_MAX`]: each may quote
    /// what a file chose, and a file may choose megabytes. Callers quote file-chosen
    /// values in the reason with [`quote`](fn@super::quote) and lists with
    /// [`quote_list`](fn@super::quote_list); the reason's cap is a backstop.
    #[cfg_attr(not(feature = "model"), allow(dead_code))]
    pub(crate) fn checkpoint(
        file: impl Into<String>,
        tensor: Option<&str>,
        kind: CheckpointFault,
        reason: impl Into<String>,
    ) -> Self {
        Error::Checkpoint {
            file: clip_owned(file.into(), PATH_MAX),
            tensor: tensor.map(|t| match clip(t, QUOTE_MAX) {
                (t, false) => t.to_owned(),
                (head, true) => format!("{head}… ({} bytes)", t.len()),
            }),
            kind,
            reason: clip_owned(reason.into(), REASON_MAX),
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            // A path may come from a file (a shard named by an index): bounded as well.
            path: clip_owned(path.into(), PATH_MAX),
            source: std::sync::Arc::new(source),
        }
    }
}
