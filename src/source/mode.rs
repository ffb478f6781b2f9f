//! How the loader reads file pieces: through the page cache (the default), around it
//! (`O_DIRECT`), or through it and then evicting what it read (drop-behind); why a
//! direct read fell back to the page cache; and how a file's residency was measured.

use std::fmt;

use crate::error::{Error, Result};

/// How [`PinStore::pack_layer`](crate::store::PinStore::pack_layer) reads file pieces.
///
/// The default, [`ReadMode::Auto`], looks at each file's page-cache residency first and
/// reads buffered what is cached, direct what is not.
///
/// Reading a cold model through the page cache leaves a second full copy of it cached
/// next to the placed one; where the model is most of RAM the kernel must evict that copy
/// while loading. [`ReadMode::Direct`] and [`ReadMode::DropBehind`] keep it bounded.
///
/// `FromStr` and `Display` use the names `auto`, `buffered`, `direct` and `drop-behind`.
///
/// # Example
/// ```
/// use numapin::store::ReadMode;
/// let mode: ReadMode = "drop-behind".parse()?;
/// assert_eq!(mode, ReadMode::DropBehind);
/// assert_eq!(mode.to_string(), "drop-behind");
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "kebab-case")
)]
pub enum ReadMode {
    /// Per file, by its page-cache residency (`cachestat(2)`, or `mincore(2)` on a
    /// mapping of the file where the kernel has no `cachestat`, before Linux 6.5):
    /// [`ReadMode::Buffered`] when at least half of its pages are cached (reading them
    /// again from the device would be slower than copying them), [`ReadMode::Direct`]
    /// otherwise (with its fallbacks). The report says per file which ran and why
    /// ([`LayerReport::files`](crate::store::LayerReport::files)).
    #[default]
    Auto,
    /// `pread` through the page cache: fastest when the file is cached already, and the
    /// file stays cached after the load.
    Buffered,
    /// `pread` on a second descriptor opened with `O_DIRECT` (the caller's descriptor is
    /// never changed): the page cache is not touched. Reads are aligned to the file's
    /// `STATX_DIOALIGN`; pieces that are not aligned (most safetensors tensors) are read
    /// in aligned windows into a per-thread bounce buffer and copied. Falls back to
    /// [`ReadMode::Buffered`], with a [`ReadFallback`], where the file system reports no
    /// direct-I/O alignment (tmpfs, ramfs), the `O_DIRECT` open answers `EINVAL`, or
    /// `/proc/self/fd` is missing. A descriptor that cannot be read through (opened
    /// write-only, or `O_PATH`) is not reopened: its reads fail with the same `EBADF`
    /// error as in the other modes.
    Direct,
    /// `pread` through the page cache, then `POSIX_FADV_DONTNEED` on what no loader still
    /// has to read, every [`DROP_BEHIND_EVERY`] bytes read from a file, and at the end
    /// of each layer on the file up to the end of what the layer read, or of what an
    /// earlier layer of the same store read when that is further (what the kernel read
    /// ahead past it stays for the next layer, which reads it: the file is read from the
    /// device once; layers loaded backwards leave nothing behind them). What was read
    /// within the kernel's readahead reach (twice `read_ahead_kb` and a 2 MiB folio) above
    /// a range still to be read stays until that range is read: the readahead from it
    /// would read it from the device again (a GGUF layer's gate, up and down experts,
    /// read side by side). At most four such reaches per file are held, the lowest; what
    /// lies past them goes (a slot order unlike the file's no longer holds half the file),
    /// and what a placement that fails or is cancelled still held goes when it ends. The
    /// cache holds about that much of the file at a time, with
    /// the reads in flight and the kernel's readahead past them (twice `read_ahead_kb` at
    /// most); after a load, at most that
    /// readahead past the furthest byte a store's layers read stays cached. A whole
    /// placement ([`Checkpoint::place`](crate::model::Checkpoint::place)) shares one
    /// record per file among all its stores, and runs its fills in file order. The
    /// advice evicts the file's clean pages whoever cached them: a file that was cached
    /// before the load is not cached after it (use [`ReadMode::Direct`] to leave the
    /// cache as it was).
    ///
    /// [`DROP_BEHIND_EVERY`]: crate::store::DROP_BEHIND_EVERY
    DropBehind,
}

impl ReadMode {
    /// Every mode.
    pub const ALL: [ReadMode; 4] = [
        ReadMode::Auto,
        ReadMode::Buffered,
        ReadMode::Direct,
        ReadMode::DropBehind,
    ];

    /// The mode's name (`"drop-behind"`), as `Display` and `FromStr` spell it.
    pub fn name(self) -> &'static str {
        match self {
            ReadMode::Auto => "auto",
            ReadMode::Buffered => "buffered",
            ReadMode::Direct => "direct",
            ReadMode::DropBehind => "drop-behind",
        }
    }
}

