//! The order of a placement's fills, and for drop-behind the one record per file that
//! all its stores' fills share.

use std::sync::Arc;

use super::assign::{Assigned, Group};
use super::views::DenseStore;
use crate::error::Result;
use crate::model::Checkpoint;
use crate::model::pack::PlannedLayer;
use crate::source::load::SharedBehind;
use crate::store::{Kind, Piece, PinStore, ReadMode, StoreOptions};

/// A dense group's tensors with bytes, their piece counts, and the pieces.
pub(super) type GroupPieces<'c> = (Vec<usize>, Vec<usize>, Vec<Piece<'c>>);

/// One fill of a placement: a dense group, or an MoE layer of the experts' store (by
/// position).
#[derive(Debug, Clone, Copy)]
pub(super) enum Step {
    /// Dense group `i` of the assignment.
    Dense(usize),
    /// MoE layer `i` of the expert plan (by position).
    Experts(usize),
}

impl Checkpoint {
    /// The tensors of dense group `g` that have bytes, how many pieces each has, and
    /// the pieces, in slot order.
    pub(super) fn group_pieces(&self, assigned: &Assigned, g: &Group) -> Result<GroupPieces<'_>> {
        let packed: Vec<usize> = g
            .tensors
            .iter()
            .copied()
            .filter(|&i| !self.tensors[i].is_empty())
            .collect();
        let mut counts = Vec::with_capacity(packed.len());
        let mut pieces = Vec::with_capacity(packed.len());
        for &i in &packed {
            let before = pieces.len();
            for (offset, len, joined) in assigned.held_pieces(self, i) {
                let piece = self.piece(i, offset, len)?;
                pieces.push(if joined { piece.joined() } else { piece });
            }
            counts.push(pieces.len() - before);
        }
        Ok((packed, counts, pieces))
    }

    /// The order the placement's fills run in: the dense groups, then the expert layers;
    /// for [`ReadMode::DropBehind`] by where each fill's first piece is (file by file,
    /// then by offset), so that the whole placement walks each file forwards (a
    /// checkpoint's tensors usually sort by name: layer 10 before layer 2) and each byte
    /// is read from the device once.
    pub(super) fn schedule(
        &self,
        options: &StoreOptions,
        dense: &[Option<GroupPieces<'_>>],
        experts: Option<&Vec<PlannedLayer<'_>>>,
    ) -> Vec<Step> {
        let mut steps: Vec<(Option<(usize, u64)>, Step)> = Vec::new();
        let by_file = options.read_mode == ReadMode::DropBehind;
        let first = |pieces: &mut dyn Iterator<Item = &Piece<'_>>| {
            pieces
                .filter(|_| by_file)
                .filter_map(|p| {
                    let file = self
                        .files
                        .iter()
                        .position(|f| std::ptr::eq(f.file(), p.file))?;
                    Some((file, p.offset))
                })
                .min()
        };
        for (i, group) in dense.iter().enumerate() {
            let pieces = group.iter().flat_map(|(_, _, pieces)| pieces);
            steps.push((first(&mut pieces.into_iter()), Step::Dense(i)));
        }
        for (i, (_, _, sources)) in experts.into_iter().flatten().enumerate() {
            let mut pieces = sources
                .iter()
                .flat_map(|s| Kind::ALL.into_iter().flat_map(|k| s.tensor(k).pieces()));
            steps.push((first(&mut pieces), Step::Experts(i)));
        }
        // Stable: without keys (other modes), dense groups first, as planned.
        steps.sort_by_key(|(key, _)| *key);
        steps.into_iter().map(|(_, step)| step).collect()
    }
}

/// Makes every store of a placement (the dense `stores`, and the experts' with its planned
/// layers) share one drop-behind record per file, holding every piece the placement reads
/// of it ([`SharedBehind`]).
pub(super) fn share_drop_behind(
    stores: &[DenseStore],
    dense: &[Option<GroupPieces<'_>>],
    experts: Option<(&PinStore, &[PlannedLayer<'_>])>,
) {
    let expert_pieces = experts.into_iter().flat_map(|(_, layers)| {
        layers.iter().flat_map(|(_, _, sources)| {
            sources.iter().flat_map(|source| {
                Kind::ALL
                    .into_iter()
                    .flat_map(|k| source.tensor(k).pieces())
            })
        })
    });
    let shared = Arc::new(SharedBehind::new(
        dense
            .iter()
            .flatten()
            .flat_map(|(_, _, pieces)| pieces)
            .chain(expert_pieces)
            .map(|p| (p.file, p.offset, p.len)),
    ));
    for store in stores
        .iter()
        .map(|d| &d.store)
        .chain(experts.map(|(store, _)| store))
    {
        store.share_drop_behind(Some(shared.clone()));
    }
}
