"""`Checkpoint.place(convert_class=, convert_pattern=)`: tensors placed in the dtype the
framework holds (issue 33 item 2). The reference conversion is numpy's: float16 values
through `astype(float32)`, bfloat16 bits shifted into the top half of a float32."""

import json
import struct

import numpy as np
import pytest

import numapin

RNG = np.random.default_rng(33)
BF16 = RNG.integers(0, 1 << 16, size=(4, 8), dtype=np.uint16)
NORM = RNG.integers(0, 1 << 16, size=(8,), dtype=np.uint16)
F16 = np.array([1.0, -2.0, 0.5, 65504.0, 2.0**-24, -0.0, np.inf, 0.1], dtype=np.float16)
TENSORS = [
    ("model.embed_tokens.weight", "BF16", [4, 8], BF16.tobytes()),
    ("model.layers.0.input_layernorm.weight", "BF16", [8], NORM.tobytes()),
    ("model.layers.0.mlp.gate.weight", "BF16", [4, 8], BF16[::-1].tobytes()),
    ("model.layers.0.mlp.gate.e_score_correction_bias", "F16", [8], F16.tobytes()),
    ("model.layers.0.self_attn.q_proj.weight", "I8", [4, 8], bytes(range(32))),
]


@pytest.fixture
def ckpt(tmp_path):
    header, data = {}, b""
    for name, dtype, shape, raw in TENSORS:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return numapin.Checkpoint(str(path))


def bf16_as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def place(ckpt, **keywords):
    return ckpt.place("unplaced", "unplaced", progress=False, **keywords)


def test_converted_views_are_numpys_conversion_of_the_file(ckpt):
    model = place(ckpt, convert_class={"norms": "float32"},
                  convert_pattern={"*.mlp.gate.weight": np.dtype("float32")})
    gate = model.tensor("model.layers.0.mlp.gate.weight")
    assert gate.dtype == "F32"
    got = np.asarray(gate)
    assert got.dtype == np.float32 and got.shape == (4, 8)
    assert got.tobytes() == bf16_as_f32(BF16[::-1]).tobytes()
    norm = np.asarray(model.tensor("model.layers.0.input_layernorm.weight"))
    assert norm.tobytes() == bf16_as_f32(NORM).tobytes()
    bias = np.asarray(model.tensor("model.layers.0.mlp.gate.e_score_correction_bias"))
    assert bias.dtype == np.float32
    assert bias.tobytes() == F16.astype(np.float32).tobytes()
    # Not asked for: as in the file.
    assert model.tensor("model.embed_tokens.weight").dtype == "BF16"
    assert np.asarray(model.tensor("model.embed_tokens.weight")).tobytes() == BF16.tobytes()
    check = model.verify()
    assert check["verified"] and check["mismatched"] == 0, check
    converted = model.report_dict()["converted"]
    assert len(converted) == 3, converted
    assert any(line.startswith("model.layers.0.mlp.gate.e_score_correction_bias F16 -> F32")
               for line in converted), converted
    assert "converted at placement (3 tensors)" in model.report()
    assert "norms=convert:F32" in model.plan


@pytest.mark.parametrize(("keywords", "words"), [
    ({"convert_pattern": {"*.gate.*": "float33"}}, ["float33", "not a dtype"]),
    ({"convert_pattern": {"*.q_proj.*": "float32"}}, ["q_proj.weight", "I8 -> F32"]),
    ({"convert_pattern": {"*.nothing.*": "float32"}}, ["*.nothing.*", "matches no dense"]),
    ({"convert_class": {"experts": "float32"}}, ["experts"]),
    ({"convert_class": {"norms": "float32"}, "slice_pattern": {"*.gate.weight": "rows:0/2"}},
     ["gate.weight", "sliced"]),
])
def test_bad_conversions_are_named(ckpt, keywords, words):
    with pytest.raises(numapin.InvalidArgument) as raised:
        place(ckpt, **keywords)
    for w in words:
        assert w in str(raised.value), str(raised.value)


def test_a_dtype_that_is_not_one_is_a_type_error(ckpt):
    with pytest.raises(TypeError, match="convert_pattern"):
        place(ckpt, convert_pattern={"*": 32})
    with pytest.raises(TypeError, match="convert_pattern"):
        place(ckpt, convert_pattern={"*": np.float32})
