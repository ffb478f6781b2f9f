//! A placement served by name: the first process places and serves its sealed memfds
//! over a Unix socket, later processes fetch them by that name and attach, with no copy.
//!
//! The transport is generic over the payload: a [`Parcel`] is manifest bytes (whatever
//! the attacher parses: `store::Manifest::to_text`, a whole model's manifest) and the
//! files they describe. [`Server::bind`] serves a parcel; [`fetch`] receives one;
//! [`serve_or_attach`] elects the placer.
//!
//! # Names and sockets
//!
//! A name is 1 to 64 bytes of `[A-Za-z0-9._:+-]`, not starting with a dot. Its socket
//! ([`address`]) is, by [`Endpoint`]:
//! - [`Endpoint::Abstract`] (the default): the abstract socket `@numapin-<uid>-<name>`,
//!   `<uid>` the owner's (the server's effective uid). It has no file: it goes away with
//!   its last listener, so it is never stale, and binding it is an atomic election.
//! - [`Endpoint::Runtime`]: the file `<dir>/<name>.sock`, `<dir>` being
//!   `$XDG_RUNTIME_DIR/numapin` when that variable is set, `/run/numapin/<uid>` otherwise.
//! - [`Endpoint::Dir`]: the file `<dir>/<name>.sock` in a directory of the caller's.
//!
//! A socket directory is created 0700 and must be the caller's and writable by no one
//! else ([`ServeFault::UnsafeDirectory`]); the socket file is 0600. A socket file whose
//! server died (connecting is refused) is stale: [`Server::bind`] replaces it, under a
//! lock file beside it so that two processes never both replace it.
//!
//! # Access
//!
//! A server answers a peer only if `SO_PEERCRED` gives it an allowed uid: its own by
//! default, or one of [`Access::uids`]. A refused peer gets nothing: the connection is
//! closed ([`ServeFault::Closed`] on its side). A client accepts a server only if it runs
//! as the owner uid it asked for ([`Limits::owner`], its own by default): a process of
//! another uid squatting an abstract name is refused ([`ServeFault::PeerUid`]).
//!
//! [`ServeFault::UnsafeDirectory`]: crate::ServeFault::UnsafeDirectory
//! [`ServeFault::Closed`]: crate::ServeFault::Closed
//! [`ServeFault::PeerUid`]: crate::ServeFault::PeerUid
//!
//! # The wire
//!
//! One connection, one parcel, server to client: a 24-byte header (`NUMAPIN\0`, version
//! `u32` = 1, file count `u32`, manifest length `u64`, little-endian), then the files in
//! chunks of at most [`FDS_PER_CHUNK`] (the kernel's `SCM_MAX_FD` is 253), each one byte
//! (its count) carrying the fds as `SCM_RIGHTS`, then the manifest bytes; then the server
//! closes. The client reads nothing more than the header announced, within
//! [`Limits::max_manifest_bytes`] and [`Limits::max_files`], each read bounded by
//! [`Limits::timeout`]; every file must be a memfd sealed with
//! `F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW`. On any error every fd received so far is
//! closed.
//!
//! # When the server dies
//!
//! Attached readers keep their pages: they hold the memfds, and the memory lives as
//! long as any process holds one. The name is served again by the first of these rules
//! that applies:
//! 1. A reader that attached re-serves what it holds: [`Server::bind`] with
//!    [`Parcel::try_clone`] of its parcel (the abstract name is free once its last
//!    listener is gone; a stale socket file is replaced).
//! 2. Otherwise a new process finds the name unserved and places again:
//!    [`serve_or_attach`] does this by itself.
//!
//! All system calls here go through rustix (sockets, `sendmsg`/`recvmsg` with
//! `SCM_RIGHTS`, `SO_PEERCRED`, `poll`, `flock`, seals), safe wrappers of the raw calls:
//! the crate's "syscalls in sys/ or rustix" rule holds with no `unsafe` in this module.

mod join;
mod name;
mod server;
mod wire;

use std::fs::File;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::Result;

