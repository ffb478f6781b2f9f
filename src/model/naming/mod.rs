//! Expert naming: which tensors are experts, of which layer, in which slot order, and
//! which roles (gate, up, down, ...) every expert must have; and the [`ExpertPlan`] that
//! results (built in `plan.rs`): per MoE layer, per expert, its weight and scale pieces
//! as (file, absolute offset, length). No bytes are read.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use super::Checkpoint;
use crate::error::{CheckpointFault, Error, Result, quote_list};

mod expert_plan;
#[cfg(test)]
mod tests;
mod vocabulary;

pub use expert_plan::{ExpertPieces, ExpertPlan, GateUpLayout, LayerPlan, PieceRole, TensorPiece};
pub(crate) use vocabulary::ExpertAxis;
pub use vocabulary::Vocabulary;
use vocabulary::{BIAS, DOWN, GATE, GATE_UP, GENERIC_ROLES, UP};

/// The most experts one MoE layer may have: 65,536.
///
/// The largest layers shipped have 384 (Kimi K2) and 512 (Qwen3-Next) routed experts;
/// this is 128 times that. A plan keeps a few hundred bytes per expert (its pieces), so
/// a layer at the ceiling costs tens of MiB of plan, never more: a file that claims more
/// experts (a merged tensor whose shape says 2^40, a name or a custom naming that says
/// expert `usize::MAX`) is an [`Error::Checkpoint`] naming the tensor, refused before
/// anything is allocated for its experts.
pub const MAX_EXPERTS_PER_LAYER: usize = 1 << 16;

/// What a naming says about one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRef {
    /// The model layer number.
    pub layer: usize,
    /// The expert; `None` when the tensor holds every expert of the layer with the expert
    /// as its outermost dimension (fused / merged tensors).
    pub expert: Option<usize>,
    /// Position in the slot: pieces are laid out by increasing `piece`
    /// (presets: gate 0, up 1, down 2; fused gate_up 0, down 1).
    pub piece: u8,
    /// A tensor of the scale slot rather than a weight: a scale, or (in
    /// [`Naming::Generic`], pieces [`Naming::GENERIC_BIAS_PIECE`] and up) a per-expert
    /// bias, laid out after the scales.
    pub scale: bool,
}

/// What a tensor of an expert holds, as its name's last words say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TensorKind {
    /// Weights (or quant blocks: MXFP4's `…_blocks`): the weight slot.
    Weight,
    /// Scales (`….weight_scale(_inv)`, MXFP4's `…_scales`): the scale slot.
    Scale,
    /// A per-expert bias (gpt-oss's `…_bias`, GGUF's `ffn_*_exps.bias`): the scale slot,
    /// after the scales.
    Bias,
}

/// How one expert's part of a weight is stored: which of its two axes is the layer's
/// output. A tensor-parallel cut follows it: a column-parallel role (gate, up) keeps part
/// of the output dimension, a row-parallel role (down) part of the input dimension,
/// whichever axis that is in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum Orientation {
    /// `[out, in]` (row-major), applied as `x @ W.T`: torch's `nn.Linear` and every
    /// per-expert checkpoint, GGUF (`ne` reversed), the `[E, 2I, H]` / `[E, H, I]`
    /// stacked experts, DBRX's `w1` and `v1`.
    OutIn,
    /// `[in, out]`, applied as `x @ W`: DBRX's flattened `experts.mlp.w2` (`[E·I, H]`),
    /// the `[E, H, 2I]` / `[E, I, H]` experts of Llama4, Qwen3-VL-MoE and gpt-oss.
    InOut,
}

impl Orientation {
    /// `"[out, in]"` or `"[in, out]"`.
    pub fn name(self) -> &'static str {
        match self {
            Orientation::OutIn => "[out, in]",
            Orientation::InOut => "[in, out]",
        }
    }
}

type Classify = dyn Fn(&str) -> Option<TensorRef> + Send + Sync;