impl fmt::Display for ReadMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ReadMode {
    type Err = Error;

    /// `auto`, `buffered`, `direct` or `drop-behind` (ASCII case ignored; `drop_behind`
    /// too).
    fn from_str(s: &str) -> Result<ReadMode> {
        let wanted = s.trim().to_ascii_lowercase().replace('_', "-");
        ReadMode::ALL
            .into_iter()
            .find(|m| m.name() == wanted)
            .ok_or_else(|| {
                Error::bad_value(
                    "ReadMode",
                    "read mode",
                    crate::error::quote(s),
                    "expected auto, buffered, direct or drop-behind",
                )
            })
    }
}

/// Why a [`ReadMode::Direct`] load read a file through the page cache instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "kebab-case")
)]
#[non_exhaustive]
pub enum ReadFallback {
    /// `statx` reported no direct-I/O alignment for the file (`STATX_DIOALIGN` absent or
    /// 0): tmpfs and ramfs report 0 (even where tmpfs accepts `O_DIRECT`), and kernels
    /// before 6.1 do not know the field.
    NoDirectIoAlignment,
    /// Opening the file again with `O_DIRECT` answered `EINVAL`: the file system does not
    /// support direct I/O.
    DirectOpenRefused,
    /// `/proc/self/fd/N` does not exist (no procfs here), so the file cannot be opened
    /// again with `O_DIRECT` without changing the caller's descriptor.
    NoProcFs,
}

impl fmt::Display for ReadFallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReadFallback::NoDirectIoAlignment => {
                "the file system reports no direct-I/O alignment (statx STATX_DIOALIGN is 0 or \
                 unknown: tmpfs, ramfs, or a kernel before 6.1)"
            }
            ReadFallback::DirectOpenRefused => {
                "opening the file with O_DIRECT answered EINVAL (no direct I/O on this file system)"
            }
            ReadFallback::NoProcFs => {
                "/proc/self/fd is unavailable, so the file cannot be reopened with O_DIRECT"
            }
        })
    }
}

/// Reads in flight per loader thread, at most, when direct reads go through blocking
/// calls (`source::pool`): the calling loader and 7 helper threads. With requests of 4 MiB (the most one
/// ring request reads) that is the 32 MiB batch of slots a loader takes at once.
pub const POOL_DEPTH: usize = 8;

/// How the direct reads of a [`ReadMode::Direct`] load were issued
/// ([`LayerReport::direct_io`](crate::store::LayerReport::direct_io)).
///
/// `Display` prints `io_uring (depth 32 per loader)` or `threads (up to 8 reads in flight
/// per loader; fallback: …)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "kebab-case")
)]
#[non_exhaustive]
pub enum DirectIo {
    /// Each loader thread keeps up to `depth` reads in flight on its own `io_uring`,
    /// straight into the slots (aligned pieces; the others go through the bounce buffer).
    IoUring {
        /// Reads in flight per loader thread, at most.
        depth: usize,
    },
    /// Blocking `pread`/`preadv` calls, because `io_uring` could not be used (the reason
    /// is the value): each loader thread keeps up to
    /// [`POOL_DEPTH`](crate::store::POOL_DEPTH) of them in flight with short-lived read
    /// threads ([`DirectReads::blocking_depth`] says how many it had).
    Threads(IoUringFallback),
}

impl DirectIo {
    /// Whether the reads went through `io_uring`.
    pub(crate) fn is_io_uring(self) -> bool {
        matches!(self, DirectIo::IoUring { .. })
    }
}

impl fmt::Display for DirectIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DirectIo::IoUring { depth } => write!(f, "io_uring (depth {depth} per loader)"),
            DirectIo::Threads(why) => write!(
                f,
                "threads (up to {} reads in flight per loader; fallback: {why})",
                POOL_DEPTH
            ),
        }
    }
}

/// Why direct reads ran on blocking loader threads instead of `io_uring`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "kebab-case")
)]
#[non_exhaustive]
pub enum IoUringFallback {
    /// `io_uring_setup` answered `EPERM`: a seccomp profile denies it (Docker's default
    /// since Docker 25, moby #46762) or `kernel.io_uring_disabled` is set (Linux 6.6+).
    Denied,
    /// `io_uring_setup` answered `ENOSYS`: the kernel has no `io_uring`
    /// (`CONFIG_IO_URING=n`, or a filter that answers so).
    Unsupported,
    /// [`StoreOptions::io_uring`](crate::store::StoreOptions::io_uring) turned it off.
    Off,
    /// The environment variable `NUMAPIN_IO_URING=off` ([`IO_URING_ENV`](crate::store::IO_URING_ENV))
    /// turned it off.
    Environment,
}

