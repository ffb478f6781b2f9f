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
the layer's experts sit at one stride. Anything else transformers converts with a copy
(a dtype cast such as a float32 router, a fusion numapin cannot view): those parameters
are listed, with their bytes and the reason, in `model.numapin_load["copied"]`.

Placed memory is read-only (PROT_READ): nothing in this path writes an assigned
parameter, and neither may the caller (a write faults). Requires torch and transformers
5 (`pip install './python[transformers]'`). See docs/frameworks.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from . import Checkpoint, InvalidArgument, NumapinError, WholeModel

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
    return model, whole


class Sources:
    """Which checkpoint tensors make each model parameter, by transformers' own rules
    (`rename_source_key`: its renamings, then at most one converter): `renamed[target]`
    the one tensor renamed to it, `fused[target]` the (name, pattern) list a converter
    gathers and the converter."""

    def __init__(self, names: list[str], meta: Any) -> None:
        expected = meta.state_dict()
        mapping = get_model_conversion_mapping(meta)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self.expected = expected
        self.renamed: dict[str, str] = {}
        self.fused: dict[str, tuple[WeightConverter, list[tuple[str, str]]]] = {}
        for name in names:
            target, pattern = rename_source_key(
                name, renamings, converters, meta.base_model_prefix, expected
            )
            if pattern is None:
                self.renamed[target] = name
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            entry = self.fused.setdefault(target, (converter, []))
            entry[1].append((name, pattern))


def state_dict(
    whole: WholeModel, ckpt: Checkpoint, sources: Sources, skip: frozenset[str] = frozenset()
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """The state dict transformers loads (checkpoint names; fused targets under the
    model's name, one view), leaving out targets in `skip` and experts not held:
    (state, {target: how it was fused or why copied}, {target: checkpoint name})."""
    state: dict[str, torch.Tensor] = {}
    shapes = {name: shape for name, _, shape in ckpt.tensors()}
    layers_of = {name: layer for name, _, layer in whole.classes()}
    renamed_from: dict[str, str] = {}
    for target, name in sources.renamed.items():
        if target in skip:
            continue
        state[name] = _whole_tensor(whole, name, shapes[name], layers_of.get(name))
        renamed_from[target] = name
    fused: dict[str, str] = {}
    for target, (converter, group) in sources.fused.items():
        if target in skip:
            continue
        group = held(whole, group)
        view, why = _fused_view(whole, converter, group, layers_of, sources.expected.get(target))
        if view is not None:
            state[target] = view
            fused[target] = why
        else:
            # transformers' own converter does it (a copy); reported below.
            for name, _ in group:
                state[name] = torch.from_dlpack(whole.tensor(name))
            fused[target] = f"copy: {why}"
    return state, fused, renamed_from


def held(whole: WholeModel, group: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (name, pattern) pairs of `group` whose expert this rank holds."""
    out = []
    for name, pattern in group:
        where = whole.locate(name)
        if where is None or where[1] is None or where[1] in whole.expert_ids(where[0]):
            out.append((name, pattern))
    return out


def _meta_dtype(dtype: Any, config: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" or dtype is None:
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(found, str):
            return getattr(torch, found)
        return found or torch.float32
    return getattr(torch, dtype)


def _whole_tensor(
    whole: WholeModel, name: str, shape: list[int], layer: int | None
) -> torch.Tensor:
    """The view of checkpoint tensor `name`. A tensor that holds every expert of a layer
    (GraniteMoE `input_linear`, a fused safetensors layout) has one slot per expert in
    numapin, so it is the layer's strided view of the role whose [E, ...] shape is the
    file's; refused by name where no role, or more than one, has that shape."""
    try:
        return torch.from_dlpack(whole.tensor(name))
    except NumapinError:
        if layer is None:
            raise
    ids = _expert_ids(whole, layer)
    roles = list(whole.expert(layer, ids[0]))
    views = [whole.layer(layer, r) for r in roles]
    match = [(r, v) for r, v in zip(roles, views) if list(v.shape) == list(shape)]
    if len(match) != 1:
        raise InvalidArgument(
            f"numapin.transformers: {name!r} {shape} holds every expert of layer {layer}; "
            f"{len(match)} of its roles {roles} have that shape, so it is not one view"
        )
    return torch.from_dlpack(match[0][1])


def _fused_view(
    whole: WholeModel,
    converter: WeightConverter,
    sources: list[tuple[str, str]],
    layers_of: dict[str, int | None],
    want: torch.Tensor | None,
) -> tuple[torch.Tensor | None, str]:
    """One numapin view for what `converter` would build from `sources` by stacking
    (MergeModulelist(dim=0)) and, for two source roles, joining them (Concatenate(dim=1)):
    `whole.layer(l, first, through=second)`. (None, why) where it cannot be one view."""
    ops = converter.operations
    kinds = [type(op) for op in ops]
    if want is None:
        return None, "no such parameter in the model"
    if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]):
        return None, f"conversion {[k.__name__ for k in kinds]} is not a stack of experts"
    if any(getattr(op, "dim", 0) != (0 if isinstance(op, MergeModulelist) else 1) for op in ops):
        return None, "stack or join along another axis"
    patterns = list(converter.source_patterns)
    if len(patterns) != len(ops):
        return None, f"{len(patterns)} source roles for {len(ops)} operations"
    layers = {layers_of.get(name) for name, _ in sources}
    if len(layers) != 1 or None in layers:
        return None, "sources in several layers"
    (layer,) = layers
    # Each source tensor's (expert, role) in numapin's layer: matched by address, so the
    # file's role names need no table here.
    where: dict[int, tuple[int, str]] = {}
    held = sorted(_expert_ids(whole, layer))
    for e in held:
        for role, view in whole.expert(layer, e).items():
            where[view.address] = (e, role)
    roles: list[str] = []
    for pattern in patterns:
        found = [where.get(whole.tensor(n).address) for n, p in sources if p == pattern]
        # The file's order is its names' (experts.10 before experts.2): by expert id.
        if None in found or sorted(e for e, _ in found) != held:
            return None, f"{pattern}: not every held expert, in order"
        names = {r for _, r in found}
        if len(names) != 1:
            return None, f"{pattern}: several roles"
        roles.append(names.pop())
    try:
        if len(roles) == 1:
            view = whole.layer(layer, roles[0])
        else:
            view = whole.layer(layer, roles[0], through=roles[1])
    except Exception as e:  # numapin says why (a layer split over nodes, roles apart)
        return None, str(e)
    tensor = torch.from_dlpack(view)
    if tensor.shape != want.shape or tensor.dtype != want.dtype:
        return None, f"view {tuple(tensor.shape)} {tensor.dtype}, model {tuple(want.shape)} {want.dtype}"
    return tensor, f"view of layer {layer} {'+'.join(roles)}"


def _expert_ids(whole: WholeModel, layer: int) -> list[int]:
    ids = getattr(whole, "expert_ids", None)
    if ids is not None:
        return list(ids(layer))
    # Without the structure API: probe the ids the layer's view rows stand for.
    count = whole.layer(layer, next(iter(whole.expert(layer, 0)))).shape[0]
    return list(range(count))


def placed_ranges(whole: WholeModel, tensors: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """The (start, end) address ranges of the views behind `tensors`, merged."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + _span(t)) for t in tensors.values() if t.numel()
    )
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _span(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


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
