//! Real checkpoints: safetensors (one file, sharded, fused experts) and GGUF (one file,
//! split), read header-only, and the expert naming that turns their tensors into an
//! [`ExpertPlan`]: per MoE layer, per expert, the file pieces of its weights and scales.
//!
//! Nothing here maps or reads tensor data: [`Checkpoint::open`] reads each file's header
//! (safetensors: the u64 length prefix and the JSON; GGUF: key/values and tensor infos),
//! checks every tensor range against its file, and keeps the files open. Every fault is an
//! [`Error::Checkpoint`] naming the file and, where there is
//! one, the tensor; never a panic, never an allocation sized by a length the file claims
//! but does not hold.
//!
//! The parsers work over [`ReadAt`] (positional reads), so a header can be parsed from
//! memory as well as from a [`File`].
//!
//! # Example
//! ```no_run
//! use numapin::model::{Checkpoint, Naming};
//!
//! let checkpoint = Checkpoint::open("/models/qwen-moe")?; // a directory of shards
//! let plan = checkpoint.expert_plan()?; // naming detected
//! for layer in plan.layers() {
//!     println!("layer {}: {} experts, {} weight bytes each",
//!              layer.layer(), layer.experts().len(), layer.weight_bytes());
//! }
//! let mixtral = checkpoint.expert_plan_with(&Naming::Mixtral)?; // or chosen by hand
//! # let _ = mixtral;
//! # Ok::<(), numapin::Error>(())
//! ```

mod config;
pub mod ggml;
pub mod gguf;
mod naming;
mod pack;
mod plan;
pub mod safetensors;

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use config::MAX_CONFIG;
pub use ggml::GgmlType;
pub use gguf::{GgufArray, GgufValue};
pub use naming::{
    CustomNaming, ExpertPieces, ExpertPlan, LayerPlan, MAX_EXPERTS_PER_LAYER, Naming, Piece,
    PieceRole, TensorRef,
};
pub use pack::{ModelReport, SlotMismatch, VerifyReport};
pub use safetensors::Dtype as SafetensorsDtype;

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

/// A tensor's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// A safetensors dtype (`"BF16"`, `"F8_E4M3"`, …).
    Safetensors(SafetensorsDtype),
    /// A ggml type (GGUF), quantised ones included.
    Ggml(GgmlType),
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dtype::Safetensors(d) => write!(f, "{}", d.name()),
            Dtype::Ggml(t) => write!(f, "{}", t.name()),
        }
    }
}

/// One tensor of a checkpoint: where its bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    file: usize,
    offset: u64,
    len: u64,
}

impl TensorInfo {
    /// Its name in the checkpoint.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Its shape as the file states it: safetensors outermost first (row-major); GGUF
    /// `ne0` first (innermost first, ggml's order).
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Index of its file in [`Checkpoint::files`].
    pub fn file(&self) -> usize {
        self.file
    }

    /// Absolute byte offset of its data in that file.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The experts (outermost) dimension of a merged or fused expert tensor.
    pub(crate) fn outermost_dim(&self) -> Option<u64> {
        match self.dtype {
            Dtype::Safetensors(_) => self.shape.first().copied(),
            Dtype::Ggml(_) => self.shape.last().copied(),
        }
    }
}

/// The container format of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One or more `.safetensors` files.
    Safetensors,
    /// One GGUF file, or the parts of a split set.
    Gguf,
}

/// One open file of a checkpoint.
#[derive(Debug)]
pub struct CheckpointFile {
    path: PathBuf,
    file: File,
    len: u64,
}

impl CheckpointFile {
    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file (kept open by the checkpoint, so the tensors' ranges refer to what
    /// was validated even if the path is replaced).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Its length when opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A checkpoint on disk: its files (open), its tensors, and for GGUF its metadata.
///
/// # Example
/// ```no_run
/// let checkpoint = numapin::model::Checkpoint::open("model.gguf")?;
/// for tensor in checkpoint.tensors() {
///     let file = &checkpoint.files()[tensor.file()];
///     println!("{} {} at {}+{} in {}", tensor.name(), tensor.dtype(), tensor.offset(),
///              tensor.len(), file.path().display());
/// }
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug)]
pub struct Checkpoint {
    format: Format,
    files: Vec<CheckpointFile>,
    tensors: Vec<TensorInfo>,
    metadata: Vec<(String, GgufValue)>,
    config: Option<config::ModelConfig>,
}

