#!/usr/bin/env python3
"""Writes a DeepSeek-V3-shaped checkpoint for the planner: the real tensor names, dtypes
and shapes of deepseek-ai/DeepSeek-V3 (61 layers, the first 3 dense, 58 MoE layers of 256
routed experts + 1 shared expert, FP8 E4M3 weights with F32 128x128 block scales
`weight_scale_inv`, BF16 norms, router, embeddings and head; the multi-token-prediction
layer 61 is left out), as a *sparse* file: the header is real, the ~640 GiB of data are a
hole (no disk is used, nothing is ever read by `--plan-only`).

    python3 docs/planner/deepseek_v3_header.py OUT_DIR
    cargo run --release --example pin_model -- --model OUT_DIR --plan-only \
        --topology docs/planner/nps4_2socket.json [--routing trace.json]

Standard library only.
"""
import json
import math
import os
import struct
import sys

H, I_DENSE, I_MOE, VOCAB = 7168, 18432, 2048, 129280
Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD, HEADS = 1536, 512, 64, 128, 128, 128
LAYERS, DENSE, EXPERTS = 61, 3, 256
SIZE = {"F8_E4M3": 1, "BF16": 2, "F32": 4}


def tensors():
    out = [("model.embed_tokens.weight", "BF16", [VOCAB, H])]

    def fp8(name, rows, cols):
        out.append((f"{name}.weight", "F8_E4M3", [rows, cols]))
        out.append((f"{name}.weight_scale_inv", "F32",
                    [math.ceil(rows / 128), math.ceil(cols / 128)]))

    for l in range(LAYERS):
        p = f"model.layers.{l}"
        out.append((f"{p}.input_layernorm.weight", "BF16", [H]))
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", [H]))
        a = f"{p}.self_attn"
        fp8(f"{a}.q_a_proj", Q_LORA, H)
        out.append((f"{a}.q_a_layernorm.weight", "BF16", [Q_LORA]))
        fp8(f"{a}.q_b_proj", HEADS * (NOPE + ROPE), Q_LORA)
        fp8(f"{a}.kv_a_proj_with_mqa", KV_LORA + ROPE, H)
        out.append((f"{a}.kv_a_layernorm.weight", "BF16", [KV_LORA]))
        fp8(f"{a}.kv_b_proj", HEADS * (NOPE + V_HEAD), KV_LORA)
        fp8(f"{a}.o_proj", H, HEADS * V_HEAD)
        m = f"{p}.mlp"
        if l < DENSE:
            fp8(f"{m}.gate_proj", I_DENSE, H)
            fp8(f"{m}.up_proj", I_DENSE, H)
            fp8(f"{m}.down_proj", H, I_DENSE)
            continue
        out.append((f"{m}.gate.weight", "BF16", [EXPERTS, H]))
        out.append((f"{m}.gate.e_score_correction_bias", "F32", [EXPERTS]))
        fp8(f"{m}.shared_experts.gate_proj", I_MOE, H)
        fp8(f"{m}.shared_experts.up_proj", I_MOE, H)
        fp8(f"{m}.shared_experts.down_proj", H, I_MOE)
        for e in range(EXPERTS):
            fp8(f"{m}.experts.{e}.gate_proj", I_MOE, H)
            fp8(f"{m}.experts.{e}.up_proj", I_MOE, H)
            fp8(f"{m}.experts.{e}.down_proj", H, I_MOE)
    out.append(("model.norm.weight", "BF16", [H]))
    out.append(("lm_head.weight", "BF16", [VOCAB, H]))
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    os.makedirs(root, exist_ok=True)
    header, offset = {}, 0
    for name, dtype, shape in tensors():
        n = SIZE[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = os.path.join(root, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + offset)  # a hole: the data are never read
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                   "num_hidden_layers": LAYERS, "first_k_dense_replace": DENSE,
                   "n_routed_experts": EXPERTS, "n_shared_experts": 1,
                   "hidden_size": H, "moe_intermediate_size": I_MOE,
                   "num_experts_per_tok": 8}, f)
    print(f"{path}: {len(header)} tensors, {offset} bytes of data (sparse)")


if __name__ == "__main__":
    main()
