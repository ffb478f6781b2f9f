//! Building an [`ExpertPlan`]: the tensors a naming recognises, grouped by layer and
//! expert, checked for completeness (every expert has every role), for counts no file
//! can make true (more than [`MAX_EXPERTS_PER_LAYER`] experts) and against the model's
//! config, then cut into per-expert pieces.
//!
//! Nothing here is sized by a number a file states before it is checked: the per-expert
//! maps hold only tensors that exist, and a merged tensor's expert count is checked
//! against the ceiling and against the tensor's bytes before its experts are laid out.

use std::collections::{BTreeMap, BTreeSet};

use super::files::shape_text;
use super::naming::{
    ExpertAxis, ExpertPieces, ExpertPlan, GateUpLayout, LayerPlan, MAX_EXPERTS_PER_LAYER, Naming,
    Orientation, PieceRole, TensorPiece, no_experts,
};
use super::{Checkpoint, Dtype, TensorInfo};
use crate::error::{CheckpointFault, Error, Result, quote};

/// `(scale, piece)`: a role of an expert, in slot order (weights first, each by piece).
type Role = (bool, u8);

#[derive(Default)]
struct LayerTensors {
    /// expert → role → tensor index
    per_expert: BTreeMap<usize, BTreeMap<Role, usize>>,
    /// role → tensor index, for tensors holding every expert.
    merged: BTreeMap<Role, usize>,
    /// The merged tensors whose experts are flattened into dimension 0 (DBRX).
    flattened: BTreeSet<usize>,
}

/// What the steps share: the naming, the checkpoint, and how to name a tensor's file.
struct Plan<'a> {
    naming: &'a Naming,
    checkpoint: &'a Checkpoint,
}

impl Plan<'_> {
    fn tensor(&self, index: usize) -> &TensorInfo {
        &self.checkpoint.tensors()[index]
    }

    fn file_of(&self, t: &TensorInfo) -> String {
        self.checkpoint
            .files()
            .get(t.file())
            .map(|f| f.path().display().to_string())
            .unwrap_or_default()
    }

    fn fault(&self, t: &TensorInfo, kind: CheckpointFault, why: String) -> Error {
        Error::checkpoint(self.file_of(t), Some(t.name()), kind, why)
    }

    /// Expert `expert` of `layer` lacks `role`; `t` is a tensor of the layer (for the file).
    fn missing_role(
        &self,
        t: &TensorInfo,
        layer: usize,
        expert: usize,
        role: Role,
        required: &BTreeSet<Role>,
    ) -> Error {
        let names: Vec<String> = required
            .iter()
            .map(|&(scale, piece)| self.naming.role_name(piece, scale))
            .collect();
        let mut why = format!(
            "layer {layer} expert {expert} has no {} (the naming {} wants every expert to \
             have {}): an incomplete expert is not packed",
            self.naming.role_name(role.1, role.0),
            quote(self.naming.name()),
            names.join(", ")
        );
        if matches!(self.naming, Naming::GgufMerged) {
            let fused = format!("blk.{layer}.ffn_gate_up_exps.weight");
            if self.checkpoint.tensor(&fused).is_some() {
                why.push_str(&format!(
                    "; the file has {fused}, gate and up fused into one tensor (as llama.cpp's \
                     convert_hf_to_gguf.py --fuse-gate-up-exps writes): the naming \
                     \"generic\" packs it whole"
                ));
            }
        }
        Error::checkpoint(self.file_of(t), None, CheckpointFault::Missing, why)
    }

    fn piece(&self, index: usize) -> Result<TensorPiece> {
        let t = self.tensor(index);
        TensorPiece::new(index, t.file(), t.offset(), t.len())
    }
}

