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


DBRX_ROLES = ["transformer.blocks.1.ffn.experts.mlp." + r for r in ("w1", "v1", "w2")]


@pytest.mark.parametrize("held,ids", [("0/2", [0, 1]), ("1/2", [2, 3]), ("3/4", [3]),
                                      ("1-2", [1, 2])])
def test_dbrx_held_experts_are_one_view_of_the_files_rows(fixture, held, ids):
    """Under an expert share DBRX's slots are role-major over the held experts: each of
    w1, v1, w2 is one view of the held experts' rows of the file's [E·I, H] (numpy)."""
    fx = fixture("fam-dbrx")
    model = place(fx, experts_held=held)
    assert model.expert_ids(1) == ids
    for name in DBRX_ROLES:
        shape, data = numpy_tensors(fx.root)[name]
        whole = np.frombuffer(data, dtype=np.float16).reshape(shape)
        rows = shape[0] // 4
        want = whole[ids[0] * rows:(ids[-1] + 1) * rows]
        view = np.asarray(model.tensor(name))
        assert view.shape == want.shape, name
        assert view.tobytes() == want.tobytes(), name
        role = model.locate(name)[2]
        for i, e in enumerate(ids):
            piece = np.asarray(model.expert(1, e)[model.role_names(1)[role]])
            assert piece.tobytes() == whole[e * rows:(e + 1) * rows].tobytes()
            at = view.__array_interface__["data"][0] + i * piece.nbytes
            assert piece.__array_interface__["data"][0] == at, (name, e)


def test_dbrx_held_ids_with_a_gap_are_no_one_view(fixture):
    fx = fixture("fam-dbrx")
    model = place(fx, experts_held="0,2")
    with pytest.raises(numapin.InvalidArgument):
        model.tensor(DBRX_ROLES[0])


def test_dbrx_under_tensor_parallel_stays_a_slot_per_expert(fixture):
    fx = fixture("fam-dbrx")
    model = place(fx, tensor_parallel="0/2")
    with pytest.raises(numapin.InvalidArgument):
        model.tensor(DBRX_ROLES[0])
    with pytest.raises(numapin.InvalidArgument, match="role_major"):
        place(fx, tensor_parallel="0/2", role_major=True)


def test_role_major_keyword_asks_it_of_a_per_expert_naming(fixture):
    """role_major=True on Mixtral's per-expert w1/w2/w3: each role's experts back to
    back (one stride per role), every tensor numpy's bytes; the same as role_major=3."""
    fx = fixture("st-mixtral")
    numpy = numpy_tensors(fx.root)
    for value in (True, 3):
        model = place(fx, role_major=value)
        for name, (shape, data) in numpy.items():
            assert np.asarray(model.tensor(name)).tobytes() == data, name
        ids = model.expert_ids(1)
        for role in model.roles(1):
            starts = [np.asarray(model.expert(1, e)[model.role_names(1)[role]])
                      for e in ids]
            size = starts[0].nbytes
            base = starts[0].__array_interface__["data"][0]
            assert [a.__array_interface__["data"][0] for a in starts] == \
                [base + i * size for i in range(len(ids))], role
        assert model.verify()["verified"]
    # Default and "auto": Mixtral stays a slot per expert (roles interleaved).
    model = place(fx, role_major="auto")
    a, b = (np.asarray(model.expert(1, e)[model.role_names(1)["gate"]]) for e in (0, 1))
    assert b.__array_interface__["data"][0] - a.__array_interface__["data"][0] > a.nbytes


@pytest.mark.parametrize("value,error", [
    (0, numapin.InvalidArgument), (2, numapin.InvalidArgument),
    (-1, numapin.InvalidArgument), (2**64, numapin.InvalidArgument),
    (2**64 - 1, numapin.InvalidArgument), (False, numapin.InvalidArgument),
    ("yes", numapin.InvalidArgument), (3.0, TypeError), ([3], TypeError),
])
def test_role_major_bad_values_are_refused_by_name(fixture, value, error):
    fx = fixture("st-mixtral")
    with pytest.raises(error, match="role_major"):
        place(fx, role_major=value)


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
