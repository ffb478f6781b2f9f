//! The tensor-parallel convention by name (Megatron, vLLM, SGLang): which axis of each
//! weight a rank of a tensor-parallel group holds, for the Hugging Face and the GGUF
//! namings.
//!
//! A linear layer's weight is `[out, in]` (row-major; GGUF's `ne` reversed).
//! Column-parallel layers split the output dimension, so a rank holds **rows**:
//! `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, DeepSeek's `q_b_proj` and
//! `kv_b_proj`, the vocabulary-parallel `embed_tokens` and `lm_head`; GGUF's `attn_q`,
//! `attn_k`, `attn_v`, `attn_q_b`, `attn_kv_b`, `ffn_gate`, `ffn_up` (and their
//! `_shexp` shared-expert forms), `token_embd`, `output`; and their biases (1-D, cut
//! with the rows). Row-parallel layers split the input dimension, so a rank holds
//! **columns**: `o_proj`, `down_proj`; GGUF's `attn_output`, `ffn_down` (`_shexp`);
//! their biases stay whole (the all-reduce adds them once). Everything else is whole on
//! every rank: norms, routers (`mlp.gate`, `ffn_gate_inp`), DeepSeek's replicated
//! low-rank projections (`q_a_proj`, `kv_a_proj_with_mqa`; GGUF `attn_q_a`,
//! `attn_kv_a_mqa`), fused projections (`qkv_proj`, `gate_up_proj`, `attn_qkv`: their
//! parts would have to be cut one by one), every 1-D tensor not named above. Routed
//! experts follow the same split per role: gate and up their output dimension, down its
//! input dimension, on the axes each family stores them ([`Orientation`](crate::model::Orientation)).

use crate::model::SliceAxis;

/// Column-parallel modules (the output dimension split: rows held).
const COLUMN: [&str; 18] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "q_b_proj",
    "kv_b_proj",
    "gate_proj",
    "up_proj",
    "embed_tokens",
    "lm_head",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_q_b",
    "attn_kv_b",
    "ffn_gate",
    "ffn_up",
    "token_embd",
    "output",
];

/// Row-parallel modules (the input dimension split: columns held).
const ROW: [&str; 4] = ["o_proj", "down_proj", "attn_output", "ffn_down"];

/// Where a tensor goes under the tensor-parallel convention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TpCut {
    /// Its rows or columns are cut; `bias`: a 1-D bias cut with its layer's rows.
    Cut { axis: SliceAxis, bias: bool },
    /// Whole on every rank.
    Whole,
}

/// The module a tensor name belongs to and the parameter: `a.b.q_proj.weight` →
/// (`q_proj`, `weight`); a GGUF shared expert's `_shexp` suffix dropped.
fn module_of(name: &str) -> Option<(&str, &str)> {
    let (module, param) = name.rsplit_once('.')?;
    let module = module.rsplit('.').next().unwrap_or(module);
    Some((module.strip_suffix("_shexp").unwrap_or(module), param))
}

/// The convention's cut of dense tensor `name`.
pub(crate) fn tp_cut(name: &str) -> TpCut {
    let Some((module, param)) = module_of(name) else {
        return TpCut::Whole;
    };
    let bias = param == "bias";
    let weight = !bias && param.starts_with("weight");
    if COLUMN.contains(&module) && (weight || bias) {
        return TpCut::Cut {
            axis: SliceAxis::Rows,
            bias,
        };
    }
    if ROW.contains(&module) && weight {
        return TpCut::Cut {
            axis: SliceAxis::Columns,
            bias: false,
        };
    }
    TpCut::Whole
}

/// The axis of a routed expert's role under the convention, for a weight stored
/// `[out, in]`: gate and up (`gate_proj`, `up_proj`, Mixtral's `w1` and `w3`, GGUF's
/// `ffn_gate_exps`, `ffn_up_exps`) by rows (the output dimension); down (`down_proj`,
/// `w2`, `ffn_down_exps`) by columns (the input dimension); `None` for a role the
/// convention does not know (a fused `gate_up`). A role stored `[in, out]`
/// ([`Orientation::InOut`](crate::model::Orientation)) takes the other axis: the slicer
/// swaps it.
pub(crate) fn expert_axis(role: &str) -> Option<SliceAxis> {
    let role = role.split(' ').next().unwrap_or(role);
    let role = role.strip_suffix("_exps").unwrap_or(role);
    match role {
        "gate_proj" | "up_proj" | "w1" | "w3" | "ffn_gate" | "ffn_up" | "gate" | "up" => {
            Some(SliceAxis::Rows)
        }
        "down_proj" | "w2" | "ffn_down" | "down" => Some(SliceAxis::Columns),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_namings() {
        let rows = TpCut::Cut {
            axis: SliceAxis::Rows,
            bias: false,
        };
        let cols = TpCut::Cut {
            axis: SliceAxis::Columns,
            bias: false,
        };
        for (name, want) in [
            ("model.layers.0.self_attn.q_proj.weight", rows),
            ("model.layers.0.self_attn.o_proj.weight", cols),
            ("model.layers.0.mlp.down_proj.weight_scale_inv", cols),
            ("model.layers.3.mlp.shared_experts.up_proj.weight", rows),
            ("model.embed_tokens.weight", rows),
            ("lm_head.weight", rows),
            ("blk.0.attn_k.weight", rows),
            ("blk.0.ffn_down.weight", cols),
            ("blk.2.ffn_down_shexp.weight", cols),
            ("token_embd.weight", rows),
            ("output.weight", rows),
            ("model.layers.0.self_attn.o_proj.bias", TpCut::Whole),
            ("model.layers.0.input_layernorm.weight", TpCut::Whole),
            ("model.layers.1.mlp.gate.weight", TpCut::Whole),
            ("blk.1.ffn_gate_inp.weight", TpCut::Whole),
            ("output_norm.weight", TpCut::Whole),
            ("model.layers.0.self_attn.q_a_proj.weight", TpCut::Whole),
            ("model.layers.0.self_attn.qkv_proj.weight", TpCut::Whole),
        ] {
            assert_eq!(tp_cut(name), want, "{name}");
        }
        assert_eq!(
            tp_cut("model.layers.0.self_attn.v_proj.bias"),
            TpCut::Cut {
                axis: SliceAxis::Rows,
                bias: true
            }
        );
        assert_eq!(expert_axis("w2"), Some(SliceAxis::Columns));
        assert_eq!(expert_axis("ffn_up_exps"), Some(SliceAxis::Rows));
        assert_eq!(expert_axis("down_proj scale"), Some(SliceAxis::Columns));
        assert_eq!(expert_axis("gate_up_proj"), None);
    }
}
