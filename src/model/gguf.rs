//! GGUF headers (versions 2 and 3): key/values, tensor infos, alignment, data section;
//! and llama.cpp's split sets (`name-00001-of-0000N.gguf`, keys `split.no`,
//! `split.count`, `split.tensors.count`).
//!
//! Hand-written: the format is small and frozen, and the crates seen (`gguf`,
//! `gguf-rs`, candle's reader) bring a CLI or a whole ML framework. Reads go through a
//! 64 KiB window over [`ReadAt`]; every count and length is checked against the bytes
//! left in the file before anything is allocated for it. That is not enough on its own:
//! a sparse file holds as many (zero) bytes as it claims, so no reservation made for a
//! count the file states is larger than [`RESERVE_BYTES`]; vectors grow as their entries
//! are parsed, and a string's buffer grows as its bytes are read.

use std::path::{Path, PathBuf};

use super::{Dtype, ReadAt, TensorInfo};
use crate::error::{CheckpointFault, Error, Result, quote};
use crate::model::ggml::GgmlType;

/// `"GGUF"`, the first four bytes.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// `general.alignment` when the key is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
/// The longest string accepted (key, value or tensor name): longer is absurd.
pub const MAX_STRING: u64 = 64 << 20;
/// How deep arrays may nest.
pub const MAX_NESTING: usize = 8;
const WINDOW: usize = 64 << 10;
/// The most bytes reserved ahead for a count a file states (key/values, tensor infos,
/// array elements); past it a vector grows as entries are actually parsed.
pub const RESERVE_BYTES: usize = 64 << 10;

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
    pub fn as_str(&self) -> Option<&str> {
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
    let mut r = Cursor {
        src,
        file,
        len,
        pos: 0,
        window: Vec::new(),
        window_start: 0,
    };
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
    // A key/value takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 4 + 8.
    r.count_fits(kv_count, 13, "key/value count")?;
    r.count_fits(tensor_count, 24, "tensor count")?;

    let mut metadata = Vec::with_capacity(r.capacity::<(String, GgufValue)>(kv_count));
    for _ in 0..kv_count {
        let key = r.string("key")?;
        let value_type = r.u32("value type")?;
        let value = r.value(value_type, &key, 0)?;
        metadata.push((key, value));
    }
    let mut keys = std::collections::HashSet::with_capacity(metadata.len());
    for (key, _) in &metadata {
        if !keys.insert(key.as_str()) {
            return Err(r.fault(
                None,
                CheckpointFault::Header,
                format!("key {} appears twice", quote(key)),
            ));
        }
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, GgufValue::U32(a))) if a.is_power_of_two() => u64::from(*a),
        Some((_, value)) => {
            return Err(r.fault(
                None,
                CheckpointFault::Header,
                format!(
                    "general.alignment is {}: it must be a u32 power of two",
                    value.describe()
                ),
            ));
        }
    };

    let mut raw = Vec::with_capacity(r.capacity::<(String, Vec<u64>, GgmlType, u64)>(tensor_count));
    for _ in 0..tensor_count {
        let name = r.string("tensor name")?;
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
        raw.push((name, ne, ty, offset));
    }

    let data_start = r
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| r.fault(None, CheckpointFault::Range, "data start overflows"))?;

    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(raw.len());
    for (name, ne, ty, offset) in raw {
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
        tensors.push(TensorInfo {
            name,
            dtype: Dtype::Ggml(ty),
            shape: ne,
            file: 0,
            offset: start,
            len: bytes,
        });
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

/// No two tensors with one name, no two overlapping; sorts by offset.
pub(crate) fn check_layout(tensors: &mut [TensorInfo], file: &str) -> Result<()> {
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

/// The `split.*` keys of one part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitInfo {
    /// `split.no`: this part, from 0.
    pub no: u64,
    /// `split.count`: how many parts.
    pub count: u64,
    /// `split.tensors.count`: tensors in all parts (the first part states it).
    pub tensors: Option<u64>,
}

/// The split keys, if the file has `split.count`.
///
/// # Errors
/// [`CheckpointFault::Header`] when a key is not a non-negative integer, `split.count` is
/// 0, or `split.no` is missing or not below `split.count`.
pub fn split_info(metadata: &[(String, GgufValue)], file: &str) -> Result<Option<SplitInfo>> {
    let get = |key: &str| -> Result<Option<u64>> {
        match metadata.iter().find(|(k, _)| k == key) {
            None => Ok(None),
            Some((_, v)) => v.as_u64().map(Some).ok_or_else(|| {
                Error::checkpoint(
                    file,
                    None,
                    CheckpointFault::Header,
                    format!("{key} is {}, not a non-negative integer", v.describe()),
                )
            }),
        }
    };
    let Some(count) = get("split.count")? else {
        return Ok(None);
    };
    let no = get("split.no")?;
    let tensors = get("split.tensors.count")?;
    match no {
        Some(no) if count > 0 && no < count => Ok(Some(SplitInfo { no, count, tensors })),
        _ => Err(Error::checkpoint(
            file,
            None,
            CheckpointFault::Header,
            format!(
                "split.count = {count}, split.no = {no:?}: the part number must be below the count"
            ),
        )),
    }
}

/// `(prefix, no, count)` from `prefix-00001-of-00003.gguf` (no from 1).
pub fn split_name(path: &Path) -> Option<(String, u64, u64)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    Some((prefix.to_owned(), no.parse().ok()?, count.parse().ok()?))
}

