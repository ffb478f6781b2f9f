#!/usr/bin/env python3
"""Writes a skewed (Zipf) routing trace in numapin's routing statistics format for a
model's MoE layers: in each layer the expert of rank k (1-based) gets a share of the
tokens proportional to 1 / k^S, the ranks shuffled per layer by a seeded generator (the
hot experts differ from layer to layer), TOKENS x TOP_K picks per layer.

    python3 docs/planner/zipf_trace.py > trace.json               # DeepSeek-V3's shape
    python3 docs/planner/zipf_trace.py --first 3 --layers 58 --experts 256 \
        --s 1.0 --tokens 1000000 --top-k 8 --seed 23 > trace.json

Deterministic for given arguments (Python's random.Random). Standard library only.
"""
import argparse
import json
import random


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--first", type=int, default=3, help="first MoE layer number")
    a.add_argument("--layers", type=int, default=58, help="MoE layers")
    a.add_argument("--experts", type=int, default=256)
    a.add_argument("--s", type=float, default=1.0, help="Zipf exponent")
    a.add_argument("--tokens", type=int, default=1_000_000)
    a.add_argument("--top-k", type=int, default=8)
    a.add_argument("--seed", type=int, default=23)
    args = a.parse_args()
    rng = random.Random(args.seed)
    weights = [1.0 / (k ** args.s) for k in range(1, args.experts + 1)]
    total = sum(weights)
    picks = args.tokens * args.top_k
    layers = []
    for l in range(args.first, args.first + args.layers):
        ranks = list(range(args.experts))
        rng.shuffle(ranks)
        counts = [0] * args.experts
        for rank, expert in enumerate(ranks):
            counts[expert] = round(picks * weights[rank] / total)
        layers.append({"layer": l, "counts": counts})
    print(json.dumps({"numapin_routing": 1, "layers": layers}))


if __name__ == "__main__":
    main()
