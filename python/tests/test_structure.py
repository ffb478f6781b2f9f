"""A WholeModel's structure (issue 33, item 6): its MoE layers, each layer's roles under
one vocabulary (gate, up, gate_up, down, with .scale/.bias) beside the file's names, the
experts held, `locate(name)`, and `tensor(name)` of a tensor holding every expert of a
layer as one view with the file's shape, compared with numpy's bytes of the file."""

import numpy as np
import pytest

import numapin
from test_whole import numpy_tensors

# (fixture, a tensor holding every expert of layer 1, its canonical role)
WHOLE = [
    ("st-fused", "model.layers.1.mlp.experts.gate_up_proj", "gate_up"),
    ("fam-gpt-oss", "model.layers.1.mlp.experts.gate_up_proj", "gate_up"),
    ("fam-gpt-oss", "model.layers.1.mlp.experts.gate_up_proj_bias", "gate_up.bias"),
    ("fam-gpt-oss", "model.layers.1.mlp.experts.down_proj", "down"),
    ("fam-granite-moe", "model.layers.1.block_sparse_moe.input_linear.weight", "gate_up"),
    ("fam-granite-moe-v5", "model.layers.1.block_sparse_moe.experts.down_proj", "down"),
    ("fam-llama4", "language_model.model.layers.1.feed_forward.experts.gate_up_proj",
     "gate_up"),
    ("fam-qwen3-vl-moe", "model.language_model.layers.1.mlp.experts.down_proj", "down"),
    ("fam-jetmoe", "model.layers.1.mlp.input_linear.weight", "gate_up"),
    # DBRX's flattened [E·I, H] per role: role-major slots make each one run.
    ("fam-dbrx", "transformer.blocks.1.ffn.experts.mlp.w1", "gate"),
    ("fam-dbrx", "transformer.blocks.1.ffn.experts.mlp.v1", "up"),
    ("fam-dbrx", "transformer.blocks.1.ffn.experts.mlp.w2", "down"),
]


def place(fx, **keywords):
    return numapin.Checkpoint(fx.path).place("split:all", "replicate:all",
                                             progress=False, **keywords)


@pytest.mark.parametrize("name,tensor,role", WHOLE)
def test_a_tensor_of_every_expert_is_one_view_with_the_files_bytes(fixture, name,
                                                                   tensor, role):
    fx = fixture(name)
    shape, data = numpy_tensors(fx.root)[tensor]
    model = place(fx)
    assert model.locate(tensor) == (1, None, role)
    view = np.asarray(model.tensor(tensor))
    assert list(view.shape) == shape
    assert view.tobytes() == data, tensor
    # A view, not a copy: inside the placed experts' slots.
    first = np.asarray(model.expert(1, 0)[model.role_names(1)[role]])
    assert view.__array_interface__["data"][0] == first.__array_interface__["data"][0]
    # The canonical name and the file's give the same layer view.
    a = np.asarray(model.layer(1, role))
    b = np.asarray(model.layer(1, model.role_names(1)[role]))
    assert a.__array_interface__ == b.__array_interface__


def test_dbrx_flattened_tensor_is_refused_under_a_share(fixture):
    """Under an expert share DBRX's slots stay a slot per expert (w1, v1, w2 of one
    expert back to back): `w1` [E·I, H] is no single view there."""
    fx = fixture("fam-dbrx")
    model = place(fx, experts_held="0/2")
    name = "transformer.blocks.1.ffn.experts.mlp.w1"
    assert model.locate(name) == (1, None, "gate")
    with pytest.raises(numapin.InvalidArgument):
        model.tensor(name)


def test_a_share_keeps_the_tensor_of_every_expert_unviewable(fixture):
    fx = fixture("fam-gpt-oss")
    model = place(fx, experts_held="0/2")
    assert model.expert_ids(1) == [0, 1]
    with pytest.raises(numapin.InvalidArgument):
        model.tensor("model.layers.1.mlp.experts.gate_up_proj")


@pytest.mark.parametrize("name,layer,names", [
    ("st-mixtral", 1, {"gate": "w1", "up": "w3", "down": "w2"}),
    ("st-sharded", 1, {"gate": "gate_proj", "up": "up_proj", "down": "down_proj",
                       "gate.scale": "gate_proj scale", "up.scale": "up_proj scale",
                       "down.scale": "down_proj scale"}),
    ("fam-gpt-oss", 1, {"gate_up": "gate_up", "down": "down",
                        "gate_up.bias": "gate_up bias", "down.bias": "down bias"}),
    ("fam-lfm2-moe", 1, {"gate": "gate", "up": "up", "down": "down"}),
    ("fam-dbrx", 1, {"gate": "gate", "up": "up", "down": "down"}),
])
def test_roles_are_canonical_with_the_files_names_beside(fixture, name, layer, names):
    fx = fixture(name)
    model = place(fx)
    assert layer in model.layers
    assert set(model.roles(layer)) == set(names)
    assert model.role_names(layer) == names
    assert model.expert_ids(layer) == list(range(len(model.expert_ids(layer))))


def test_locate_per_expert_and_other_tensors(fixture):
    fx = fixture("st-mixtral")
    model = place(fx)
    assert model.locate("model.layers.1.block_sparse_moe.experts.2.w3.weight") == (1, 2, "up")
    assert model.locate("model.layers.1.mlp.gate.weight") is None
    with pytest.raises(numapin.InvalidArgument, match="no tensor"):
        model.locate("model.layers.99.nothing")
