"""Standing checks: ruff and mypy --strict (the import layers are checked in test_layers.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["faucet_dagster", "connectors"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def test_ruff_lint() -> None:
    result = run("ruff", "check", *CHECKED, "tests", "bench", "example_project", "scripts")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = run("ruff", "format", "--check", *CHECKED, "tests", "bench", "example_project", "scripts")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_strict() -> None:
    result = run("mypy", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_strict_scripts() -> None:
    """The measuring scripts, strict too: they import helpers of the tests and the example project,
    whose own errors are not theirs (``follow-imports=silent``)."""
    scripts = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "scripts").glob("*.py"))
    result = run(
        "mypy",
        "--strict",
        "--follow-imports=silent",
        "--explicit-package-bases",
        *scripts,
        env={"MYPYPATH": os.pathsep.join(["connectors", "tests", "scripts", "example_project"])},
    )
    assert result.returncode == 0, result.stdout + result.stderr
