"""Issue 31 items 6 and 8 from Python: a megabyte given to `place()` (a layout keyword, a
plan item, a read mode, a share) is echoed clipped, a message of at most a few KiB that
still says what is wrong (before: `place(experts=<1 MB>)` raised a 1,048,706-byte
InvalidArgument); a plan's text form (`model.plan`) reads back as the same plan for
patterns named like keys; a pattern every match of which a later pattern claims is
named as shadowed. The checkpoint is written by safetensors.numpy."""

import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

import numapin

MIB = 1 << 20
BOUND = 4096


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(31)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.norm.weight": rng.standard_normal((8,)).astype(np.float32),
        "model.layers.0.input_layernorm.weight": rng.standard_normal((8,)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float16),
        # Tensors named like the text form's keys, and padded.
        "norms": rng.standard_normal((4,)).astype(np.float32),
        "dense": rng.standard_normal((4,)).astype(np.float32),
        " padded ": rng.standard_normal((4,)).astype(np.float32),
        "a;b=c": rng.standard_normal((4,)).astype(np.float32),
    }
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    return numapin.Checkpoint(path)


@pytest.mark.parametrize("kwargs,needle", [
    ({"experts": "x" * MIB}, "unknown layout"),
    ({"experts": "é" * (MIB // 2)}, "unknown layout"),
    ({"experts": "unplaced:" + "x" * MIB}, "unplaced takes no node set"),
    ({"attention": "x" * MIB}, "dense layout"),
    ({"dense": "bind:" + "9" * MIB}, "not a node number"),
    ({"dense": "unplaced:" + "x" * MIB}, "dense layout"),
    ({"norms": "interleave:" + "x" * MIB}, "node string"),
    # The plan text is parsed on its own (typed keywords, then `plan`): an item needs `=`.
    ({"plan": "x" * MIB}, "KEY=VALUE"),
    ({"plan": "=" + "x" * MIB}, "empty key"),
    ({"plan": '"' + "x" * MIB}, "quoted pattern"),
    ({"plan": "x" * MIB + "=bind:0"}, "matches no dense tensor"),
    ({"read_mode": "x" * MIB}, "read_mode"),
    ({"experts_held": "x" * MIB}, "expert"),
    ({"expert_slice": "x" * MIB}, "AXIS"),
    ({"dense_slice": "rows:" + "x" * MIB}, "rows"),
    ({"tensor_parallel": "1/" + "9" * MIB}, "k/n"),
    ({"whole": ["x" * MIB]}, "not a tensor class"),
])
def test_a_megabyte_is_echoed_clipped(ckpt, kwargs, needle):
    with pytest.raises(numapin.InvalidArgument) as e:
        ckpt.place(progress=False, **kwargs)
    message = str(e.value)
    assert len(message) < BOUND, (len(message), message[:300])
    assert needle in message, message[:600]


def test_a_megabyte_progress_value_is_echoed_clipped(ckpt):
    """Before: the TypeError quoted the value's whole repr (1,048,644 bytes)."""
    with pytest.raises(TypeError) as e:
        ckpt.place(progress="x" * MIB)
    assert len(str(e.value)) < BOUND and "progress must be a callable" in str(e.value)


@pytest.mark.parametrize("name", ["norms", "dense", " padded ", "a;b=c"])
def test_the_plan_text_reads_back_for_patterns_named_like_keys(ckpt, name):
    """Before: `norms=bind:0` read back as the norms class's layout, `" padded "` as a
    trimmed pattern that matches nothing, `a;b=c` was refused."""
    quoted = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    model = ckpt.place(plan=quoted + "=bind:0", progress=False)
    assert model.verify()["verified"]
    again = ckpt.place(plan=model.plan, progress=False)
    assert again.plan == model.plan
    # The tensor named like a key kept its bytes, read by name.
    assert np.asarray(again.tensor(name)).tobytes() == np.asarray(model.tensor(name)).tobytes()


def test_a_shadowed_pattern_names_the_pattern_that_claims_its_tensors(ckpt):
    """Before: "matches no dense tensor", although `*norm*` matches and `*` claims."""
    with pytest.raises(numapin.InvalidArgument) as e:
        ckpt.place(plan="*norm*=bind:0;*=unplaced", progress=False)
    message = str(e.value)
    assert '"*norm*"' in message and 'claimed by the later pattern(s) "*"' in message, message
    assert "matches no dense tensor" not in message, message
