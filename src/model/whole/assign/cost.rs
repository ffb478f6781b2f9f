//! What an assignment costs ([`PlacementCost`]), counted from the layouts alone.

use std::collections::{BTreeMap, BTreeSet};

use super::Assigned;
use crate::error::Result;
use crate::model::whole::classes::TensorClass;
use crate::model::whole::plan::{PlacementPlan, expert_layout_text};
use crate::model::{Checkpoint, ExpertPieces, ExpertPlan, LayerPlan, TensorPiece};
use crate::node::{Node, NodeSet};
use crate::store::{ExpertAssignment, LayerPlacement, Layout, PieceLayout, Placer, SlotOrder};

/// What a plan costs, counted from the layouts before anything is reserved: the whole
/// checkpoint and each class.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PlacementCost {
    /// Per class with tensors, in [`TensorClass::ALL`] order.
    pub classes: Vec<ClassCost>,
    /// Mappings of every region of every copy (the map budget checks this).
    pub mappings: usize,
    /// `mbind` calls the plan makes where placement works.
    pub mbind_calls: usize,
    /// The mappings of one allocation per tensor per copy (an expert's piece of a merged
    /// tensor counts as a tensor, as engines that allocate per expert do).
    pub per_tensor_mappings: usize,
    /// Bytes each node is asked to hold (replicas, bound groups, split blocks, interleaved
    /// shares rounded up), padding included.
    pub node_bytes: BTreeMap<Node, u64>,
    /// Bytes placed on no node (unplaced layouts), padding included.
    pub unbound_bytes: u64,
    /// One copy of everything, padding included: what placement needs where it degrades
    /// (one unplaced copy is built then).
    pub one_copy_bytes: u64,
}

/// One class's share of a [`PlacementCost`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ClassCost {
    /// The class.
    pub class: TensorClass,
    /// Its layout(s) in the text form of plans; several joined by `+` where patterns
    /// moved some of its tensors.
    pub layout: String,
    /// Why it has that layout (the default plan's branch, or "chosen by the caller").
    pub why: String,
    /// Tensors of the checkpoint in the class: a tensor that holds every expert of a
    /// layer (GGUF's `ffn_*_exps`, fused safetensors) counts once.
    pub tensors: usize,
    /// Their bytes this rank holds (as in the files; a share's under a slice or an
    /// expert share).
    pub bytes: u64,
    /// Store layers: dense groups, or MoE layers for the routed experts.
    pub groups: usize,
    /// Mappings of all its copies.
    pub mappings: usize,
    /// `mbind` calls.
    pub mbind_calls: usize,
    /// One mapping per tensor per copy instead.
    pub per_tensor_mappings: usize,
    /// Bytes per node, padding included.
    pub node_bytes: BTreeMap<Node, u64>,
    /// Which slices its tensors hold, counted: `rows:0/2 ×4, columns:0/2 ×2, whole ×1`
    /// (a part `k/n` where the cut is one, else `AXIS:START:LEN`); empty where none of
    /// its tensors is cut (and for the routed experts: their roles' slices are the
    /// share's, [`ExpertPlan::share`]).
    pub slices: String,
}

fn align_up(n: u64, a: u64) -> u64 {
    n.div_ceil(a.max(1)).saturating_mul(a.max(1))
}

/// The slot extent of the non-empty pieces `(file offset, len, joined)` laid out as
/// the store lays them out ([`PieceLayout::offset`]; a joined piece right after the one
/// before), rounded to the slot alignment `slot` (`u64::MAX` where that overflows: no
/// node has room for it).
pub(crate) fn slot_bytes(
    pieces: impl Iterator<Item = (u64, u64, bool)>,
    layout: PieceLayout,
    slot: u64,
) -> u64 {
    let end = pieces
        .filter(|&(_, n, _)| n > 0)
        .try_fold((0usize, false), |(at, any), (offset, n, joined)| {
            let n = usize::try_from(n).ok()?;
            let start = if joined && any {
                at
            } else {
                layout.offset(at, offset)?
            };
            Some((start.checked_add(n)?, true))
        })
        .map(|(end, _)| end);
    end.map_or(u64::MAX, |end| align_up(end as u64, slot))
}

/// Adds `bytes` to `node`'s, saturating.
fn add(into: &mut BTreeMap<Node, u64>, node: Node, bytes: u64) {
    let at = into.entry(node).or_default();
    *at = at.saturating_add(bytes);
}

