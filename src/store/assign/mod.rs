//! [`ExpertAssignment`]: which node of a [`Layout::SplitExperts`] set each expert of a
//! layer lives on, when that is not the contiguous split by index — or that it lives on
//! every node ([`Home::Hot`]: a hot expert of a hybrid layout).
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
//! Hot experts (the hybrid layout): the first copy of the layer holds every expert, the
//! hot ones right after the first node's cold ones; every other *hot group* gets one more
//! region per kind holding only the hot experts. The hot groups are the set's nodes one
//! by one ([`HotCopies::PerNode`]: each copy bound to its node) or the set's domains
//! ([`HotCopies::PerDomain`]: each copy interleaved over the domain's nodes of the set,
//! bound where the domain has one node there, as [`Layout::ReplicateDomains`] places a
//! copy). The first copy's hot slots belong to the first group: inside the first node's
//! block (one `mbind`) where that group is one node, else a range of their own,
//! interleaved over the group. `weights_local` reads a hot expert from the calling
//! thread's group (its node, or its domain; else the nearest) and a cold one from its
//! home; `home_node` is `None` for a hot expert. Mappings per layer, per kind: the
//! non-empty node blocks, + 1 for the first group's hot range where it is apart, + the
//! groups − 1 (see the `hot` module).
//!
//! Why the per-domain choice is a property of the assignment ([`ExpertAssignment::hot_copies`])
//! and not a second home constant or a [`StoreOptions`] flag: a home constant would let
//! one layer mix per-node and per-domain hot experts (two sets of hot regions, for no use
//! anyone asked for), and a store option would mean nothing without an assignment (one
//! more combination to refuse). The assignment already says where every expert lives;
//! "one copy per domain" is part of that answer.
//!
//! [`Layout`]: super::Layout
//! [`Layout::SplitExperts`]: super::Layout::SplitExperts
//! [`StoreOptions::assignment`]: super::StoreOptions::assignment
//! [`StoreOptions`]: super::StoreOptions
//! [`Layout::ReplicateDomains`]: super::Layout::ReplicateDomains

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use super::layout::{Layout, block};

mod hot;
use crate::error::{Error, Result};
use crate::nodeset::{Node, NodeSet};
use crate::routing::{RoutingStats, balance};

const OP: &str = "ExpertAssignment";

/// Each expert's [`Home`] per layer: a node of the layout's set, or a copy in every hot
/// group ([`Home::Hot`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpertAssignment {
    layers: BTreeMap<usize, Arc<[Home]>>,
    hot_copies: HotCopies,
}

/// Where one expert of an assigned layer lives ([`ExpertAssignment::layer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Home {
    /// Its only copy is on this node, which must be in the layout's node set.
    Node(Node),
    /// Hot: a copy on every node of the set, or in every domain of it with
    /// [`HotCopies::PerDomain`].
    Hot,
}

/// Where a hybrid layer's hot experts ([`Home::Hot`]) get their copies:
/// [`ExpertAssignment::hot_copies`]. `#[non_exhaustive]`: shapes may be added.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HotCopies {
    /// One copy on every node of the set, each bound to its node: the nearest copy for
    /// every reader, nodes × the hot bytes.
    #[default]
    PerNode,
    /// One copy per domain (socket, see
    /// [`Topology::domains`](crate::topology::Topology::domains)) among the set's nodes,
    /// interleaved over the domain's nodes of the set (bound where it has one node
    /// there): with sub-NUMA clustering, one copy per socket instead of 2–4, each
    /// reader's copy in its own socket. The domains are read when the store is made.
    PerDomain,
}

/// The slot-order index of a hot expert: inside the crate ([`SlotOrder::new`], the
/// planner's rows), homes are indices into the layout's set; [`Home`] is the public form.
pub(crate) const HOT: usize = usize::MAX;

impl ExpertAssignment {
    /// No layer assigned: every layer split by index.
    pub fn new() -> ExpertAssignment {
        ExpertAssignment::default()
    }

    /// Where the hot experts get their copies: on every node of the set (the default) or
    /// once per domain ([`HotCopies::PerDomain`]).
    #[must_use]
    pub fn hot_copies(mut self, copies: HotCopies) -> Self {
        self.hot_copies = copies;
        self
    }

