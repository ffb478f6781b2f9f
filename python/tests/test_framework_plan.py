"""`place(framework_plan=..., rank="k/n")` (issue 33, item 1): transformers' tp_plan
vocabulary as a rank's share, against numpy's own cut of the fixture's tensors; the
routed experts held whole under experts_held; bad plans refused by name."""

import numpy as np
import pytest

import numapin
from test_whole import numpy_tensors

FIXTURE = "st-sharded"
PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.input_layernorm": "replicate",
}


@pytest.mark.parametrize("k", [0, 1])
def test_each_rank_holds_the_framework_plans_cut(fixture, k):
    fx = fixture(FIXTURE)
    ckpt = numapin.Checkpoint(fx.path)
    model = ckpt.place(framework_plan=PLAN, rank=f"{k}/2", experts_held=f"{k}/2",
                       progress=False)
    assert model.verify()["verified"]
    seen = set()
    for name, (shape, data) in numpy_tensors(fx.root).items():
        if ".experts." in name:
            expert = int(name.split(".")[5])
            if expert // 2 != k:
                with pytest.raises(numapin.NotHeld):
                    model.tensor(name)
                continue
            assert np.asarray(model.tensor(name)).tobytes() == data, name
            seen.add("expert whole")
            continue
        got = np.asarray(model.tensor(name))
        full = np.frombuffer(data, dtype=got.dtype).reshape(shape)
        if "q_proj" in name or "embed_tokens" in name:
            expect, what = full[k * shape[0] // 2:(k + 1) * shape[0] // 2], "rows"
        elif "o_proj" in name:
            expect, what = full[:, k * shape[1] // 2:(k + 1) * shape[1] // 2], "columns"
        else:
            expect, what = full, "whole"
        seen.add(what)
        assert got.shape == expect.shape, name
        assert got.tobytes() == np.ascontiguousarray(expect).tobytes(), name
    assert seen == {"rows", "columns", "whole", "expert whole"}


def test_bad_framework_plans_are_refused_by_name(fixture):
    ckpt = numapin.Checkpoint(fixture(FIXTURE).path)
    with pytest.raises(numapin.InvalidArgument,
                       match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*colwize"):
        ckpt.place(framework_plan={"layers.*.self_attn.q_proj": "colwize"}, rank="0/2",
                   progress=False)
    with pytest.raises(numapin.InvalidArgument, match="3 ranks"):
        ckpt.place(framework_plan=PLAN, rank="0/3", progress=False)
    with pytest.raises(numapin.InvalidArgument, match="routed expert"):
        ckpt.place(framework_plan={"layers.*.mlp.experts.*.up_proj": "colwise"},
                   rank="0/2", progress=False)
    with pytest.raises(numapin.InvalidArgument, match="needs rank"):
        ckpt.place(framework_plan=PLAN, progress=False)
    with pytest.raises(numapin.InvalidArgument, match="tensor_parallel"):
        ckpt.place(framework_plan=PLAN, rank="0/2", tensor_parallel="0/2", progress=False)
    with pytest.raises(numapin.InvalidArgument, match="rank="):
        ckpt.place(rank="0/2", progress=False)
    with pytest.raises(TypeError, match="style"):
        ckpt.place(framework_plan={"embed_tokens": 3}, rank="0/2", progress=False)
