"""The default progress display of `Checkpoint.pack`: a tqdm bar over the model's bytes
when tqdm is installed and stderr is a terminal; nothing otherwise."""

from __future__ import annotations

import sys
import threading


class _Bar:
    """Sums the per-layer reports into one bar (loader threads call it concurrently)."""

    def __init__(self, tqdm, total: int) -> None:
        self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="numapin pack")
        # Keyed by (store, layer): a whole-model placement's stores share the bar and
        # each number their layers from 0.
        self._done: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def __call__(self, progress) -> None:
        with self._lock:
            key = (progress.store, progress.layer)
            before = self._done.get(key, 0)
            self._done[key] = progress.bytes_done
            self._bar.update(progress.bytes_done - before)

    def close(self) -> None:
        self._bar.close()


def auto_bar(total: int):
    """A tqdm bar for `total` bytes, or None (no tqdm, or stderr is not a terminal)."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return _Bar(tqdm, total)
