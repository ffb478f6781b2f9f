"""The hook numapin puts on a model class while transformers loads it under torchrun
(`_views_for_missing`) serves the loads of the thread that runs them, and only while they
run: two loads of one class in two threads at once each get their own views, a thread
with no load of ours gets transformers' own method, and the class is left as it was."""

import threading

from numapin import transformers_distributed as td

HOOK = "_move_missing_keys_from_meta_to_device"


class Module:
    def __init__(self) -> None:
        self._parameters: dict = {}


class Base:
    """Stands for transformers' PreTrainedModel: records what its own method was given."""

    def __init__(self, keys: list[str]) -> None:
        self.modules = {}
        for key in keys:
            path, _, name = key.rpartition(".")
            self.modules.setdefault(path, Module())._parameters[name] = f"meta {key}"
        self.left_to_original: set = set()

    def get_submodule(self, path: str) -> Module:
        return self.modules[path]

    def _move_missing_keys_from_meta_to_device(self, missing_keys, *args, **kw):
        self.left_to_original = set(missing_keys)


class Model(Base):
    pass


def run_load(barrier_in, barrier_out, keys, sharded_keys, tag, out):
    sharded = {k: None for k in sharded_keys}
    with td._views_for_missing(Model, sharded, lambda name, meta: (tag, name, meta)) as assigned:
        barrier_in.wait()  # both threads have the hook on, neither has called it
        model = Model(keys)
        Model._move_missing_keys_from_meta_to_device(model, set(keys))
        barrier_out.wait()  # both have called it before either takes the hook off
    out[tag] = (model, assigned)


def test_two_loads_of_one_class_in_two_threads_get_their_own_views():
    keys = ["a.w", "b.w", "c.w"]
    barrier_in, barrier_out = threading.Barrier(2), threading.Barrier(2)
    out: dict = {}
    t1 = threading.Thread(target=run_load, args=(barrier_in, barrier_out, keys, ["a.w"], "one", out))
    t2 = threading.Thread(target=run_load, args=(barrier_in, barrier_out, keys, ["b.w", "c.w"], "two", out))
    t1.start()
    t2.start()
    t1.join()
    t2.join()
    model1, assigned1 = out["one"]
    model2, assigned2 = out["two"]
    assert assigned1 == {"a.w"} and assigned2 == {"b.w", "c.w"}
    assert model1.modules["a"]._parameters["w"] == ("one", "a.w", "meta a.w")
    assert model1.modules["b"]._parameters["w"] == "meta b.w"
    assert model1.left_to_original == {"b.w", "c.w"}
    assert model2.modules["b"]._parameters["w"] == ("two", "b.w", "meta b.w")
    assert model2.modules["a"]._parameters["w"] == "meta a.w"
    assert model2.left_to_original == {"a.w"}
    # Taken off by the last load: the class inherits transformers' method again.
    assert HOOK not in Model.__dict__
    assert td._HOOKED == {}


def test_a_thread_without_a_load_gets_the_original_method():
    keys = ["a.w"]
    entered, done = threading.Event(), threading.Event()
    seen: dict = {}

    def load():
        with td._views_for_missing(Model, {"a.w": None}, lambda name, meta: "view"):
            entered.set()
            done.wait()

    def other():
        entered.wait()
        model = Model(keys)
        Model._move_missing_keys_from_meta_to_device(model, set(keys))
        seen["model"] = model
        done.set()

    threads = [threading.Thread(target=load), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model = seen["model"]
    assert model.modules["a"]._parameters["w"] == "meta a.w"
    assert model.left_to_original == {"a.w"}


def test_a_method_the_class_defines_itself_is_restored():
    class Own(Base):
        def _move_missing_keys_from_meta_to_device(self, missing_keys, *args, **kw):
            self.left_to_original = {"own"} | set(missing_keys)

    mine = Own.__dict__[HOOK]
    with td._views_for_missing(Own, {"a.w": None}, lambda name, meta: "view") as assigned:
        model = Own(["a.w", "b.w"])
        Own._move_missing_keys_from_meta_to_device(model, {"a.w", "b.w"})
    assert assigned == {"a.w"}
    assert model.left_to_original == {"own", "b.w"}
    assert Own.__dict__[HOOK] is mine


def test_the_hook_comes_off_when_the_load_raises():
    try:
        with td._views_for_missing(Model, {}, lambda name, meta: "view"):
            raise RuntimeError("load failed")
    except RuntimeError:
        pass
    assert HOOK not in Model.__dict__
    assert td._HOOKED == {}


class Meshed:
    """Stands for a model class: transformers' `prepare_distribute_model` is a classmethod
    that makes a new mesh on every call."""

    made = 0

    @classmethod
    def prepare_distribute_model(cls, config, device_map=None):
        cls.made += 1
        return ("new mesh", config, device_map)


def test_same_mesh_serves_each_threads_own_config_and_no_other():
    barrier_in, barrier_out = threading.Barrier(2), threading.Barrier(2)
    seen: dict = {}

    def load(tag):
        config = object()
        with td._same_mesh(Meshed, config, (tag, "mesh")):
            barrier_in.wait()
            seen[tag] = (
                Meshed.prepare_distribute_model(config),
                Meshed.prepare_distribute_model(config, device_map="cpu"),
                Meshed.prepare_distribute_model(object()),
            )
            barrier_out.wait()

    threads = [threading.Thread(target=load, args=(t,)) for t in ("one", "two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for tag in ("one", "two"):
        own, with_map, other = seen[tag]
        assert own == (tag, "mesh")
        assert with_map[0] == "new mesh" and with_map[2] == "cpu"
        assert other[0] == "new mesh"
    assert Meshed.made == 4
    assert isinstance(Meshed.__dict__["prepare_distribute_model"], classmethod)
    assert Meshed.prepare_distribute_model(None)[0] == "new mesh"
    assert td._HOOKED == {}