/// The paths of every part, index = `split.no`, given the first part's path and keys.
///
/// # Errors
/// [`CheckpointFault::Split`] when `path` is not the first part or its name disagrees
/// with its keys; [`CheckpointFault::Missing`] naming the first part that does not exist.
pub fn split_paths(path: &Path, split: &SplitInfo) -> Result<Vec<PathBuf>> {
    let file = path.display().to_string();
    if split.no != 0 {
        return Err(Error::checkpoint(
            file,
            None,
            CheckpointFault::Split,
            format!("split.no is {}: open the first part (split.no 0)", split.no),
        ));
    }
    if split.count == 1 {
        return Ok(vec![path.to_path_buf()]);
    }
    let Some((prefix, no, count)) = split_name(path) else {
        return Err(Error::checkpoint(
            file,
            None,
            CheckpointFault::Split,
            format!(
                "split.count is {} but the name is not NAME-00001-of-{:05}.gguf",
                split.count, split.count
            ),
        ));
    };
    if no != 1 || count != split.count {
        return Err(Error::checkpoint(
            file,
            None,
            CheckpointFault::Split,
            format!(
                "the name says part {no} of {count}, the keys say part 1 of {}",
                split.count
            ),
        ));
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut paths = Vec::with_capacity(split.count.min(16) as usize);
    for i in 0..split.count {
        let part = dir.join(format!("{prefix}-{:05}-of-{:05}.gguf", i + 1, split.count));
        if !part.is_file() {
            return Err(Error::checkpoint(
                file,
                None,
                CheckpointFault::Missing,
                format!(
                    "split part {} of {} is missing: {}",
                    i + 1,
                    split.count,
                    part.display()
                ),
            ));
        }
        paths.push(part);
    }
    Ok(paths)
}

/// Checks part `no` (from 0) against the first part's keys.
///
/// # Errors
/// [`CheckpointFault::Split`] when the part has no split keys or they disagree.
pub fn check_part(
    file: &str,
    info: Option<&SplitInfo>,
    no: usize,
    first: &SplitInfo,
) -> Result<()> {
    let why = match info {
        None => "the part has no split.count key".to_owned(),
        Some(i) if i.count != first.count => format!(
            "split.count is {} but the first part says {}",
            i.count, first.count
        ),
        Some(i) if i.no != no as u64 => format!("split.no is {} in part {}", i.no, no + 1),
        Some(_) => return Ok(()),
    };
    Err(Error::checkpoint(file, None, CheckpointFault::Split, why))
}

struct Cursor<'a> {
    src: &'a dyn ReadAt,
    file: &'a str,
    len: u64,
    pos: u64,
    window: Vec<u8>,
    window_start: u64,
}

