//! safetensors headers: the u64 little-endian length, then that many bytes of JSON
//! (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {..}}`),
//! then the data section the offsets are relative to. And the sharded index,
//! `model.safetensors.index.json` (`{"weight_map": {"tensor": "shard file"}}`).
//!
//! Why not the `safetensors` crate's `Metadata` (0.8)? It is public and `Deserialize`,
//! and it can be fed the header bytes alone. But: its checks report a bad size or an
//! overflow without the tensor's name (`TensorInvalidInfo`, `ValidationOverflow`), and
//! errors here must name the tensor; it folds the tensors into a `HashMap`, so a name
//! given twice in one header vanishes instead of being refused; an unknown dtype fails as
//! a bare serde error; it does not know the file length (the range checks against the
//! file are ours anyway); and its `std` feature brings `tempfile` to every user of
//! numapin. The header is four fields: our own serde types cost less than the glue.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{MapAccess, Visitor};

use crate::error::{CheckpointFault, Error, Result, clip, quote};
use crate::model::files::{ReadAt, check_layout, read_grown, shape_text};
use crate::model::{self, TensorInfo};

mod open;

pub(super) use open::{open_dir, open_index, open_single};

/// The largest JSON header (or index) read: 100 MiB.
pub const MAX_HEADER: u64 = 100 << 20;

macro_rules! dtypes {
    ($($name:ident = $bits:literal,)*) => {
        /// A safetensors dtype, as the header spells it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types, missing_docs)]
        #[non_exhaustive]
        pub enum Dtype {
            $($name,)*
        }

        impl Dtype {
            /// The dtype the header string names.
            pub(crate) fn from_name(name: &str) -> Option<Dtype> {
                match name {
                    $(stringify!($name) => Some(Dtype::$name),)*
                    _ => None,
                }
            }

            /// The header's spelling.
            pub fn name(self) -> &'static str {
                match self {
                    $(Dtype::$name => stringify!($name),)*
                }
            }

            /// Bits per element (4 and 6 for the MX types).
            pub(crate) fn bits(self) -> u64 {
                match self {
                    $(Dtype::$name => $bits,)*
                }
            }
        }
    };
}

dtypes! {
    BOOL = 8,
    F4 = 4,
    F6_E2M3 = 6,
    F6_E3M2 = 6,
    U8 = 8,
    I8 = 8,
    F8_E5M2 = 8,
    F8_E4M3 = 8,
    F8_E8M0 = 8,
    F8_E4M3FNUZ = 8,
    F8_E5M2FNUZ = 8,
    I16 = 16,
    U16 = 16,
    F16 = 16,
    BF16 = 16,
    I32 = 32,
    U32 = 32,
    F32 = 32,
    C64 = 64,
    F64 = 64,
    I64 = 64,
    U64 = 64,
}

#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// The header's tensors in file order, duplicates kept (refused later, by name).
struct Header(Vec<(String, Entry)>);

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct HeaderVisitor;
        impl<'de> Visitor<'de> for HeaderVisitor {
            type Value = Header;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Header, A::Error> {
                let mut tensors = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        map.next_value::<BTreeMap<String, String>>()?;
                    } else {
                        let entry = map.next_value::<Entry>().map_err(|e| {
                            serde::de::Error::custom(format_args!("tensor {}: {e}", quote(&key)))
                        })?;
                        tensors.push((key, entry));
                    }
                }
                Ok(Header(tensors))
            }
        }
        d.deserialize_map(HeaderVisitor)
    }
}

/// Parses a safetensors header from `src`; `file` names it in errors. The tensors come
/// back sorted by offset, with absolute offsets (file index 0).
///
/// # Errors
/// [`Error::Checkpoint`]: a file shorter than 8 bytes or a header length past the end
/// ([`CheckpointFault::Truncated`]); a header over [`MAX_HEADER`], not UTF-8 or not the
/// JSON of a header ([`CheckpointFault::Header`]); an unknown dtype; `data_offsets`
/// reversed, past the data section or overlapping ([`CheckpointFault::Range`]); a length
/// that is not dtype × shape ([`CheckpointFault::Size`]); a name twice.
/// [`Error::Io`] when a read fails.
pub fn parse(src: &dyn ReadAt, file: &str) -> Result<Vec<TensorInfo>> {
    let len = src.size().map_err(|e| Error::io("fstat", file, e))?;
    let (header_len, Header(entries)) = read_header(src, file, len)?;
    let data_start = 8 + header_len;
    let data_len = len - data_start;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, entry) in entries {
        tensors.push(tensor_info(name, entry, data_start, data_len, file)?);
    }
    check_layout(&mut tensors, file)?;
    Ok(tensors)
}

fn fault(file: &str, tensor: Option<&str>, kind: CheckpointFault, why: String) -> Error {
    Error::checkpoint(file, tensor, kind, why)
}

