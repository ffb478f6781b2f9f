//! One tensor's encoding as a slice sees it ([`Geometry`]): its row-major dims, the
//! smallest unit its innermost axis splits into (GGML blocks, MXFP4 blocks, sub-byte
//! dtypes' bytes), and the bytes a slice of either axis holds ([`Run`]). Shared by the
//! expert slices and the whole-model plan's dense slices.

use std::ops::Range;

use super::OP;
use crate::error::{Error, Result, quote};
use crate::model::safetensors::Dtype as StDtype;
use crate::model::{Checkpoint, Dtype, SliceAxis, TensorInfo, TensorPiece};

/// One tensor's encoding (or one expert's part of a merged tensor), as a slice sees it.
pub(crate) struct Geometry {
    pub(crate) name: String,
    /// Row-major, outermost first (GGUF's `ne` reversed; MXFP4 `…_blocks` in elements).
    pub(crate) dims: Vec<u64>,
    pub(crate) rows: u64,
    /// The innermost axis in elements.
    pub(crate) cols: u64,
    /// Elements and bytes of the smallest piece the innermost axis splits into.
    unit: (u64, u64),
    unit_name: String,
    len: u64,
}

/// The bytes a slice holds in a tensor: `count` pieces of `len` bytes, the first at
/// `offset` from the tensor's start, each `stride` after the one before (a row slice: one
/// piece).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) count: u64,
    pub(crate) stride: u64,
}

impl Run {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }

    /// The pieces, `(offset from the tensor's start, len)`.
    pub(crate) fn pieces(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count).map(|r| (self.offset + r * self.stride, self.len))
    }
}

/// The geometry of expert piece `piece` (a merged tensor's experts axis removed).
pub(crate) fn geometry(checkpoint: &Checkpoint, piece: &TensorPiece) -> Result<Geometry> {
    let t: &TensorInfo = checkpoint.tensors().get(piece.tensor()).ok_or_else(|| {
        let why = format!("the checkpoint has {} tensors", checkpoint.tensors().len());
        Error::bad_value(OP, "a piece's tensor", piece.tensor(), why)
    })?;
    tensor_geometry(t, piece.len)
}

/// The geometry of `len` bytes of `t`: all of it, or one expert's part.
pub(crate) fn tensor_geometry(t: &TensorInfo, len: u64) -> Result<Geometry> {
    let piece_len = len;
    let shape_error = |why: String| {
        Error::bad_value(
            OP,
            "tensor slice",
            quote(t.name()),
            format!("its shape {:?} {why}", t.shape()),
        )
    };
    let mut dims: Vec<u64> = match t.dtype() {
        Dtype::Safetensors(_) => t.shape().to_vec(),
        Dtype::Ggml(_) => t.shape().iter().rev().copied().collect(),
    };
    if piece_len != t.len() {
        // A merged tensor `[E, …]` or a flattened one `[E·I, …]`: one expert's part.
        let n = match piece_len {
            0 => 0,
            l if t.len().is_multiple_of(l) => t.len() / l,
            _ => 0,
        };
        match dims.first().copied() {
            Some(d) if n > 0 && d == n => {
                dims.remove(0);
            }
            Some(d) if n > 0 && d.is_multiple_of(n) => dims[0] = d / n,
            _ => {
                return Err(shape_error(format!(
                    "does not hold {} bytes per expert",
                    piece_len
                )));
            }
        }
    }
    let last = dims.last().copied().unwrap_or(1);
    let (cols, unit, unit_name) = match t.dtype() {
        Dtype::Ggml(ty) => {
            let b = u64::from(ty.block_size());
            let name = format!("{} blocks of {b} elements", ty.name());
            (last, (b, u64::from(ty.type_size())), name)
        }
        Dtype::Safetensors(StDtype::U8)
            if t.name().ends_with("_blocks") && dims.len() >= 3 && last == 16 =>
        {
            // gpt-oss MXFP4: `[…, H/32, 16]` bytes, two FP4 values a byte.
            let groups = dims[dims.len() - 2];
            let cols = groups
                .checked_mul(32)
                .ok_or_else(|| shape_error("overflows".into()))?;
            dims.truncate(dims.len() - 2);
            dims.push(cols);
            (cols, (32, 16), "MXFP4 blocks of 32 elements".to_owned())
        }
        Dtype::Safetensors(d) => {
            let bits = d.bits().max(1);
            let g = gcd(bits, 8);
            let unit = (8 / g, bits / g);
            let name = if unit.0 > 1 {
                format!("{}: {} elements in {} byte(s)", d.name(), unit.0, unit.1)
            } else {
                format!("{} elements", d.name())
            };
            (last, unit, name)
        }
    };
    Ok(Geometry {
        name: t.name().to_owned(),
        rows: dims.first().copied().unwrap_or(1),
        dims,
        cols,
        unit,
        unit_name,
        len: piece_len,
    })
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl Geometry {
    /// Entries along `axis`.
    pub(crate) fn extent(&self, axis: SliceAxis) -> u64 {
        match axis {
            SliceAxis::Rows => self.rows,
            SliceAxis::Columns => self.cols,
        }
    }

    /// The (offset, len) pieces within the tensor that hold `range` of `axis`.
    pub(crate) fn cuts(
        &self,
        axis: SliceAxis,
        range: &Range<u64>,
    ) -> std::result::Result<Vec<(u64, u64)>, String> {
        Ok(self.run(axis, range)?.pieces().collect())
    }

    /// The bytes that hold `range` of `axis`, as one [`Run`]. `Err` says why (a cut
    /// through an encoding unit, bytes that are not whole rows).
    pub(crate) fn run(
        &self,
        axis: SliceAxis,
        range: &Range<u64>,
    ) -> std::result::Result<Run, String> {
        let n = range.end - range.start;
        match axis {
            SliceAxis::Rows => {
                if self.rows == 0 || !self.len.is_multiple_of(self.rows) {
                    return Err(format!(
                        "{} bytes are not {} equal rows",
                        self.len, self.rows
                    ));
                }
                let stride = self.len / self.rows;
                Ok(Run {
                    offset: range.start * stride,
                    len: n * stride,
                    count: 1,
                    stride: 0,
                })
            }
            SliceAxis::Columns => {
                let (unit, unit_bytes) = self.unit;
                if !range.start.is_multiple_of(unit) || !n.is_multiple_of(unit) {
                    return Err(format!(
                        "columns {}..{} cut through its {}: a cut falls on a multiple of {unit}",
                        range.start, range.end, self.unit_name
                    ));
                }
                if !self.cols.is_multiple_of(unit) {
                    // A row that ends inside a packed unit: the next row starts inside
                    // a byte, so no byte range holds any row's columns.
                    return Err(format!(
                        "a row of {} elements is not a whole number of its {}: its rows \
                         do not start on a byte, so no byte range holds a column slice \
                         (slice by rows, or keep it whole)",
                        self.cols, self.unit_name
                    ));
                }
                let row = (self.cols / unit) * unit_bytes;
                if row == 0 || !self.len.is_multiple_of(row) {
                    return Err(format!(
                        "{} bytes are not whole rows of {row} bytes",
                        self.len
                    ));
                }
                let (start, bytes) = (range.start / unit * unit_bytes, n / unit * unit_bytes);
                if bytes == row {
                    return Ok(Run {
                        offset: 0,
                        len: self.len,
                        count: 1,
                        stride: 0,
                    });
                }
                Ok(Run {
                    offset: start,
                    len: bytes,
                    count: self.len / row,
                    stride: row,
                })
            }
        }
    }
}