/// A naming a user builds: a name and a closure from tensor name to [`TensorRef`].
///
/// # Example
/// ```
/// use numapin::model::{CustomNaming, Naming, TensorRef};
///
/// // "moe.{L}.{E}.w{1,2,3}" with w1 = gate, w3 = up, w2 = down.
/// let naming = Naming::Custom(CustomNaming::new("my-moe", |name| {
///     let mut parts = name.strip_prefix("moe.")?.split('.');
///     let layer = parts.next()?.parse().ok()?;
///     let expert = parts.next()?.parse().ok()?;
///     let piece = match parts.next()? { "w1" => 0, "w3" => 1, "w2" => 2, _ => return None };
///     Some(TensorRef { layer, expert: Some(expert), piece, scale: false })
/// }));
/// assert_eq!(naming.name(), "my-moe");
/// ```
#[derive(Clone)]
pub struct CustomNaming {
    name: String,
    classify: Arc<Classify>,
    roles: Vec<(bool, u8)>,
}

impl CustomNaming {
    /// A naming called `name` that classifies tensor names with `classify`.
    pub fn new(
        name: impl Into<String>,
        classify: impl Fn(&str) -> Option<TensorRef> + Send + Sync + 'static,
    ) -> Self {
        CustomNaming {
            name: name.into(),
            classify: Arc::new(classify),
            roles: Vec::new(),
        }
    }

    /// Declares the roles every expert must have, as `(piece, scale)` pairs: a layer
    /// where an expert lacks one is an error naming it. Without this, the roles are those
    /// any expert of the layer has (so a piece no expert has goes unnoticed).
    ///
    /// ```
    /// use numapin::model::CustomNaming;
    /// // gate 0, up 1, down 2, no scales.
    /// let naming = CustomNaming::new("my-moe", |_| None).with_roles([(0, false), (1, false), (2, false)]);
    /// # let _ = naming;
    /// ```
    pub fn with_roles(mut self, roles: impl IntoIterator<Item = (u8, bool)>) -> Self {
        self.roles = roles
            .into_iter()
            .map(|(piece, scale)| (scale, piece))
            .collect();
        self
    }
}

impl fmt::Debug for CustomNaming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustomNaming")
            .field("name", &self.name)
            .field("roles", &self.roles)
            .finish_non_exhaustive()
    }
}

/// How expert tensors are named.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Naming {
    /// `model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight`, scales
    /// `….weight_scale` or `….weight_scale_inv` (Qwen-MoE, DeepSeek, OLMoE).
    PerExpert,
    /// `model.layers.{L}.block_sparse_moe.experts.{E}.w{1,3,2}.weight` (gate = w1,
    /// up = w3, down = w2), scales as for [`Naming::PerExpert`].
    Mixtral,
    /// `model.layers.{L}.mlp.experts.gate_up_proj` and `….down_proj`, the expert as the
    /// leading dimension: a slot holds [gate_up, down].
    Fused,
    /// GGUF `blk.{L}.ffn_{gate,up,down}_exps.weight`, the expert outermost; quant blocks
    /// carry their scales, so there are no scale pieces.
    GgufMerged,
    /// The vocabulary of MoE tensor names, any prefix (see [`Naming::GENERIC_VOCABULARY`]):
    /// `….{layers,blocks,h,blk}.{L}.{mlp,feed_forward,block_sparse_moe,ffn}.…`, the role
    /// from the name's last words. Per-expert tensors (`experts.{E}.{role}.weight`, scales
    /// `….weight_scale(_inv)`), tensors holding every expert outermost (`experts.{role}`,
    /// Granite's and JetMoE's `input_linear.weight` / `output_linear.weight`, GGUF's
    /// `ffn_{gate,up,down,gate_up}_exps.weight`) and DBRX's flattened
    /// `experts.mlp.{w1,v1,w2}` (`[E·I, H]`, E from the layer's `router.layer.weight`
    /// or the config). Slot order gate, up, gate_up, down; a gate_up tensor is never
    /// split (see [`GateUpLayout`]).
    ///
    /// Per-expert scales and biases go to the expert's scale slot, scales first, then
    /// biases, each in slot order: gpt-oss's `experts.{gate_up_proj,down_proj}_bias`
    /// `[E, …]` and GGUF's `ffn_{gate,up,down}_exps.bias` are biases; gpt-oss's original
    /// MXFP4 `experts.{gate_up_proj,down_proj}_blocks` (U8 `[E, R, C/32, 16]`) are
    /// weights and their `…_scales` (U8 `[E, R, C/32]`) scales. So
    /// [`PinStore::scales`](crate::store::PinStore::scales) of an expert holds its scales
    /// and then its biases; [`LayerPlan::roles`] names each piece of the slot map
    /// ([`PinStore::slot_map`](crate::store::PinStore::slot_map)) in order
    /// (`"gate_up scale"`, …, `"gate_up bias"`, `"down bias"`). A layer with a bias must
    /// have one for each of its weight roles, as a layer with a scale must have a scale for
    /// each.
    Generic,
    /// A naming built by the user.
    Custom(CustomNaming),
}

