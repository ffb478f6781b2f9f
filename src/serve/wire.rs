//! The wire: one parcel per connection, server to client (header, fd chunks, manifest),
//! and the client's checks of all of it.

use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
    sockopt::Timeout,
};

use super::name::{Addr, resolve};
use super::{Limits, Parcel, euid};
use crate::error::{Error, Result, ServeFault};

/// The most fds sent in one message (the kernel's `SCM_MAX_FD` is 253).
pub const FDS_PER_CHUNK: usize = 250;
/// The header's first 8 bytes.
const MAGIC: &[u8; 8] = b"NUMAPIN\0";
/// The protocol version, after the magic.
const VERSION: u32 = 1;
/// Magic, version, file count, manifest length.
const HEADER: usize = 24;

/// The header announcing `files` fds and `manifest` bytes.
fn header(files: usize, manifest: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(files as u32).to_le_bytes());
    h[16..24].copy_from_slice(&(manifest as u64).to_le_bytes());
    h
}

/// How often a blocked send looks at its stop flag.
const STEP: Duration = Duration::from_millis(50);

/// How long, in all, sending to one peer may take, and the flag that stops it sooner.
pub(super) struct Budget<'a> {
    /// When the send fails (`ETIMEDOUT`) however much the peer has read.
    pub deadline: Instant,
    /// Set when the server is dropped: the send fails (`ECANCELED`).
    pub stop: &'a AtomicBool,
}

impl Budget<'_> {
    /// Waits until `conn` takes more bytes (or fails): `ETIMEDOUT` past the deadline,
    /// `ECANCELED` once stopped.
    fn wait(&self, conn: &OwnedFd) -> rustix::io::Result<()> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Err(Errno::CANCELED);
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Errno::TIMEDOUT);
            }
            let step = left.min(STEP);
            let t = Timespec {
                tv_sec: step.as_secs() as _,
                tv_nsec: step.subsec_nanos() as _,
            };
            let mut fds = [PollFd::new(conn, PollFlags::OUT)];
            match rustix::event::poll(&mut fds, Some(&t)) {
                Ok(0) | Err(Errno::INTR) => {}
                Ok(_) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }
}

/// Sends never block: a peer that does not read makes them wait on the budget.
const SEND: SendFlags = SendFlags::NOSIGNAL.union(SendFlags::DONTWAIT);

/// Sends `parcel` on the connected socket `conn` (the server's side), within `budget`
/// in all (a peer reading a trickle does not extend it).
pub(super) fn send(conn: &OwnedFd, parcel: &Parcel, budget: &Budget<'_>) -> rustix::io::Result<()> {
    send_all(
        conn,
        &header(parcel.files.len(), parcel.manifest.len()),
        budget,
    )?;
    for chunk in parcel.files.chunks(FDS_PER_CHUNK) {
        let fds: Vec<BorrowedFd<'_>> = chunk.iter().map(AsFd::as_fd).collect();
        let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(Errno::NOBUFS);
        }
        let count = [chunk.len() as u8];
        let sent = loop {
            match rustix::net::sendmsg(conn, &[IoSlice::new(&count)], &mut control, SEND) {
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => budget.wait(conn)?,
                other => break other?,
            }
        };
        if sent != 1 {
            return Err(Errno::PIPE);
        }
    }
    send_all(conn, &parcel.manifest, budget)
}

