"""One rank of test_torchrun_ep.py (run by torchrun, gloo, CPU): transformers' own
expert-parallel load (DistributedConfig(tp_size=n, ep_size=n): experts whole per rank,
dense modules cut by the model's TP plan), and numapin's share of the same rank
(`experts_held="k/n"`). Prints one JSON line per rank: whether each expert parameter's
local shard has the bytes of numapin's view, and whether the logits stay bit-equal once
the local shards are numapin's views (the DTensors rebuilt around them)."""

import json
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

import numapin

path = sys.argv[1]
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
model = transformers.AutoModelForCausalLM.from_pretrained(
    path, distributed_config=DistributedConfig(tp_size=n, ep_size=n)
).eval()
ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
with torch.no_grad():
    want = model(ids).logits.clone()

ckpt = numapin.Checkpoint(path)
whole = ckpt.place(experts="interleave:all", experts_held=f"{rank}/{n}", progress=False)
result = {"rank": rank, "params": {}}
for layer in sorted(ckpt.experts):
    experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")
    first_held = rank * ckpt.experts[layer] // n  # experts_held="k/n": a contiguous block
    roles = list(whole.expert(layer, first_held))  # the slot's roles: gate, up, down
    for pname, view in (
        ("gate_up_proj", whole.layer(layer, roles[0], through=roles[1])),
        ("down_proj", whole.layer(layer, roles[2])),
    ):
        ref = getattr(experts, pname)
        local = ref._local_tensor
        tensor = torch.from_dlpack(view)
        same = tensor.shape == local.shape and torch.equal(tensor, local)
        result["params"][f"{layer}.{pname}"] = {
            "local": list(local.shape), "view": list(tensor.shape), "equal": bool(same),
            "experts": ckpt.experts[layer]}
        if same:
            # DTensor.from_local as transformers' _dtensor_from_local_like, without its
            # .contiguous(): a strided [E, 2I, H] view would be copied.
            local_view = DTensor.from_local(tensor, ref.device_mesh, ref.placements,
                                            run_check=False, shape=ref.shape,
                                            stride=tuple(ref.stride()))
            param = torch.nn.Parameter(local_view, requires_grad=False)
            setattr(experts, pname, param)
            assert getattr(experts, pname)._local_tensor.data_ptr() == view.address
with torch.no_grad():
    got = model(ids).logits
result["logits_equal"] = bool(torch.equal(got, want))
print("EP-RESULT " + json.dumps(result), flush=True)
dist.destroy_process_group()
