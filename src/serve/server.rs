//! The serving side: a listening socket and a thread that answers each allowed peer
//! with the parcel.

use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketFlags, SocketType};

use super::name::{Addr, private_dir, resolve};
use super::{Access, Parcel, euid, wire};
use crate::error::{Error, Result, ServeFault};

/// How long, in all, a peer may take to read its parcel before the server closes it.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the serving thread looks at its stop flag.
const POLL_EVERY: Duration = Duration::from_millis(50);
/// The most peers sent to at once (a thread each); more wait in the backlog.
const MAX_PEERS: usize = 64;

/// What a [`Server`] has done so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ServeStats {
    /// Peers sent the whole parcel.
    pub served: u64,
    /// Peers of a uid not allowed: closed unanswered.
    pub refused: u64,
    /// Peers whose parcel could not be sent whole (they left, or did not read in time).
    pub failed: u64,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    served: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
}

/// A parcel served by name, by a background thread, until dropped.
///
/// Dropping it stops the thread (within 50 ms), closes the socket and removes the socket
/// file if it is still the one bound; the parcel's files are closed with it, while every
/// process that fetched them keeps its own.
pub struct Server {
    name: String,
    addr: Addr,
    parcel: Arc<Parcel>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The socket file's (device, inode), for a path endpoint.
    file: Option<(u64, u64)>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("name", &self.name)
            .field("address", &self.addr.to_string())
            .field("files", &self.parcel.files.len())
            .field("stats", &self.stats())
            .finish()
    }
}

/// A bound, listening socket not yet served from.
pub(super) struct Bound {
    fd: OwnedFd,
    addr: Addr,
    file: Option<(u64, u64)>,
}

impl Server {
    /// Serves `parcel` under `name` (see the [module docs](super) for the socket and
    /// the wire) until the server is dropped. Peers are checked with `SO_PEERCRED`:
    /// this process's effective uid and [`Access::uids`] are answered, others closed
    /// unanswered.
    ///
    /// # Errors
    /// A bad or too long name; [`ServeFault::InUse`] when a live server holds the name;
    /// [`ServeFault::UnsafeDirectory`] for a socket directory that is not private; the
    /// socket calls' errors. A stale socket file is replaced, not an error.
    pub fn bind(name: &str, parcel: Parcel, access: Access) -> Result<Server> {
        let bound = listen(OP, name, &access)?;
        Server::start(name, bound, parcel, access)
    }

    /// Starts the serving thread on a socket [`listen`] bound.
    pub(super) fn start(
        name: &str,
        bound: Bound,
        parcel: Parcel,
        access: Access,
    ) -> Result<Server> {
        let parcel = Arc::new(parcel);
        let shared = Arc::new(Shared::default());
        let Bound { fd, addr, file } = bound;
        let (p, s) = (Arc::clone(&parcel), Arc::clone(&shared));
        let mut allowed = access.uids;
        allowed.push(euid());
        let thread = std::thread::Builder::new()
            .name(format!(
                "numapin-serve-{}",
                name.chars().take(8).collect::<String>()
            ))
            .spawn(move || serve(fd, &p, &s, &allowed))
            .map_err(|e| Error::io("spawn", "the serving thread", e))?;
        Ok(Server {
            name: name.to_string(),
            addr,
            parcel,
            shared,
            thread: Some(thread),
            file,
        })
    }

    /// The socket served on, as [`address`](super::address) gives it.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// The parcel served.
    pub fn parcel(&self) -> &Parcel {
        &self.parcel
    }

