//! [`TensorClass`]: what a tensor is for, from its name alone, over the name families
//! the expert namings know (Hugging Face safetensors names and llama.cpp's GGUF names).
//!
//! Routed experts are not classified here: they are the tensors the expert naming puts
//! in its plan. Every other tensor gets exactly one class; nothing is dropped: a
//! per-layer tensor no rule claims is [`TensorClass::DenseMlp`] (per-layer dense), a
//! global one [`TensorClass::Global`].

use std::fmt;

/// What a tensor is for, as its name says. `#[non_exhaustive]`: classes can be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum TensorClass {
    /// The routed experts: the tensors of the expert naming's plan, placed by the store's
    /// [`Layout`](crate::store::Layout).
    RoutedExperts,
    /// Shared experts, read by every token (`mlp.shared_experts.*`, Qwen's
    /// `shared_expert.*` and `shared_expert_gate`, GGUF `ffn_*_shexp`).
    SharedExperts,
    /// Attention projections (`self_attn.*`, `attention.*`, GGUF `attn_*` but its norms).
    Attention,
    /// The dense feed-forward of non-MoE layers (`mlp.gate_proj`, GGUF `ffn_gate`), and
    /// every per-layer tensor no other class claims (MTP's `eh_proj`, …).
    DenseMlp,
    /// Norms (`*norm*`, `ln_*`) and MoE routers (`mlp.gate`, `router`, GGUF
    /// `ffn_gate_inp`, `exp_probs_b`, DeepSeek's `e_score_correction_bias`): small, read
    /// by every token.
    NormsAndRouters,
    /// Token embeddings (`embed_tokens`, GGUF `token_embd`, `wte`, …): a token reads a
    /// few rows.
    Embeddings,
    /// The output head (`lm_head`, GGUF `output.weight`, `embed_out`, MTP's
    /// `shared_head.head`).
    OutputHead,
    /// A global tensor (outside any layer) no other class claims.
    Global,
}

impl TensorClass {
    /// Every class, in report order.
    pub const ALL: [TensorClass; 8] = [
        TensorClass::RoutedExperts,
        TensorClass::SharedExperts,
        TensorClass::Attention,
        TensorClass::DenseMlp,
        TensorClass::NormsAndRouters,
        TensorClass::Embeddings,
        TensorClass::OutputHead,
        TensorClass::Global,
    ];

    /// The classes of dense tensors (all but [`TensorClass::RoutedExperts`]).
    pub const DENSE: [TensorClass; 7] = [
        TensorClass::SharedExperts,
        TensorClass::Attention,
        TensorClass::DenseMlp,
        TensorClass::NormsAndRouters,
        TensorClass::Embeddings,
        TensorClass::OutputHead,
        TensorClass::Global,
    ];

    /// The dense classes a [`PlacementPlan::dense_slice`](super::PlacementPlan::dense_slice)
    /// cuts (their 2-D weights; 1-D tensors stay whole): norms and routers and unclaimed
    /// globals are replicated whole.
    pub const SLICEABLE: [TensorClass; 5] = [
        TensorClass::SharedExperts,
        TensorClass::Attention,
        TensorClass::DenseMlp,
        TensorClass::Embeddings,
        TensorClass::OutputHead,
    ];

    /// Its name in plans and reports: `experts`, `shared`, `attention`, `dense_mlp`,
    /// `norms`, `embeddings`, `head`, `global`.
    pub fn name(self) -> &'static str {
        match self {
            TensorClass::RoutedExperts => "experts",
            TensorClass::SharedExperts => "shared",
            TensorClass::Attention => "attention",
            TensorClass::DenseMlp => "dense_mlp",
            TensorClass::NormsAndRouters => "norms",
            TensorClass::Embeddings => "embeddings",
            TensorClass::OutputHead => "head",
            TensorClass::Global => "global",
        }
    }

    /// The class called `name` (see [`TensorClass::name`]).
    pub fn from_name(name: &str) -> Option<TensorClass> {
        TensorClass::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The class and model layer of a tensor that is not a routed expert, from its name.
    ///
    /// ```
    /// use numapin::model::TensorClass;
    /// assert_eq!(TensorClass::of("blk.3.attn_q.weight"), (TensorClass::Attention, Some(3)));
    /// assert_eq!(TensorClass::of("blk.3.attn_norm.weight"), (TensorClass::NormsAndRouters, Some(3)));
    /// assert_eq!(TensorClass::of("model.layers.1.mlp.shared_experts.up_proj.weight").0,
    ///            TensorClass::SharedExperts);
    /// assert_eq!(TensorClass::of("output.weight"), (TensorClass::OutputHead, None));
    /// assert_eq!(TensorClass::of("rope_freqs.weight"), (TensorClass::Global, None));
    /// ```
    pub fn of(name: &str) -> (TensorClass, Option<usize>) {
        let words: Vec<&str> = name.split('.').collect();
        let (layer, rest) = layer_of(&words);
        (class_of(rest, layer.is_some()), layer)
    }
}

