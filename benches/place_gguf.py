#!/usr/bin/env python3
"""Writes the GGUF checkpoints of the whole-model cold-load figures of docs/benchmarks.md
("Whole-model loads: place against dd", GGUF): the same shapes as
benches/place_checkpoint.py (hidden size 1000, expert width 1400, 8 experts) in llama.cpp's
merged-expert form (`blk.N.ffn_{gate,up,down}_exps.weight`, float16), 6 MoE layers with
attention, norms, router, embeddings and head: about 0.5 GB, once as one file and once
split by gguf-py (16 tensors a part at most: 4 parts). GGUF aligns tensor data to 32 bytes,
so almost no tensor starts on a 512-byte boundary. Written by gguf-py's GGUFWriter
(target/fixtures-venv has it).

    target/fixtures-venv/bin/python benches/place_gguf.py DIR
    # DIR/single/model.gguf and DIR/split/model-00001-of-0000N.gguf
"""
import os, sys

import gguf
import numpy as np

LAYERS, EXPERTS, HIDDEN, FFN, VOCAB = 6, 8, 1000, 1400, 32000


def write(path, split_max_tensors=0):
    rng = np.random.default_rng(34)

    def t(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)

    writer = gguf.GGUFWriter(path, "qwen2moe", split_max_tensors=split_max_tensors)
    writer.add_block_count(LAYERS)
    writer.add_expert_count(EXPERTS)
    writer.add_tensor("token_embd.weight", t(VOCAB, HIDDEN))
    for i in range(LAYERS):
        p = f"blk.{i}"
        writer.add_tensor(f"{p}.attn_norm.weight", rng.standard_normal(HIDDEN, dtype=np.float32))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{p}.{n}.weight", t(HIDDEN, HIDDEN))
        writer.add_tensor(f"{p}.ffn_norm.weight", rng.standard_normal(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"{p}.ffn_gate_inp.weight", t(EXPERTS, HIDDEN))
        writer.add_tensor(f"{p}.ffn_gate_exps.weight", t(EXPERTS, FFN, HIDDEN))
        writer.add_tensor(f"{p}.ffn_up_exps.weight", t(EXPERTS, FFN, HIDDEN))
        writer.add_tensor(f"{p}.ffn_down_exps.weight", t(EXPERTS, HIDDEN, FFN))
    writer.add_tensor("output_norm.weight", rng.standard_normal(HIDDEN, dtype=np.float32))
    writer.add_tensor("output.weight", t(VOCAB, HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


root = sys.argv[1]
for name, split in [("single", 0), ("split", 16)]:
    os.makedirs(os.path.join(root, name), exist_ok=True)
    write(os.path.join(root, name, "model.gguf"), split)
    files = sorted(os.listdir(os.path.join(root, name)))
    size = sum(os.path.getsize(os.path.join(root, name, f)) for f in files)
    print(f"{name}: {size} bytes in {files}")
