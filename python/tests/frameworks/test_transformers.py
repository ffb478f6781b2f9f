"""numapin.transformers.from_pretrained against transformers' own from_pretrained, on
checkpoints transformers itself wrote (save_pretrained of tiny random models).

The reference is transformers' load from the files: the logits of the same ids must be
bit-equal (torch.equal), every parameter equal to transformers' own, greedy generate()
the same tokens. Where each parameter lives is checked against the WholeModel's views
(address, span_bytes), independently of numapin.transformers' own accounting, and the
copies it reports must be exactly the ones expected for the family."""

import signal
import subprocess
import sys
from functools import cache

import pytest
import torch
import transformers

import numapin
import numapin.transformers as nt

from .conftest import families, fixtures_dir

REQUIRED = {"qwen3_moe", "qwen3_moe_tied", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3",
            "glm4_moe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "phimoe", "granitemoe",
            "dbrx"}

# What transformers holds in another dtype than the file (float32 routers and router
# biases, `_keep_in_fp32_modules`): converted at placement (BF16 -> F32), so placed
# views, not copies.
def _router(layers, *names):
    return {f"model.layers.{l}.mlp.gate.{n}" for l in layers for n in names}


EXPECTED_CONVERTED = {
    "deepseek_v3": _router([1], "weight", "e_score_correction_bias"),
    "glm4_moe": _router([1], "weight", "e_score_correction_bias"),
    "dots1": _router([1], "weight", "e_score_correction_bias"),
    "ernie4_5_moe": _router([0, 1], "weight", "moe_statics.e_score_correction_bias"),
    "hunyuan_v1_moe": _router([0, 1], "wg.weight"),
}
# No parameter of any family here is a copy.
EXPECTED_COPIES: dict[str, set[str]] = {}


@cache
def loaded(family: str):
    path = fixtures_dir() / family
    model, whole = nt.from_pretrained(path)
    return model, whole


@cache
def reference(family: str):
    path = fixtures_dir() / family
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(7))


def placed_ranges(whole: numapin.WholeModel, layers) -> list[tuple[int, int]]:
    """Every placed tensor's byte range, from the views themselves, and each expert
    layer's block (first byte of its first expert to the last of its last: one region,
    slot padding included, which a strided [E, ...] view spans)."""
    ranges = []
    for name in whole.tensors():
        try:
            view = whole.tensor(name)
        except numapin.InvalidArgument:
            continue  # holds every expert of a layer: the layer's block below covers it
        ranges.append((view.address, view.address + view.span_bytes))
    for layer, count in layers.items():
        views = [v for e in range(count) for v in whole.expert(layer, e).values()]
        ranges.append((min(v.address for v in views),
                       max(v.address + v.span_bytes for v in views)))
    return ranges


def test_the_fixtures_are_there():
    assert fixtures_dir() is not None, "NUMAPIN_FRAMEWORK_FIXTURES is not set"
    missing = REQUIRED - set(families())
    assert not missing, f"fixtures missing: {sorted(missing)} in {fixtures_dir()}"


@pytest.mark.parametrize("family", families())
def test_logits_are_bit_equal_to_transformers_load(family):
    model, _ = loaded(family)
    ref = reference(family)
    tokens = ids(model.config.vocab_size)
    with torch.no_grad():
        got = model(tokens).logits
        want = ref(tokens).logits
    assert got.dtype == want.dtype
    assert torch.equal(got, want), (family, (got - want).abs().max())


@pytest.mark.parametrize("family", families())
def test_every_parameter_is_transformers_own(family):
    model, _ = loaded(family)
    ref = dict(reference(family).state_dict())
    mine = dict(model.state_dict())
    assert mine.keys() == ref.keys()
    for name, tensor in mine.items():
        assert tensor.dtype == ref[name].dtype, name
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.parametrize("family", families())
def test_every_parameter_is_placed_memory_or_a_reported_copy(family):
    model, whole = loaded(family)
    ranges = placed_ranges(whole, numapin.Checkpoint(fixtures_dir() / family).experts)
    outside = set()
    for name, tensor in model.state_dict().items():
        start = tensor.data_ptr()
        end = start + nt._span(tensor)
        if not any(a <= start and end <= b for a, b in ranges):
            outside.add(name)
    report = model.numapin_load
    assert outside == set(report["copied"]), (outside, report["copied"])
    assert outside == EXPECTED_COPIES.get(family, set()), report["copied"]
    # The float32 routers are views of the placed, converted copy: float32 in the store.
    converted = EXPECTED_CONVERTED.get(family, set())
    state = model.state_dict()
    for name in converted:
        assert state[name].dtype == torch.float32, name
        assert name in report["views"], name
    # Which checkpoint tensors were converted: their file names (ERNIE's bias is renamed).
    assert len(report["converted"]) == len(converted), report["converted"]
    lines = whole.report_dict()["converted"]
    assert sorted(line.split(" ")[0] for line in lines) == report["converted"], lines
    assert all(" BF16 -> F32 " in line for line in lines), lines
    # The fused experts are views, never copies, for every family here.
    experts = [n for n in model.state_dict()
               if ".experts." in n or n.endswith(("input_linear.weight", "output_linear.weight"))]
    assert experts and not set(experts) & outside
    assert set(experts) <= set(report["views"])
    if family != "granitemoe":  # its file is fused already: a plain rename, no fusion
        assert set(report["fused"]) >= {n for n in experts
                                        if n.endswith(("gate_up_proj", "down_proj"))}


