//! What a placed model holds, as an engine asks for it: its MoE layers, each layer's
//! roles under one canonical vocabulary (`gate`, `up`, `gate_up`, `down`, with `.scale`
//! / `.bias`) beside the file's own names, the experts held, and where a tensor of the
//! checkpoint sits in that structure.

use super::views::PlacedModel;
use crate::error::{Error, Result};
use crate::model::PieceRole;

/// One role of a MoE layer's experts: its canonical name and the file's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertRole<'a> {
    /// The canonical name, the same for every naming (`"gate"`, `"up"`, `"gate_up"`,
    /// `"down"`, `"gate_up.bias"`, `"down.scale"`:
    /// [`Naming::canonical_role`](crate::model::Naming::canonical_role)).
    pub canonical: &'a str,
    /// The role as the file's naming spells it (`"w3"`, `"gate_up bias"`,
    /// `"down_proj scale"`).
    pub file: &'a str,
    /// The slot the role's pieces sit in.
    pub slot: PieceRole,
}

/// Where a tensor of the checkpoint sits among the routed experts
/// ([`PlacedModel::locate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertTensorRef {
    /// The model layer number.
    pub layer: usize,
    /// The expert (global id) a per-expert tensor belongs to; `None` for a tensor that
    /// holds every expert of the layer (`experts.gate_up_proj`, DBRX's `experts.mlp.w1`).
    pub expert: Option<usize>,
    /// The role's canonical name (`"gate_up"`, `"down.bias"`).
    pub role: String,
    /// The role as the file's naming spells it (`"gate_up_proj"`, `"gate_up bias"`).
    pub file_role: String,
}

impl PlacedModel {
    /// The MoE layers (model layer numbers) whose experts were placed, ascending; empty
    /// without routed experts.
    pub fn layers(&self) -> Vec<usize> {
        self.expert_plan
            .as_ref()
            .map(|p| p.layers().iter().map(|l| l.layer()).collect())
            .unwrap_or_default()
    }

    /// MoE layer `layer`'s roles in slot order (weights, then scales and biases), each
    /// by its canonical name and the file's.
    ///
    /// # Errors
    /// [`Error::NotPacked`] where `layer` has no placed experts.
    pub fn roles(&self, layer: usize) -> Result<Vec<ExpertRole<'_>>> {
        let plan = self.layer_plan("PlacedModel::roles", layer)?;
        Ok(plan
            .roles()
            .zip(plan.canonical_roles())
            .map(|((slot, file), canonical)| ExpertRole {
                canonical,
                file,
                slot,
            })
            .collect())
    }

    /// Where tensor `name` sits among the routed experts: its layer, expert and role;
    /// `None` for a tensor that is not a routed expert's (attention, a router, a shared
    /// expert).
    ///
    /// ```no_run
    /// # use numapin::model::{Checkpoint, DenseLayout, PlacementPlan};
    /// # use numapin::store::{Layout, StoreOptions};
    /// # let checkpoint = Checkpoint::open("model.safetensors")?;
    /// # let plan = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced);
    /// let model = checkpoint.place(&plan, StoreOptions::default())?;
    /// let at = model.locate("model.layers.1.block_sparse_moe.experts.3.w3.weight")?.unwrap();
    /// assert_eq!((at.layer, at.expert, at.role.as_str()), (1, Some(3), "up"));
    /// # Ok::<(), numapin::Error>(())
    /// ```
    ///
    /// # Errors
    /// No tensor of the checkpoint has this name ([`Error::InvalidArgument`] naming it).
    pub fn locate(&self, name: &str) -> Result<Option<ExpertTensorRef>> {
        if !self.by_name.contains_key(name) {
            return Err(Error::bad_value(
                "PlacedModel::locate",
                "tensor name",
                crate::error::quote(name),
                "no tensor of the checkpoint has this name",
            ));
        }
        let (Some(naming), Some(plan)) = (&self.naming, &self.expert_plan) else {
            return Ok(None);
        };
        let Some(r) = naming.classify(name) else {
            return Ok(None);
        };
        if plan.layer(r.layer).is_none() {
            return Ok(None);
        }
        Ok(Some(ExpertTensorRef {
            layer: r.layer,
            expert: r.expert,
            role: naming.canonical_role(r.piece, r.scale),
            file_role: naming.role_name(r.piece, r.scale),
        }))
    }
}
