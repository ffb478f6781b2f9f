"""The whole model placed from Python (`Checkpoint.place`): every tensor read by name
through a view, against numpy's bytes of the tensor (the `tensors.json` + `tensors/*.bin`
sidecars make_fixtures.py writes with numpy, and safetensors.numpy / gguf's reader for
dtypes), zero copy, read-only; plans as strings, bad plans typed."""

import gc
import json
import threading

import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

import numapin
from test_views import array, mapping_of

# The fixtures whose script writes every tensor's numpy bytes beside the model.
DENSE_FIXTURES = ["st-sharded", "gguf-single", "gguf-split", "fam-deepseek-v3-fp8"]


def numpy_tensors(root):
    """numpy's side: {name: (shape, bytes)} in file order."""
    entries = json.loads((root / "tensors.json").read_text())
    return {t["name"]: (t["shape"], (root / "tensors" / t["file"]).read_bytes())
            for t in entries}


def expert_layer(model, name):
    for tensor, cls, layer in model.classes():
        if tensor == name:
            return cls, layer
    raise AssertionError(name)


@pytest.mark.parametrize("name", DENSE_FIXTURES)
@pytest.mark.parametrize("experts,dense", [("split:all", "replicate:all"),
                                           ("interleave:all", "interleave:all")])
def test_every_tensor_equals_numpys_bytes(fixture, name, experts, dense):
    fx = fixture(name)
    want = numpy_tensors(fx.root)
    model = numapin.Checkpoint(fx.path).place(experts, dense, loader_threads=2,
                                              progress=False)
    assert sorted(model.tensors()) == sorted(want), "every tensor placed"
    assert len(model) == len(want)
    assert model.verify()["verified"]
    # The text form names the nodes `all` stood for.
    assert model.plan.startswith(f"experts={experts.split(':')[0]}:")
    dense_seen = 0
    for tensor, (shape, data) in want.items():
        cls, layer = expert_layer(model, tensor)
        try:
            v = model.tensor(tensor)
        except numapin.InvalidArgument:
            # A tensor holding every expert of a layer: expert e's pieces are numpy's
            # e-th slice of it.
            assert cls == "experts", tensor
            experts_n = shape[0]
            per = len(data) // experts_n
            for e in range(experts_n):
                pieces = [p for p in model.expert(layer, e).values()
                          if np.asarray(p).nbytes == per]
                assert any(np.asarray(p).tobytes() == data[e * per:(e + 1) * per]
                           for p in pieces), (tensor, e)
            continue
        a = np.asarray(v)
        assert a.tobytes() == data, f"{name} {tensor}: bytes differ from numpy's"
        # numpy's shape, unless the dtype has no numpy/DLPack type (raw uint8 blocks).
        if v.dtype == "U8" and len(v.shape) == 1 and list(v.shape) != shape:
            assert v.shape == [len(data)], tensor
        else:
            assert list(v.shape) == shape, tensor
        # Zero copy, in an anonymous mapping (a store's region, not the file), read-only.
        assert a.__array_interface__["data"][0] == v.address
        if v.nbytes:
            _, _, path = mapping_of(v.address)
            assert not path.startswith("/"), (tensor, path)
        assert not a.flags.writeable
        dense_seen += cls != "experts"
    assert dense_seen > 0


def test_safetensors_dtypes_and_values_are_the_files(fixture):
    fx = fixture("st-sharded")
    files = sorted(fx.path.glob("*.safetensors")) if fx.path.is_dir() else [fx.path]
    numpy_side = {}
    for f in files:
        numpy_side.update(safetensors_numpy.load_file(str(f)))
    model = numapin.Checkpoint(fx.path).place(progress=False)
    checked = 0
    for name, want in numpy_side.items():
        try:
            v = model.tensor(name)
        except numapin.InvalidArgument:
            continue
        a = array(v)
        assert a.dtype == want.dtype and a.shape == want.shape, name
        np.testing.assert_array_equal(a, want)
        checked += 1
    assert checked > 0


