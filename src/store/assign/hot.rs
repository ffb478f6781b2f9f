//! A split layer's bindings and hot copies, and what is checked before any of it is
//! mapped: every node's memory for its block and its share of the hot copies, and the
//! mappings of them all.
//!
//! Mappings of a split layer, per kind of tensor: one per non-empty range of
//! [`PinStore::split_bindings`] (each node's block; a hybrid layer's first hot range
//! where it is interleaved apart), plus one per further hot group
//! ([`PinStore::hot_groups`] − 1) when the layer has hot experts. Ranges with different
//! policies never merge, and the regions are named apart, so this is exact (the tests
//! count it in `smaps`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use super::SlotOrder;
use crate::error::{Error, Result};
use crate::node::{Node, NodeSet};
use crate::policy::MemPolicy;
use crate::store::layout::copy_policy;
use crate::store::{LayerPlacement, LayerSpec, PinStore, arena, layer, replica};

impl PinStore {
    /// The ranges of slots of a split layer's first copy (`experts` slots over the set),
    /// each with its policy: the `i`-th node's block bound to it; a hybrid layer's hot
    /// slots inside the first node's block where the first hot group is that one node,
    /// else apart, interleaved over the group. Empty ranges are left out.
    pub(in crate::store) fn split_bindings(
        &self,
        experts: usize,
        order: Option<&SlotOrder>,
    ) -> Vec<(Range<usize>, MemPolicy)> {
        let Some(set) = self.layout.blocks() else {
            return Vec::new();
        };
        // The one arithmetic's first copy (`store::layout::placing`).
        (self.placer.split_blocks(&set, experts, order).into_iter())
            .filter(|b| b.copy == 0)
            .filter_map(|b| Some((b.slots, b.policy?)))
            .collect()
    }

    /// The groups a hybrid layer's hot experts get a copy on, the first one's first
    /// (empty: the store has no assignment). See [`HotCopies`](super::HotCopies).
    pub fn hot_groups(&self) -> &[NodeSet] {
        &self.placer.hot_groups
    }

    /// Mappings per region a layer's hot experts may add, for a whole-model check that
    /// does not name the layers: the first hot range apart, and a copy per further hot
    /// group; 0 without hot experts in the assignment.
    pub(in crate::store) fn hot_maps_bound(&self) -> usize {
        let hot = (self.options.assignment.as_ref())
            .is_some_and(|a| a.layers().any(|(_, h)| h.contains(&super::Home::Hot)));
        if !hot {
            return 0;
        }
        let apart = self.placer.hot_groups.first().is_some_and(|g| g.len() > 1);
        usize::from(apart) + self.placer.hot_groups.len().saturating_sub(1)
    }

    /// Bytes each node of a split layer's set gets: its block, its share of the first
    /// hot range where that is interleaved, and its share of its group's hot copy.
    /// The figure is the one arithmetic's (`placed`, from
    /// [`Placer::arrange`](crate::store::Placer)), every node of the set named.
    pub(in crate::store) fn split_node_bytes(
        set: &NodeSet,
        placed: &LayerPlacement,
    ) -> BTreeMap<Node, u64> {
        let mut out: BTreeMap<Node, u64> = set.iter().map(|n| (n, 0)).collect();
        out.extend(&placed.node_bytes);
        out
    }