impl Checkpoint {
    /// Opens a checkpoint, reading only headers.
    ///
    /// `path` is one of: a `.safetensors` file; a directory holding
    /// `model.safetensors.index.json` (its `weight_map` names the shards); a directory of
    /// `*.safetensors` files without an index; a `.gguf` file; the first part of a split
    /// GGUF (`name-00001-of-0000N.gguf`; the other parts are found beside it and checked
    /// against its `split.*` keys).
    ///
    /// A part of a sharded safetensors set is never taken for the whole: a file named
    /// `NAME-0000K-of-0000N.safetensors` with N > 1 opens the whole set through
    /// `NAME.safetensors.index.json` beside it (which must name the file), and is refused
    /// without one; a directory without an index must hold every part of each such set.
    /// (`-00001-of-00001` is a whole checkpoint.) A non-first GGUF part is refused too.
    ///
    /// A `config.json` beside safetensors files (GGUF: the `{arch}.expert_count` key) is
    /// read, if small and understood, for [`Naming::plan`]'s checks.
    ///
    /// # Errors
    /// [`Error::Io`] when a file cannot be opened or read; [`Error::Checkpoint`] for every
    /// malformed header, tensor range, duplicate name, missing shard or split part, a
    /// shard opened alone ([`CheckpointFault::Split`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io("stat", display(path), e))?;
        let dir = if meta.is_dir() {
            path
        } else {
            path.parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."))
        };
        let mut checkpoint = if meta.is_dir() {
            open_safetensors_dir(path)?
        } else {
            match path.extension().and_then(|e| e.to_str()) {
                Some("gguf") => open_gguf(path)?,
                Some("safetensors") => open_safetensors_file(path)?,
                Some("json") => open_safetensors_index(path)?,
                _ => {
                    return Err(Error::checkpoint(
                        display(path),
                        None,
                        CheckpointFault::Header,
                        "not a .safetensors or .gguf file, an index .json, nor a directory",
                    ));
                }
            }
        };
        checkpoint.config = match checkpoint.format {
            Format::Safetensors => config::ModelConfig::read(dir),
            Format::Gguf => config::ModelConfig::from_gguf(&checkpoint.metadata, path),
        };
        Ok(checkpoint)
    }

    /// The model config read beside the checkpoint, if any was understood.
    pub(crate) fn config(&self) -> Option<&config::ModelConfig> {
        self.config.as_ref()
    }

    /// The container format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Every tensor, in file order then offset order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The checkpoint's files, open; [`TensorInfo::file`] indexes this.
    pub fn files(&self) -> &[CheckpointFile] {
        &self.files
    }

    /// GGUF key/values (of the first part for a split set; `split.*` keys included);
    /// empty for safetensors.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// The GGUF value of `key`.
    pub fn metadata_value(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The experts, with the naming detected from the tensor names
    /// (see [`Naming::detect`]).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] with [`CheckpointFault::NoExperts`] (listing names that look
    /// like expert tensors), [`CheckpointFault::Missing`] for a layer missing an expert,
    /// [`CheckpointFault::Shape`] for experts of one layer with different shapes.
    pub fn expert_plan(&self) -> Result<ExpertPlan> {
        let naming = Naming::detect(self)?;
        naming.plan(self)
    }

    /// The experts under a naming chosen by hand.
    ///
    /// # Errors
    /// As [`Checkpoint::expert_plan`].
    pub fn expert_plan_with(&self, naming: &Naming) -> Result<ExpertPlan> {
        naming.plan(self)
    }

    fn from_safetensors_files(paths: Vec<PathBuf>) -> Result<Checkpoint> {
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors = Vec::new();
        for (index, path) in paths.into_iter().enumerate() {
            let (file, len) = open_file(&path)?;
            let parsed = safetensors::parse(&file, &display(&path))?;
            tensors.extend(parsed.into_iter().map(|mut t| {
                t.file = index;
                t
            }));
            files.push(CheckpointFile { path, file, len });
        }
        check_unique(&files, &tensors)?;
        Ok(Checkpoint {
            format: Format::Safetensors,
            files,
            tensors,
            metadata: Vec::new(),
            config: None,
        })
    }
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

/// Opens a regular file for reading. `O_NONBLOCK`, so that a FIFO (or a device) named
/// like a shard is refused after `fstat` instead of blocking the open forever; it has no
/// effect on reads of a regular file.
fn open_file(path: &Path) -> Result<(File, u64)> {
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

/// A name twice across files (within one file the parser already refused it).
fn check_unique(files: &[CheckpointFile], tensors: &[TensorInfo]) -> Result<()> {
    let mut seen: std::collections::HashMap<&str, usize> =
        std::collections::HashMap::with_capacity(tensors.len());
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

const INDEX_NAME: &str = "model.safetensors.index.json";

/// `(prefix, no, count)` from `prefix-00002-of-00003.safetensors` (no from 1).
fn shard_name(path: &Path) -> Option<(String, u64, u64)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".safetensors")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    Some((prefix.to_owned(), no.parse().ok()?, count.parse().ok()?))
}

/// One `.safetensors` file: the whole checkpoint, unless its name says it is a part of a
/// set, which is opened through its index or refused.
fn open_safetensors_file(path: &Path) -> Result<Checkpoint> {
    let Some((prefix, no, count)) = shard_name(path).filter(|(_, _, count)| *count > 1) else {
        return Checkpoint::from_safetensors_files(vec![path.to_path_buf()]);
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let index = dir.join(format!("{prefix}.safetensors.index.json"));
    if !index.is_file() {
        return Err(Error::checkpoint(
            display(path),
            None,
            CheckpointFault::Split,
            format!(
                "part {no} of {count} of a sharded checkpoint, opened alone: its experts would \
                 be missing the tensors of the other parts; open the directory or {} (not \
                 found beside it)",
                index.display()
            ),
        ));
    }
    let checkpoint = open_safetensors_index(&index)?;
    let name = path.file_name();
    if !checkpoint.files.iter().any(|f| f.path.file_name() == name) {
        return Err(Error::checkpoint(
            display(path),
            None,
            CheckpointFault::Split,
            format!(
                "part {no} of {count} of a sharded checkpoint, but {} beside it does not \
                 name this file",
                index.display()
            ),
        ));
    }
    Ok(checkpoint)
}

/// Every part of each `NAME-0000K-of-0000N.safetensors` set among `paths` is there.
fn check_shard_sets(dir: &Path, paths: &[PathBuf]) -> Result<()> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut sets: BTreeMap<(String, u64), BTreeSet<u64>> = BTreeMap::new();
    for path in paths {
        if let Some((prefix, no, count)) = shard_name(path) {
            sets.entry((prefix, count)).or_default().insert(no);
        }
    }
    for ((prefix, count), present) in sets {
        // At most |present| + 1 turns: the first part not present.
        let missing = (1..=count).find(|no| !present.contains(no));
        if let Some(no) = missing {
            return Err(Error::checkpoint(
                display(dir),
                None,
                CheckpointFault::Missing,
                format!(
                    "part {no} of {count} of {} is not in the directory (and there is no \
                     {INDEX_NAME}): the other parts alone are not the checkpoint",
                    quote(&format!("{prefix}-*-of-{count:05}.safetensors"))
                ),
            ));
        }
    }
    Ok(())
}

fn open_safetensors_dir(dir: &Path) -> Result<Checkpoint> {
    let index = dir.join(INDEX_NAME);
    if index.is_file() {
        return open_safetensors_index(&index);
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("readdir", display(dir), e))?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("readdir", display(dir), e))?;
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) == Some("safetensors") {
            paths.push(path);
        }
    }
    if paths.is_empty() {
        return Err(Error::checkpoint(
            display(dir),
            None,
            CheckpointFault::Missing,
            format!("no {INDEX_NAME} and no *.safetensors file in the directory"),
        ));
    }
    paths.sort();
    check_shard_sets(dir, &paths)?;
    Checkpoint::from_safetensors_files(paths)
}

