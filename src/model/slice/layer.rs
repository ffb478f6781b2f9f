//! Cutting a layer's expert pieces to a slice ([`slice_layer`]): each weight role's
//! range (or, packed, one range per block), each scale's blocks lined up with it, every
//! expert cut as the first; and how each role was cut ([`RoleSlice`]).

use std::ops::Range;

use super::geometry::{Geometry, geometry};
use super::{OP, RoleSlice, SliceAxis, TensorSlice};
use crate::error::{Error, Result, quote};
use crate::model::{Checkpoint, GateUpLayout, LayerPlan, Orientation, PieceRole, TensorPiece};
/// The slice each weight role of an expert gets: one for all, or the tensor-parallel
/// convention's per role (gate and up by rows, down by columns, a fused gate_up stored
/// gate rows then up rows by rows `k/n` of each half) for rank `k` of `n`.
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
    let canonical = layer
        .roles
        .iter()
        .zip(layer.canonical.iter())
        .filter(|((r, _), _)| *r == PieceRole::Weight)
        .map(|(_, c)| c.clone())
        .collect();
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
        canonical,
        gate_up: layer.gate_up,
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
    /// Each weight role's canonical name (`gate`, `up`, `gate_up`, `down`).
    canonical: Vec<String>,
    /// How the layer's fused gate_up holds gate and up.
    gate_up: Option<GateUpLayout>,
}

impl Cutting<'_> {
    /// The slice weight role `j`, `role`, gets, and whether it cuts the input dimension.
    /// Under TP the convention's axis is for `[out, in]`; a role stored `[in, out]`
    /// (DBRX's `w2`) has its input dimension outermost, so the row-parallel down keeps
    /// rows there, and a column-parallel role columns.
    fn slice_of(&self, j: usize, role: &str) -> Result<(TensorSlice, bool)> {
        match self.slicer {
            RoleSlicer::Uniform(slice) => Ok((slice, slice.axis == SliceAxis::Columns)),
            RoleSlicer::Tp { k, n } if self.canonical.get(j).is_some_and(|c| c == "gate_up") => {
                self.packed_gate_up(role, k, n)
            }
            RoleSlicer::Tp { k, n } => {
                match crate::model::whole::tp::expert_axis(role).or_else(|| {
                    crate::model::whole::tp::expert_axis(self.canonical.get(j).map_or("", |c| c))
                }) {
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
                            "layer {}: the tensor-parallel convention knows gate and up (rows), \
                         down (columns) and a fused gate_up (rows of each half); an unknown \
                         role takes a plain slice (Share::slice)",
                            self.layer
                        ),
                    )),
                }
            }
        }
    }

    /// A fused gate_up role under TP: rows `k/n` of each half when the layer stores gate
    /// rows then up rows (Granite's `input_linear`, transformers 5's `gate_up_proj`,
    /// llama.cpp's `ffn_gate_up_exps`), as Megatron's merged column-parallel layer and
    /// transformers' `packed_colwise` cut it; another layout (interleaved, columns) by
    /// name.
    fn packed_gate_up(&self, role: &str, k: u64, n: u64) -> Result<(TensorSlice, bool)> {
        match self.gate_up {
            Some(GateUpLayout::GateThenUpRows) => {
                Ok((TensorSlice::packed(SliceAxis::Rows, k, n, 2)?, false))
            }
            layout => Err(Error::bad_value(
                OP,
                "tensor-parallel expert role",
                quote(role),
                format!(
                    "layer {}: a fused gate_up is cut by rows k/n of each half only when it \
                     holds gate rows then up rows; this one is {}",
                    self.layer,
                    layout.map_or("of no known layout", |l| l.name())
                ),
            )),
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
            let ranges = slice
                .resolve_parts(extent)
                .map_err(|why| self.bad(&slice, role, &g, why))?;
            let mut piece_cuts = Vec::new();
            for range in &ranges {
                piece_cuts.extend(
                    g.cuts(axis, range)
                        .map_err(|why| self.bad(&slice, role, &g, why))?,
                );
            }
            cuts.push(piece_cuts);
            let range = ranges.first().cloned().unwrap_or_default();
            let held = ranges.iter().map(|r| r.end - r.start).sum::<u64>();
            let cut = (range.start, held, slice.parts());
            report.push(role_slice(role, true, axis, cut, extent, &g, false));
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
                report.push(role_slice(
                    role,
                    false,
                    axis,
                    (0, g.rows, 1),
                    g.rows,
                    &g,
                    true,
                ));
                continue;
            };
            if slice.parts() > 1 {
                return Err(self.bad(
                    slice,
                    role,
                    &g,
                    "a packed cut of a role with a scale grid or a bias beside it is not \
                     taken (each block's scales would be cut apart)"
                        .into(),
                ));
            }
            let s = g.extent(axis);
            let range = self.scale_range(slice, role, &g, (s, *n), wrange)?;
            cuts.push(
                g.cuts(axis, &range)
                    .map_err(|why| self.bad(slice, role, &g, why))?,
            );
            let cut = (range.start, range.end - range.start, 1);
            report.push(role_slice(role, false, axis, cut, s, &g, false));
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

/// `(start, len, parts)`: as [`RoleSlice`]'s fields.
fn role_slice(
    role: &str,
    weight: bool,
    axis: SliceAxis,
    (start, len, parts): (u64, u64, u64),
    extent: u64,
    g: &Geometry,
    whole: bool,
) -> RoleSlice {
    RoleSlice {
        role: role.to_owned(),
        weight,
        axis,
        start,
        len,
        parts,
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
