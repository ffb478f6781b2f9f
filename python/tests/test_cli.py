"""The `numapin` console script the package installs: it runs the Rust command."""

import json
import subprocess
import sys
from pathlib import Path

import numapin
from numapin import _numapin


def script() -> Path:
    path = Path(sys.executable).parent / "numapin"
    assert path.is_file(), f"the package installed no console script at {path}"
    return path


def test_console_script_runs_probe_json():
    out = subprocess.run(
        [str(script()), "probe", "--json"], capture_output=True, text=True, check=True
    )
    report = json.loads(out.stdout)
    assert report["schema"] == 1
    max_map_count = int(Path("/proc/sys/vm/max_map_count").read_text())
    assert report["support"]["max_map_count"] == max_map_count
    # The same probe as the module's own function.
    assert report["support"]["possible_nodes"] == numapin.probe()["possible_nodes"]
    assert report["verdict"]


def test_console_script_refuses_a_bad_pid_by_name():
    for pid, status, says in [
        ("abc", 2, "a process id is decimal digits"),
        (str(2**64 - 1), 2, "larger than any process id"),
    ]:
        out = subprocess.run(
            [str(script()), "stat", pid], capture_output=True, text=True
        )
        assert out.returncode == status, out.stderr
        assert says in out.stderr
        assert "panicked" not in out.stderr


def test_main_returns_the_exit_status():
    assert _numapin.main(["numapin", "stat", "0"]) == 2
    assert _numapin.main(["numapin", "--version"]) == 0