impl Naming {
    /// The presets, in detection order.
    /// [`Naming::Generic`] is last: it recognises every tensor the others do, and
    /// detection keeps the earlier preset on a tie.
    pub const PRESETS: [Naming; 5] = [
        Naming::PerExpert,
        Naming::Mixtral,
        Naming::Fused,
        Naming::GgufMerged,
        Naming::Generic,
    ];

    /// In [`Naming::Generic`], the piece of a role's bias is the role's piece plus this
    /// (gate 0, up 1, gate_up 2, down 3; their biases 4 to 7, all `scale: true`).
    pub const GENERIC_BIAS_PIECE: u8 = BIAS;

    /// Its name (`"per-expert"`, `"mixtral"`, `"fused"`, `"gguf-merged"`, `"generic"`,
    /// or the custom one's).
    pub fn name(&self) -> &str {
        match self {
            Naming::PerExpert => "per-expert",
            Naming::Mixtral => "mixtral",
            Naming::Fused => "fused",
            Naming::GgufMerged => "gguf-merged",
            Naming::Generic => "generic",
            Naming::Custom(c) => &c.name,
        }
    }

    /// What this naming says about the tensor called `name`.
    pub fn classify(&self, name: &str) -> Option<TensorRef> {
        self.classify_axis(name).map(|(r, _)| r)
    }

    /// [`Naming::classify`], and where the experts are in a tensor holding them all.
    pub(crate) fn classify_axis(&self, name: &str) -> Option<(TensorRef, ExpertAxis)> {
        if let Naming::Generic = self {
            return Self::GENERIC_VOCABULARY.classify(name);
        }
        self.classify_preset(name)
            .map(|r| (r, ExpertAxis::Outermost))
    }

    fn classify_preset(&self, name: &str) -> Option<TensorRef> {
        match self {
            Naming::PerExpert => per_expert(
                name,
                ".mlp.experts.",
                &["gate_proj", "up_proj", "down_proj"],
            ),
            Naming::Mixtral => per_expert(name, ".block_sparse_moe.experts.", &["w1", "w3", "w2"]),
            Naming::Fused => merged(
                name,
                "model.layers.",
                &[".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"],
            ),
            Naming::GgufMerged => merged(
                name,
                "blk.",
                &[
                    ".ffn_gate_exps.weight",
                    ".ffn_up_exps.weight",
                    ".ffn_down_exps.weight",
                ],
            ),
            Naming::Custom(c) => (c.classify)(name),
            Naming::Generic => Self::GENERIC_VOCABULARY.classify(name).map(|(r, _)| r),
        }
    }

    /// How the tensor called `name` stores each expert's weight, when its name says
    /// ([`Orientation`]): the per-expert presets and GGUF `[out, in]`; in
    /// [`Naming::Generic`], DBRX's flattened tensors by their word
    /// ([`Vocabulary::flattened_input_first`]) and per-expert tensors `[out, in]`.
    /// `None` where the name does not say: tensors holding every expert under one name
    /// in both orientations (`experts.gate_up_proj` is `[E, 2I, H]` in transformers v5,
    /// `[E, H, 2I]` in Llama4's hub checkpoint), whose layer's shapes decide
    /// ([`LayerPlan::orientations`]), and custom namings.
    pub fn orientation(&self, name: &str) -> Option<Orientation> {
        match self {
            Naming::PerExpert | Naming::Mixtral | Naming::GgufMerged => Some(Orientation::OutIn),
            Naming::Generic => Self::GENERIC_VOCABULARY.orientation(name),
            Naming::Fused | Naming::Custom(_) => None,
        }
    }