impl Assigned {
    /// The cost of the assignment under `plan`; `slot` is the store's slot alignment,
    /// `experts` the store's assignment of the routed experts (its hot copies and slot
    /// orders priced as the store packs them).
    ///
    /// # Errors
    /// An assigned home outside the experts' layout's set.
    pub(crate) fn cost(
        &self,
        checkpoint: &Checkpoint,
        plan: &PlacementPlan,
        slot: u64,
        assignment: Option<&ExpertAssignment>,
    ) -> Result<PlacementCost> {
        let mut classes: BTreeMap<TensorClass, ClassCost> = BTreeMap::new();
        let mut unbound = 0u64;
        let mut one_copy = 0u64;
        let entry = |class: TensorClass| -> ClassCost {
            ClassCost {
                class,
                layout: String::new(),
                why: plan.why(class).to_owned(),
                tensors: 0,
                bytes: 0,
                groups: 0,
                mappings: 0,
                mbind_calls: 0,
                per_tensor_mappings: 0,
                node_bytes: BTreeMap::new(),
                slices: String::new(),
            }
        };
        let mut slices: BTreeMap<TensorClass, BTreeMap<String, usize>> = BTreeMap::new();
        for g in &self.groups {
            let c = classes.entry(g.class).or_insert_with(|| entry(g.class));
            let counts = slices.entry(g.class).or_default();
            let (copy, u) = self.group_cost(c, counts, g, checkpoint, slot);
            one_copy = one_copy.saturating_add(copy);
            unbound = unbound.saturating_add(u);
        }
        if let Some(experts) = &self.experts {
            let mut c = entry(TensorClass::RoutedExperts);
            c.layout = expert_layout_text(&plan.experts);
            if self.roles > 1 {
                // Each role's experts back to back: what the mappings count says.
                c.layout = format!("{} role-major x{}", c.layout, self.roles);
            }
            let layout = PieceLayout {
                align: self.layout.align,
                modulus: self.expert_modulus,
            };
            // Role-major: the store's R × E slots of one piece each, in runs.
            let experts = &crate::model::whole::role_major::role_major_plan(experts, self.roles);
            let placed = (plan.experts, assignment, self.roles);
            let (u, o) = expert_cost(&mut c, experts, placed, layout, slot)?;
            unbound = unbound.saturating_add(u);
            one_copy = one_copy.saturating_add(o);
            classes.insert(TensorClass::RoutedExperts, c);
        }
        describe_slices(&mut classes, slices);
        let classes: Vec<ClassCost> = classes.into_values().collect();
        let mut node_bytes = BTreeMap::new();
        for c in &classes {
            for (&n, &b) in &c.node_bytes {
                add(&mut node_bytes, n, b);
            }
        }
        Ok(PlacementCost {
            mappings: classes.iter().map(|c| c.mappings).sum(),
            mbind_calls: classes.iter().map(|c| c.mbind_calls).sum(),
            per_tensor_mappings: classes.iter().map(|c| c.per_tensor_mappings).sum(),
            classes,
            node_bytes,
            unbound_bytes: unbound,
            one_copy_bytes: one_copy,
        })
    }
}

impl Assigned {
    /// Adds dense group `g` to its class's cost `c` (and its tensors' slices to
    /// `counts`); returns one copy's bytes and the bytes left unbound.
    fn group_cost(
        &self,
        c: &mut ClassCost,
        counts: &mut BTreeMap<String, usize>,
        g: &super::Group,
        checkpoint: &Checkpoint,
        slot: u64,
    ) -> (u64, u64) {
        let copy = if g.converted {
            // Packed from memory as one piece: the converted bytes laid out at 64.
            let held = g
                .tensors
                .iter()
                .filter(|&&i| !checkpoint.tensors[i].is_empty());
            let (_, total) = super::converted_layout(held.map(|&i| self.held_len(checkpoint, i)));
            slot_bytes(std::iter::once((0, total, false)), self.layout, slot)
        } else {
            slot_bytes(
                g.tensors
                    .iter()
                    .flat_map(|&i| self.held_pieces(checkpoint, i)),
                self.layout,
                slot,
            )
        };
        let text = g.layout.to_string();
        if !c.layout.split('+').any(|l| l == text) {
            if !c.layout.is_empty() {
                c.layout.push('+');
            }
            c.layout.push_str(&text);
        }
        c.tensors += g.tensors.len();
        for &i in &g.tensors {
            *counts.entry(self.slice_text(i)).or_default() += 1;
        }
        c.bytes += g
            .tensors
            .iter()
            .map(|&i| self.held_len(checkpoint, i))
            .sum::<u64>();
        // Empty tensors are never packed (`place` skips them), and a group of empty
        // tensors only costs no mapping and no `mbind`.
        let held = g
            .tensors
            .iter()
            .filter(|&&i| !checkpoint.tensors[i].is_empty())
            .count();
        if held == 0 {
            return (copy, 0);
        }
        c.groups += 1;
        // A dense group is one region of one slot, placed as its store places it.
        let placer = Placer::with_domains(g.layout.store_layout(), None, live_domains);
        let placed = placer.arrange(0, 1, [Some(copy), None], None);
        c.per_tensor_mappings += held * placed.copies;
        let unbound = absorb(c, &placed);
        (copy, unbound)
    }
}

/// The domains of `set` on this machine, as the store reads them; one per node where
/// the topology cannot be read (the dry run still answers).
fn live_domains(set: &NodeSet) -> Vec<NodeSet> {
    crate::topology::Topology::get()
        .map(|t| t.domains_within(set))
        .unwrap_or_else(|_| set.iter().map(|n| std::iter::once(n).collect()).collect())
}

