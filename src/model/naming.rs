//! Expert naming: which tensors are experts, of which layer, in which slot order, and
//! which roles (gate, up, down, ...) every expert must have; and the [`ExpertPlan`] that
//! results (built in `plan.rs`): per MoE layer, per expert, its weight and scale pieces
//! as (file, absolute offset, length). No bytes are read.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use super::Checkpoint;
use crate::error::{CheckpointFault, Error, Result, quote_list};

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

    /// [`Naming::Generic`]'s vocabulary, as data: the words that may precede the layer
    /// number, the feed-forward block's words, and each role's last words.
    pub const GENERIC_VOCABULARY: Vocabulary = Vocabulary {
        layer_words: &["layers", "blocks", "h", "blk"],
        block_words: &["mlp", "feed_forward", "block_sparse_moe", "ffn"],
        expert_words: &[
            ("gate_proj", "gate"),
            ("w1", "gate"),
            ("up_proj", "up"),
            ("w3", "up"),
            ("v1", "up"),
            ("gate_up_proj", "gate_up"),
            ("down_proj", "down"),
            ("w2", "down"),
        ],
        block_merged_words: &[
            ("input_linear.weight", "gate_up"),
            ("output_linear.weight", "down"),
        ],
        gguf_words: &[
            ("ffn_gate_exps", "gate"),
            ("ffn_up_exps", "up"),
            ("ffn_gate_up_exps", "gate_up"),
            ("ffn_down_exps", "down"),
        ],
        gguf_kind_words: &[("weight", TensorKind::Weight), ("bias", TensorKind::Bias)],
        kind_words: &[
            ("weight", TensorKind::Weight),
            ("weight_scale", TensorKind::Scale),
            ("weight_scale_inv", TensorKind::Scale),
        ],
        merged_kind_suffixes: &[
            ("_blocks", TensorKind::Weight),
            ("_scales", TensorKind::Scale),
            ("_bias", TensorKind::Bias),
        ],
    };

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
            Naming::Fused => {
                let (layer, rest) = layer_of(name, "model.layers.")?;
                let piece = match rest.strip_prefix(".mlp.experts.")? {
                    "gate_up_proj" => 0,
                    "down_proj" => 1,
                    _ => return None,
                };
                Some(TensorRef {
                    layer,
                    expert: None,
                    piece,
                    scale: false,
                })
            }
            Naming::GgufMerged => {
                let (layer, rest) = layer_of(name, "blk.")?;
                let piece = match rest {
                    ".ffn_gate_exps.weight" => 0,
                    ".ffn_up_exps.weight" => 1,
                    ".ffn_down_exps.weight" => 2,
                    _ => return None,
                };
                Some(TensorRef {
                    layer,
                    expert: None,
                    piece,
                    scale: false,
                })
            }
            Naming::Custom(c) => (c.classify)(name),
            Naming::Generic => Self::GENERIC_VOCABULARY.classify(name).map(|(r, _)| r),
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
        super::plan::build_plan(self, checkpoint)
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

/// [`Naming::Generic`]'s pieces: slot order gate, up, gate_up, down.
const GATE: u8 = 0;
const UP: u8 = 1;
const GATE_UP: u8 = 2;
const DOWN: u8 = 3;
/// A role's bias is its piece plus this, in the scale slot (after every scale).
const BIAS: u8 = 4;
const GENERIC_ROLES: [&str; 4] = ["gate", "up", "gate_up", "down"];

/// Where the experts are in a tensor that holds every expert of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertAxis {
    /// `[E, …]` (safetensors), `ne[last] = E` (GGUF).
    Outermost,
    /// `[E·I, …]`: DBRX's experts flattened into dimension 0; E from elsewhere.
    Flattened,
}

