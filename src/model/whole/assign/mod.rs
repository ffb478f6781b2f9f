//! A plan applied to a checkpoint, nothing reserved: every tensor's class, layer and
//! layout; the dense tensors grouped (one group per class, layer and layout: a store
//! layer of one slot); and what it would cost ([`PlacementCost`]), counted from the
//! layouts alone, so that ~700 GB of DeepSeek-V3 can be priced on a laptop.
//!
//! `cut` holds a dense slice's rows per tensor, `cost` the pricing.

mod cost;
mod cut;

pub use cost::{ClassCost, PlacementCost};

use std::collections::{BTreeMap, BTreeSet};

use super::classes::TensorClass;
use super::convert::{Conversion, conversion_of};
use super::glob::glob_match;
use super::plan::{DenseLayout, PlacementPlan};
use crate::error::{CheckpointFault, Error, Result, quote, quote_list};
use crate::model::slice::Run;
use crate::model::{Checkpoint, Dtype, ExpertPlan, Naming, TensorInfo};
use crate::store::PieceLayout;
use cut::{dense_cut, scale_cut, scale_of};

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
    /// Its tensors are converted at placement (packed from memory, not read in place).
    pub(crate) converted: bool,
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
    /// Per checkpoint tensor: its conversion at placement.
    pub(crate) converts: Vec<Option<Conversion>>,
    /// The experts' role-major runs (1: a slot per expert; `role_major::roles_for`).
    pub(crate) roles: usize,
}

/// The part of a dense tensor a rank holds, as placed: its rows (one piece) or its
/// columns (one piece per row, laid out back to back in the slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DenseCut {
    /// The bytes held, from the tensor's start.
    pub(crate) run: Run,
    /// The slice along the axis, as a view reports it.
    pub(crate) slice: super::shape::DenseSlice,
}

impl Assigned {
    /// The pieces of tensor `index` this rank holds: `(file offset, len, joined)`, the
    /// pieces after the first of a column cut joined to the one before (no padding).
    pub(crate) fn held_pieces(
        &self,
        checkpoint: &Checkpoint,
        index: usize,
    ) -> impl Iterator<Item = (u64, u64, bool)> {
        let t = &checkpoint.tensors()[index];
        let run = match self.cuts.get(index).copied().flatten() {
            Some(cut) => cut.run,
            None => Run {
                offset: 0,
                len: t.len(),
                count: 1,
                stride: 0,
            },
        };
        let start = t.offset();
        (0..run.count).map(move |r| {
            let at = run.offset.saturating_add(r.saturating_mul(run.stride));
            (start.saturating_add(at), run.len, r > 0)
        })
    }

    /// The bytes of tensor `index` this rank holds (placed: a converted tensor's in
    /// its new dtype).
    pub(crate) fn held_len(&self, checkpoint: &Checkpoint, index: usize) -> u64 {
        let len = match self.cuts.get(index).copied().flatten() {
            Some(cut) => cut.run.bytes(),
            None => checkpoint.tensors()[index].len(),
        };
        match self.converts.get(index).copied().flatten() {
            Some(c) => c.placed_len(len),
            None => len,
        }
    }
}

