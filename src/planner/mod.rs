//! The planner: which layout for this model on this machine, and why — without loading a
//! byte and without timing anything.
//!
//! From a model's sizes ([`ModelSizes`], read from a checkpoint's header), a
//! [`Machine`] (the live one, or a description file) and optional
//! [`RoutingStats`], [`plan`] computes for each [`Candidate`] layout: the bytes it puts
//! on each node and whether they fit the node's free memory (or the budget), the
//! mappings its expert regions cost against the map limit, the expected fraction of
//! expert bytes a token reads from another node (and from another domain) when every
//! node's threads read any expert, and the load imbalance (most-loaded node over the
//! mean) when each expert runs on its home node. Then it recommends one by the rule of
//! [`PlanTable::recommended`]. The definitions, the rule and a worked table are in
//! `docs/planner.md`.

mod figures;
mod machine;
mod table;

use crate::error::{Error, Result};
use crate::model::Checkpoint;
use crate::routing::RoutingStats;

pub use machine::{Machine, MachineNode};
pub use table::{Candidate, PlanRow, PlanTable};

/// One MoE layer's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeLayerSizes {
    /// The model's layer number.
    pub layer: usize,
    /// Routed experts in the layer.
    pub experts: usize,
    /// Bytes of one expert's weights.
    pub weight_bytes: u64,
    /// Bytes of one expert's scales (0: none).
    pub scale_bytes: u64,
}

impl MoeLayerSizes {
    /// Bytes one expert takes in a store: each kind's slot rounded up to the page, as
    /// [`PinStore`](crate::store::PinStore) strides them (4 KiB pages).
    pub fn slot_bytes(&self) -> u64 {
        let page = |b: u64| b.div_ceil(4096).saturating_mul(4096);
        page(self.weight_bytes).saturating_add(page(self.scale_bytes))
    }

    /// Regions per copy of the layer: one per kind.
    pub fn kinds(&self) -> usize {
        1 + usize::from(self.scale_bytes > 0)
    }
}

/// What the planner needs of a model: its MoE layers and the bytes of everything else
/// (attention, norms, routers, shared experts, embeddings: "non-expert" bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSizes {
    /// The MoE layers, by increasing layer number.
    pub moe_layers: Vec<MoeLayerSizes>,
    /// Bytes of every tensor that is not a routed expert.
    pub other_bytes: u64,
}

impl ModelSizes {
    /// The sizes of a checkpoint, from its header (its expert plan under the detected
    /// naming, and the bytes of every other tensor).
    ///
    /// # Errors
    /// As [`Checkpoint::expert_plan`].
    pub fn from_checkpoint(checkpoint: &Checkpoint) -> Result<ModelSizes> {
        let plan = checkpoint.expert_plan()?;
        Ok(ModelSizes {
            moe_layers: plan
                .layers()
                .iter()
                .map(|l| MoeLayerSizes {
                    layer: l.layer(),
                    experts: l.experts().len(),
                    weight_bytes: l.weight_bytes(),
                    scale_bytes: l.scale_bytes(),
                })
                .collect(),
            other_bytes: plan.engine_bytes(),
        })
    }

    /// `(layer, experts)` of each MoE layer, what routing statistics are checked against.
    pub fn shape(&self) -> Vec<(usize, usize)> {
        self.moe_layers
            .iter()
            .map(|l| (l.layer, l.experts))
            .collect()
    }

    /// The fields are public: layers by strictly increasing number (a layer twice would
    /// take another's statistics), no more experts than a checkpoint can hold.
    fn check(&self, op: &'static str) -> Result<()> {
        if let Some(w) = self
            .moe_layers
            .windows(2)
            .find(|w| w[0].layer >= w[1].layer)
        {
            return Err(Error::bad_value(
                op,
                "MoE layer",
                w[1].layer,
                format!(
                    "the MoE layers go by strictly increasing number ({} then {})",
                    w[0].layer, w[1].layer
                ),
            ));
        }
        if let Some(l) = self
            .moe_layers
            .iter()
            .find(|l| l.experts > crate::model::MAX_EXPERTS_PER_LAYER)
        {
            return Err(Error::too_large(
                op,
                format!("layer {}'s experts", l.layer),
                l.experts,
                crate::model::MAX_EXPERTS_PER_LAYER,
                "MAX_EXPERTS_PER_LAYER",
            ));
        }
        Ok(())
    }

    /// Bytes of all experts in store slots.
    pub fn expert_bytes(&self) -> u64 {
        self.moe_layers
            .iter()
            .map(|l| l.slot_bytes().saturating_mul(l.experts as u64))
            .fold(0, u64::saturating_add)
    }
}

/// Options of [`plan`]. `#[non_exhaustive]`: set through the setters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanOptions {
    /// Bytes per node the layouts may use (default: each node's free memory). The hybrid
    /// layout fills it; every layout's fit is judged against it.
    pub budget: Option<u64>,
}

impl PlanOptions {
    /// [`PlanOptions::budget`].
    #[must_use]
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }
}

/// The table of candidate layouts for `model` on `machine` with optional routing
/// statistics, and the recommendation.
///
/// # Errors
/// A model without MoE layers, or whose layers are not by strictly increasing number or
/// hold more than [`MAX_EXPERTS_PER_LAYER`](crate::model::MAX_EXPERTS_PER_LAYER)
/// experts; a machine that [`Machine::from_json`] would refuse (no nodes, a node twice or
/// out of order, a distance matrix of the wrong shape, ...); statistics whose layers or
/// expert counts disagree with the model, or a budget smaller than one copy of the
/// non-expert tensors.
pub fn plan(
    model: &ModelSizes,
    machine: &Machine,
    stats: Option<&RoutingStats>,
    options: &PlanOptions,
) -> Result<PlanTable> {
    const OP: &str = "planner::plan";
    if model.moe_layers.is_empty() || model.moe_layers.iter().all(|l| l.experts == 0) {
        return Err(Error::empty(OP, "MoE layers in the model"));
    }
    model.check(OP)?;
    machine.check(OP)?;
    if let Some(stats) = stats {
        stats.check_against(&model.shape())?;
    }
    if let Some(budget) = options.budget
        && budget < model.other_bytes
    {
        return Err(Error::too_large(
            OP,
            "one copy of the non-expert tensors",
            model.other_bytes,
            budget,
            "the per-node budget",
        ));
    }
    Ok(figures::Ctx::new(model, machine, stats, options).table())
}

#[cfg(test)]
mod agree;
#[cfg(test)]
mod tests;
