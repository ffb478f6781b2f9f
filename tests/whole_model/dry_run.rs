//! The counted figure of docs/whole-model.md: DeepSeek-V3's real tensor list (the MTP
//! layer included) as a sparse safetensors header, priced for 4 nodes with nothing
//! reserved.

use super::*;

/// DeepSeek-V3's real tensor list (the FP8 checkpoint's names, dtypes and shapes; 61
/// layers, the first 3 dense, 256 routed experts and a shared expert per MoE layer; the
/// MTP layer 61 left out), as a header over a hole: ~690 GB that cost no disk.
fn deepseek_v3_tensors() -> Vec<(String, &'static str, Vec<u64>, u64)> {
    let mut t = Vec::new();
    let mut add = |name: String, dtype: &'static str, shape: Vec<u64>| {
        let elements: u64 = shape.iter().product();
        let bytes = match dtype {
            "BF16" => elements * 2,
            "F32" => elements * 4,
            _ => elements,
        };
        t.push((name, dtype, shape, bytes));
    };
    let fp8 = |add: &mut dyn FnMut(String, &'static str, Vec<u64>),
               name: String,
               rows: u64,
               cols: u64| {
        add(format!("{name}.weight"), "F8_E4M3", vec![rows, cols]);
        add(
            format!("{name}.weight_scale_inv"),
            "F32",
            vec![rows.div_ceil(128), cols.div_ceil(128)],
        );
    };
    add(
        "model.embed_tokens.weight".into(),
        "BF16",
        vec![129280, 7168],
    );
    // Layers 0–60 and the multi-token-prediction layer 61: a MoE decoder layer with the
    // MTP's own embedding, two norms, `eh_proj` (BF16, no scale grid) and head.
    for l in 0..62 {
        let p = format!("model.layers.{l}");
        if l == 61 {
            add(
                format!("{p}.embed_tokens.weight"),
                "BF16",
                vec![129280, 7168],
            );
            add(format!("{p}.enorm.weight"), "BF16", vec![7168]);
            add(format!("{p}.hnorm.weight"), "BF16", vec![7168]);
            add(format!("{p}.eh_proj.weight"), "BF16", vec![7168, 14336]);
            add(format!("{p}.shared_head.norm.weight"), "BF16", vec![7168]);
            add(
                format!("{p}.shared_head.head.weight"),
                "BF16",
                vec![129280, 7168],
            );
        }
        add(format!("{p}.input_layernorm.weight"), "BF16", vec![7168]);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            "BF16",
            vec![7168],
        );
        let a = format!("{p}.self_attn");
        fp8(&mut add, format!("{a}.q_a_proj"), 1536, 7168);
        add(format!("{a}.q_a_layernorm.weight"), "BF16", vec![1536]);
        fp8(&mut add, format!("{a}.q_b_proj"), 24576, 1536);
        fp8(&mut add, format!("{a}.kv_a_proj_with_mqa"), 576, 7168);
        add(format!("{a}.kv_a_layernorm.weight"), "BF16", vec![512]);
        fp8(&mut add, format!("{a}.kv_b_proj"), 32768, 512);
        fp8(&mut add, format!("{a}.o_proj"), 7168, 16384);
        let m = format!("{p}.mlp");
        if l < 3 {
            fp8(&mut add, format!("{m}.gate_proj"), 18432, 7168);
            fp8(&mut add, format!("{m}.up_proj"), 18432, 7168);
            fp8(&mut add, format!("{m}.down_proj"), 7168, 18432);
            continue;
        }
        add(format!("{m}.gate.weight"), "BF16", vec![256, 7168]);
        add(
            format!("{m}.gate.e_score_correction_bias"),
            "F32",
            vec![256],
        );
        for e in std::iter::once("shared_experts".to_owned())
            .chain((0..256).map(|e| format!("experts.{e}")))
        {
            fp8(&mut add, format!("{m}.{e}.gate_proj"), 2048, 7168);
            fp8(&mut add, format!("{m}.{e}.up_proj"), 2048, 7168);
            fp8(&mut add, format!("{m}.{e}.down_proj"), 7168, 2048);
        }
    }
    add("model.norm.weight".into(), "BF16", vec![7168]);
    add("lm_head.weight".into(), "BF16", vec![129280, 7168]);
    t
}

