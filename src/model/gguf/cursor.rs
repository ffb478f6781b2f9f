//! The byte cursor GGUF headers are parsed with: a 64 KiB window over [`ReadAt`], reads
//! checked against the bytes left in the file, and no reservation larger than
//! [`RESERVE_BYTES`] for a count the file states.

use super::{GgufArray, GgufValue, MAX_HEADER_BYTES, MAX_NESTING, MAX_STRING, RESERVE_BYTES};
use crate::error::{CheckpointFault, Error, Result, quote};
use crate::model::files::ReadAt;

/// The bytes read through at once.
const WINDOW: usize = 64 << 10;

/// A position in a GGUF file and the window of bytes read around it.
pub(super) struct Cursor<'a> {
    src: &'a dyn ReadAt,
    file: &'a str,
    len: u64,
    pos: u64,
    window: Vec<u8>,
    window_start: u64,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `src`, `len` bytes long; `file` names it in errors.
    pub(super) fn new(src: &'a dyn ReadAt, file: &'a str, len: u64) -> Cursor<'a> {
        Cursor {
            src,
            file,
            len,
            pos: 0,
            window: Vec::new(),
            window_start: 0,
        }
    }

    /// The file's length.
    pub(super) fn file_len(&self) -> u64 {
        self.len
    }

    /// The offset of the next byte to read.
    pub(super) fn pos(&self) -> u64 {
        self.pos
    }

    pub(super) fn fault(
        &self,
        tensor: Option<&str>,
        kind: CheckpointFault,
        why: impl Into<String>,
    ) -> Error {
        Error::checkpoint(self.file, tensor, kind, why)
    }

    /// The bytes from the cursor to the end of the file.
    pub(super) fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    /// How many `T`s may be reserved for a count the file claims: never more bytes than
    /// the file has left, nor than [`RESERVE_BYTES`] (a sparse file has every byte it
    /// claims); the vector grows past that as entries are parsed.
    pub(super) fn capacity<T>(&self, claimed: u64) -> usize {
        let per = std::mem::size_of::<T>().max(1) as u64;
        let cap = (RESERVE_BYTES as u64 / per).min(self.remaining() / per);
        claimed.min(cap) as usize
    }

    pub(super) fn count_fits(&self, count: u64, min_bytes: u64, what: &str) -> Result<()> {
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

    /// `n` bytes from the cursor within the file and [`MAX_HEADER_BYTES`].
    fn span_fits(&self, n: u64, what: &str) -> Result<()> {
        if n > self.remaining() {
            return Err(self.past_end(n, what));
        }
        if self.pos.saturating_add(n) > MAX_HEADER_BYTES {
            return Err(self.fault(
                None,
                CheckpointFault::Header,
                format!(
                    "{what} ({n} bytes at offset {}) reaches past {MAX_HEADER_BYTES} bytes, \
                     the most a GGUF header may span",
                    self.pos
                ),
            ));
        }
        Ok(())
    }

    /// Copies `out.len()` bytes at the cursor and advances.
    fn fill(&mut self, out: &mut [u8], what: &str) -> Result<()> {
        let n = out.len() as u64;
        self.span_fits(n, what)?;
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

    pub(super) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        self.fill(&mut out, what)?;
        Ok(out)
    }

    pub(super) fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    pub(super) fn string(&mut self, what: &str) -> Result<String> {
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
        self.span_fits(n, what)?;
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

    pub(super) fn value(&mut self, value_type: u32, key: &str, depth: usize) -> Result<GgufValue> {
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
        // Within the file, checked above (the fault says so); within the header's ceiling.
        self.span_fits(n * min, &format!("array of {n} elements of {}", quote(key)))?;
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