    /// Where the hot experts get their copies ([`ExpertAssignment::hot_copies`]).
    pub(crate) fn hot_copy_shape(&self) -> HotCopies {
        self.hot_copies
    }

    /// Assigns the experts of `layer`: `homes[e]` is expert `e`'s node (one of the
    /// layout's set), or [`Home::Hot`]. Checked against the layer and the set when the
    /// layer is packed.
    ///
    /// ```
    /// use numapin::Node;
    /// use numapin::store::{ExpertAssignment, Home};
    /// let a = ExpertAssignment::new().layer(0, vec![Home::Node(Node(1)), Home::Hot]);
    /// assert_eq!(a.home(0, 0), Some(Home::Node(Node(1))));
    /// assert_eq!(a.home(0, 1), Some(Home::Hot));
    /// assert_eq!(a.home(1, 0), None, "layer 1 is split by index");
    /// ```
    #[must_use]
    pub fn layer(mut self, layer: usize, homes: Vec<Home>) -> Self {
        self.layers.insert(layer, homes.into());
        self
    }

    /// Balanced by load: for each `(layer, experts)` of `model` with statistics, the
    /// experts assigned by [`balance`] over the nodes of `nodes` with each node holding
    /// the same number of experts as the split by index gives it (the same bytes per
    /// node and mappings; only which experts changes). Layers without statistics are
    /// left out (split by index). `nodes` is the set the store's layout splits over.
    ///
    /// # Errors
    /// No nodes, or statistics that disagree with `model`
    /// ([`RoutingStats::check_against`]).
    pub fn balanced(
        stats: &RoutingStats,
        model: &[(usize, usize)],
        nodes: &NodeSet,
    ) -> Result<ExpertAssignment> {
        ExpertAssignment::hybrid(stats, model, nodes, 0)
    }

    /// Hybrid: in each `(layer, experts)` of `model` with statistics, the `hot` most
    /// routed experts (ties to the lower expert) on every node ([`Home::Hot`]), the
    /// others balanced by load over the nodes of `nodes` with each node holding its share
    /// of the split by index of the cold ones. Layers without statistics are left out
    /// (split by index). The planner chooses `hot` per layer at a memory budget
    /// ([`PlanRow::assignment`](crate::planner::PlanRow::assignment)); this is the same
    /// shape with one number. `hot` 0 is [`ExpertAssignment::balanced`].
    ///
    /// # Errors
    /// As [`ExpertAssignment::balanced`].
    pub fn hybrid(
        stats: &RoutingStats,
        model: &[(usize, usize)],
        nodes: &NodeSet,
        hot: usize,
    ) -> Result<ExpertAssignment> {
        if nodes.is_empty() {
            return Err(Error::empty(OP, "nodes to balance over"));
        }
        stats.check_against(model)?;
        let ids: Vec<Node> = nodes.iter().collect();
        let n = ids.len();
        let mut out = ExpertAssignment::new();
        for &(layer, experts) in model {
            let Some(counts) = stats.layer(layer) else {
                continue;
            };
            let mut by_count: Vec<usize> = (0..experts).collect();
            by_count.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
            let mut homes = vec![Home::Hot; experts];
            let mut cold: Vec<usize> = by_count.iter().copied().skip(hot).collect();
            cold.sort_unstable();
            let cold_counts: Vec<u64> = cold.iter().map(|&e| counts[e]).collect();
            let caps: Vec<usize> = (0..n).map(|i| block(i, n, cold.len()).len()).collect();
            for (&e, i) in cold.iter().zip(balance(&cold_counts, &caps)?) {
                homes[e] = Home::Node(ids[i]);
            }
            out = out.layer(layer, homes);
        }
        Ok(out)
    }

    /// The home of `expert` of `layer`, if the layer is assigned.
    pub fn home(&self, layer: usize, expert: usize) -> Option<Home> {
        self.layers.get(&layer)?.get(expert).copied()
    }

    /// The assigned layers.
    pub fn layers(&self) -> impl Iterator<Item = (usize, &[Home])> {
        self.layers.iter().map(|(&l, h)| (l, &h[..]))
    }