    /// The preset that recognises the most tensors of `checkpoint`.
    ///
    /// # Errors
    /// [`CheckpointFault::NoExperts`] when no preset recognises any tensor; the message
    /// lists a few names that look like expert tensors (contain `expert` or `exps`) and
    /// how many there are.
    pub fn detect(checkpoint: &Checkpoint) -> Result<Naming> {
        let mut best: Option<(usize, Naming)> = None;
        for naming in Naming::PRESETS {
            let hits = checkpoint
                .tensors()
                .iter()
                .filter(|t| naming.classify(t.name()).is_some())
                .count();
            if hits > 0 && best.as_ref().is_none_or(|(n, _)| hits > *n) {
                best = Some((hits, naming));
            }
        }
        best.map(|(_, n)| n)
            .ok_or_else(|| no_experts(checkpoint, "no preset naming"))
    }

    /// The name of the role `(piece, scale)` in this naming, as its tensors spell it
    /// (`"up_proj"`, `"w3 scale"`, `"ffn_down_exps"`; `"piece 4"` for a custom naming).
    pub fn role_name(&self, piece: u8, scale: bool) -> String {
        let names: &[&str] = match self {
            Naming::PerExpert => &["gate_proj", "up_proj", "down_proj"],
            Naming::Mixtral => &["w1", "w3", "w2"],
            Naming::Fused => &["gate_up_proj", "down_proj"],
            Naming::GgufMerged => &["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
            Naming::Generic => &GENERIC_ROLES,
            Naming::Custom(_) => &[],
        };
        if let Naming::Generic = self
            && scale
            && let Some(role) = GENERIC_ROLES.get(usize::from(piece.wrapping_sub(BIAS)))
        {
            return format!("{role} bias");
        }
        let base = names
            .get(usize::from(piece))
            .map_or_else(|| format!("piece {piece}"), |n| (*n).to_owned());
        if scale { format!("{base} scale") } else { base }
    }

    /// The canonical name of the role `(piece, scale)`, the same for every preset:
    /// `gate`, `up`, `gate_up`, `down`, and a role's scale or bias with `.scale` /
    /// `.bias` (`"gate_up.bias"`: gpt-oss's `gate_up_proj_bias`, which
    /// [`Naming::role_name`] calls `"gate_up bias"`; Mixtral's `w3` is `"up"`, the fused
    /// preset's `gate_up_proj` `"gate_up"`). A custom naming has no vocabulary to map
    /// to: its roles keep [`Naming::role_name`]'s names.
    ///
    /// ```
    /// use numapin::model::Naming;
    /// assert_eq!(Naming::Mixtral.canonical_role(1, false), "up");
    /// assert_eq!(Naming::PerExpert.canonical_role(2, true), "down.scale");
    /// assert_eq!(Naming::Fused.canonical_role(0, false), "gate_up");
    /// let bias = Naming::GENERIC_BIAS_PIECE + 2;
    /// assert_eq!(Naming::Generic.canonical_role(bias, true), "gate_up.bias");
    /// ```
    pub fn canonical_role(&self, piece: u8, scale: bool) -> String {
        let names: &[&str] = match self {
            Naming::PerExpert | Naming::Mixtral | Naming::GgufMerged => &["gate", "up", "down"],
            Naming::Fused => &["gate_up", "down"],
            Naming::Generic => &GENERIC_ROLES,
            Naming::Custom(_) => return self.role_name(piece, scale),
        };
        let (piece, suffix) = match (self, scale) {
            (Naming::Generic, true) if piece >= BIAS => (piece - BIAS, ".bias"),
            (_, true) => (piece, ".scale"),
            (_, false) => (piece, ""),
        };
        match names.get(usize::from(piece)) {
            Some(base) => format!("{base}{suffix}"),
            None => self.role_name(piece, scale),
        }
    }

    /// The roles, as `(scale, piece)`, every expert of a layer must have, given those
    /// some tensor of the layer has (`seen`): the naming's own, and every one seen.
    pub(crate) fn required_roles(&self, seen: &BTreeSet<(bool, u8)>) -> BTreeSet<(bool, u8)> {
        let weights: &[u8] = match self {
            Naming::PerExpert | Naming::Mixtral | Naming::GgufMerged => &[0, 1, 2],
            Naming::Fused => &[0, 1],
            Naming::Generic => {
                let has = |p: u8| seen.iter().any(|&(_, q)| q == p || q == p + BIAS);
                match (has(GATE) || has(UP), has(GATE_UP)) {
                    (_, false) => &[GATE, UP, DOWN],
                    (false, true) => &[GATE_UP, DOWN],
                    (true, true) => &[GATE, UP, GATE_UP, DOWN],
                }
            }
            Naming::Custom(_) => &[],
        };
        let generic = matches!(self, Naming::Generic);
        let is_bias = |&(scale, piece): &(bool, u8)| generic && scale && piece >= BIAS;
        let mut roles = seen.clone();
        roles.extend(weights.iter().map(|&p| (false, p)));
        if seen.iter().any(|r| r.0 && !is_bias(r)) {
            roles.extend(weights.iter().map(|&p| (true, p)));
        }
        if seen.iter().any(is_bias) {
            roles.extend(weights.iter().map(|&p| (true, p + BIAS)));
        }
        if let Naming::Custom(c) = self {
            roles.extend(c.roles.iter().copied());
        }
        roles
    }

    /// The piece of a fused gate_up role, if the naming has one.
    pub(crate) fn gate_up_piece(&self) -> Option<u8> {
        match self {
            Naming::Fused => Some(0),
            Naming::Generic => Some(GATE_UP),
            _ => None,
        }
    }

    /// Whether this is a preset (checked against the model's config).
    pub(crate) fn is_preset(&self) -> bool {
        !matches!(self, Naming::Custom(_))
    }
}

/// `{prefix}{L}{rest}` → (L, rest).
fn layer_of<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let rest = name.strip_prefix(prefix)?;
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 || digits > 9 {
        return None;
    }
    Some((rest[..digits].parse().ok()?, &rest[digits..]))
}