impl fmt::Display for IoUringFallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IoUringFallback::Denied => {
                "io_uring_setup answered EPERM (a seccomp profile such as Docker's default, \
                 or kernel.io_uring_disabled)"
            }
            IoUringFallback::Unsupported => {
                "io_uring_setup answered ENOSYS (no io_uring in this kernel)"
            }
            IoUringFallback::Off => "io_uring turned off in the options",
            IoUringFallback::Environment => "io_uring turned off by NUMAPIN_IO_URING=off",
        })
    }
}

/// What the direct reads of a load did ([`LayerReport::direct_reads`](crate::store::LayerReport::direct_reads)):
/// the bytes that landed in the slots in place (the rest of a direct load's bytes went
/// through the bounce buffers: `bounced_bytes`), and the reads issued per mechanism.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DirectReads {
    /// Slot bytes read straight into place.
    pub in_place_bytes: u64,
    /// Requests submitted to the loaders' `io_uring`s (resubmissions included).
    pub uring_reads: u64,
    /// Blocking `pread`/`preadv` calls of the loader threads.
    pub blocking_reads: u64,
    /// The most requests one loader's ring had in flight at once (0: no ring).
    pub uring_depth: usize,
    /// The most blocking calls one loader had in flight at once: up to
    /// [`POOL_DEPTH`](crate::store::POOL_DEPTH) where `io_uring` is not used (the loader
    /// and its read threads), 1 for calls one at a time, 0 when none was made.
    #[cfg_attr(feature = "serde", serde(default))]
    pub blocking_depth: usize,
}

impl DirectReads {
    /// Both loads' counts: sums, and the larger depth.
    #[must_use]
    pub(crate) fn plus(self, other: DirectReads) -> DirectReads {
        DirectReads {
            in_place_bytes: self.in_place_bytes + other.in_place_bytes,
            uring_reads: self.uring_reads + other.uring_reads,
            blocking_reads: self.blocking_reads + other.blocking_reads,
            uring_depth: self.uring_depth.max(other.uring_depth),
            blocking_depth: self.blocking_depth.max(other.blocking_depth),
        }
    }
}

/// A file's page-cache residency, as [`ReadMode::Auto`] measured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Residency {
    /// Pages of the file in the page cache.
    pub cached_pages: u64,
    /// Pages of the file (its size in base pages, rounded up).
    pub pages: u64,
    /// The call that counted them.
    pub probe: ResidencyProbe,
}

impl Residency {
    /// Whether [`ReadMode::Auto`] reads the file buffered: at least half its pages are
    /// cached (an empty file is).
    pub(crate) fn mostly_cached(&self) -> bool {
        self.cached_pages.saturating_mul(2) >= self.pages
    }
}

/// How a file's residency was measured (`cachestat`, or `mincore` where it is missing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "kebab-case")
)]
#[non_exhaustive]
pub enum ResidencyProbe {
    /// `cachestat(2)` (Linux 6.5).
    Cachestat,
    /// `mincore(2)` on a read-only mapping of the file: `cachestat` answered `ENOSYS`
    /// (or `EOPNOTSUPP`).
    Mincore,
}

impl ResidencyProbe {
    /// The call's name (`"cachestat"`).
    pub fn name(self) -> &'static str {
        match self {
            ResidencyProbe::Cachestat => "cachestat",
            ResidencyProbe::Mincore => "mincore",
        }
    }
}

/// How one file of a load was read, and why
/// ([`LayerReport::files`](crate::store::LayerReport::files)).
///
/// `Display` prints `/m/shard-1.safetensors: direct (auto: 0 of 262144 pages cached,
/// by cachestat)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct FileRead {
    /// The file's path (`/proc/self/fd`'s name for it; `fd N` without one).
    pub path: String,
    /// How it was read: never [`ReadMode::Auto`], which picks one of the others.
    pub mode: ReadMode,
    /// Its residency, where [`ReadMode::Auto`] measured it.
    pub residency: Option<Residency>,
    /// Why it was read buffered although direct reads were asked for (or picked).
    pub fallback: Option<ReadFallback>,
}

impl fmt::Display for FileRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.mode)?;
        match (&self.residency, &self.fallback) {
            (Some(r), _) => write!(
                f,
                " (auto: {} of {} pages cached, by {}",
                r.cached_pages,
                r.pages,
                r.probe.name()
            )?,
            (None, _) => f.write_str(" (asked")?,
        }
        match &self.fallback {
            Some(why) => write!(f, "; fell back: {why})"),
            None => f.write_str(")"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_refused() {
        for mode in ReadMode::ALL {
            assert_eq!(mode.to_string().parse::<ReadMode>().unwrap(), mode);
        }
        assert_eq!(
            "DROP_BEHIND".parse::<ReadMode>().unwrap(),
            ReadMode::DropBehind
        );
        let e = "o_direct".parse::<ReadMode>().unwrap_err();
        assert!(e.to_string().contains("\"o_direct\""), "{e}");
        assert_eq!(ReadMode::default(), ReadMode::Auto);
    }
}
