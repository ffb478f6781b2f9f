//! A plan applied to a checkpoint, nothing reserved: every tensor's class, layer and
//! layout; the dense tensors grouped (one group per class, layer and layout: a store
//! layer of one slot); and what it would cost ([`PlacementCost`]), counted from the
//! layouts alone, so that ~700 GB of DeepSeek-V3 can be priced on a laptop.

use std::collections::{BTreeMap, BTreeSet};

use super::classes::TensorClass;
use super::plan::{DenseLayout, PlacementPlan, expert_layout_text};
use crate::error::{CheckpointFault, Error, Result};
use crate::model::{
    Checkpoint, Dtype, ExpertPieces, ExpertPlan, Naming, SliceAxis, TensorInfo, TensorPiece,
    TensorSlice,
};
use crate::node::{Node, NodeSet};
use crate::store::{Layout, PieceLayout};

/// Dense tensors start at multiples of this inside their group's slot at least: GGUF's
/// default alignment is 32 and AVX-512 loads want 64.
pub const DENSE_ALIGN: usize = 64;

/// One dense group: the tensors of one class and layer under one layout, packed as the
/// single slot of one layer of that class's store.
#[derive(Debug, Clone)]
pub(crate) struct Group {
    pub(crate) class: TensorClass,
    pub(crate) layout: DenseLayout,
    /// Checkpoint tensor indices, in file then offset order (the read order).
    pub(crate) tensors: Vec<usize>,
    /// Index of its store in [`Assigned::stores`], and its layer in that store.
    pub(crate) store: usize,
    pub(crate) slot_layer: usize,
}

/// A plan applied to a checkpoint.
pub(crate) struct Assigned {
    pub(crate) naming: Option<Naming>,
    pub(crate) experts: Option<ExpertPlan>,
    /// Per checkpoint tensor: its class and model layer.
    pub(crate) class_of: Vec<(TensorClass, Option<usize>)>,
    pub(crate) groups: Vec<Group>,
    /// The dense stores: one per (class, layout) that has a group.
    pub(crate) stores: Vec<(TensorClass, DenseLayout)>,
    /// How dense tensors are laid out in their group's slot.
    pub(crate) layout: PieceLayout,
    /// The experts' congruence modulus (their store's `piece_congruence`).
    pub(crate) expert_modulus: usize,
    /// Per checkpoint tensor: the part of it this rank holds under a dense slice.
    pub(crate) cuts: Vec<Option<DenseCut>>,
}

/// The rows of a dense tensor a rank holds, as placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DenseCut {
    /// Bytes from the tensor's start, and bytes held.
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// The slice along the axis, as a view reports it.
    pub(crate) slice: super::views::DenseSlice,
}

impl Assigned {
    /// The file offset of the bytes of tensor `index` this rank holds.
    pub(crate) fn held_offset(&self, checkpoint: &Checkpoint, index: usize) -> u64 {
        let start = checkpoint.tensors()[index].offset();
        match self.cuts.get(index).copied().flatten() {
            Some(cut) => start.saturating_add(cut.offset),
            None => start,
        }
    }

    /// The bytes of tensor `index` this rank holds.
    pub(crate) fn held_len(&self, checkpoint: &Checkpoint, index: usize) -> u64 {
        match self.cuts.get(index).copied().flatten() {
            Some(cut) => cut.len,
            None => checkpoint.tensors()[index].len(),
        }
    }
}

/// The weight a block-scale grid belongs to: DeepSeek's FP8 `X.weight_scale_inv` (one
/// entry per 128×128 block of `X.weight`), when that weight exists and is 2-D.
fn scale_of<'a>(checkpoint: &'a Checkpoint, t: &TensorInfo) -> Option<&'a TensorInfo> {
    let weight = t.name().strip_suffix("_scale_inv")?;
    checkpoint
        .tensor(weight)
        .filter(|w| w.shape().len() >= 2 && t.shape().len() >= 2)
}

