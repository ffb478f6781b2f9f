"""PinStore, ExpertCache, errors, release under live views, progress callbacks, and
threads reading while others place."""

import gc
import threading

import numpy as np
import pytest

import numapin
from conftest import expect

EXPERTS = 6
WEIGHTS = 3 * 4096 + 100
SCALES = 333


def sources(layer: int):
    rng = np.random.default_rng(layer)
    weights = [rng.integers(0, 256, WEIGHTS, dtype=np.uint8) for _ in range(EXPERTS)]
    scales = [rng.integers(0, 256, SCALES, dtype=np.uint8) for _ in range(EXPERTS)]
    return weights, scales


class Boom(Exception):
    pass


def test_probe_reports_the_verdict():
    support = numapin.probe()
    assert support["mempolicy"] in ("available", "denied", "unsupported")
    assert support["possible_nodes"] >= 1
    assert isinstance(support["summary"], str) and "mempolicy" in support["summary"]
    want = {"denied": "denied", "unsupported": "unsupported", "full": "available",
            "sys-nice": "available"}.get(expect())
    if want:
        assert support["mempolicy"] == want


def test_degradation_is_a_value():
    store = numapin.PinStore("interleave:all")
    w, s = sources(0)
    store.pack_layer(0, w, s)
    mode = numapin.probe()["mempolicy"]
    want = {"available": None, "denied": "denied", "unsupported": "unsupported"}[mode]
    assert store.degraded == want
    stats = store.stats()
    assert (stats["layers"], stats["experts_loaded"]) == (1, EXPERTS)
    if want is None:
        assert stats["mbind_calls"] == 2  # one per region: weights, scales


def test_pinstore_views_are_the_sources_bytes_at_one_stride():
    store = numapin.PinStore("split:all", loader_threads=2)
    assert store.layout.startswith("split:")
    w, s = sources(3)
    report = store.pack_layer(3, w, s)
    assert report["experts"] == EXPERTS
    for e in range(EXPERTS):
        assert np.array_equal(np.asarray(store.weights(3, e)), w[e])
        assert np.array_equal(np.frombuffer(store.scales(3, e), dtype=np.uint8), s[e])
    whole = np.asarray(store.layer(3))
    assert whole.shape == (EXPERTS, WEIGHTS)
    assert whole.strides[0] % 4096 == 0 and whole.strides[0] >= WEIGHTS
    assert whole.__array_interface__["data"][0] == store.weights(3, 0).address
    assert np.array_equal(whole, np.stack(w))


def test_errors_are_typed():
    with pytest.raises(numapin.InvalidArgument, match="unknown layout"):
        numapin.PinStore("spread:0")
    with pytest.raises(numapin.InvalidArgument):
        numapin.PinStore("interleave:4096")
    assert issubclass(numapin.CheckpointError, numapin.NumapinError)
    assert issubclass(numapin.CacheFull, numapin.NumapinError)
    store = numapin.PinStore("unplaced")
    with pytest.raises(numapin.NotPacked, match="layer 9 is not packed"):
        store.weights(9, 0)
    w, s = sources(0)
    store.pack_layer(0, w, s)
    with pytest.raises(numapin.InvalidArgument, match="out of range"):
        store.weights(0, EXPERTS)
    with pytest.raises(numapin.NumapinError, match="already packed"):
        store.pack_layer(0, w, s)
    with pytest.raises(numapin.NumapinError):
        numapin.Checkpoint("/nonexistent/model.safetensors")


