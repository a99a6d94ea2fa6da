"""Standing checks: ruff, mypy --strict, and the import layers of DESIGN.md section 1."""

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["faucet_dagster", "connectors"]
DAGSTER_FREE = ["protocol", "planner.py", "pipeline", "runner", "state", "testing", "conformance"]


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


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def python_files(*parts: str) -> list[Path]:
    found: list[Path] = []
    for part in parts:
        path = ROOT / part
        found.extend([path] if path.is_file() else sorted(path.rglob("*.py")))
    return found


def test_connectors_import_only_the_protocol_from_faucet_dagster() -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in python_files("connectors")
        for line, module in imported_modules(path)
        if (module.startswith("faucet_dagster") and not module.startswith("faucet_dagster.protocol"))
        or module.split(".")[0] == "dagster"
    ]
    assert not offences, "\n".join(offences)


def test_inner_layers_never_import_dagster() -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in python_files(*(f"faucet_dagster/{part}" for part in DAGSTER_FREE))
        for line, module in imported_modules(path)
        if module.split(".")[0] in ("dagster", "dagster_dg_cli", "dagster_shared")
    ]
    assert not offences, "\n".join(offences)


def test_protocol_imports_nothing_above_it() -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in python_files("faucet_dagster/protocol")
        for line, module in imported_modules(path)
        if module.startswith("faucet_dagster") and not module.startswith("faucet_dagster.protocol")
    ]
    assert not offences, "\n".join(offences)
