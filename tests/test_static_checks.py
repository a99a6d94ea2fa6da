"""Standing checks: ruff and mypy --strict (the import layers are checked in test_layers.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["faucet_dagster", "connectors"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False
    )


def test_ruff_lint() -> None:
    result = run("ruff", "check", *CHECKED, "tests", "bench", "example_project")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = run("ruff", "format", "--check", *CHECKED, "tests", "bench", "example_project")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_strict() -> None:
    result = run("mypy", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr
