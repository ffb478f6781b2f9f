//! Where a slot's bytes come from: bytes in memory, or pieces of files (each piece naming
//! its own file, so that an expert whose tensors straddle two checkpoint shards loads
//! without a copy), and the parallel loader that copies them into slots. Used by the store
//! and the cache alike; it knows nothing of either.

mod behind;
pub(crate) mod compare;
pub(crate) mod direct;
pub(crate) mod load;
mod mode;
mod pool;
pub(crate) mod progress;
pub(crate) mod read;
mod resident;
mod segment;
mod uring;

use std::fs::File;

use crate::error::{Error, Result};

pub use behind::DROP_BEHIND_EVERY;
pub use load::{LOADER_THREAD_MAPS, MAX_READ};
pub use mode::{
    DirectIo, DirectReads, FileRead, IoUringFallback, ReadFallback, ReadMode, Residency,
    ResidencyProbe,
};
pub(crate) use pool::ThreadRoom;
pub use pool::{IO_URING_ENV, POOL_DEPTH};
pub use progress::{PROGRESS_STEP, Progress, ProgressHook};
pub(crate) use resident::residency;

/// Which tensor of an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum Kind {
    /// The expert's weight matrices (gate, up, down).
    Weights = 0,
    /// The expert's quantisation scales.
    Scales = 1,
}

impl Kind {
    /// Every kind, in slot order: the one list a new tensor kind is added to.
    pub const ALL: [Kind; 2] = [Kind::Weights, Kind::Scales];

    /// The kind's name (`"weights"`), as in manifests and messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Weights => "weights",
            Kind::Scales => "scales",
        }
    }

    /// The kind's position in [`Kind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A range of a file: `len` bytes at `offset`.
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    /// The open file (a checkpoint shard).
    pub file: &'a File,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes.
    pub len: usize,
    /// Laid out right after the piece before it, whatever the store's `piece_align` and
    /// `piece_congruence` (the rows of one column-sliced tensor: one byte run a view can
    /// hand out). Set with [`Piece::joined`].
    pub(crate) joined: bool,
}

impl<'a> Piece<'a> {
    /// `len` bytes of `file` at `offset`.
    pub fn new(file: &'a File, offset: u64, len: usize) -> Self {
        Piece {
            file,
            offset,
            len,
            joined: false,
        }
    }

    /// The same piece laid out back to back with the piece before it in the slot (no
    /// alignment padding between them): the strided rows of a column slice that must read
    /// as one `[rows, len]` run.
    #[must_use]
    pub(crate) fn joined(mut self) -> Self {
        self.joined = true;
        self
    }
}

/// Where one expert's bytes come from.
///
/// # Example
/// ```
/// use numapin::store::{ExpertSource, Kind, Piece};
/// let file = std::fs::File::open("/proc/self/exe").unwrap();
/// // gate and up are adjacent in the file (one read), down is elsewhere.
/// let source = ExpertSource::File {
///     weights: vec![Piece::new(&file, 0, 100), Piece::new(&file, 100, 100), Piece::new(&file, 4096, 50)],
///     scales: vec![],
/// };
/// assert_eq!(source.bytes(Kind::Weights)?, 250);
/// assert_eq!(source.bytes(Kind::Scales)?, 0);
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone)]
pub enum ExpertSource<'a> {
    /// Bytes already in memory.
    Memory {
        /// The weights.
        weights: &'a [u8],
        /// The scales (may be empty).
        scales: &'a [u8],
    },
    /// Pieces of files, concatenated into the slot in order (e.g. gate, up, down). Each
    /// piece names its file; adjacent pieces of one file are read with one `pread`.
    File {
        /// Pieces of the weights.
        weights: Vec<Piece<'a>>,
        /// Pieces of the scales.
        scales: Vec<Piece<'a>>,
    },
}

/// One tensor of one expert's source.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Tensor<'a> {
    Memory(&'a [u8]),
    File(&'a [Piece<'a>]),
}

impl<'a> ExpertSource<'a> {
    /// Pieces of one file: `(offset, len)` for the weights and the scales.
    pub fn from_file(file: &'a File, weights: &[(u64, usize)], scales: &[(u64, usize)]) -> Self {
        let pieces = |list: &[(u64, usize)]| {
            list.iter()
                .map(|&(offset, len)| Piece::new(file, offset, len))
                .collect()
        };
        ExpertSource::File {
            weights: pieces(weights),
            scales: pieces(scales),
        }
    }

