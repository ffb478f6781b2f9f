//! The faults of the rendezvous by name (`numapin::serve`): one [`Error::Serve`] variant,
//! told apart by a [`ServeFault`].

use std::fmt;

use super::{Error, clip_owned};

/// What went wrong serving or fetching a placement by name ([`Error::Serve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServeFault {
    /// The name, with its prefix, does not fit a socket address (`sun_path`: 108 bytes
    /// with the terminating or leading NUL).
    NameTooLong,
    /// The name is empty or holds a character outside `[A-Za-z0-9._:+-]` (or starts
    /// with a dot).
    BadName,
    /// Another live process serves the name already.
    InUse,
    /// Nobody serves the name (no such socket, or an abstract name nobody holds).
    NotServed,
    /// A socket file is there, and nobody listens on it: its server died.
    StaleSocket,
    /// The socket's directory is not private: not ours, or writable (or readable) by
    /// others.
    UnsafeDirectory,
    /// The peer runs as a uid this side does not accept (`SO_PEERCRED`).
    PeerUid,
    /// The server closed the connection before sending anything: it refuses this uid, or
    /// it is exiting (or failed to place).
    Closed,
    /// Nothing (or not everything) arrived within the time allowed.
    Timeout,
    /// The message ended early.
    Truncated,
    /// The message (the manifest, the file count, or trailing bytes) is larger than
    /// announced or allowed.
    Oversized,
    /// The message is not this protocol's: magic, version, or a chunk's header.
    BadMessage,
    /// File descriptors arrived where none were announced, more or fewer than
    /// announced, or more than allowed.
    FdCount,
    /// A file descriptor is not a memfd sealed against writing, shrinking and growing.
    FdKind,
}

impl fmt::Display for ServeFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ServeFault::NameTooLong => "name too long for a socket address",
            ServeFault::BadName => "bad name",
            ServeFault::InUse => "name served already",
            ServeFault::NotServed => "not served",
            ServeFault::StaleSocket => "stale socket",
            ServeFault::UnsafeDirectory => "unsafe socket directory",
            ServeFault::PeerUid => "peer of another uid",
            ServeFault::Closed => "closed by the server",
            ServeFault::Timeout => "timed out",
            ServeFault::Truncated => "truncated message",
            ServeFault::Oversized => "oversized message",
            ServeFault::BadMessage => "not a numapin serve message",
            ServeFault::FdCount => "wrong file descriptor count",
            ServeFault::FdKind => "file descriptor of the wrong kind",
        })
    }
}

impl ServeFault {
    /// The `io::ErrorKind` an [`Error::Serve`] of this fault becomes.
    pub(crate) fn io_kind(self) -> std::io::ErrorKind {
        use std::io::ErrorKind as K;
        match self {
            ServeFault::NameTooLong | ServeFault::BadName => K::InvalidInput,
            ServeFault::InUse => K::AddrInUse,
            ServeFault::NotServed | ServeFault::StaleSocket => K::NotFound,
            ServeFault::UnsafeDirectory | ServeFault::PeerUid => K::PermissionDenied,
            ServeFault::Closed => K::ConnectionAborted,
            ServeFault::Timeout => K::TimedOut,
            ServeFault::Truncated => K::UnexpectedEof,
            ServeFault::Oversized
            | ServeFault::BadMessage
            | ServeFault::FdCount
            | ServeFault::FdKind => K::InvalidData,
        }
    }
}

impl Error {
    /// A rendezvous fault for the served `name`.
    pub(crate) fn serve(
        op: &'static str,
        name: &str,
        fault: ServeFault,
        detail: impl Into<String>,
    ) -> Self {
        Error::Serve {
            op,
            name: clip_owned(name.to_string(), 128),
            fault,
            detail: clip_owned(detail.into(), 512),
        }
    }

    /// The fault of an [`Error::Serve`], `None` for every other error.
    pub fn serve_fault(&self) -> Option<ServeFault> {
        match self {
            Error::Serve { fault, .. } => Some(*fault),
            _ => None,
        }
    }
}