/// The header's length (from the 8-byte prefix) and its JSON, parsed; the JSON bytes are
/// dropped once parsed.
fn read_header(src: &dyn ReadAt, file: &str, len: u64) -> Result<(u64, Header)> {
    if len < 8 {
        return Err(fault(
            file,
            None,
            CheckpointFault::Truncated,
            format!("{len} bytes: no room for the 8-byte header length"),
        ));
    }
    let mut prefix = [0u8; 8];
    src.read_exact_at(&mut prefix, 0)
        .map_err(|e| Error::io("pread", file, e))?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > len - 8 {
        return Err(fault(
            file,
            None,
            CheckpointFault::Truncated,
            format!("header length {header_len} reaches past the end of the {len} byte file"),
        ));
    }
    if header_len > MAX_HEADER {
        return Err(fault(
            file,
            None,
            CheckpointFault::Header,
            format!("header length {header_len} is over the {MAX_HEADER} byte cap"),
        ));
    }
    let json = read_grown(src, 8, header_len).map_err(|e| Error::io("pread", file, e))?;
    let text = std::str::from_utf8(&json).map_err(|e| {
        fault(
            file,
            None,
            CheckpointFault::Header,
            format!("the header is not UTF-8: {e}"),
        )
    })?;
    let header = serde_json::from_str(text).map_err(|e| {
        fault(
            file,
            None,
            CheckpointFault::Header,
            format!(
                "the header is not a safetensors JSON header: {}",
                json_error(&e)
            ),
        )
    })?;
    Ok((header_len, header))
}

/// One header entry checked against the data section (`data_len` bytes from
/// `data_start`): a known dtype, offsets in order and inside, a length of dtype × shape.
fn tensor_info(
    name: String,
    entry: Entry,
    data_start: u64,
    data_len: u64,
    file: &str,
) -> Result<TensorInfo> {
    let Some(dtype) = Dtype::from_name(&entry.dtype) else {
        return Err(fault(
            file,
            Some(&name),
            CheckpointFault::UnknownType,
            format!("dtype {} is not a safetensors dtype", quote(&entry.dtype)),
        ));
    };
    let (begin, end) = entry.data_offsets;
    if end < begin {
        return Err(fault(
            file,
            Some(&name),
            CheckpointFault::Range,
            format!("data_offsets [{begin}, {end}] are reversed"),
        ));
    }
    if end > data_len {
        return Err(fault(
            file,
            Some(&name),
            CheckpointFault::Range,
            format!("data_offsets [{begin}, {end}] reach past the {data_len} byte data section"),
        ));
    }
    let bytes = tensor_bytes(dtype, &entry.shape)
        .map_err(|why| fault(file, Some(&name), CheckpointFault::Size, why))?;
    if end - begin != bytes {
        return Err(fault(
            file,
            Some(&name),
            CheckpointFault::Size,
            format!(
                "data_offsets [{begin}, {end}] hold {} bytes but {} × {} is {bytes}",
                end - begin,
                dtype.name(),
                shape_text(&entry.shape)
            ),
        ));
    }
    Ok(TensorInfo {
        name,
        dtype: model::Dtype::Safetensors(dtype),
        shape: entry.shape,
        file: 0,
        offset: data_start + begin,
        len: bytes,
    })
}

/// dtype × shape in bytes; the reason when that is not whole bytes or overflows.
fn tensor_bytes(dtype: Dtype, shape: &[u64]) -> std::result::Result<u64, String> {
    let bits = shape
        .iter()
        .try_fold(dtype.bits(), |acc, &d| acc.checked_mul(d));
    match bits {
        Some(bits) if bits % 8 == 0 => Ok(bits / 8),
        Some(bits) => Err(format!(
            "{} × {} is {bits} bits, not whole bytes",
            dtype.name(),
            shape_text(shape)
        )),
        None => Err(format!(
            "{} × {} overflows 64 bits",
            dtype.name(),
            shape_text(shape)
        )),
    }
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// Parses `model.safetensors.index.json`: `(tensor, shard file)` pairs, sorted by tensor.
///
/// # Errors
/// [`CheckpointFault::Header`] when it is not UTF-8, not JSON with a `weight_map` of
/// strings, gives a key twice in an object, or names a shard outside its directory.
pub(crate) fn parse_index(bytes: &[u8], file: &str) -> Result<Vec<(String, String)>> {
    let fault = |tensor: Option<&str>, why: String| {
        Error::checkpoint(file, tensor, CheckpointFault::Header, why)
    };
    let text = std::str::from_utf8(bytes)
        .map_err(|e| fault(None, format!("the index is not UTF-8: {e}")))?;
    // Read strictly first: a tensor given twice in `weight_map` would otherwise keep its
    // last shard without a word (serde_json's map), where the headers refuse a name twice.
    let index: Index = crate::routing::strict::from_str(text)
        .and_then(serde_json::from_value)
        .map_err(|e| {
            fault(
                None,
                format!("the index is not a safetensors index: {}", json_error(&e)),
            )
        })?;
    for (tensor, shard) in &index.weight_map {
        if shard.is_empty() || shard.contains('/') || shard == "." || shard == ".." {
            return Err(fault(
                Some(tensor),
                format!(
                    "shard {} is not a file name in the index's directory",
                    quote(shard)
                ),
            ));
        }
    }
    Ok(index.weight_map.into_iter().collect())
}

/// A serde_json error for a message: it may quote a value of the file (an invalid type
/// quotes the string found), so it is clipped like any file-chosen string.
pub(crate) fn json_error(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match clip(&text, 2 * crate::error::QUOTE_MAX) {
        (_, false) => text,
        (head, true) => format!("{head}… ({} bytes)", text.len()),
    }
}
