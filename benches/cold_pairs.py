#!/usr/bin/env python3
"""The issue-24 form of the cold-load figures: rounds of `cat FILE > /dev/null` (for MODE
`direct`: `dd if=FILE of=/dev/null bs=8M iflag=direct`, still labelled "cat") against
`pin_model --file FILE --read MODE --json` binaries (caches dropped before every run, the
binaries in a rotating order after cat), each run's page-cache peak polled with `fincore`
every 50 ms. Prints each round's GB/s and ratio to cat, then medians (min-max) and the
highest peak. Needs root (drop_caches) and util-linux's fincore.

    python3 benches/cold_pairs.py ROUNDS MODE FILE PIN_MODEL [PIN_MODEL...]

PIN_MODEL: target/release/examples/pin_model, or copies built from other commits (A/B).
FILE: the default synthetic model (16 layers x 64 experts x (1 MiB + 32 KiB), 1.03 GiB),
which pin_model verifies against testkit's SyntheticModel pattern (splitmix64 of each
8-byte word's index); written here with numpy when FILE does not exist."""
import json, os, statistics, subprocess, sys, time

rounds, mode, path, variants = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
MODEL_BYTES = 16 * 64 * ((1 << 20) + (32 << 10))


def write_model():
    import numpy as np
    step = 8 << 20  # words per chunk
    with open(path, "wb") as out:
        for first in range(0, MODEL_BYTES // 8, step):
            z = np.arange(first, min(first + step, MODEL_BYTES // 8), dtype=np.uint64)
            z += np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            out.write((z ^ (z >> np.uint64(31))).astype("<u8").tobytes())


if not os.path.exists(path):
    write_model()
# The yardstick ("cat" in the output): `cat FILE`, or for --read direct `dd` with O_DIRECT.
BASELINE = (["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"]
            if mode == "direct" else ["cat", path])
size = os.path.getsize(path)


def drop():
    subprocess.run("sync; echo 1 > /proc/sys/vm/drop_caches", shell=True, check=True)


def cached():
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", path],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else 0


res = {v: [] for v in ["cat"] + variants}
for r in range(rounds):
    k = r % len(variants)
    row = {}
    for v in ["cat"] + variants[k:] + variants[:k]:
        drop()
        if v == "cat":
            start = time.time()
            subprocess.run(BASELINE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=True)
            row[v] = (size / (time.time() - start) / 1e9, None)
            continue
        p = subprocess.Popen([v, "--file", path, "--read", mode, "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak = 0
        while p.poll() is None:
            peak = max(peak, cached())
            time.sleep(0.05)
        out, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"{v} failed ({p.returncode}): {err}")
        row[v] = (json.loads(out)["gbps"], peak / size * 100)
    cat = row["cat"][0]
    print(f"round {r}: cat {cat:.2f} " + " ".join(
        f"{v} {g:.2f} ({g / cat:.2f}x, peak {pk:.1f}%)"
        for v, (g, pk) in row.items() if v != "cat"), flush=True)
    for v, (g, pk) in row.items():
        res[v].append((g, g / cat, pk))
print("median (min-max):")
for v, xs in res.items():
    gb = [x[0] for x in xs]
    ratio = [x[1] for x in xs]
    line = (f"  {v}: GB/s {statistics.median(gb):.2f} ({min(gb):.2f}-{max(gb):.2f})"
            f"  x cat {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})")
    if v != "cat":
        peaks = [x[2] for x in xs]
        line += (f"  peak {statistics.median(peaks):.1f}% of the file"
                 f" ({min(peaks):.1f}-{max(peaks):.1f})")
    print(line)