    /// The slot order of `layer` (of `experts`) under `layout`: its experts grouped by
    /// home; `None` where the layout has no blocks or the layer is not assigned. What the
    /// store packs and the dry run prices.
    ///
    /// # Errors
    /// A home outside the layout's set, or homes that are not one per expert.
    pub(crate) fn slot_order(
        &self,
        layout: Layout,
        layer: usize,
        experts: usize,
    ) -> Result<Option<SlotOrder>> {
        let Some(set) = layout.blocks() else {
            return Ok(None);
        };
        let Some(homes) = self.indices(layer, &set)? else {
            return Ok(None);
        };
        SlotOrder::new(layer, &homes, experts, set.len()).map(Some)
    }

    /// The homes of `layer` as indices into `set` (a hot expert [`HOT`]), for the slot
    /// order; `None` where the layer is not assigned.
    ///
    /// # Errors
    /// A home outside `set`.
    fn indices(&self, layer: usize, set: &NodeSet) -> Result<Option<Vec<usize>>> {
        let Some(homes) = self.layers.get(&layer) else {
            return Ok(None);
        };
        let ids: Vec<Node> = set.iter().collect();
        let index = |(e, h): (usize, &Home)| match *h {
            Home::Hot => Ok(HOT),
            Home::Node(node) => ids.iter().position(|&m| m == node).ok_or_else(|| {
                Error::bad_value(
                    "PinStore::pack_layer",
                    "assignment",
                    node.0,
                    format!(
                        "layer {layer} expert {e}: a home must be a node of the layout's set {set}"
                    ),
                )
            }),
        };
        homes
            .iter()
            .enumerate()
            .map(index)
            .collect::<Result<_>>()
            .map(Some)
    }
}

/// The groups of `set` a hybrid layer's hot experts get a copy on, the one holding the
/// set's first node first: its nodes one by one, or its domains (`domains` groups a set
/// by domain, as for [`Layout::ReplicateDomains`]; asked only for
/// [`HotCopies::PerDomain`]).
///
/// # Errors
/// As `domains`.
pub(super) fn hot_groups(
    shape: HotCopies,
    set: NodeSet,
    domains: impl FnOnce(&NodeSet) -> Result<Vec<NodeSet>>,
) -> Result<Vec<NodeSet>> {
    // The groups are those of the replicating layouts, which place a copy the same way.
    match shape {
        HotCopies::PerNode => super::Layout::Replicate(set).copy_groups(domains),
        HotCopies::PerDomain => super::Layout::ReplicateDomains(set).copy_groups(domains),
    }
}

/// A layer's slots under an assignment: where each expert's slot is, and each node's
/// block of slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotOrder {
    /// `slot[e]`: the slot expert `e` occupies.
    pub(crate) slot: Arc<[usize]>,
    /// `blocks[i]`: the slots of the `i`-th node of the set (the first node's block holds
    /// the hot experts after its cold ones).
    pub(crate) blocks: Vec<Range<usize>>,
    /// The hot experts, by index.
    pub(crate) hot: Vec<usize>,
    /// The hot experts' slots: the end of the first node's block.
    pub(crate) hot_slots: Range<usize>,
}

impl SlotOrder {
    /// Checks `homes` against `experts` and `nodes`, then lays the slots out node by
    /// node (each node's experts in index order).
    pub(crate) fn new(
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
        if let Some((e, &h)) = homes
            .iter()
            .enumerate()
            .find(|&(_, &h)| h >= nodes && h != HOT)
        {
            return Err(Error::bad_value(
                PACK,
                "assignment",
                h,
                format!(
                    "layer {layer} expert {e}: a home index must be below the layout's {nodes} nodes"
                ),
            ));
        }
        let hot: Vec<usize> = (0..experts).filter(|&e| homes[e] == HOT).collect();
        let mut count = vec![0usize; nodes];
        for &h in homes.iter().filter(|&&h| h != HOT) {
            count[h] += 1;
        }
        // The hot experts right after the first node's cold ones: one block, one mbind.
        if let Some(first) = count.first_mut() {
            *first += hot.len();
        }
        let mut next = Vec::with_capacity(nodes);
        let mut blocks = Vec::with_capacity(nodes);
        let mut start = 0;
        for c in count {
            next.push(start);
            blocks.push(start..start + c);
            start += c;
        }
        let first = blocks.first().cloned().unwrap_or_default();
        let hot_slots = first.end.saturating_sub(hot.len())..first.end;
        let mut hot_next = hot_slots.start;
        let slot = homes
            .iter()
            .map(|&h| {
                if h == HOT {
                    hot_next += 1;
                    return hot_next - 1;
                }
                let s = next[h];
                next[h] += 1;
                s
            })
            .collect();
        Ok(SlotOrder {
            slot,
            blocks,
            hot,
            hot_slots,
        })
    }
}

