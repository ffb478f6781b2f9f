"""What numapin.transformers and numapin.transformers_distributed both use: which
checkpoint tensors make each model parameter (`Sources`, by transformers' own rules), the
state dict of numapin views transformers loads (`state_dict`, with expert fusions as one
strided view where `_fused_view` can), and the address ranges those views cover
(`placed_ranges`), so that each load can tell a view from a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from . import Checkpoint, InvalidArgument, NumapinError, WholeModel


def dtype_conversions(ckpt: Checkpoint, sources: Sources) -> dict[str, str]:
    """{checkpoint name: "float32"} for every tensor the model holds in float32 where the
    file has BF16 or F16. Left to transformers' own cast: a name with a glob character
    (`*`, `?`: it cannot be one exact pattern) and the routed experts (placed by the
    expert store, which does not convert: a model loaded with `dtype=torch.float32`)."""
    dtypes = {name: dtype for name, dtype, _ in ckpt.tensors()}
    out: dict[str, str] = {}
    for target, name in sources.renamed.items():
        want = sources.expected.get(target)
        if (want is not None and want.dtype == torch.float32
                and dtypes.get(name) in ("BF16", "F16") and not set(name) & {"*", "?"}
                and ".experts." not in target and ".experts." not in name):
            out[name] = "float32"
    return out


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
    except Exception as e:  # numapin says why (not at one stride, roles apart)
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