/// A vocabulary of MoE tensor names: what [`Naming::Generic`] matches, as data.
///
/// A name is `{any prefix}{layer word}.{L}.` then either a GGUF word
/// (`ffn_gate_exps.weight`, …) or `{block word}.` and then one of:
/// `experts.{E}.{expert word}.{kind word}` (one expert), `experts.{expert word}`,
/// `experts.{expert word}.weight` or `experts.{expert word}{merged kind suffix}` (every
/// expert, outermost: gpt-oss's `_bias`, `_blocks`, `_scales`), `experts.mlp.{expert word}`
/// (every expert, flattened into dimension 0: DBRX), `{block merged word}` (every expert,
/// outermost: Granite, JetMoE). Anything else — routers (`mlp.gate.weight`),
/// router biases (`expert_bias`, `e_score_correction_bias`), shared experts
/// (`shared_expert(s).…`), attention experts (`self_attention.experts.…`) — is not an
/// expert. Roles are `"gate"`, `"up"`, `"gate_up"`, `"down"`; a GGUF word is followed by
/// `.{GGUF kind word}` (`.weight`, `.bias`).
#[derive(Debug, Clone, Copy)]
pub struct Vocabulary {
    /// Words right before the layer number.
    pub layer_words: &'static [&'static str],
    /// The feed-forward block's words, right after the layer number.
    pub block_words: &'static [&'static str],
    /// An expert tensor's last words → role.
    pub expert_words: &'static [(&'static str, &'static str)],
    /// Tensors holding every expert right under the block → role.
    pub block_merged_words: &'static [(&'static str, &'static str)],
    /// GGUF tensors holding every expert right after the layer number → role.
    pub gguf_words: &'static [(&'static str, &'static str)],
    /// A GGUF tensor's kind, the word after its role's.
    pub gguf_kind_words: &'static [(&'static str, TensorKind)],
    /// A per-expert tensor's kind, its last word.
    pub kind_words: &'static [(&'static str, TensorKind)],
    /// A tensor holding every expert: its kind, from the suffix after its role's word.
    pub merged_kind_suffixes: &'static [(&'static str, TensorKind)],
}

impl Vocabulary {
    fn piece(role: &str) -> Option<u8> {
        GENERIC_ROLES
            .iter()
            .position(|r| *r == role)
            .map(|p| p as u8)
    }

    fn lookup(words: &[(&str, &str)], word: &str) -> Option<u8> {
        words
            .iter()
            .find(|(w, _)| *w == word)
            .and_then(|(_, role)| Self::piece(role))
    }

    /// The layer number after the first `{layer word}.{digits}.` at a segment start,
    /// and what follows it.
    fn layer<'a>(&self, name: &'a str) -> Option<(usize, &'a str)> {
        let starts = std::iter::once(0).chain(name.match_indices('.').map(|(i, _)| i + 1));
        for start in starts {
            let tail = &name[start..];
            for word in self.layer_words {
                let Some(after) = tail.strip_prefix(word).and_then(|t| t.strip_prefix('.')) else {
                    continue;
                };
                if let Some((layer, rest)) = layer_of(after, "")
                    && let Some(rest) = rest.strip_prefix('.')
                {
                    return Some((layer, rest));
                }
            }
        }
        None
    }

    /// What this vocabulary says about `name`.
    fn classify(&self, name: &str) -> Option<(TensorRef, ExpertAxis)> {
        let (layer, rest) = self.layer(name)?;
        let at = |piece: u8, kind: TensorKind, expert, axis| {
            let (piece, scale) = match kind {
                TensorKind::Weight => (piece, false),
                TensorKind::Scale => (piece, true),
                TensorKind::Bias => (piece + BIAS, true),
            };
            Some((
                TensorRef {
                    layer,
                    expert,
                    piece,
                    scale,
                },
                axis,
            ))
        };
        if let Some((word, kind)) = rest.rsplit_once('.')
            && let Some(piece) = Self::lookup(self.gguf_words, word)
        {
            let kind = Self::kind(self.gguf_kind_words, kind)?;
            return at(piece, kind, None, ExpertAxis::Outermost);
        }
        let (block, rest) = rest.split_once('.')?;
        if !self.block_words.contains(&block) {
            return None;
        }
        if let Some(piece) = Self::lookup(self.block_merged_words, rest) {
            return at(piece, TensorKind::Weight, None, ExpertAxis::Outermost);
        }
        let rest = rest.strip_prefix("experts.")?;
        if let Some(word) = rest.strip_prefix("mlp.") {
            let piece = Self::lookup(self.expert_words, word)?;
            return at(piece, TensorKind::Weight, None, ExpertAxis::Flattened);
        }
        if let Some((expert, tail)) = layer_of(rest, "") {
            let (word, kind) = tail.strip_prefix('.')?.split_once('.')?;
            let piece = Self::lookup(self.expert_words, word)?;
            let kind = Self::kind(self.kind_words, kind)?;
            return at(piece, kind, Some(expert), ExpertAxis::Outermost);
        }
        if let Some(word) = rest.strip_suffix(".weight") {
            let piece = Self::lookup(self.expert_words, word)?;
            return at(piece, TensorKind::Weight, None, ExpertAxis::Outermost);
        }
        if let Some(piece) = Self::lookup(self.expert_words, rest) {
            return at(piece, TensorKind::Weight, None, ExpertAxis::Outermost);
        }
        // `{expert word}{suffix}`: gpt-oss's `gate_up_proj_bias`, `down_proj_blocks`, ….
        self.merged_kind_suffixes
            .iter()
            .find_map(|&(suffix, kind)| {
                let piece = Self::lookup(self.expert_words, rest.strip_suffix(suffix)?)?;
                at(piece, kind, None, ExpertAxis::Outermost)
            })
    }

    fn kind(words: &[(&str, TensorKind)], word: &str) -> Option<TensorKind> {
        words.iter().find(|(w, _)| *w == word).map(|(_, k)| *k)
    }
}