pub use join::{Joined, serve_or_attach};
pub use name::address;
pub use server::{ServeStats, Server};
pub use wire::{FDS_PER_CHUNK, fetch};

/// What is served: manifest bytes and the files they describe, in order.
#[derive(Debug)]
pub struct Parcel {
    /// The manifest, as its own format writes it (opaque here).
    pub manifest: Vec<u8>,
    /// The files (sealed memfds), in the manifest's order.
    pub files: Vec<File>,
}

impl Parcel {
    /// The same manifest and duplicated fds (`dup`, close-on-exec): what a reader
    /// re-serves while keeping its own.
    ///
    /// # Errors
    /// Duplicating an fd fails (`EMFILE`).
    pub fn try_clone(&self) -> Result<Parcel> {
        let files = self
            .files
            .iter()
            .map(|f| {
                f.try_clone()
                    .map_err(|e| crate::error::Error::io("dup", "parcel file", e))
            })
            .collect::<Result<_>>()?;
        Ok(Parcel {
            manifest: self.manifest.clone(),
            files,
        })
    }
}

/// Where a name's socket lives (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Endpoint {
    /// The abstract socket `@numapin-<uid>-<name>`.
    #[default]
    Abstract,
    /// `$XDG_RUNTIME_DIR/numapin/<name>.sock`, or `/run/numapin/<uid>/<name>.sock`.
    Runtime,
    /// `<dir>/<name>.sock`.
    Dir(PathBuf),
}

/// Who a [`Server`] answers, and where it listens: [`Access::same_uid`],
/// [`Access::allow`], then [`Access::at`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Access {
    /// Where the socket lives.
    pub endpoint: Endpoint,
    /// Uids answered besides the server's own effective uid. Peers of a path socket
    /// must also reach it: its directory is 0700, so other uids need the abstract
    /// endpoint (or root).
    pub uids: Vec<u32>,
}

impl Access {
    /// Same uid only, on the abstract socket: the default.
    pub fn same_uid() -> Access {
        Access::default()
    }

    /// The server's own uid and these.
    pub fn allow(uids: impl IntoIterator<Item = u32>) -> Access {
        Access {
            uids: uids.into_iter().collect(),
            ..Access::default()
        }
    }

    /// The same access at another endpoint.
    pub fn at(self, endpoint: Endpoint) -> Access {
        Access { endpoint, ..self }
    }
}

/// What [`fetch`] accepts, and how long it waits: `Limits::default()` and the setters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Where the socket lives.
    pub endpoint: Endpoint,
    /// The uid that must serve the name (the `<uid>` of its socket): this process's
    /// effective uid when `None`.
    pub owner: Option<u32>,
    /// The largest manifest accepted (default 64 MiB).
    pub max_manifest_bytes: u64,
    /// The most files accepted (default 65536).
    pub max_files: u32,
    /// How long each step may wait for the server: connecting, and every read (default
    /// 30 s). [`serve_or_attach`] also waits this long in all for a placer.
    pub timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            endpoint: Endpoint::Abstract,
            owner: None,
            max_manifest_bytes: 64 << 20,
            max_files: 65536,
            timeout: Duration::from_secs(30),
        }
    }
}

impl Limits {
    /// The same limits at another endpoint.
    pub fn at(self, endpoint: Endpoint) -> Limits {
        Limits { endpoint, ..self }
    }

    /// The same limits with another timeout.
    pub fn timeout(self, timeout: Duration) -> Limits {
        Limits { timeout, ..self }
    }

    /// The same limits for a name served by `uid` (its socket's `<uid>`, and the uid the
    /// server must run as).
    pub fn owner(self, uid: u32) -> Limits {
        Limits {
            owner: Some(uid),
            ..self
        }
    }

    /// The same limits with another largest manifest.
    pub fn max_manifest_bytes(self, bytes: u64) -> Limits {
        Limits {
            max_manifest_bytes: bytes,
            ..self
        }
    }

    /// The same limits with another most files.
    pub fn max_files(self, files: u32) -> Limits {
        Limits {
            max_files: files,
            ..self
        }
    }
}

/// This process's effective uid.
fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}