/// The routed experts' naming and plan, or none for a checkpoint without experts.
pub(crate) fn experts_of(checkpoint: &Checkpoint) -> Result<Option<(Naming, ExpertPlan)>> {
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
pub(crate) fn expert_tensor_indices(experts: Option<&(Naming, ExpertPlan)>) -> BTreeSet<usize> {
    experts
        .iter()
        .flat_map(|(_, p)| p.layers())
        .flat_map(|l| l.experts())
        .flat_map(|e| e.weights().iter().chain(e.scales()))
        .map(|p| p.tensor())
        .collect()
}

/// The dense tensors keyed by (class, index in `layouts`, model layer, converted),
/// before grouping.
type Keyed = BTreeMap<(TensorClass, usize, Option<usize>, bool), Vec<usize>>;

/// Every tensor classified under the plan: its class and layer, its dense cut, its
/// layout; which patterns matched a tensor.
struct Classified {
    class_of: Vec<(TensorClass, Option<usize>)>,
    cuts: Vec<Option<DenseCut>>,
    converts: Vec<Option<Conversion>>,
    /// Per conversion pattern of the plan: whether it matched a dense tensor.
    converts_used: Vec<bool>,
    /// Per pattern of the plan: whether it matched a dense tensor.
    used: Vec<bool>,
    /// Per slice pattern of the plan: whether it matched a dense tensor.
    slices_used: Vec<bool>,
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
        converts: vec![None; checkpoint.tensors().len()],
        converts_used: vec![false; plan.convert_patterns.len()],
        used: vec![false; plan.patterns().len()],
        slices_used: vec![false; plan.slice_patterns.len()],
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
        // An FP8 scale grid is cut where its weight is, so it takes its weight's slice.
        let weight = scale_of(checkpoint, t);
        let chosen = plan.slice_for(class, weight.map_or(t.name(), |w| w.name()));
        if let Some((slice, explicit, pattern)) = chosen {
            if let Some(i) = pattern {
                out.slices_used[i] = true;
            }
            out.cuts[index] = match weight {
                Some(weight) => scale_cut(t, weight, &slice)?,
                None => dense_cut(t, &slice, explicit)?,
            };
        }
        if let Some((dtype, pattern)) = plan.convert_for(class, t.name()) {
            if let Some(i) = pattern {
                out.converts_used[i] = true;
            }
            let glob = pattern.map(|i| plan.convert_patterns[i].0.as_str());
            let sliced = out.cuts[index].is_some();
            out.converts[index] = conversion_of(t.name(), class, (t.dtype(), dtype), glob, sliced)?;
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
        let converted = out.converts[index].is_some();
        out.keyed
            .entry((class, l, layer, converted))
            .or_default()
            .push(index);
    }
    Ok(out)
}

/// Refuses a pattern that chose no dense tensor (`classified.used`, per pattern).
fn check_patterns(
    checkpoint: &Checkpoint,
    plan: &PlacementPlan,
    classified: &Classified,
) -> Result<()> {
    let Some(i) = classified.used.iter().position(|u| !u) else {
        return Ok(());
    };
    let patterns: Vec<&str> = plan.patterns().iter().map(|(p, _)| p.as_str()).collect();
    let names = dense_tensors(checkpoint, classified).map(|t| t.name());
    Err(unchosen(
        ("PlacementPlan", "placed by the experts' layout"),
        &patterns,
        i,
        names,
        checkpoint.tensors().len(),
    ))
}

/// Refuses a slice pattern that chose no dense tensor (`classified.slices_used`).
fn check_slice_patterns(
    checkpoint: &Checkpoint,
    plan: &PlacementPlan,
    classified: &Classified,
) -> Result<()> {
    let Some(i) = classified.slices_used.iter().position(|u| !u) else {
        return Ok(());
    };
    let patterns: Vec<&str> = plan
        .slice_patterns
        .iter()
        .map(|(p, _)| p.as_str())
        .collect();
    // An FP8 scale grid is matched by its weight's name, as `classify_tensors` does.
    let names = dense_tensors(checkpoint, classified)
        .map(|t| scale_of(checkpoint, t).map_or(t.name(), |w| w.name()));
    Err(unchosen(
        ("PlacementPlan::slice_pattern", "sliced by the expert share"),
        &patterns,
        i,
        names,
        checkpoint.tensors().len(),
    ))
}

/// Refuses a conversion of the routed experts' class and a conversion pattern that
/// chose no dense tensor (`classified.converts_used`).
fn check_conversions(
    checkpoint: &Checkpoint,
    plan: &PlacementPlan,
    classified: &Classified,
) -> Result<()> {
    if let Some((_, dtype)) = plan
        .convert_classes
        .iter()
        .find(|(c, _)| *c == TensorClass::RoutedExperts)
    {
        return Err(Error::bad_value(
            "PlacementPlan::convert_class",
            "class",
            TensorClass::RoutedExperts,
            format!(
                "the routed experts are placed by the expert store, not converted (to {dtype})"
            ),
        ));
    }
    let Some(i) = classified.converts_used.iter().position(|u| !u) else {
        return Ok(());
    };
    let patterns: Vec<&str> = plan
        .convert_patterns
        .iter()
        .map(|(p, _)| p.as_str())
        .collect();
    let names = dense_tensors(checkpoint, classified).map(|t| t.name());
    Err(unchosen(
        ("PlacementPlan::convert_pattern", "not converted"),
        &patterns,
        i,
        names,
        checkpoint.tensors().len(),
    ))
}

/// The tensors of the checkpoint that are not routed experts.
fn dense_tensors<'a>(
    checkpoint: &'a Checkpoint,
    classified: &'a Classified,
) -> impl Iterator<Item = &'a TensorInfo> {
    checkpoint
        .tensors()
        .iter()
        .zip(&classified.class_of)
        .filter(|(_, (class, _))| *class != TensorClass::RoutedExperts)
        .map(|(t, _)| t)
}

/// The error for pattern `i` of `patterns` (the last matching wins), which chose none of
/// the dense tensors `names`: it matches none of them, or each one it matches is claimed
/// by a later pattern (named, so that the caller can reorder them). `op` refuses;
/// `experts` says what places or slices routed experts instead of patterns.
fn unchosen<'a>(
    (op, experts): (&'static str, &str),
    patterns: &[&str],
    i: usize,
    names: impl Iterator<Item = &'a str>,
    tensors: usize,
) -> Error {
    let mut matched = 0usize;
    let mut claimed_by: BTreeSet<usize> = BTreeSet::new();
    for name in names.filter(|n| glob_match(patterns[i], n)) {
        matched += 1;
        if let Some(j) = patterns.iter().rposition(|p| glob_match(p, name)) {
            claimed_by.insert(j);
        }
    }
    let why = if matched == 0 {
        format!(
            "matches no dense tensor of the checkpoint ({tensors} tensors; routed experts are \
             {experts}, not by patterns)"
        )
    } else {
        format!(
            "matches {matched} dense tensor(s), every one claimed by the later pattern(s) {} \
             (the last matching pattern wins: put it after them, or drop it)",
            quote_list(claimed_by.iter().map(|&j| patterns[j]))
        )
    };
    Error::bad_value(op, "name pattern", quote(patterns[i]), why)
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
    for ((class, l, _layer, converted), mut tensors) in keyed {
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
            converted,
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
    check_patterns(checkpoint, plan, &classified)?;
    check_slice_patterns(checkpoint, plan, &classified)?;
    check_conversions(checkpoint, plan, &classified)?;
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
        converts: classified.converts,
        roles: 1,
    })
}

/// Where each tensor of a converted group lands in its slot (multiples of
/// [`DENSE_ALIGN`]), and the slot's bytes, from the placed byte sizes.
pub(in crate::model::whole) fn converted_layout(
    lens: impl Iterator<Item = u64>,
) -> (Vec<u64>, u64) {
    let align = DENSE_ALIGN as u64;
    let mut at = 0u64;
    let mut offsets = Vec::new();
    for len in lens {
        at = at.div_ceil(align).saturating_mul(align);
        offsets.push(at);
        at = at.saturating_add(len);
    }
    (offsets, at)
}
