//! The one arithmetic of placement (design rule 19): from a layout (and, for a split
//! layout, an assignment), a layer's expert count and slot strides, and the machine's
//! domains, the blocks a layer becomes — each a range of slots of one copy with its policy
//! — the bytes each node holds, the mappings and the `mbind` calls.
//!
//! Three callers ask it and derive nothing themselves: the store places each layer by its
//! blocks and checks memory and mappings by its figures (`pack.rs`), the dry run
//! ([`Checkpoint::placement_cost`](crate::model::Checkpoint::placement_cost)) adds up its
//! figures per class, and the planner's rows
//! ([`planner::plan`](crate::planner::plan)) take their bytes per node and mappings from
//! it. A new layout is written here (and in the decisions of [`Layout`]) once.

use std::collections::BTreeMap;
use std::ops::Range;

use super::{Layout, block, copy_policy};
use crate::error::Result;
use crate::node::{Node, NodeSet};
use crate::policy::MemPolicy;
use crate::store::assign::{HotCopies, SlotOrder, hot_groups};

#[cfg(test)]
thread_local! {
    /// Every answer [`Placer::arrange`] gave on this thread, for the test that the
    /// store, the dry run and the planner take their figures from it
    /// (`planner::agree`).
    pub(crate) static ARRANGED: std::cell::RefCell<Vec<LayerPlacement>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A layout on a machine: the copies it makes and, for a hybrid split, the groups its hot
/// experts get a copy on. Made once (the domains are read then), asked per layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placer {
    layout: Layout,
    /// The nodes of each copy ([`Layout::copy_groups`]; empty: one copy).
    pub(crate) copy_groups: Vec<NodeSet>,
    /// The groups a hybrid layer's hot experts get a copy on (empty: no assignment).
    pub(crate) hot_groups: Vec<NodeSet>,
    /// Runs of experts per layer ([`StoreOptions::role_major`](crate::store::StoreOptions::role_major); 1: a slot per
    /// expert).
    pub(crate) roles: usize,
}

/// One range of slots of one copy of a layer, bound under one policy: each region of the
/// copy (one per kind) gets the same range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Block {
    /// The copy: 0 the first (every expert), then the replicas or a hybrid layer's hot
    /// copies (their slots count the hot experts only).
    pub(crate) copy: usize,
    /// The slots, in the copy's slot order.
    pub(crate) slots: Range<usize>,
    /// The policy (`None`: unplaced).
    pub(crate) policy: Option<MemPolicy>,
    /// Whether the block is the whole region, bound in one call over all of it.
    pub(crate) whole: bool,
}

/// Where one layer's bytes go and what that costs: [`Placer::layer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LayerPlacement {
    /// Every block of every copy, the first copy's first.
    pub(crate) blocks: Vec<Block>,
    /// The assignment's slot order of the first copy (`None`: by index).
    pub(crate) order: Option<SlotOrder>,
    /// Copies of the layer (replicas; a hybrid layer's hot copies are not whole copies
    /// and not counted).
    pub(crate) copies: usize,
    /// Regions per copy: one per kind with a stride.
    pub(crate) kinds: usize,
    /// Bytes each node is asked to hold, padding included (an interleaved block's share
    /// rounded up per node and region).
    pub(crate) node_bytes: BTreeMap<Node, u64>,
    /// Bytes placed on no node (unplaced).
    pub(crate) unbound_bytes: u64,
    /// Bytes of one whole copy.
    pub(crate) one_copy_bytes: u64,
    /// Mappings of every region of every copy: a region per kind per copy, split in one
    /// mapping per block.
    pub(crate) mappings: usize,
    /// `mbind` calls where placement works: one per bound block per region.
    pub(crate) mbind_calls: usize,
}

