"""`numapin.transformers.from_pretrained(..., distributed_config=...)` under torchrun: each
rank places only its share, as transformers' own TP/EP plan cuts the model, and each
DTensor parameter's local shard is a numapin view.

1. The model is built on the meta device and distributed by transformers itself
   (`prepare_distribute_model`, `maybe_distribute_model`: its resolved `tp_plan` and
   `ep_plan`), which gives every parameter's DTensor placements on this rank.
2. Those placements, read back onto the checkpoint's tensors (transformers' renames and
   expert fusions), are the rank's share: a dense `Shard(0)` is `colwise` (rows k/n, an
   embedding's vocabulary rows), `Shard(-1)` of a matrix `rowwise` (columns k/n), an
   expert parameter's `Shard(0)` the held experts (`experts_held`, whole), its
   `_StridedShard` / `Shard` of the packed gate_up rows (`packed_colwise`) each per-expert
   gate and up by rows k/n (a gate_up the file holds fused, Granite's `input_linear`:
   rows k/n of each half), its `Shard(-1)` each down by columns; replicated or unnamed:
   whole. numapin places that share (`Checkpoint.place(framework_plan=..., rank=...,
   experts_held=...)`), refusing by name before anything is reserved a cut that splits a
   head or does not divide its axis.
3. transformers' own `from_pretrained(None, state_dict=..., distributed_config=...)` loads
   the replicated parameters from numapin's views (renames, fusions, ties, float32
   routers as in one process); each sharded parameter is then
   `DTensor.from_local(view, mesh, placements, shape=global, stride=global)` over this
   rank's view, no copy (transformers' own `_dtensor_from_local_like` calls
   `.contiguous()`, which would copy a strided expert view).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import Checkpoint, InvalidArgument, WholeModel
from ._transformers_common import (
    Sources,
    _fused_view,
    _meta_dtype,
    _span,
    dtype_conversions,
    held,
    placed_ranges,
    state_dict,
)

try:  # torch's own name for a strided (packed) shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()  # type: ignore[assignment,misc]


def load_share(
    ckpt: Checkpoint,
    config: Any,
    meta: Any,
    sources: Sources,
    distributed_config: Any,
    nodes: str | None,
    place_kwargs: dict[str, Any],
    kwargs: dict[str, Any],
) -> tuple[Any, WholeModel]:
    cls = type(meta)
    # transformers' device mesh (its gloo process groups: threads and buffers per group),
    # made once: the load below is handed the same one (`_same_mesh`).
    prepared = cls.prepare_distribute_model(distributed_config)
    sharded = _sharded_parameters(cls, config, prepared, kwargs["dtype"])
    tied = frozenset(meta.all_tied_weights_keys) if hasattr(meta, "all_tied_weights_keys") \
        else frozenset()
    sharded = {k: v for k, v in sharded.items()
               if k not in tied or k in sources.renamed or k in sources.fused}
    styles, experts_held, rank = _share_of(sharded, sources, tied)
    if nodes is None:
        nodes = local_nodes()
    place_kwargs.setdefault("experts", f"interleave:{nodes}")
    place_kwargs.setdefault("dense", f"replicate:{nodes}")
    if styles:
        place_kwargs["framework_plan"] = styles
        place_kwargs["rank"] = rank
    if experts_held is not None:
        place_kwargs["experts_held"] = experts_held
    converted = dtype_conversions(ckpt, sources)
    if converted:
        place_kwargs["convert_pattern"] = {
            **converted, **(place_kwargs.get("convert_pattern") or {})}
    whole = ckpt.place(**place_kwargs)
    _give_back_freed()

    state, fused, _ = state_dict(whole, ckpt, sources, skip=frozenset(sharded))
    layers_of = {name: layer for name, _, layer in whole.classes()}
    locals_: dict[str, torch.Tensor] = {}
    copied: dict[str, dict[str, Any]] = {}

    def shard_param(target: str, ref: Any) -> torch.nn.Parameter:
        """The DTensor parameter over this rank's numapin view, with `ref`'s (the meta
        DTensor's) mesh, placements, global shape and stride."""
        want = ref._local_tensor
        view = _local_view(whole, sources, target, want, layers_of)
        if view.dtype != want.dtype:
            copied[target] = {"bytes": view.numel() * want.element_size(),
                              "reason": f"dtype cast {view.dtype} -> {want.dtype}"}
            view = view.to(want.dtype)
        locals_[target] = view
        dtensor = DTensor.from_local(view, ref.device_mesh, ref.placements, run_check=False,
                                     shape=ref.shape, stride=tuple(ref.stride()))
        param = torch.nn.Parameter(dtensor, requires_grad=False)
        param._is_hf_initialized = True
        return param

    # The cut parameters are not in the state dict, so transformers would materialise each
    # (an empty local shard of the share's size, then its random initialisation) before
    # they are replaced: instead they get numapin's views where it would allocate them.
    with _views_for_missing(cls, sharded, shard_param) as assigned, \
            _same_mesh(cls, distributed_config, prepared):
        model = cls.from_pretrained(
            None, config=config, state_dict=state, distributed_config=distributed_config,
            **kwargs
        )
    model.eval()
    # old parameter's id -> (the old one, kept alive so that its id is not reused; new)
    replaced: dict[int, tuple[Any, torch.nn.Parameter]] = {}
    for target in sharded:
        if target in assigned:
            continue
        # Not handed to transformers' materialisation (loaded some other way): replaced.
        module_path, _, pname = target.rpartition(".")
        module = model.get_submodule(module_path)
        old = getattr(module, pname)
        param = shard_param(target, old)
        module._parameters[pname] = param
        replaced[id(old)] = (old, param)
    # A parameter tied to a replaced one (the head to the embedding) is the new one too.
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None and id(p) in replaced and replaced[id(p)][0] is p:
                module._parameters[pname] = replaced[id(p)][1]
    del replaced
    ranges = placed_ranges(whole, {**state, **locals_})
    model.numapin_load = _account(model, ranges, fused, copied, whole.share)
    model.numapin_load["converted"] = sorted(converted)
    return model, whole


def _give_back_freed() -> None:
    """glibc's `malloc_trim(0)`: the memory the placement freed (under a TP cut, a piece
    range per sliced row of a column cut: ~17 MB for a 1 GB checkpoint at n = 2) back to the
    system rather than kept in the process's heap (docs/benchmarks.md). Nothing where
    the C library is not glibc."""
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


# {(class, attribute): [what the class itself had (None: inherited), loads in progress]}:
# a hook is put on a class by the first load of it and taken off by the last, under this
# lock.
_HOOKED: dict[tuple, list] = {}
_HOOKED_LOCK = threading.Lock()
# Per thread, {(class, attribute): [frame, ...]}: what this thread's loads gave the hook.
_LOADS_HERE = threading.local()


def _loads_here(key: tuple) -> list:
    loads = getattr(_LOADS_HERE, "by_key", None)
    if loads is None:
        loads = _LOADS_HERE.by_key = {}
    return loads.setdefault(key, [])


@contextlib.contextmanager
def _class_hook(cls: Any, attr: str, install: Any, frame: Any) -> Iterator[None]:
    """Replaces `cls.attr` by `install((cls, attr))` while any load of `cls` runs, and
    pushes `frame` on this thread's stack for that hook: the hook serves the frames of
    the thread calling it (`_loads_here(key)`) and defers to the original otherwise, so
    two loads of one class in two threads each get their own, and a call from a thread
    with no load of ours gets transformers' own behaviour. The last load out restores
    what the class had (its own attribute, or none: inherited again)."""
    key = (cls, attr)
    with _HOOKED_LOCK:
        hooked = _HOOKED.get(key)
        if hooked is None:
            hooked = _HOOKED[key] = [cls.__dict__.get(attr), 0]
            setattr(cls, attr, install(key))
        hooked[1] += 1
    mine = _loads_here(key)
    mine.append(frame)
    try:
        yield
    finally:
        for i in range(len(mine) - 1, -1, -1):
            if mine[i] is frame:
                del mine[i]
                break
        with _HOOKED_LOCK:
            hooked[1] -= 1
            if hooked[1] == 0:
                del _HOOKED[key]
                if hooked[0] is not None:
                    setattr(cls, attr, hooked[0])
                else:
                    delattr(cls, attr)


@contextlib.contextmanager
def _same_mesh(cls: Any, distributed_config: Any, prepared: tuple) -> Iterator[None]:
    """While transformers' `from_pretrained` runs on `cls` in this thread: its
    `prepare_distribute_model` for `distributed_config` (no device map) gives `prepared`,
    the mesh the share was read from, rather than a second mesh with process groups of
    its own (under gloo, 2 threads and a TCP loop per group: ~6 groups at tp_size=2,
    each with its stacks and buffers, for the process's life). A hook on the class
    (`_class_hook`) while any load of it runs."""
    attr = "prepare_distribute_model"

    def install(key: tuple) -> Any:
        original = getattr(cls, attr)  # bound to cls

        def prepare(_: Any, config: Any, *args: Any, **kw: Any) -> Any:
            for dc, mesh in reversed(_loads_here(key)):
                if config is dc and not args and kw.get("device_map") is None:
                    return mesh
            return original(config, *args, **kw)

        return classmethod(prepare)

    with _class_hook(cls, attr, install, (distributed_config, prepared)):
        yield


@contextlib.contextmanager
def _views_for_missing(cls: Any, sharded: dict, make: Any) -> Iterator[set[str]]:
    """While transformers' `from_pretrained` runs on `cls` in this thread: where it would
    materialise a missing parameter of `sharded` (`_move_missing_keys_from_meta_to_device`:
    an empty local shard, which `_initialize_missing_keys` then fills at random),
    `make(name, meta DTensor)` is assigned instead, marked initialised. Yields the names
    assigned. A hook on the class (`_class_hook`) while any load of it runs."""
    attr = "_move_missing_keys_from_meta_to_device"
    assigned: set[str] = set()
    if getattr(cls, attr, None) is None:
        # Another transformers: the parameters are replaced afterwards.
        yield assigned
        return

    def install(key: tuple) -> Any:
        original = getattr(cls, attr)

        def move(self: Any, missing_keys: Any, *args: Any, **kw: Any) -> Any:
            mine = _loads_here(key)
            if not mine:
                return original(self, missing_keys, *args, **kw)
            sharded, make, assigned = mine[-1]
            rest = set()
            for k in missing_keys:
                if k not in sharded:
                    rest.add(k)
                    continue
                module_path, _, pname = k.rpartition(".")
                module = self.get_submodule(module_path)
                module._parameters[pname] = make(k, module._parameters[pname])
                assigned.add(k)
            return original(self, rest, *args, **kw)

        return move

    with _class_hook(cls, attr, install, (sharded, make, assigned)):
        yield assigned


def _sharded_parameters(cls: Any, config: Any, prepared: tuple, dtype: Any) -> dict:
    """{parameter name: meta DTensor} of every parameter transformers' plan cuts on this
    rank (a placement other than Replicate), from the model distributed on meta over
    `prepared` (`cls.prepare_distribute_model`'s result)."""
    import copy

    dc, _, mesh_manager = prepared
    if mesh_manager is None:
        return {}
    from transformers import initialization

    # Untied, as transformers' from_pretrained builds it (it ties after loading): a tied
    # head is a parameter of its own the plan names.
    with torch.device("meta"), initialization.no_tie_weights():
        model = cls._from_config(copy.deepcopy(config), dtype=_meta_dtype(dtype, config))
    model = cls.maybe_distribute_model(model, dc, mesh_manager)
    return {
        name: p
        for name, p in model.named_parameters()
        if isinstance(p, DTensor) and any(not isinstance(x, Replicate) for x in p.placements)
    }


def _share_of(sharded: dict, sources: Sources, tied: frozenset[str]
              ) -> tuple[dict[str, str], str | None, str]:
    """transformers' placements as numapin's share: ({checkpoint module glob: style},
    experts_held text or None, "k/n" of the cutting mesh)."""
    modules: dict[str, str] = {}
    held_ranges: set[tuple[int, int]] = set()
    ranks: set[tuple[int, int]] = set()
    for target, p in sharded.items():
        cuts = [x for x in p.placements if not isinstance(x, Replicate)]
        if len(cuts) != 1 or p.device_mesh.ndim != 1:
            raise InvalidArgument(
                f"numapin.transformers: {target}: placements {p.placements} on a "
                f"{p.device_mesh.ndim}-D mesh; numapin takes one cut on a 1-D mesh")
        (cut,) = cuts
        if not isinstance(cut, (Shard, _StridedShard)):
            raise InvalidArgument(f"numapin.transformers: {target}: placement {cut} unknown")
        dim = cut.dim % p.ndim
        k, n = p.device_mesh.get_local_rank(), p.device_mesh.size()
        if target in sources.fused:
            names = [name for name, _ in sources.fused[target][1]]
            if dim == 0:
                local = p._local_tensor.shape[0]
                held_ranges.add((k * local, local))
                continue
            style = "colwise" if dim == p.ndim - 2 else "rowwise" if dim == p.ndim - 1 else None
        elif target in sources.renamed:
            names = [sources.renamed[target]]
            if p.ndim == 3 and dim == 0:
                # An expert tensor the file holds fused (Granite `input_linear`) under EP:
                # the held experts, whole, as for one transformers fuses.
                local = p._local_tensor.shape[0]
                held_ranges.add((k * local, local))
                continue
            if p.ndim == 3:
                # TP of every expert of a tensor the file holds fused: `packed_colwise`
                # (`_StridedShard` of the rows, gate and up: rows k/n of each half) and
                # `rowwise` (columns k/n); numapin cuts each expert's slot so, and the
                # layer's held rows are one strided view.
                style = _fused_expert_style(target, cut, dim)
            else:
                style = "colwise" if dim == 0 else "rowwise" if dim == p.ndim - 1 else None
        elif target in tied:
            continue  # transformers ties it to the parameter the file holds
        else:
            raise InvalidArgument(
                f"numapin.transformers: {target}: cut by transformers' plan ({cut}) and "
                f"made from no checkpoint tensor")
        if style is None:
            raise InvalidArgument(
                f"numapin.transformers: {target}: cut along axis {dim} of {p.ndim}")
        ranks.add((k, n))
        for name in names:
            module = name.rpartition(".")[0]
            if modules.setdefault(module, style) != style:
                raise InvalidArgument(
                    f"numapin.transformers: {name}: cut both {modules[module]} and {style}")
    if len(ranks) > 1:
        raise InvalidArgument(f"numapin.transformers: cuts on several meshes {sorted(ranks)}")
    experts_held = None
    if held_ranges:
        if len(held_ranges) != 1:
            raise InvalidArgument(
                f"numapin.transformers: the expert layers hold different ranges {held_ranges}")
        ((first, count),) = held_ranges
        experts_held = f"{first}-{first + count - 1}"
    rank = "0/1"
    if ranks:
        ((k, n),) = ranks
        rank = f"{k}/{n}"
    return _globs(modules), experts_held, rank


def _fused_expert_style(target: str, cut: Any, dim: int) -> str:
    """The framework-plan style of an `[E, 2I, H]` / `[E, H, I]` expert tensor the file
    holds fused, cut by `cut` along `dim` (not the experts axis): the packed rows of gate
    and up (`_StridedShard` of 2), or the columns."""
    if dim == 1 and isinstance(cut, _StridedShard) and getattr(cut, "split_factor", 0) == 2:
        return "packed_colwise"
    if dim == 2 and not isinstance(cut, _StridedShard):
        return "rowwise"
    raise InvalidArgument(
        f"numapin.transformers: {target}: an expert tensor the file holds fused, cut by "
        f"{cut}: numapin cuts its rows k/n of each of 2 packed halves (gate, up) or its "
        f"columns")


def _globs(modules: dict[str, str]) -> dict[str, str]:
    """`modules` with each index word as `*` where every module that glob reaches under
    those words has the same style (fewer entries for numapin's plan), else by name."""
    generic = {m: re.sub(r"(?<=\.)\d+(?=\.|$)", "*", m) for m in modules}
    style_of: dict[str, set[str]] = {}
    for m, g in generic.items():
        style_of.setdefault(g, set()).add(modules[m])
    out: dict[str, str] = {}
    for m, style in modules.items():
        g = generic[m]
        out[g if len(style_of[g]) == 1 else m] = style
    return out


def _local_view(whole: WholeModel, sources: Sources, target: str, want: torch.Tensor,
                layers_of: dict) -> torch.Tensor:
    if target in sources.renamed:
        name = sources.renamed[target]
        where = whole.locate(name)
        if where is not None and where[1] is None:
            # The file holds the layer's experts as one tensor: this rank's held experts
            # of its role, one strided view (the role by its file name, else canonical).
            layer, _, role = where
            view = torch.from_dlpack(whole.layer(layer, whole.role_names(layer).get(role, role)))
        else:
            view = torch.from_dlpack(whole.tensor(name))
    else:
        converter, group = sources.fused[target]
        probe = torch.empty(want.shape, dtype=want.dtype, device="meta")
        found, why = _fused_view(whole, converter, held(whole, group), layers_of, probe)
        if found is None:
            raise InvalidArgument(f"numapin.transformers: {target}: no one view of this "
                                  f"rank's share: {why}")
        view = found
    if tuple(view.shape) != tuple(want.shape):
        raise InvalidArgument(
            f"numapin.transformers: {target}: numapin's share {tuple(view.shape)}, "
            f"transformers' local shard {tuple(want.shape)}")
    return view


def _account(model: Any, ranges: list[tuple[int, int]], fused: dict[str, str],
             copied: dict[str, dict[str, Any]], share: str | None) -> dict[str, Any]:
    """As in one process, on each DTensor's local shard."""
    views: list[str] = []
    for name, tensor in model.state_dict().items():
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        start, end = local.data_ptr(), local.data_ptr() + _span(local)
        if local.numel() == 0 or any(a <= start and end <= b for a, b in ranges):
            views.append(name)
        elif name not in copied:
            copied[name] = {"bytes": local.numel() * local.element_size(),
                            "reason": fused.get(name, "converted by transformers")}
    return {"views": views, "fused": {k: v for k, v in fused.items() if not v.startswith("copy")},
            "copied": copied, "copied_bytes": sum(c["bytes"] for c in copied.values()),
            "share": share}


def local_nodes() -> str:
    """The NUMA nodes of the CPUs this process may run on (numactl syntax), "all" where
    sysfs does not say."""
    found = set()
    for cpu in os.sched_getaffinity(0):
        try:
            entries = os.listdir(f"/sys/devices/system/cpu/cpu{cpu}")
        except OSError:
            return "all"
        found.update(int(e[4:]) for e in entries if re.fullmatch(r"node\d+", e))
    return ",".join(map(str, sorted(found))) or "all"