    /// Before anything of split layer `layer` is mapped: each node of the set has the
    /// memory for its bytes ([`PinStore::split_node_bytes`], against `MemFree +
    /// Inactive(file)` as for the replicas). Passes where placement is denied or
    /// unsupported (one unplaced copy is built then).
    ///
    /// # Errors
    /// [`Error::NodeMemory`] for the nodes needing as much as the first node short of
    /// memory, with every node's need in its `what`.
    pub(in crate::store) fn check_split_memory(
        &self,
        layer: usize,
        set: &NodeSet,
        placed: &LayerPlacement,
    ) -> Result<()> {
        if crate::calls::NumaCall::Mbind.support()? != crate::calls::MempolicySupport::Available {
            return Ok(());
        }
        let needs = PinStore::split_node_bytes(set, placed);
        let mut nodes = Vec::new();
        for (&node, &need) in &needs {
            if let Some(bytes) = crate::topology::available_bytes(node)? {
                nodes.push((node, bytes, need));
            }
        }
        let Some(&(_, _, short)) = nodes.iter().find(|&&(_, bytes, need)| bytes < need) else {
            return Ok(());
        };
        let each: Vec<String> = needs.iter().map(|(n, b)| format!("{n}: {b}")).collect();
        let hot = placed.order.as_ref().map_or(0, |o| o.hot.len());
        Err(Error::NodeMemory {
            what: format!(
                "layer {layer} split over {set} with {hot} hot experts in {} groups \
                 (bytes per node {})",
                self.placer.hot_groups.len().max(1),
                each.join(", ")
            ),
            needed: short,
            available: (nodes.iter())
                .filter(|&&(_, _, need)| need == short)
                .map(|&(node, bytes, _)| (node, bytes))
                .collect(),
            figure: crate::topology::FIGURE,
        })
    }

    /// After the first copy is filled: for every hot group after the first, a region per
    /// kind holding the hot experts only, bound to the group's node or interleaved over
    /// its nodes, copied from the first copy on a thread of the group's first node.
    /// Memory and mappings are checked by `check_copies` beforehand.
    pub(in crate::store) fn build_hot_copies(
        &self,
        layer: usize,
        spec: &LayerSpec,
        first: &layer::Arenas,
        order: &SlotOrder,
    ) -> Result<replica::Built> {
        let mut built = replica::Built::default();
        let mut slot = vec![arena::ABSENT; spec.experts];
        for (k, &e) in order.hot.iter().enumerate() {
            slot[e] = k;
        }
        let slot: Arc<[usize]> = slot.into();
        let backing = arena::Backing::of(&self.options, layer);
        let align = self.options.slot_align.bytes()?;
        for group in self.placer.hot_groups.iter().skip(1) {
            let Some(lead) = group.nth(0) else { continue };
            let mut copy: layer::Arenas = Default::default();
            let policy = copy_policy(group);
            for kind in spec.kinds() {
                let _reservation = self
                    .maps
                    .reserve(|| format!("layer {layer} {} hot copy", kind.name()), 1)?;
                let arena = arena::Arena::reserve(
                    kind,
                    order.hot.len(),
                    spec.bytes(kind),
                    align,
                    &backing,
                )?
                .with_order(slot.clone());
                self.name_region(arena.region(), layer, kind)?;
                let _ = self.note_placement(arena.bind(&policy)?);
                self.mbind_calls
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                built.mbind_calls += 1;
                copy[kind.index()] = Some(arena);
            }
            // Written from the group's own CPUs (rule 12), where it has any.
            let on_node = crate::source::load::OnNode::enter(lead);
            for (to, from) in copy.iter_mut().zip(first) {
                let (Some(to), Some(from)) = (to, from) else {
                    continue;
                };
                for &e in &order.hot {
                    let n = to.copy_slot_from(from, e)?;
                    if on_node.moved() {
                        built.local_bytes += n as u64;
                    }
                }
            }
            drop(on_node);
            built.replicas.push((lead, copy));
        }
        Ok(built)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ExpertAssignment, Home, HotCopies, Layout, StoreOptions};

    const H: usize = usize::MAX;

    fn set(ids: &[usize]) -> NodeSet {
        NodeSet::from_nodes(ids.iter().copied()).unwrap()
    }

    /// A hybrid store over `nodes` with the hot groups `groups` (as the machine's domains
    /// would give them), and the slot order of its layer 0 (`homes`).
    fn store(nodes: &[usize], homes: &[usize], groups: Vec<NodeSet>) -> (PinStore, SlotOrder) {
        let ids: Vec<Node> = set(nodes).iter().collect();
        let homes_of = homes.iter().map(|&h| {
            if h == H {
                Home::Hot
            } else {
                Home::Node(ids[h])
            }
        });
        let a = ExpertAssignment::new()
            .layer(0, homes_of.collect())
            .hot_copies(HotCopies::PerDomain);
        let mut store = PinStore::new(
            Layout::SplitExperts(set(nodes)),
            StoreOptions::default().assignment(Some(a)),
        )
        .unwrap();
        // Nodes 1 and 2 need not exist to lay out and count: only the domains are faked.
        store.placer.hot_groups = groups;
        let order = store.slot_order(0, homes.len()).unwrap().unwrap();
        (store, order)
    }

