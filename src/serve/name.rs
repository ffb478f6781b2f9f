//! A name's socket address: checked, derived from the name and the owner uid, its
//! directory created or checked private.

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use rustix::net::SocketAddrUnix;

use super::Endpoint;
use crate::error::{Error, Result, ServeFault};

/// The longest name accepted, before the socket address's own limit.
pub(super) const NAME_MAX: usize = 64;
/// `sizeof(sockaddr_un.sun_path)`: the path and its NUL, or the abstract name and its
/// leading NUL.
const SUN_PATH: usize = 108;

/// A name's socket.
#[derive(Debug, Clone)]
pub(super) enum Addr {
    /// An abstract name (without its leading NUL).
    Abstract(String),
    /// A socket file, and the lock file beside it.
    Path { sock: PathBuf, lock: PathBuf },
}

impl Addr {
    /// The socket address to bind or connect.
    pub(super) fn unix(&self, op: &'static str, name: &str) -> Result<SocketAddrUnix> {
        let made = match self {
            Addr::Abstract(a) => SocketAddrUnix::new_abstract_name(a.as_bytes()),
            Addr::Path { sock, .. } => SocketAddrUnix::new(sock.as_path()),
        };
        made.map_err(|e| {
            Error::serve(
                op,
                name,
                ServeFault::NameTooLong,
                format!("{self}: {e} (sun_path holds {SUN_PATH} bytes)"),
            )
        })
    }
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Addr::Abstract(a) => write!(f, "@{a}"),
            Addr::Path { sock, .. } => write!(f, "{}", sock.display()),
        }
    }
}

/// The socket a name is served on, as `ss -x` shows it: `@numapin-<uid>-<name>` for the
/// abstract endpoint (`@` standing for the leading NUL), the socket file's path
/// otherwise. `owner` is the serving uid.
///
/// # Errors
/// [`ServeFault::BadName`] for an empty name, one over 64 bytes or with a character
/// outside `[A-Za-z0-9._:+-]` or a leading dot; [`ServeFault::NameTooLong`] when the
/// address does not fit `sun_path` (a long runtime directory).
pub fn address(name: &str, endpoint: &Endpoint, owner: u32) -> Result<String> {
    Ok(resolve("serve::address", name, endpoint, owner)?.to_string())
}

/// The checked address of `name` served by `owner` at `endpoint` (no directory made).
pub(super) fn resolve(
    op: &'static str,
    name: &str,
    endpoint: &Endpoint,
    owner: u32,
) -> Result<Addr> {
    check_name(op, name)?;
    let addr = match endpoint {
        Endpoint::Abstract => Addr::Abstract(format!("numapin-{owner}-{name}")),
        Endpoint::Runtime => in_dir(&runtime_dir(owner), name),
        Endpoint::Dir(dir) => in_dir(dir, name),
    };
    let len = match &addr {
        Addr::Abstract(a) => 1 + a.len(),
        Addr::Path { sock, .. } => sock.as_os_str().len() + 1,
    };
    if len > SUN_PATH {
        return Err(Error::serve(
            op,
            name,
            ServeFault::NameTooLong,
            format!("the socket address {addr} takes {len} bytes; sun_path holds {SUN_PATH}"),
        ));
    }
    Ok(addr)
}

fn in_dir(dir: &Path, name: &str) -> Addr {
    Addr::Path {
        sock: dir.join(format!("{name}.sock")),
        lock: dir.join(format!("{name}.lock")),
    }
}

/// `$XDG_RUNTIME_DIR/numapin` when set (and absolute), `/run/numapin/<uid>` otherwise.
fn runtime_dir(owner: u32) -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(d) if d.is_absolute() => d.join("numapin"),
        _ => PathBuf::from(format!("/run/numapin/{owner}")),
    }
}

fn check_name(op: &'static str, name: &str) -> Result<()> {
    let bad = |why: String| Err(Error::serve(op, name, ServeFault::BadName, why));
    if name.len() > NAME_MAX {
        // The kernel's sun_path limit is the one callers meet; this one keeps every
        // endpoint's address within it.
        return Err(Error::serve(
            op,
            name,
            ServeFault::NameTooLong,
            format!(
                "{} bytes; a name has at most {NAME_MAX} (its socket address at most {SUN_PATH})",
                name.len()
            ),
        ));
    }
    if name.is_empty() {
        return bad("empty".to_string());
    }
    if name.starts_with('.') {
        return bad("starts with a dot".to_string());
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '+' | '-')))
    {
        return bad(format!("{c:?} is not one of [A-Za-z0-9._:+-]"));
    }
    Ok(())
}

/// The socket file's directory, created 0700 (parents 0755) when missing; refused when
/// it is not a directory, not this uid's, or open to others (group or world bits).
pub(super) fn private_dir(op: &'static str, name: &str, sock: &Path) -> Result<()> {
    let Some(dir) = sock.parent() else {
        return Ok(());
    };
    if let Some(parent) = dir.parent()
        && !parent.as_os_str().is_empty()
        && !parent.exists()
    {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)
            .map_err(|e| Error::io("mkdir", parent.display().to_string(), e))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io("mkdir", dir.display().to_string(), e)),
    }
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::io("lstat", dir.display().to_string(), e))?;
    let me = super::euid();
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(Error::serve(
            op,
            name,
            ServeFault::UnsafeDirectory,
            format!(
                "{}: {} owned by uid {} with mode {:o}; wanted a directory of uid {me} \
                 with mode 0700",
                dir.display(),
                if meta.is_dir() {
                    "a directory"
                } else {
                    "not a directory"
                },
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_derived() {
        let a = resolve("t", "qwen3-30b", &Endpoint::Abstract, 1000).unwrap();
        assert_eq!(a.to_string(), "@numapin-1000-qwen3-30b");
        let d = Endpoint::Dir(PathBuf::from("/tmp/x"));
        assert_eq!(address("m:1", &d, 0).unwrap(), "/tmp/x/m:1.sock");
        let fault = |n: &str, e: &Endpoint| resolve("t", n, e, 0).unwrap_err().serve_fault();
        assert_eq!(fault("", &d), Some(ServeFault::BadName));
        assert_eq!(fault(".x", &d), Some(ServeFault::BadName));
        assert_eq!(fault("a/b", &d), Some(ServeFault::BadName));
        assert_eq!(fault("a\0b", &d), Some(ServeFault::BadName));
        let long = "n".repeat(200);
        assert_eq!(
            fault(&long, &Endpoint::Abstract),
            Some(ServeFault::NameTooLong)
        );
        let deep = Endpoint::Dir(PathBuf::from(format!("/{}", "d".repeat(80))));
        assert_eq!(fault(&"n".repeat(30), &deep), Some(ServeFault::NameTooLong));
        // 64 bytes fit the abstract namespace whatever the uid.
        let max = "n".repeat(NAME_MAX);
        let a = resolve("t", &max, &Endpoint::Abstract, u32::MAX).unwrap();
        a.unix("t", &max).unwrap();
    }
}
