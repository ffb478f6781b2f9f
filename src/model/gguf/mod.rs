//! GGUF headers (versions 2 and 3): key/values, tensor infos, alignment, data section;
//! and llama.cpp's split sets (`name-00001-of-0000N.gguf`, keys `split.no`,
//! `split.count`, `split.tensors.count`: the `split` module, which opens checkpoints).
//!
//! Hand-written: the format is small and frozen, and the crates seen (`gguf`,
//! `gguf-rs`, candle's reader) bring a CLI or a whole ML framework. Reads go through a
//! 64 KiB window over [`ReadAt`]; every count and length is checked against the bytes
//! left in the file before anything is allocated for it. That is not enough on its own:
//! a sparse file holds as many (zero) bytes as it claims, so no reservation made for a
//! count the file states is larger than [`RESERVE_BYTES`]; vectors grow as their entries
//! are parsed, and a string's buffer grows as its bytes are read. A key or tensor name is
//! refused when it is read a second time (the zeros of a sparse file read as `""`), and
//! nothing past [`MAX_HEADER_BYTES`] is read as header (zeros are valid array elements).

mod cursor;
mod split;

use cursor::Cursor;
pub(super) use split::open;
pub use split::{SplitInfo, split_paths};

use crate::error::{CheckpointFault, Error, Result, quote};
use crate::model::files::{ReadAt, check_layout};
use crate::model::ggml::GgmlType;
use crate::model::{Dtype, TensorInfo};

/// `"GGUF"`, the first four bytes.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// `general.alignment` when the key is absent.
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
/// `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
/// The longest string accepted (key, value or tensor name): longer is absurd.
pub(crate) const MAX_STRING: u64 = 64 << 20;
/// How deep arrays may nest.
pub(crate) const MAX_NESTING: usize = 8;
/// The most bytes a header (key/values and tensor infos) may span: the largest headers
/// seen (a 262,144-token vocabulary with its scores, types and merges) take a few tens of
/// MiB. A sparse file holds as many zero bytes as its length claims, and zeros are valid
/// array elements: without a ceiling, one array claiming 2^39 `u8`s in a 1 TiB sparse
/// file would be walked and held in memory.
pub const MAX_HEADER_BYTES: u64 = 256 << 20;
/// The most bytes reserved ahead for a count a file states (key/values, tensor infos,
/// array elements); past it a vector grows as entries are actually parsed.
pub const RESERVE_BYTES: usize = 64 << 10;

/// The fewest bytes a key/value takes: key length (8), value type (4), a u8 (1).
const KV_MIN_BYTES: u64 = 13;
/// The fewest bytes a tensor info takes: name length (8), n_dims (4), type (4), offset (8).
const TENSOR_MIN_BYTES: u64 = 24;

/// A GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A GGUF array: one element type, stored unboxed.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufArray {
    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value for a message: numbers as they are, a string quoted and clipped, an
    /// array by its length (a file may make either megabytes).
    pub(crate) fn describe(&self) -> String {
        match self {
            GgufValue::String(s) => format!("the string {}", quote(s)),
            GgufValue::Array(a) => format!("an array of {} elements", a.len()),
            other => format!("{other:?}"),
        }
    }

    /// The value as a string, if it is one.
    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

/// A parsed GGUF header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// 2 or 3.
    pub version: u32,
    /// Key/values in file order.
    pub metadata: Vec<(String, GgufValue)>,
    /// `general.alignment` (or 32).
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    /// The tensors, with absolute offsets, all inside the file (file index 0).
    pub tensors: Vec<TensorInfo>,
}

