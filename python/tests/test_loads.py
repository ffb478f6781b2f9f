"""What a placement's direct reads did, in the Python report (`report_dict()`): each
measured class has the counts `pin_model --plan --json` gives it, under the same names
(in_place_bytes, bounced_bytes, uring_reads, blocking_reads, uring_depth,
blocking_depth), and the dict says how the experts' reads were issued (`direct_io`).
The bytes are checked against the tensors' sizes in numpy's files (written by the
fixture writer, not read through numapin). Passes where io_uring works and where it is
denied: the mechanism expected is the one the report names, and NUMAPIN_IO_URING=off in
a child process must name the read threads."""

import json
import os
import subprocess
import sys

import pytest

import numapin

from test_whole import numpy_tensors

COUNTS = ("in_place_bytes", "bounced_bytes", "uring_reads", "blocking_reads",
          "uring_depth", "blocking_depth")

CHILD = r"""
import json, sys
import numapin
model = numapin.Checkpoint(sys.argv[1]).place("interleave:all", "interleave:all",
                                              loader_threads=2, read_mode="direct",
                                              progress=False)
assert model.verify()["verified"]
r = model.report_dict()
print(json.dumps({"direct_io": r["direct_io"],
                  "measured": [{k: m[k] for k in ("class", "files") + COUNTS}
                               for m in r["measured"]]}))
""".replace("COUNTS", repr(COUNTS))

# The report's class (serde's variant name) -> the class names model.classes() gives.
CLASS_NAMES = {"RoutedExperts": "experts", "SharedExperts": "shared",
               "Attention": "attention", "DenseMlp": "dense_mlp",
               "NormsAndRouters": "norms", "Embeddings": "embeddings",
               "OutputHead": "head", "Global": "global"}


def placed_bytes_by_class(fx, model):
    """{class: bytes of its tensors in the files}, from numpy's copies of the tensors."""
    want = numpy_tensors(fx.root)
    classes = {name: cls for name, cls, _ in model.classes()}
    out = {}
    for name, (_, data) in want.items():
        out[classes[name]] = out.get(classes[name], 0) + len(data)
    return out


def skip_without_direct_io(report):
    """Skips where the fixtures' file system takes no direct reads (tmpfs, overlayfs):
    the report records the fallback to buffered reads, and there is nothing to count."""
    fallbacks = [f for m in report["measured"] for f in m["files"] if f["fallback"]]
    if fallbacks:
        pytest.skip(f"NOT RUN: no direct reads of the fixtures here: {fallbacks[0]}")
    modes = {f["mode"] for m in report["measured"] for f in m["files"]}
    assert modes == {"direct"}, report["measured"]


def check_counts(report, expected):
    """Every class's bytes read once, in place or bounced; the mechanism named counted."""
    measured = {CLASS_NAMES[m["class"]]: m for m in report["measured"]}
    assert sorted(measured) == sorted(expected), (measured, expected)
    for cls, m in measured.items():
        assert m["in_place_bytes"] + m["bounced_bytes"] == expected[cls], (cls, m)
        # The CLI's flat names are the nested direct_reads' figures.
        if "direct_reads" in m:
            for key in ("in_place_bytes", "uring_reads", "blocking_reads", "uring_depth",
                        "blocking_depth"):
                assert m[key] == m["direct_reads"][key], (cls, key, m)
    # Reads and bytes summed; the depths are the deepest class's.
    total = {k: (max if k.endswith("depth") else sum)(m[k] for m in measured.values())
             for k in COUNTS}
    assert total["in_place_bytes"] + total["bounced_bytes"] == sum(expected.values())
    return total


def test_a_direct_place_reports_what_each_read_path_did(fixture):
    fx = fixture("st-sharded")
    model = numapin.Checkpoint(fx.path).place("interleave:all", "interleave:all",
                                              loader_threads=2, read_mode="direct",
                                              progress=False)
    assert model.verify()["verified"]
    report = model.report_dict()
    skip_without_direct_io(report)
    expected = placed_bytes_by_class(fx, model)
    assert sum(expected.values()) > 0
    total = check_counts(report, expected)
    io = report["direct_io"]
    assert io is not None, report
    if io.startswith("io_uring"):
        assert total["uring_reads"] > 0 and total["uring_depth"] >= 1, (io, total)
    else:
        # Denied (a seccomp profile), missing, or turned off: the read threads.
        assert io.startswith("threads") and "fallback" in io, io
        assert total["uring_reads"] == 0 and total["uring_depth"] == 0, (io, total)
        assert total["blocking_reads"] > 0 and total["blocking_depth"] >= 1, (io, total)


def test_numapin_io_uring_off_reports_the_read_threads(fixture):
    fx = fixture("st-sharded")
    model = numapin.Checkpoint(fx.path).place("interleave:all", "interleave:all",
                                              loader_threads=2, read_mode="buffered",
                                              progress=False)
    expected = placed_bytes_by_class(fx, model)
    # Buffered: nothing read directly, every count 0.
    report = model.report_dict()
    assert report["direct_io"] is None
    for m in report["measured"]:
        assert all(m[k] == 0 for k in COUNTS), m
    del model
    env = dict(os.environ, NUMAPIN_IO_URING="off")
    out = subprocess.run([sys.executable, "-c", CHILD, str(fx.path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    skip_without_direct_io(child)
    assert "NUMAPIN_IO_URING" in child["direct_io"], child
    total = check_counts(child, expected)
    assert total["uring_reads"] == 0 and total["uring_depth"] == 0, child
    assert total["blocking_reads"] > 0, child
    assert 1 <= total["blocking_depth"] <= 8, child