impl Cursor<'_> {
    fn fault(&self, tensor: Option<&str>, kind: CheckpointFault, why: impl Into<String>) -> Error {
        Error::checkpoint(self.file, tensor, kind, why)
    }

    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    /// How many `T`s may be reserved for a count the file claims: never more bytes than
    /// the file has left, nor than [`RESERVE_BYTES`] (a sparse file has every byte it
    /// claims); the vector grows past that as entries are parsed.
    fn capacity<T>(&self, claimed: u64) -> usize {
        let per = std::mem::size_of::<T>().max(1) as u64;
        let cap = (RESERVE_BYTES as u64 / per).min(self.remaining() / per);
        claimed.min(cap) as usize
    }

    fn count_fits(&self, count: u64, min_bytes: u64, what: &str) -> Result<()> {
        match count.checked_mul(min_bytes) {
            Some(need) if need <= self.remaining() => Ok(()),
            _ => Err(self.fault(
                None,
                CheckpointFault::Header,
                format!(
                    "{what} {count} is beyond what the file can hold ({} bytes left at offset {})",
                    self.remaining(),
                    self.pos
                ),
            )),
        }
    }

    fn past_end(&self, n: u64, what: &str) -> Error {
        self.fault(
            None,
            CheckpointFault::Truncated,
            format!(
                "{what} ({n} bytes at offset {}) reaches past the end of the {} byte file",
                self.pos, self.len
            ),
        )
    }

    /// Copies `out.len()` bytes at the cursor and advances.
    fn fill(&mut self, out: &mut [u8], what: &str) -> Result<()> {
        let n = out.len() as u64;
        if n > self.remaining() {
            return Err(self.past_end(n, what));
        }
        if out.len() > WINDOW {
            self.src
                .read_exact_at(out, self.pos)
                .map_err(|e| Error::io("pread", self.file, e))?;
            self.pos += n;
            return Ok(());
        }
        let in_window = self.pos >= self.window_start
            && self.pos + n <= self.window_start + self.window.len() as u64;
        if !in_window {
            let size = (WINDOW as u64).min(self.remaining()) as usize;
            self.window.resize(size, 0);
            self.src
                .read_exact_at(&mut self.window, self.pos)
                .map_err(|e| Error::io("pread", self.file, e))?;
            self.window_start = self.pos;
        }
        let at = (self.pos - self.window_start) as usize;
        out.copy_from_slice(&self.window[at..at + out.len()]);
        self.pos += n;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        self.fill(&mut out, what)?;
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        if n > MAX_STRING {
            return Err(self.fault(
                None,
                CheckpointFault::Header,
                format!(
                    "{what} of {n} bytes at offset {} is absurdly large",
                    self.pos
                ),
            ));
        }
        if n > self.remaining() {
            return Err(self.past_end(n, what));
        }
        // Grown window by window as the bytes are read: `n` is only what the file says.
        let mut bytes = Vec::with_capacity((n as usize).min(WINDOW));
        while (bytes.len() as u64) < n {
            let at = bytes.len();
            let step = (n - at as u64).min(WINDOW as u64) as usize;
            bytes.resize(at + step, 0);
            self.fill(&mut bytes[at..], what)?;
        }
        String::from_utf8(bytes).map_err(|e| {
            self.fault(
                None,
                CheckpointFault::Header,
                format!("{what} is not UTF-8: {e}"),
            )
        })
    }

    fn value(&mut self, value_type: u32, key: &str, depth: usize) -> Result<GgufValue> {
        let quoted = quote(key);
        let ctx = |what: &str| format!("{what} of {quoted}");
        Ok(match value_type {
            0 => GgufValue::U8(u8::from_le_bytes(self.array(&ctx("u8"))?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(&ctx("i8"))?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&ctx("u16"))?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&ctx("i16"))?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(&ctx("u32"))?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&ctx("i32"))?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&ctx("f32"))?)),
            7 => GgufValue::Bool(self.bool(key)?),
            8 => GgufValue::String(self.string(&ctx("string"))?),
            9 => GgufValue::Array(self.array_value(key, depth)?),
            10 => GgufValue::U64(u64::from_le_bytes(self.array(&ctx("u64"))?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&ctx("i64"))?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&ctx("f64"))?)),
            other => {
                return Err(self.fault(
                    None,
                    CheckpointFault::Header,
                    format!("key {quoted} has unknown value type {other}"),
                ));
            }
        })
    }

    fn bool(&mut self, key: &str) -> Result<bool> {
        match self.array::<1>("bool")?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.fault(
                None,
                CheckpointFault::Header,
                format!("key {}: bool byte {b} is neither 0 nor 1", quote(key)),
            )),
        }
    }

    fn typed<T, const N: usize>(
        &mut self,
        n: u64,
        what: &str,
        convert: impl Fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(self.capacity::<T>(n));
        for _ in 0..n {
            out.push(convert(self.array(what)?));
        }
        Ok(out)
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<GgufArray> {
        if depth >= MAX_NESTING {
            return Err(self.fault(
                None,
                CheckpointFault::Header,
                format!("key {}: arrays nest deeper than {MAX_NESTING}", quote(key)),
            ));
        }
        let elem = self.u32("array type")?;
        let n = self.u64("array length")?;
        let min = match elem {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            other => {
                return Err(self.fault(
                    None,
                    CheckpointFault::Header,
                    format!("key {}: array of unknown value type {other}", quote(key)),
                ));
            }
        };
        if n.checked_mul(min)
            .is_none_or(|need| need > self.remaining())
        {
            return Err(self.fault(
                None,
                CheckpointFault::Truncated,
                format!(
                    "key {}: array of {n} elements of at least {min} bytes reaches past the \
                     end ({} bytes left at offset {})",
                    quote(key),
                    self.remaining(),
                    self.pos
                ),
            ));
        }
        let what = format!("element of {}", quote(key));
        Ok(match elem {
            0 => GgufArray::U8(self.typed(n, &what, u8::from_le_bytes)?),
            1 => GgufArray::I8(self.typed(n, &what, i8::from_le_bytes)?),
            2 => GgufArray::U16(self.typed(n, &what, u16::from_le_bytes)?),
            3 => GgufArray::I16(self.typed(n, &what, i16::from_le_bytes)?),
            4 => GgufArray::U32(self.typed(n, &what, u32::from_le_bytes)?),
            5 => GgufArray::I32(self.typed(n, &what, i32::from_le_bytes)?),
            6 => GgufArray::F32(self.typed(n, &what, f32::from_le_bytes)?),
            7 => {
                let mut v = Vec::with_capacity(self.capacity::<bool>(n));
                for _ in 0..n {
                    v.push(self.bool(key)?);
                }
                GgufArray::Bool(v)
            }
            8 => {
                let mut v = Vec::with_capacity(self.capacity::<String>(n));
                for _ in 0..n {
                    v.push(self.string(&what)?);
                }
                GgufArray::String(v)
            }
            9 => {
                let mut v = Vec::with_capacity(self.capacity::<GgufArray>(n));
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                GgufArray::Array(v)
            }
            10 => GgufArray::U64(self.typed(n, &what, u64::from_le_bytes)?),
            11 => GgufArray::I64(self.typed(n, &what, i64::from_le_bytes)?),
            _ => GgufArray::F64(self.typed(n, &what, f64::from_le_bytes)?),
        })
    }
}
