//! The model manifest's parts ([`super::export`]): the tensor table and the expert plan
//! as plain serde structs (unknown fields refused), converted both ways and checked on
//! the way in so that no index a view follows can be out of range.

use serde::{Deserialize, Serialize};

use super::classes::TensorClass;
use super::shape::DenseSlice;
use super::views::{Place, PlacedTensor};
use crate::error::{Error, Result};
use crate::model::share::LayerShare;
use crate::model::{
    Dtype, ExpertPieces, ExpertPlan, GateUpLayout, GgmlType, LayerPlan, Orientation, PieceRole,
    RoleSlice, SafetensorsDtype, SliceAxis, TensorPiece,
};
use crate::store::Kind;

pub(super) const ATTACH: &str = "PlacedModel::attach";

/// One tensor of the table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TensorPart {
    pub(super) name: String,
    class: String,
    layer: Option<usize>,
    /// `st:BF16` or `ggml:Q4_K`.
    dtype: String,
    shape: Vec<u64>,
    file: usize,
    offset: u64,
    len: u64,
    rows: (u64, u64),
    place: PlacePart,
    /// `(rows, start, len, extent)`: rows true for the outermost axis.
    slice: Option<(bool, u64, u64, u64)>,
    /// The file's dtype of a tensor converted at placement (`dtype` is the placed one).
    #[serde(default)]
    converted_from: Option<String>,
}

/// [`Place`], with the kind as `scales: bool`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
enum PlacePart {
    Dense {
        store: usize,
        layer: usize,
        offset: usize,
        len: usize,
    },
    ExpertPiece {
        layer: usize,
        expert: usize,
        scales: bool,
        offset: usize,
        len: usize,
    },
    Experts,
    /// [`Place::ExpertRun`]: role-major weight slots `first..first + count`.
    ExpertRun {
        layer: usize,
        first: usize,
        count: usize,
    },
    NotHeld {
        layer: usize,
        expert: usize,
    },
    Padded {
        layer: usize,
        expert: usize,
    },
    Empty,
}

/// The expert plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PlanPart {
    naming: String,
    engine_tensors: usize,
    engine_bytes: u64,
    layers: Vec<LayerPlanPart>,
}

impl PlanPart {
    /// The name of the naming the plan was made with.
    pub(super) fn naming(&self) -> &str {
        &self.naming
    }
}

