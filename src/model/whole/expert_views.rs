//! An expert of a [`PlacedModel`] by its pieces' roles ([`PlacedModel::expert`]): each
//! piece's role as the naming spells it and canonically, its dtype, its shape without the
//! experts dimension and its bytes; under a tensor slice, the part held with the sliced
//! shape.

use super::views::{BACK_TO_BACK, PlacedModel, piece};
use crate::error::{Error, Result};
use crate::model::{Dtype, PieceRole, RoleSlice, SliceAxis, TensorPiece};
use crate::store::{Kind, SlotPiece};

/// One piece of an expert: its role, dtype, shape and bytes.
#[derive(Debug, Clone)]
pub struct ExpertPieceView<'a> {
    /// Weight or scale slot.
    pub slot: PieceRole,
    /// The role as the naming spells it (`"gate_proj"`, `"ffn_down_exps"`,
    /// `"down_proj scale"`, `"gate_up bias"`).
    pub role: &'a str,
    /// The role's canonical name, the same for every naming (`"gate"`, `"down.scale"`,
    /// `"gate_up.bias"`: [`Naming::canonical_role`](crate::model::Naming::canonical_role)).
    pub canonical: &'a str,
    /// The tensor it comes from.
    pub tensor: &'a str,
    /// Its element type.
    pub dtype: Dtype,
    /// This expert's shape (the tensor's without its experts dimension), row-major,
    /// outermost first.
    pub shape: Vec<u64>,
    /// Its bytes (the calling thread's node's copy when the experts are replicated).
    pub bytes: &'a [u8],
}

