"""One rank of test_torchrun.py (torchrun, gloo, CPU). For each family and mode given on
the command line, in one job: transformers' own distributed load
(`AutoModelForCausalLM.from_pretrained(path, distributed_config=...)`, the reference) and
`numapin.transformers.from_pretrained(path, distributed_config=...)` with the same
config; writes one JSON line per (family, mode) into OUT_DIR/rank{k}.jsonl:

- per parameter: whether the local shard (a DTensor's `_local_tensor`, else the tensor)
  has transformers' bytes, shape and dtype, and whether numapin's lies in the placed
  memory (the WholeModel's own views, independently of numapin_load);
- whether the logits of the same ids are bit-equal;
- for a mode numapin refuses (fewer KV heads than ranks), the error.

Modes: tp (tp_size=n), ep (tp_size=n, ep_size=n, tp_plan={}: experts only), eptp
(tp_size=n, ep_size=n: experts whole per rank, dense cut by the TP plan).
"""

import faulthandler
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.distributed import DistributedConfig

import numapin
import numapin.transformers as nt

faulthandler.enable()  # a Python stack on SIGABRT/SIGSEGV, should one come back
root = Path(sys.argv[1])
out_dir = Path(sys.argv[2])  # rank{k}.jsonl: a file per rank (the ranks share stdout, and
# lines past PIPE_BUF written by two processes at once interleave)
jobs = [job.split(":") for job in sys.argv[3:]]  # family:mode
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
out = open(out_dir / f"rank{rank}.jsonl", "w")  # noqa: SIM115


def report(result: dict) -> None:
    out.write(json.dumps(result) + "\n")
    out.flush()


def config_of(path: Path, mode: str) -> DistributedConfig:
    if mode == "tp":
        return DistributedConfig(tp_size=n)
    if mode == "ep":
        # Experts alone: every rule of the model's TP plan overridden by "replicate"
        # (transformers refuses tp_size > 1 with an empty tp_plan; its override is
        # merged into the class's plan).
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(path))
        return DistributedConfig(tp_size=n, ep_size=n,
                                 tp_plan=dict.fromkeys(meta.tp_plan, "replicate"))
    return DistributedConfig(tp_size=n, ep_size=n)


class Allocations(TorchDispatchMode):
    """Every plain CPU tensor an `empty` op allocates while active: (shape, dtype, bytes)."""

    EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
             torch.ops.aten.new_empty_strided.default}

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[tuple[int, ...], torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in self.EMPTY and type(out) is torch.Tensor and out.device.type == "cpu":
            self.found.append((tuple(out.shape), out.dtype, out.numel() * out.element_size()))
        return out


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def placed(whole: numapin.WholeModel) -> list[tuple[int, int]]:
    """Every placed byte range, from the WholeModel's views: each tensor the rank holds,
    each held expert's roles, and each expert layer's block (first held slot's first
    byte to the last's last: a strided [E, ...] view spans it)."""
    ranges = []
    for name in whole.tensors():
        try:
            view = whole.tensor(name)
        except (numapin.InvalidArgument, numapin.NotHeld):
            continue
        ranges.append((view.address, view.address + view.span_bytes))
    for layer in whole.layers:
        views = [v for e in whole.expert_ids(layer) for v in whole.expert(layer, e).values()]
        ranges.append((min(v.address for v in views),
                       max(v.address + v.span_bytes for v in views)))
    return ranges


for family, mode in jobs:
    path = root / family
    result = {"family": family, "mode": mode, "rank": rank, "ranks": n}
    # transformers' own load first: where it fails, numapin's is not compared.
    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            path, distributed_config=config_of(path, mode)).eval()
    except Exception as e:  # noqa: BLE001 (the case's result says what failed)
        ref = None
        result["reference_error"] = f"{type(e).__name__}: {e}"[:500]
    allocations = Allocations()
    try:
        with allocations:
            mine, whole = nt.from_pretrained(path, distributed_config=config_of(path, mode))
    except numapin.InvalidArgument as e:
        result["refused"] = str(e)
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"[:500]
    if ref is None or "refused" in result or "error" in result:
        report(result)
        del ref
        gc.collect()
        dist.barrier()
        continue
    ranges = placed(whole)
    ref_state = ref.state_dict()
    params = {}
    for name, tensor in mine.state_dict().items():
        got, want = local(tensor), local(ref_state[name])
        start = got.data_ptr()
        end = start + nt._span(got)
        params[name] = {
            "sharded": isinstance(tensor, DTensor) and got.shape != tensor.shape,
            "ref_sharded": isinstance(ref_state[name], DTensor)
            and want.shape != ref_state[name].shape,
            "equal": got.shape == want.shape and got.dtype == want.dtype
            and bool(torch.equal(got, want)),
            "placed": got.numel() == 0 or any(a <= start and end <= b for a, b in ranges),
            "local": list(got.shape),
        }
    ids = torch.randint(0, mine.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        result["logits_equal"] = bool(torch.equal(mine(ids).logits, ref(ids).logits))
    result["params"] = params
    result["missing"] = sorted(set(ref_state) - set(params))
    result["copied"] = sorted(mine.numapin_load["copied"])
    result["share"] = whole.share
    # The local shards of the cut parameters: allocated during numapin's load with their
    # shape and dtype (transformers materialising them before the views replace them).
    cut = {(tuple(local(t).shape), local(t).dtype) for t in mine.state_dict().values()
           if isinstance(t, DTensor)}
    result["materialised"] = sum(b for shape, dtype, b in allocations.found
                                 if (shape, dtype) in cut)
    result["cut_bytes"] = sum(local(t).numel() * local(t).element_size()
                              for t in mine.state_dict().values() if isinstance(t, DTensor))
    report(result)
    del mine, ref, whole
    # Every rank done with this job before the next one's collectives (and before the
    # process group goes): gloo's pairs stay open while a peer still uses them.
    dist.barrier()
# Teardown in order, then out without the interpreter's finalization. In one run of about
# ten, the old EP test's rank 0 died with SIGABRT after both ranks had printed their
# (correct) results: "terminate called without an active exception", C++'s
# std::terminate for a std::thread destroyed while still joinable — gloo's worker threads
# torn down during interpreter finalization (process groups still referenced by the
# model's device meshes), not numapin's memory (a write to a protected page is SIGSEGV;
# a Rust panic says "panicked at"). So: every model and view released, every rank past
# a barrier, the process group destroyed, then os._exit.
gc.collect()
out.close()
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
