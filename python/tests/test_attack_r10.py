"""Hostile pass on round 10's report keys (`WholeModel.report_dict()`): every read mode
(buffered, drop-behind, direct, auto) and a served model and its attached copy. Every
measured class must carry the six direct-read counts and the dict `direct_io`; the bytes
read directly (in place + bounced) are checked against numpy's copies of the tensors
(the fixture's sidecars, not read through numapin): exactly the class's bytes where all
its files were read directly, 0 where none was."""

import json
import os
import subprocess
import sys

import pytest

import numapin

from test_loads import CLASS_NAMES, COUNTS, placed_bytes_by_class


def check_keys(report):
    assert "direct_io" in report, sorted(report)
    assert report["measured"], report
    for m in report["measured"]:
        for k in COUNTS:
            assert isinstance(m.get(k), int) and m[k] >= 0, (k, m)


def check_against_numpy(report, expected, mode):
    """Per class: in place + bounced is the class's bytes (numpy's) where every file was
    read directly, 0 (every count 0) where none was, between where some were."""
    measured = {CLASS_NAMES[m["class"]]: m for m in report["measured"]}
    assert sorted(measured) == sorted(expected), (measured, expected)
    any_direct = False
    for cls, m in measured.items():
        modes = {f["mode"] for f in m["files"]}
        read = m["in_place_bytes"] + m["bounced_bytes"]
        if modes == {"direct"}:
            assert read == expected[cls], (mode, cls, m)
            assert m["uring_reads"] + m["blocking_reads"] > 0, (mode, cls, m)
            any_direct = True
        elif "direct" not in modes:
            assert read == 0, (mode, cls, m)
            assert all(m[k] == 0 for k in COUNTS), (mode, cls, m)
        else:
            assert 0 < read <= expected[cls], (mode, cls, m)
            any_direct = True
        if m["uring_reads"] == 0:
            assert m["uring_depth"] == 0, (mode, cls, m)
        if m["blocking_reads"] == 0:
            assert m["blocking_depth"] == 0, (mode, cls, m)
    if mode in ("buffered", "drop-behind"):
        assert not any_direct and report["direct_io"] is None, (mode, report["direct_io"])
    experts = measured.get("experts")
    if experts is not None and experts["in_place_bytes"] + experts["bounced_bytes"] > 0:
        assert report["direct_io"] is not None, report
    return measured


@pytest.mark.parametrize("mode", ["buffered", "drop-behind", "direct", "auto"])
def test_every_read_mode_reports_the_counts_numpy_agrees_with(fixture, mode):
    fx = fixture("st-sharded")
    model = numapin.Checkpoint(fx.path).place("interleave:all", "interleave:all",
                                              loader_threads=2, read_mode=mode,
                                              progress=False)
    assert model.verify()["verified"]
    report = model.report_dict()
    check_keys(report)
    # Asked twice: the same dict (no count added by the asking).
    assert model.report_dict() == report
    check_against_numpy(report, placed_bytes_by_class(fx, model), mode)


OFF_CHILD = r"""
import json, sys
import numapin
model = numapin.Checkpoint(sys.argv[1]).place("interleave:all", "interleave:all",
                                              loader_threads=2, read_mode=sys.argv[2],
                                              progress=False)
assert model.verify()["verified"]
print(json.dumps(model.report_dict()))
"""


@pytest.mark.parametrize("mode", ["direct", "auto"])
def test_io_uring_off_in_a_child_counts_only_blocking_reads(fixture, mode):
    fx = fixture("st-sharded")
    model = numapin.Checkpoint(fx.path).place(read_mode="buffered", progress=False)
    expected = placed_bytes_by_class(fx, model)
    del model
    env = dict(os.environ, NUMAPIN_IO_URING="off")
    out = subprocess.run([sys.executable, "-c", OFF_CHILD, str(fx.path), mode], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    check_keys(report)
    measured = check_against_numpy(report, expected, mode)
    for cls, m in measured.items():
        assert m["uring_reads"] == 0 and m["uring_depth"] == 0, (mode, cls, m)
        if m["in_place_bytes"] + m["bounced_bytes"] > 0:
            assert m["blocking_reads"] > 0, (mode, cls, m)
            assert 1 <= m["blocking_depth"] <= 8, (mode, cls, m)
    if report["direct_io"] is not None:
        assert report["direct_io"].startswith("threads"), report["direct_io"]
        assert "NUMAPIN_IO_URING" in report["direct_io"], report["direct_io"]


ATTACH_CHILD = r"""
import json, sys
import numapin
model = numapin.attach(sys.argv[1], timeout=20.0)
assert model.attached
print(json.dumps({"report": model.report_dict(), "text": model.report()}))
"""


def test_a_served_model_and_its_attached_copy_give_a_report_dict(fixture):
    fx = fixture("st-sharded")
    name = f"attack-r10-{os.getpid()}"
    model = numapin.Checkpoint(fx.path).place("interleave:all", "interleave:all",
                                              loader_threads=2, read_mode="direct",
                                              progress=False, serve_as=name)
    report = model.report_dict()
    check_keys(report)
    expected = placed_bytes_by_class(fx, model)
    for m in report["measured"]:
        if {f["mode"] for f in m["files"]} == {"direct"}:
            cls = CLASS_NAMES[m["class"]]
            assert m["in_place_bytes"] + m["bounced_bytes"] == expected[cls], m
    out = subprocess.run([sys.executable, "-c", ATTACH_CHILD, name],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    # The attached copy read nothing: no report (None, as the stub and docs say), never
    # one that claims reads it did not make; report() is empty.
    assert child == {"report": None, "text": ""}, child
    del model
