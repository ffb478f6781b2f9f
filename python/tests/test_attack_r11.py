"""Hostile pass on round 11's drop-behind readahead guard, from Python: every dense
fixture placed with read_mode="drop-behind" (cold: its files evicted first) reports
drop-behind for every file it read, holds numpy's bytes in every tensor (numpy's
sidecars, not read through numapin), and leaves no page of its tensor data cached, counted
by the kernel (`mincore` on a private mapping of each file, which faults nothing in)."""

import ctypes
import gc
import mmap
import os

import numpy as np
import pytest

import gguf
import numapin
from test_whole import DENSE_FIXTURES, expert_layer, numpy_tensors

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
PAGE = mmap.PAGESIZE


def cached_pages(path):
    """The indices of the cached pages of the file at `path`, by `mincore`."""
    size = os.path.getsize(path)
    if size == 0:
        return []
    pages = (size + PAGE - 1) // PAGE
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        vec = ctypes.create_string_buffer(pages)
        if LIBC.mincore(ctypes.c_void_p(address), size, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore {path}")
        return [i for i, b in enumerate(vec.raw) if b & 1]
    finally:
        del address
        m.close()


def model_files(fx):
    """The fixture's tensor files, each with where its tensor data starts (read by the
    `safetensors` and `gguf` packages' own rules, not numapin's): the header before it is
    read when the checkpoint opens, not by the placement's read mode."""
    paths = sorted(fx.path.iterdir()) if fx.path.is_dir() else [fx.path]
    out = []
    for f in paths:
        if f.suffix == ".safetensors":
            with open(f, "rb") as h:
                out.append((f, 8 + int.from_bytes(h.read(8), "little")))
        elif f.suffix == ".gguf":
            out.append((f, gguf.GGUFReader(f).data_offset))
    assert out, fx.path
    return out


def evict(path):
    """Drops the file's pages from the page cache. Written back first: the fixtures are
    written just before the Python stage, and POSIX_FADV_DONTNEED leaves dirty pages
    (CI skipped 3 of 4 fixtures whose pages all stayed cached)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", DENSE_FIXTURES)
def test_a_cold_drop_behind_placement_is_numpys_and_leaves_nothing_cached(fixture, name):
    fx = fixture(name)
    files = model_files(fx)
    # gguf.GGUFReader maps the file (np.memmap) and may live on in a reference cycle; a
    # page mapped anywhere in this process is not dropped by POSIX_FADV_DONTNEED.
    gc.collect()
    for f, _ in files:
        evict(f)
    # Pages that stay cached anyway (mapped by another test's objects, or tmpfs) are not
    # this placement's: it must leave no other page of tensor data cached.
    before = {f.name: set(cached_pages(f)) for f, _ in files}
    tensor_pages = {f.name: {p for p in range((os.path.getsize(f) + PAGE - 1) // PAGE)
                             if p * PAGE >= start} for f, start in files}
    if all(tensor_pages[k] <= before[k] for k in before):
        maps = [line.split()[-1] for line in open("/proc/self/maps")
                if any(line.rstrip().endswith(str(f)) for f, _ in files)]
        pytest.skip(f"{name}: every page of its tensor data stays cached after eviction "
                    f"after a write-back (mapped in this process: {sorted(set(maps)) or 'no'}; "
                    f"else tmpfs)")
    model = numapin.Checkpoint(fx.path).place("split:all", "replicate:all",
                                              loader_threads=2, read_mode="drop-behind",
                                              progress=False)
    # What stays cached of the tensor data (the pages wholly past the header) that was
    # not cached before.
    left = {f.name: sorted(set(cached_pages(f)) & tensor_pages[f.name] - before[f.name])
            for f, start in files}
    report = model.report_dict()
    modes = {f["mode"] for m in report["measured"] for f in m["files"]}
    assert modes == {"drop-behind"}, (name, report["measured"])
    assert report["direct_io"] is None, report
    # Every tensor against numpy's bytes (the experts' slices of a merged tensor too).
    want = numpy_tensors(fx.root)
    assert sorted(model.tensors()) == sorted(want)
    for tensor, (shape, data) in want.items():
        cls, layer = expert_layer(model, tensor)
        try:
            v = model.tensor(tensor)
        except numapin.InvalidArgument:
            per = len(data) // shape[0]
            for e in range(shape[0]):
                pieces = [np.asarray(p).tobytes() for p in model.expert(layer, e).values()]
                assert data[e * per:(e + 1) * per] in pieces, (name, tensor, e)
            continue
        assert np.asarray(v).tobytes() == data, (name, tensor)
    # Read once and dropped behind: no page of tensor data stays cached.
    assert all(not pages for pages in left.values()), (name, left)