/// A scale grid cut where its weight's rows are cut: the weight's rows `a..b` under
/// blocks of `B` rows are the grid's rows `a/B..⌈b/B⌉`; a cut inside a block is refused
/// naming the block size (the block's scale would be shared by two ranks).
fn scale_cut(t: &TensorInfo, weight: &TensorInfo, slice: &TensorSlice) -> Result<Option<DenseCut>> {
    let Some(wcut) = dense_cut(weight, slice)? else {
        return Ok(None);
    };
    let (n, rows) = (wcut.slice.extent, super::views::normalized_shape(t)[0]);
    let block = if rows == 0 { 0 } else { n.div_ceil(rows) };
    let (start, end) = (wcut.slice.start, wcut.slice.start + wcut.slice.len);
    let on_edge = |x: u64| block > 0 && (x.is_multiple_of(block) || x == n);
    if block == 0
        || n.div_ceil(block) != rows
        || !t.len().is_multiple_of(rows)
        || !on_edge(start)
        || !on_edge(end)
    {
        return Err(Error::bad_value(
            "PlacementPlan::dense_slice",
            "tensor slice",
            slice,
            format!(
                "{} {:?}: rows {start}..{end} of its weight's {n} cut through its scale \
                 blocks of {block} rows: a cut falls on a multiple of {block} (keep the \
                 class whole with PlacementPlan::whole)",
                crate::error::quote(t.name()),
                t.shape()
            ),
        ));
    }
    let range = start / block..end.div_ceil(block);
    let stride = t.len() / rows;
    Ok(Some(DenseCut {
        offset: range.start * stride,
        len: (range.end - range.start) * stride,
        slice: super::views::DenseSlice {
            axis: SliceAxis::Rows,
            start: range.start,
            len: range.end - range.start,
            extent: rows,
        },
    }))
}

/// The rows of `t` that `slice` holds: `Ok(None)` for a 1-D (or 0-D) tensor, kept whole.
fn dense_cut(t: &TensorInfo, slice: &TensorSlice) -> Result<Option<DenseCut>> {
    let dims = super::views::normalized_shape(t);
    if dims.len() < 2 {
        return Ok(None);
    }
    let bad = |why: String| {
        Error::bad_value(
            "PlacementPlan::dense_slice",
            "tensor slice",
            slice,
            format!("{} {dims:?}: {why}", crate::error::quote(t.name())),
        )
    };
    if slice.axis() != SliceAxis::Rows {
        return Err(bad(
            "dense tensors are sliced by rows only (a column slice of a dense tensor is \
             not placed yet)"
                .into(),
        ));
    }
    let rows = dims[0];
    if rows == 0 || !t.len().is_multiple_of(rows) {
        return Err(bad(format!("{} bytes are not {rows} equal rows", t.len())));
    }
    let range = slice.resolve(rows).map_err(bad)?;
    let stride = t.len() / rows;
    Ok(Some(DenseCut {
        offset: range.start * stride,
        len: (range.end - range.start) * stride,
        slice: super::views::DenseSlice {
            axis: SliceAxis::Rows,
            start: range.start,
            len: range.end - range.start,
            extent: rows,
        },
    }))
}

