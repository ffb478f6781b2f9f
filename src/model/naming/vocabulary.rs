//! [`Naming::Generic`]'s vocabulary of MoE tensor names, as data, and the reading of a
//! name against it: kept apart from the presets because it is a small parser of its own.

use super::{Naming, TensorKind, TensorRef, layer_of};

impl Naming {
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
        flattened_input_first: &["w2"],
    };
}

/// [`Naming::Generic`]'s pieces: slot order gate, up, gate_up, down.
pub(super) const GATE: u8 = 0;
pub(super) const UP: u8 = 1;
pub(super) const GATE_UP: u8 = 2;
pub(super) const DOWN: u8 = 3;
/// A role's bias is its piece plus this, in the scale slot (after every scale).
pub(super) const BIAS: u8 = 4;
pub(super) const GENERIC_ROLES: [&str; 4] = ["gate", "up", "gate_up", "down"];

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
    /// The expert words of flattened tensors (`experts.mlp.{word}`, `[E·I, H]`) stored
    /// input dimension first, `[in, out]` per expert (DBRX's `w2`, applied as `x @ W`);
    /// the other flattened words are `[out, in]` (`w1`, `v1`, applied as `x @ W.T`).
    pub flattened_input_first: &'static [&'static str],
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
    pub(super) fn classify(&self, name: &str) -> Option<(TensorRef, ExpertAxis)> {
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

    /// How tensor `name` stores each expert's weight, when its name says: a flattened
    /// tensor by [`Vocabulary::flattened_input_first`], a per-expert tensor
    /// (`experts.{E}.…`) `[out, in]`; `None` for the rest (a tensor holding every expert
    /// outermost is stored either way under one name: its layer's shapes decide).
    pub(super) fn orientation(&self, name: &str) -> Option<super::Orientation> {
        let (r, axis) = self.classify(name)?;
        if axis == ExpertAxis::Flattened {
            let word = name.rsplit('.').next().unwrap_or(name);
            return Some(if self.flattened_input_first.contains(&word) {
                super::Orientation::InOut
            } else {
                super::Orientation::OutIn
            });
        }
        r.expert.map(|_| super::Orientation::OutIn)
    }

    fn kind(words: &[(&str, TensorKind)], word: &str) -> Option<TensorKind> {
        words.iter().find(|(w, _)| *w == word).map(|(_, k)| *k)
    }
}