fn per_expert(name: &str, middle: &str, pieces: &[&str; 3]) -> Option<TensorRef> {
    let (layer, rest) = layer_of(name, "model.layers.")?;
    let (expert, rest) = layer_of(rest, middle)?;
    let rest = rest.strip_prefix('.')?;
    let (proj, kind) = rest.split_once('.')?;
    let piece = pieces.iter().position(|p| *p == proj)? as u8;
    let scale = match kind {
        "weight" => false,
        "weight_scale" | "weight_scale_inv" => true,
        _ => return None,
    };
    Some(TensorRef {
        layer,
        expert: Some(expert),
        piece,
        scale,
    })
}

/// A merged tensor (every expert of a layer in one): `{prefix}{layer}{piece}`, its
/// piece the index of that ending in `pieces`.
fn merged(name: &str, prefix: &str, pieces: &[&str]) -> Option<TensorRef> {
    let (layer, rest) = layer_of(name, prefix)?;
    let piece = pieces.iter().position(|p| *p == rest)? as u8;
    Some(TensorRef {
        layer,
        expert: None,
        piece,
        scale: false,
    })
}

pub(crate) fn no_experts(checkpoint: &Checkpoint, naming: &str) -> Error {
    let looks = || {
        checkpoint
            .tensors()
            .iter()
            .map(|t| t.name())
            .filter(|n| n.contains("expert") || n.contains("exps"))
    };
    let file = checkpoint
        .files()
        .first()
        .map(|f| f.path().display().to_string())
        .unwrap_or_default();
    let seen = if looks().next().is_none() {
        "no tensor name contains \"expert\" or \"exps\"".to_owned()
    } else {
        format!("names that look like experts: {}", quote_list(looks()))
    };
    let how = "; for another naming, build a numapin::model::CustomNaming (a closure from \
               tensor name to TensorRef {layer, expert, piece, scale}) and call \
               Checkpoint::expert_plan_with or pack_with";
    Error::checkpoint(
        file,
        None,
        CheckpointFault::NoExperts,
        format!("{naming} recognises an expert tensor; {seen}{how}"),
    )
}