fn send_all(conn: &OwnedFd, mut bytes: &[u8], budget: &Budget<'_>) -> rustix::io::Result<()> {
    while !bytes.is_empty() {
        match rustix::net::send(conn, bytes, SEND) {
            Ok(0) => return Err(Errno::PIPE),
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => budget.wait(conn)?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

const OP: &str = "serve::fetch";

/// Connects to `name`'s server and receives its parcel: the manifest bytes and the files,
/// each checked to be a memfd sealed with `F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW`.
///
/// # Errors
/// [`Error::Serve`] naming the fault: a bad or too long name, nobody serving
/// ([`ServeFault::NotServed`]) or a stale socket file, a server of another uid than
/// [`Limits::owner`], a connection closed before anything came (a refused uid), a
/// timeout, a truncated or oversized message or one of another protocol, too many or
/// too few fds, an fd that is not a sealed memfd. Every fd received is closed on error.
pub fn fetch(name: &str, limits: &Limits) -> Result<Parcel> {
    let owner = limits.owner.unwrap_or_else(euid);
    let addr = resolve(OP, name, &limits.endpoint, owner)?;
    let sock = connect(OP, name, &addr, limits.timeout)?;
    let peer = rustix::net::sockopt::socket_peercred(&sock)
        .map_err(|e| Error::os("getsockopt", e, format!("SO_PEERCRED of {addr}")))?;
    if peer.uid.as_raw() != owner {
        return Err(Error::serve(
            OP,
            name,
            ServeFault::PeerUid,
            format!(
                "{addr} is served by uid {} (pid {}), not by the owner uid {owner}",
                peer.uid.as_raw(),
                peer.pid.as_raw_nonzero()
            ),
        ));
    }
    receive(name, &sock, limits)
}

/// A stream socket connected to `addr`, with `timeout` on connecting, sending and
/// receiving.
pub(super) fn connect(
    op: &'static str,
    name: &str,
    addr: &Addr,
    timeout: Duration,
) -> Result<OwnedFd> {
    let unix = addr.unix(op, name)?;
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| Error::os("socket", e, "AF_UNIX SOCK_STREAM"))?;
    let timeout = Some(timeout.max(Duration::from_millis(1)));
    for kind in [Timeout::Recv, Timeout::Send] {
        rustix::net::sockopt::set_socket_timeout(&sock, kind, timeout)
            .map_err(|e| Error::os("setsockopt", e, format!("{kind:?} timeout {timeout:?}")))?;
    }
    match rustix::net::connect(&sock, &unix) {
        Ok(()) => Ok(sock),
        Err(Errno::CONNREFUSED) if matches!(addr, Addr::Path { .. }) => Err(Error::serve(
            op,
            name,
            ServeFault::StaleSocket,
            format!("{addr}: nobody listens on the socket file (ECONNREFUSED)"),
        )),
        Err(e @ (Errno::CONNREFUSED | Errno::NOENT)) => Err(Error::serve(
            op,
            name,
            ServeFault::NotServed,
            format!("nobody serves {addr} ({e:?})"),
        )),
        Err(Errno::AGAIN) => Err(Error::serve(
            op,
            name,
            ServeFault::Timeout,
            format!("connect to {addr}: the server's backlog stayed full for {timeout:?}"),
        )),
        Err(e) => Err(Error::os("connect", e, addr)),
    }
}

/// Reads one parcel from `sock` (the client's side).
fn receive(name: &str, sock: &OwnedFd, limits: &Limits) -> Result<Parcel> {
    let fault = |f: ServeFault, d: String| Error::serve(OP, name, f, d);
    let mut head = [0u8; HEADER];
    let mut got = 0;
    while got < HEADER {
        let (n, stray) = recv(name, sock, &mut head[got..], 1, "the header", got)?;
        if stray {
            return Err(fault(
                ServeFault::FdCount,
                "file descriptors came with the header".into(),
            ));
        }
        if n == 0 {
            return Err(if got == 0 {
                fault(
                    ServeFault::Closed,
                    "the server closed the connection without sending anything: it refuses \
                     this uid, or it is exiting"
                        .into(),
                )
            } else {
                fault(
                    ServeFault::Truncated,
                    format!("the header ends after {got} of {HEADER} bytes"),
                )
            });
        }
        got += n;
    }
    let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    if &head[..8] != MAGIC || version != VERSION {
        return Err(fault(
            ServeFault::BadMessage,
            format!(
                "header {:02x?}: wanted magic {MAGIC:02x?} and version {VERSION}",
                &head[..12]
            ),
        ));
    }
    let count = u32::from_le_bytes([head[12], head[13], head[14], head[15]]);
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&head[16..24]);
    let len = u64::from_le_bytes(len_bytes);
    if count > limits.max_files {
        return Err(fault(
            ServeFault::FdCount,
            format!(
                "{count} files announced; at most {} allowed",
                limits.max_files
            ),
        ));
    }
    if len > limits.max_manifest_bytes {
        return Err(fault(
            ServeFault::Oversized,
            format!(
                "a manifest of {len} bytes announced; at most {} allowed",
                limits.max_manifest_bytes
            ),
        ));
    }
    let files = receive_files(name, sock, count as usize)?;
    // Within max_manifest_bytes, which may be u64::MAX: allocated as the bytes come.
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    let manifest = receive_manifest(name, sock, len)?;
    let files = files
        .into_iter()
        .enumerate()
        .map(|(i, fd)| check_memfd(name, i, File::from(fd)))
        .collect::<Result<Vec<File>>>()?;
    Ok(Parcel { manifest, files })
}

/// The `count` fds, chunk by chunk.
fn receive_files(name: &str, sock: &OwnedFd, count: usize) -> Result<Vec<OwnedFd>> {
    let fault = |f: ServeFault, d: String| Error::serve(OP, name, f, d);
    let mut files: Vec<OwnedFd> = Vec::with_capacity(count.min(FDS_PER_CHUNK));
    while files.len() < count {
        let mut byte = [0u8; 1];
        let (n, fds, truncated) = recv_fds(name, sock, &mut byte, FDS_PER_CHUNK, files.len())?;
        if n == 0 {
            return Err(fault(
                ServeFault::Truncated,
                format!("the message ends after {} of {count} files", files.len()),
            ));
        }
        let announced = byte[0] as usize;
        if truncated || fds.len() != announced || announced == 0 {
            return Err(fault(
                ServeFault::FdCount,
                format!(
                    "a chunk announces {announced} fds and carries {}{}",
                    fds.len(),
                    if truncated {
                        " and more (MSG_CTRUNC)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if files.len() + fds.len() > count {
            return Err(fault(
                ServeFault::FdCount,
                format!(
                    "{} files received; the header announced {count}",
                    files.len() + fds.len()
                ),
            ));
        }
        files.extend(fds);
    }
    Ok(files)
}

/// The `len` manifest bytes, then the end of the stream.
fn receive_manifest(name: &str, sock: &OwnedFd, len: usize) -> Result<Vec<u8>> {
    let fault = |f: ServeFault, d: String| Error::serve(OP, name, f, d);
    // What came so far, grown as it comes (doubling, from 1 MiB): a header announcing
    // more than the server sends costs no more memory than the bytes sent.
    let mut manifest = Vec::new();
    let mut got = 0;
    while got < len {
        if got == manifest.len() {
            let more = (len - got).min(manifest.len().max(1 << 20));
            manifest.resize(got + more, 0);
        }
        let (n, stray) = recv(name, sock, &mut manifest[got..], 1, "the manifest", got)?;
        if stray {
            return Err(fault(
                ServeFault::FdCount,
                "file descriptors came with the manifest".into(),
            ));
        }
        if n == 0 {
            return Err(fault(
                ServeFault::Truncated,
                format!("the manifest ends after {got} of {len} bytes"),
            ));
        }
        got += n;
    }
    let mut extra = [0u8; 1];
    let (n, stray) = recv(name, sock, &mut extra, 1, "the end", len)?;
    if n != 0 || stray {
        return Err(fault(
            ServeFault::Oversized,
            format!("more than the {len} manifest bytes announced"),
        ));
    }
    Ok(manifest)
}

/// One `recvmsg` into `buf`: the bytes read, and whether any fd came with them (closed).
fn recv(
    name: &str,
    sock: &OwnedFd,
    buf: &mut [u8],
    room: usize,
    what: &str,
    at: usize,
) -> Result<(usize, bool)> {
    let (n, fds, truncated) = recv_fds(name, sock, buf, room, at).map_err(|e| match e {
        Error::Serve { fault, detail, .. } => {
            Error::serve(OP, name, fault, format!("{what}: {detail}"))
        }
        other => other,
    })?;
    Ok((n, truncated || !fds.is_empty()))
}

/// One `recvmsg` into `buf` with room for `room` fds (close on exec): the bytes read, the
/// fds, and whether more fds came than fit (`MSG_CTRUNC`: the kernel closed those).
fn recv_fds(
    name: &str,
    sock: &OwnedFd,
    buf: &mut [u8],
    room: usize,
    at: usize,
) -> Result<(usize, Vec<OwnedFd>, bool)> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(room.max(1)))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = loop {
        match rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(Errno::INTR) => {}
            other => break other,
        }
    };
    let msg = match received {
        Ok(msg) => msg,
        Err(Errno::AGAIN) => {
            return Err(Error::serve(
                OP,
                name,
                ServeFault::Timeout,
                format!("nothing came after byte {at} within the timeout"),
            ));
        }
        Err(Errno::CONNRESET) if at == 0 => {
            return Err(Error::serve(
                OP,
                name,
                ServeFault::Closed,
                "the server reset the connection before sending anything".to_string(),
            ));
        }
        Err(Errno::CONNRESET) => {
            return Err(Error::serve(
                OP,
                name,
                ServeFault::Truncated,
                format!("the server reset the connection after byte {at}"),
            ));
        }
        Err(e) => return Err(Error::os("recvmsg", e, format!("served name {name:?}"))),
    };
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    Ok((msg.bytes, fds, msg.flags.contains(ReturnFlags::CTRUNC)))
}

/// `file` (the parcel's `index`th), if it is a memfd sealed against writing, shrinking
/// and growing; closed otherwise.
fn check_memfd(name: &str, index: usize, file: File) -> Result<File> {
    use rustix::fs::SealFlags;
    let wanted = SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW;
    let kind = |d: String| Error::serve(OP, name, ServeFault::FdKind, format!("file {index}: {d}"));
    let stat = rustix::fs::fstat(&file).map_err(|e| Error::os("fstat", e, "parcel file"))?;
    let mode = rustix::fs::FileType::from_raw_mode(stat.st_mode);
    if mode != rustix::fs::FileType::RegularFile {
        return Err(kind(format!("a {mode:?}, not a memfd")));
    }
    match rustix::fs::fcntl_get_seals(&file) {
        Ok(seals) if seals.contains(wanted) => Ok(file),
        Ok(seals) => Err(kind(format!(
            "a memfd sealed {seals:?}; wanted at least {wanted:?}"
        ))),
        Err(e) => Err(kind(format!(
            "not a memfd: fcntl(F_GET_SEALS) answers {e:?}"
        ))),
    }
}