impl Placer {
    /// `layout` on a machine whose domains `domains` reads (a set grouped by domain, asked
    /// only for [`Layout::ReplicateDomains`] and [`HotCopies::PerDomain`]); `hot` the
    /// shape of a hybrid assignment's hot copies (`None`: no assignment).
    ///
    /// # Errors
    /// As `domains`.
    pub(crate) fn new(
        layout: Layout,
        hot: Option<HotCopies>,
        domains: impl Fn(&NodeSet) -> Result<Vec<NodeSet>>,
    ) -> Result<Placer> {
        let copy_groups = layout.copy_groups(&domains)?;
        let hot_groups = match (hot, layout.blocks()) {
            (Some(shape), Some(set)) => hot_groups(shape, set, &domains)?,
            _ => Vec::new(),
        };
        Ok(Placer {
            layout,
            copy_groups,
            hot_groups,
            roles: 1,
        })
    }

    /// [`Placer::new`] with a domain reader that cannot fail (a described machine's, or
    /// the live one's with a fallback).
    pub(crate) fn with_domains(
        layout: Layout,
        hot: Option<HotCopies>,
        domains: impl Fn(&NodeSet) -> Vec<NodeSet>,
    ) -> Placer {
        let read = |set: &NodeSet| Ok(domains(set));
        Placer {
            layout,
            copy_groups: layout.copy_groups(read).unwrap_or_default(),
            hot_groups: match (hot, layout.blocks()) {
                (Some(shape), Some(set)) => hot_groups(shape, set, read).unwrap_or_default(),
                _ => Vec::new(),
            },
            roles: 1,
        }
    }

    /// The placer with role-major slots: each layer's slots are `roles` runs of its
    /// experts (see [`StoreOptions::role_major`](crate::store::StoreOptions::role_major)).
    pub(crate) fn role_major(mut self, roles: usize) -> Placer {
        self.roles = roles.max(1);
        self
    }

    /// The experts of a layer of `slots` slots and the runs they come in: `(slots, 1)`
    /// unless the slots are role-major and divide into the runs (no slots are one run:
    /// `roles` runs of nothing walked `roles` times, a hang for `usize::MAX`).
    pub(crate) fn runs(&self, slots: usize) -> (usize, usize) {
        match self.roles {
            r if r > 1 && slots > 0 && slots.is_multiple_of(r) => (slots / r, r),
            _ => (slots, 1),
        }
    }

    /// `layout` on the live machine: its domains as the store reads them
    /// ([`Topology::domains_within`](crate::topology::Topology::domains_within)).
    ///
    /// # Errors
    /// [`Layout::ReplicateDomains`] or per-domain hot copies where the topology cannot be
    /// read.
    pub(crate) fn live(layout: Layout, hot: Option<HotCopies>) -> Result<Placer> {
        Placer::new(layout, hot, |set| {
            Ok(crate::topology::Topology::get()?.domains_within(set))
        })
    }

    /// Where the bytes of layer `layer` go and what that costs: `experts` slots, each
    /// kind's slot stride (weights, scales; `None` where the layer has no region of that
    /// kind), and a split layer's slot order under an assignment (`None`: by index). The
    /// one arithmetic the store, the dry run and the planner ask.
    pub(crate) fn arrange(
        &self,
        layer: usize,
        experts: usize,
        strides: [Option<u64>; 2],
        order: Option<SlotOrder>,
    ) -> LayerPlacement {
        let out = self.compute(layer, experts, strides, order);
        #[cfg(test)]
        ARRANGED.with(|a| a.borrow_mut().push(out.clone()));
        out
    }

    /// The mappings [`Placer::arrange`] counts for a layer of `experts` by index whose
    /// kinds with a region are `kinds` (weights, scales): what a whole-model budget
    /// check asks before any layer is named.
    pub(crate) fn mappings(&self, experts: usize, kinds: [bool; 2]) -> usize {
        let strides = kinds.map(|k| k.then_some(1));
        self.compute(0, experts, strides, None).mappings
    }