/// How a fused gate_up tensor holds an expert's gate and up (its slice is kept whole;
/// an engine reads it this way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GateUpLayout {
    /// Gate rows then up rows, `[2I, H]` per expert: transformers v5's stacked
    /// `gate_up_proj`, Granite's and JetMoE's `input_linear`, llama.cpp's
    /// `ffn_gate_up_exps`.
    GateThenUpRows,
    /// Gate columns then up columns, `[H, 2I]` per expert: Llama4, Qwen3-VL-MoE.
    GateThenUpColumns,
    /// Gate and up columns alternating, `[H, 2I]` per expert: gpt-oss (told apart from
    /// [`GateUpLayout::GateThenUpColumns`] by its `gate_up_proj_bias` beside it).
    Interleaved,
    /// Gate and up rows alternating, `[2I, …]` per expert: gpt-oss's original MXFP4
    /// `gate_up_proj_blocks` `[E, 2I, H/32, 16]` (with its `gate_up_proj_bias` beside).
    InterleavedRows,
    /// The shapes do not say.
    Unknown,
}

impl GateUpLayout {
    /// Its name in a report.
    pub fn name(&self) -> &'static str {
        match self {
            GateUpLayout::GateThenUpRows => "gate-then-up rows [2I, H]",
            GateUpLayout::GateThenUpColumns => "gate-then-up columns [H, 2I]",
            GateUpLayout::Interleaved => "interleaved gate/up [H, 2I]",
            GateUpLayout::InterleavedRows => "interleaved gate/up rows [2I, …]",
            GateUpLayout::Unknown => "unknown",
        }
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

/// One range of a checkpoint file holding part of a tensor: what a role of an expert
/// reads into its slot (the plan's view; the store reads it as a [`crate::store::Piece`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorPiece {
    pub(crate) tensor: usize,
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl TensorPiece {
    /// Index of the tensor it comes from in [`Checkpoint::tensors`].
    pub fn tensor(&self) -> usize {
        self.tensor
    }

    /// Index of its file in [`Checkpoint::files`].
    pub fn file(&self) -> usize {
        self.file
    }

    /// Absolute offset in that file.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Which slot a piece belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceRole {
    /// The weight slot.
    Weight,
    /// The scale slot.
    Scale,
}

/// One expert: its weight pieces and scale pieces, each in slot order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPieces {
    pub(crate) weights: Vec<TensorPiece>,
    pub(crate) scales: Vec<TensorPiece>,
}

impl ExpertPieces {
    /// The weight pieces in slot order (gate, up, down).
    pub fn weights(&self) -> &[TensorPiece] {
        &self.weights
    }

    /// The scale slot's pieces: the scales in the weights' order, then (in
    /// [`Naming::Generic`]) the expert's biases in the same order; empty without either.
    pub fn scales(&self) -> &[TensorPiece] {
        &self.scales
    }

