"""Hostile pass 7 on the Python surface: wrong types, out-of-range ints, keyword typos,
layout strings that smuggle plan items, odd `layer(..., through=...)`, non-callable and
interrupting progress callbacks in a multi-threaded load, `place()` twice, views after
`del`. Each must raise a typed NumapinError subclass (or TypeError / ValueError /
OverflowError where Python convention says so) and leave the checkpoint usable. The
expected bytes are numpy's (safetensors.numpy writes the checkpoints here)."""

import gc
import threading

import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

import numapin


def _tensors():
    rng = np.random.default_rng(7)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.norm.weight": rng.standard_normal((8,)).astype(np.float32),
    }
    for layer in range(3):
        t[f"model.layers.{layer}.self_attn.q_proj.weight"] = (
            rng.standard_normal((8, 8)).astype(np.float16))
        t[f"model.layers.{layer}.input_layernorm.weight"] = (
            rng.standard_normal((8,)).astype(np.float32))
        for e in range(4):
            for role in ("gate_proj", "up_proj", "down_proj"):
                t[f"model.layers.{layer}.mlp.experts.{e}.{role}.weight"] = (
                    rng.standard_normal((64, 32)).astype(np.float32))
    return t


@pytest.fixture
def model_path(tmp_path):
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    return path, tensors


def test_a_layout_keyword_cannot_smuggle_other_plan_items(model_path):
    """Bug (fixed): the keywords were pasted into the plan's text form, so a class
    keyword's value could carry `;`-, `,`- or `=`-separated items of its own: attention=
    "bind:0;experts=unplaced" changed the experts' layout, dense="replicate:all,*=bind:0"
    added a pattern. A layout value is one layout: those are InvalidArgument now."""
    path, _ = model_path
    ckpt = numapin.Checkpoint(path)
    for kwargs in (
        {"attention": "bind:0;experts=unplaced"},
        {"attention": "bind:0,experts=unplaced"},
        {"dense": "replicate:all,*=bind:0"},
        {"experts": "split:all;dense=unplaced"},
        {"norms": "unplaced;*.q_proj.*=bind:0"},
    ):
        with pytest.raises(numapin.InvalidArgument, match="one layout"):
            ckpt.place(progress=False, **kwargs)
    # Node lists with commas are still one layout.
    model = ckpt.place(experts="split:0", dense="replicate:0", norms="interleave:0",
                       progress=False)
    assert model.verify()["verified"]


def test_wrong_types_and_out_of_range_ints_are_typed(model_path):
    path, tensors = model_path
    with pytest.raises(TypeError):
        numapin.Checkpoint(None)
    with pytest.raises(TypeError):
        numapin.Checkpoint(5)
    with pytest.raises((numapin.CheckpointError, numapin.NumapinError)):
        numapin.Checkpoint(str(path) + "\x00")  # noqa: not a file name the kernel takes
    ckpt = numapin.Checkpoint(path)
    with pytest.raises(TypeError):
        ckpt.place(experts=5, progress=False)
    with pytest.raises(TypeError):
        ckpt.place(dense=None, progress=False)
    with pytest.raises(TypeError):
        ckpt.place(attention=3, progress=False)
    for threads in (-1, 2**64):
        with pytest.raises(OverflowError):
            ckpt.place(loader_threads=threads, progress=False)
    with pytest.raises(TypeError):
        ckpt.place(loader_threads="2", progress=False)
    with pytest.raises(numapin.InvalidArgument, match="not a tensor class"):
        ckpt.place(huge_page=False, progress=False)  # a keyword typo
    with pytest.raises(numapin.InvalidArgument):
        ckpt.place(read_mode="Direct", progress=False)
    # Bug (fixed): a node string's error echoed all of it ("split:all" * 1000: 18 KB).
    for layout in ("split:٣", "split:0-", "split:-1", "split:99999", "split:" + "9" * 100,
                   "split:all" * 1000, "split:" + "0," * 100_000 + "x"):
        with pytest.raises(numapin.InvalidArgument) as e:
            ckpt.place(experts=layout, progress=False)
        assert len(str(e.value)) < 4000, len(str(e.value))
    # Held: spaces around the nodes, and a node named many times (a set, as numactl).
    for layout in ("split: all", "interleave:" + "0," * 100_000 + "0"):
        assert ckpt.place(experts=layout, progress=False).verify()["verified"]
    with pytest.raises(numapin.InvalidArgument) as e:
        ckpt.place(plan="x" * (1 << 20) + "=bind:0", progress=False)
    assert len(str(e.value)) < 4000, len(str(e.value))
    model = ckpt.place(progress=False)
    with pytest.raises(TypeError):
        model.tensor(None)
    with pytest.raises(TypeError):
        model.tensor(b"model.norm.weight")
    with pytest.raises(numapin.InvalidArgument):
        model.tensor("MODEL.NORM.WEIGHT")
    with pytest.raises(numapin.InvalidArgument):
        model.tensor("model.norm.weight\x00")
    for layer, expert in ((-1, 0), (0, -1), (2**64, 0), (0, 2**64)):
        with pytest.raises(OverflowError):
            model.expert(layer, expert)
    with pytest.raises(TypeError):
        model.expert(0.5, 0)
    with pytest.raises(numapin.NumapinError):
        model.expert(0, 4)
    with pytest.raises(numapin.NumapinError):
        model.expert(2**63, 0)
    assert np.asarray(model.tensor("model.norm.weight")).tobytes() == (
        tensors["model.norm.weight"].tobytes())