// `Naming::plan` lives beside its builder, so that the arrow runs one way: this module
// reads the naming's types, the naming module needs nothing of this one.
impl Naming {
    /// The plan of `checkpoint`'s experts under this naming.
    ///
    /// An expert is complete or it is an error: every expert `0..E` of a MoE layer must
    /// have every role of the naming (see [`Naming::role_name`]). A preset with scales
    /// wants a scale for every weight role of a layer where any scale is present. Beside
    /// a safetensors checkpoint, a `config.json` (`num_hidden_layers`,
    /// `first_k_dense_replace`, `moe_layer_freq`, `decoder_sparse_step`,
    /// `mlp_only_layers`, and `n_routed_experts`, `num_local_experts` or `num_experts`)
    /// says which layers are MoE layers and how many experts each has; a GGUF's
    /// `{arch}.expert_count` says the latter. Presets are checked against them (keys
    /// absent or not understood: no check); a custom naming is not, as it may choose a
    /// subset on purpose.
    ///
    /// # Errors
    /// [`CheckpointFault::NoExperts`]; [`CheckpointFault::Missing`]: an expert of a layer
    /// without a role (the message names the layer, the expert and the role), a layer
    /// missing an expert, a MoE layer of `config.json` missing, fewer experts than the
    /// config says; [`CheckpointFault::Shape`]: experts of one layer with different
    /// shapes or dtypes, a piece given twice, a fused tensor whose bytes do not divide by
    /// its expert count, fused tensors of one layer that disagree on it, more experts
    /// than the config says, more than [`MAX_EXPERTS_PER_LAYER`] experts.
    pub fn plan(&self, checkpoint: &Checkpoint) -> Result<ExpertPlan> {
        build_plan(self, checkpoint)
    }
}

fn build_plan(naming: &Naming, checkpoint: &Checkpoint) -> Result<ExpertPlan> {
    let plan = Plan { naming, checkpoint };
    let (layers, engine_tensors, engine_bytes) = group(&plan)?;
    if layers.is_empty() {
        return Err(no_experts(
            checkpoint,
            &format!("the naming {}", quote(naming.name())),
        ));
    }
    let mut plans = Vec::with_capacity(layers.len());
    for (layer, lt) in layers {
        let (experts, required) = if lt.merged.is_empty() {
            per_expert_layer(&plan, layer, &lt.per_expert)?
        } else if let Some((&e, pieces)) = lt.per_expert.iter().next() {
            let t = plan.tensor(*pieces.values().next().unwrap_or(&0));
            return Err(plan.fault(
                t,
                CheckpointFault::Shape,
                format!(
                    "layer {layer} has both per-expert tensors (expert {e}) and tensors \
                     holding every expert"
                ),
            ));
        } else {
            merged_layer(&plan, layer, &lt)?
        };
        let gate_up = gate_up_layout(&plan, &lt);
        let bytes = |pieces: &[TensorPiece]| pieces.iter().map(|p| p.len).sum::<u64>();
        let (weight_bytes, scale_bytes) = experts
            .first()
            .map(|e| (bytes(&e.weights), bytes(&e.scales)))
            .unwrap_or((0, 0));
        let roles = required
            .iter()
            .map(|&(scale, piece)| {
                let role = if scale {
                    PieceRole::Scale
                } else {
                    PieceRole::Weight
                };
                (role, naming.role_name(piece, scale))
            })
            .collect();
        let canonical = required
            .iter()
            .map(|&(scale, piece)| naming.canonical_role(piece, scale))
            .collect();
        let orientations = orientations(&plan, &lt, &required, gate_up);
        plans.push(LayerPlan {
            layer,
            experts,
            weight_bytes,
            scale_bytes,
            roles,
            canonical,
            gate_up,
            orientations,
            share: None,
        });
    }
    let expert_plan = ExpertPlan {
        naming: naming.name().to_owned(),
        layers: plans,
        engine_tensors,
        engine_bytes,
    };
    if naming.is_preset()
        && let Some(config) = checkpoint.config()
    {
        config.check(&expert_plan)?;
    }
    Ok(expert_plan)
}