def test_gguf_types_are_the_readers(fixture):
    gguf = pytest.importorskip("gguf")
    fx = fixture("gguf-single")
    reader = gguf.GGUFReader(str(fx.path))
    model = numapin.Checkpoint(fx.path).place(progress=False)
    kinds = set()
    for t in reader.tensors:
        try:
            v = model.tensor(t.name)
        except numapin.InvalidArgument:
            continue
        a = np.asarray(v)
        kind = t.tensor_type.name
        kinds.add(kind)
        if kind in ("F32", "F16"):
            # The reader's array: numpy's dtype and shape (ne reversed).
            assert a.dtype == t.data.dtype and list(a.shape) == list(t.data.shape), t.name
            np.testing.assert_array_equal(a, t.data)
        else:
            # A quant block type: raw bytes, all of them.
            assert v.dtype == "U8" and a.dtype == np.uint8, t.name
            assert a.tobytes() == np.asarray(t.data).tobytes(), t.name
    assert "F32" in kinds and len(kinds) > 1, kinds


def test_a_view_outlives_its_model(fixture):
    fx = fixture("gguf-single")
    want = numpy_tensors(fx.root)
    model = numapin.Checkpoint(fx.path).place(progress=False)
    name = next(n for n in want if not n.startswith("blk.1.ffn"))
    v = model.tensor(name)
    a = np.asarray(v)
    del model, v
    gc.collect()
    assert a.tobytes() == want[name][1]


def test_plan_text_and_class_overrides(fixture):
    fx = fixture("gguf-single")
    ckpt = numapin.Checkpoint(fx.path)
    model = ckpt.place(plan="experts=interleave:all,dense=replicate:all,"
                            "*.attn_q.*=interleave:all", embeddings="unplaced",
                       progress=False)
    assert model.plan.startswith("experts=interleave:")
    assert ";*.attn_q.*=interleave:" in model.plan
    assert ";attention=replicate:" in model.plan
    assert "embeddings=unplaced" in model.plan
    report = model.report_dict()
    assert report["plan"] == model.plan
    assert "embeddings" in model.report()
    stats = model.stats()
    assert stats["experts"] is not None
    classes = {s["class"] for s in stats["dense"]}
    assert "embeddings" in classes and "attention" in classes
    # The attention class is split over two stores: the pattern's and the class's.
    assert sum(s["class"] == "attention" for s in stats["dense"]) == 2
    assert model.verify()["verified"]


def test_bad_plans_are_typed_errors(fixture):
    fx = fixture("gguf-single")
    ckpt = numapin.Checkpoint(fx.path)
    with pytest.raises(numapin.InvalidArgument, match="nothing_like_this"):
        ckpt.place(plan="*.nothing_like_this.*=interleave:all", progress=False)
    with pytest.raises(numapin.InvalidArgument):
        ckpt.place(dense="scatter:all", progress=False)
    with pytest.raises(numapin.InvalidArgument):
        ckpt.place(experts="bind:0", progress=False)
    with pytest.raises(numapin.InvalidArgument):
        ckpt.place(plan="experts", progress=False)
    with pytest.raises(numapin.InvalidArgument, match="not a tensor class"):
        ckpt.place(attn="interleave:all", progress=False)
    model = ckpt.place(progress=False)
    with pytest.raises(numapin.InvalidArgument, match="no_such_tensor"):
        model.tensor("no_such_tensor")
    with pytest.raises(numapin.NotPacked):
        model.expert(99, 0)
    with pytest.raises(numapin.InvalidArgument):
        model.expert(1, 99)


def test_progress_is_reported_and_a_raise_aborts(fixture):
    fx = fixture("st-sharded")
    ckpt = numapin.Checkpoint(fx.path)
    seen = []
    ckpt.place(progress=seen.append)
    assert seen and all(isinstance(p, numapin.Progress) for p in seen)

    class Stop(Exception):
        pass

    def stop(_):
        raise Stop

    with pytest.raises(Stop):
        ckpt.place(progress=stop)
    # The checkpoint places again after the abort.
    assert ckpt.place(progress=False).verify()["verified"]


