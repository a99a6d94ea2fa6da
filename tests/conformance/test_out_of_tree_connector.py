"""An outside author's connector package, installed with pip, found and run by name.

``examples/faucet_example_connector`` is a package of its own (its own ``pyproject.toml``) that
registers a connector (``faucet.connectors``) and its conformance setup (``faucet.conformance``). The
test builds its wheel from the repository's sources (a wheel is a zip: no build backend, no network),
installs it with pip into a folder of its own and runs ``faucet conformance jsonl_example`` by name.
"""

import base64
import hashlib
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "faucet_example_connector"


def build_wheel(project: Path, into: Path) -> Path:
    """The wheel of ``project`` (pure Python, the packages its pyproject lists), built with zipfile."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    name, version = meta["name"].replace("-", "_"), meta["version"]
    info = f"{name}-{version}.dist-info"
    packages = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    files: dict[str, bytes] = {}
    for package in packages:
        for path in sorted((project / package).rglob("*.py")):
            files[path.relative_to(project).as_posix()] = path.read_bytes()
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: faucet-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    groups = meta.get("entry-points", {})
    files[f"{info}/entry_points.txt"] = "".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items()) + "\n"
        for group, entries in groups.items()
    ).encode()
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel = into / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


@pytest.fixture
def installed_example(tmp_path: Path) -> dict[str, str]:
    """The environment of a process that has the example's wheel installed: pip installs it into a
    folder of its own on ``PYTHONPATH`` (its entry points are found there), never into the shared
    environment, where other test processes import the example from its source folder meanwhile."""
    wheel = build_wheel(EXAMPLE, tmp_path)
    site = tmp_path / "site"
    pip("install", "--no-deps", "--no-index", "--target", str(site), str(wheel))
    return {**os.environ, "PYTHONPATH": str(site)}


def test_an_installed_out_of_tree_connector_passes_faucet_conformance_by_name(
    installed_example: dict[str, str],
) -> None:
    faucet = Path(sys.executable).with_name("faucet")
    result = subprocess.run(
        [str(faucet), "conformance", "jsonl_example"],
        capture_output=True,
        text=True,
        timeout=600,
        env=installed_example,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout
    assert "jsonl_example source" in table
    for check in ("config_schema", "bounded_memory", "capabilities", "no_panic", "scenarios"):
        assert f"{check:<32} pass" in table, table
