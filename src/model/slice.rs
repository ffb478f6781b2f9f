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

use std::fmt;
use std::ops::Range;

use super::{Checkpoint, LayerPlan, Orientation, PieceRole, TensorPiece};
use crate::error::{Error, Result, quote};
use geometry::geometry;
pub(crate) use geometry::{Geometry, Run, tensor_geometry};

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
    Part { k: u64, n: u64 },
    Span { start: u64, len: u64 },
}

/// A slice of every expert tensor along one axis: the `k`-th of `n` equal parts, or
/// `len` entries from `start`.
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
    /// The CLI syntax: `rows:0/2`, `columns:128:256`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.extent {
            Extent::Part { k, n } => write!(f, "{}:{k}/{n}", self.axis.name()),
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
            extent: Extent::Part { k, n },
        })
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

    /// Parses `AXIS:k/n` or `AXIS:start:len`, AXIS `rows` (or `outer`) or `columns`
    /// (`cols`, `inner`).
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
            return TensorSlice::part(axis, number(k)?, number(n)?);
        }
        let (start, len) = rest
            .split_once(':')
            .ok_or_else(|| parse_error(rest, "k/n or start:len"))?;
        TensorSlice::span(axis, number(start)?, number(len)?)
    }

    /// The entries of an axis of `extent` it holds. `Err` says why (for the caller to
    /// name the tensor): a part that does not divide the axis, a span past it.
    pub fn resolve(&self, extent: u64) -> std::result::Result<Range<u64>, String> {
        match self.extent {
            Extent::Part { k, n } => {
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
    /// First entry held along it.
    pub start: u64,
    /// Entries held.
    pub len: u64,
    /// Entries the whole axis has.
    pub extent: u64,
    /// One expert's whole tensor, row-major (outermost first; GGUF's `ne` reversed).
    pub shape: Vec<u64>,
    /// Kept whole rather than cut (a one-element scale; a bias under a column cut).
    pub whole: bool,
}

/// The slice each weight role of an expert gets: one for all, or the tensor-parallel
/// convention's per role (gate and up by rows, down by columns) for rank `k` of `n`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RoleSlicer {
    Uniform(TensorSlice),
    Tp { k: u64, n: u64 },
}

/// Cuts every expert's pieces of `layer` to `slicer`'s slices; the slot sizes follow.
/// Returns how each role (weights, then scales) was cut.
pub(crate) fn slice_layer(
    checkpoint: &Checkpoint,
    layer: &mut LayerPlan,
    slicer: RoleSlicer,
) -> Result<Vec<RoleSlice>> {
    let Some(first) = layer.experts.first().cloned() else {
        return Ok(Vec::new());
    };
    let names = |role: PieceRole| -> Vec<String> {
        layer
            .roles
            .iter()
            .filter(|(r, _)| *r == role)
            .map(|(_, n)| n.clone())
            .collect()
    };
    let (weight_names, scale_names) = (names(PieceRole::Weight), names(PieceRole::Scale));
    let orientations = layer
        .roles
        .iter()
        .zip(
            layer
                .orientations
                .iter()
                .chain(std::iter::repeat(&Orientation::OutIn)),
        )
        .filter(|((r, _), _)| *r == PieceRole::Weight)
        .map(|(_, o)| *o)
        .collect();
    let cutting = Cutting {
        checkpoint,
        slicer,
        layer: layer.layer,
        orientations,
    };
    // Every expert of a layer has one shape, so the first expert's pieces say where the
    // cuts fall for all of them.
    let mut report = Vec::new();
    let (weight_cuts, weight_axes) = cutting.weights(&first.weights, &weight_names, &mut report)?;
    let scale_cuts = cutting.scales(&first.scales, &scale_names, &weight_axes, &mut report)?;
    for expert in &mut layer.experts {
        expert.weights = apply(&expert.weights, &weight_cuts, &first.weights)?;
        expert.scales = apply(&expert.scales, &scale_cuts, &first.scales)?;
    }
    let bytes = |cuts: &[Vec<(u64, u64)>]| cuts.iter().flatten().map(|c| c.1).sum::<u64>();
    layer.weight_bytes = bytes(&weight_cuts);
    layer.scale_bytes = bytes(&scale_cuts);
    Ok(report)
}

/// Each piece's (offset, len) cuts within its tensor, in slot order.
type PieceCuts = Vec<Vec<(u64, u64)>>;

/// A weight role's slice, its extent along the slice's axis and the range of it kept:
/// what its scale's blocks must line up with; and whether the cut is of the role's input
/// dimension (row-parallel: a 1-D bias or scale beside it stays whole, as the all-reduce
/// adds it once).
type WeightAxis = (TensorSlice, u64, Range<u64>, bool);

/// One layer being cut to a slice: what its errors name.
struct Cutting<'a> {
    checkpoint: &'a Checkpoint,
    slicer: RoleSlicer,
    layer: usize,
    /// How each weight role stores an expert's weight (its cut under TP follows it).
    orientations: Vec<Orientation>,
}