/// The index JSON is read whole, bounded like a header.
fn open_safetensors_index(index: &Path) -> Result<Checkpoint> {
    let (file, len) = open_file(index)?;
    let name = display(index);
    if len > safetensors::MAX_HEADER {
        return Err(Error::checkpoint(
            name,
            None,
            CheckpointFault::Header,
            format!(
                "index of {len} bytes is larger than the {} byte cap",
                safetensors::MAX_HEADER
            ),
        ));
    }
    let bytes = read_grown(&file, 0, len).map_err(|e| Error::io("pread", &name, e))?;
    let weight_map = safetensors::parse_index(&bytes, &name)?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut shard_names: Vec<&str> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (_, shard) in &weight_map {
        if seen.insert(shard.as_str()) {
            shard_names.push(shard.as_str());
        }
    }
    let mut paths = Vec::with_capacity(shard_names.len());
    for shard in shard_names {
        let path = dir.join(shard);
        if !path.is_file() {
            let tensor = weight_map
                .iter()
                .find(|(_, s)| s == shard)
                .map(|(t, _)| t.as_str());
            return Err(Error::checkpoint(
                name,
                tensor,
                CheckpointFault::Missing,
                format!(
                    "the index names shard {}, which does not exist",
                    quote(shard)
                ),
            ));
        }
        paths.push(path);
    }
    let checkpoint = Checkpoint::from_safetensors_files(paths)?;
    let by_name: std::collections::HashMap<&str, &TensorInfo> = checkpoint
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    for (tensor, shard) in &weight_map {
        let found = by_name.get(tensor.as_str()).map(|t| {
            checkpoint.files[t.file].path.file_name() == Some(std::ffi::OsStr::new(shard))
        });
        if found != Some(true) {
            return Err(Error::checkpoint(
                name,
                Some(tensor),
                CheckpointFault::Missing,
                format!(
                    "the index places the tensor in {}, which does not hold it",
                    quote(shard)
                ),
            ));
        }
    }
    Ok(checkpoint)
}

