//! [`TensorSlice`]: the part of each expert tensor a tensor-parallel rank holds, along the
//! outermost axis (rows: one contiguous piece per tensor) or the innermost (columns: one
//! strided piece per row), and what it does to an expert's pieces.
//!
//! Axes are row-major, outermost first, over one expert's tensor (a merged tensor's
//! experts axis removed): safetensors shapes as written; GGUF's `ne` reversed (`ne0` is
//! the innermost). A cut along the innermost axis must keep whole encoding units: GGML
//! blocks (32 or 256 elements), MXFP4's 32-element blocks (gpt-oss `…_blocks`
//! `[…, H/32, 16]` bytes), sub-byte dtypes' bytes. Scale and bias pieces follow the
//! weight they belong to (the naming puts them in the weights' order): a scale grid
//! (DeepSeek's FP8 `weight_scale_inv` `[⌈out/128⌉, ⌈in/128⌉]`, MXFP4 `…_scales`) is cut at
//! the same place, which must fall on a block boundary; a one-element scale is kept
//! whole, and so is a bias under a column cut (a row-parallel sum adds it once).
//!
//! The type knows only an axis and a range, so it applies to any tensor described by a
//! [`TensorInfo`] (shape and dtype): dense tensors can take the same slices once the
//! whole-model plan places them.

pub(crate) mod check;
mod geometry;
mod layer;

use std::fmt;
use std::ops::Range;

use crate::error::{Error, Result};
pub(crate) use geometry::{Geometry, Run, tensor_geometry};
pub(crate) use layer::{RoleSlicer, slice_layer};

const OP: &str = "TensorSlice";

/// The axis a [`TensorSlice`] cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum SliceAxis {
    /// The outermost axis (row-major `dims[0]`): one contiguous piece per tensor.
    Rows,
    /// The innermost axis: one piece per row, strided in the file.
    Columns,
}

impl SliceAxis {
    /// `"rows"` or `"columns"`.
    pub fn name(self) -> &'static str {
        match self {
            SliceAxis::Rows => "rows",
            SliceAxis::Columns => "columns",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extent {
    /// The `k`-th of `n` equal parts of each of `parts` equal blocks of the axis.
    Part {
        k: u64,
        n: u64,
        parts: u64,
    },
    Span {
        start: u64,
        len: u64,
    },
}

/// A slice of every expert tensor along one axis: the `k`-th of `n` equal parts, or
/// `len` entries from `start`; or, packed ([`TensorSlice::packed`]), the `k`-th of `n`
/// equal parts of each of `parts` equal row blocks (transformers' `packed_colwise`: a
/// fused gate_up `[2I, H]` is two blocks, gate rows then up rows; a rank holds rows
/// `k/n` of each, back to back).
///
/// # Example
/// ```
/// use numapin::model::{SliceAxis, TensorSlice};
/// let half = TensorSlice::parse("rows:1/2")?;
/// assert_eq!(half.resolve(1024).unwrap(), 512..1024);
/// let span = TensorSlice::parse("columns:128:256")?;
/// assert_eq!(span.axis(), SliceAxis::Columns);
/// assert!(span.resolve(300).is_err()); // past the axis
/// assert!(TensorSlice::parse("rows:0/3")?.resolve(1024).is_err()); // 3 does not divide 1024
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSlice {
    axis: SliceAxis,
    extent: Extent,
}

impl fmt::Display for TensorSlice {
    /// The CLI syntax: `rows:0/2`, `columns:128:256`, packed `rows:0/2:2`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.extent {
            Extent::Part { k, n, parts: 1 } => write!(f, "{}:{k}/{n}", self.axis.name()),
            Extent::Part { k, n, parts } => write!(f, "{}:{k}/{n}:{parts}", self.axis.name()),
            Extent::Span { start, len } => write!(f, "{}:{start}:{len}", self.axis.name()),
        }
    }
}

