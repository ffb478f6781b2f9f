"""Placed weights nobody can overwrite, and views that say what they span. A write through
a writable array made over a view's address (ctypes: what torch.from_dlpack, which
ignores DLPack's read-only flag, would allow) dies with SIGSEGV in a child process unless
the model was placed writable=True; `span_bytes` of a strided layer view against numpy's
own byte bounds of the same array. Checkpoints are written here with safetensors.numpy."""

import signal
import subprocess
import sys

import numpy as np
import safetensors.numpy as safetensors_numpy

import numapin


def _checkpoint(tmp_path):
    rng = np.random.default_rng(31)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((64, 32)).astype(np.float32)}
    for e in range(3):
        for role in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"model.layers.0.mlp.experts.{e}.{role}.weight"] = (
                rng.standard_normal((8, 16)).astype(np.float32))
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    return path, tensors


CHILD = """
import ctypes, sys
import numapin
path, writable, what = sys.argv[1], sys.argv[2] == "writable", sys.argv[3]
model = numapin.Checkpoint(path).place("interleave:all", "interleave:all",
                                       progress=False, writable=writable)
view = (model.tensor("model.embed_tokens.weight") if what == "dense"
        else model.layer(0, "gate_proj"))
memory = (ctypes.c_uint8 * view.nbytes).from_address(view.address)
print("writing now", flush=True)
memory[5] = memory[5] ^ 0xFF
print("wrote", bytes(memoryview(view).cast("B")[:8]) == bytes(memory[:8]), flush=True)
"""


def _child(path, mode, what):
    return subprocess.run([sys.executable, "-c", CHILD, str(path), mode, what],
                          capture_output=True, text=True, timeout=300)


def test_a_write_through_a_pointer_from_a_view_faults(tmp_path):
    path, _ = _checkpoint(tmp_path)
    for what in ("dense", "experts"):
        out = _child(path, "default", what)
        assert "writing now" in out.stdout, (what, out.stdout, out.stderr)
        assert out.returncode == -signal.SIGSEGV, (what, out.returncode, out.stdout,
                                                    out.stderr)
    # Asked for writable memory: the write goes through, and the view sees it.
    out = _child(path, "writable", "dense")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "wrote True" in out.stdout, out.stdout


def test_placed_memory_is_read_only_in_proc_maps(tmp_path):
    path, _ = _checkpoint(tmp_path)
    for writable, perms in ((False, "r--p"), (True, "rw-p")):
        model = numapin.Checkpoint(path).place("interleave:all", "interleave:all",
                                               progress=False, writable=writable)
        view = model.tensor("model.embed_tokens.weight")
        with open("/proc/self/maps") as maps:
            lines = [line.split() for line in maps]
        holding = [f for f in lines
                   if int(f[0].split("-")[0], 16) <= view.address < int(f[0].split("-")[1], 16)]
        assert [f[1] for f in holding] == [perms], holding


def _byte_bounds(a):
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # numpy < 2
        byte_bounds = np.byte_bounds
    return byte_bounds(a)


def test_span_bytes_is_numpys_byte_bounds(tmp_path):
    path, tensors = _checkpoint(tmp_path)
    model = numapin.Checkpoint(path).place("interleave:all", "interleave:all",
                                           progress=False)
    for view in (model.layer(0, "gate_proj"), model.layer(0, "up_proj"),
                 model.layer(0, "gate_proj", through="up_proj"),
                 model.tensor("model.embed_tokens.weight")):
        a = np.asarray(view)
        assert a.__array_interface__["data"][0] == view.address
        assert list(a.strides) == view.strides
        low, high = _byte_bounds(a)
        assert view.span_bytes == high - low, (view, view.span_bytes, high - low)
        assert view.address == low
        # nbytes keeps numpy's meaning: elements x itemsize.
        assert view.nbytes == a.nbytes
    strided = model.layer(0, "up_proj")
    assert strided.span_bytes > strided.nbytes  # the gaps between the experts' slots
    gate = np.asarray(strided)
    for e in range(3):
        assert gate[e].tobytes() == tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].tobytes()
