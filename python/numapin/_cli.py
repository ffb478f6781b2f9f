"""The `numapin` console script: the command the Rust binary is (probe, plan, place,
stat PID; docs/cli.md), run by the extension module's `main`."""

import signal
import sys

from ._numapin import main as _main


def main() -> int:
    """Runs `numapin` with this process's arguments; returns its exit status."""
    # Ctrl-C ends the command as it ends the binary: Python's handler would only set a
    # flag that the Rust code, with the GIL released, never reads.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # The command writes to the file descriptors directly: what Python buffered goes first.
    sys.stdout.flush()
    sys.stderr.flush()
    return _main(["numapin", *sys.argv[1:]])
