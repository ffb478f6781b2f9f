"""A rank's share of the whole model from Python (`Checkpoint.place(experts_held=…,
dense_slice=…)`): two ranks, each holding half of the routed experts and the k-th half of
the rows of every sliceable dense tensor. Each rank's bytes are compared with numpy's
bytes of the tensor (the fixture script's `tensors.json` sidecars), cut by plain index
arithmetic here, and the two ranks' pieces put together give numpy's whole tensor."""

import numpy as np
import pytest

import numapin
from test_whole import DENSE_FIXTURES, numpy_tensors

# The FP8 fixture's MLP weights have 96 and 160 rows under 128-row scale blocks: half of
# them would cut a block (refused, below), so those classes stay whole there.
KEPT_WHOLE = {"fam-deepseek-v3-fp8": ["dense_mlp", "shared"]}
# The classes a dense slice cuts (their tensors of two or more dimensions).
SLICEABLE = {"shared", "attention", "dense_mlp", "embeddings", "head"}


def place_rank(path, k, whole):
    return numapin.Checkpoint(path).place(
        "interleave:all", "interleave:all", experts_held=f"{k}/2",
        dense_slice=f"rows:{k}/2", whole=whole, loader_threads=2, progress=False)


def held_bytes(model, tensor):
    """The tensor's bytes on this rank, or None where it holds none of them."""
    try:
        return np.asarray(model.tensor(tensor)).tobytes()
    except numapin.NumapinError:
        return None


def check_experts(ranks, tensor, shape, data, layer):
    """Every expert in exactly one rank, with numpy's bytes."""
    parts = [held_bytes(r, tensor) for r in ranks]
    if any(p is not None for p in parts):
        # One tensor per expert: exactly one rank holds it, byte for byte.
        assert sorted(p == data for p in parts if p is not None) == [True], tensor
        assert sum(p is None for p in parts) == 1, tensor
        return
    # One tensor holding every expert of the layer: expert e's pieces are numpy's e-th
    # slice of it, in exactly one rank; the other raises NotHeld.
    per = len(data) // shape[0]
    for e in range(shape[0]):
        holders = []
        for r in ranks:
            try:
                holders.append(r.expert(layer, e))
            except numapin.NotHeld as err:
                assert str(e) in str(err)
        assert len(holders) == 1, (tensor, e)
        assert any(np.asarray(p).tobytes() == data[e * per:(e + 1) * per]
                   for p in holders[0].values()), (tensor, e)