def test_a_truncated_checkpoint_is_a_checkpoint_error(tmp_path, fixture):
    src = fixture("st-single").path.read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(src[: len(src) // 2])
    with pytest.raises(numapin.CheckpointError, match="cut.safetensors"):
        numapin.Checkpoint(bad).pack("unplaced", progress=False)
    bad.write_bytes(src[:5])
    with pytest.raises(numapin.CheckpointError):
        numapin.Checkpoint(bad)


def test_placed_model_errors_are_typed(fixture):
    fx = fixture("st-single")
    placed = numapin.Checkpoint(fx.path).pack("unplaced", progress=False)
    with pytest.raises(numapin.NotPacked, match="not a MoE layer"):
        placed.expert(0, 0)
    with pytest.raises(numapin.InvalidArgument, match="out of range"):
        placed.expert(1, 99)
    with pytest.raises(numapin.InvalidArgument, match="no role"):
        placed.layer(1, "nope")
    assert "per-expert" in placed.report()
    assert placed.report_dict()["layers"] == len(fx.layers)


def test_release_under_a_live_view_is_refused(fixture):
    fx = fixture("st-single")
    layer = min(fx.layers)
    placed = numapin.Checkpoint(fx.path).pack("interleave:all", progress=False)
    views = placed.expert(layer, 0)
    array = np.from_dlpack(views["gate_proj"])
    with pytest.raises(numapin.ViewsAlive, match="live view"):
        placed.release(layer, 0)
    del views
    gc.collect()
    # The array made by DLPack still holds the layer.
    with pytest.raises(numapin.ViewsAlive):
        placed.release(layer, 1)
    assert array.tobytes() == fx.expected(layer, 0, "weights")[: array.nbytes]
    del array
    gc.collect()
    placed.release(layer, 0)
    with pytest.raises(numapin.NotPacked, match="released"):
        placed.expert(layer, 0)
    # Other layers were never pinned by those views.
    other = max(fx.layers)
    placed.release(other, 0)


def test_pinstore_release_and_ensure():
    store = numapin.PinStore("unplaced")
    w, s = sources(1)
    store.pack_layer(1, w, s)
    view = store.weights(1, 2)
    with pytest.raises(numapin.ViewsAlive):
        store.release(1, 2)
    del view
    store.release(1, 2)
    with pytest.raises(numapin.NotPacked):
        store.weights(1, 2)
    store.ensure(1, 2, w[2], s[2])
    assert np.array_equal(np.asarray(store.weights(1, 2)), w[2])


def test_a_raising_callback_aborts_the_load_and_the_store_stays_usable():
    store = numapin.PinStore("interleave:all")
    w, s = sources(5)
    seen = []

    def boom(progress):
        seen.append(progress)
        raise Boom(f"stop at {progress.bytes_done}")

    with pytest.raises(Boom, match="stop at"):
        store.pack_layer(5, w, s, progress=boom)
    assert seen and seen[0].layer == 5 and seen[0].bytes_total == EXPERTS * (WEIGHTS + SCALES)
    with pytest.raises(numapin.NotPacked):
        store.weights(5, 0)
    assert store.stats()["layers"] == 0
    # Usable: the same layer packs, with a callback that returns.
    reports = []
    store.pack_layer(5, w, s, progress=reports.append)
    assert reports[-1].bytes_done == reports[-1].bytes_total
    assert np.array_equal(np.asarray(store.weights(5, 4)), w[4])


def test_a_raising_callback_aborts_a_checkpoint_pack(fixture):
    fx = fixture("st-single")
    ckpt = numapin.Checkpoint(fx.path)

    def boom(progress):
        raise Boom(progress.layer)

    with pytest.raises(Boom):
        ckpt.pack("interleave:all", progress=boom)
    seen = []
    placed = ckpt.pack("interleave:all", progress=seen.append)
    assert sorted({p.layer for p in seen}) == sorted(fx.layers)
    assert placed.verify()["mismatched_slots"] == 0


def test_expert_cache_pins_its_slots():
    cache = numapin.ExpertCache(2, WEIGHTS, SCALES, nodes="all")
    w, s = sources(7)
    nodes = numapin.probe()["possible_nodes"]
    held = [cache.get_or_load(7, e, w[e], s[e], hint=0) for e in range(2)]
    assert np.array_equal(np.asarray(held[1].weights), w[1])
    assert held[0].key == (7, 0) and held[0].node == 0
    if nodes == 1:
        with pytest.raises(numapin.CacheFull, match="held by a live Entry"):
            cache.get_or_load(7, 2, w[2], s[2], hint=0)
    # A view pins the slot as its entry does.
    view = held[0].weights
    del held
    gc.collect()
    assert np.array_equal(np.asarray(view), w[0])
    entry = cache.get_or_load(7, 3, w[3], s[3], hint=0)  # evicts expert 1, not 0
    assert cache.get(7, 1) is None and cache.get(7, 0) is not None
    assert np.array_equal(np.asarray(entry.scales), s[3])
    stats = cache.stats()
    assert stats["evictions"] == 1 and stats["loads"] == 3


def test_threads_read_while_others_place(fixture):
    fx = fixture("st-fused")
    ckpt = numapin.Checkpoint(fx.path)
    placed = ckpt.pack("interleave:all", progress=False)
    store = numapin.PinStore("interleave:all")
    errors = []
    stop = threading.Event()

    def reader():
        try:
            while not stop.is_set():
                for layer, experts in fx.layers.items():
                    for e in range(experts):
                        got = np.asarray(placed.slot(layer, e)).tobytes()
                        assert got == fx.expected(layer, e, "weights")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def placer(first: int):
        try:
            for layer in range(first, first + 4):
                w, s = sources(layer)
                store.pack_layer(layer, w, s)
                assert np.array_equal(np.asarray(store.weights(layer, 1)), w[1])
            again = ckpt.pack("split:all", progress=False)
            assert again.verify()["mismatched_slots"] == 0
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    placers = [threading.Thread(target=placer, args=(10 * i,)) for i in range(3)]
    for t in readers + placers:
        t.start()
    for t in placers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors
    assert store.stats()["layers"] == 12


def test_no_deadlock_between_a_load_its_callback_a_release_and_readers():
    """A load whose callback needs the GIL, a release queued for the write lock, and
    readers holding the GIL: none waits for the GIL while holding a lock another needs."""
    store = numapin.PinStore("unplaced", loader_threads=2)
    w, s = sources(0)
    store.pack_layer(0, w, s)
    store.pack_layer(2, w, s)
    big = [np.full(12 << 20, e, dtype=np.uint8) for e in range(4)]  # 48 MiB: mid-load reports
    calls = []
    errors = []

    def load():
        try:
            store.pack_layer(1, big, progress=lambda p: calls.append(p.bytes_done))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def release():
        try:
            store.release(0, 1)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=load, daemon=True), threading.Thread(target=release, daemon=True)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        assert store.layout == "unplaced"
        assert np.asarray(store.weights(2, 0))[0] == w[0][0]
        for t in threads:
            t.join(timeout=0.001)
        if len(calls) > 1000:
            break
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    assert not errors, errors
    assert len(calls) >= 2 and calls[-1] == 4 * (12 << 20)
    assert np.array_equal(np.asarray(store.weights(1, 3))[:16], np.full(16, 3, np.uint8))