    fn compute(
        &self,
        layer: usize,
        experts: usize,
        strides: [Option<u64>; 2],
        order: Option<SlotOrder>,
    ) -> LayerPlacement {
        let blocks = match self.layout.blocks() {
            Some(set) => self.split_blocks(&set, experts, order.as_ref()),
            None => self.copy_blocks(layer, experts),
        };
        let kinds = strides.iter().flatten().count();
        let mut out = LayerPlacement {
            copies: self.copy_groups.len().max(1),
            kinds,
            node_bytes: BTreeMap::new(),
            unbound_bytes: 0,
            one_copy_bytes: 0,
            mappings: 0,
            mbind_calls: 0,
            blocks,
            order,
        };
        let copies = out.blocks.iter().map(|b| b.copy + 1).max().unwrap_or(1);
        for copy in 0..copies {
            let n = out.blocks.iter().filter(|b| b.copy == copy).count();
            out.mappings = out.mappings.saturating_add(kinds.saturating_mul(n.max(1)));
        }
        for &stride in strides.iter().flatten() {
            let copy = stride.saturating_mul(experts as u64);
            out.one_copy_bytes = out.one_copy_bytes.saturating_add(copy);
            for b in &out.blocks {
                let bytes = stride.saturating_mul(b.slots.len() as u64);
                match &b.policy {
                    Some(MemPolicy::Bind(group) | MemPolicy::Interleave(group)) => {
                        out.mbind_calls += 1;
                        let share = bytes.div_ceil(group.len().max(1) as u64);
                        for node in group.iter() {
                            let at = out.node_bytes.entry(node).or_default();
                            *at = at.saturating_add(share);
                        }
                    }
                    Some(_) => out.mbind_calls += 1,
                    None => out.unbound_bytes = out.unbound_bytes.saturating_add(bytes),
                }
            }
        }
        out
    }

    /// The blocks of a layout that binds each region whole: one per copy.
    fn copy_blocks(&self, layer: usize, experts: usize) -> Vec<Block> {
        let whole = |copy: usize, policy: Option<MemPolicy>| Block {
            copy,
            slots: 0..experts,
            policy,
            whole: true,
        };
        let first = whole(0, self.layout.region_policy(layer, &self.copy_groups));
        std::iter::once(first)
            .chain(
                (self.copy_groups.iter().enumerate().skip(1))
                    .map(|(copy, group)| whole(copy, Some(copy_policy(group)))),
            )
            .collect()
    }

    /// A split layer's blocks: in the first copy the `i`-th node's block bound to it (a
    /// hybrid layer's hot slots inside the first node's block where the first hot group
    /// is that one node, else apart, interleaved over the group), empty ones left out;
    /// then one copy of the hot slots per further hot group.
    pub(crate) fn split_blocks(
        &self,
        set: &NodeSet,
        experts: usize,
        order: Option<&SlotOrder>,
    ) -> Vec<Block> {
        let bind = |n: Node| MemPolicy::Bind(std::iter::once(n).collect());
        let bound = |copy: usize, slots: Range<usize>, policy: MemPolicy| Block {
            copy,
            slots,
            policy: Some(policy),
            whole: false,
        };
        let mut out: Vec<Block> = match order {
            None => {
                // Role-major: each run of the experts split in the node blocks, a block
                // merged with the one before where both are on one node (one node: the
                // runs are one block, as the kernel merges them).
                let (per, runs) = self.runs(experts);
                let mut out: Vec<Block> = Vec::new();
                for run in 0..runs {
                    for (i, node) in set.iter().enumerate() {
                        let b = block(i, set.len(), per);
                        let slots = run * per + b.start..run * per + b.end;
                        match out.last_mut() {
                            Some(last)
                                if last.slots.end == slots.start
                                    && last.policy == Some(bind(node)) =>
                            {
                                last.slots.end = slots.end;
                            }
                            _ if slots.is_empty() => {}
                            _ => out.push(bound(0, slots, bind(node))),
                        }
                    }
                }
                out
            }
            Some(order) => {
                let apart =
                    (self.hot_groups.first()).filter(|g| g.len() > 1 && !order.hot.is_empty());
                let mut out: Vec<Block> = (set.iter().zip(&order.blocks).enumerate())
                    .map(|(i, (node, slots))| match apart {
                        Some(_) if i == 0 => {
                            bound(0, slots.start..order.hot_slots.start, bind(node))
                        }
                        _ => bound(0, slots.clone(), bind(node)),
                    })
                    .collect();
                if let Some(group) = apart {
                    out.push(bound(0, order.hot_slots.clone(), copy_policy(group)));
                }
                if !order.hot.is_empty() {
                    for (copy, group) in self.hot_groups.iter().enumerate().skip(1) {
                        out.push(bound(copy, 0..order.hot.len(), copy_policy(group)));
                    }
                }
                out
            }
        };
        out.retain(|b| !b.slots.is_empty());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[usize]) -> NodeSet {
        NodeSet::from_nodes(ids.iter().copied()).unwrap()
    }

