"""The default progress display (`progress=None`): a tqdm bar over the model's bytes when
stderr is a terminal, nothing when it is not. Each case runs a child interpreter whose
stderr is a pseudo-terminal (or a pipe) and reads what it wrote there."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from conftest import Fixture, fixtures_dir

CHILD = r"""
import sys
import numapin
path, how = sys.argv[1], sys.argv[2]
ckpt = numapin.Checkpoint(path)
if how == "pack":
    placed = ckpt.pack("interleave:all")
else:
    placed = ckpt.place(experts="interleave:all", dense="interleave:all")
print("done", flush=True)
"""


def run_child(how: str, tty: bool) -> tuple[str, str]:
    """(stdout, stderr) of the child packing the sharded fixture; stderr a pty or a pipe."""
    fx = Fixture(fixtures_dir() / "st-sharded")
    args = [sys.executable, "-c", CHILD, str(fx.path), how]
    if not tty:
        out = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout, out.stderr
    try:
        master, slave = pty.openpty()
    except OSError as e:
        pytest.fail(f"no pseudo-terminal here ({e}): the bar cannot be tested")
    # A new pty is 0 columns wide, where tqdm draws nothing: give it 24 x 120.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every slave descriptor is closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    stdout = child.stdout.read()
    assert child.wait(timeout=120) == 0, seen.decode(errors="replace")
    return stdout, seen.decode(errors="replace")


@pytest.mark.parametrize("how", ["pack", "place"])
def test_a_terminal_gets_a_bar_that_ends_at_the_total(how):
    stdout, stderr = run_child(how, tty=True)
    assert "done" in stdout
    assert "numapin pack" in stderr, stderr
    # tqdm's last refresh of a closed bar shows 100% (n == total): the layers' reports
    # summed to the model's expert bytes.
    assert "100%" in stderr, stderr


@pytest.mark.parametrize("how", ["pack", "place"])
def test_a_pipe_gets_no_bar(how):
    stdout, stderr = run_child(how, tty=False)
    assert "done" in stdout
    assert "numapin pack" not in stderr and "%" not in stderr, stderr