/// One node's share of a split (or hybrid) store's experts:
/// [`PinStore::expert_shares`](super::PinStore::expert_shares).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct NodeShare {
    /// Expert bytes loaded on the node (its cold experts, and its copy of the hot ones).
    pub bytes: u64,
    /// Hot experts: the same on every node (each node holds a copy of each, or its share
    /// of its domain's interleaved copy with [`HotCopies::PerDomain`]).
    pub hot_experts: usize,
    /// Experts whose only copy is on this node.
    pub cold_experts: usize,
    /// The fraction of routed tokens that run here when each cold expert runs on its home
    /// and each hot one on every node alike (counts from the statistics; without them,
    /// every expert equally).
    pub load_share: f64,
}

impl super::PinStore {
    /// Per node of the layout's set: the bytes, hot and cold experts and load share of
    /// every packed layer (see [`NodeShare`]). Without placement (degraded) the hot
    /// experts have one copy, and the figures are where the layout meant them.
    ///
    /// # Errors
    /// As [`PinStore::stats`](super::PinStore::stats).
    pub fn expert_shares(&self, stats: Option<&RoutingStats>) -> Result<BTreeMap<Node, NodeShare>> {
        let node_bytes = self.stats()?.node_bytes;
        let Some(set) = self.layout.nodes() else {
            return Ok(BTreeMap::new());
        };
        let mut out: BTreeMap<Node, NodeShare> =
            set.iter().map(|n| (n, NodeShare::default())).collect();
        let mut total = 0.0;
        for (index, layer) in self.layers.iter() {
            let experts = layer.experts();
            let counts = stats
                .and_then(|s| s.layer(index))
                .filter(|c| c.len() == experts);
            for e in 0..experts {
                let w = counts.map_or(1.0, |c| c[e] as f64);
                total += w;
                match self.home_node(index, e)? {
                    Some(node) => {
                        let share = out.entry(node).or_default();
                        share.cold_experts += 1;
                        share.load_share += w;
                    }
                    None => {
                        for share in out.values_mut() {
                            share.hot_experts += 1;
                            share.load_share += w / set.len() as f64;
                        }
                    }
                }
            }
        }
        for (node, share) in &mut out {
            share.bytes = node_bytes.get(node).copied().unwrap_or(0);
            if total > 0.0 {
                share.load_share /= total;
            }
        }
        Ok(out)
    }

    /// The slot order of `layer` under the store's assignment (`None`: by index).
    pub(super) fn slot_order(&self, layer: usize, experts: usize) -> Result<Option<SlotOrder>> {
        match self.options.assignment.as_ref() {
            Some(a) => a.slot_order(self.layout, layer, experts),
            None => Ok(None),
        }
    }

    /// The node `expert` of `layer` (of `experts`) is bound to in the first copy: its
    /// assigned home where the store's assignment names the layer (the first node for a
    /// hot expert), else the layout's node; with role-major slots
    /// ([`StoreOptions::role_major`](crate::store::StoreOptions::role_major)), slot
    /// `expert` holds a role of expert `expert mod E` and goes to that expert's node.
    pub(super) fn expert_node(&self, layer: usize, experts: usize, expert: usize) -> Option<Node> {
        let (per, runs) = self.placer.runs(experts);
        let (experts, expert) = match runs {
            1 => (experts, expert),
            _ => (per, expert % per),
        };
        if let (Some(set), Some(homes)) = (
            self.layout.blocks(),
            (self.options.assignment.as_ref()).and_then(|a| a.layers.get(&layer)),
        ) && homes.len() == experts
        {
            return match homes.get(expert) {
                Some(Home::Hot) => set.nth(0),
                Some(&Home::Node(node)) => set.contains(node).then_some(node),
                None => None,
            };
        }
        self.layout.target_node(layer, experts, expert)
    }