    /// Mappings per region of a split layer, its hot copies included, as the placer
    /// counts them for the store's map check.
    fn maps(store: &PinStore, experts: usize, order: Option<&SlotOrder>) -> usize {
        (store.placer)
            .arrange(0, experts, [Some(1), None], order.cloned())
            .mappings
    }

    /// Two domains {0, 1} and {2}; experts 0 and 3 hot. By hand: slots node 0 [1], hot
    /// [0, 3], node 1 [2], node 2 [4, 5]; the hot range apart, interleaved over {0, 1};
    /// one more hot copy on {2}.
    #[test]
    fn per_domain_hot_ranges_bindings_maps_and_bytes() {
        let (store, order) = store(
            &[0, 1, 2],
            &[H, 0, 1, H, 2, 2],
            vec![set(&[0, 1]), set(&[2])],
        );
        assert_eq!(&order.slot[..], &[1, 0, 3, 2, 4, 5]);
        assert_eq!(order.hot_slots, 1..3);
        let bind = |n: usize| MemPolicy::Bind(set(&[n]));
        assert_eq!(
            store.split_bindings(6, Some(&order)),
            vec![
                (0..1, bind(0)),
                (3..4, bind(1)),
                (4..6, bind(2)),
                (1..3, MemPolicy::Interleave(set(&[0, 1]))),
            ]
        );
        // Per kind: 4 ranges in the first copy, 1 hot copy.
        assert_eq!(maps(&store, 6, Some(&order)), 5);
        let page = crate::page::page_size();
        let spec = LayerSpec {
            experts: 6,
            weight_bytes: page,
            scale_bytes: 1,
        };
        // Each slot two pages (weights, scales): node 0 its cold expert and half the hot
        // range, node 1 the same, node 2 its two cold ones and the whole hot copy.
        let strides = store.strides(&spec).unwrap();
        let placed = (store.placer).arrange(0, 6, strides, Some(order.clone()));
        let bytes = PinStore::split_node_bytes(&set(&[0, 1, 2]), &placed);
        let p = page as u64;
        let want: BTreeMap<Node, u64> = [(Node(0), 4 * p), (Node(1), 4 * p), (Node(2), 8 * p)]
            .into_iter()
            .collect();
        assert_eq!(bytes, want);
    }

    /// Per node (singletons): the hot range stays inside the first node's block, and
    /// every other node gets a copy.
    #[test]
    fn per_node_hot_joins_the_first_block() {
        let groups = vec![set(&[0]), set(&[1]), set(&[2])];
        let (store, order) = store(&[0, 1, 2], &[H, 0, 1, H, 2, 2], groups);
        let bind = |n: usize| MemPolicy::Bind(set(&[n]));
        assert_eq!(
            store.split_bindings(6, Some(&order)),
            vec![(0..3, bind(0)), (3..4, bind(1)), (4..6, bind(2))]
        );
        assert_eq!(maps(&store, 6, Some(&order)), 3 + 2);
        // By index, no hot: a block per node, empty ones left out.
        assert_eq!(maps(&store, 2, None), 2);
    }

    #[test]
    fn hot_groups_follow_the_shape() {
        let machine = [set(&[0, 1]), set(&[2, 3])];
        let domains = |s: &NodeSet| Ok(machine.iter().map(|d| d.intersection(s)).collect());
        let all = set(&[0, 1, 2, 3]);
        assert_eq!(
            super::super::hot_groups(HotCopies::PerDomain, all, domains).unwrap(),
            [set(&[0, 1]), set(&[2, 3])]
        );
        // Per node never asks for the domains.
        let broken = |_: &NodeSet| Err(Error::empty("domains", "test"));
        assert_eq!(
            super::super::hot_groups(HotCopies::PerNode, set(&[1, 3]), broken).unwrap(),
            [set(&[1]), set(&[3])]
        );
    }
}