def test_threads_read_while_others_place(fixture):
    fx = fixture("gguf-single")
    want = numpy_tensors(fx.root)
    ckpt = numapin.Checkpoint(fx.path)
    model = ckpt.place(progress=False)
    names = [n for n in want if n in model.tensors()]
    errors = []

    def read():
        try:
            for _ in range(20):
                for n in names:
                    try:
                        v = model.tensor(n)
                    except numapin.InvalidArgument:
                        continue
                    assert np.asarray(v).tobytes() == want[n][1]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def place():
        try:
            for _ in range(3):
                assert ckpt.place(progress=False).verify()["verified"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (read, read, place)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("name", DENSE_FIXTURES)
def test_a_layer_view_of_the_whole_model_is_numpys_experts(fixture, name):
    """`WholeModel.layer(l, role)`: one `[E, ...]` view over the layer's region at the slot
    stride, each row numpy's bytes of one expert's tensor (found by its bytes among the
    layer's expert tensors numpy wrote, not through numapin's naming)."""
    fx = fixture(name)
    want = numpy_tensors(fx.root)
    model = numapin.Checkpoint(fx.path).place("interleave:all", "interleave:all",
                                              loader_threads=2, progress=False)
    per_layer = {}
    for tensor, cls, layer in model.classes():
        if cls == "experts":
            per_layer.setdefault(layer, []).append(want[tensor][1])
    assert per_layer, "the fixture has experts"
    for layer, datas in per_layer.items():
        experts = model.expert(layer, 0)
        for role, first in experts.items():
            view = model.layer(layer, role)
            got = np.asarray(view)
            assert not got.flags.writeable
            # Zero copy: row 0 is expert 0's piece, the outer stride the slot stride.
            assert view.address == first.address
            assert view.strides[0] == model.expert(layer, 1)[role].address - first.address
            for e in range(got.shape[0]):
                row = got[e].tobytes()
                assert row == np.asarray(model.expert(layer, e)[role]).tobytes()
                # numpy's bytes: a whole per-expert tensor, or expert e's part of a fused one.
                assert any(row == data or row in _rows_of(data, got.shape[0], e)
                           for data in datas), (name, layer, role, e)
    with pytest.raises(numapin.InvalidArgument, match="no role"):
        model.layer(min(per_layer), "nope")


def _rows_of(data, experts, e):
    """Expert e's part of a tensor holding every expert (numpy's e-th slice), if the
    tensor's size divides evenly."""
    if len(data) % experts:
        return ()
    per = len(data) // experts
    return (data[e * per:(e + 1) * per],)


def _mappings_over(start, end):
    """(start, end) of this process's mappings overlapping [start, end), in order."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            if a < end and b > start:
                out.append((a, b))
    return sorted(out)


@pytest.mark.parametrize("name", ["gguf-single", "st-sharded"])
def test_a_split_layer_is_one_range_and_each_role_one_view(fixture, name):
    """Split over the nodes, a layer is one virtual range per kind bound node block by
    node block: every role is one strided view, its rows numpy's bytes, the layer's
    mappings back to back in /proc/self/maps (one per node block; the VM checks the
    nodes page by page, tests/whole_model/one_range.rs). Buffered reads: direct reads
    may place a piece congruent to its file offset, off the stride."""
    fx = fixture(name)
    want = numpy_tensors(fx.root)
    model = numapin.Checkpoint(fx.path).place("split:all", "replicate:all",
                                              read_mode="buffered", progress=False)
    for layer in model.layers:
        ids = model.expert_ids(layer)
        for role, first in model.expert(layer, ids[0]).items():
            view = model.layer(layer, role)
            got = np.asarray(view)
            assert view.address == first.address and got.shape[0] == len(ids)
            stride = view.strides[0]
            for e in ids:
                piece = model.expert(layer, e)[role]
                assert piece.address == first.address + e * stride, (name, layer, role, e)
                row = got[e].tobytes()
                assert row == np.asarray(piece).tobytes()
                assert any(row == data or row in _rows_of(data, len(ids), e)
                           for _, data in want.values()), (name, layer, role, e)
            # The view's bytes, from its first row's first byte to its last row's last.
            end = first.address + (len(ids) - 1) * stride + got[0].nbytes
            maps = _mappings_over(first.address, end)
            assert maps and maps[0][0] <= first.address and maps[-1][1] >= end
            assert all(a[1] == b[0] for a, b in zip(maps, maps[1:])), maps
