"""numapin.transformers.from_pretrained(distributed_config=...) under
`torchrun --nproc-per-node 2` over gloo (CPU), against transformers' own distributed load
in the same job (dist_rank.py is one rank).

Modes, as transformers 5 runs them: tp (`DistributedConfig(tp_size=2)`: the class's TP
plan, routed experts cut too: gate_up `packed_colwise`, down `rowwise`), ep (`tp_size=2,
ep_size=2`, every TP rule overridden by "replicate": experts only, whole per rank) and
eptp (`tp_size=2, ep_size=2`: experts whole per rank, dense modules cut by the TP plan).
Per rank: every parameter's local shard (a DTensor's `_local_tensor`) has the bytes,
shape and dtype of transformers' own; numapin's lies in memory the WholeModel placed
(its own views' ranges), the float32 routers included (converted at placement); the logits of the same ids are bit-equal; the cut parameters are the ones
transformers cuts. Fewer KV heads than ranks is refused by numapin by name.

One torchrun job runs every case (the process start and torch's import paid once); the
full matrix (every family, n = 4): NUMAPIN_TORCHRUN_FULL=1 (docs/frameworks.md).
"""

import json
import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest

from .conftest import families, fixtures_dir
from .test_transformers import EXPECTED_COPIES

RANK = Path(__file__).with_name("dist_rank.py")
MODES = ["tp", "ep", "eptp"]
FAMILIES = ["qwen3_moe", "qwen3_moe_tied", "mixtral", "deepseek_v3", "qwen2_moe"]
if os.environ.get("NUMAPIN_TORCHRUN_FULL") == "1":
    FAMILIES = [f for f in families() if f != "qwen3_moe_kv1"]
RANKS = int(os.environ.get("NUMAPIN_TORCHRUN_RANKS", "2"))
CASES = [(f, m) for f in FAMILIES for m in MODES]
REFUSED = ("qwen3_moe_kv1", "tp")

# What transformers holds in float32 over a bf16 file (`_keep_in_fp32_modules`) is
# converted at placement: no copies, the same as in one process.
COPIES = EXPECTED_COPIES


@cache
def results() -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = [f"{f}:{m}" for f, m in [REFUSED, *CASES]]
    with tempfile.TemporaryDirectory() as out_dir:
        out = subprocess.run(
            [str(torchrun), "--standalone", "--nproc-per-node", str(RANKS), str(RANK),
             str(fixtures_dir()), out_dir, *jobs],
            capture_output=True, text=True, timeout=1800, env=env)
        assert out.returncode == 0, (out.returncode, out.stderr[-4000:])
        found: dict = {}
        for k in range(RANKS):
            for line in (Path(out_dir) / f"rank{k}.jsonl").read_text().splitlines():
                r = json.loads(line)
                assert r["rank"] == k, r["rank"]
                found.setdefault((r["family"], r["mode"]), {})[k] = r
    return found


def ranks_of(family: str, mode: str, compared: bool = True) -> list[dict]:
    found = results().get((family, mode), {})
    assert sorted(found) == list(range(RANKS)), (family, mode, sorted(found))
    ranks = [found[k] for k in range(RANKS)]
    for r in ranks:
        assert "error" not in r, r
        if compared:
            assert "reference_error" not in r and "refused" not in r, r
    return ranks


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_each_ranks_shards_are_numapin_views_with_transformers_bytes(family, mode):
    for r in ranks_of(family, mode):
        params = r["params"]
        assert params and not r["missing"], r["missing"]
        bad = {k: v for k, v in params.items() if not v["equal"]}
        assert not bad, (r["rank"], bad)
        outside = {k for k, v in params.items() if not v["placed"]}
        assert outside == COPIES.get(family, set()), (r["rank"], outside)
        assert set(r["copied"]) == outside, r["copied"]
        cut = {k for k, v in params.items() if v["sharded"]}
        experts = {k for k in params if ".experts." in k}
        # Each mode cuts what transformers cuts: ep the experts alone (half each),
        # tp and eptp the dense modules too.
        assert experts and experts <= cut, (mode, experts - cut)
        if mode == "ep":
            assert cut == experts, cut - experts
            assert r["share"].startswith("experts "), r["share"]
        else:
            assert cut - experts, cut
            assert any(f"{k}/{RANKS}" in r["share"] for k in range(RANKS)), r["share"]


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_each_ranks_logits_are_bit_equal_to_transformers_distributed_load(family, mode):
    for r in ranks_of(family, mode):
        assert r["logits_equal"], (r["rank"], family, mode)


def test_fewer_kv_heads_than_ranks_is_refused_by_name():
    for r in ranks_of(*REFUSED, compared=False):
        assert "refused" in r, r
        assert "k_proj" in r["refused"] and "num_key_value_heads = 1" in r["refused"], r
