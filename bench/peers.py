"""Where the peers live, each run as a child process: in the project's environment or one of its own.

dlt is installed with the project's ``bench`` extra (``pip install -e ".[dev,bench]"``) and runs as a
child process of this environment's Python. Sling and the DuckDB command line it drives are installed
from ``bench/requirements-sling.txt`` into ``.venv-sling`` (its DuckDB extensions pin an older DuckDB
than the project's), quixstreams and bytewax into environments of their own (they pin other versions
of the project's dependencies). A peer scenario (``peer.*``) is registered only when its peer is
installed, so ``python -m bench`` on a machine without it simply does not list it. A variable
(``SLING_VENV``, ``DLT_VENV``, ``QUIX_VENV``, ``BYTEWAX_VENV``) names another environment.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def peer_venv(variable: str, default: str) -> Path | None:
    """The virtual environment ``$variable`` names (else ``ROOT/default``), or None if it has no Python."""
    folder = Path(os.environ.get(variable) or ROOT / default)
    return folder if (folder / "bin" / "python").exists() else None


def peer_python(variable: str, default: str, module: str) -> Path | None:
    """The Python that runs a peer importing ``module``: ``$variable``'s environment when set, else this
    one when it holds ``module`` (the project's ``bench`` extra), else ``ROOT/default``'s; None if
    none has it."""
    if os.environ.get(variable) is None and importlib.util.find_spec(module) is not None:
        return Path(sys.executable)
    venv = peer_venv(variable, default)
    return None if venv is None else venv / "bin" / "python"


def site_packages(venv: Path) -> Path | None:
    """The ``site-packages`` folder of the virtual environment ``venv`` (None: it has none)."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def sling_binary() -> Path | None:
    """Sling's binary in ``$SLING_VENV`` (default ``.venv-sling``); None when it is not installed."""
    venv = peer_venv("SLING_VENV", ".venv-sling")
    packages = None if venv is None else site_packages(venv)
    binary = None if packages is None else packages / "sling_linux_amd64" / "bin" / "sling-linux-amd64"
    return binary if binary is not None and binary.exists() else None


def sling_duckdb_cli() -> Path | None:
    """The DuckDB command line installed beside Sling (``bench/requirements-sling.txt``), or None."""
    binary = sling_binary()
    cli = None if binary is None else binary.parents[2] / "duckdb_cli" / "duckdb"
    return cli if cli is not None and cli.exists() else None


def sling_duckdb_env(home: Path) -> dict[str, str]:
    """The environment Sling needs for a DuckDB target, with ``home`` (a new folder) as its home: the
    DuckDB command line beside Sling (``DUCKDB_PATH``) and, in ``home``'s DuckDB extension folder, the
    extensions installed there, so that neither is downloaded at run time."""
    cli = sling_duckdb_cli()
    assert cli is not None
    for extension in cli.parents[1].glob("duckdb_extension_*/extensions/v*/*.duckdb_extension"):
        folder = home / ".duckdb" / "extensions" / extension.parent.name / "linux_amd64"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / extension.name).symlink_to(extension)
    return {**os.environ, "HOME": str(home), "DUCKDB_PATH": str(cli)}


def run_sling_csv(csv_path: str, connection: str, target: str, env: Mapping[str, str]) -> float:
    """Sling's full refresh of the CSV file at ``csv_path`` into table ``target`` of the connection
    named ``connection`` (defined in ``env``); the seconds of the subprocess, start to exit.

    Raises ``RuntimeError`` with the end of its stderr when it fails."""
    binary = sling_binary()
    assert binary is not None
    command = [str(binary), "run", "--src-stream", f"file://{csv_path}", "--tgt-conn", connection]
    command += ["--tgt-object", target, "--mode", "full-refresh"]
    start = time.perf_counter()
    done = subprocess.run(
        command,
        env={**env, "SLING_DISABLE_TELEMETRY": "true"},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"sling failed: {done.stderr[-2000:]}")
    return seconds


def run_peer(what: str, command: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run a peer's ``command`` (blocking, at most an hour) and return the JSON object it printed last.

    Raises ``RuntimeError`` naming ``what`` with the end of its stderr when it exits non-zero.
    """
    done = subprocess.run(list(command), env=env, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report