def test_dbrx_role_tensors_are_each_one_view_of_the_placed_run():
    """DBRX keeps each role of a layer's experts as one parameter, flattened [E·I, H]
    (ffn.experts.mlp.w1, v1, w2), as its file does: numapin places its experts in
    role-major slots, so each parameter is one contiguous view of its role's run (the
    address of numapin's own tensor(name), expert e's piece at e × I·H elements in),
    never a copy. Its values are transformers' own (test_every_parameter_is_...)."""
    if "dbrx" not in families():
        pytest.skip("no dbrx fixture")
    model, whole = loaded("dbrx")
    state = model.state_dict()
    names = [n for n in state if ".ffn.experts.mlp." in n]
    assert len(names) == 6, names
    for name in names:
        param = state[name]
        assert param.is_contiguous(), name
        assert param.data_ptr() == whole.tensor(name).address, name
        assert name in model.numapin_load["views"], name
        layer, expert, role = whole.locate(name)
        assert expert is None
        ids = whole.expert_ids(layer)
        per = param.numel() // len(ids) * param.element_size()
        for e in ids:
            piece = whole.expert(layer, e)[whole.role_names(layer)[role]]
            assert piece.address == param.data_ptr() + e * per, (name, e)
    assert not model.numapin_load["copied"]


def test_tied_weights_are_one_parameter():
    model, whole = loaded("qwen3_moe_tied")
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    assert head is embed or head.data_ptr() == embed.data_ptr()
    assert embed.data_ptr() == whole.tensor("model.embed_tokens.weight").address


@pytest.mark.parametrize("family", families())
def test_generate_gives_transformers_tokens(family):
    model, _ = loaded(family)
    ref = reference(family)
    tokens = ids(model.config.vocab_size)[:1, :6]
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(tokens, **args)
        want = ref.generate(tokens, **args)
    assert got.shape == (1, 10)
    assert torch.equal(got, want)


CHILD = """
import sys, torch, numapin.transformers as nt
model, whole = nt.from_pretrained(sys.argv[1])
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]))
print("forward ok", flush=True)
param = model.get_submodule("model.layers.0.mlp.experts").gate_up_proj
with torch.no_grad():
    param.add_(1)
print("written", flush=True)
"""


def test_assigned_parameters_are_read_only_and_the_load_never_wrote_them():
    """The whole load and a forward run on read-only memory (a write anywhere in them
    would have faulted before "forward ok"); a write to a fused expert parameter faults."""
    path = fixtures_dir() / "qwen3_moe"
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                         text=True, timeout=600)
    assert "forward ok" in out.stdout, out.stderr[-2000:]
    assert "written" not in out.stdout
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr[-2000:])


def test_a_float32_load_converts_every_dense_tensor_at_placement():
    """dtype=torch.float32 over a bf16 file: every dense tensor is converted at placement
    (a float32 view); only the routed experts, which the expert store does not convert,
    are transformers' casts. Logits bit-equal to transformers' own float32 load."""
    path = fixtures_dir() / "deepseek_v3"
    model, whole = nt.from_pretrained(path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = ids(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)
    report = model.numapin_load
    assert report["copied"] and all(".experts." in n for n in report["copied"]), report["copied"]
    dense = [n for n, _, _ in numapin.Checkpoint(path).tensors() if ".experts." not in n]
    assert sorted(report["converted"]) == sorted(dense)
    for name in dense:
        assert whole.tensor(name).dtype == "F32", name
    assert whole.verify()["verified"]