/// The naming's tensors by layer and expert; the others counted for the engine.
fn group(plan: &Plan<'_>) -> Result<(BTreeMap<usize, LayerTensors>, usize, u64)> {
    let mut layers: BTreeMap<usize, LayerTensors> = BTreeMap::new();
    let (mut engine_tensors, mut engine_bytes) = (0usize, 0u64);
    for (index, t) in plan.checkpoint.tensors().iter().enumerate() {
        let Some((r, axis)) = plan.naming.classify_axis(t.name()) else {
            engine_tensors += 1;
            engine_bytes = engine_bytes.saturating_add(t.len());
            continue;
        };
        if let Some(e) = r.expert
            && e >= MAX_EXPERTS_PER_LAYER
        {
            return Err(plan.fault(
                t,
                CheckpointFault::Shape,
                format!(
                    "the naming {} makes it expert {e} of layer {}: a layer has at most \
                     {MAX_EXPERTS_PER_LAYER} experts",
                    quote(plan.naming.name()),
                    r.layer
                ),
            ));
        }
        let layer = layers.entry(r.layer).or_default();
        if axis == ExpertAxis::Flattened {
            layer.flattened.insert(index);
        }
        let slot = match r.expert {
            Some(e) => layer.per_expert.entry(e).or_default(),
            None => &mut layer.merged,
        };
        if let Some(other) = slot.insert((r.scale, r.piece), index) {
            return Err(plan.fault(
                t,
                CheckpointFault::Shape,
                format!(
                    "the naming {} gives it the same place as {} (layer {}, piece {})",
                    quote(plan.naming.name()),
                    quote(plan.tensor(other).name()),
                    r.layer,
                    r.piece
                ),
            ));
        }
    }
    Ok((layers, engine_tensors, engine_bytes))
}

fn split_roles(pieces: impl Iterator<Item = (Role, Result<TensorPiece>)>) -> Result<ExpertPieces> {
    let mut weights = Vec::new();
    let mut scales = Vec::new();
    // BTreeMap order: (false, piece) before (true, piece), each by piece.
    for ((scale, _), p) in pieces {
        let p = p?;
        if scale {
            scales.push(p)
        } else {
            weights.push(p)
        }
    }
    Ok(ExpertPieces { weights, scales })
}

fn per_expert_layer(
    plan: &Plan<'_>,
    layer: usize,
    experts: &BTreeMap<usize, BTreeMap<Role, usize>>,
) -> Result<(Vec<ExpertPieces>, BTreeSet<Role>)> {
    let seen: BTreeSet<Role> = experts.values().flat_map(|m| m.keys().copied()).collect();
    let required = plan.naming.required_roles(&seen);
    let (Some((_, first)), Some(&last)) = (experts.iter().next(), experts.keys().next_back())
    else {
        return Ok((Vec::new(), required));
    };
    // `last` < MAX_EXPERTS_PER_LAYER (checked in `group`): no overflow, a small loop.
    let mut out = Vec::with_capacity(experts.len());
    for e in 0..=last {
        let Some(pieces) = experts.get(&e) else {
            let t = plan.tensor(*first.values().next().unwrap_or(&0));
            return Err(Error::checkpoint(
                plan.file_of(t),
                None,
                CheckpointFault::Missing,
                format!("layer {layer} has experts up to {last} but no tensor of expert {e}"),
            ));
        };
        let any = plan.tensor(*pieces.values().next().unwrap_or(&0));
        if let Some(&role) = required.iter().find(|r| !pieces.contains_key(r)) {
            return Err(plan.missing_role(any, layer, e, role, &required));
        }
        // Every expert has exactly the required roles now (it has each, and none that is
        // not: every role seen is required). Each of the dtype and shape of the first's.
        for (key, &mine) in pieces {
            let reference = plan.tensor(first.get(key).copied().unwrap_or(mine));
            let t = plan.tensor(mine);
            if t.dtype() != reference.dtype() || t.shape() != reference.shape() {
                return Err(plan.fault(
                    t,
                    CheckpointFault::Shape,
                    format!(
                        "experts of one layer with different shapes: {} {} here, {} {} in {}",
                        t.dtype(),
                        shape_text(t.shape()),
                        reference.dtype(),
                        shape_text(reference.shape()),
                        quote(reference.name())
                    ),
                ));
            }
        }
        out.push(split_roles(
            pieces.iter().map(|(&k, &i)| (k, plan.piece(i))),
        )?);
    }
    Ok((out, required))
}

