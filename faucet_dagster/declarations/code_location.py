"""Where a declaration was made: the user's line that declared a sync or stream, and the code location a
command imports.

A declaration's asset references its declaring line (``dagster/code_references``), and a refused one
names it in the error; ``faucet check`` and ``faucet partitions refresh`` import a code location as
Dagster's code server would.
"""

import importlib
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import dagster as dg


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


def with_code_reference(spec: dg.AssetSpec, line: tuple[str, int] | None) -> dg.AssetSpec:
    """``spec`` referencing the line that declared it (``dagster/code_references``), unless it holds
    references already (a component's ``defs.yaml`` line, a translator's own)."""
    if line is None or "dagster/code_references" in spec.metadata:
        return spec
    with warnings.catch_warnings():
        # Dagster marks code references beta; its own components attach them the same way.
        warnings.simplefilter("ignore", dg.BetaWarning)
        reference = dg.LocalFileCodeReference(file_path=line[0], line_number=line[1])
        value = dg.CodeReferencesMetadataValue(code_references=[reference])
    return spec.merge_attributes(metadata={"dagster/code_references": value})


__all__ = ["declaring_line", "import_code_location", "with_code_reference"]
