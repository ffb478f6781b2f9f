//! Expert naming: which tensors are experts, of which layer, in which slot order; and the
//! [`ExpertPlan`] that results: per MoE layer, per expert, its weight and scale pieces as
//! (file, absolute offset, length). No bytes are read.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use super::{Checkpoint, TensorInfo};
use crate::error::{CheckpointFault, Error, Result};

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
        }
    }
}

impl fmt::Debug for CustomNaming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustomNaming")
            .field("name", &self.name)
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
    /// lists up to ten names that look like expert tensors (contain `expert` or `exps`).
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
    /// # Errors
    /// [`CheckpointFault::NoExperts`], [`CheckpointFault::Missing`] (a layer missing an
    /// expert, named), [`CheckpointFault::Shape`] (experts of one layer with different
    /// shapes or dtypes, a piece given twice, a fused tensor whose bytes do not divide by
    /// its expert count, fused tensors of one layer that disagree on it).
    pub fn plan(&self, checkpoint: &Checkpoint) -> Result<ExpertPlan> {
        build_plan(self, checkpoint)
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

fn no_experts(checkpoint: &Checkpoint, naming: &str) -> Error {
    let looks: Vec<&str> = checkpoint
        .tensors()
        .iter()
        .map(|t| t.name())
        .filter(|n| n.contains("expert") || n.contains("exps"))
        .take(10)
        .collect();
    let file = checkpoint
        .files()
        .first()
        .map(|f| f.path().display().to_string())
        .unwrap_or_default();
    let seen = if looks.is_empty() {
        "no tensor name contains \"expert\" or \"exps\"".to_owned()
    } else {
        format!("names that look like experts: {}", looks.join(", "))
    };
    Error::checkpoint(
        file,
        None,
        CheckpointFault::NoExperts,
        format!("{naming} recognises an expert tensor; {seen}"),
    )
}

/// One range of a file: part of an expert's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    tensor: usize,
    file: usize,
    offset: u64,
    len: u64,
}

impl Piece {
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
    weights: Vec<Piece>,
    scales: Vec<Piece>,
}

impl ExpertPieces {
    /// The weight pieces in slot order (gate, up, down).
    pub fn weights(&self) -> &[Piece] {
        &self.weights
    }

    /// The scale pieces in the same order (empty without scales).
    pub fn scales(&self) -> &[Piece] {
        &self.scales
    }

    /// The pieces of one slot.
    pub fn pieces(&self, role: PieceRole) -> &[Piece] {
        match role {
            PieceRole::Weight => &self.weights,
            PieceRole::Scale => &self.scales,
        }
    }
}

/// One MoE layer: its experts, all of one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerPlan {
    layer: usize,
    experts: Vec<ExpertPieces>,
    weight_bytes: u64,
    scale_bytes: u64,
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
}

/// The experts of a checkpoint under a naming: what the store packs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPlan {
    naming: String,
    layers: Vec<LayerPlan>,
    engine_tensors: usize,
    engine_bytes: u64,
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
}

#[derive(Default)]
struct LayerTensors {
    /// expert → (scale, piece) → tensor index
    per_expert: BTreeMap<usize, BTreeMap<(bool, u8), usize>>,
    /// (scale, piece) → tensor index, for tensors holding every expert.
    merged: BTreeMap<(bool, u8), usize>,
}

fn build_plan(naming: &Naming, checkpoint: &Checkpoint) -> Result<ExpertPlan> {
    let tensors = checkpoint.tensors();
    let file_of = |t: &TensorInfo| {
        checkpoint
            .files()
            .get(t.file())
            .map(|f| f.path().display().to_string())
            .unwrap_or_default()
    };
    let shape_fault = |t: &TensorInfo, why: String| {
        Error::checkpoint(file_of(t), Some(t.name()), CheckpointFault::Shape, why)
    };

    let mut layers: BTreeMap<usize, LayerTensors> = BTreeMap::new();
    let mut engine_tensors = 0;
    let mut engine_bytes = 0u64;
    for (index, t) in tensors.iter().enumerate() {
        let Some(r) = naming.classify(t.name()) else {
            engine_tensors += 1;
            engine_bytes += t.len();
            continue;
        };
        let layer = layers.entry(r.layer).or_default();
        let slot = match r.expert {
            Some(e) => layer.per_expert.entry(e).or_default(),
            None => &mut layer.merged,
        };
        if let Some(other) = slot.insert((r.scale, r.piece), index) {
            return Err(shape_fault(
                t,
                format!(
                    "the naming {:?} gives it the same place as {:?} (layer {}, piece {})",
                    naming.name(),
                    tensors[other].name(),
                    r.layer,
                    r.piece
                ),
            ));
        }
    }
    if layers.is_empty() {
        return Err(no_experts(
            checkpoint,
            &format!("the naming {:?}", naming.name()),
        ));
    }

    let mut plans = Vec::with_capacity(layers.len());
    for (layer, lt) in layers {
        let experts = if lt.merged.is_empty() {
            per_expert_layer(layer, &lt.per_expert, tensors, &shape_fault, &file_of)?
        } else if let Some((&e, pieces)) = lt.per_expert.iter().next() {
            let t = &tensors[*pieces.values().next().unwrap_or(&0)];
            return Err(shape_fault(
                t,
                format!(
                    "layer {layer} has both per-expert tensors (expert {e}) and tensors \
                     holding every expert"
                ),
            ));
        } else {
            merged_layer(layer, &lt.merged, tensors, &shape_fault)?
        };
        let bytes = |pieces: &[Piece]| pieces.iter().map(|p| p.len).sum::<u64>();
        let (weight_bytes, scale_bytes) = experts
            .first()
            .map(|e| (bytes(&e.weights), bytes(&e.scales)))
            .unwrap_or((0, 0));
        plans.push(LayerPlan {
            layer,
            experts,
            weight_bytes,
            scale_bytes,
        });
    }
    Ok(ExpertPlan {
        naming: naming.name().to_owned(),
        layers: plans,
        engine_tensors,
        engine_bytes,
    })
}