fn open_gguf(path: &Path) -> Result<Checkpoint> {
    let (file, len) = open_file(path)?;
    let first = gguf::parse(&file, &display(path))?;
    let split = gguf::split_info(&first.metadata, &display(path))?;
    let Some(split) = split else {
        if let Some((_, no, count)) = gguf::split_name(path)
            && count > 1
        {
            return Err(Error::checkpoint(
                display(path),
                None,
                CheckpointFault::Split,
                format!("named part {no} of {count} but the file has no split.count key"),
            ));
        }
        let tensors = first.tensors;
        let files = vec![CheckpointFile {
            path: path.to_path_buf(),
            file,
            len,
        }];
        check_unique(&files, &tensors)?;
        return Ok(Checkpoint {
            format: Format::Gguf,
            files,
            tensors,
            metadata: first.metadata,
            config: None,
        });
    };
    let paths = gguf::split_paths(path, &split)?;
    let mut files = vec![CheckpointFile {
        path: path.to_path_buf(),
        file,
        len,
    }];
    let mut tensors = first.tensors;
    for (no, part_path) in paths.into_iter().enumerate().skip(1) {
        let (part_file, part_len) = open_file(&part_path)?;
        let part = gguf::parse(&part_file, &display(&part_path))?;
        let info = gguf::split_info(&part.metadata, &display(&part_path))?;
        gguf::check_part(&display(&part_path), info.as_ref(), no, &split)?;
        tensors.extend(part.tensors.into_iter().map(|mut t| {
            t.file = no;
            t
        }));
        files.push(CheckpointFile {
            path: part_path,
            file: part_file,
            len: part_len,
        });
    }
    if let Some(total) = split.tensors
        && total != tensors.len() as u64
    {
        return Err(Error::checkpoint(
            display(path),
            None,
            CheckpointFault::Split,
            format!(
                "split.tensors.count is {total} but the {} parts hold {} tensors",
                split.count,
                tensors.len()
            ),
        ));
    }
    check_unique(&files, &tensors)?;
    Ok(Checkpoint {
        format: Format::Gguf,
        files,
        tensors,
        metadata: first.metadata,
        config: None,
    })
}