@pytest.mark.parametrize("name", DENSE_FIXTURES)
def test_two_ranks_shares_concatenate_to_numpys_tensors(fixture, name):
    fx = fixture(name)
    want = numpy_tensors(fx.root)
    whole = KEPT_WHOLE.get(name, [])
    ranks = [place_rank(fx.path, k, whole) for k in (0, 1)]
    for k, r in enumerate(ranks):
        assert f"rows:{k}/2" in r.share and r.verify()["verified"], r.share
    classes = {t: (c, l) for t, c, l in ranks[0].classes()}
    sliced = 0
    for tensor, (shape, data) in want.items():
        cls, layer = classes[tensor]
        if cls == "experts":
            check_experts(ranks, tensor, shape, data, layer)
            continue
        parts = [held_bytes(r, tensor) for r in ranks]
        if cls in SLICEABLE and len(shape) >= 2 and cls not in whole:
            half = len(data) // 2
            assert parts == [data[:half], data[half:]], f"{name} {tensor}: rows"
            view = ranks[0].tensor(tensor)
            if view.dtype != "U8":
                assert list(view.shape) == [shape[0] // 2] + shape[1:], tensor
            sliced += 1
        else:
            assert parts == [data, data], f"{name} {tensor}: whole on every rank"
    assert sliced > 0


def test_bad_shares_are_typed_errors(fixture):
    path = fixture("st-sharded").path
    ckpt = numapin.Checkpoint(path)
    with pytest.raises(numapin.InvalidArgument, match="3/2|k < n"):
        ckpt.place(experts_held="3/2", progress=False)
    with pytest.raises(numapin.InvalidArgument):
        ckpt.place(experts_held="+1", progress=False)
    with pytest.raises(numapin.InvalidArgument):
        ckpt.place(dense_slice="diagonal:0/2", progress=False)
    with pytest.raises(numapin.InvalidArgument, match="tensor class"):
        ckpt.place(dense_slice="rows:0/2", whole=["attn"], progress=False)
    with pytest.raises(numapin.InvalidArgument, match="overlapping"):
        ckpt.place(experts_held="0-1,1-2", progress=False)
    # A slice that cuts an FP8 scale block names the tensor and the block.
    fp8 = numapin.Checkpoint(fixture("fam-deepseek-v3-fp8").path)
    with pytest.raises(numapin.InvalidArgument, match="weight_scale_inv.*scale blocks"):
        fp8.place(dense_slice="rows:0/2", progress=False)


# Megatron's convention, written here from the names alone: column-parallel weights and
# the vocabulary-parallel embedding and head by rows, row-parallel ones by columns.
TP_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
TP_COLUMNS = ("o_proj", "down_proj")


def tp_axis(tensor, shape):
    """The axis the convention cuts `tensor` along (an FP8 `weight_scale_inv` grid with
    its weight), or None for a tensor every rank holds whole."""
    parts = tensor.split(".")
    if len(shape) < 2 or parts[-1] not in ("weight", "weight_scale_inv"):
        return None
    if any(p in TP_ROWS for p in parts):
        return "rows"
    if any(p in TP_COLUMNS for p in parts):
        return "columns"
    return None


def test_tensor_parallel_ranks_put_back_together_are_numpys(fixture):
    """`tensor_parallel="k/2"` on the sharded safetensors: every weight the convention
    cuts is numpy's rows or columns k of 2, the two ranks' parts side by side are numpy's
    tensor, every other tensor is whole on both ranks."""
    fx = fixture("st-sharded")
    want = numpy_tensors(fx.root)
    ckpt = numapin.Checkpoint(fx.path)
    ranks = [ckpt.place("interleave:all", "interleave:all", tensor_parallel=f"{k}/2",
                        progress=False) for k in (0, 1)]
    cut = {"rows": 0, "columns": 0}
    classes = {t: (c, l) for t, c, l in ranks[0].classes()}
    for tensor, (shape, data) in want.items():
        cls, layer = classes[tensor]
        if cls == "experts":
            # One tensor per expert here: `...experts.E.ROLE.weight`, read by role.
            e, role = int(tensor.split(".")[-3]), tensor.split(".")[-2]
            if tensor.endswith("_scale_inv"):
                role += " scale"
            parts = [np.asarray(r.expert(layer, e)[role]) for r in ranks]
        else:
            parts = [np.asarray(r.tensor(tensor)) for r in ranks]
        axis = tp_axis(tensor, shape)
        if axis is None:
            assert [p.tobytes() for p in parts] == [data, data], tensor
            continue
        full = np.frombuffer(data, dtype=np.uint8).reshape(shape[0], -1)
        width = full.shape[1]
        for k, p in enumerate(parts):
            raw = np.frombuffer(p.tobytes(), dtype=np.uint8)
            if axis == "rows":
                assert raw.tobytes() == full[k * shape[0] // 2:(k + 1) * shape[0] // 2].tobytes(), tensor
            else:
                half = width // 2
                assert raw.tobytes() == full[:, k * half:(k + 1) * half].tobytes(), tensor
        cut[axis] += 1
    assert cut["rows"] > 0 and cut["columns"] > 0, cut
    with pytest.raises(numapin.InvalidArgument, match="k/n"):
        ckpt.place(tensor_parallel="+1/2", progress=False)
    with pytest.raises(numapin.InvalidArgument):
        ckpt.place(tensor_parallel="2/2", progress=False)


def test_a_per_expert_tensor_by_name_is_its_held_part(fixture):
    """Issue 31: under EP+TP (`experts_held="k/2"`, `tensor_parallel="k/2"`),
    `tensor(name)` of a per-expert tensor is numpy's cut of the file's tensor where the
    rank holds the expert (gate/up rows, down columns, FP8 scale grids with their weight),
    and raises NotHeld where it does not; the view of a tensor holding every expert names
    its layer as a number; `expert_slice=` with `tensor_parallel=` is refused by name."""
    fx = fixture("st-sharded")
    want = numpy_tensors(fx.root)
    ckpt = numapin.Checkpoint(fx.path)
    ranks = [ckpt.place("interleave:all", "interleave:all", experts_held=f"{k}/2",
                        tensor_parallel=f"{k}/2", progress=False) for k in (0, 1)]
    held = refused = 0
    for tensor, (shape, data) in want.items():
        parts = tensor.split(".")
        if "experts" not in parts:
            continue
        layer, e = int(parts[2]), int(parts[parts.index("experts") + 1])
        experts = fx.layers[layer]
        axis = tp_axis(tensor, shape)
        full = np.frombuffer(data, dtype=np.uint8).reshape(shape[0], -1)
        for k, rank in enumerate(ranks):
            if not k * experts // 2 <= e < (k + 1) * experts // 2:
                with pytest.raises(numapin.NotHeld, match=f"expert {e}"):
                    rank.tensor(tensor)
                refused += 1
                continue
            view = np.asarray(rank.tensor(tensor))
            if axis == "rows":
                cut, cut_shape = full[k * shape[0] // 2:(k + 1) * shape[0] // 2], \
                    (shape[0] // 2, shape[1])
            else:
                half = full.shape[1] // 2
                cut, cut_shape = full[:, k * half:(k + 1) * half], (shape[0], shape[1] // 2)
            assert view.shape == cut_shape, (tensor, k, view.shape)
            assert view.tobytes() == cut.tobytes(), (tensor, k)
            held += 1
    assert held > 0 and refused > 0, (held, refused)
    gguf = numapin.Checkpoint(fixture("gguf-single").path).place(progress=False)
    with pytest.raises(numapin.InvalidArgument, match="layer 1") as err:
        gguf.tensor("blk.1.ffn_gate_exps.weight")
    assert "Some(" not in str(err.value)
    with pytest.raises(numapin.InvalidArgument, match="expert_slice=.*tensor_parallel"):
        ckpt.place(expert_slice="rows:0/2", tensor_parallel="0/2", progress=False)