impl TensorSlice {
    /// The `k`-th of `n` equal parts of `axis` (each tensor's axis must divide by `n`).
    ///
    /// # Errors
    /// `n` is 0 or `k ≥ n`.
    pub fn part(axis: SliceAxis, k: u64, n: u64) -> Result<TensorSlice> {
        if n == 0 || k >= n {
            return Err(Error::bad_value(
                OP,
                "tensor slice part",
                format!("{k}/{n}"),
                "k/n takes the k-th of n parts: n > 0 and k < n",
            ));
        }
        Ok(TensorSlice {
            axis,
            extent: Extent::Part { k, n, parts: 1 },
        })
    }

    /// Rows `k/n` of each of `parts` equal row blocks, held back to back: the `k`-th of
    /// `n` equal parts of the first block, then the same rows of the second, and so on
    /// (transformers' `packed_colwise` of a fused gate_up `[2I, H]`, `parts` 2: gate rows
    /// `k/n` then up rows `k/n`, so the rank's `[2I/n, H]` is its gate then its up). An
    /// axis of `extent` must divide into `parts × n`. `parts` 1 is [`TensorSlice::part`].
    ///
    /// ```
    /// use numapin::model::{SliceAxis, TensorSlice};
    /// let s = TensorSlice::packed(SliceAxis::Rows, 1, 2, 2)?;
    /// assert_eq!(s.to_string(), "rows:1/2:2");
    /// assert_eq!(s.resolve_parts(8).unwrap(), vec![2..4, 6..8]);
    /// assert!(s.resolve_parts(6).is_err()); // 6 rows are not 2 parts of 2 ranks
    /// assert!(TensorSlice::packed(SliceAxis::Columns, 0, 2, 2).is_err());
    /// # Ok::<(), numapin::Error>(())
    /// ```
    ///
    /// # Errors
    /// `n` or `parts` is 0, `k ≥ n`, or a packed cut (`parts` > 1) of the columns: a
    /// column block of each row would be one piece per row and part, not a view.
    pub fn packed(axis: SliceAxis, k: u64, n: u64, parts: u64) -> Result<TensorSlice> {
        let slice = TensorSlice::part(axis, k, n)?;
        if parts == 0 || (parts > 1 && axis == SliceAxis::Columns) {
            return Err(Error::bad_value(
                OP,
                "packed tensor slice",
                format!("{}:{k}/{n}:{parts}", axis.name()),
                "a packed slice cuts rows k/n of each of parts > 0 equal row blocks (a \
                 packed column cut is one piece per row and part: not taken)",
            ));
        }
        Ok(TensorSlice {
            extent: Extent::Part { k, n, parts },
            ..slice
        })
    }

    /// The equal blocks the axis is cut in, each the same way: 1 but for a
    /// [`TensorSlice::packed`] slice.
    pub fn parts(&self) -> u64 {
        match self.extent {
            Extent::Part { parts, .. } => parts,
            Extent::Span { .. } => 1,
        }
    }

    /// `len` entries of `axis` from `start`.
    ///
    /// # Errors
    /// `len` is 0, or `start + len` overflows.
    pub fn span(axis: SliceAxis, start: u64, len: u64) -> Result<TensorSlice> {
        if len == 0 {
            return Err(Error::empty(
                OP,
                format!("{} slice from {start}", axis.name()),
            ));
        }
        start
            .checked_add(len)
            .ok_or_else(|| Error::overflow(OP, format!("{start} + {len}")))?;
        Ok(TensorSlice {
            axis,
            extent: Extent::Span { start, len },
        })
    }

    /// The axis it cuts.
    pub fn axis(&self) -> SliceAxis {
        self.axis
    }

    /// Parses `AXIS:k/n`, `AXIS:start:len` or packed `rows:k/n:parts`, AXIS `rows` (or
    /// `outer`) or `columns` (`cols`, `inner`).
    ///
    /// # Errors
    /// [`Error::Parse`] naming the piece that is wrong; the constructors' errors.
    pub fn parse(text: &str) -> Result<TensorSlice> {
        let parse_error = |part: &str, reason: &str| Error::Parse {
            what: "tensor slice",
            input: crate::error::clip_owned(text.to_owned(), 200),
            part: crate::error::clip_owned(part.to_owned(), 64),
            reason: reason.to_owned(),
        };
        let (axis, rest) = text
            .trim()
            .split_once(':')
            .ok_or_else(|| parse_error(text, "AXIS:k/n or AXIS:start:len"))?;
        let axis = match axis {
            "rows" | "outer" => SliceAxis::Rows,
            "columns" | "cols" | "inner" => SliceAxis::Columns,
            _ => return Err(parse_error(axis, "the axis is rows or columns")),
        };
        let number = |part: &str| -> Result<u64> {
            crate::error::decimal(part).ok_or_else(|| parse_error(part, "not a number"))
        };
        if let Some((k, n)) = rest.split_once('/') {
            return match n.split_once(':') {
                Some((n, parts)) => {
                    TensorSlice::packed(axis, number(k)?, number(n)?, number(parts)?)
                }
                None => TensorSlice::part(axis, number(k)?, number(n)?),
            };
        }
        let (start, len) = rest
            .split_once(':')
            .ok_or_else(|| parse_error(rest, "k/n or start:len"))?;
        TensorSlice::span(axis, number(start)?, number(len)?)
    }

    /// The entries of an axis of `extent` it holds. `Err` says why (for the caller to
    /// name the tensor): a part that does not divide the axis, a span past it, a packed
    /// slice (several ranges: [`TensorSlice::resolve_parts`]).
    pub fn resolve(&self, extent: u64) -> std::result::Result<Range<u64>, String> {
        match self.extent {
            Extent::Part { parts, .. } if parts > 1 => Err(format!(
                "{self} holds rows of each of {parts} packed blocks, not one range (only \
                 a routed expert's fused role is cut so)"
            )),
            Extent::Part { k, n, .. } => {
                if extent == 0 || !extent.is_multiple_of(n) {
                    return Err(format!(
                        "{n} equal parts of an axis of {extent}: {n} does not divide it"
                    ));
                }
                let len = extent / n;
                Ok(k * len..(k + 1) * len)
            }
            Extent::Span { start, len } => {
                let end = start + len; // checked in `span`
                if end > extent {
                    return Err(format!(
                        "{start}..{end} runs past the axis, which has {extent}"
                    ));
                }
                Ok(start..end)
            }
        }
    }

    /// The ranges of an axis of `extent` it holds, in order: one, or one per packed
    /// block. `Err` says why: `parts × n` does not divide the axis, a span past it.
    pub fn resolve_parts(&self, extent: u64) -> std::result::Result<Vec<Range<u64>>, String> {
        let Extent::Part { k, n, parts } = self.extent else {
            return Ok(vec![self.resolve(extent)?]);
        };
        if parts == 1 {
            return Ok(vec![self.resolve(extent)?]);
        }
        // parts × n past u64 divides no axis (saturating it would take u64::MAX as the
        // cut and hand back `parts` ranges of an axis they do not divide).
        let Some(cut) = parts
            .checked_mul(n)
            .filter(|&c| extent > 0 && extent.is_multiple_of(c))
        else {
            return Err(format!(
                "{parts} packed blocks of {n} equal parts of an axis of {extent}: \
                 {parts} × {n} does not divide it"
            ));
        };
        let (block, len) = (extent / parts, extent / cut);
        Ok((0..parts)
            .map(|p| p * block + k * len..p * block + (k + 1) * len)
            .collect())
    }
}

/// How one role of a layer was sliced: what an engine checks it got.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RoleSlice {
    /// The role, as the naming calls it (`"gate_proj"`, `"down_proj scale"`).
    pub role: String,
    /// Weight or scale slot.
    pub weight: bool,
    /// The axis cut.
    pub axis: SliceAxis,
    /// First entry held along it (of each packed block when `parts` > 1).
    pub start: u64,
    /// Entries held (in all: `len / parts` of each packed block).
    pub len: u64,
    /// The equal blocks the axis is cut in, each alike ([`TensorSlice::packed`]): 1,
    /// or 2 for a fused gate_up cut by packed halves (gate rows `k/n`, then up rows
    /// `k/n`, back to back in the slot).
    pub parts: u64,
    /// Entries the whole axis has.
    pub extent: u64,
    /// One expert's whole tensor, row-major (outermost first; GGUF's `ne` reversed).
    pub shape: Vec<u64>,
    /// Kept whole rather than cut (a one-element scale; a bias under a column cut).
    pub whole: bool,
}
