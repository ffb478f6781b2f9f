#!/usr/bin/env python3
"""Writes the sharded safetensors checkpoint the whole-model cold-load figures of
docs/benchmarks.md use ("Whole-model loads: place against dd"): Mixtral names, float16,
a hidden size of 1000 and an expert width of 1400 (so almost no tensor starts on a
page or a 512-byte boundary: the offsets a real checkpoint has), 12 MoE layers of 8
experts, attention, norms, embeddings and head, in 4 shards with an index:
about 1.03 GB. Written by the `safetensors` library (target/fixtures-venv has it).

    target/fixtures-venv/bin/python benches/place_checkpoint.py DIR

Then, cold, each in its own process, alternating (root: drop_caches):
    numapin place --model DIR --plan default --read MODE --json
against
    for f in DIR/*.safetensors; do dd if=$f of=/dev/null bs=8M iflag=direct; done
"""
import json, os, sys

import numpy as np
from safetensors.numpy import save_file

LAYERS, EXPERTS, HIDDEN, FFN, VOCAB, SHARDS = 12, 8, 1000, 1400, 32000, 4


def tensors():
    rng = np.random.default_rng(34)

    def t(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)

    out = {"model.embed_tokens.weight": t(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = t(HIDDEN)
        out[f"{p}.post_attention_layernorm.weight"] = t(HIDDEN)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}.self_attn.{n}.weight"] = t(HIDDEN, HIDDEN)
        out[f"{p}.block_sparse_moe.gate.weight"] = t(EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            q = f"{p}.block_sparse_moe.experts.{e}"
            out[f"{q}.w1.weight"] = t(FFN, HIDDEN)
            out[f"{q}.w3.weight"] = t(FFN, HIDDEN)
            out[f"{q}.w2.weight"] = t(HIDDEN, FFN)
    out["model.norm.weight"] = t(HIDDEN)
    out["lm_head.weight"] = t(VOCAB, HIDDEN)
    return out


def main(root):
    os.makedirs(root, exist_ok=True)
    all_tensors = tensors()
    names = list(all_tensors)
    per = -(-len(names) // SHARDS)
    weight_map = {}
    for s in range(SHARDS):
        shard = f"model-{s + 1:05}-of-{SHARDS:05}.safetensors"
        part = {n: all_tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(root, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    total = sum(t.nbytes for t in all_tensors.values())
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": LAYERS,
                   "num_local_experts": EXPERTS, "hidden_size": HIDDEN,
                   "intermediate_size": FFN}, f)
    print(f"{total} bytes in {SHARDS} shards under {root}")


main(sys.argv[1])
