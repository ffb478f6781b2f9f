//! [`ExpertAssignment`]: which node of a [`Layout::SplitExperts`] set each expert of a
//! layer lives on, when that is not the contiguous split by index.
//!
//! Why the assignment is data beside the layout and not in it: [`Layout`] is `Copy`, a
//! few words, matched everywhere; an assignment is a list per layer (thousands of
//! experts), built from routing statistics that the layout's users may not have. So the
//! layout says *how* (split over these nodes) and [`StoreOptions::assignment`] says *which
//! expert where*; a layer the assignment does not name is split by index as before.
//!
//! In the store the experts of one node still sit in one contiguous block of each
//! region (so a split layer costs one mapping per node and region, as by index): the
//! slots are laid out node by node, each node's experts in index order, and every
//! accessor translates the expert number to its slot. Nothing outside the store sees the
//! order: `weights(layer, e)` is expert `e`.
//!
//! [`Layout`]: super::Layout
//! [`Layout::SplitExperts`]: super::Layout::SplitExperts
//! [`StoreOptions::assignment`]: super::StoreOptions::assignment

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use super::layout::block;
use crate::error::{Error, Result};
use crate::nodeset::Node;
use crate::routing::{RoutingStats, balance};

const OP: &str = "ExpertAssignment";

/// Each expert's home, as an index into the layout's node set, per layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpertAssignment {
    layers: BTreeMap<usize, Arc<[usize]>>,
}

impl ExpertAssignment {
    /// No layer assigned: every layer split by index.
    pub fn new() -> ExpertAssignment {
        ExpertAssignment::default()
    }

    /// Assigns the experts of `layer`: `homes[e]` is the index, in the layout's node set,
    /// of expert `e`'s node. Checked against the layer and the set when the layer is
    /// packed.
    #[must_use]
    pub fn layer(mut self, layer: usize, homes: Vec<usize>) -> Self {
        self.layers.insert(layer, homes.into());
        self
    }

    /// Balanced by load: for each `(layer, experts)` of `model` with statistics, the
    /// experts assigned by [`balance`] over `nodes` nodes with each node holding the
    /// same number of experts as the split by index gives it (the same bytes per node and
    /// mappings; only which experts changes). Layers without statistics are left out
    /// (split by index).
    ///
    /// # Errors
    /// No nodes, or statistics that disagree with `model`
    /// ([`RoutingStats::check_against`]).
    pub fn balanced(
        stats: &RoutingStats,
        model: &[(usize, usize)],
        nodes: usize,
    ) -> Result<ExpertAssignment> {
        if nodes == 0 {
            return Err(Error::empty(OP, "nodes to balance over"));
        }
        stats.check_against(model)?;
        let mut out = ExpertAssignment::new();
        for &(layer, experts) in model {
            let Some(counts) = stats.layer(layer) else {
                continue;
            };
            let caps: Vec<usize> = (0..nodes).map(|i| block(i, nodes, experts).len()).collect();
            out = out.layer(layer, balance(counts, &caps)?);
        }
        Ok(out)
    }

    /// The home index of `expert` of `layer`, if the layer is assigned.
    pub fn home(&self, layer: usize, expert: usize) -> Option<usize> {
        self.layers.get(&layer)?.get(expert).copied()
    }

    /// The assigned layers.
    pub fn layers(&self) -> impl Iterator<Item = (usize, &[usize])> {
        self.layers.iter().map(|(&l, h)| (l, &h[..]))
    }

    pub(super) fn homes(&self, layer: usize) -> Option<&Arc<[usize]>> {
        self.layers.get(&layer)
    }
}

/// A layer's slots under an assignment: where each expert's slot is, and each node's
/// block of slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotOrder {
    /// `slot[e]`: the slot expert `e` occupies.
    pub(crate) slot: Arc<[usize]>,
    /// `blocks[i]`: the slots of the `i`-th node of the set.
    pub(crate) blocks: Vec<Range<usize>>,
}

impl SlotOrder {
    /// Checks `homes` against `experts` and `nodes`, then lays the slots out node by
    /// node (each node's experts in index order).
    pub(super) fn new(
        layer: usize,
        homes: &[usize],
        experts: usize,
        nodes: usize,
    ) -> Result<SlotOrder> {
        const PACK: &str = "PinStore::pack_layer";
        if homes.len() != experts {
            return Err(Error::mismatch(
                PACK,
                format!("experts of layer {layer}: the spec's against the assignment's"),
                experts,
                homes.len(),
            ));
        }
        if let Some((e, &h)) = homes.iter().enumerate().find(|&(_, &h)| h >= nodes) {
            return Err(Error::bad_value(
                PACK,
                "assignment",
                h,
                format!(
                    "layer {layer} expert {e}: a home index must be below the layout's {nodes} nodes"
                ),
            ));
        }
        let mut count = vec![0usize; nodes];
        for &h in homes {
            count[h] += 1;
        }
        let mut next = Vec::with_capacity(nodes);
        let mut blocks = Vec::with_capacity(nodes);
        let mut start = 0;
        for c in count {
            next.push(start);
            blocks.push(start..start + c);
            start += c;
        }
        let slot = homes
            .iter()
            .map(|&h| {
                let s = next[h];
                next[h] += 1;
                s
            })
            .collect();
        Ok(SlotOrder { slot, blocks })
    }
}

