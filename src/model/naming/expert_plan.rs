//! The plan's types: per MoE layer, per expert, its pieces as (file, offset, length);
//! what [`Naming::plan`](super::Naming::plan) returns and the store packs.

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

/// One range of a checkpoint file holding part of a tensor: what a role of an expert
/// reads into its slot (the plan's view; the store reads it as a [`crate::store::Piece`]).
///
/// 24 bytes: a column cut has one per sliced row of each expert (8 layers × 32 experts ×
/// 1024 rows of `down_proj` are 262,144 of them, kept for the views, the verification and
/// the export), so the indices are `u32` (a larger one is refused by name where a piece is made).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorPiece {
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) tensor: u32,
    pub(crate) file: u32,
}

impl TensorPiece {
    /// The piece of tensor `tensor` in file `file` at `offset`, `len` bytes.
    ///
    /// # Errors
    /// An index above `u32::MAX` (no checkpoint has that many tensors or files).
    pub(crate) fn new(
        tensor: usize,
        file: usize,
        offset: u64,
        len: u64,
    ) -> crate::error::Result<Self> {
        let index = |what: &str, i: usize| {
            u32::try_from(i).map_err(|_| {
                crate::error::Error::overflow(
                    "TensorPiece::new",
                    format!("{what} index {i} of a piece at offset {offset} as a u32"),
                )
            })
        };
        Ok(TensorPiece {
            offset,
            len,
            tensor: index("tensor", tensor)?,
            file: index("file", file)?,
        })
    }

    /// Index of the tensor it comes from in
    /// [`Checkpoint::tensors`](crate::model::Checkpoint::tensors).
    pub fn tensor(&self) -> usize {
        self.tensor as usize
    }

    /// Index of its file in [`Checkpoint::files`](crate::model::Checkpoint::files).
    pub fn file(&self) -> usize {
        self.file as usize
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
    /// [`Naming::Generic`](super::Naming::Generic)) the expert's biases in the same
    /// order; empty without either.
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
    /// The same roles' canonical names ([`Naming::canonical_role`](super::Naming::canonical_role)).
    pub(crate) canonical: Vec<String>,
    /// How a fused gate_up role holds gate and up, when the layer has one.
    pub(crate) gate_up: Option<GateUpLayout>,
    /// How each role (as `roles`) stores an expert's weight.
    pub(crate) orientations: Vec<super::Orientation>,
    /// The share held, in a plan cut to one ([`ExpertPlan::share`]).
    pub(crate) share: Option<crate::model::share::LayerShare>,
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

    /// The same roles under their canonical names, in [`LayerPlan::roles`]' order
    /// (`"gate"`, `"up"`, `"down"`, `"gate.scale"`, ...: the same for every naming,
    /// [`Naming::canonical_role`](super::Naming::canonical_role)).
    pub(crate) fn canonical_roles(&self) -> impl Iterator<Item = &str> + '_ {
        self.canonical.iter().map(String::as_str)
    }

    /// The index in [`LayerPlan::roles`] of the role called `name`, by its canonical
    /// name or as the file's naming calls it.
    pub fn role_index(&self, name: &str) -> Option<usize> {
        self.canonical
            .iter()
            .position(|c| c == name)
            .or_else(|| self.roles.iter().position(|(_, n)| n == name))
    }

    /// How each role stores an expert's weight, in [`LayerPlan::roles`]' order (a scale
    /// or bias as its weight): what the naming says by name
    /// ([`Naming::orientation`](super::Naming::orientation)), else the layer's shapes
    /// (`[H, 2I]` gate_up beside `[I, H]` down: `[in, out]`; otherwise `[out, in]`).
    pub fn orientations(&self) -> &[super::Orientation] {
        &self.orientations
    }

    /// How the layer's fused gate_up role holds gate and up (`None`: no gate_up role).
    pub fn gate_up_layout(&self) -> Option<GateUpLayout> {
        self.gate_up
    }

    /// Whether every expert has one piece for each of the layer's roles (and the layer
    /// has experts and a weight role): what "complete" means in a report. A plan built
    /// by [`Naming::plan`](super::Naming::plan) is complete or was an error; this checks
    /// the plan itself.
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

    #[test]
    fn a_piece_is_24_bytes_and_refuses_indices_above_u32() {
        assert_eq!(std::mem::size_of::<TensorPiece>(), 24);
        let p = TensorPiece::new(7, 3, 1 << 40, 5 << 33).unwrap();
        assert_eq!(
            (p.tensor(), p.file(), p.offset(), p.len()),
            (7, 3, 1 << 40, 5 << 33)
        );
        let top = u32::MAX as usize;
        let p = TensorPiece::new(top, top, 0, 1).unwrap();
        assert_eq!((p.tensor(), p.file()), (top, top));
        let e = TensorPiece::new(top + 1, 0, 0, 1).unwrap_err().to_string();
        assert!(
            e.contains("TensorPiece::new") && e.contains("tensor index 4294967296"),
            "{e}"
        );
        let e = TensorPiece::new(0, top + 1, 0, 1).unwrap_err().to_string();
        assert!(e.contains("file index 4294967296"), "{e}");
    }
}
