#!/usr/bin/env python3
"""Per-rank memory of `numapin.transformers.from_pretrained(..., distributed_config=...)`
under `torchrun --nproc-per-node N` with gloo, in TP, EP and EP+TP (issue 33, "Done when":
each rank's memory above the runtime's own baseline is its share's bytes, not the model's).

The checkpoint: a Qwen3-MoE of about 1 GB (bfloat16, 8 layers of 32 experts, hidden 1024,
vocabulary 32000, 8 query and 4 KV heads) written once by transformers' own
`save_pretrained` into DIR (skipped when DIR/config.json exists).

Per rank, in its own torchrun job per mode: the baseline is the process after importing
torch, transformers and numapin, joining the process group, building the model on the
meta device and making transformers' device mesh for the config (any distributed load
makes one); then the peak (VmHWM) is reset (`clear_refs` 5), the model is loaded, and
/proc/self/smaps_rollup is read again. The figures: RSS, PSS and USS (Private_Clean +
Private_Dirty) above the baseline, the peak RSS above it (a transient allocation shows
there), against the rank's share: the bytes numapin placed for it (the placed stores'
`bytes` in `WholeModel.stats()`, every node's copy) plus the bytes transformers copied
(`model.numapin_load["copied_bytes"]`, the float32 routers). Figures and reading:
docs/benchmarks.md ("Per-rank memory under torchrun").

    target/frameworks-venv/bin/python benches/rank_memory.py DIR [RANKS [MODES]]

MODES: a comma-separated subset of tp,ep,eptp. Each rank also lists the mappings that
grew by more than 1 MB outside numapin's placed memory (where the rest went).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ["tp", "ep", "eptp"]


def rollup() -> dict[str, int]:
    """smaps_rollup and status fields in bytes: rss, pss, uss, anon, hwm."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    status = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            status[key] = int(value.split()[0]) * 1024
    return {
        "rss": fields["Rss"],
        "pss": fields["Pss"],
        "uss": fields["Private_Clean"] + fields["Private_Dirty"],
        "anon": fields["Anonymous"],
        "hwm": status["VmHWM"],
    }


def mappings() -> dict[int, tuple[int, int, str]]:
    """{start address: (end, Rss bytes, the mapping's name)} from /proc/self/smaps (by
    start: the heap grows at its end)."""
    out: dict[int, tuple[int, int, str]] = {}
    span, name = (0, 0), ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            start, end = head[0].split("-")
            span = (int(start, 16), int(end, 16))
            name = head[5] if len(head) > 5 else "[anon]"
        elif head[0] == "Rss:":
            out[span[0]] = (span[1], int(head[1]) * 1024, name)
    return out


def write_checkpoint(root: Path) -> None:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, intermediate_size=2048,
        moe_intermediate_size=512, num_experts=32, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root)
    files = sorted(root.glob("*.safetensors"))
    print(f"wrote {root}: {sum(f.stat().st_size for f in files):,} bytes in {len(files)} files",
          flush=True)


def whole_ranges(whole) -> list[tuple[int, int]]:  # noqa: ANN001
    """The address ranges of every view the WholeModel gives (tensors, held experts)."""
    ranges = []
    for name in whole.tensors():
        try:
            view = whole.tensor(name)
        except Exception:  # noqa: BLE001 (not held, or fused: the experts below)
            continue
        ranges.append((view.address, view.address + view.span_bytes))
    for layer in whole.layers:
        for e in whole.expert_ids(layer):
            for view in whole.expert(layer, e).values():
                ranges.append((view.address & ~4095, view.address + view.span_bytes))
    return ranges


def rank_main(root: Path, mode: str, out_dir: Path) -> None:
    import gc

    import torch
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    import numapin.transformers as nt

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    config = transformers.AutoConfig.from_pretrained(root)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    if mode == "tp":
        dc = DistributedConfig(tp_size=n)
    elif mode == "ep":
        dc = DistributedConfig(tp_size=n, ep_size=n,
                               tp_plan=dict.fromkeys(meta.tp_plan, "replicate"))
    else:
        dc = DistributedConfig(tp_size=n, ep_size=n)
    # transformers' device mesh for that config (its gloo process groups, ~2 MB): any
    # distributed load makes one, so the baseline has one too (the load makes its own,
    # ~0.15 MB more; it is counted).
    mesh = type(meta).prepare_distribute_model(dc)
    del meta
    gc.collect()
    dist.barrier()
    before = rollup()
    maps_before = mappings()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    model, whole = nt.from_pretrained(root, distributed_config=dc)
    gc.collect()
    after = rollup()
    maps_after = mappings()
    views = [*whole_ranges(whole)]
    grown = []
    for start, (end, rss, name) in maps_after.items():
        delta = rss - maps_before.get(start, (0, 0, ""))[1]
        # A mapping numapin placed a view in is the store's (its placed memory).
        if delta > 1 << 20 and not any(a < end and start < b for a, b in views):
            grown.append((delta, hex(start), name))
    # What glibc keeps of freed memory (the loaders' buffers): given back, measured again.
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = rollup()
    stats = whole.stats()
    stores = [stats["experts"], *stats["dense"]]
    placed = sum(s["bytes"] for s in stores if s)
    copied = model.numapin_load["copied_bytes"]
    files = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    result = {
        "rank": rank, "ranks": n, "mode": mode, "share": whole.share,
        "placed": placed, "copied": copied, "file_bytes": files,
        "views": len(model.numapin_load["views"]),
        "before": before, "after": after, "trimmed": trimmed, "grown": sorted(grown, reverse=True)[:8],
    }
    (out_dir / f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    del model, whole, mesh
    gc.collect()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    root = Path(sys.argv[1]).resolve()
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    modes = sys.argv[3].split(",") if len(sys.argv) > 3 else MODES
    if not (root / "config.json").exists():
        write_checkpoint(root)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    print("| mode | rank | share | placed + copied | RSS above baseline | PSS above | "
          "USS above | peak RSS above | RSS / share | after malloc_trim: RSS / share | model's file bytes |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for mode in modes:
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(ranks),
                            __file__, "--rank", str(root), mode, out], check=True, env=env)
            for k in range(ranks):
                r = json.loads((Path(out) / f"{mode}-rank{k}.json").read_text())
                share = r["placed"] + r["copied"]
                d = {f: r["after"][f] - r["before"][f] for f in ("rss", "pss", "uss")}
                peak = r["after"]["hwm"] - r["before"]["rss"]
                trim = r["trimmed"]["rss"] - r["before"]["rss"]
                ratio = d["rss"] / share
                worst = max(worst, abs(ratio - 1), abs(peak / share - 1))
                share_text = r["share"] if len(r["share"]) < 40 else r["share"][:37] + "..."
                print(f"| {mode} | {k}/{ranks} | {share_text} | {share / 1e6:,.1f} MB | "
                      f"{d['rss'] / 1e6:,.1f} MB | {d['pss'] / 1e6:,.1f} MB | "
                      f"{d['uss'] / 1e6:,.1f} MB | {peak / 1e6:,.1f} MB | {ratio:.3f} | {trim / share:.3f} | "
                      f"{r['file_bytes'] / 1e6:,.1f} MB |", flush=True)
                grown_text = ", ".join(f"{d / 1e6:.1f} MB {n}" for d, _, n in r["grown"])
                print(f"  {mode} rank {k}: grown outside the placed memory: {grown_text}",
                      file=sys.stderr)
    print(f"largest deviation from the share (RSS and peak): {worst * 100:.1f}%")


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    else:
        main()