    /// The pieces of one slot.
    pub fn pieces(&self, role: PieceRole) -> &[TensorPiece] {
        match role {
            PieceRole::Weight => &self.weights,
            PieceRole::Scale => &self.scales,
        }
    }
}

/// One MoE layer: its experts, all of one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlan {
    pub(crate) layer: usize,
    pub(crate) experts: Vec<ExpertPieces>,
    pub(crate) weight_bytes: u64,
    pub(crate) scale_bytes: u64,
    /// The naming's roles for this layer, in slot order, weights then scales.
    pub(crate) roles: Vec<(PieceRole, String)>,
    /// How a fused gate_up role holds gate and up, when the layer has one.
    pub(crate) gate_up: Option<GateUpLayout>,
    /// The share held, in a plan cut to one ([`ExpertPlan::share`]).
    pub(crate) share: Option<super::share::LayerShare>,
}

impl LayerPlan {
    /// The model layer number.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The experts, index = expert number (= slot; in a share, the slot of global
    /// expert [`LayerPlan::expert_id`]).
    pub fn experts(&self) -> &[ExpertPieces] {
        &self.experts
    }

    /// Bytes of one expert's weight slot (the sum of its weight pieces).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Bytes of one expert's scale slot (0 without scales).
    pub fn scale_bytes(&self) -> u64 {
        self.scale_bytes
    }

    /// The roles every expert of the layer has, in slot order (weights, then scales), as
    /// the naming calls them (`"gate_proj"`, ..., `"gate_proj scale"`, ...).
    pub fn roles(&self) -> impl Iterator<Item = (PieceRole, &str)> + '_ {
        self.roles.iter().map(|(r, n)| (*r, n.as_str()))
    }

    /// How the layer's fused gate_up role holds gate and up (`None`: no gate_up role).
    pub fn gate_up_layout(&self) -> Option<GateUpLayout> {
        self.gate_up
    }

    /// Whether every expert has one piece for each of the layer's roles (and the layer
    /// has experts and a weight role): what "complete" means in a report. A plan built
    /// by [`Naming::plan`] is complete or was an error; this checks the plan itself.
    pub fn is_complete(&self) -> bool {
        // A share's pieces were cut (one per row for columns): judged before the cut.
        if let Some(share) = &self.share {
            return share.complete && !self.experts.is_empty();
        }
        let want = |role| self.roles.iter().filter(|(r, _)| *r == role).count();
        let (weights, scales) = (want(PieceRole::Weight), want(PieceRole::Scale));
        weights > 0
            && !self.experts.is_empty()
            && self
                .experts
                .iter()
                .all(|e| e.weights.len() == weights && e.scales.len() == scales)
    }
}

/// The experts of a checkpoint under a naming: what the store packs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPlan {
    pub(crate) naming: String,
    pub(crate) layers: Vec<LayerPlan>,
    pub(crate) engine_tensors: usize,
    pub(crate) engine_bytes: u64,
}

impl ExpertPlan {
    /// The naming's name.
    pub fn naming(&self) -> &str {
        &self.naming
    }

    /// The MoE layers by increasing layer number (dense layers are absent).
    pub fn layers(&self) -> &[LayerPlan] {
        &self.layers
    }

    /// The layer with model layer number `layer`.
    pub fn layer(&self, layer: usize) -> Option<&LayerPlan> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Tensors that are not experts, left for the engine to load.
    pub fn engine_tensors(&self) -> usize {
        self.engine_tensors
    }

    /// Their bytes.
    pub fn engine_bytes(&self) -> u64 {
        self.engine_bytes
    }

