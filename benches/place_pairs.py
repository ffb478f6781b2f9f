#!/usr/bin/env python3
"""Cold whole-model loads against dd, in rounds (issue 34; docs/benchmarks.md, "Whole-model
loads: place against dd"): each round runs `dd bs=8M iflag=direct` over the checkpoint's
shards, then every NUMAPIN binary's `place --model DIR --plan default --read MODE --json`
in a rotating order, the page cache dropped before every run (root). Prints each round's
ratios to dd, then per binary the medians (min-max) of: the whole process's wall over
dd's (load + verify against one read), the load alone (the JSON's load_seconds) over
dd's wall, the verify over the load (verify_seconds / load_seconds) and the verify over
dd's wall (both one read of the files: the steadier figure when the load's first touch of
fresh memory varies). Ratios within a round only: the machine may be shared.

    python3 benches/place_pairs.py ROUNDS MODE DIR NUMAPIN [NUMAPIN...]

DIR: a checkpoint from benches/place_checkpoint.py, or a GGUF file from
benches/place_gguf.py (a split set: its first part; dd reads every part). NUMAPIN:
target/release/numapin, or copies built from other commits (A/B); VAR=VALUE:NUMAPIN runs
it with that environment variable (NUMAPIN_IO_URING=off:target/release/numapin: direct
reads on the loaders' read threads, as where seccomp denies io_uring). The first round's
reads per mechanism (io_uring requests, blocking calls, summed over the classes) are
printed per contender: they say which path really ran.

PRIME_MB=N (environment): before every timed run (dd's included), touch N MiB of fresh
memory in a throwaway process (`dd if=/dev/zero bs=NM count=1`). On this VM a process
that runs right after another has freed its memory faults its own in much faster (the
host backs the guest's pages again on first touch), so without it the second contender
of a round gains from the first; with it every run follows one."""
import glob, json, os, re, statistics, subprocess, sys, time

rounds, mode, root, binaries = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
if os.path.isdir(root):
    shards = sorted(glob.glob(os.path.join(root, "*.safetensors")))
else:
    split = re.match(r"(.*)-00001-of-(\d+)\.gguf$", root)
    shards = (sorted(glob.glob(f"{split[1]}-*-of-{split[2]}.gguf")) if split else [root])


PRIME_MB = int(os.environ.get("PRIME_MB", "0"))


def drop():
    if PRIME_MB:
        subprocess.run(["dd", "if=/dev/zero", "of=/dev/null", f"bs={PRIME_MB}M", "count=1"],
                       check=True, capture_output=True)
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def contender(spec):
    """(environment, binary) of a NUMAPIN argument: `VAR=VALUE:BINARY` or `BINARY`."""
    m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=([^:]*):(.+)$", spec)
    if not m:
        return dict(os.environ), spec
    return dict(os.environ, **{m[1]: m[2]}), m[3]


def timed(spec, argv):
    env, binary = contender(spec)
    drop()
    start = time.monotonic()
    out = subprocess.run([binary] + argv, check=True, capture_output=True, text=True,
                         env=env).stdout
    return time.monotonic() - start, out


def mechanisms(report):
    """io_uring requests and blocking calls of the load, summed over the classes."""
    classes = report.get("classes") or []
    return (sum(c.get("uring_reads", 0) for c in classes),
            sum(c.get("blocking_reads", 0) for c in classes))


def dd():
    drop()
    start = time.monotonic()
    for shard in shards:
        subprocess.run(["dd", f"if={shard}", "of=/dev/null", "bs=8M", "iflag=direct"],
                       check=True, capture_output=True)
    return time.monotonic() - start


wall = {b: [] for b in binaries}
load = {b: [] for b in binaries}
verify = {b: [] for b in binaries}
verify_dd = {b: [] for b in binaries}
for r in range(rounds):
    base = dd()
    order = binaries[r % len(binaries):] + binaries[:r % len(binaries)]
    line = [f"round {r + 1}: dd {base:.2f} s"]
    for b in order:
        seconds, out = timed(b, ["place", "--model", root, "--plan", "default",
                                 "--read", mode, "--json"])
        report = json.loads(out)
        if r == 0:
            ring, blocking = mechanisms(report)
            print(f"  {b}: {ring} io_uring reads, {blocking} blocking reads", flush=True)
        assert report["verified"], b
        wall[b].append(seconds / base)
        load[b].append(report["load_seconds"] / base)
        if report.get("verify_seconds") is not None:
            verify[b].append(report["verify_seconds"] / report["load_seconds"])
            verify_dd[b].append(report["verify_seconds"] / base)
        line.append(f"{b}: wall {seconds / base:.2f}x load {report['load_seconds'] / base:.2f}x"
                    + (f" verify {report['verify_seconds'] / base:.2f}x"
                       if report.get("verify_seconds") is not None else ""))
    print("; ".join(line), flush=True)


def med(xs):
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


for b in binaries:
    print(f"{b}: wall/dd {med(wall[b])}, load/dd {med(load[b])}, dd/load {med([1 / x for x in load[b]])}"
          + (f", verify/load {med(verify[b])}, verify/dd {med(verify_dd[b])}" if verify[b] else ""))
# Each contender against the first, within each round (the steadier A/B figure).
for b in binaries[1:]:
    pairs = [x / y for x, y in zip(load[b], load[binaries[0]])]
    print(f"{b} / {binaries[0]}: load {med(pairs)}")
