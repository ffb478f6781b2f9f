//! Per-expert tensors by name ([`PlacedModel::tensor`](super::PlacedModel::tensor)):
//! where each one's part of its expert's slot is, under a share and a slice.

use super::shape::DenseSlice;
use super::views::{Place, PlacedTensor};
use crate::error::{Error, Result};
use crate::model::{ExpertPlan, Naming, RoleSlice, SliceAxis, TensorPiece};
use crate::store::{Kind, PinStore, SlotMap, SlotPiece};

/// Records where each per-expert tensor went (a tensor the naming gives one expert):
/// its part of its expert's slot, under a slice the part held (its sliced shape, its
/// pieces in the file, the cut); an expert outside the share [`Place::NotHeld`].
/// Tensors holding every expert stay [`Place::Experts`].
pub(crate) fn expert_tensors(
    store: &PinStore,
    plan: &ExpertPlan,
    naming: &Naming,
    roles: usize,
    tensors: &mut [PlacedTensor],
) -> Result<()> {
    for (index, t) in tensors.iter_mut().enumerate() {
        let Some(r) = naming.classify(&t.name) else {
            continue;
        };
        let (Some(expert), Some(layer)) = (r.expert, plan.layer(r.layer)) else {
            continue;
        };
        let pieces = match layer.expert(expert) {
            Ok(pieces) => pieces,
            Err(Error::NotHeld { .. }) => {
                t.place = Place::NotHeld {
                    layer: r.layer,
                    expert,
                };
                continue;
            }
            Err(_) => continue,
        };
        let kind = if r.scale { Kind::Scales } else { Kind::Weights };
        let list = match kind {
            Kind::Weights => pieces.weights(),
            Kind::Scales => pieces.scales(),
        };
        let map = store.slot_map(r.layer)?;
        if roles > 1 {
            // Role-major slots count the held experts: the held one's index.
            let local = layer
                .share()
                .map_or(Some(expert), |s| s.expert_ids().binary_search(&expert).ok());
            let experts = (roles, layer.experts().len());
            if let Some(place) = local.and_then(|local| {
                role_major_piece(map, (r.layer, local, kind), experts, list, index)
            }) {
                t.place = place;
            }
            continue;
        }
        let slots = map.pieces(expert, kind).unwrap_or_default();
        let mine: Vec<(&TensorPiece, &SlotPiece)> = list
            .iter()
            .zip(slots)
            .filter(|(p, _)| p.tensor() == index)
            .collect();
        let (Some(&(first, sfirst)), Some(&(_, slast))) = (mine.first(), mine.last()) else {
            continue;
        };
        if mine.windows(2).any(|w| w[0].1.end() != w[1].1.offset) {
            t.place = Place::Padded {
                layer: r.layer,
                expert,
            };
            continue;
        }
        t.place = Place::ExpertPiece {
            layer: r.layer,
            expert,
            kind,
            offset: sfirst.offset,
            len: slast.end() - sfirst.offset,
        };
        let held: u64 = mine.iter().map(|(p, _)| p.len()).sum();
        if held == t.len {
            continue;
        }
        // A slice: the cut of its role, as the share reports it.
        let role = naming.role_name(r.piece, r.scale);
        let cut = layer.share().and_then(|s| {
            s.slices()
                .iter()
                .find(|c| c.weight != r.scale && c.role == role)
        });
        t.offset = first.offset();
        t.len = held;
        t.rows = match mine.get(1) {
            Some((second, _)) => (mine.len() as u64, second.offset() - first.offset()),
            None => (1, 0),
        };
        if let Some(cut) = cut.filter(|c| !c.whole) {
            record_cut(t, cut);
        }
    }
    Ok(())
}

/// Role-major: a per-expert tensor's piece is slot `r × E + e` alone (`e` the held
/// expert's index under a share; no slice); `None` where the tensor is not among the expert's pieces or the slot has none.
fn role_major_piece(
    map: &SlotMap,
    (layer, expert, kind): (usize, usize, Kind),
    (roles, experts): (usize, usize),
    list: &[TensorPiece],
    index: usize,
) -> Option<Place> {
    let at = list.iter().position(|p| p.tensor() == index)?;
    let (slot, _) = super::role_major::slot_of(roles, experts, expert, at);
    let sp = map.pieces(slot, kind).and_then(<[_]>::first)?;
    Some(Place::ExpertPiece {
        layer,
        expert: slot,
        kind,
        offset: sp.offset,
        len: sp.len,
    })
}

/// The tensor's shape and slice under its role's cut.
fn record_cut(t: &mut PlacedTensor, cut: &RoleSlice) {
    let axis = match cut.axis {
        SliceAxis::Rows => t.shape.first_mut(),
        SliceAxis::Columns => t.shape.last_mut(),
    };
    if let Some(d) = axis {
        *d = cut.len;
    }
    t.slice = Some(DenseSlice {
        axis: cut.axis,
        start: cut.start,
        len: cut.len,
        extent: cut.extent,
    });
}
