"""Placed checkpoints read through views: every expert's bytes against numpy's bytes
(the fixtures' expected sidecars), dtypes and shapes, zero copy, read-only."""

import gc

import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

import numapin
from conftest import Fixture, all_fixtures


def mapping_of(address: int):
    """The /proc/self/maps line holding `address`: (start, end, path)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return start, end, fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is in no mapping")


def array(view) -> np.ndarray:
    """numpy's array of a view: DLPack when numpy has the dtype, else the buffer."""
    try:
        return np.from_dlpack(view)
    except (BufferError, TypeError, ValueError, RuntimeError):
        return np.asarray(view)


@pytest.mark.parametrize("name", all_fixtures())
def test_every_expert_equals_numpys_bytes(fixture, name):
    fx: Fixture = fixture(name)
    ckpt = numapin.Checkpoint(fx.path)
    assert ckpt.experts == fx.layers
    placed = ckpt.pack("interleave:all", progress=False)
    assert placed.layers == sorted(fx.layers)
    assert placed.verify()["mismatched_slots"] == 0
    compared = 0
    for layer, experts in fx.layers.items():
        roles = placed.roles(layer)
        if fx.meta.get("roles"):
            assert roles == fx.meta["roles"]
        for e in range(experts):
            views = placed.expert(layer, e)
            assert list(views) == roles
            covered = {"weights": 0, "scales": 0}
            slots = {k: placed.slot(layer, e, k) for k in covered}
            for role, v in views.items():
                a = np.asarray(v)
                # Zero copy: the array is the view's memory, inside its expert's slot,
                # in an anonymous mapping (the store's region, not the file).
                assert a.__array_interface__["data"][0] == v.address
                kind = next(k for k, s in slots.items()
                            if s.address <= v.address < s.address + s.nbytes)
                offset = v.address - slots[kind].address
                assert offset + v.nbytes <= slots[kind].nbytes
                _, _, path = mapping_of(v.address)
                assert not path.startswith("/"), (role, path)
                # Its bytes are numpy's bytes of the tensor (the sidecar, written by numpy).
                want = fx.expected(layer, e, kind)
                assert a.tobytes() == want[offset:offset + v.nbytes], (role, e)
                covered[kind] += v.nbytes
                compared += 1
            for kind, slot in slots.items():
                want = fx.expected(layer, e, kind)
                assert np.asarray(slot).tobytes() == (want or b"")
                # The roles cover the whole slot: no byte of the expert is left out.
                assert covered[kind] == len(want or b""), (layer, e, kind)
    assert compared > 0


