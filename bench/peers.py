"""Where the peers live: each in its own virtual environment, run as a child process.

A peer scenario (``peer.*``) is registered only when its virtual environment exists, so ``python -m
bench`` on a machine without the peer simply does not list it. The environment is named by a variable
(``SLING_VENV``, ``DLT_VENV``, ``QUIX_VENV``, ``BYTEWAX_VENV``) or defaults to a folder in the repository root
(``.venv-sling``...).
"""

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def peer_venv(variable: str, default: str) -> Path | None:
    """The virtual environment ``$variable`` names (else ``ROOT/default``), or None if it has no Python."""
    folder = Path(os.environ.get(variable) or ROOT / default)
    return folder if (folder / "bin" / "python").exists() else None


def run_peer(what: str, command: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run a peer's ``command`` (blocking, at most an hour) and return the JSON object it printed last.

    Raises ``RuntimeError`` naming ``what`` with the end of its stderr when it exits non-zero.
    """
    done = subprocess.run(list(command), env=env, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report