impl super::PinStore {
    /// The slot order of `layer` under the store's assignment (`None`: by index).
    pub(super) fn slot_order(&self, layer: usize, experts: usize) -> Result<Option<SlotOrder>> {
        let (Some(set), Some(homes)) = (
            self.layout.blocks(),
            self.options
                .assignment
                .as_ref()
                .and_then(|a| a.homes(layer)),
        ) else {
            return Ok(None);
        };
        SlotOrder::new(layer, homes, experts, set.len()).map(Some)
    }

    /// The node `expert` of `layer` (of `experts`) is bound to: its assigned home where
    /// the store's assignment names the layer, else the layout's node.
    pub(super) fn expert_node(&self, layer: usize, experts: usize, expert: usize) -> Option<Node> {
        if let (Some(set), Some(homes)) = (
            self.layout.blocks(),
            self.options
                .assignment
                .as_ref()
                .and_then(|a| a.homes(layer)),
        ) && homes.len() == experts
        {
            return homes.get(expert).and_then(|&h| set.nth(h));
        }
        self.layout.target_node(layer, experts, expert)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arena lays expert `e` at `order[e]`: written in expert order, each reads back
    /// its own bytes from its own position.
    #[test]
    fn an_ordered_arena_reads_each_expert_from_its_slot() {
        use crate::store::Kind;
        use crate::store::arena::{Arena, Backing};
        let page = crate::page::page_size();
        let backing = Backing::Anonymous { huge_pages: false };
        let order: Arc<[usize]> = vec![2, 0, 1].into();
        let mut arena = Arena::reserve(Kind::Weights, 3, page, page, &backing)
            .unwrap()
            .with_order(order);
        for (e, slot) in arena.slots_mut().unwrap().into_iter().enumerate() {
            slot[..10].fill(e as u8 + 1);
        }
        for e in 0..3 {
            arena.mark_loaded(e, 10);
        }
        let base = arena.region().as_slice().as_ptr() as usize;
        for (e, p) in [(0, 2), (1, 0), (2, 1)] {
            assert_eq!(arena.slot(e).unwrap(), &[e as u8 + 1; 10]);
            assert_eq!(arena.slot(e).unwrap().as_ptr() as usize - base, p * page);
            assert_eq!(arena.slot_range(e), p * page..(p + 1) * page);
        }
        arena.release_slot(0).unwrap();
        assert!(arena.slot(0).is_none());
        assert_eq!(arena.slot(1).unwrap(), &[2; 10]);
    }

    #[test]
    fn slots_node_by_node_and_bad_homes() {
        let o = SlotOrder::new(0, &[1, 0, 1, 0, 2], 5, 3).unwrap();
        assert_eq!(&o.slot[..], &[2, 0, 3, 1, 4]);
        assert_eq!(o.blocks, vec![0..2, 2..4, 4..5]);
        assert!(
            SlotOrder::new(0, &[0, 3], 2, 3)
                .unwrap_err()
                .to_string()
                .contains("expert 1")
        );
        assert!(SlotOrder::new(0, &[0], 2, 3).is_err());
    }

    #[test]
    fn balanced_keeps_the_split_sizes() {
        let stats = RoutingStats::from_counts([(2, vec![9, 8, 1, 1, 1, 0])]).unwrap();
        let a = ExpertAssignment::balanced(&stats, &[(1, 6), (2, 6)], 2).unwrap();
        assert_eq!(a.layers().count(), 1, "layer 1 has no statistics");
        let homes: Vec<usize> = (0..6).map(|e| a.home(2, e).unwrap()).collect();
        assert_eq!(homes.iter().filter(|&&h| h == 0).count(), 3);
        // 9 and 8 apart: loads 10 and 10.
        assert_ne!(homes[0], homes[1]);
        assert!(ExpertAssignment::balanced(&stats, &[(2, 5)], 2).is_err());
        assert!(ExpertAssignment::balanced(&stats, &[(2, 6)], 0).is_err());
    }
}
