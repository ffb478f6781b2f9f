"""Fixtures for numapin's Python tests: the checkpoint fixtures `cargo xtask fixtures`
writes (NUMAPIN_FIXTURES), with their independent expected bytes (numpy's, written by
xtask/fixtures/make_fixtures.py beside each model)."""

import json
import os
from pathlib import Path

import pytest


def fixtures_dir() -> Path:
    value = os.environ.get("NUMAPIN_FIXTURES")
    if not value:
        pytest.fail("NUMAPIN_FIXTURES is not set: `cargo xtask fixtures` writes them")
    path = Path(value)
    if not (path / "ggml_quant_sizes.json").is_file():
        pytest.fail(f"no fixtures in {path}: run `cargo xtask fixtures`")
    return path


def all_fixtures():
    """Every fixture directory with a fixture.json, by name."""
    value = os.environ.get("NUMAPIN_FIXTURES")
    if not value:
        return []
    return sorted(p.name for p in Path(value).iterdir() if (p / "fixture.json").is_file())


class Fixture:
    def __init__(self, root: Path):
        self.root = root
        self.meta = json.loads((root / "fixture.json").read_text())
        self.path = root / self.meta["path"]
        self.layers = {int(k): v for k, v in self.meta["layers"].items()}

    def expected(self, layer: int, expert: int, kind: str) -> bytes | None:
        f = self.root / "expected" / f"L{layer}_E{expert}.{kind}.bin"
        return f.read_bytes() if f.is_file() else None


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return fixtures_dir()


@pytest.fixture
def fixture(fixtures):
    def load(name: str) -> Fixture:
        return Fixture(fixtures / name)

    return load


def expect() -> str | None:
    """NUMAPIN_EXPECT: full, denied, unsupported, sys-nice; None: find out."""
    return os.environ.get("NUMAPIN_EXPECT") or None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One libtest-style line, so that xtask's container table counts pytest's tests."""
    stats = terminalreporter.stats
    passed = len(stats.get("passed", []))
    failed = len(stats.get("failed", [])) + len(stats.get("error", []))
    skipped = len(stats.get("skipped", []))
    for report in stats.get("skipped", []):
        terminalreporter.write_line(f"NOT RUN: {report.nodeid}")
    verdict = "ok" if failed == 0 and exitstatus == 0 else "FAILED"
    terminalreporter.write_line(
        f"test result: {verdict}. {passed} passed; {failed} failed; {skipped} ignored"
    )
