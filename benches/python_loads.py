#!/usr/bin/env python3
"""Issue 34's done-when figures as a new user meets them: `numapin.Checkpoint(PATH).place()`
from Python, every contender its own process, in rounds against `dd bs=8M iflag=direct` of
the same files (caches dropped before every cold run; root). Per round:

- cold `dd` over the files (the yardstick);
- cold `place(read_mode="direct")` then `verify()`: place's seconds, verify's seconds, and
  the page cache the two leave (`fincore` of the files after the process exits);
- cold `place()` (the default mode, `auto`);
- cold `place(read_mode="drop-behind")`: the bytes the process read from the device
  (`/proc/self/io` `read_bytes` from before the checkpoint is opened, after the imports)
  over the files' bytes;
- for a safetensors directory, cold `safetensors.numpy.load_file` of every shard (the
  peer), right after the direct place;

then, warm (files cached by `cat` first), 2 x ROUNDS pairs of `place(read_mode=
"buffered")` and `place()` in one process (the speed of auto over buffered's).

The cold place contenders run in a rotating order after dd, the warm ones alternate.
Ratios are within a round (the machine may be shared); the summary prints medians
(min-max) of the per-round ratios. Speeds are "x dd": dd's seconds over place's (>= 0.95
is the issue's bar), so higher is faster.

    PY=target/fixtures-venv/bin/python   # numapin built into it: maturin develop --release
    $PY benches/python_loads.py ROUNDS PATH

PATH: a sharded safetensors directory (benches/place_checkpoint.py), a GGUF file or a
split GGUF set's first part (benches/place_gguf.py)."""
import glob, json, os, re, statistics, subprocess, sys, time

CHILD = r"""
import json, sys, time
import numapin
path, mode, verify = sys.argv[1], sys.argv[2], sys.argv[3] == "1"


def read_bytes():
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["read_bytes"])


# The interpreter's and the extension's own reads (cold after drop_caches) come before.
before = read_bytes()
start = time.monotonic()
model = numapin.Checkpoint(path).place(read_mode=mode, progress=False)
placed = time.monotonic()
checked = model.verify() if verify else None
done = time.monotonic()
read = read_bytes() - before
report = model.report_dict()
print(json.dumps({
    "place": placed - start,
    "verify": done - placed if verify else None,
    "read_bytes": read,
    "direct_io": report.get("direct_io"),
    "classes": {c["class"]: {"modes": sorted({f["mode"] for f in c["files"]}),
                             **{k: c[k] for k in ("in_place_bytes", "bounced_bytes",
                                                  "uring_reads", "blocking_reads")}}
                for c in report["measured"]},
}))
"""


# Warm pairs in one process (the checkpoint opened once, each model dropped before the
# next place): a warm place takes 0.1-0.3 s, where a new process's start and first touch
# of memory vary as much; buffered and auto alternate, after one untimed place of each.
WARM = r"""
import gc, json, sys, time
import numapin
checkpoint, pairs = numapin.Checkpoint(sys.argv[1]), int(sys.argv[2])


def timed(mode):
    start = time.monotonic()
    model = checkpoint.place(read_mode=mode, progress=False)
    seconds = time.monotonic() - start
    del model
    gc.collect()
    return seconds


timed("buffered"), timed("auto")
ratios = []
for i in range(pairs):
    t = {m: timed(m) for m in (["buffered", "auto"] if i % 2 == 0 else ["auto", "buffered"])}
    ratios.append(t["buffered"] / t["auto"])
print(json.dumps(ratios))
"""


def files_of(path):
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "*.safetensors")))
    split = re.match(r"(.*)-00001-of-(\d+)\.gguf$", path)
    return sorted(glob.glob(f"{split[1]}-*-of-{split[2]}.gguf")) if split else [path]


def drop():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def warm(files):
    for f in files:
        subprocess.run(["cat", f], stdout=subprocess.DEVNULL, check=True)


def cached_bytes(files):
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES"] + files, capture_output=True,
                         text=True, check=True).stdout.split()
    return sum(int(x) for x in out)


def dd(files):
    drop()
    start = time.monotonic()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=8M", "iflag=direct"], check=True,
                       capture_output=True)
    return time.monotonic() - start


def place(path, mode, verify=False, cold=True):
    if cold:
        drop()
    out = subprocess.run([sys.executable, "-c", CHILD, path, mode, "1" if verify else "0"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


PEER = r"""
import glob, os, sys, time
from safetensors.numpy import load_file
start = time.monotonic()
held = [load_file(f) for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.safetensors")))]
print(time.monotonic() - start)
"""


def peer(path):
    """Cold safetensors `load_file` of every shard into numpy arrays (its own copies)."""
    drop()
    out = subprocess.run([sys.executable, "-c", PEER, path], check=True, capture_output=True,
                         text=True).stdout
    return float(out)


def med(xs):
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def main():
    rounds, path = int(sys.argv[1]), sys.argv[2]
    files = files_of(path)
    size = sum(os.path.getsize(f) for f in files)
    print(f"{path}: {len(files)} file(s), {size} bytes; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    figures = {k: [] for k in ("direct", "auto", "drop-behind", "verify/load", "verify x dd",
                               "cache after direct+verify", "drop-behind device/file",
                               "warm auto/buffered")}
    cold = ["direct", "auto", "drop-behind"]
    if os.path.isdir(path):
        figures["safetensors load_file"] = []
        figures["direct / load_file"] = []
    for r in range(rounds):
        base = dd(files)
        line = [f"round {r + 1}: dd {base:.2f} s ({size / base / 1e9:.2f} GB/s)"]
        for mode in cold[r % 3:] + cold[:r % 3]:
            got = place(path, mode, verify=(mode == "direct"))
            figures[mode].append(base / got["place"])
            line.append(f"{mode} {base / got['place']:.2f}x")
            if r == 0:
                print(f"  {mode}: direct_io {got['direct_io']!r}; " + ", ".join(
                    f"{c} {v}" for c, v in got["classes"].items()), flush=True)
            if mode == "direct":
                cache = cached_bytes(files) / size
                figures["verify/load"].append(got["verify"] / got["place"])
                figures["verify x dd"].append(base / got["verify"])
                figures["cache after direct+verify"].append(cache)
                line.append(f"verify/load {got['verify'] / got['place']:.2f} "
                            f"cache {100 * cache:.2f}%")
                if "safetensors load_file" in figures:
                    seconds = peer(path)
                    figures["safetensors load_file"].append(base / seconds)
                    figures["direct / load_file"].append(seconds / got["place"])
                    line.append(f"load_file {base / seconds:.2f}x")
            if mode == "drop-behind":
                figures["drop-behind device/file"].append(got["read_bytes"] / size)
                line.append(f"device/file {got['read_bytes'] / size:.3f}")
        print("; ".join(line), flush=True)
    warm(files)
    out = subprocess.run([sys.executable, "-c", WARM, path, str(2 * rounds)], check=True,
                         capture_output=True, text=True).stdout
    figures["warm auto/buffered"] = json.loads(out)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    for k, xs in figures.items():
        if k.startswith("cache"):
            print(f"{k}: median {100 * statistics.median(xs):.2f}%, max {100 * max(xs):.2f}%")
        else:
            print(f"{k}: {med(xs)}")


main()
