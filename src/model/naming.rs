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
    /// A scale tensor (goes to the scale slot) rather than a weight.
    pub scale: bool,
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
    /// A naming built by the user.
    Custom(CustomNaming),
}

impl Naming {
    /// The presets, in detection order.
    pub const PRESETS: [Naming; 4] = [
        Naming::PerExpert,
        Naming::Mixtral,
        Naming::Fused,
        Naming::GgufMerged,
    ];

    /// Its name (`"per-expert"`, `"mixtral"`, `"fused"`, `"gguf-merged"`, or the custom
    /// one's).
    pub fn name(&self) -> &str {
        match self {
            Naming::PerExpert => "per-expert",
            Naming::Mixtral => "mixtral",
            Naming::Fused => "fused",
            Naming::GgufMerged => "gguf-merged",
            Naming::Custom(c) => &c.name,
        }
    }

    /// What this naming says about the tensor called `name`.
    pub fn classify(&self, name: &str) -> Option<TensorRef> {
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
            Naming::Custom(_) => &[],
        };
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
            Naming::Custom(_) => &[],
        };
        let mut roles = seen.clone();
        roles.extend(weights.iter().map(|&p| (false, p)));
        if seen.iter().any(|&(scale, _)| scale) {
            roles.extend(weights.iter().map(|&p| (true, p)));
        }
        if let Naming::Custom(c) = self {
            roles.extend(c.roles.iter().copied());
        }
        roles
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
    Error::checkpoint(
        file,
        None,
        CheckpointFault::NoExperts,
        format!("{naming} recognises an expert tensor; {seen}"),
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

    /// The scale pieces in the same order (empty without scales).
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
}

impl LayerPlan {
    /// The model layer number.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The experts, index = expert number.
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

    /// Whether every expert has one piece for each of the layer's roles (and the layer
    /// has experts and a weight role): what "complete" means in a report. A plan built
    /// by [`Naming::plan`] is complete or was an error; this checks the plan itself.
    pub fn is_complete(&self) -> bool {
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