fn piece_of(tensors: &[TensorInfo], index: usize) -> Piece {
    let t = &tensors[index];
    Piece {
        tensor: index,
        file: t.file(),
        offset: t.offset(),
        len: t.len(),
    }
}

fn split_roles(pieces: impl Iterator<Item = ((bool, u8), Piece)>) -> ExpertPieces {
    let mut weights = Vec::new();
    let mut scales = Vec::new();
    // BTreeMap order: (false, piece) before (true, piece), each by piece.
    for ((scale, _), p) in pieces {
        if scale {
            scales.push(p)
        } else {
            weights.push(p)
        }
    }
    ExpertPieces { weights, scales }
}

fn per_expert_layer(
    layer: usize,
    experts: &BTreeMap<usize, BTreeMap<(bool, u8), usize>>,
    tensors: &[TensorInfo],
    shape_fault: &dyn Fn(&TensorInfo, String) -> Error,
    file_of: &dyn Fn(&TensorInfo) -> String,
) -> Result<Vec<ExpertPieces>> {
    let Some((_, first)) = experts.iter().next() else {
        return Ok(Vec::new());
    };
    let count = experts.keys().next_back().map_or(0, |&e| e + 1);
    let mut out = Vec::with_capacity(experts.len());
    for e in 0..count {
        let Some(pieces) = experts.get(&e) else {
            let t = &tensors[*first.values().next().unwrap_or(&0)];
            return Err(Error::checkpoint(
                file_of(t),
                None,
                CheckpointFault::Missing,
                format!(
                    "layer {layer} has experts up to {} but no tensor of expert {e}",
                    count - 1
                ),
            ));
        };
        // Same pieces, each of the same dtype, shape and length as expert 0's.
        for (key, &index) in first {
            let reference = &tensors[index];
            let Some(&mine) = pieces.get(key) else {
                let t = &tensors[*pieces.values().next().unwrap_or(&index)];
                return Err(shape_fault(
                    t,
                    format!(
                        "experts of one layer with different shapes: layer {layer} expert {e} \
                         has no counterpart of {:?}",
                        reference.name()
                    ),
                ));
            };
            let t = &tensors[mine];
            if t.dtype() != reference.dtype() || t.shape() != reference.shape() {
                return Err(shape_fault(
                    t,
                    format!(
                        "experts of one layer with different shapes: {} {:?} here, {} {:?} in \
                         {:?}",
                        t.dtype(),
                        t.shape(),
                        reference.dtype(),
                        reference.shape(),
                        reference.name()
                    ),
                ));
            }
        }
        if pieces.len() != first.len() {
            let extra = pieces.keys().find(|k| !first.contains_key(k));
            let t = &tensors[extra.and_then(|k| pieces.get(k)).copied().unwrap_or(0)];
            return Err(shape_fault(
                t,
                format!(
                    "experts of one layer with different shapes: layer {layer} expert {e} has \
                     a piece expert {} lacks",
                    experts.keys().next().copied().unwrap_or(0)
                ),
            ));
        }
        out.push(split_roles(
            pieces.iter().map(|(&k, &i)| (k, piece_of(tensors, i))),
        ));
    }
    Ok(out)
}

fn merged_layer(
    layer: usize,
    merged: &BTreeMap<(bool, u8), usize>,
    tensors: &[TensorInfo],
    shape_fault: &dyn Fn(&TensorInfo, String) -> Error,
) -> Result<Vec<ExpertPieces>> {
    let mut count: Option<(u64, &TensorInfo)> = None;
    for &index in merged.values() {
        let t = &tensors[index];
        let n = match t.outermost_dim() {
            Some(n) if n > 0 => n,
            _ => {
                return Err(shape_fault(
                    t,
                    format!(
                        "a tensor holding layer {layer}'s experts has shape {:?}",
                        t.shape()
                    ),
                ));
            }
        };
        if !t.len().is_multiple_of(n) || t.len() < n {
            return Err(shape_fault(
                t,
                format!("{} bytes do not divide into {n} non-empty experts", t.len()),
            ));
        }
        match count {
            Some((c, other)) if c != n => {
                return Err(shape_fault(
                    t,
                    format!(
                        "{n} experts here but {c} in {:?} of the same layer {layer}",
                        other.name()
                    ),
                ));
            }
            _ => count = Some((n, t)),
        }
    }
    let n = count.map_or(0, |(n, _)| n);
    // n ≤ the tensor's bytes ≤ the file's length: checked above.
    let mut out = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    for e in 0..n {
        out.push(split_roles(merged.iter().map(|(&k, &i)| {
            let t = &tensors[i];
            let per = t.len() / n;
            (
                k,
                Piece {
                    tensor: i,
                    file: t.file(),
                    offset: t.offset() + e * per,
                    len: per,
                },
            )
        })));
    }
    Ok(out)
}