impl Cutting<'_> {
    /// The slice weight role `j`, `role`, gets, and whether it cuts the input dimension.
    /// Under TP the convention's axis is for `[out, in]`; a role stored `[in, out]`
    /// (DBRX's `w2`) has its input dimension outermost, so the row-parallel down keeps
    /// rows there, and a column-parallel role columns.
    fn slice_of(&self, j: usize, role: &str) -> Result<(TensorSlice, bool)> {
        match self.slicer {
            RoleSlicer::Uniform(slice) => Ok((slice, slice.axis == SliceAxis::Columns)),
            RoleSlicer::Tp { k, n } => match crate::model::whole::tp::expert_axis(role) {
                Some(axis) => {
                    let input = axis == SliceAxis::Columns;
                    let axis = match (self.orientations.get(j), axis) {
                        (Some(Orientation::InOut), SliceAxis::Rows) => SliceAxis::Columns,
                        (Some(Orientation::InOut), SliceAxis::Columns) => SliceAxis::Rows,
                        (_, axis) => axis,
                    };
                    Ok((TensorSlice::part(axis, k, n)?, input))
                }
                None => Err(Error::bad_value(
                    OP,
                    "tensor-parallel expert role",
                    quote(role),
                    format!(
                        "layer {}: the tensor-parallel convention knows gate and up (rows) \
                         and down (columns); a fused or unknown role takes a plain slice \
                         (Share::slice)",
                        self.layer
                    ),
                )),
            },
        }
    }

    fn bad(&self, slice: &TensorSlice, role: &str, g: &Geometry, why: String) -> Error {
        Error::bad_value(
            OP,
            "tensor slice",
            slice,
            format!(
                "layer {} {role} ({} {:?}): {why}",
                self.layer,
                quote(&g.name),
                g.dims
            ),
        )
    }

    /// The weight pieces' cuts: each weight role keeps the slice's range of its axis.
    fn weights(
        &self,
        pieces: &[TensorPiece],
        names: &[String],
        report: &mut Vec<RoleSlice>,
    ) -> Result<(PieceCuts, Vec<WeightAxis>)> {
        let mut cuts = Vec::new();
        let mut axes = Vec::new();
        for (j, p) in pieces.iter().enumerate() {
            let role = names.get(j).map_or("weight", String::as_str);
            let (slice, input) = self.slice_of(j, role)?;
            let axis = slice.axis;
            let g = geometry(self.checkpoint, p)?;
            if g.dims.len() < 2 {
                return Err(self.bad(&slice, role, &g, "a 1-D tensor has no axis to slice".into()));
            }
            let extent = g.extent(axis);
            let range = slice
                .resolve(extent)
                .map_err(|why| self.bad(&slice, role, &g, why))?;
            cuts.push(
                g.cuts(axis, &range)
                    .map_err(|why| self.bad(&slice, role, &g, why))?,
            );
            report.push(role_slice(role, true, axis, &range, extent, &g, false));
            axes.push((slice, extent, range, input));
        }
        Ok((cuts, axes))
    }

    /// The scale pieces' cuts: scale `j` follows weight `j` (modulo the weights), keeping
    /// the blocks that cover the weight's kept range; a scalar or a 1-D scale under a
    /// column slice is kept whole.
    fn scales(
        &self,
        pieces: &[TensorPiece],
        names: &[String],
        weight_axes: &[WeightAxis],
        report: &mut Vec<RoleSlice>,
    ) -> Result<PieceCuts> {
        let mut cuts = Vec::new();
        for (j, p) in pieces.iter().enumerate() {
            let role = names.get(j).map_or("scale", String::as_str);
            let g = geometry(self.checkpoint, p)?;
            let numel: u64 = g.dims.iter().product();
            let paired = weight_axes.get(j % weight_axes.len().max(1));
            let axis = paired.map_or(SliceAxis::Rows, |w| w.0.axis);
            let input = paired.is_some_and(|w| w.3);
            let whole = numel <= 1 || (g.dims.len() == 1 && input);
            let Some((slice, n, wrange, _)) = paired.filter(|_| !whole) else {
                cuts.push(vec![(0, p.len)]);
                let all = 0..g.rows;
                report.push(role_slice(role, false, axis, &all, g.rows, &g, true));
                continue;
            };
            let s = g.extent(axis);
            let range = self.scale_range(slice, role, &g, (s, *n), wrange)?;
            cuts.push(
                g.cuts(axis, &range)
                    .map_err(|why| self.bad(slice, role, &g, why))?,
            );
            report.push(role_slice(role, false, axis, &range, s, &g, false));
        }
        Ok(cuts)
    }

    /// The range of a scale's `s` entries that covers `wrange` of its weight's `n`, when
    /// the entries tile the weight in whole blocks and the cuts fall on block edges.
    fn scale_range(
        &self,
        slice: &TensorSlice,
        role: &str,
        g: &Geometry,
        (s, n): (u64, u64),
        wrange: &Range<u64>,
    ) -> Result<Range<u64>> {
        let axis = slice.axis;
        // Block b: a grid of S entries over N means ⌈N / S⌉ entries a block.
        let b = if s == 0 { 0 } else { n.div_ceil(s) };
        if b == 0 || n.div_ceil(b) != s {
            return Err(self.bad(
                slice,
                role,
                g,
                format!(
                    "{s} entries along the {} do not tile the weight's {n}",
                    axis.name()
                ),
            ));
        }
        let cut_ok = |x: u64| x.is_multiple_of(b) || x == n;
        if !cut_ok(wrange.start) || !cut_ok(wrange.end) {
            return Err(self.bad(
                slice,
                role,
                g,
                format!(
                    "{} {}..{} of {n} cut through its scale blocks of {b}: a cut falls on \
                     a multiple of {b}",
                    axis.name(),
                    wrange.start,
                    wrange.end
                ),
            ));
        }
        Ok(wrange.start / b..wrange.end.div_ceil(b))
    }
}

fn role_slice(
    role: &str,
    weight: bool,
    axis: SliceAxis,
    range: &Range<u64>,
    extent: u64,
    g: &Geometry,
    whole: bool,
) -> RoleSlice {
    RoleSlice {
        role: role.to_owned(),
        weight,
        axis,
        start: range.start,
        len: range.end - range.start,
        extent,
        shape: g.dims.clone(),
        whole,
    }
}

/// Each of `pieces` cut as the reference expert's were (every expert of a layer has the
/// same piece lengths).
fn apply(
    pieces: &[TensorPiece],
    cuts: &[Vec<(u64, u64)>],
    reference: &[TensorPiece],
) -> Result<Vec<TensorPiece>> {
    let mut out = Vec::with_capacity(cuts.iter().map(Vec::len).sum());
    for ((p, cuts), r) in pieces.iter().zip(cuts).zip(reference) {
        if p.len != r.len {
            return Err(Error::mismatch(
                OP,
                "bytes of one role of two experts",
                r.len,
                p.len,
            ));
        }
        out.extend(cuts.iter().map(|&(offset, len)| TensorPiece {
            offset: p.offset + offset,
            len,
            ..*p
        }));
    }
    Ok(out)
}
