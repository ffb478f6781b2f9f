//! The plan against this machine's memory and map budget: the checks made before
//! anything is reserved (the plan's mappings against the budget, the bytes each node is
//! asked to hold against what it has) and the default plan, which replicates the dense
//! classes where every node has room and interleaves them where one has not.

use super::assign::PlacementCost;
use super::classes::TensorClass;
use super::plan::{DenseLayout, PlacementPlan};
use crate::diag;
use crate::error::{Error, Result};
use crate::model::Checkpoint;
use crate::node::{Node, NodeSet};
use crate::store::{HEAP_MARGIN, Layout, StoreOptions};
use crate::topology::{FIGURE as NODE_MEMORY_FIGURE, available_bytes};

impl Checkpoint {
    /// The default plan over `nodes`, which looks at free memory per node: routed experts
    /// split ([`Layout::SplitExperts`]); embeddings interleaved (a token reads a few rows);
    /// every other dense class replicated where every node has room for its copy plus its
    /// share of the rest, else interleaved. [`PlacementPlan::why`] says which branch was
    /// taken and the figures.
    ///
    /// # Errors
    /// As [`Checkpoint::placement_cost`]; a node's meminfo cannot be read.
    pub fn default_plan(&self, nodes: NodeSet) -> Result<PlacementPlan> {
        if nodes.is_empty() {
            return Err(Error::empty("Checkpoint::default_plan", "nodes"));
        }
        let mut plan =
            PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes));
        plan.experts_why = format!(
            "default: each expert on one home node, {} node(s) holding a contiguous block each",
            nodes.len()
        );
        let embeddings = "default: interleaved, a token reads a few rows of the table, so one \
                          copy spread over the nodes is enough";
        plan.set_class(
            TensorClass::Embeddings,
            DenseLayout::Interleave(nodes),
            embeddings.to_owned(),
        );
        let cost = self.placement_cost(&plan, &StoreOptions::default())?;
        let mut short: Option<(Node, u64, Option<u64>)> = None;
        for node in nodes.iter() {
            let needed = cost.node_bytes.get(&node).copied().unwrap_or(0);
            let available = available_bytes(node)?;
            if available.is_none_or(|a| a < needed) {
                short = Some((node, needed, available));
                break;
            }
        }
        let (dense, why) = match short {
            None => (
                DenseLayout::Replicate(nodes),
                format!(
                    "default: replicated, every node of {nodes} has room for a copy and its \
                     share of the rest ({} bytes on the busiest node; the figure is \
                     {NODE_MEMORY_FIGURE})",
                    cost.node_bytes.values().max().copied().unwrap_or(0)
                ),
            ),
            Some((node, needed, available)) => (
                DenseLayout::Interleave(nodes),
                match available {
                    Some(a) => format!(
                        "default: interleaved, node {} has {a} bytes available but a replica \
                         and its share of the rest need {needed}",
                        node.0
                    ),
                    None => format!(
                        "default: interleaved, node {}'s free memory is unknown (no meminfo)",
                        node.0
                    ),
                },
            ),
        };
        for class in TensorClass::DENSE {
            if class != TensorClass::Embeddings {
                plan.set_class(class, dense, why.clone());
            }
        }
        Ok(plan)
    }
}

/// The plan's mappings (plus the store's heap margin) against the map budget.
pub(super) fn check_budget(cost: &PlacementCost, options: &StoreOptions) -> Result<()> {
    let limit = match options.vma_budget {
        Some(budget) => budget,
        None => diag::max_map_count()?,
    };
    let current = diag::map_count()?;
    let needed = cost.mappings.saturating_add(HEAP_MARGIN);
    let available = limit.saturating_sub(current);
    if needed > available {
        return Err(Error::MapBudget {
            what: format!(
                "the placement plan ({} classes, {} mappings, {HEAP_MARGIN} kept free)",
                cost.classes.len(),
                cost.mappings
            ),
            needed,
            available,
            limit,
            current,
        });
    }
    Ok(())
}

/// The bytes each node is asked to hold against what it has; where placement is denied
/// or unsupported (one unplaced copy is built), one copy against all nodes together.
pub(super) fn check_memory(cost: &PlacementCost) -> Result<()> {
    let bound =
        crate::calls::NumaCall::Mbind.support()? == crate::calls::MempolicySupport::Available;
    if bound {
        for (&node, &needed) in &cost.node_bytes {
            if let Some(available) = available_bytes(node)?
                && available < needed
            {
                return Err(Error::NodeMemory {
                    what: format!("the placement plan's share of node {}", node.0),
                    needed,
                    available: vec![(node, available)],
                    figure: NODE_MEMORY_FIGURE,
                });
            }
        }
        return Ok(());
    }
    let mut available = Vec::new();
    for node in NodeSet::allowed().unwrap_or_default().iter() {
        if let Some(bytes) = available_bytes(node)? {
            available.push((node, bytes));
        }
    }
    let total: u64 = available.iter().map(|&(_, b)| b).sum();
    if !available.is_empty() && total < cost.one_copy_bytes {
        return Err(Error::NodeMemory {
            what: format!(
                "the placement plan's one unplaced copy (placement is denied or unsupported \
                 here; the nodes together have {total} bytes)"
            ),
            needed: cost.one_copy_bytes,
            available,
            figure: NODE_MEMORY_FIGURE,
        });
    }
    Ok(())
}
