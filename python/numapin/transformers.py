"""A transformers model whose parameters are numapin's placed memory, in one call.

>>> import numapin.transformers
>>> model, whole = numapin.transformers.from_pretrained("path/to/checkpoint")
>>> out = model.generate(ids, max_new_tokens=8, do_sample=False)
>>> model.numapin_load["copied"]          # {} when every parameter is a view

The checkpoint is placed whole by `numapin.Checkpoint(path).place(...)`; every tensor of it
becomes a torch tensor over its placed bytes (`torch.from_dlpack` of the view: no copy),
and transformers' own `from_pretrained` loads that state dict: its model classes, its
checkpoint conversion mapping (renames, expert fusions), its dtype rules, its weight
tying and its initialisation of what the checkpoint lacks. What transformers would fuse
by copying (per-expert `gate_proj`/`up_proj` stacked into one `gate_up_proj [E, 2I, H]`,
per-expert `down_proj` into `[E, H, I]`) is handed over already fused, as one strided
numapin view (`WholeModel.layer(l, "gate_proj", through="up_proj")`), when the
conversion is one transformers' `MergeModulelist`/`Concatenate` can be replaced by and
the layer's experts sit at one stride. What transformers holds in float32 where the file
has BF16 or F16 (routers and router biases: its `_keep_in_fp32_modules`, DeepSeek-V3,
GLM4-MoE, dots1, ERNIE, HunYuan) is converted by numapin once, at placement
(`Checkpoint.place(convert_pattern=...)`), so it is a float32 view too
(`model.numapin_load["converted"]`). Anything else transformers converts with a copy
(a fusion numapin cannot view): those parameters are listed, with their bytes and the
reason, in `model.numapin_load["copied"]`.

Placed memory is read-only (PROT_READ): nothing in this path writes an assigned
parameter, and neither may the caller (a write faults). Requires torch and transformers
5 (`pip install './python[transformers]'`). See docs/frameworks.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers

from . import Checkpoint, WholeModel
from ._transformers_common import (
    Sources,
    _meta_dtype,
    _span,
    dtype_conversions,
    placed_ranges,
    state_dict,
)

__all__ = ["from_pretrained", "placed_ranges"]


def from_pretrained(
    path: str | os.PathLike[str],
    plan: str | None = None,
    nodes: str | None = None,
    *,
    place: dict[str, Any] | None = None,
    distributed_config: Any = None,
    **kwargs: Any,
) -> tuple[Any, WholeModel]:
    """Builds `AutoModelForCausalLM` for the checkpoint at `path` (a directory with
    config.json and safetensors) with every parameter and persistent buffer on numapin's
    placed memory where transformers' rules allow a view.

    `plan`: numapin's plan text (`Checkpoint.place(plan=...)`); `nodes`: a node set
    (numactl syntax) for the default plan, experts split and dense tensors replicated
    over it; `place`: further `Checkpoint.place` keywords. `kwargs` go to transformers'
    `from_pretrained` (`dtype`, `attn_implementation`, ...; `dtype` defaults to "auto",
    the checkpoint's). Returns `(model, whole)`: the model in eval mode, and the
    `WholeModel` its views keep alive (report, verify, stats).
    `model.numapin_load` says what was assigned and what was copied.

    `distributed_config`: transformers' `DistributedConfig` (under torchrun): this rank
    places only its share as transformers' own TP/EP plan cuts it (on the nodes of the
    CPUs it runs on, or `nodes`), and each DTensor's local shard is a numapin view
    (numapin.transformers_distributed, docs/frameworks.md).
    """
    path = os.fspath(path)
    place_kwargs: dict[str, Any] = {"progress": False, **(place or {})}
    if plan is not None:
        place_kwargs["plan"] = plan
    ckpt = Checkpoint(path)
    config = kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(path)
    kwargs.setdefault("dtype", "auto")
    # The model transformers will build, on the meta device: its parameter names, shapes
    # and dtypes, and the conversion rules of its class (nothing is allocated).
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(
            config, dtype=_meta_dtype(kwargs["dtype"], config)
        )
    names = [name for name, _, _ in ckpt.tensors()]
    sources = Sources(names, meta)
    # What transformers holds in float32 over a BF16/F16 file: converted at placement
    # (the caller's own convert_pattern= items come after, so they win).
    converted = dtype_conversions(ckpt, sources)
    if converted:
        place_kwargs["convert_pattern"] = {
            **converted, **(place_kwargs.get("convert_pattern") or {})}
    if distributed_config is not None:
        from .transformers_distributed import load_share

        return load_share(ckpt, config, meta, sources, distributed_config, nodes,
                          place_kwargs, kwargs)
    if nodes is not None:
        place_kwargs.setdefault("experts", f"split:{nodes}")
        place_kwargs.setdefault("dense", f"replicate:{nodes}")
    whole = ckpt.place(**place_kwargs)
    state, fused, renamed_from = state_dict(whole, ckpt, sources)
    # The class AutoModelForCausalLM chose (the auto class takes no state dict alone).
    model = type(meta).from_pretrained(None, config=config, state_dict=state, **kwargs)
    model.eval()
    model.numapin_load = _account(model, whole, state, fused, renamed_from)
    model.numapin_load["converted"] = sorted(converted)
    return model, whole


def _account(
    model: Any,
    whole: WholeModel,
    state: dict[str, torch.Tensor],
    fused: dict[str, str],
    renamed_from: dict[str, str],
) -> dict[str, Any]:
    """Which parameters and persistent buffers lie in numapin's placed memory and which
    are copies transformers made (with their bytes and, where known, why)."""
    ranges = placed_ranges(whole, state)

    def inside(t: torch.Tensor) -> bool:
        start, end = t.data_ptr(), t.data_ptr() + _span(t)
        return any(a <= start and end <= b for a, b in ranges)

    views: list[str] = []
    copied: dict[str, dict[str, Any]] = {}
    for name, tensor in model.state_dict().items():
        if tensor.numel() == 0 or inside(tensor):
            views.append(name)
            continue
        reason = fused.get(name)
        if reason is None:
            source = state.get(renamed_from.get(name, name))
            if source is not None and source.dtype != tensor.dtype:
                reason = f"dtype cast {source.dtype} -> {tensor.dtype}"
            else:
                reason = "converted by transformers"
        copied[name] = {"bytes": tensor.numel() * tensor.element_size(), "reason": reason}
    return {
        "views": views,
        "fused": {k: v for k, v in fused.items() if not v.startswith("copy")},
        "copied": copied,
        "copied_bytes": sum(c["bytes"] for c in copied.values()),
    }