    /// Whether `expert` of `layer` is hot (a copy in every hot group of the set).
    pub(super) fn is_hot(&self, layer: usize, expert: usize) -> bool {
        self.layout.blocks().is_some()
            && (self.options.assignment.as_ref()).and_then(|a| a.home(layer, expert))
                == Some(Home::Hot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(ids: &[usize]) -> NodeSet {
        NodeSet::from_nodes(ids.iter().copied()).unwrap()
    }

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

    /// Hot experts sit right after the first node's cold ones, inside its block.
    #[test]
    fn hot_slots_join_the_first_block() {
        const H: usize = HOT;
        let o = SlotOrder::new(0, &[1, H, 0, H, 1], 5, 2).unwrap();
        assert_eq!(o.hot, vec![1, 3]);
        assert_eq!(o.blocks, vec![0..3, 3..5]);
        assert_eq!(&o.slot[..], &[3, 1, 0, 2, 4]);
        // All hot: one block.
        let o = SlotOrder::new(0, &[H, H], 2, 3).unwrap();
        assert_eq!(o.blocks, vec![0..2, 2..2, 2..2]);
    }

    #[test]
    fn hybrid_takes_the_hottest_and_balances_the_rest() {
        let stats = RoutingStats::from_counts([(0, vec![1, 50, 2, 40, 3, 3])]).unwrap();
        let a = ExpertAssignment::hybrid(&stats, &[(0, 6)], &nodes(&[0, 1]), 2).unwrap();
        let homes: Vec<Home> = (0..6).map(|e| a.home(0, e).unwrap()).collect();
        assert_eq!(homes[1], Home::Hot);
        assert_eq!(homes[3], Home::Hot);
        // Cold 1, 2, 3, 3 two per node: {3, 1} and {3, 2} (loads 4 and 5) or better.
        let load = |n: usize| -> u64 {
            [1u64, 50, 2, 40, 3, 3]
                .iter()
                .zip(&homes)
                .filter(|&(_, &h)| h == Home::Node(Node(n as u16)))
                .map(|(c, _)| c)
                .sum()
        };
        assert_eq!(load(0) + load(1), 9);
        assert!(load(0).max(load(1)) <= 5);
        assert_eq!(
            homes.iter().filter(|&&h| h == Home::Node(Node(0))).count(),
            2
        );
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
        // Node ids, not indices: the set {3, 5}.
        let set = nodes(&[3, 5]);
        let a = ExpertAssignment::balanced(&stats, &[(1, 6), (2, 6)], &set).unwrap();
        assert_eq!(a.layers().count(), 1, "layer 1 has no statistics");
        let homes: Vec<Home> = (0..6).map(|e| a.home(2, e).unwrap()).collect();
        assert_eq!(
            homes.iter().filter(|&&h| h == Home::Node(Node(3))).count(),
            3
        );
        assert_eq!(
            homes.iter().filter(|&&h| h == Home::Node(Node(5))).count(),
            3
        );
        // 9 and 8 apart: loads 10 and 10.
        assert_ne!(homes[0], homes[1]);
        assert!(ExpertAssignment::balanced(&stats, &[(2, 5)], &set).is_err());
        assert!(ExpertAssignment::balanced(&stats, &[(2, 6)], &NodeSet::new()).is_err());
        // Indices into the set for the slot order; a node outside it is refused.
        assert_eq!(
            a.indices(2, &set)
                .unwrap()
                .unwrap()
                .iter()
                .filter(|&&i| i == 1)
                .count(),
            3
        );
        assert!(a.indices(2, &nodes(&[3, 4])).is_err());
        assert_eq!(a.indices(1, &set).unwrap(), None);
    }
}