/// The routed experts' naming and plan, or none for a checkpoint without experts.
fn experts_of(checkpoint: &Checkpoint) -> Result<Option<(Naming, ExpertPlan)>> {
    let naming = match Naming::detect(checkpoint) {
        Ok(n) => n,
        Err(Error::Checkpoint {
            kind: CheckpointFault::NoExperts,
            ..
        }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let plan = naming.plan(checkpoint)?;
    Ok(Some((naming, plan)))
}

/// Every tensor's bytes against its dtype and shape (the parsers check this at open; a
/// checkpoint built otherwise is checked again here, as a view trusts it).
fn check_size(checkpoint: &Checkpoint, t: &TensorInfo) -> Result<()> {
    let expected = match t.dtype() {
        Dtype::Ggml(g) => g.tensor_bytes(t.shape()),
        Dtype::Safetensors(d) => {
            let bits = t
                .shape()
                .iter()
                .try_fold(d.bits(), |acc, &n| acc.checked_mul(n))
                .ok_or_else(|| "the element count overflows 64 bits".to_owned());
            bits.and_then(|b| {
                if b % 8 == 0 {
                    Ok(b / 8)
                } else {
                    Err(format!("{b} bits are not whole bytes"))
                }
            })
        }
    };
    match expected {
        Ok(n) if n == t.len() => Ok(()),
        Ok(n) => Err(size_fault(
            checkpoint,
            t,
            format!("{} bytes, but its dtype and shape say {n}", t.len()),
        )),
        Err(why) => Err(size_fault(checkpoint, t, why)),
    }
}

fn size_fault(checkpoint: &Checkpoint, t: &TensorInfo, why: String) -> Error {
    let file = checkpoint
        .files()
        .get(t.file())
        .map(|f| f.path().display().to_string())
        .unwrap_or_default();
    Error::checkpoint(file, Some(t.name()), CheckpointFault::Size, why)
}

/// The checkpoint tensors that are pieces of routed experts (weights and scales).
fn expert_tensor_indices(experts: Option<&(Naming, ExpertPlan)>) -> BTreeSet<usize> {
    experts
        .iter()
        .flat_map(|(_, p)| p.layers())
        .flat_map(|l| l.experts())
        .flat_map(|e| e.weights().iter().chain(e.scales()))
        .map(|p| p.tensor())
        .collect()
}

/// The dense tensors keyed by (class, index in `layouts`, model layer), before grouping.
type Keyed = BTreeMap<(TensorClass, usize, Option<usize>), Vec<usize>>;

/// Every tensor classified under the plan: its class and layer, its dense cut, its
/// layout; which patterns matched a tensor.
struct Classified {
    class_of: Vec<(TensorClass, Option<usize>)>,
    cuts: Vec<Option<DenseCut>>,
    /// Per pattern of the plan: whether it matched a dense tensor.
    used: Vec<bool>,
    keyed: Keyed,
    /// The distinct dense layouts, in first-seen order.
    layouts: Vec<DenseLayout>,
}

/// Checks each tensor's size, then gives it its class and layer; a dense tensor also
/// gets its cut (under a dense slice of its class) and its layout (the plan's patterns).
fn classify_tensors(
    checkpoint: &Checkpoint,
    plan: &PlacementPlan,
    expert_tensors: &BTreeSet<usize>,
) -> Result<Classified> {
    let mut out = Classified {
        class_of: Vec::with_capacity(checkpoint.tensors().len()),
        cuts: vec![None; checkpoint.tensors().len()],
        used: vec![false; plan.patterns().len()],
        keyed: BTreeMap::new(),
        layouts: Vec::new(),
    };
    for (index, t) in checkpoint.tensors().iter().enumerate() {
        check_size(checkpoint, t)?;
        if expert_tensors.contains(&index) {
            let layer = TensorClass::of(t.name()).1;
            out.class_of.push((TensorClass::RoutedExperts, layer));
            continue;
        }
        let (class, layer) = TensorClass::of(t.name());
        out.class_of.push((class, layer));
        if let Some(slice) = plan.dense_slice.filter(|_| plan.is_sliced(class)) {
            out.cuts[index] = match scale_of(checkpoint, t) {
                Some(weight) => scale_cut(t, weight, &slice)?,
                None => dense_cut(t, &slice)?,
            };
        }
        let (layout, pattern) = plan.dense_layout(class, t.name());
        if let Some(i) = pattern {
            out.used[i] = true;
        }
        let l = match out.layouts.iter().position(|&x| x == layout) {
            Some(l) => l,
            None => {
                out.layouts.push(layout);
                out.layouts.len() - 1
            }
        };
        out.keyed.entry((class, l, layer)).or_default().push(index);
    }
    Ok(out)
}

/// Refuses a pattern the plan's text form cannot carry and a pattern that matched no
/// dense tensor (`used`, per pattern).
fn check_patterns(checkpoint: &Checkpoint, plan: &PlacementPlan, used: &[bool]) -> Result<()> {
    // The text form separates items by ',' and ';' and keys from values by '=': a
    // pattern holding one would print a plan that reads back as another (no tensor name
    // holds them).
    if let Some((pattern, _)) = plan
        .patterns()
        .iter()
        .find(|(p, _)| p.contains([',', ';', '=']))
    {
        return Err(Error::bad_value(
            "PlacementPlan",
            "name pattern",
            pattern,
            "holds ',', ';' or '=', which separate the plan's text form (patterns have `*` \
             and `?` only)",
        ));
    }
    if let Some(i) = used.iter().position(|u| !u) {
        let (pattern, _) = &plan.patterns()[i];
        return Err(Error::bad_value(
            "PlacementPlan",
            "name pattern",
            pattern,
            format!(
                "matches no dense tensor of the checkpoint ({} tensors; routed experts are \
                 placed by the experts' layout, not by patterns)",
                checkpoint.tensors().len()
            ),
        ));
    }
    Ok(())
}

/// The dense groups, one per (class, layout, layer), each the next layer of its
/// (class, layout) store, with its tensors in read order; and those stores.
fn group_dense(
    checkpoint: &Checkpoint,
    keyed: Keyed,
    layouts: &[DenseLayout],
) -> (Vec<Group>, Vec<(TensorClass, DenseLayout)>) {
    let mut stores: Vec<(TensorClass, DenseLayout)> = Vec::new();
    let mut per_store: Vec<usize> = Vec::new();
    let mut groups = Vec::with_capacity(keyed.len());
    for ((class, l, _layer), mut tensors) in keyed {
        let layout = layouts[l];
        let store = match stores.iter().position(|&s| s == (class, layout)) {
            Some(s) => s,
            None => {
                stores.push((class, layout));
                per_store.push(0);
                stores.len() - 1
            }
        };
        let t = checkpoint.tensors();
        tensors.sort_by_key(|&i| (t[i].file(), t[i].offset()));
        groups.push(Group {
            class,
            layout,
            tensors,
            store,
            slot_layer: per_store[store],
        });
        per_store[store] += 1;
    }
    (groups, stores)
}

/// Applies `plan` to `checkpoint`: classes, layouts, groups; errors for a pattern that
/// matches no dense tensor and for a tensor whose bytes are not its dtype × shape.
pub(crate) fn assign(
    checkpoint: &Checkpoint,
    plan: &PlacementPlan,
    (layout, expert_modulus): (PieceLayout, usize),
) -> Result<Assigned> {
    let mut experts = experts_of(checkpoint)?;
    let expert_tensors = expert_tensor_indices(experts.as_ref());
    let classified = classify_tensors(checkpoint, plan, &expert_tensors)?;
    check_patterns(checkpoint, plan, &classified.used)?;
    // Routed experts are recognised on the whole plan (above), then cut to the share.
    if let (Some(share), Some((_, expert_plan))) = (&plan.share, experts.as_mut()) {
        *expert_plan = expert_plan.share(checkpoint, share)?;
    }
    let (groups, stores) = group_dense(checkpoint, classified.keyed, &classified.layouts);
    let (naming, experts) = match experts {
        Some((n, p)) => (Some(n), Some(p)),
        None => (None, None),
    };
    Ok(Assigned {
        naming,
        experts,
        class_of: classified.class_of,
        groups,
        stores,
        layout,
        expert_modulus,
        cuts: classified.cuts,
    })
}

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
    /// Tensors.
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
}

fn align_up(n: u64, a: u64) -> u64 {
    n.div_ceil(a.max(1)).saturating_mul(a.max(1))
}

/// The slot extent of the non-empty pieces `(file offset, len)` laid out as the store
/// lays them out ([`PieceLayout::offset`]), rounded to the slot alignment `slot`
/// (`u64::MAX` where that overflows: no node has room for it).
pub(crate) fn slot_bytes(
    pieces: impl Iterator<Item = (u64, u64)>,
    layout: PieceLayout,
    slot: u64,
) -> u64 {
    let end = pieces
        .filter(|&(_, n)| n > 0)
        .try_fold(0usize, |at, (offset, n)| {
            let n = usize::try_from(n).ok()?;
            layout.offset(at, offset)?.checked_add(n)
        });
    end.map_or(u64::MAX, |end| align_up(end as u64, slot))
}

/// Adds `bytes` to `node`'s, saturating.
fn add(into: &mut BTreeMap<Node, u64>, node: Node, bytes: u64) {
    let at = into.entry(node).or_default();
    *at = at.saturating_add(bytes);
}

/// Adds `bytes` spread over `set` page by page (rounded up per node).
fn spread(into: &mut BTreeMap<Node, u64>, set: NodeSet, bytes: u64) {
    let n = set.len().max(1) as u64;
    for node in set.iter() {
        add(into, node, bytes.div_ceil(n));
    }
}

impl Assigned {
    /// The cost of the assignment under `plan`; `slot` is the store's slot alignment.
    pub(crate) fn cost(
        &self,
        checkpoint: &Checkpoint,
        plan: &PlacementPlan,
        slot: u64,
    ) -> PlacementCost {
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
            }
        };
        for g in &self.groups {
            let c = classes.entry(g.class).or_insert_with(|| entry(g.class));
            let copy = slot_bytes(
                g.tensors.iter().map(|&i| {
                    (
                        self.held_offset(checkpoint, i),
                        self.held_len(checkpoint, i),
                    )
                }),
                self.layout,
                slot,
            );
            one_copy = one_copy.saturating_add(copy);
            let text = g.layout.to_string();
            if !c.layout.split('+').any(|l| l == text) {
                if !c.layout.is_empty() {
                    c.layout.push('+');
                }
                c.layout.push_str(&text);
            }
            c.tensors += g.tensors.len();
            c.bytes += g
                .tensors
                .iter()
                .map(|&i| self.held_len(checkpoint, i))
                .sum::<u64>();
            c.groups += 1;
            c.mappings += g.layout.copies();
            c.mbind_calls += g.layout.mbind_calls();
            c.per_tensor_mappings += g.tensors.len() * g.layout.copies();
            match g.layout {
                // Saturating: an unreachable layout costs u64::MAX (see `slot_bytes`).
                DenseLayout::Replicate(set) => {
                    for node in set.iter() {
                        add(&mut c.node_bytes, node, copy);
                    }
                }
                DenseLayout::Interleave(set) => spread(&mut c.node_bytes, set, copy),
                DenseLayout::Bind(node) => add(&mut c.node_bytes, node, copy),
                DenseLayout::Unplaced => unbound = unbound.saturating_add(copy),
            }
        }
        if let Some(experts) = &self.experts {
            let mut c = entry(TensorClass::RoutedExperts);
            c.layout = expert_layout_text(&plan.experts);
            let layout = PieceLayout {
                align: self.layout.align,
                modulus: self.expert_modulus,
            };
            let (u, o) = expert_cost(&mut c, experts, plan.experts, layout, slot);
            unbound = unbound.saturating_add(u);
            one_copy = one_copy.saturating_add(o);
            classes.insert(TensorClass::RoutedExperts, c);
        }
        let classes: Vec<ClassCost> = classes.into_values().collect();
        let mut node_bytes = BTreeMap::new();
        for c in &classes {
            for (&n, &b) in &c.node_bytes {
                add(&mut node_bytes, n, b);
            }
        }
        PlacementCost {
            mappings: classes.iter().map(|c| c.mappings).sum(),
            mbind_calls: classes.iter().map(|c| c.mbind_calls).sum(),
            per_tensor_mappings: classes.iter().map(|c| c.per_tensor_mappings).sum(),
            classes,
            node_bytes,
            unbound_bytes: unbound,
            one_copy_bytes: one_copy,
        }
    }
}