fn merged_layer(
    plan: &Plan<'_>,
    layer: usize,
    lt: &LayerTensors,
) -> Result<(Vec<ExpertPieces>, BTreeSet<Role>)> {
    let merged = &lt.merged;
    let seen: BTreeSet<Role> = merged.keys().copied().collect();
    let required = plan.naming.required_roles(&seen);
    if let Some(&role) = required.iter().find(|r| !merged.contains_key(r)) {
        let any = plan.tensor(*merged.values().next().unwrap_or(&0));
        return Err(plan.missing_role(any, layer, 0, role, &required));
    }
    let mut count: Option<(u64, &TensorInfo)> = None;
    for &index in merged.values() {
        if lt.flattened.contains(&index) {
            continue;
        }
        let t = plan.tensor(index);
        let n = match t.outermost_dim() {
            Some(n) if n > 0 => n,
            _ => {
                return Err(plan.fault(
                    t,
                    CheckpointFault::Shape,
                    format!(
                        "a tensor holding layer {layer}'s experts has shape {}",
                        shape_text(t.shape())
                    ),
                ));
            }
        };
        check_count(plan, t, layer, n, "its shape")?;
        match count {
            Some((c, other)) if c != n => {
                return Err(plan.fault(
                    t,
                    CheckpointFault::Shape,
                    format!(
                        "{n} experts here but {c} in {} of the same layer {layer}",
                        quote(other.name())
                    ),
                ));
            }
            _ => count = Some((n, t)),
        }
    }
    if let Some(&index) = lt.flattened.iter().next() {
        let n = match count {
            Some((n, _)) => n,
            None => flattened_count(plan, layer, plan.tensor(index))?,
        };
        for &index in &lt.flattened {
            let t = plan.tensor(index);
            let rows = t.outermost_dim().unwrap_or(0);
            if rows < n || !rows.is_multiple_of(n) {
                return Err(plan.fault(
                    t,
                    CheckpointFault::Shape,
                    format!(
                        "its experts are flattened into dimension 0 ([E·I, …]), but its shape \
                         {} does not divide into {n} experts of layer {layer}",
                        shape_text(t.shape())
                    ),
                ));
            }
            check_count(plan, t, layer, n, "dimension 0")?;
        }
        count = Some((n, plan.tensor(index)));
    }
    // n ≤ MAX_EXPERTS_PER_LAYER and n ≤ each tensor's bytes: checked above.
    let n = count.map_or(0, |(n, _)| n);
    let mut out = Vec::with_capacity(MAX_EXPERTS_PER_LAYER.min(n as usize));
    for e in 0..n {
        out.push(split_roles(merged.iter().map(|(&k, &i)| {
            let t = plan.tensor(i);
            let per = t.len() / n;
            (k, TensorPiece::new(i, t.file(), t.offset() + e * per, per))
        }))?);
    }
    Ok((out, required))
}

/// `n` experts in tensor `t` (`what` said so): at most [`MAX_EXPERTS_PER_LAYER`], and
/// its bytes divide into `n` non-empty experts.
fn check_count(plan: &Plan<'_>, t: &TensorInfo, layer: usize, n: u64, what: &str) -> Result<()> {
    if n > MAX_EXPERTS_PER_LAYER as u64 {
        return Err(plan.fault(
            t,
            CheckpointFault::Shape,
            format!(
                "{what} {} says {n} experts of layer {layer}: a layer has at most \
                 {MAX_EXPERTS_PER_LAYER} experts",
                shape_text(t.shape())
            ),
        ));
    }
    if n == 0 || !t.len().is_multiple_of(n) || t.len() < n {
        return Err(plan.fault(
            t,
            CheckpointFault::Shape,
            format!("{} bytes do not divide into {n} non-empty experts", t.len()),
        ));
    }
    Ok(())
}

