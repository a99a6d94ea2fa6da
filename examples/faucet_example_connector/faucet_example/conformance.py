"""The conformance setup of ``jsonl_example``: what ``faucet conformance jsonl_example`` runs with.

The config factory asks for the ``tmp_path`` fixture, creates an empty folder and returns a
SourceSetup: ``add_rows`` writes one file per call (in name order, so the source reads them in the
order they were added), ``add_rows_before`` a file whose name sorts before every file written so far
(the generated scenarios then resume from every bookmark and expect its rows), ``add_malformed`` a
line that is not JSON, ``unreachable`` a folder that does not exist.
"""

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

from faucet_dagster.conformance import SourceSetup
from faucet_dagster.conformance.registry import ConformanceSetup
from faucet_dagster.conformance.setup import Row
from faucet_dagster.protocol import Role


def jsonl_source(tmp_path: Path) -> SourceSetup:
    folder = tmp_path / "jsonl"
    folder.mkdir()
    written = [0]

    def write(name: str, lines: Sequence[str]) -> None:
        (folder / name).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")

    async def add_rows(rows: Sequence[Row]) -> None:
        written[0] += 1
        await asyncio.to_thread(
            write, f"part-{written[0]:05d}.jsonl", [json.dumps(dict(row)) for row in rows]
        )

    async def add_malformed() -> None:
        await asyncio.to_thread(write, "part-99999.jsonl", ["{not json"])

    before = [0]

    async def add_rows_before(rows: Sequence[Row]) -> None:
        before[0] += 1  # "part-0-..." sorts before "part-00001...", each one before the last
        await asyncio.to_thread(
            write, f"part-0-{99_999 - before[0]:05d}.jsonl", [json.dumps(dict(row)) for row in rows]
        )

    return SourceSetup(
        {"folder": str(folder)},
        add_rows,
        unreachable={"folder": str(tmp_path / "missing")},
        add_malformed=add_malformed,
        add_rows_before=add_rows_before,
    )


SETUP = ConformanceSetup({Role.SOURCE: jsonl_source})