impl PlacedModel {
    /// Expert `expert` (its global id) of MoE layer `layer` (model layer number): its
    /// pieces by role in slot order, weights then scales (and biases). Under an expert
    /// share, an expert the share does not hold is [`Error::NotHeld`].
    ///
    /// # Errors
    /// The model has no experts, or not that layer or expert.
    pub fn expert(&self, layer: usize, expert: usize) -> Result<Vec<ExpertPieceView<'_>>> {
        let store = self.expert_store()?;
        let plan = self.layer_plan("PlacedModel::expert", layer)?;
        // `expert` is a global id: a share's slots are looked up by it (store and map).
        let experts = plan.share().map_or(plan.experts().len(), |s| s.of());
        let pieces = match plan.share() {
            Some(_) => plan.expert(expert)?,
            None => plan.experts().get(expert).ok_or(Error::OutOfRange {
                op: "PlacedModel::expert",
                what: format!("expert of layer {layer}"),
                index: expert,
                len: experts,
            })?,
        };
        let map = store.slot_map(layer)?;
        let roles: Vec<(PieceRole, (&str, &str))> = plan
            .roles()
            .zip(plan.canonical_roles())
            .map(|((r, n), c)| (r, (n, c)))
            .collect();
        let mut out = Vec::new();
        if self.roles > 1 {
            // Role-major slots: weight piece r of this expert is slot r × E + e alone.
            // Under a share: E the experts held, e the held one's index.
            let (held, local) = match plan.share() {
                Some(s) => (plan.experts().len(), s.expert_ids().binary_search(&expert)),
                None => (experts, Ok(expert)),
            };
            let local = local.unwrap_or(usize::MAX);
            let names = roles.iter().filter(|(r, _)| *r == PieceRole::Weight);
            for (r, (p, (_, (name, canonical)))) in pieces.weights().iter().zip(names).enumerate() {
                let (s, _) = super::role_major::slot_of(self.roles, held, local, r);
                let slot = store.weights_local(layer, s)?;
                let Some(sp) = map.pieces(s, Kind::Weights).and_then(<[_]>::first) else {
                    continue;
                };
                let t = &self.tensors[p.tensor()];
                out.push(ExpertPieceView {
                    slot: PieceRole::Weight,
                    role: name,
                    canonical,
                    tensor: &t.name,
                    dtype: t.dtype,
                    shape: expert_shape(&t.shape, t.len, p.len(), experts),
                    bytes: piece(slot, sp.offset, sp.len),
                });
            }
            return Ok(out);
        }
        for (role, kind) in [
            (PieceRole::Weight, Kind::Weights),
            (PieceRole::Scale, Kind::Scales),
        ] {
            let slot = match kind {
                Kind::Weights => store.weights_local(layer, expert)?,
                Kind::Scales => store.scales_local(layer, expert)?,
            };
            let names = roles.iter().filter(|(r, _)| *r == role).map(|(_, n)| *n);
            let places = map.pieces(expert, kind).unwrap_or_default();
            let cuts: Vec<&RoleSlice> = plan.share().map_or(Vec::new(), |s| {
                let weight = role == PieceRole::Weight;
                s.slices().iter().filter(|c| c.weight == weight).collect()
            });
            if !cuts.is_empty() {
                let what = (layer, expert, pieces.pieces(role), places);
                out.extend(self.sliced_views(what, role, names, &cuts, slot)?);
                continue;
            }
            for ((p, sp), (name, canonical)) in pieces.pieces(role).iter().zip(places).zip(names) {
                let t = &self.tensors[p.tensor()];
                out.push(ExpertPieceView {
                    slot: role,
                    role: name,
                    canonical,
                    tensor: &t.name,
                    dtype: t.dtype,
                    shape: expert_shape(&t.shape, t.len, p.len(), experts),
                    bytes: piece(slot, sp.offset, sp.len),
                });
            }
        }
        Ok(out)
    }

    /// The global ids of MoE layer `layer`'s experts this model holds, in slot order
    /// (`0..n` without an expert share).
    ///
    /// # Errors
    /// The model has no experts, or not that layer.
    pub fn expert_ids(&self, layer: usize) -> Result<Vec<usize>> {
        self.expert_store()?;
        let plan = self.layer_plan("PlacedModel::expert_ids", layer)?;
        Ok((0..plan.experts().len())
            .map(|slot| plan.expert_id(slot))
            .collect())
    }

    /// The views of one slot's roles under a tensor slice: a role cut by columns is one
    /// piece per row (all of them one view, its shape the slice's), a role cut by rows
    /// or kept whole one piece. The rows of a view must lie back to back in the slot
    /// (`piece_align` 1, no `piece_congruence`): with padding between them no single
    /// byte slice holds the role, and that is an error rather than padding in the view.
    fn sliced_views<'s>(
        &'s self,
        (layer, expert, pieces, places): (usize, usize, &[TensorPiece], &[SlotPiece]),
        role: PieceRole,
        names: impl Iterator<Item = (&'s str, &'s str)>,
        cuts: &[&RoleSlice],
        slot: &'s [u8],
    ) -> Result<Vec<ExpertPieceView<'s>>> {
        let mut out = Vec::new();
        let mut at = 0usize;
        for (cut, (name, canonical)) in cuts.iter().zip(names) {
            let rows = match cut.shape.split_last() {
                Some((_, outer)) if sliced_by_columns(cut) => outer.iter().product::<u64>(),
                // A packed row cut: one piece per block (gate rows, then up rows).
                _ if !cut.whole => cut.parts.max(1),
                _ => 1,
            };
            let count = usize::try_from(rows).unwrap_or(usize::MAX);
            let end = at.saturating_add(count);
            let (Some(ps), Some(sps)) = (pieces.get(at..end), places.get(at..end)) else {
                return Err(Error::mismatch(
                    "PlacedModel::expert",
                    format!("layer {layer} expert {expert} {name}: slot pieces from {at}"),
                    count,
                    places.len().saturating_sub(at),
                ));
            };
            at = end;
            // A manifest's forged `parts` (or any count off the slot's pieces) takes
            // another tensor's piece into this role: refused, not a wrong view.
            if ps.iter().any(|p| p.tensor() != ps[0].tensor()) {
                return Err(Error::mismatch(
                    "PlacedModel::expert",
                    format!("layer {layer} expert {expert} {name}: pieces of one tensor"),
                    count,
                    ps.iter()
                        .take_while(|p| p.tensor() == ps[0].tensor())
                        .count(),
                ));
            }
            let (Some(first), Some(last)) = (sps.first(), sps.last()) else {
                continue;
            };
            if sps.windows(2).any(|w| w[0].end() != w[1].offset) {
                return Err(Error::wrong_backing(
                    "PlacedModel::expert",
                    format!(
                        "layer {layer} expert {expert} {name}: its {count} row pieces are not \
                         back to back in the slot (piece_align or piece_congruence padded \
                         them)"
                    ),
                    BACK_TO_BACK,
                ));
            }
            let t = &self.tensors[ps[0].tensor()];
            let mut shape = cut.shape.clone();
            if !cut.whole {
                let axis = match cut.axis {
                    SliceAxis::Rows => shape.first_mut(),
                    SliceAxis::Columns => shape.last_mut(),
                };
                if let Some(d) = axis {
                    *d = cut.len;
                }
            }
            out.push(ExpertPieceView {
                slot: role,
                role: name,
                canonical,
                tensor: &t.name,
                dtype: t.dtype,
                shape,
                bytes: piece(slot, first.offset, last.end() - first.offset),
            });
        }
        if at != places.len() || at != pieces.len() {
            return Err(Error::mismatch(
                "PlacedModel::expert",
                format!("layer {layer} expert {expert}: slot pieces its role slices take"),
                places.len(),
                at,
            ));
        }
        Ok(out)
    }
}

/// Whether a role's cut keeps part of each row (one piece per row), as
/// `Geometry::cuts` makes it.
fn sliced_by_columns(cut: &RoleSlice) -> bool {
    cut.axis == SliceAxis::Columns && !cut.whole && cut.len != cut.extent
}

/// One expert's shape in a tensor of `shape` (normalized) and `len` bytes whose piece is
/// `piece` bytes: the tensor's own for a per-expert tensor; without the outermost
/// dimension for `[E, …]`; the outermost divided by E for DBRX's flattened `[E·I, …]`.
fn expert_shape(shape: &[u64], len: u64, piece: u64, experts: usize) -> Vec<u64> {
    let e = experts as u64;
    match shape.split_first() {
        _ if piece == len => shape.to_vec(),
        Some((&first, rest)) if first == e => rest.to_vec(),
        Some((&first, rest)) if e > 0 && first % e == 0 => std::iter::once(first / e)
            .chain(rest.iter().copied())
            .collect(),
        _ => shape.to_vec(),
    }
}
