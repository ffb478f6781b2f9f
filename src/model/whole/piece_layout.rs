//! Where a placement's pieces start in their slots: the dense stores' layout (alignment
//! at least 64; for direct reads, congruence to each tensor's file offset modulo the
//! files' direct-I/O alignment) and the experts' congruence, and the plan applied to the
//! checkpoint with them ([`Checkpoint::placement_cost`] prices it, nothing reserved).

use super::assign::{Assigned, DENSE_ALIGN, PlacementCost, assign};
use super::plan::{DenseLayout, PlacementPlan};
use crate::error::{Error, Result};
use crate::model::Checkpoint;
use crate::source::direct::dio_mem_alignment;
use crate::store::{PieceLayout, ReadMode, StoreOptions};

const OP: &str = "Checkpoint::place";

impl Checkpoint {
    /// What `plan` would cost here, nothing reserved: per class its tensors, bytes,
    /// groups, mappings, `mbind` calls, bytes per node, against one mapping per tensor.
    /// Dense tensors are laid out at multiples of `max(options.piece_align, 64)` (and for
    /// [`ReadMode::Direct`] congruent to their file offsets, see [`Checkpoint::place`]),
    /// as [`Checkpoint::place`] does: the two count the same padding.
    ///
    /// # Errors
    /// As [`Checkpoint::place`]'s plan errors: a pattern that chooses no dense tensor, a
    /// tensor whose bytes are not its dtype × shape, the expert naming's errors.
    pub fn placement_cost(
        &self,
        plan: &PlacementPlan,
        options: &StoreOptions,
    ) -> Result<PlacementCost> {
        let (assigned, slot) = self.assigned(plan, options)?;
        assigned.cost(self, plan, slot, options.assignment.as_ref())
    }

    pub(super) fn assigned(
        &self,
        plan: &PlacementPlan,
        options: &StoreOptions,
    ) -> Result<(Assigned, u64)> {
        let slot = options.slot_align.bytes()?;
        let unit = self.direct_unit(options)?;
        // The experts' store would refuse a bad modulus only after the dense ones are
        // packed: refused here, before anything is reserved (and by the dry run too).
        let experts = PieceLayout {
            align: options.piece_align,
            modulus: expert_congruence(options, unit.filter(|_| plan.share.is_none()), slot),
        };
        experts.check(slot)?;
        let layout = dense_layout(options, unit, slot);
        layout.check(slot)?;
        let mut assigned = assign(self, plan, (layout, experts.modulus))?;
        assigned.roles = super::role_major::roles_for(self, &assigned, plan, options)?;
        if assigned.roles > 1 && options.piece_congruence == 0 {
            // A role's run must stay back to back: no padding to the file offsets (as
            // under a share), unless the caller asked for a modulus.
            assigned.expert_modulus = 0;
        }
        // A node past the node sets' bits would drop out of the set the store is given
        // (`bind:65535` became "no nodes in LayerPerNode()"): named here, before the
        // cost counts bytes on it.
        for &(class, layout) in &assigned.stores {
            if let DenseLayout::Bind(node) = layout
                && usize::from(node.0) >= crate::nodeset::MAX_NODES
            {
                return Err(Error::no_such_node(
                    OP,
                    format!("the bind node of {class}"),
                    usize::from(node.0),
                    crate::nodeset::MAX_NODES,
                    None,
                ));
            }
        }
        Ok((assigned, slot as u64))
    }

    /// The direct-I/O memory alignment the pieces are laid out for (`None`: none): the
    /// largest `stx_dio_mem_align` the files report (a read lands in place from the first
    /// aligned file offset on where the address follows the offset modulo it), for
    /// [`ReadMode::Direct`], and for [`ReadMode::Auto`] where some file is mostly not in
    /// the page cache (Auto reads it directly; a cached checkpoint keeps the layout of
    /// buffered reads). `None` for other read modes and for files that report no
    /// alignment (read buffered anyway).
    fn direct_unit(&self, options: &StoreOptions) -> Result<Option<usize>> {
        match options.read_mode {
            ReadMode::Direct => {}
            ReadMode::Auto => {
                let mut cold = false;
                for f in &self.files {
                    if !crate::source::residency(f.file())?.mostly_cached() {
                        cold = true;
                        break;
                    }
                }
                if !cold {
                    return Ok(None);
                }
            }
            _ => return Ok(None),
        }
        Ok(self
            .files
            .iter()
            .filter_map(|f| dio_mem_alignment(f.file()))
            .max())
    }
}

/// How the dense stores lay their tensors out in a slot. The caller's
/// [`StoreOptions::piece_congruence`] when set (1: off, tensors at multiples of
/// `max(piece_align, 64)`; otherwise that modulus, at least the alignment). At its default
/// 0, with a direct-I/O alignment `unit` (see `Checkpoint::direct_unit`): every tensor
/// congruent to its file offset modulo `max(unit, piece_align, 64)` (one whose file
/// offset is a multiple of 64 is still 64-aligned; one that is not follows its file
/// offset, so that its read lands in place), a modulus the slot alignment cannot reach
/// leaving the alignment alone; without one, the alignment alone.
fn dense_layout(options: &StoreOptions, unit: Option<usize>, slot: usize) -> PieceLayout {
    let align = options.piece_align.max(DENSE_ALIGN);
    let modulus = match (options.piece_congruence, unit) {
        (0, Some(unit)) if unit.max(align) <= slot => {
            return PieceLayout {
                align: options.piece_align,
                modulus: unit.max(align),
            };
        }
        (0 | 1, _) => 0,
        (modulus, _) => modulus.max(align),
    };
    PieceLayout { align, modulus }
}

/// The experts' congruence modulus: the caller's [`StoreOptions::piece_congruence`] when
/// set (1: off), else the direct-I/O alignment `unit` where there is one within the piece
/// and slot alignments (every expert piece then follows its file offset modulo it and
/// lands in place). Not under a share (a column-sliced role's rows must stay back to
/// back).
fn expert_congruence(options: &StoreOptions, unit: Option<usize>, slot: usize) -> usize {
    match (options.piece_congruence, unit) {
        (0, Some(unit)) if (options.piece_align..=slot).contains(&unit) => unit,
        (0 | 1, _) => 0,
        (modulus, _) => modulus,
    }
}
