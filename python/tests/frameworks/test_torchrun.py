"""numapin.transformers.from_pretrained(distributed_config=...) under
`torchrun --nproc-per-node 2` and `4` over gloo (CPU), against transformers' own distributed load
in the same job (dist_rank.py is one rank).

Modes, as transformers 5 runs them: tp (`DistributedConfig(tp_size=2)`: the class's TP
plan, routed experts cut too: gate_up `packed_colwise`, down `rowwise`), ep (`tp_size=2,
ep_size=2`, every TP rule overridden by "replicate": experts only, whole per rank) and
eptp (`tp_size=2, ep_size=2`: experts whole per rank, dense modules cut by the TP plan).
Per rank: every parameter's local shard (a DTensor's `_local_tensor`) has the bytes,
shape and dtype of transformers' own; numapin's lies in memory the WholeModel placed
(its own views' ranges), the float32 routers included (converted at placement); the logits of the same ids are bit-equal; the cut parameters are the ones
transformers cuts. Fewer KV heads than ranks is refused by numapin by name.

One torchrun job per rank count runs its cases (the process start and torch's import paid
once): n = 2 on five families and granitemoe (its experts fused in the file: tp cuts
rows k/n of each packed half of `input_linear`), n = 4 on the two fixtures with 4 KV heads (qwen3_moe_kv4,
mixtral_kv4). The full matrix (every family at n = 2 and n = 4; at n = 4 TP and EP+TP
only where the family has 4 KV heads): NUMAPIN_TORCHRUN_FULL=1 (docs/frameworks.md).
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
# n = 4: the fixtures with 4 KV heads (one per rank under TP).
FAMILIES4 = ["qwen3_moe_kv4", "mixtral_kv4"]
FULL = os.environ.get("NUMAPIN_TORCHRUN_FULL") == "1"
# Families whose model class has no `ep_plan` (transformers itself refuses `ep_size=n`:
# "DbrxForCausalLM has no ep_plan"): tp only. DBRX under tp: transformers cuts lm_head and
# holds the experts whole; numapin's w1/v1/w2 are each one view of the role-major run.
NO_EP_PLAN = {"dbrx"}
if FULL:
    FAMILIES = [f for f in families() if f != "qwen3_moe_kv1"]
    FAMILIES4 = FAMILIES
# Refused by numapin by name: fewer KV heads than ranks (1 on 2, 2 on 4).
REFUSED = {2: ("qwen3_moe_kv1", "tp"), 4: ("qwen3_moe", "tp")}


def kv_heads(family: str) -> int:
    root = fixtures_dir()
    config = json.loads((root / family / "config.json").read_text()) if root else {}
    return (config.get("num_key_value_heads") or config.get("num_attention_heads")
            or (config.get("attn_config") or {}).get("kv_n_heads") or 0)


def cases_at(n: int) -> list[tuple[str, str]]:
    """(family, mode) run at n ranks; in the full matrix at n = 4, TP and EP+TP only
    where the family has at least n KV heads (transformers' own forward fails
    otherwise, and numapin refuses: the REFUSED case)."""
    families_n = FAMILIES if n == 2 else FAMILIES4
    cases = [(f, m) for f in families_n for m in MODES
             if (m == "ep" or kv_heads(f) >= n) and not (f in NO_EP_PLAN and m != "tp")]
    if n == 2 and not FULL:
        # The file's own fused experts (Granite `input_linear`): held whole per rank (ep,
        # eptp), or cut rows k/n of each packed half (tp).
        cases += [("granitemoe", m) for m in MODES]
    return cases


CASES = [(f, m, n) for n in (2, 4) for f, m in cases_at(n)]

# What transformers holds in float32 over a bf16 file (`_keep_in_fp32_modules`) is
# converted at placement: no copies, the same as in one process.
COPIES = EXPECTED_COPIES


@cache
def results(ranks: int) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = [f"{f}:{m}" for f, m in [REFUSED[ranks], *cases_at(ranks)]]
    with tempfile.TemporaryDirectory() as out_dir:
        out = subprocess.run(
            [str(torchrun), "--standalone", "--nproc-per-node", str(ranks), str(RANK),
             str(fixtures_dir()), out_dir, *jobs],
            capture_output=True, text=True, timeout=1800, env=env)
        assert out.returncode == 0, (out.returncode, out.stderr[-4000:])
        found: dict = {}
        for k in range(ranks):
            for line in (Path(out_dir) / f"rank{k}.jsonl").read_text().splitlines():
                r = json.loads(line)
                assert r["rank"] == k, r["rank"]
                found.setdefault((r["family"], r["mode"]), {})[k] = r
    return found


def ranks_of(family: str, mode: str, ranks: int, compared: bool = True) -> list[dict]:
    found = results(ranks).get((family, mode), {})
    assert sorted(found) == list(range(ranks)), (family, mode, sorted(found))
    out = [found[k] for k in range(ranks)]
    for r in out:
        assert "error" not in r, r
        assert r["ranks"] == ranks, r["ranks"]
        if compared:
            assert "reference_error" not in r and "refused" not in r, r
    return out


@pytest.mark.parametrize(("family", "mode", "ranks"), CASES)
def test_each_ranks_shards_are_numapin_views_with_transformers_bytes(family, mode, ranks):
    for r in ranks_of(family, mode, ranks):
        params = r["params"]
        assert params and not r["missing"], r["missing"]
        bad = {k: v for k, v in params.items() if not v["equal"]}
        assert not bad, (r["rank"], bad)
        outside = {k for k, v in params.items() if not v["placed"]}
        assert outside == COPIES.get(family, set()), (r["rank"], outside)
        assert set(r["copied"]) == outside, r["copied"]
        cut = {k for k, v in params.items() if v["sharded"]}
        experts = {k for k in params if ".experts." in k}
        # Each mode cuts what transformers' own load cuts, in the installed version (its
        # model class's plan: transformers 5.24's tp cut the routed experts too, 5.25's
        # holds them whole): ep the experts alone (half each), tp and eptp the dense
        # modules at least.
        assert cut == {k for k, v in params.items() if v["ref_sharded"]}, mode
        assert experts, params.keys()
        if mode == "ep":
            assert cut == experts, cut - experts
            assert r["share"].startswith("experts "), r["share"]
        else:
            assert cut - experts, cut
            assert f"{r['rank']}/{ranks}" in r["share"], r["share"]


@pytest.mark.parametrize(("family", "mode", "ranks"), CASES)
def test_no_cut_parameter_is_materialised_before_its_view(family, mode, ranks):
    """The load allocates no CPU tensor of a cut parameter's local shape and dtype (counted
    by a dispatch mode on torch's `empty` ops): transformers' materialisation of the
    missing local shards, and their random initialisation, are skipped for the views."""
    for r in ranks_of(family, mode, ranks):
        assert r["cut_bytes"] > 0, r["rank"]
        assert r["materialised"] == 0, (r["rank"], r["materialised"], r["cut_bytes"])


@pytest.mark.parametrize(("family", "mode", "ranks"), CASES)
def test_each_ranks_logits_are_bit_equal_to_transformers_distributed_load(family, mode, ranks):
    for r in ranks_of(family, mode, ranks):
        assert r["logits_equal"], (r["rank"], family, mode)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fewer_kv_heads_than_ranks_is_refused_by_name(ranks):
    family, mode = REFUSED[ranks]
    heads = kv_heads(family)
    assert heads < ranks, (family, heads)
    for r in ranks_of(family, mode, ranks, compared=False):
        assert "refused" in r, r
        assert "k_proj" in r["refused"], r
        assert f"num_key_value_heads = {heads}" in r["refused"], r
