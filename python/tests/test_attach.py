"""A whole model served by name from Python: `Checkpoint.place(..., serve_as=name)` in
this process, `numapin.attach(name)` in another (sys.executable -c), every tensor there
equal to numpy's bytes (the tensors.json + tensors/*.bin sidecars make_fixtures.py
writes with numpy), read through numpy and DLPack; the name is served as long as the
placer's WholeModel lives."""

import gc
import json
import os
import subprocess
import sys

import pytest

import numapin

CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
import numapin

name, root = sys.argv[1], Path(sys.argv[2])
want = {t["name"]: (t["shape"], (root / "tensors" / t["file"]).read_bytes())
        for t in json.loads((root / "tensors.json").read_text())}
model = numapin.attach(name, timeout=20.0)
assert model.attached and model.served_as is None
assert sorted(model.tensors()) == sorted(want), "the same tensors"
whole = pieces = 0
covered = set()
for tensor, (shape, data) in want.items():
    try:
        v = model.tensor(tensor)
    except numapin.InvalidArgument:
        continue  # every expert of a layer in one tensor: read by expert() below
    a = np.asarray(v)
    assert a.tobytes() == data, tensor
    assert not a.flags.writeable, tensor
    assert np.from_dlpack(v).tobytes() == data, tensor
    covered.add(tensor)
    whole += 1
for layer in model.layers:
    for e in model.expert_ids(layer):
        for role, view in model.expert(layer, e).items():
            got = np.asarray(view).tobytes()
            for tensor, (shape, data) in want.items():
                per = len(data) // max(shape[0], 1)
                if got == data or (len(got) == per and got == data[e * per:(e + 1) * per]):
                    covered.add(tensor)
                    break
            else:
                raise AssertionError(f"layer {layer} expert {e} {role}: no numpy match")
            pieces += 1
missing = sorted(set(want) - covered)
assert not missing, missing
try:
    model.verify()
    raise AssertionError("verify without a checkpoint")
except numapin.InvalidArgument:
    pass
print(json.dumps({"tensors": whole, "pieces": pieces}))
"""


def attach_in_child(name, root):
    return subprocess.run([sys.executable, "-c", CHILD, name, str(root)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["st-sharded", "gguf-single"])
def test_attach_in_another_process_equals_numpy(fixture, name):
    fx = fixture(name)
    serve_name = f"pytest-{os.getpid()}-{name}"
    model = numapin.Checkpoint(fx.path).place("split:all", "replicate:all", loader_threads=2,
                                              progress=False, serve_as=serve_name)
    assert model.served_as == serve_name and not model.attached
    out = attach_in_child(serve_name, fx.root)
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["tensors"] + counts["pieces"] > 0, counts
    # The placer still reads its (now frozen) model.
    assert model.verify()["verified"]
    # Once the placer's model is gone, nothing serves the name.
    del model
    gc.collect()
    out = attach_in_child(serve_name, fx.root)
    assert out.returncode != 0
    assert "NumapinError" in out.stderr or "Error" in out.stderr, out.stderr
    assert serve_name in out.stderr, out.stderr


def test_attach_an_unserved_name_is_a_named_error():
    name = f"pytest-{os.getpid()}-nobody"
    with pytest.raises(numapin.NumapinError, match=name):
        numapin.attach(name, timeout=1.0)
    with pytest.raises(numapin.InvalidArgument, match="timeout"):
        numapin.attach(name, timeout=-1.0)


DBRX_CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
import numapin

name, root, ids = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
want = {t["name"]: (t["shape"], (root / "tensors" / t["file"]).read_bytes())
        for t in json.loads((root / "tensors.json").read_text())}
model = numapin.attach(name, timeout=20.0)
runs = 0
for tensor, (shape, data) in want.items():
    if ".ffn.experts.mlp." not in tensor:
        continue
    whole = np.frombuffer(data, dtype=np.float16).reshape(shape)
    rows = shape[0] // 4
    rows_held = whole[ids[0] * rows:(ids[-1] + 1) * rows]
    v = np.asarray(model.tensor(tensor))  # one run, attached
    assert v.shape == rows_held.shape, (tensor, v.shape)
    assert v.tobytes() == rows_held.tobytes(), tensor
    layer, _, role = model.locate(tensor)
    assert model.expert_ids(layer) == ids
    for i, e in enumerate(ids):
        piece = np.asarray(model.expert(layer, e)[model.role_names(layer)[role]])
        at = v.__array_interface__["data"][0] + i * piece.nbytes
        assert piece.__array_interface__["data"][0] == at, (tensor, e)
    runs += 1
print(json.dumps({"runs": runs}))
"""


@pytest.mark.parametrize("held,ids", [(None, [0, 1, 2, 3]), ("1/2", [2, 3])])
def test_an_attached_dbrx_role_tensor_is_one_view_of_numpys_rows(fixture, held, ids):
    """DBRX placed shared is role-major: in the attaching process each of w1/v1/w2 is
    one view (the held experts' rows under experts_held), numpy's bytes."""
    fx = fixture("fam-dbrx")
    serve_name = f"pytest-{os.getpid()}-dbrx-{len(ids)}"
    model = numapin.Checkpoint(fx.path).place("split:all", "replicate:all", progress=False,
                                              experts_held=held, serve_as=serve_name)
    out = subprocess.run([sys.executable, "-c", DBRX_CHILD, serve_name, str(fx.root),
                          json.dumps(ids)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"runs": 6}
    assert model.verify()["verified"]