/// A piece: `(tensor, file, offset, len)`.
type PiecePart = (usize, usize, u64, u64);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerPlanPart {
    layer: usize,
    /// Per slot: weight pieces, scale pieces.
    experts: Vec<(Vec<PiecePart>, Vec<PiecePart>)>,
    weight_bytes: u64,
    scale_bytes: u64,
    /// `(scale slot, name)`.
    roles: Vec<(bool, String)>,
    canonical: Vec<String>,
    gate_up: Option<String>,
    /// `out_in` or `in_out`.
    orientations: Vec<String>,
    share: Option<SharePart>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SharePart {
    ids: Vec<usize>,
    of: usize,
    complete: bool,
    slices: Vec<RoleSlicePart>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RoleSlicePart {
    role: String,
    weight: bool,
    rows: bool,
    start: u64,
    len: u64,
    /// [`RoleSlice::parts`]; absent (1) in a manifest written before packed cuts.
    #[serde(default = "one_part")]
    parts: u64,
    extent: u64,
    shape: Vec<u64>,
    whole: bool,
}

fn one_part() -> u64 {
    1
}

const GATE_UP: [GateUpLayout; 5] = [
    GateUpLayout::GateThenUpRows,
    GateUpLayout::GateThenUpColumns,
    GateUpLayout::Interleaved,
    GateUpLayout::InterleavedRows,
    GateUpLayout::Unknown,
];

fn bad(what: &'static str, value: impl std::fmt::Display, why: &str) -> Error {
    Error::bad_value(ATTACH, what, value, why)
}

fn dtype_text(d: Dtype) -> String {
    match d {
        Dtype::Safetensors(d) => format!("st:{}", d.name()),
        Dtype::Ggml(t) => format!("ggml:{}", t.name()),
    }
}

fn dtype_of(text: &str) -> Result<Dtype> {
    let found = match text.split_once(':') {
        Some(("st", name)) => SafetensorsDtype::from_name(name).map(Dtype::Safetensors),
        Some(("ggml", name)) => GgmlType::ALL
            .iter()
            .find(|t| t.name() == name)
            .map(|&t| Dtype::Ggml(t)),
        _ => None,
    };
    found.ok_or_else(|| {
        bad(
            "dtype",
            crate::error::quote(text),
            "not st:NAME or ggml:NAME of a known type",
        )
    })
}

fn axis_of(rows: bool) -> SliceAxis {
    if rows {
        SliceAxis::Rows
    } else {
        SliceAxis::Columns
    }
}

pub(super) fn tensor_part(t: &PlacedTensor) -> TensorPart {
    let place = match t.place {
        Place::Dense {
            store,
            layer,
            offset,
            len,
        } => PlacePart::Dense {
            store,
            layer,
            offset,
            len,
        },
        Place::ExpertPiece {
            layer,
            expert,
            kind,
            offset,
            len,
        } => PlacePart::ExpertPiece {
            layer,
            expert,
            scales: kind == Kind::Scales,
            offset,
            len,
        },
        Place::Experts => PlacePart::Experts,
        Place::ExpertRun {
            layer,
            first,
            count,
        } => PlacePart::ExpertRun {
            layer,
            first,
            count,
        },
        Place::NotHeld { layer, expert } => PlacePart::NotHeld { layer, expert },
        Place::Padded { layer, expert } => PlacePart::Padded { layer, expert },
        Place::Empty => PlacePart::Empty,
    };
    TensorPart {
        name: t.name.clone(),
        class: t.class.name().to_owned(),
        layer: t.layer,
        dtype: dtype_text(t.dtype),
        shape: t.shape.clone(),
        file: t.file,
        offset: t.offset,
        len: t.len,
        rows: t.rows,
        place,
        slice: t
            .slice
            .map(|s| (s.axis == SliceAxis::Rows, s.start, s.len, s.extent)),
        converted_from: t.converted.map(|c| dtype_text(c.from)),
    }
}

/// A tensor from its part; `stores` dense stores exist.
pub(super) fn placed_tensor(p: &TensorPart, stores: usize) -> Result<PlacedTensor> {
    let class = TensorClass::from_name(&p.class)
        .ok_or_else(|| bad("tensor class", crate::error::quote(&p.class), "unknown"))?;
    let place = match p.place {
        PlacePart::Dense {
            store,
            layer,
            offset,
            len,
        } => {
            if store >= stores {
                return Err(Error::OutOfRange {
                    op: ATTACH,
                    what: format!("dense store of tensor {}", crate::error::quote(&p.name)),
                    index: store,
                    len: stores,
                });
            }
            Place::Dense {
                store,
                layer,
                offset,
                len,
            }
        }
        PlacePart::ExpertPiece {
            layer,
            expert,
            scales,
            offset,
            len,
        } => Place::ExpertPiece {
            layer,
            expert,
            kind: if scales { Kind::Scales } else { Kind::Weights },
            offset,
            len,
        },
        PlacePart::Experts => Place::Experts,
        // Checked against the plan and the roles once both are read (check_attached).
        PlacePart::ExpertRun {
            layer,
            first,
            count,
        } => Place::ExpertRun {
            layer,
            first,
            count,
        },
        PlacePart::NotHeld { layer, expert } => Place::NotHeld { layer, expert },
        PlacePart::Padded { layer, expert } => Place::Padded { layer, expert },
        PlacePart::Empty => Place::Empty,
    };
    let dtype = dtype_of(&p.dtype)?;
    let tensor = PlacedTensor {
        name: p.name.clone(),
        class,
        layer: p.layer,
        dtype,
        shape: p.shape.clone(),
        file: p.file,
        offset: p.offset,
        len: p.len,
        rows: p.rows,
        place,
        slice: p.slice.map(|(rows, start, len, extent)| DenseSlice {
            axis: axis_of(rows),
            start,
            len,
            extent,
        }),
        converted: match &p.converted_from {
            Some(from) => Some(conversion(p, dtype_of(from)?, dtype_of(&p.dtype)?)?),
            None => None,
        },
    };
    // After the conversion's check (a forged dtype is named as that first). A view is made with the tensor's shape over the bytes its place gives: a shape
    // (or dtype) describing other than those bytes is refused (a reader would index
    // past them).
    if let PlacePart::Dense { len, .. } | PlacePart::ExpertPiece { len, .. } = p.place
        && super::shape::shape_bytes(dtype, &p.shape) != Some(len as u64)
    {
        return Err(bad(
            "tensor shape",
            format!(
                "{} {:?} of {}",
                crate::error::quote(&p.name),
                p.shape,
                p.dtype
            ),
            &format!("its place gives {len} bytes"),
        ));
    }
    Ok(tensor)
}

/// The conversion a tensor's `converted_from` and `dtype` name, where this crate makes
/// it (verify converts the file's bytes with it; anything else is taken for BF16).
fn conversion(p: &TensorPart, from: Dtype, to: Dtype) -> Result<super::convert::Conversion> {
    match super::convert::Conversion::of(from, to) {
        Ok(Some(c)) if c.to == to => Ok(c),
        Ok(_) => Err(bad(
            "conversion",
            crate::error::quote(&p.name),
            &format!("{from} -> {to} is not a conversion this crate makes at placement"),
        )),
        Err(why) => Err(bad("conversion", crate::error::quote(&p.name), &why)),
    }
}

fn piece_part(p: &TensorPiece) -> PiecePart {
    (p.tensor(), p.file(), p.offset, p.len)
}

pub(super) fn plan_part(plan: &ExpertPlan) -> PlanPart {
    PlanPart {
        naming: plan.naming.clone(),
        engine_tensors: plan.engine_tensors,
        engine_bytes: plan.engine_bytes,
        layers: plan
            .layers
            .iter()
            .map(|l| LayerPlanPart {
                layer: l.layer,
                experts: l
                    .experts
                    .iter()
                    .map(|e| {
                        (
                            e.weights.iter().map(piece_part).collect(),
                            e.scales.iter().map(piece_part).collect(),
                        )
                    })
                    .collect(),
                weight_bytes: l.weight_bytes,
                scale_bytes: l.scale_bytes,
                roles: l
                    .roles
                    .iter()
                    .map(|(r, n)| (*r == PieceRole::Scale, n.clone()))
                    .collect(),
                canonical: l.canonical.clone(),
                gate_up: l.gate_up.map(|g| format!("{g:?}")),
                orientations: l
                    .orientations
                    .iter()
                    .map(|o| match o {
                        Orientation::InOut => "in_out".to_owned(),
                        _ => "out_in".to_owned(),
                    })
                    .collect(),
                share: l.share.as_ref().map(|s| SharePart {
                    ids: s.ids.clone(),
                    of: s.of,
                    complete: s.complete,
                    slices: s
                        .slices
                        .iter()
                        .map(|c| RoleSlicePart {
                            role: c.role.clone(),
                            weight: c.weight,
                            rows: c.axis == SliceAxis::Rows,
                            start: c.start,
                            len: c.len,
                            parts: c.parts,
                            extent: c.extent,
                            shape: c.shape.clone(),
                            whole: c.whole,
                        })
                        .collect(),
                }),
            })
            .collect(),
    }
}

/// The plan from its part: every piece names a tensor of the `tensors` placed and a range
/// of one of the checkpoint's files (`files`: their lengths), a share's ids are one per
/// slot and increasing.
pub(super) fn expert_plan(p: &PlanPart, tensors: usize, files: &[u64]) -> Result<ExpertPlan> {
    Ok(ExpertPlan {
        naming: p.naming.clone(),
        layers: p
            .layers
            .iter()
            .map(|l| layer_plan(l, tensors, files))
            .collect::<Result<_>>()?,
        engine_tensors: p.engine_tensors,
        engine_bytes: p.engine_bytes,
    })
}

/// One layer's plan from its part: its pieces checked against the `tensors` placed and
/// the checkpoint's `files` (lengths), one canonical name and orientation per role, its
/// share checked.
fn layer_plan(l: &LayerPlanPart, tensors: usize, files: &[u64]) -> Result<LayerPlan> {
    let piece = |&(tensor, file, offset, len): &PiecePart| {
        if tensor >= tensors {
            return Err(Error::OutOfRange {
                op: ATTACH,
                what: "tensor of an expert piece".to_owned(),
                index: tensor,
                len: tensors,
            });
        }
        // Checked here, not only by the u32 cast in TensorPiece::new: a forged index
        // past the checkpoint's file table (below 2^32 or not) is refused by this call.
        let Some(&file_len) = files.get(file) else {
            return Err(Error::OutOfRange {
                op: ATTACH,
                what: "file of an expert piece".to_owned(),
                index: file,
                len: files.len(),
            });
        };
        if offset.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(Error::bad_value(
                ATTACH,
                "range of an expert piece",
                format!("offset {offset} len {len}"),
                format!("past the end of file {file} ({file_len} bytes)"),
            ));
        }
        TensorPiece::new(tensor, file, offset, len)
    };
    let mut experts = Vec::with_capacity(l.experts.len());
    for (w, s) in &l.experts {
        experts.push(ExpertPieces {
            weights: w.iter().map(piece).collect::<Result<_>>()?,
            scales: s.iter().map(piece).collect::<Result<_>>()?,
        });
    }
    if l.canonical.len() != l.roles.len() || l.orientations.len() != l.roles.len() {
        return Err(Error::mismatch(
            ATTACH,
            format!(
                "layer {}: canonical roles and orientations, one per role",
                l.layer
            ),
            l.roles.len(),
            l.canonical.len().min(l.orientations.len()),
        ));
    }
    let orientations = l
        .orientations
        .iter()
        .map(|o| orientation_of(o))
        .collect::<Result<_>>()?;
    let gate_up = match &l.gate_up {
        None => None,
        Some(g) => Some(gate_up_of(g)?),
    };
    let share = match &l.share {
        None => None,
        Some(s) => Some(layer_share(s, l.layer, experts.len())?),
    };
    Ok(LayerPlan {
        layer: l.layer,
        experts,
        weight_bytes: l.weight_bytes,
        scale_bytes: l.scale_bytes,
        roles: l
            .roles
            .iter()
            .map(|(s, n)| {
                let role = if *s {
                    PieceRole::Scale
                } else {
                    PieceRole::Weight
                };
                (role, n.clone())
            })
            .collect(),
        canonical: l.canonical.clone(),
        gate_up,
        orientations,
        share,
    })
}

fn orientation_of(text: &str) -> Result<Orientation> {
    match text {
        "out_in" => Ok(Orientation::OutIn),
        "in_out" => Ok(Orientation::InOut),
        other => Err(bad(
            "orientation",
            crate::error::quote(other),
            "out_in or in_out",
        )),
    }
}

fn gate_up_of(text: &str) -> Result<GateUpLayout> {
    GATE_UP
        .into_iter()
        .find(|x| format!("{x:?}") == text)
        .ok_or_else(|| bad("gate_up layout", crate::error::quote(text), "unknown"))
}

/// Layer `layer`'s share from its part: its ids one per slot (`slots`), increasing and
/// below the count it is a share of.
fn layer_share(s: &SharePart, layer: usize, slots: usize) -> Result<LayerShare> {
    let increasing = s.ids.windows(2).all(|w| w[0] < w[1]);
    if s.ids.len() != slots || !increasing || s.ids.iter().any(|&i| i >= s.of) {
        return Err(Error::bad_value(
            ATTACH,
            "layer",
            layer,
            format!(
                "the share's ids are not {slots} increasing ids below {}",
                s.of
            ),
        ));
    }
    // Rows k/n of each of `parts` blocks: parts ≥ 1, more only for a row cut whose
    // held rows split into them.
    if let Some(c) = s.slices.iter().find(|c| {
        c.parts == 0 || (c.parts > 1 && (!c.rows || c.whole || !c.len.is_multiple_of(c.parts)))
    }) {
        return Err(Error::bad_value(
            ATTACH,
            "layer",
            layer,
            format!(
                "role {}'s slice has parts {} (len {}, rows {}): parts are 1, or more for \
                 a row cut whose len divides into them",
                c.role, c.parts, c.len, c.rows
            ),
        ));
    }
    Ok(LayerShare {
        ids: s.ids.clone(),
        of: s.of,
        complete: s.complete,
        slices: s
            .slices
            .iter()
            .map(|c| RoleSlice {
                role: c.role.clone(),
                weight: c.weight,
                axis: axis_of(c.rows),
                start: c.start,
                len: c.len,
                parts: c.parts,
                extent: c.extent,
                shape: c.shape.clone(),
                whole: c.whole,
            })
            .collect(),
    })
}
