"""Hostile inputs for `WholeModel.layer(layer, role, through=None)` (round 6): experts of
one layer whose tensors are not alike, layer numbers out of range, `through` in the wrong
order, writing through the view. Checkpoints are written here with safetensors.numpy;
the expected bytes are numpy's."""

import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

import numapin


def _write(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    return path


def _experts(dtypes):
    """Layer 0 MoE, one expert per dtype: gate, up and down_proj of 128 bytes each whatever
    the dtype (so every slot has the same size), numpy's values."""
    rng = np.random.default_rng(6)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((4, 8)).astype(np.float32)}
    for e, dtype in enumerate(dtypes):
        per_row = 32 // np.dtype(dtype).itemsize
        for role in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"model.layers.0.mlp.experts.{e}.{role}.weight"] = (
                (rng.standard_normal((4, per_row)) * 100).astype(dtype))
    return tensors


def test_a_layer_whose_experts_differ_in_dtype_is_refused_before_any_view(tmp_path):
    """Expert 1's tensors are int16 where expert 0's are float16 (same shape and bytes):
    one [E, ...] view (built from expert 0's dtype) would show expert 1's integers as
    float16 values. The checkpoint refuses such a layer when it is read, naming both."""
    tensors = _experts([np.float16, np.int16, np.float16])
    with pytest.raises(numapin.CheckpointError, match="I16 .4, 16. here, F16"):
        numapin.Checkpoint(_write(tmp_path, tensors)).place(
            "interleave:all", "interleave:all", progress=False)


def test_layer_numbers_and_roles_out_of_range_are_errors(tmp_path):
    tensors = _experts([np.float32, np.float32])
    model = numapin.Checkpoint(_write(tmp_path, tensors)).place(
        "interleave:all", "interleave:all", progress=False)
    view = np.asarray(model.layer(0, "gate_proj", through="up_proj"))
    for e in range(2):
        want = b"".join(tensors[f"model.layers.0.mlp.experts.{e}.{r}.weight"].tobytes()
                        for r in ("gate_proj", "up_proj"))
        assert view[e].tobytes() == want
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0, 0, 0] = 1.0
    for layer in (1, 2**31, 2**63 - 1):
        with pytest.raises(numapin.NumapinError):
            model.layer(layer, "up_proj")
    for layer in (-1, 2**64):
        with pytest.raises((OverflowError, numapin.NumapinError)):
            model.layer(layer, "up_proj")
    with pytest.raises(numapin.InvalidArgument, match="does not follow"):
        model.layer(0, "up_proj", through="gate_proj")
    with pytest.raises(numapin.InvalidArgument, match="no role"):
        model.layer(0, "up_proj", through="nope")