    /// Peers served, refused and failed so far.
    pub fn stats(&self) -> ServeStats {
        ServeStats {
            served: self.shared.served.load(Ordering::Relaxed),
            refused: self.shared.refused.load(Ordering::Relaxed),
            failed: self.shared.failed.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let (Addr::Path { sock, .. }, Some(id)) = (&self.addr, self.file)
            && let Ok(meta) = std::fs::symlink_metadata(sock)
            && (meta.dev(), meta.ino()) == id
        {
            let _ = std::fs::remove_file(sock);
        }
    }
}

const OP: &str = "Server::bind";

/// The serving loop: accept, check the peer, and send to it on a thread of its own
/// (within [`SEND_TIMEOUT`] in all), so that a peer that does not read delays no other;
/// until the stop flag, then the peers' threads are joined (they stop within
/// [`POLL_EVERY`]).
fn serve(listener: OwnedFd, parcel: &Arc<Parcel>, shared: &Arc<Shared>, allowed: &[u32]) {
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: POLL_EVERY.as_nanos() as _,
    };
    let mut peers: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stop.load(Ordering::Relaxed) {
        peers.retain(|t| !t.is_finished());
        if peers.len() >= MAX_PEERS {
            std::thread::sleep(POLL_EVERY);
            continue;
        }
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(Errno::INTR) => continue,
            Ok(_) => {}
            Err(_) => {
                std::thread::sleep(POLL_EVERY);
                continue;
            }
        }
        let Ok(conn) = rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) else {
            continue;
        };
        let uid = rustix::net::sockopt::socket_peercred(&conn).map(|c| c.uid.as_raw());
        if !uid.is_ok_and(|u| allowed.contains(&u)) {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let deadline = Instant::now() + SEND_TIMEOUT;
        let (p, s) = (Arc::clone(parcel), Arc::clone(shared));
        let peer = std::thread::Builder::new()
            .name("numapin-serve-peer".to_string())
            .spawn(move || {
                let budget = wire::Budget {
                    deadline,
                    stop: &s.stop,
                };
                let sent = wire::send(&conn, &p, &budget);
                // Closed before it is counted: a count seen means the fd is gone.
                drop(conn);
                let counter = if sent.is_ok() { &s.served } else { &s.failed };
                counter.fetch_add(1, Ordering::Relaxed);
            });
        match peer {
            Ok(t) => peers.push(t),
            Err(_) => {
                shared.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    for t in peers {
        let _ = t.join();
    }
}

/// A socket bound to `name`'s address and listening: the election. A live server there
/// is [`ServeFault::InUse`]; a stale socket file is replaced (under the lock file).
pub(super) fn listen(op: &'static str, name: &str, access: &Access) -> Result<Bound> {
    let addr = resolve(op, name, &access.endpoint, euid())?;
    let unix = addr.unix(op, name)?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| Error::os("socket", e, "AF_UNIX SOCK_STREAM"))?;
    let in_use = |detail: String| Error::serve(op, name, ServeFault::InUse, detail);
    let file = match &addr {
        Addr::Abstract(_) => match rustix::net::bind(&fd, &unix) {
            Ok(()) => None,
            Err(Errno::ADDRINUSE) => return Err(in_use(format!("{addr} is bound"))),
            Err(e) => return Err(Error::os("bind", e, &addr)),
        },
        Addr::Path { sock, lock } => {
            private_dir(op, name, sock)?;
            let lock_file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .open(lock)
                .map_err(|e| Error::io("open", lock.display().to_string(), e))?;
            rustix::fs::flock(&lock_file, rustix::fs::FlockOperation::LockExclusive)
                .map_err(|e| Error::os("flock", e, lock.display()))?;
            match rustix::net::bind(&fd, &unix) {
                Ok(()) => {}
                Err(Errno::ADDRINUSE) => {
                    match wire::connect(op, name, &addr, Duration::from_secs(1)) {
                        Err(e) if e.serve_fault() == Some(ServeFault::StaleSocket) => {
                            std::fs::remove_file(sock)
                                .map_err(|e| Error::io("unlink", sock.display().to_string(), e))?;
                            rustix::net::bind(&fd, &unix)
                                .map_err(|e| Error::os("bind", e, &addr))?;
                        }
                        Ok(_) => return Err(in_use(format!("{addr} has a live listener"))),
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(Error::os("bind", e, &addr)),
            }
            std::fs::set_permissions(sock, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| Error::io("chmod 0600", sock.display().to_string(), e))?;
            let meta = std::fs::symlink_metadata(sock)
                .map_err(|e| Error::io("lstat", sock.display().to_string(), e))?;
            Some((meta.dev(), meta.ino()))
        }
    };
    rustix::net::listen(&fd, 128).map_err(|e| Error::os("listen", e, &addr))?;
    Ok(Bound { fd, addr, file })
}