impl fmt::Display for TensorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The words that precede a layer number (the expert vocabulary's, and `layer`).
const LAYER_WORDS: [&str; 5] = ["layers", "blocks", "h", "blk", "layer"];

/// The layer number and the words after it; no layer: `None` and every word.
fn layer_of<'a, 'b>(words: &'b [&'a str]) -> (Option<usize>, &'b [&'a str]) {
    for (i, pair) in words.windows(2).enumerate() {
        if LAYER_WORDS.contains(&pair[0])
            && !pair[1].is_empty()
            && pair[1].bytes().all(|b| b.is_ascii_digit())
            && let Ok(n) = pair[1].parse::<usize>()
        {
            return (Some(n), &words[i + 2..]);
        }
    }
    (None, words)
}

/// The class of a tensor whose words (after its layer number, if any) are `rest`.
fn class_of(rest: &[&str], in_layer: bool) -> TensorClass {
    let has = |f: &dyn Fn(&str) -> bool| rest.iter().any(|w| f(w));
    if has(&|w| w.contains("shared_expert") || w.ends_with("_shexp")) {
        return TensorClass::SharedExperts;
    }
    let router = |w: &str| {
        matches!(
            w,
            "gate" | "router" | "ffn_gate_inp" | "exp_probs_b" | "e_score_correction_bias"
        )
    };
    if has(&router) || has(&|w| w.contains("norm") || w.starts_with("ln_")) {
        return TensorClass::NormsAndRouters;
    }
    let head = rest.first() == Some(&"output") && !in_layer;
    if head || has(&|w| w == "lm_head" || w == "embed_out" || w == "shared_head") {
        return TensorClass::OutputHead;
    }
    if has(&|w| w.contains("embed") || w.contains("embd") || w == "wte" || w == "wpe") {
        return TensorClass::Embeddings;
    }
    if has(&|w| w.contains("attn") || w.contains("attention")) {
        return TensorClass::Attention;
    }
    if in_layer {
        TensorClass::DenseMlp
    } else {
        TensorClass::Global
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_both_families() {
        use TensorClass::*;
        let cases = [
            ("model.embed_tokens.weight", Embeddings, None),
            ("token_embd.weight", Embeddings, None),
            ("lm_head.weight", OutputHead, None),
            ("output.weight", OutputHead, None),
            ("output_norm.weight", NormsAndRouters, None),
            ("model.norm.weight", NormsAndRouters, None),
            ("model.layers.0.self_attn.q_proj.weight", Attention, Some(0)),
            (
                "model.layers.7.self_attn.kv_a_layernorm.weight",
                NormsAndRouters,
                Some(7),
            ),
            (
                "model.layers.0.input_layernorm.weight",
                NormsAndRouters,
                Some(0),
            ),
            ("model.layers.0.mlp.gate_proj.weight", DenseMlp, Some(0)),
            (
                "model.layers.0.mlp.gate_proj.weight_scale_inv",
                DenseMlp,
                Some(0),
            ),
            ("model.layers.3.mlp.gate.weight", NormsAndRouters, Some(3)),
            (
                "model.layers.3.mlp.gate.e_score_correction_bias",
                NormsAndRouters,
                Some(3),
            ),
            (
                "model.layers.3.mlp.shared_experts.down_proj.weight",
                SharedExperts,
                Some(3),
            ),
            (
                "model.layers.3.mlp.shared_expert_gate.weight",
                SharedExperts,
                Some(3),
            ),
            (
                "model.layers.3.block_sparse_moe.gate.weight",
                NormsAndRouters,
                Some(3),
            ),
            ("model.layers.61.eh_proj.weight", DenseMlp, Some(61)),
            ("model.layers.61.embed_tokens.weight", Embeddings, Some(61)),
            (
                "model.layers.61.shared_head.head.weight",
                OutputHead,
                Some(61),
            ),
            ("model.layers.61.enorm.weight", NormsAndRouters, Some(61)),
            ("blk.2.attn_q.weight", Attention, Some(2)),
            ("blk.2.attn_kv_a_mqa.weight", Attention, Some(2)),
            ("blk.2.attn_norm.weight", NormsAndRouters, Some(2)),
            ("blk.2.ffn_norm.weight", NormsAndRouters, Some(2)),
            ("blk.2.ffn_gate_inp.weight", NormsAndRouters, Some(2)),
            ("blk.2.exp_probs_b.bias", NormsAndRouters, Some(2)),
            ("blk.2.ffn_gate_shexp.weight", SharedExperts, Some(2)),
            ("blk.0.ffn_gate.weight", DenseMlp, Some(0)),
            ("transformer.h.4.attn.c_attn.weight", Attention, Some(4)),
            ("transformer.wte.weight", Embeddings, None),
            ("transformer.h.4.ln_1.weight", NormsAndRouters, Some(4)),
            ("rope_freqs.weight", Global, None),
            ("", Global, None),
            ("blk..x", Global, None),
            ("blk.99999999999999999999999.x", Global, None),
        ];
        for (name, class, layer) in cases {
            assert_eq!(TensorClass::of(name), (class, layer), "{name}");
        }
    }

    #[test]
    fn names_round_trip() {
        for c in TensorClass::ALL {
            assert_eq!(TensorClass::from_name(c.name()), Some(c));
        }
        assert_eq!(TensorClass::from_name("nope"), None);
    }
}