/// Parses a GGUF header from `src`; `file` names it in errors.
///
/// # Errors
/// [`Error::Checkpoint`] for wrong magic, an unknown version, a string or array past the
/// end or absurdly large, counts the file cannot hold, more than [`MAX_DIMS`] dims, an
/// unknown ggml type, a bad `general.alignment`, a tensor misaligned, overlapping another
/// or past the end; [`Error::Io`] when a read fails for another reason than the end.
pub fn parse(src: &dyn ReadAt, file: &str) -> Result<GgufHeader> {
    let len = src.size().map_err(|e| Error::io("fstat", file, e))?;
    let mut r = Cursor::new(src, file, len);
    let (version, tensor_count, kv_count) = read_preamble(&mut r)?;
    let metadata = read_metadata(&mut r, kv_count)?;
    let alignment = alignment(&r, &metadata)?;
    let infos = read_tensor_infos(&mut r, tensor_count)?;
    let data_start = r
        .pos()
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| r.fault(None, CheckpointFault::Range, "data start overflows"))?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(infos.len());
    for info in infos {
        tensors.push(place(&r, info, data_start, alignment)?);
    }
    check_layout(&mut tensors, file)?;
    Ok(GgufHeader {
        version,
        metadata,
        alignment,
        data_start,
        tensors,
    })
}

/// The magic, the version, and the tensor and key/value counts, each count within what
/// the rest of the file can hold: `(version, tensor count, key/value count)`.
fn read_preamble(r: &mut Cursor<'_>) -> Result<(u32, u64, u64)> {
    let magic: [u8; 4] = r.array("magic")?;
    if magic != MAGIC {
        return Err(r.fault(
            None,
            CheckpointFault::Header,
            format!("magic {magic:02x?} is not \"GGUF\""),
        ));
    }
    let version = r.u32("version")?;
    if version != 2 && version != 3 {
        return Err(r.fault(
            None,
            CheckpointFault::Header,
            format!("GGUF version {version} (this reader takes 2 and 3)"),
        ));
    }
    let tensor_count = r.u64("tensor count")?;
    let kv_count = r.u64("key/value count")?;
    // A key/value takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 4 + 8: both
    // counts together within the bytes left (the tensor count again once the key/values
    // are read, against what they left).
    r.count_fits(kv_count, KV_MIN_BYTES, "key/value count")?;
    r.count_fits(tensor_count, TENSOR_MIN_BYTES, "tensor count")?;
    let both = kv_count
        .saturating_mul(KV_MIN_BYTES)
        .saturating_add(tensor_count.saturating_mul(TENSOR_MIN_BYTES));
    if both > r.remaining() {
        return Err(r.fault(
            None,
            CheckpointFault::Header,
            format!(
                "key/value count {kv_count} ({KV_MIN_BYTES}+ bytes each) and tensor count \
                 {tensor_count} ({TENSOR_MIN_BYTES}+ bytes each) are beyond what the file can \
                 hold ({} bytes left at offset {})",
                r.remaining(),
                r.pos()
            ),
        ));
    }
    Ok((version, tensor_count, kv_count))
}

/// `count` key/values in file order, no key twice: a key is refused as soon as it is read
/// a second time (a sparse file claiming 2^36 key/values, every key `""`, was walked to
/// the end before, issue 31).
fn read_metadata(r: &mut Cursor<'_>, count: u64) -> Result<Vec<(String, GgufValue)>> {
    let mut metadata = Vec::with_capacity(r.capacity::<(String, GgufValue)>(count));
    let mut keys = std::collections::HashSet::with_capacity(metadata.capacity());
    for _ in 0..count {
        let key = r.string("key")?;
        if !keys.insert(key.clone()) {
            return Err(r.fault(
                None,
                CheckpointFault::Header,
                format!("key {} appears twice", quote(&key)),
            ));
        }
        let value_type = r.u32("value type")?;
        let value = r.value(value_type, &key, 0)?;
        metadata.push((key, value));
    }
    Ok(metadata)
}

/// `general.alignment`, or [`DEFAULT_ALIGNMENT`] without the key.
fn alignment(r: &Cursor<'_>, metadata: &[(String, GgufValue)]) -> Result<u64> {
    match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some((_, GgufValue::U32(a))) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some((_, value)) => Err(r.fault(
            None,
            CheckpointFault::Header,
            format!(
                "general.alignment is {}: it must be a u32 power of two",
                value.describe()
            ),
        )),
    }
}