    /// Whether every layer is complete ([`LayerPlan::is_complete`]): every expert of
    /// every layer has every role of the naming.
    pub fn is_complete(&self) -> bool {
        !self.layers.is_empty() && self.layers.iter().all(LayerPlan::is_complete)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (layer, expert, role, scale, axis)
    type Seen = (usize, Option<usize>, &'static str, bool, ExpertAxis);

    fn generic(name: &str) -> Option<Seen> {
        let (r, axis) = Naming::Generic.classify_axis(name)?;
        Some((
            r.layer,
            r.expert,
            GENERIC_ROLES[usize::from(r.piece)],
            r.scale,
            axis,
        ))
    }

    use ExpertAxis::{Flattened, Outermost};

    #[test]
    fn generic_names_of_every_family() {
        let cases: &[(&str, Seen)] = &[
            // Qwen3.5-MoE with vision, Qwen3-VL-MoE, other multimodal prefixes.
            (
                "model.language_model.layers.3.mlp.experts.7.up_proj.weight",
                (3, Some(7), "up", false, Outermost),
            ),
            (
                "model.language_model.layers.2.mlp.experts.gate_up_proj",
                (2, None, "gate_up", false, Outermost),
            ),
            (
                "language_model.model.layers.1.mlp.experts.down_proj",
                (1, None, "down", false, Outermost),
            ),
            // Llama4, Jamba, LFM2-MoE.
            (
                "language_model.model.layers.0.feed_forward.experts.gate_up_proj",
                (0, None, "gate_up", false, Outermost),
            ),
            (
                "model.layers.1.feed_forward.experts.3.gate_proj.weight",
                (1, Some(3), "gate", false, Outermost),
            ),
            (
                "model.layers.4.feed_forward.experts.0.w3.weight",
                (4, Some(0), "up", false, Outermost),
            ),
            (
                "model.layers.4.feed_forward.experts.0.w2.weight",
                (4, Some(0), "down", false, Outermost),
            ),
            // Granite (both layouts), JetMoE.
            (
                "model.layers.0.block_sparse_moe.input_linear.weight",
                (0, None, "gate_up", false, Outermost),
            ),
            (
                "model.layers.0.block_sparse_moe.output_linear.weight",
                (0, None, "down", false, Outermost),
            ),
            (
                "model.layers.5.block_sparse_moe.experts.gate_up_proj",
                (5, None, "gate_up", false, Outermost),
            ),
            (
                "model.layers.1.mlp.input_linear.weight",
                (1, None, "gate_up", false, Outermost),
            ),
            // DBRX, flattened.
            (
                "transformer.blocks.9.ffn.experts.mlp.v1",
                (9, None, "up", false, Flattened),
            ),
            (
                "transformer.blocks.9.ffn.experts.mlp.w2",
                (9, None, "down", false, Flattened),
            ),
            // GGUF, fused gate_up included; GPT-style h.N; scales.
            (
                "blk.12.ffn_gate_up_exps.weight",
                (12, None, "gate_up", false, Outermost),
            ),
            (
                "blk.0.ffn_down_exps.weight",
                (0, None, "down", false, Outermost),
            ),
            (
                "transformer.h.2.mlp.experts.1.w1.weight",
                (2, Some(1), "gate", false, Outermost),
            ),
            (
                "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv",
                (1, Some(0), "down", true, Outermost),
            ),
        ];
        for (name, want) in cases {
            assert_eq!(generic(name), Some(*want), "{name}");
        }
    }

    #[test]
    fn generic_biases_blocks_and_scales() {
        let at = |name: &str| {
            let (r, axis) = Naming::Generic.classify_axis(name)?;
            Some((r.layer, r.expert, r.piece, r.scale, axis))
        };
        type At = (usize, Option<usize>, u8, bool, ExpertAxis);
        let cases: &[(&str, At)] = &[
            // gpt-oss bf16 and MXFP4.
            (
                "model.layers.3.mlp.experts.gate_up_proj_bias",
                (3, None, GATE_UP + BIAS, true, Outermost),
            ),
            (
                "model.layers.3.mlp.experts.down_proj_bias",
                (3, None, DOWN + BIAS, true, Outermost),
            ),
            (
                "model.layers.3.mlp.experts.gate_up_proj_blocks",
                (3, None, GATE_UP, false, Outermost),
            ),
            (
                "model.layers.3.mlp.experts.down_proj_scales",
                (3, None, DOWN, true, Outermost),
            ),
            // GGUF.
            (
                "blk.2.ffn_up_exps.bias",
                (2, None, UP + BIAS, true, Outermost),
            ),
            (
                "blk.2.ffn_gate_exps.bias",
                (2, None, GATE + BIAS, true, Outermost),
            ),
            ("blk.2.ffn_up_exps.weight", (2, None, UP, false, Outermost)),
        ];
        for (name, want) in cases {
            assert_eq!(at(name), Some(*want), "{name}");
        }
        let n = |piece| Naming::Generic.role_name(piece, true);
        assert_eq!(n(GATE_UP), "gate_up scale");
        assert_eq!(n(GATE_UP + BIAS), "gate_up bias");
        assert_eq!(n(DOWN + BIAS), "down bias");
        assert_eq!(Naming::Generic.role_name(DOWN, false), "down");
    }

    #[test]
    fn generic_biases_are_required_for_every_weight_role() {
        let roles = |seen: &[(bool, u8)]| {
            let seen = seen.iter().copied().collect();
            Naming::Generic
                .required_roles(&seen)
                .into_iter()
                .map(|(s, p)| Naming::Generic.role_name(p, s))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            roles(&[(false, GATE_UP), (true, DOWN + BIAS)]),
            ["gate_up", "down", "gate_up bias", "down bias"]
        );
        assert_eq!(
            roles(&[(false, GATE_UP), (true, GATE_UP), (true, DOWN + BIAS)]),
            [
                "gate_up",
                "down",
                "gate_up scale",
                "down scale",
                "gate_up bias",
                "down bias"
            ]
        );
        assert_eq!(
            roles(&[(true, UP + BIAS)]),
            ["gate", "up", "down", "gate bias", "up bias", "down bias"]
        );
    }

    #[test]
    fn look_alikes_are_not_experts() {
        for name in [
            // Routers and their biases.
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.feed_forward.expert_bias",
            "model.layers.1.block_sparse_moe.router.layer.weight",
            "transformer.blocks.1.ffn.router.layer.weight",
            "blk.1.ffn_gate_inp.weight",
            "blk.1.exp_probs_b.bias",
            // Shared experts.
            "model.layers.1.mlp.shared_expert.gate_proj.weight",
            "model.layers.1.mlp.shared_experts.down_proj.weight",
            "model.layers.1.feed_forward.shared_expert.up_proj.weight",
            "blk.1.ffn_gate_shexp.weight",
            // JetMoE's attention experts, and its MoE bias.
            "model.layers.1.self_attention.experts.input_linear.weight",
            "model.layers.1.self_attention.experts.output_linear.weight",
            "model.layers.1.mlp.bias",
            // Dense MLPs, attention, a layer word inside another word, no number.
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.mylayers.0.mlp.experts.0.gate_proj.weight",
            "model.layers.x.mlp.experts.0.gate_proj.weight",
            "model.layers.1234567890.mlp.experts.0.gate_proj.weight",
            // Unknown kinds and roles.
            "model.layers.1.mlp.experts.0.gate_proj.bias",
            "model.layers.1.mlp.experts.0.gate_proj.input_scale",
            "model.layers.1.mlp.experts.gate_up_proj_weird",
            "model.layers.1.mlp.experts.gate_up_proj_bias.weight",
            "blk.1.ffn_gate_exps.scale",
            "blk.1.ffn_gate_exps",
            "model.layers.1.mlp.experts.0.fc1.weight",
            "",
            ".",
            "layers.",
            "layers.1",
            "layers.1.",
        ] {
            assert_eq!(generic(name), None, "{name}");
        }
    }

    #[test]
    fn generic_required_roles() {
        let roles = |seen: &[u8]| {
            let seen = seen.iter().map(|&p| (false, p)).collect();
            Naming::Generic
                .required_roles(&seen)
                .into_iter()
                .map(|(_, p)| GENERIC_ROLES[usize::from(p)])
                .collect::<Vec<_>>()
        };
        assert_eq!(roles(&[DOWN]), ["gate", "up", "down"]);
        assert_eq!(roles(&[GATE, DOWN]), ["gate", "up", "down"]);
        assert_eq!(roles(&[GATE_UP]), ["gate_up", "down"]);
        assert_eq!(roles(&[GATE_UP, UP]), ["gate", "up", "gate_up", "down"]);
    }
}
