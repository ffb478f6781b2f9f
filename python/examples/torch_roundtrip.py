"""The real-client check (by hand, not CI: torch's PyPI wheel pulls ~5 GB of CUDA
libraries). A tiny transformers MoE model built from a config with random weights, saved
with save_pretrained, placed by numapin; its state dict rebuilt from numapin's views with
torch.from_dlpack (experts) and the file (dense tensors, the engine's part), loaded with
load_state_dict(assign=True): the logits of a forward pass must equal the original's bit
for bit, and every expert parameter must point into the store.

    python python/examples/torch_roundtrip.py [qwen3_moe|mixtral] [float32|bfloat16]
"""

import sys
import tempfile
from pathlib import Path

import torch

import numapin


def build(kind: str, dtype: torch.dtype):
    import transformers

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **common)
        model = transformers.MixtralForCausalLM(config)
    return model.to(dtype).eval()


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "qwen3_moe"
    dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
    torch.manual_seed(0)
    model = build(kind, dtype)
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = model(tokens).logits

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        files = sorted(Path(tmp).glob("*.safetensors"))
        print("saved:", [f.name for f in files])
        ckpt = numapin.Checkpoint(tmp if len(files) > 1 else files[0])
        placed = ckpt.pack("interleave:all", progress=False)
        print(placed.report())
        print("expert layers:", ckpt.experts, "roles:", placed.roles(placed.layers[0]))

        # Dense tensors are the engine's part: transformers reads them from the files
        # (with its own renames, e.g. Mixtral's block_sparse_moe.gate -> mlp.gate).
        engine = type(model).from_pretrained(tmp, dtype=dtype)
        state = {k: v.clone() for k, v in engine.state_dict().items()}
        del engine
        params = dict(model.state_dict())
        # Expert parameters from numapin's views, zero-copy.
        from_views = {}
        for name, param in params.items():
            view = expert_view(placed, name)
            if view is None:
                continue
            tensor = torch.from_dlpack(view)
            assert tensor.shape == param.shape, (name, tensor.shape, param.shape)
            assert tensor.dtype == param.dtype, (name, tensor.dtype, param.dtype)
            from_views[name] = tensor
        assert from_views, "no expert parameter matched a view"
        state.update(from_views)
        fresh = build(kind, dtype)
        missing, unexpected = fresh.load_state_dict(
            {k: v for k, v in state.items() if k in params}, strict=True, assign=True)
        assert not missing and not unexpected
        # Zero copy: every expert parameter of the loaded model points into the store.
        loaded = dict(fresh.state_dict())
        for name, tensor in from_views.items():
            assert loaded[name].data_ptr() == tensor.data_ptr(), name
        with torch.no_grad():
            got = fresh(tokens).logits
        equal = torch.equal(got, want)
        print(f"{kind} {dtype}: {len(from_views)} expert tensors from views; logits bit-equal: {equal}")
        assert equal


def expert_view(placed, name: str):
    """The numapin view for a state-dict entry that is an expert tensor, or None.

    Per-expert names (`model.layers.L.mlp.experts.E.gate_proj.weight`) map to
    `placed.expert(L, E)[role]`; fused ones (`model.layers.L.mlp.experts.down_proj`) to
    `placed.layer(L, role)`, and `gate_up_proj` to `placed.layer(L, "gate_proj",
    through="up_proj")` when the checkpoint has them per expert.
    """
    parts = name.split(".")
    if "experts" not in parts or not parts[2].isdigit():
        return None
    layer = int(parts[2])
    if layer not in placed.layers:
        return None
    i = parts.index("experts")
    if parts[i + 1].isdigit():
        return placed.expert(layer, int(parts[i + 1])).get(parts[i + 2])
    role = parts[i + 1]
    roles = placed.roles(layer)
    if role in roles:
        return placed.layer(layer, role)
    # transformers v5 fuses gate and up ([E, 2I, H]) even when it saves them per expert
    # (Qwen3-MoE: gate_proj/up_proj; Mixtral: w1/w3, down is w2): gate and up are back to
    # back in each slot, so one strided view spans both.
    spans = {"gate_up_proj": [("gate_proj", "up_proj"), ("w1", "w3")], "down_proj": [("w2", "w2")]}
    for first, last in spans.get(role, []):
        if first in roles and last in roles:
            return placed.layer(layer, first, through=last)
    return None


if __name__ == "__main__":
    main()
