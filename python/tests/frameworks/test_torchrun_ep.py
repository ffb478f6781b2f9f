"""A first expert-parallel test: torchrun --nproc-per-node 2 over gloo (CPU).

Each rank loads with transformers' own EP (DistributedConfig(tp_size=2, ep_size=2): the
experts whole per rank, Shard(0) of the [E, ...] expert parameters) and places its share
with numapin (experts_held="k/2"). The reference is transformers' own shard: every
expert parameter's local tensor must equal numapin's view of the rank's held experts
(`layer(l, gate, through=up)`, `layer(l, down)`) bit for bit, and with the local shards
swapped for those views (the DTensors rebuilt around them, no copy) the logits must stay
bit-equal to transformers' distributed forward. Dense modules stay transformers' (TP)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import fixtures_dir

RANK = Path(__file__).with_name("ep_rank.py")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_ep_shards_are_numapins_views_and_logits_stay_bit_equal(family):
    path = fixtures_dir() / family
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(RANK), str(path)],
        capture_output=True, text=True, timeout=900, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("EP-RESULT ")]
    assert out.returncode == 0 and len(lines) == 2, (out.returncode, out.stderr[-3000:])
    results = sorted((json.loads(l.removeprefix("EP-RESULT ")) for l in lines),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["params"], r
        for name, p in r["params"].items():
            assert p["equal"], (r["rank"], name, p)
            # Each rank holds half the experts, whole.
            assert p["local"] == p["view"] and p["local"][0] * 2 == p["experts"], p
        assert r["logits_equal"], r