/// A tensor info as the file states it, offset relative to the data section.
struct RawTensor {
    name: String,
    ne: Vec<u64>,
    ty: GgmlType,
    offset: u64,
}

/// `count` tensor infos (the count within the bytes left after the key/values; no name
/// twice, refused as read): names, dimensions (at most [`MAX_DIMS`], each a valid int64),
/// known ggml types and offsets.
fn read_tensor_infos(r: &mut Cursor<'_>, count: u64) -> Result<Vec<RawTensor>> {
    r.count_fits(count, TENSOR_MIN_BYTES, "tensor count")?;
    let mut infos = Vec::with_capacity(r.capacity::<RawTensor>(count));
    let mut names = std::collections::HashSet::with_capacity(infos.capacity());
    for _ in 0..count {
        let name = r.string("tensor name")?;
        // Refused as read, not after the walk (a sparse file's zeros are "" names).
        if !names.insert(name.clone()) {
            return Err(r.fault(
                Some(&name),
                CheckpointFault::Duplicate,
                "the name appears twice in the file",
            ));
        }
        let n_dims = r.u32("n_dims")?;
        if n_dims > MAX_DIMS {
            return Err(r.fault(
                Some(&name),
                CheckpointFault::Header,
                format!("{n_dims} dimensions (ggml has at most {MAX_DIMS})"),
            ));
        }
        let mut ne = Vec::with_capacity(MAX_DIMS as usize);
        for _ in 0..n_dims {
            let d = r.u64("dimension")?;
            if d > i64::MAX as u64 {
                return Err(r.fault(
                    Some(&name),
                    CheckpointFault::Header,
                    format!("dimension {d} is negative as ggml's int64"),
                ));
            }
            ne.push(d);
        }
        let type_id = r.u32("ggml type")?;
        let Some(ty) = GgmlType::from_id(type_id) else {
            return Err(r.fault(
                Some(&name),
                CheckpointFault::UnknownType,
                format!("ggml type id {type_id} is not in the type table"),
            ));
        };
        let offset = r.u64("tensor offset")?;
        infos.push(RawTensor {
            name,
            ne,
            ty,
            offset,
        });
    }
    Ok(infos)
}

/// A tensor placed in the file: aligned, its size from its type and dimensions, its
/// bytes inside the file.
fn place(r: &Cursor<'_>, raw: RawTensor, data_start: u64, alignment: u64) -> Result<TensorInfo> {
    let RawTensor {
        name,
        ne,
        ty,
        offset,
    } = raw;
    if offset % alignment != 0 {
        return Err(r.fault(
            Some(&name),
            CheckpointFault::Range,
            format!("offset {offset} is not a multiple of the alignment {alignment}"),
        ));
    }
    let bytes = ty
        .tensor_bytes(&ne)
        .map_err(|why| r.fault(Some(&name), CheckpointFault::Size, why))?;
    let start = data_start.checked_add(offset);
    let end = start.and_then(|s| s.checked_add(bytes));
    let (Some(start), Some(end)) = (start, end) else {
        return Err(r.fault(
            Some(&name),
            CheckpointFault::Range,
            format!("data start {data_start} + offset {offset} + {bytes} bytes overflows"),
        ));
    };
    let len = r.file_len();
    if end > len {
        return Err(r.fault(
            Some(&name),
            CheckpointFault::Range,
            format!(
                "bytes {start}..{end} ({bytes} bytes of {}) reach past the end of the \
                 {len} byte file",
                ty.name()
            ),
        ));
    }
    Ok(TensorInfo {
        name,
        dtype: Dtype::Ggml(ty),
        shape: ne,
        file: 0,
        offset: start,
        len: bytes,
    })
}
