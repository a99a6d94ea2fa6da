"""What this process declared: every faucet sync and stream its definitions built, for ``faucet check``.

``faucet_assets`` and the component record each declaration here as they build it; ``faucet check``
imports a code location, then checks what was recorded. Nothing reads this while definitions load or
runs execute.
"""

import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from faucet_dagster.assets import FaucetSync
    from faucet_dagster.sensors import FaucetStream


@dataclass
class Declared:
    """The syncs and streams declared so far, in declaration order, by name."""

    syncs: dict[str, "FaucetSync"] = field(default_factory=dict)
    streams: dict[str, "FaucetStream"] = field(default_factory=dict)


DECLARED = Declared()
"""This process's declarations (a later one of the same name replaces an earlier one)."""


def import_code_location(module: str, directory: Path) -> ModuleType:
    """Import a code location's module from ``directory`` (Dagster's ``-m`` and ``-d``), which
    records its faucet declarations here."""
    sys.path.insert(0, str(directory.resolve()))
    return importlib.import_module(module)


def declaring_line() -> tuple[str, int] | None:
    """The file and line of the first caller outside faucet-dagster and Dagster: where a sync was
    declared in Python (``None`` when Dagster's own loader is the caller, as for a component)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".")[0] in ("dagster", "dagster_shared", "dagster_dg_cli"):
            return None
        if module.split(".")[0] != "faucet_dagster":
            return os.path.abspath(frame.f_code.co_filename), frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None
