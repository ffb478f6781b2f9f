"""Memory and attach time of one whole model served by name (issue 35), measured:

    python attach_memory.py [DIR]   # writes DIR/model.safetensors (1 GiB, numpy) once

The placer places it with `serve_as`; 4 processes `numapin.attach` it by name: each
attach's time, the sum of PSS (`/proc/PID/smaps_rollup`) of all 5 at one moment, every
byte equal to safetensors.numpy's; then 4 processes placing their own copies, the same.
"""
import os
import subprocess
import sys
import time

import numpy as np
from safetensors.numpy import save_file

import numapin

CHILD = r"""
import sys, time, numpy as np, numapin
from safetensors.numpy import load_file
mode, name, path = sys.argv[1:4]
t = time.perf_counter()
if mode == "attach":
    m = numapin.attach(name)
else:
    m = numapin.Checkpoint(path).place("unplaced", "replicate:all", progress=False)
dt = time.perf_counter() - t
for k in m.tensors():   # touch every page
    np.asarray(m.tensor(k)).view(np.uint8).reshape(-1)[::4096].sum()
print(f"{dt:.4f}", flush=True)
sys.stdin.readline()    # the parent reads every PSS now
ref = load_file(path)
print(all(np.asarray(m.tensor(k)).tobytes() == v.tobytes() for k, v in ref.items()), flush=True)
"""


def pss_kib(pid="self"):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return int(next(l for l in f if l.startswith("Pss:")).split()[1])


def four(mode, name, path):
    ps = [subprocess.Popen([sys.executable, "-c", CHILD, mode, name, path],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
          for _ in range(4)]
    times = [p.stdout.readline().strip() for p in ps]
    pss = [pss_kib(p.pid) for p in ps] + [pss_kib()]
    for p in ps:
        p.stdin.write("\n")
        p.stdin.flush()
    equal = [p.stdout.readline().strip() for p in ps]
    for p in ps:
        p.wait()
    return times, pss, equal


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/numapin-attach-memory"
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "model.safetensors")
    if not os.path.exists(path):
        rng = np.random.default_rng(0)
        save_file({f"model.layers.{i}.mlp.w{j}.weight":
                   rng.integers(0, 255, (4096, 8192), dtype=np.uint8).view(np.float16)
                   for i in range(16) for j in range(2)}, path)
    gib = os.path.getsize(path) / 2**30
    name = f"attach-memory-{os.getpid()}"
    t = time.perf_counter()
    model = numapin.Checkpoint(path).place("unplaced", "replicate:all", progress=False,
                                           serve_as=name)
    print(f"placed {gib:.2f} GiB in {time.perf_counter() - t:.1f} s, serving {name!r}")
    times, pss, equal = four("attach", name, path)
    shared = sum(pss) / 2**20
    print(f"4 attaches: {times} s, bytes equal {equal}; PSS of all 5: {shared:.3f} GiB")
    del model
    times, pss, equal = four("place", name, path)
    own = sum(pss[:4]) / 2**20
    print(f"4 own copies: {times} s, bytes equal {equal}; PSS of the 4: {own:.3f} GiB")
    print(f"shared / one copy: {shared / gib:.3f}; own copies / shared: {own / shared:.2f}")


if __name__ == "__main__":
    main()
