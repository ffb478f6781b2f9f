"""`Checkpoint.place` builds its plan with typed calls: `slice_class=` and
`slice_pattern=` (`PlacementPlan::slice_class` / `slice_pattern`) cut the tensors numpy's
own slicing of the fixture's tensors cuts, and a keyword whose value holds the text
form's separators is a bad layout for that keyword, not an item of the plan."""

import numpy as np
import pytest

import numapin
from test_whole import numpy_tensors

FIXTURE = "st-sharded"


def dense_arrays(fx, model):
    """numpy's dense tensors, typed as the placed views are: {name: (class, ndarray)}."""
    classes = {t: c for t, c, _ in model.classes()}
    out = {}
    for name, (shape, data) in numpy_tensors(fx.root).items():
        if classes[name] == "experts":
            continue
        dtype = np.asarray(model.tensor(name)).dtype
        out[name] = (classes[name], np.frombuffer(data, dtype=dtype).reshape(shape))
    return out


def place(ckpt, **keywords):
    model = ckpt.place("interleave:all", "interleave:all", progress=False, **keywords)
    assert model.verify()["verified"]
    return model


def assert_holds(model, name, expect):
    got = np.asarray(model.tensor(name))
    assert got.shape == expect.shape, (name, got.shape, expect.shape)
    assert got.tobytes() == np.ascontiguousarray(expect).tobytes(), name


def test_slice_class_is_numpys_slicing_of_the_class(fixture):
    fx = fixture(FIXTURE)
    ckpt = numapin.Checkpoint(fx.path)
    want = dense_arrays(fx, place(ckpt))
    model = place(ckpt, slice_class={"attention": "rows:1/2",
                                     "embeddings": slice(16, 48)})
    cut = set()
    for name, (cls, full) in want.items():
        if cls == "attention" and full.ndim >= 2:
            expect = full[full.shape[0] // 2:]
        elif cls == "embeddings" and full.ndim >= 2:
            expect = full[16:48]
        else:
            expect = full
        if expect is not full:
            cut.add(cls)
        assert_holds(model, name, expect)
    assert cut == {"attention", "embeddings"}


def test_slice_pattern_wins_over_the_class_and_the_last_pattern_wins(fixture):
    fx = fixture(FIXTURE)
    ckpt = numapin.Checkpoint(fx.path)
    want = dense_arrays(fx, place(ckpt))
    model = place(
        ckpt,
        slice_class={"attention": "rows:0/2"},
        slice_pattern={"*.o_proj.*": "columns:0/2",
                       "*.layers.1.self_attn.o_proj.*": "columns:1/2"},
    )
    seen = {"rows": 0, "columns 0": 0, "columns 1": 0}
    for name, (cls, full) in want.items():
        if ".layers.1.self_attn.o_proj." in name:
            expect, what = full[:, full.shape[1] // 2:], "columns 1"
        elif ".o_proj." in name:
            expect, what = full[:, :full.shape[1] // 2], "columns 0"
        elif cls == "attention" and full.ndim >= 2:
            expect, what = full[:full.shape[0] // 2], "rows"
        else:
            expect, what = full, None
        if what:
            seen[what] += 1
        assert_holds(model, name, expect)
    assert all(seen.values()), seen


def test_bad_slice_keywords_are_typed_errors(fixture):
    ckpt = numapin.Checkpoint(fixture(FIXTURE).path)
    bad = [
        ({"slice_class": {"attn": "rows:0/2"}}, "not a tensor class"),
        ({"slice_class": {"attention": "rows:0/2;experts=unplaced"}}, "slice_class"),
        ({"slice_class": {"attention": "diagonal:0/2"}}, "slice_class"),
        ({"slice_class": {"attention": slice(0, 8, 2)}}, "no step"),
        ({"slice_class": {"attention": slice(-8, None)}}, "integers"),
        ({"slice_class": {"attention": slice(4, None)}}, "needs a stop"),
        ({"slice_class": {"attention": slice(8, 8)}}, "no row"),
        ({"slice_pattern": {"*.nothing_like_this.*": "rows:0/2"}}, "nothing_like_this"),
    ]
    for keywords, says in bad:
        with pytest.raises(numapin.InvalidArgument, match=says):
            ckpt.place(progress=False, **keywords)
    with pytest.raises(TypeError, match="slice_class"):
        ckpt.place(slice_class={"attention": 5}, progress=False)


def test_a_keyword_with_separators_is_a_bad_layout_for_that_keyword(fixture):
    """Each keyword is parsed as one layout and set by a typed call: a value carrying
    `;`/`=` items is refused as that keyword's layout, naming the keyword."""
    ckpt = numapin.Checkpoint(fixture(FIXTURE).path)
    for key, value in [("attention", "bind:0;experts=unplaced"),
                       ("dense", "replicate:all;*.q_proj.*=bind:0"),
                       ("experts", "split:all;dense=unplaced"),
                       ("norms", "interleave:all=x")]:
        with pytest.raises(numapin.InvalidArgument,
                           match=f"{key}=.* is not one layout for {key}"):
            ckpt.place(progress=False, **{key: value})
    # `plan` is the one keyword that is the text form: its items still apply.
    model = place(ckpt, plan="norms=unplaced;*.q_proj.*=bind:0")
    assert "norms=unplaced" in model.plan and "*.q_proj.*=bind:0" in model.plan


def online_nodes():
    """The node list the kernel reports online, in the plan's spelling (`0` or `0-3`)."""
    with open("/sys/devices/system/node/online") as f:
        return f.read().strip()


def test_plan_default_is_the_checkpoints_default_plan(fixture):
    """`plan="default"` is `Checkpoint::default_plan` over every node (before: the item
    was read as a node string or a KEY=VALUE item and refused); items after it apply
    over it; `defaultx` is still not an item."""
    fx = fixture(FIXTURE)
    ckpt = numapin.Checkpoint(fx.path)
    nodes = online_nodes()
    model = ckpt.place(plan="default", progress=False)
    assert model.verify()["verified"]
    items = dict(item.split("=", 1) for item in model.plan.split(";"))
    assert items["experts"] == f"split:{nodes}", model.plan
    assert items["embeddings"] == f"interleave:{nodes}", model.plan
    # Every other class: replicated where every node has room, else interleaved.
    for cls in ("attention", "norms", "head", "dense_mlp", "shared", "global"):
        assert items[cls] in (f"replicate:{nodes}", f"interleave:{nodes}"), model.plan
    why = model.report_dict()
    assert "default:" in str(why), why
    # The experts/dense keywords are overridden by the plan, as any plan item does.
    model = ckpt.place("unplaced", "unplaced", plan="default;norms=unplaced",
                       progress=False)
    items = dict(item.split("=", 1) for item in model.plan.split(";"))
    assert items["norms"] == "unplaced" and items["experts"] == f"split:{nodes}"
    for bad in ("defaultx", "default=1", "default;defaultx"):
        with pytest.raises(numapin.InvalidArgument):
            ckpt.place(plan=bad, progress=False)
