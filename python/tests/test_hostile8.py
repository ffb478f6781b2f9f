"""Round 5's hostile pass over issue 31 from Python. Each test says whether it found a bug
(and what it did before) or is an attack that held, kept as a regression test. The
checkpoint is written by safetensors.numpy; the references are numpy's own arrays and
the child's exit signal."""

import signal
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

import numapin

MIB = 1 << 20
BOUND = 4096


def _checkpoint(tmp_path):
    rng = np.random.default_rng(8)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float16),
    }
    for e in range(2):
        for role in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"model.layers.0.mlp.experts.{e}.{role}.weight"] = (
                rng.standard_normal((4, 8)).astype(np.float32))
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    return path, tensors


@pytest.fixture
def ckpt(tmp_path):
    return numapin.Checkpoint(_checkpoint(tmp_path)[0])


def test_a_slice_bound_of_a_megabyte_is_echoed_clipped(ckpt):
    """Bug (fixed): `slice_pattern={"*": slice(<1 MB str>, 5)}` raised an InvalidArgument
    quoting the bound whole (str() of the object: 1,048,6xx bytes)."""
    for bound in ("x" * MIB, "é" * (MIB // 2)):
        for keyword in ("slice_pattern", "slice_class"):
            key = "*" if keyword == "slice_pattern" else "attention"
            with pytest.raises(numapin.InvalidArgument) as e:
                ckpt.place(progress=False, **{keyword: {key: slice(bound, 5)}})
            message = str(e.value)
            assert len(message) < BOUND, (keyword, len(message))
            assert "row indices are integers" in message, message[:300]


def test_a_type_named_by_a_megabyte_is_echoed_clipped(ckpt):
    """Bug (fixed): a value of a class whose name is a megabyte (`type("x" * 2**20, (),
    {})()`) given where a layout string or a slice goes raised a TypeError naming the
    type whole."""
    huge = type("x" * MIB, (), {})()
    for kwargs in ({"attention": huge}, {"slice_pattern": {"*": huge}}):
        with pytest.raises(TypeError) as e:
            ckpt.place(progress=False, **kwargs)
        message = str(e.value)
        assert len(message) < BOUND, (list(kwargs), len(message))
        assert "not " in message, message[:300]


CHILD = """
import ctypes, sys
import numpy as np
import numapin
path, how = sys.argv[1], sys.argv[2]
model = numapin.Checkpoint(path).place("interleave:all", "interleave:all", progress=False)
view = model.tensor("model.embed_tokens.weight")
array = np.from_dlpack(view) if how == "dlpack" else np.asarray(view)
print("writeable", array.flags.writeable, flush=True)
try:
    array.setflags(write=True)
    target = array.reshape(-1).view(np.uint8)
except ValueError as e:
    print("refused", e, flush=True)
    # numpy's flag is numpy's honour: the same memory through ctypes, writable to numpy.
    target = np.ctypeslib.as_array(
        (ctypes.c_uint8 * array.nbytes).from_address(array.ctypes.data))
print("writable to numpy", target.flags.writeable, flush=True)
print("writing now", flush=True)
target[0] ^= 0xFF
print("wrote", flush=True)
"""


def test_a_write_through_numpy_or_dlpack_arrays_of_a_view_faults(tmp_path):
    """Held: the numpy array of a view (np.asarray, np.from_dlpack) is read-only; numpy
    refuses setflags(write=True) on it, and a write through an array numpy is told is
    writable dies with SIGSEGV in a child: the kernel's protection, not numpy's flag."""
    path, _ = _checkpoint(tmp_path)
    for how in ("asarray", "dlpack"):
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), how],
                             capture_output=True, text=True, timeout=300)
        assert "writeable False" in out.stdout, (how, out.stdout, out.stderr)
        assert "writable to numpy True" in out.stdout, (how, out.stdout, out.stderr)
        assert "writing now" in out.stdout and "wrote" not in out.stdout, (how, out.stdout)
        assert out.returncode == -signal.SIGSEGV, (how, out.returncode, out.stderr[-2000:])