    fn split(ids: &[usize], roles: usize) -> Placer {
        Placer::with_domains(Layout::SplitExperts(set(ids)), None, |s| vec![*s]).role_major(roles)
    }

    /// Role-major slots under a split: each run of the experts in the node blocks, the
    /// cost `roles × blocks` per region on several nodes, one block on one node; a
    /// slot per expert is the split by index, unchanged.
    #[test]
    fn role_major_runs_cost_a_block_per_run_and_node() {
        let strides = [Some(8192), Some(4096)];
        // 6 experts × 3 roles over 3 nodes: runs of 6, blocks of 2.
        let placed = split(&[0, 1, 2], 3).arrange(0, 18, strides, None);
        let slots: Vec<(Range<usize>, Option<MemPolicy>)> = (placed.blocks.iter())
            .map(|b| (b.slots.clone(), b.policy))
            .collect();
        let bind = |n: u16| Some(MemPolicy::Bind(std::iter::once(Node(n)).collect()));
        let mut want = Vec::new();
        for run in 0..3 {
            for node in 0..3u16 {
                let at = run * 6 + 2 * node as usize;
                want.push((at..at + 2, bind(node)));
            }
        }
        assert_eq!(slots, want);
        assert_eq!((placed.mappings, placed.mbind_calls), (18, 18));
        for node in 0..3u16 {
            // 3 roles × 2 experts × (weights + scales) on each node.
            assert_eq!(placed.node_bytes[&Node(node)], 6 * (8192 + 4096));
        }
        // A slot per expert: n blocks, as before.
        let by_index = split(&[0, 1, 2], 1).arrange(0, 18, strides, None);
        assert_eq!((by_index.mappings, by_index.mbind_calls), (6, 6));
        // One node: the runs are one block (the kernel merges them too).
        let one = split(&[1], 3).arrange(0, 18, strides, None);
        assert_eq!(one.blocks.len(), 1);
        assert_eq!(one.blocks[0].slots, 0..18);
        assert_eq!((one.mappings, one.mbind_calls), (2, 2));
        // Fewer experts than nodes: empty blocks left out, neighbours on one node merged.
        let few = split(&[0, 1, 2], 2).arrange(0, 4, [Some(4096), None], None);
        let nodes: Vec<_> = few
            .blocks
            .iter()
            .map(|b| (b.slots.clone(), b.policy))
            .collect();
        assert_eq!(
            nodes,
            [
                (0..1, bind(0)),
                (1..2, bind(1)),
                (2..3, bind(0)),
                (3..4, bind(1))
            ]
        );
        // Slots that do not divide into the runs: by index (the store refuses them).
        assert_eq!(split(&[0, 1, 2], 4).runs(18), (18, 1));
        assert_eq!(split(&[0, 1, 2], 3).runs(18), (6, 3));
        assert_eq!(split(&[0, 1, 2], usize::MAX).runs(0), (0, 1));
    }
}