def test_layer_through_odd_arguments(model_path):
    path, tensors = model_path
    model = numapin.Checkpoint(path).place(progress=False)
    same = np.asarray(model.layer(1, "up_proj", through="up_proj"))
    for e in range(4):
        assert same[e].tobytes() == tensors[f"model.layers.1.mlp.experts.{e}.up_proj.weight"].tobytes()
    for role, through in (("up_proj", ""), ("up_proj", " up_proj"), ("UP_PROJ", None),
                          ("up_proj", "gate_proj"), ("", None), ("gate_proj", "x" * 100_000)):
        with pytest.raises(numapin.InvalidArgument) as e:
            model.layer(1, role, through=through)
        assert len(str(e.value)) < 4000
    with pytest.raises(TypeError):
        model.layer(1, "up_proj", through=5)
    with pytest.raises(TypeError):
        model.layer(1, "up_proj", "down_proj")  # through is keyword-only
    with pytest.raises(TypeError):
        model.layer(1, role="up_proj", thru="down_proj")


def test_place_twice_and_views_after_del(model_path):
    path, tensors = model_path
    ckpt = numapin.Checkpoint(path)
    first = ckpt.place(progress=False)
    keep = first.tensor("model.layers.2.self_attn.q_proj.weight")
    expert = first.expert(2, 3)
    layer = first.layer(0, "gate_proj", through="down_proj")
    second = ckpt.place(experts="interleave:all", dense="interleave:all", progress=False)
    del first
    gc.collect()
    assert np.asarray(keep).tobytes() == tensors["model.layers.2.self_attn.q_proj.weight"].tobytes()
    assert np.asarray(expert["down_proj"]).tobytes() == (
        tensors["model.layers.2.mlp.experts.3.down_proj.weight"].tobytes())
    whole = np.asarray(layer)
    for e in range(4):
        want = b"".join(tensors[f"model.layers.0.mlp.experts.{e}.{r}.weight"].tobytes()
                        for r in ("gate_proj", "up_proj", "down_proj"))
        assert whole[e].tobytes() == want
    assert second.verify()["verified"]
    # A DLPack capsule outliving everything.
    arr = np.from_dlpack(second.tensor("model.embed_tokens.weight"))
    del second, ckpt
    gc.collect()
    assert arr.tobytes() == tensors["model.embed_tokens.weight"].tobytes()
    assert not arr.flags.writeable


@pytest.mark.parametrize("progress", [True, 5, "bar", object()])
def test_a_progress_that_is_not_callable_is_a_type_error_before_loading(model_path, progress):
    """Bug (fixed): progress=True (or any non-callable) was taken as the callback and
    called from a loader thread: the load broke off with "'bool' object is not callable"
    halfway through. Now a TypeError before anything is loaded; False and None keep
    their meaning."""
    path, _ = model_path
    ckpt = numapin.Checkpoint(path)
    with pytest.raises(TypeError, match="progress"):
        ckpt.place(progress=progress)
    with pytest.raises(TypeError, match="progress"):
        ckpt.pack(progress=progress)
    assert ckpt.place(progress=False).verify()["verified"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit, ValueError])
def test_a_base_exception_from_the_callback_of_a_threaded_load(model_path, exc):
    """A BaseException (KeyboardInterrupt, SystemExit) raised by the callback on the
    third report, with four loader threads: that exception comes out of place()/pack(),
    the other threads stop, and the checkpoint places again."""
    path, tensors = model_path
    ckpt = numapin.Checkpoint(path)
    calls = []
    lock = threading.Lock()

    def cb(p):
        with lock:
            calls.append(p)
            if len(calls) == 3:
                raise exc("stop")

    with pytest.raises(exc):
        ckpt.place(loader_threads=4, progress=cb)
    calls.clear()
    with pytest.raises(exc):
        ckpt.pack("interleave:all", loader_threads=4, progress=cb)
    model = ckpt.place(loader_threads=4, progress=False)
    assert model.verify()["verified"]
    assert np.asarray(model.tensor("model.norm.weight")).tobytes() == (
        tensors["model.norm.weight"].tobytes())


def test_a_callback_that_places_again_and_reads(model_path):
    """The callback re-enters the package (places the same checkpoint, reads a view of
    another model) from a loader thread: no deadlock, both models right."""
    path, tensors = model_path
    ckpt = numapin.Checkpoint(path)
    other = ckpt.place(progress=False)
    inner = []

    def cb(p):
        if not inner:
            inner.append(ckpt.place(progress=False))
        assert np.asarray(other.tensor("model.norm.weight")).tobytes() == (
            tensors["model.norm.weight"].tobytes())

    outer = ckpt.place(loader_threads=2, progress=cb)
    assert outer.verify()["verified"] and inner[0].verify()["verified"]
