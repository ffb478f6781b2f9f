"""Fixtures for the frameworks suite (`cargo xtask test-frameworks`): tiny random models
written by transformers' own `save_pretrained` (xtask/fixtures/make_frameworks.py) into
NUMAPIN_FRAMEWORK_FIXTURES."""

import json
import os
from pathlib import Path

import pytest


def fixtures_dir() -> Path | None:
    value = os.environ.get("NUMAPIN_FRAMEWORK_FIXTURES")
    return Path(value) if value else None


def families() -> list[str]:
    root = fixtures_dir()
    if root is None or not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "fixture.json").is_file())


@pytest.fixture(scope="session")
def framework_fixtures() -> Path:
    root = fixtures_dir()
    if root is None:
        pytest.fail("NUMAPIN_FRAMEWORK_FIXTURES is not set: `cargo xtask test-frameworks` writes them")
    return root


def meta(path: Path) -> dict:
    return json.loads((path / "fixture.json").read_text())
