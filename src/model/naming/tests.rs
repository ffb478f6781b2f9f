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