@pytest.mark.parametrize("name", ["st-single", "st-mixtral", "st-sharded"])
def test_roles_have_the_files_dtypes_and_shapes(fixture, name):
    fx = fixture(name)
    files = [fx.path] if fx.path.is_file() else sorted(fx.path.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(safetensors_numpy.load_file(str(f)))
    placed = numapin.Checkpoint(fx.path).pack("interleave:all", progress=False)
    checked = 0
    for layer, experts in fx.layers.items():
        for e in range(experts):
            for role, view in placed.expert(layer, e).items():
                base, _, scale = role.partition(" ")
                names = [n for n in tensors
                         if n.startswith(f"model.layers.{layer}.")
                         and f".experts.{e}.{base}.weight" in n
                         and n.endswith("weight") != bool(scale)]
                assert len(names) == 1, (layer, e, role, names)
                want = tensors[names[0]]
                got = np.from_dlpack(view)
                assert got.dtype == want.dtype and got.shape == want.shape, (role, view)
                assert np.array_equal(got, want)
                assert got.flags.writeable is False
                checked += 1
    assert checked == sum(fx.layers.values()) * len(placed.roles(min(fx.layers)))


def test_a_layer_view_is_the_fused_tensor(fixture):
    """transformers v5 keeps mlp.experts.gate_up_proj as one [E, 2I, H] tensor: the
    per-layer strided view is that tensor, without a copy."""
    fx = fixture("st-fused")
    tensors = safetensors_numpy.load_file(str(fx.path))
    placed = numapin.Checkpoint(fx.path).pack("interleave:all", progress=False)
    for layer, experts in fx.layers.items():
        for role in placed.roles(layer):
            name = next(n for n in tensors if f"layers.{layer}." in n and n.endswith(f"experts.{role}"))
            view = placed.layer(layer, role)
            for got in (np.from_dlpack(view), np.asarray(view)):
                assert got.shape == tensors[name].shape == (experts, *got.shape[1:])
                assert got.dtype == tensors[name].dtype
                assert np.array_equal(got, tensors[name])
                assert got.flags.writeable is False
            # Outer stride: the slot stride; the first expert's piece is expert 0's view.
            assert view.strides[0] == placed.slot(layer, 1).address - placed.slot(layer, 0).address
            assert view.address == placed.expert(layer, 0)[role].address
            # The whole view lies in one anonymous mapping: the layer's weights region.
            start, end, path = mapping_of(view.address)
            last = view.address + (experts - 1) * view.strides[0] + view.nbytes // experts
            assert start <= view.address and last <= end and not path.startswith("/")


def test_gguf_quant_blocks_are_raw_bytes(fixture):
    fx = fixture("gguf-single")
    ckpt = numapin.Checkpoint(fx.path)
    assert ckpt.format == "gguf"
    placed = ckpt.pack("unplaced", progress=False)
    layer = min(fx.layers)
    for view in placed.expert(layer, 0).values():
        a = np.asarray(view)
        if view.dtype == "U8":
            assert a.dtype == np.uint8 and a.ndim == 1
    quant = [n for n, d, _ in ckpt.tensors() if d.startswith("Q")]
    assert quant, "the GGUF fixture has quantised tensors"


def test_views_are_read_only_everywhere(fixture):
    fx = fixture("st-single")
    placed = numapin.Checkpoint(fx.path).pack("unplaced", progress=False)
    view = placed.expert(min(fx.layers), 0)["gate_proj"]
    assert view.readonly
    m = memoryview(view)
    assert m.readonly and m.format == "e" and m.shape == tuple(view.shape)
    with pytest.raises(TypeError):
        m[0, 0] = 1
    a = np.asarray(view)
    assert a.flags.writeable is False
    with pytest.raises(ValueError):
        a[0, 0] = 1
    d = np.from_dlpack(view)
    assert d.flags.writeable is False
    with pytest.raises(ValueError):
        d[0, 0] = 1
    # The legacy ABI (no max_version) cannot carry the flag, and still exports.
    assert view.__dlpack__() is not None
    assert view.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError):
        view.__dlpack__(copy=True)


def test_a_view_outlives_its_store(fixture):
    fx = fixture("st-fused")
    layer = min(fx.layers)
    placed = numapin.Checkpoint(fx.path).pack("interleave:all", progress=False)
    view = placed.layer(layer, "gate_up_proj")
    by_buffer = np.asarray(view)
    by_dlpack = np.from_dlpack(placed.expert(layer, 1)["down_proj"])
    slot = np.asarray(placed.slot(layer, 1))
    del placed, view
    gc.collect()
    # The arrays still read the placed bytes: numpy's own bytes.
    assert slot.tobytes() == fx.expected(layer, 1, "weights")
    assert by_dlpack.tobytes() == fx.expected(layer, 1, "weights")[-by_dlpack.nbytes:]
    assert by_buffer[1].tobytes() == fx.expected(layer, 1, "weights")[: by_buffer[1].nbytes]


def test_a_layer_view_through_two_roles_is_transformers_gate_up(fixture):
    """A checkpoint saved per expert, read as transformers v5's fused [E, 2I, H]
    gate_up_proj: gate and up are back to back in each slot, one strided view spans both."""
    fx = fixture("st-single")
    tensors = safetensors_numpy.load_file(str(fx.path))
    placed = numapin.Checkpoint(fx.path).pack("interleave:all", progress=False)
    for layer, experts in fx.layers.items():
        want = np.stack([
            np.concatenate([tensors[f"model.layers.{layer}.mlp.experts.{e}.{r}.weight"]
                            for r in ("gate_proj", "up_proj")])
            for e in range(experts)
        ])
        view = placed.layer(layer, "gate_proj", through="up_proj")
        for got in (np.from_dlpack(view), np.asarray(view)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(got, want)
        assert view.address == placed.expert(layer, 0)["gate_proj"].address
        # gate [I, H] and down [H, I] do not join; down does not follow up's slot order.
        with pytest.raises(numapin.InvalidArgument, match="cannot be joined"):
            placed.layer(layer, "gate_proj", through="down_proj")
        with pytest.raises(numapin.InvalidArgument, match="does not follow"):
            placed.layer(layer, "up_proj", through="gate_proj")
        with pytest.raises(numapin.InvalidArgument, match="does not follow"):
            placed.layer(layer, "gate_proj", through="gate_proj scale")