/// Adds one layer's placement to its class's cost; returns its unbound bytes.
fn absorb(c: &mut ClassCost, placed: &LayerPlacement) -> u64 {
    c.mappings += placed.mappings;
    c.mbind_calls += placed.mbind_calls;
    for (&node, &bytes) in &placed.node_bytes {
        add(&mut c.node_bytes, node, bytes);
    }
    placed.unbound_bytes
}

/// Each class's slices in words (`rows:0/2 ×3, whole ×2`), where any tensor is cut.
fn describe_slices(
    classes: &mut BTreeMap<TensorClass, ClassCost>,
    slices: BTreeMap<TensorClass, BTreeMap<String, usize>>,
) {
    for (class, counts) in slices {
        if let Some(c) = classes.get_mut(&class)
            && counts.keys().any(|k| k != "whole")
        {
            // Cut tensors first (`rows:…`, `columns:…` sort before `whole`).
            let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
            c.slices = parts.join(", ");
        }
    }
}

impl Assigned {
    /// The slice dense tensor `index` holds, in the text form: `rows:1/2` where the cut
    /// is the k-th of n equal parts, else `rows:START:LEN`; `whole`.
    fn slice_text(&self, index: usize) -> String {
        let Some(cut) = self.cuts.get(index).copied().flatten() else {
            return "whole".to_owned();
        };
        let s = cut.slice;
        let axis = s.axis.name();
        if s.len > 0 && s.extent.is_multiple_of(s.len) && s.start.is_multiple_of(s.len) {
            format!("{axis}:{}/{}", s.start / s.len, s.extent / s.len)
        } else {
            format!("{axis}:{}:{}", s.start, s.len)
        }
    }
}

/// The checkpoint tensors a MoE layer's experts come from: a tensor holding every expert
/// of the layer (GGUF's `ffn_*_exps`, fused safetensors) counts once, as in the
/// checkpoint's count, not once per expert.
fn tensors_of(layer: &LayerPlan) -> usize {
    let tensors: BTreeSet<usize> = layer
        .experts()
        .iter()
        .flat_map(|e| e.weights().iter().chain(e.scales()))
        .map(TensorPiece::tensor)
        .collect();
    tensors.len()
}

/// The routed experts' share: per MoE layer, the store's placement of its regions (one
/// per tensor kind per copy, split in blocks for [`Layout::SplitExperts`]) by the one
/// arithmetic ([`Placer`]), with the hot copies and slot order of `assignment` where
/// it names the layer. Returns the unbound bytes and one copy's bytes.
fn expert_cost(
    c: &mut ClassCost,
    experts: &ExpertPlan,
    (layout, assignment, roles): (Layout, Option<&ExpertAssignment>, usize),
    pieces_layout: PieceLayout,
    slot: u64,
) -> Result<(u64, u64)> {
    let hot = assignment.map(ExpertAssignment::hot_copy_shape);
    let placer = Placer::with_domains(layout, hot, live_domains).role_major(roles);
    let (mut unbound, mut one_copy) = (0u64, 0u64);
    for layer in experts.layers() {
        let order = match assignment {
            Some(a) => a.slot_order(layout, layer.layer(), layer.experts().len())?,
            None => None,
        };
        let Some(placed) = expert_placement(&placer, layer, pieces_layout, slot, order) else {
            continue;
        };
        let count = layer.experts().len();
        c.groups += 1;
        c.tensors += tensors_of(layer);
        c.bytes += (layer.weight_bytes() + layer.scale_bytes()) * count as u64;
        let first = &layer.experts()[0];
        let pieces = first.weights().len() + first.scales().len();
        c.per_tensor_mappings += count * pieces * placed.copies;
        one_copy = one_copy.saturating_add(placed.one_copy_bytes);
        unbound = unbound.saturating_add(absorb(c, &placed));
    }
    Ok((unbound, one_copy))
}

/// Where the store puts MoE layer `layer`'s experts under `placer` (`None`: the layer has
/// none): each kind's slot stride from its pieces as the store lays them out; `order`
/// an assignment's slot order (`None`: by index).
pub(crate) fn expert_placement(
    placer: &Placer,
    layer: &LayerPlan,
    pieces_layout: PieceLayout,
    slot: u64,
    order: Option<SlotOrder>,
) -> Option<LayerPlacement> {
    let first = layer.experts().first()?;
    let kinds: [fn(&ExpertPieces) -> &[TensorPiece]; 2] =
        [ExpertPieces::weights, ExpertPieces::scales];
    let strides = kinds.map(|of| {
        if of(first).is_empty() {
            return None;
        }
        let extent = |e: &ExpertPieces| {
            slot_bytes(
                of(e).iter().map(|p| (p.offset(), p.len(), false)),
                pieces_layout,
                slot,
            )
        };
        // Under a congruence each expert's padding follows its own file offsets: the
        // slot is the largest; without one every expert of a layer has `first`'s.
        Some(if pieces_layout.modulus > 1 {
            layer.experts().iter().map(extent).max().unwrap_or(0)
        } else {
            extent(first)
        })
    });
    Some(placer.arrange(layer.layer(), layer.experts().len(), strides, order))
}
