//! The election: the first process to bind a name places and serves; the others wait
//! for it and attach.

use std::time::{Duration, Instant};

use super::server::{Server, listen};
use super::{Access, Limits, Parcel, wire};
use crate::error::{Error, Result, ServeFault};

/// What [`serve_or_attach`] made of this process.
#[derive(Debug)]
pub enum Joined<T> {
    /// This process won the name: it placed (`value`, what the closure returned beside
    /// the parcel) and serves until `server` is dropped.
    Placed {
        /// The closure's own result (the placed store or model).
        value: T,
        /// The server of the parcel.
        server: Server,
    },
    /// Another process serves the name: its parcel, to attach.
    Attached(Parcel),
}

/// Joins the placement served as `name`: the first process to bind the name places it
/// (`place`) and serves the parcel; every other one waits and fetches it.
///
/// Binding the socket is the election: the kernel lets one process bind an abstract
/// name (or, for a socket file, the lock file beside it orders the bind and the stale
/// check). The winner binds and listens *before* `place` runs, so the others connect
/// at once and wait for its parcel, each read bounded by [`Limits::timeout`], and the
/// whole wait by the same figure. If the placer fails (or dies), its socket closes, the
/// waiters see it ([`ServeFault::Closed`], [`ServeFault::NotServed`],
/// [`ServeFault::StaleSocket`]) and hold the election again: one of them places.
///
/// `access.endpoint` and `limits.endpoint` should agree; `limits.owner` should be this
/// uid (a placer always serves under its own).
///
/// # Errors
/// `place`'s error (the name is freed: another process may place); a fetch that fails
/// for another reason than a placer gone (a refused uid, a bad message); the wait
/// running past [`Limits::timeout`] ([`ServeFault::Timeout`], naming the last cause).
pub fn serve_or_attach<T>(
    name: &str,
    access: Access,
    limits: &Limits,
    place: impl FnOnce() -> Result<(T, Parcel)>,
) -> Result<Joined<T>> {
    const OP: &str = "serve::serve_or_attach";
    let deadline = Instant::now() + limits.timeout;
    let mut place = Some(place);
    loop {
        match listen(OP, name, &access) {
            Ok(bound) => {
                let Some(place) = place.take() else {
                    unreachable!("the loop returns once it has placed");
                };
                let (value, parcel) = place()?;
                let server = Server::start(name, bound, parcel, access)?;
                return Ok(Joined::Placed { value, server });
            }
            Err(e) if e.serve_fault() == Some(ServeFault::InUse) => {}
            Err(e) => return Err(e),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let cause = match wire::fetch(name, &limits.clone().timeout(left)) {
            Ok(parcel) => return Ok(Joined::Attached(parcel)),
            Err(e) if placer_gone(&e) => e,
            Err(e) => return Err(e),
        };
        if Instant::now() >= deadline {
            return Err(Error::serve(
                OP,
                name,
                ServeFault::Timeout,
                format!(
                    "no placer served it within {:?}; last: {cause}",
                    limits.timeout
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether a fetch failed because the placer went away (and the election is open again).
fn placer_gone(e: &Error) -> bool {
    matches!(
        e.serve_fault(),
        Some(ServeFault::Closed | ServeFault::NotServed | ServeFault::StaleSocket)
    )
}