/// The counted figure of docs/whole-model.md: the mappings and `mbind` calls each plan
/// costs for DeepSeek-V3's tensor list over 4 nodes, against one mapping per tensor per
/// copy, by a dry run (nothing reserved). The expected figures are counted here from the
/// model's shape, not taken from the code. 62 layers: 0–2 dense, 3–60 MoE, and the MTP
/// layer 61 (MoE, plus its embedding, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and
/// `shared_head.head`). 192 dense groups: attention 62, norms and routers 62 + the final
/// norm, dense MLP 3 + layer 61's `eh_proj`, shared experts 59, embeddings 1 + layer 61's,
/// head 1 + layer 61's; 59 MoE layers × 2 kinds (weights, scales); dense tensors 1,367
/// (per MoE layer 22: 2 norms, 12 attention, 2 router, 6 shared; per dense layer 22: 2
/// norms, 12 attention, 6 MLP; 6 MTP extras; 3 globals); expert tensors 90,624
/// (59 × 256 × 3 × 2). 91,991 tensors in all.
#[test]
fn deepseek_v3_dry_run_counts() {
    let dir = temp("deepseek-v3");
    let path = dir.join("model.safetensors");
    let tensors = deepseek_v3_tensors();
    assert_eq!(tensors.len(), 91_991);
    sparse_checkpoint(&path, &tensors);
    let checkpoint = Checkpoint::open(&path).unwrap();
    // Four nodes that need not exist here: a dry run prices a machine it is not on.
    let four = NodeSet::from_nodes(0..4).unwrap();
    let (dense_groups, moe_kinds, dense_tensors, expert_tensors) = (192, 59 * 2, 1_367, 90_624);
    let (split, replicate) = (Layout::SplitExperts(four), DenseLayout::Replicate(four));
    let interleave = DenseLayout::Interleave(four);
    let plans = [
        (
            "experts=split:0-3;dense=replicate:0-3",
            PlacementPlan::new(split, replicate),
            dense_groups * 4 + moe_kinds * 4,
            dense_tensors * 4 + expert_tensors,
        ),
        (
            "experts=split:0-3;dense=replicate:0-3;embeddings=interleave:0-3",
            PlacementPlan::new(split, replicate).class(TensorClass::Embeddings, interleave),
            // Two embedding groups (the model's and the MTP layer's), one tensor each.
            (dense_groups - 2) * 4 + 2 + moe_kinds * 4,
            (dense_tensors - 2) * 4 + 2 + expert_tensors,
        ),
        (
            "experts=split:0-3;dense=interleave:0-3",
            PlacementPlan::new(split, interleave),
            dense_groups + moe_kinds * 4,
            dense_tensors + expert_tensors,
        ),
        (
            "experts=interleave:0-3;dense=interleave:0-3",
            PlacementPlan::new(Layout::Interleave(four), interleave),
            dense_groups + moe_kinds,
            dense_tensors + expert_tensors,
        ),
        (
            "experts=replicate:0-3;dense=replicate:0-3",
            PlacementPlan::new(Layout::Replicate(four), replicate),
            (dense_groups + moe_kinds) * 4,
            (dense_tensors + expert_tensors) * 4,
        ),
    ];
    let mut out = String::new();
    for (text, plan, mappings, per_tensor) in plans {
        let cost = checkpoint
            .placement_cost(&plan, &StoreOptions::default())
            .unwrap();
        assert_eq!(cost.mappings, mappings, "{text}");
        assert_eq!(cost.mbind_calls, mappings, "{text}: one mbind per mapping");
        assert_eq!(cost.per_tensor_mappings, per_tensor, "{text}");
        let busiest = cost.node_bytes.values().max().copied().unwrap_or(0);
        out.push_str(&format!(
            "| `{text}` | {} | {} | {} | {:.1} GiB |\n",
            cost.mappings,
            cost.mbind_calls,
            cost.per_tensor_mappings,
            busiest as f64 / (1u64 << 30) as f64
        ));
        if text.contains("embeddings") {
            for c in &cost.classes {
                out.push_str(&format!(
                    "|  {} | {} | {} tensors, {} groups | {} mappings, {} mbind | {} per tensor |\n",
                    c.class, c.layout, c.tensors, c.groups, c.mappings, c.mbind_calls, c.per_tensor_mappings
                ));
            }
        }
    }
    let _ = writeln!(std::io::stderr(), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}
