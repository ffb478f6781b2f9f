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
mod files;
mod ggml;
// The header parsers, public for the hostile tests that feed them bytes; not the API.
#[doc(hidden)]
pub mod gguf;
mod naming;
mod pack;
mod plan;
#[doc(hidden)]
pub mod safetensors;
mod share;
mod slice;
mod verify;
mod whole;

use std::fs::File;
use std::path::{Path, PathBuf};

pub use config::MAX_CONFIG;
pub use files::ReadAt;
pub use ggml::GgmlType;
pub use gguf::{GgufArray, GgufValue};
pub use naming::{
    CustomNaming, ExpertPieces, ExpertPlan, GateUpLayout, LayerPlan, MAX_EXPERTS_PER_LAYER, Naming,
    Orientation, PieceRole, TensorKind, TensorPiece, TensorRef, Vocabulary,
};
pub use pack::{ModelReport, ShareReport};
pub use safetensors::Dtype as SafetensorsDtype;
pub use share::{ExpertShare, LayerShare, Share};
pub use slice::{RoleSlice, SliceAxis, TensorSlice};
pub use verify::{SlotMismatch, VerifyReport};
pub use whole::{
    Block, ClassCost, ClassMeasured, DENSE_ALIGN, DenseLayout, DenseSlice, ExpertPieceView,
    ExpertRole, ExpertTensorRef, FrameworkPlan, FrameworkStyle, MAX_MANIFEST_BYTES,
    MODEL_MANIFEST_HEADER, ModelExport, ModelManifest, PlacedModel, PlacementCost, PlacementPlan,
    TensorClass, TensorView, WholeReport, WholeVerify,
};

use crate::error::{CheckpointFault, Error, Result};
use files::{display, parent_dir};

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
    /// `(num_attention_heads, num_key_value_heads)` from config.json.
    heads: Option<(u64, u64)>,
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
        let (dir, mut checkpoint) = if meta.is_dir() {
            (path, safetensors::open_dir(path)?)
        } else {
            let checkpoint = match path.extension().and_then(|e| e.to_str()) {
                Some("gguf") => gguf::open(path)?,
                Some("safetensors") => safetensors::open_single(path)?,
                Some("json") => safetensors::open_index(path)?,
                _ => {
                    return Err(Error::checkpoint(
                        display(path),
                        None,
                        CheckpointFault::Header,
                        "not a .safetensors or .gguf file, an index .json, nor a directory",
                    ));
                }
            };
            (parent_dir(path), checkpoint)
        };
        checkpoint.config = match checkpoint.format {
            Format::Safetensors => config::ModelConfig::read(dir),
            Format::Gguf => config::ModelConfig::from_gguf(&checkpoint.metadata, path),
        };
        if checkpoint.format == Format::Safetensors {
            checkpoint.heads = config::attention_heads(dir);
        }
        Ok(checkpoint)
    }

    /// Each file's length now against its length when opened: a file another process
    /// truncated since is [`CheckpointFault::Truncated`] naming the file and both
    /// lengths, before anything is placed. (The reads are `pread`s, never a mapping of
    /// the file, so a truncation during the placement is no SIGBUS either: a read past
    /// the end is an error; this check makes it one that names the file, not the slot.)
    pub(crate) fn check_not_truncated(&self) -> Result<()> {
        for f in &self.files {
            let now = f
                .file
                .metadata()
                .map_err(|e| Error::io("fstat", display(&f.path), e))?
                .len();
            if now < f.len {
                return Err(Error::checkpoint(
                    display(&f.path),
                    None,
                    CheckpointFault::Truncated,
                    format!(
                        "it holds {now} bytes, {} when it was opened: truncated since",
                        f.len
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The model config read beside the checkpoint, if any was understood.
    pub(crate) fn config(&self) -> Option<&config::ModelConfig> {
        self.config.as_ref()
    }

    /// `(num_attention_heads, num_key_value_heads)` as the checkpoint's config.json says
    /// (top level or its `text_config`; the KV heads default to the attention heads),
    /// `None` without one. A framework plan's cut is checked against them.
    pub fn attention_heads(&self) -> Option<(u64, u64)> {
        self.heads
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
}