/// The expert count of a layer whose tensors are all flattened (`t` one of them, named
/// `….experts.mlp.{w}`): the outermost dimension of the layer's router
/// `….router.layer.weight` `[E, H]`, else the config's count.
fn flattened_count(plan: &Plan<'_>, layer: usize, t: &TensorInfo) -> Result<u64> {
    let router = t
        .name()
        .rfind(".experts.mlp.")
        .map(|at| format!("{}.router.layer.weight", &t.name()[..at]));
    let from_router = router
        .as_deref()
        .and_then(|r| plan.checkpoint.tensor(r))
        .and_then(TensorInfo::outermost_dim);
    let from_config = || plan.checkpoint.config().and_then(|c| c.experts());
    match from_router.or_else(from_config) {
        Some(n) if n > 0 => Ok(n),
        _ => Err(plan.fault(
            t,
            CheckpointFault::Shape,
            format!(
                "layer {layer}'s experts are flattened into dimension 0 ([E·I, …]): E comes \
                 from the router {} [E, H] or config.json's ffn_config.moe_num_experts, and \
                 neither is there",
                quote(router.as_deref().unwrap_or("router.layer.weight"))
            ),
        )),
    }
}

/// How each of `required`'s roles stores an expert's weight: what the naming says by
/// the role's tensor name, else the layer's gate_up layout (`[H, 2I]` beside `[I, H]`:
/// every role `[in, out]`), else `[out, in]`.
fn orientations(
    plan: &Plan<'_>,
    lt: &LayerTensors,
    required: &BTreeSet<(bool, u8)>,
    gate_up: Option<GateUpLayout>,
) -> Vec<Orientation> {
    let by_shape = match gate_up {
        Some(GateUpLayout::GateThenUpColumns | GateUpLayout::Interleaved) => Orientation::InOut,
        _ => Orientation::OutIn,
    };
    let roles = if lt.merged.is_empty() {
        lt.per_expert.values().next()
    } else {
        Some(&lt.merged)
    };
    required
        .iter()
        .map(|role| {
            roles
                .and_then(|r| r.get(role))
                .and_then(|&i| plan.naming.orientation(plan.tensor(i).name()))
                .unwrap_or(by_shape)
        })
        .collect()
}

/// How the layer's fused gate_up role (if any) holds gate and up, from its shape and
/// down's: `[2I, H]` beside `[H, I]` is stacked rows, `[H, 2I]` beside `[I, H]` columns
/// (interleaved when gpt-oss's `…_bias` is beside it); GGUF's fused tensor is rows;
/// gpt-oss's MXFP4 `…_blocks` interleaved rows (with its `…_bias`).
fn gate_up_layout(plan: &Plan<'_>, lt: &LayerTensors) -> Option<GateUpLayout> {
    let piece = plan.naming.gate_up_piece()?;
    // A layer has merged tensors or per-expert ones (expert 0's stand for all).
    let roles = if lt.merged.is_empty() {
        lt.per_expert.values().next()?
    } else {
        &lt.merged
    };
    let gate_up = *roles.get(&(false, piece))?;
    let down = roles
        .iter()
        .filter(|&(&(scale, p), _)| !scale && p != piece)
        .map(|(_, &i)| i)
        .next_back();
    let t = plan.tensor(gate_up);
    if let Dtype::Ggml(_) = t.dtype() {
        return Some(GateUpLayout::GateThenUpRows);
    }
    let has_bias = |stem: &str| plan.checkpoint.tensor(&format!("{stem}_bias")).is_some();
    if let Some(stem) = t.name().strip_suffix("_blocks") {
        // gpt-oss's MXFP4 blocks [E, 2I, H/32, 16]: rows, gate and up alternating.
        return Some(if has_bias(stem) {
            GateUpLayout::InterleavedRows
        } else {
            GateUpLayout::Unknown
        });
    }
    let per_expert = |t: &TensorInfo| -> Option<(u64, u64)> {
        match (lt.merged.is_empty(), t.shape()) {
            (true, &[a, b]) | (false, &[_, a, b]) => Some((a, b)),
            _ => None,
        }
    };
    let layout = match (per_expert(t), down.and_then(|d| per_expert(plan.tensor(d)))) {
        (Some((a, b)), Some((c, d))) if Some(a) == d.checked_mul(2) && b == c => {
            GateUpLayout::GateThenUpRows
        }
        (Some((a, b)), Some((c, d))) if Some(b) == c.checked_mul(2) && a == d => {
            if has_bias(t.name()) {
                GateUpLayout::Interleaved
            } else {
                GateUpLayout::GateThenUpColumns
            }
        }
        _ => GateUpLayout::Unknown,
    };
    Some(layout)
}
