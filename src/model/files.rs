//! What every checkpoint format needs from its files, whatever their format: positional
//! reads ([`ReadAt`]), opening a regular file, reading a stated length without trusting
//! it, the layout checks of one file's tensors and the uniqueness of names across files,
//! the `NAME-0000K-of-0000N` part names, and the text of messages.
//!
//! Both formats import this module; neither imports the other.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{CheckpointFile, TensorInfo};
use crate::error::{CheckpointFault, Error, Result, quote};

/// Positional reads from a file or a buffer: what the header parsers need.
///
/// Implemented for [`File`] (`pread`) and for `[u8]`/`Vec<u8>` (tests, fuzzing, headers
/// already in memory).
pub trait ReadAt {
    /// The total length in bytes.
    ///
    /// # Errors
    /// The underlying I/O error (`fstat`).
    fn size(&self) -> io::Result<u64>;

    /// Fills `buf` from `offset`; a range past the end is
    /// [`io::ErrorKind::UnexpectedEof`].
    ///
    /// # Errors
    /// The underlying I/O error, or `UnexpectedEof`.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

impl ReadAt for File {
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
}

impl ReadAt for [u8] {
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).ok();
        let range = start.and_then(|s| Some(s..s.checked_add(buf.len())?));
        match range.and_then(|r| self.get(r)) {
            Some(bytes) => {
                buf.copy_from_slice(bytes);
                Ok(())
            }
            None => Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }
}

impl ReadAt for Vec<u8> {
    fn size(&self) -> io::Result<u64> {
        self.as_slice().size()
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.as_slice().read_exact_at(buf, offset)
    }
}

/// `len` bytes at `offset`, read in steps of at most 1 MiB into a buffer that grows with
/// what was read: `len` is a number a file stated, and a sparse file holds every byte it
/// claims, so nothing is reserved for it ahead.
pub(crate) fn read_grown(src: &dyn ReadAt, offset: u64, len: u64) -> io::Result<Vec<u8>> {
    const STEP: u64 = 1 << 20;
    let mut out = Vec::with_capacity(len.min(STEP) as usize);
    while (out.len() as u64) < len {
        let at = out.len();
        let step = (len - at as u64).min(STEP) as usize;
        out.resize(at + step, 0);
        src.read_exact_at(&mut out[at..], offset + at as u64)?;
    }
    Ok(out)
}

/// A shape for a message: a safetensors shape may have a million dimensions.
pub(crate) fn shape_text(shape: &[u64]) -> String {
    const SHOWN: usize = 8;
    if shape.len() <= SHOWN {
        return format!("{shape:?}");
    }
    format!("{:?} … ({} dimensions)", &shape[..SHOWN], shape.len())
}

/// A path for a message.
pub(super) fn display(path: &Path) -> String {
    path.display().to_string()
}

/// The directory a file path is in (`.` for a bare name).
pub(super) fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Opens a regular file for reading. `O_NONBLOCK`, so that a FIFO (or a device) named
/// like a shard is refused after `fstat` instead of blocking the open forever; it has no
/// effect on reads of a regular file.
pub(super) fn open_file(path: &Path) -> Result<(File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io("open", display(path), e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io("fstat", display(path), e))?;
    if !meta.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        let kind = if t.is_dir() {
            "a directory"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_socket() {
            "a socket"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else {
            "not a regular file"
        };
        return Err(Error::checkpoint(
            display(path),
            None,
            CheckpointFault::Header,
            format!("{kind}, not a regular file"),
        ));
    }
    Ok((file, meta.len()))
}

impl CheckpointFile {
    /// Opens one file of a checkpoint (see [`open_file`]).
    pub(super) fn open(path: PathBuf) -> Result<CheckpointFile> {
        let (file, len) = open_file(&path)?;
        Ok(CheckpointFile { path, file, len })
    }

    /// Its path for a message.
    pub(super) fn name(&self) -> String {
        display(&self.path)
    }
}

/// The tensors of file number `index` of a checkpoint (a parser numbers them 0).
pub(super) fn in_file(mut tensors: Vec<TensorInfo>, index: usize) -> Vec<TensorInfo> {
    for t in &mut tensors {
        t.file = index;
    }
    tensors
}

/// A name twice across files (within one file the parser already refused it).
pub(super) fn check_unique(files: &[CheckpointFile], tensors: &[TensorInfo]) -> Result<()> {
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(tensors.len());
    for t in tensors {
        if let Some(first) = seen.insert(&t.name, t.file) {
            return Err(Error::checkpoint(
                display(&files[t.file].path),
                Some(&t.name),
                CheckpointFault::Duplicate,
                format!("the tensor is also in {}", files[first].path.display()),
            ));
        }
    }
    Ok(())
}

/// No two tensors of one file with one name, no two overlapping; sorts by offset.
pub(super) fn check_layout(tensors: &mut [TensorInfo], file: &str) -> Result<()> {
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    for pair in tensors.windows(2) {
        if pair[0].name == pair[1].name {
            return Err(Error::checkpoint(
                file,
                Some(&pair[1].name),
                CheckpointFault::Duplicate,
                "the name appears twice in the file",
            ));
        }
    }
    tensors.sort_by_key(|t| (t.offset, t.len));
    // Empty tensors occupy nothing and overlap nothing; sorted by offset, a tensor can
    // only overlap the non-empty one before it that reaches furthest.
    let mut furthest: Option<&TensorInfo> = None;
    for b in tensors.iter().filter(|t| t.len > 0) {
        if let Some(a) = furthest
            && b.offset < a.offset + a.len
        {
            return Err(Error::checkpoint(
                file,
                Some(&b.name),
                CheckpointFault::Range,
                format!(
                    "bytes {}..{} overlap {} at {}..{}",
                    b.offset,
                    b.offset + b.len,
                    quote(&a.name),
                    a.offset,
                    a.offset + a.len
                ),
            ));
        }
        furthest = Some(b);
    }
    Ok(())
}

/// `(prefix, no, count)` from `prefix-00002-of-00003{extension}` (no from 1): the part
/// names of sharded safetensors and of split GGUF alike.
pub(super) fn part_name(path: &Path, extension: &str) -> Option<(String, u64, u64)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(extension)?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    Some((prefix.to_owned(), no.parse().ok()?, count.parse().ok()?))
}