    pub(crate) fn tensor(&self, kind: Kind) -> Tensor<'_> {
        match (self, kind) {
            (ExpertSource::Memory { weights, .. }, Kind::Weights) => Tensor::Memory(weights),
            (ExpertSource::Memory { scales, .. }, Kind::Scales) => Tensor::Memory(scales),
            (ExpertSource::File { weights, .. }, Kind::Weights) => Tensor::File(weights),
            (ExpertSource::File { scales, .. }, Kind::Scales) => Tensor::File(scales),
        }
    }

    /// Bytes of the tensor `kind` (the sum of its pieces).
    ///
    /// # Errors
    /// The piece lengths overflow `usize`.
    pub fn bytes(&self, kind: Kind) -> Result<usize> {
        match self.tensor(kind) {
            Tensor::Memory(bytes) => Ok(bytes.len()),
            Tensor::File(pieces) => pieces
                .iter()
                .try_fold(0usize, |sum, p| sum.checked_add(p.len))
                .ok_or_else(|| {
                    Error::overflow(
                        "ExpertSource",
                        format!("the sum of the {} piece lengths", kind.name()),
                    )
                }),
        }
    }

    /// Copies the tensor `kind` into `dest` (its first [`ExpertSource::bytes`] bytes),
    /// reading file pieces with `pread` (adjacent pieces of one file with one call).
    ///
    /// # Errors
    /// `dest` is too short, or a read fails or ends early (the error names the file
    /// offset and length).
    pub fn read_tensor(&self, kind: Kind, dest: &mut [u8]) -> Result<()> {
        let len = self.bytes(kind)?;
        if dest.len() < len {
            return Err(Error::too_large(
                "ExpertSource::read_tensor",
                format!("the {}", kind.name()),
                len,
                dest.len(),
                "the buffer",
            ));
        }
        load::fill_slot(load::Job {
            dest,
            tensor: self.tensor(kind),
            what: (0, 0, kind),
        })
    }
}

impl<'a> Tensor<'a> {
    /// The byte count (saturating; [`Tensor::checked_len`] checks it).
    pub(crate) fn len(&self) -> usize {
        match *self {
            Tensor::Memory(bytes) => bytes.len(),
            Tensor::File(pieces) => pieces
                .iter()
                .fold(0usize, |sum, p| sum.saturating_add(p.len)),
        }
    }

    /// The tensor's file pieces (none for bytes in memory).
    pub(crate) fn pieces(&self) -> &'a [Piece<'a>] {
        match *self {
            Tensor::Memory(_) => &[],
            Tensor::File(pieces) => pieces,
        }
    }

    /// The files the tensor's pieces come from (repeats included).
    pub(crate) fn files(&self) -> impl Iterator<Item = &'a File> + use<'a> {
        let pieces: &'a [Piece<'a>] = match *self {
            Tensor::Memory(_) => &[],
            Tensor::File(pieces) => pieces,
        };
        pieces.iter().map(|p| p.file)
    }

    /// The byte count, checking pieces against overflow and their files' lengths (each
    /// file's length read once per call).
    pub(crate) fn checked_len(&self, op: &'static str, what: &dyn Fn() -> String) -> Result<usize> {
        match *self {
            Tensor::Memory(bytes) => Ok(bytes.len()),
            Tensor::File(pieces) => {
                let mut sizes: Vec<(*const File, u64)> = Vec::new();
                let mut total: usize = 0;
                for piece in pieces {
                    let key: *const File = piece.file;
                    let size = match sizes.iter().find(|(f, _)| *f == key) {
                        Some(&(_, size)) => size,
                        None => {
                            let size = piece
                                .file
                                .metadata()
                                .map_err(|e| Error::io("fstat", what(), e))?
                                .len();
                            sizes.push((key, size));
                            size
                        }
                    };
                    let end = piece.offset.checked_add(piece.len as u64).ok_or_else(|| {
                        let at = format!(
                            "piece at file offset {} + {} bytes",
                            piece.offset, piece.len
                        );
                        Error::overflow(op, format!("{}: {at}", what()))
                    })?;
                    if end > size {
                        let at = format!("{}: piece at file offsets", what());
                        return Err(Error::out_of_bounds(
                            op,
                            at,
                            piece.offset..end,
                            size,
                            "the file",
                        ));
                    }
                    total = total.checked_add(piece.len).ok_or_else(|| {
                        Error::overflow(op, format!("{}: the sum of the piece lengths", what()))
                    })?;
                }
                Ok(total)
            }
        }
    }
}