/// The routed experts' share: per MoE layer and tensor kind (weights, scales) one region
/// per copy, split in one block per node for [`Layout::SplitExperts`]. Returns the
/// unbound bytes and one copy's bytes.
fn expert_cost(
    c: &mut ClassCost,
    experts: &ExpertPlan,
    layout: Layout,
    pieces_layout: PieceLayout,
    slot: u64,
) -> (u64, u64) {
    let (mut unbound, mut one_copy) = (0u64, 0u64);
    for layer in experts.layers() {
        let count = layer.experts().len();
        let Some(first) = layer.experts().first() else {
            continue;
        };
        c.groups += 1;
        c.tensors += count * (first.weights().len() + first.scales().len());
        c.bytes += (layer.weight_bytes() + layer.scale_bytes()) * count as u64;
        let kinds: [fn(&ExpertPieces) -> &[TensorPiece]; 2] =
            [ExpertPieces::weights, ExpertPieces::scales];
        for of in kinds {
            let pieces = of(first);
            if pieces.is_empty() {
                continue;
            }
            let extent = |e: &ExpertPieces| {
                slot_bytes(
                    of(e).iter().map(|p| (p.offset(), p.len())),
                    pieces_layout,
                    slot,
                )
            };
            // Under a congruence each expert's padding follows its own file offsets: the
            // slot is the largest; without one every expert of a layer has `first`'s.
            let stride = if pieces_layout.modulus > 1 {
                layer.experts().iter().map(extent).max().unwrap_or(0)
            } else {
                extent(first)
            };
            let bytes = stride.saturating_mul(count as u64);
            one_copy = one_copy.saturating_add(bytes);
            let per_copy_tensors = count * pieces.len();
            let (maps, calls, copies) = match layout {
                Layout::Interleave(set) => {
                    spread(&mut c.node_bytes, set, bytes);
                    (1, 1, 1)
                }
                Layout::LayerPerNode(set) => {
                    if let Some(node) = set.nth(layer.layer() % set.len().max(1)) {
                        add(&mut c.node_bytes, node, bytes);
                    }
                    (1, 1, 1)
                }
                Layout::Replicate(set) => {
                    for node in set.iter() {
                        add(&mut c.node_bytes, node, bytes);
                    }
                    (set.len(), set.len(), set.len())
                }
                Layout::ReplicateDomains(set) => {
                    // One copy per domain of the live machine, interleaved over its nodes.
                    let groups = crate::topology::Topology::get()
                        .map(|t| t.domains_within(&set))
                        .unwrap_or_else(|_| {
                            set.iter().map(|n| std::iter::once(n).collect()).collect()
                        });
                    for group in &groups {
                        spread(&mut c.node_bytes, *group, bytes);
                    }
                    (groups.len(), groups.len(), groups.len())
                }
                Layout::SplitExperts(set) => {
                    let n = set.len().max(1);
                    let mut blocks = 0;
                    for (i, node) in set.iter().enumerate() {
                        let start = |i: usize| (i * count).div_ceil(n);
                        let len = start(i + 1) - start(i);
                        if len > 0 {
                            blocks += 1;
                            add(&mut c.node_bytes, node, stride.saturating_mul(len as u64));
                        }
                    }
                    (blocks.max(1), blocks, 1)
                }
                Layout::Unplaced => {
                    unbound = unbound.saturating_add(bytes);
                    (1, 0, 1)
                }
            };
            c.mappings += maps;
            c.mbind_calls += calls;
            c.per_tensor_mappings += per_copy_tensors * copies;
        }
    }
    (unbound, one_copy)
}
