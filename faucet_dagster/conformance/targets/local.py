"""The connectors that need no server: files (CSV) and SQL on SQLite."""

import asyncio
import csv
import sqlite3
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from faucet_dagster.conformance.setup import Row, SinkSetup, SourceSetup
from faucet_dagster.conformance.targets._common import (
    NAME_LIMIT,
    refused_rows,
    unreachable_url,
    with_mode,
)
from faucet_dagster.protocol import WritePolicy


def files_source(tmp_path: Path) -> SourceSetup:
    """CSV files ``part-NNNNN.csv`` in a fresh folder, one file per ``add_rows``, a shard per file."""
    folder = tmp_path / "files_source"
    folder.mkdir()
    written = [0]

    def write(name: str, lines: Sequence[Sequence[object]]) -> None:
        with open(folder / name, "w", newline="") as handle:
            csv.writer(handle).writerows([("id", "name"), *lines])

    write("part-00000.csv", [])  # an empty dataset is an empty file, not a missing one

    async def add_rows(rows: Sequence[Row]) -> None:
        written[0] += 1
        await asyncio.to_thread(
            write, f"part-{written[0]:05d}.csv", [(row["id"], row["name"]) for row in rows]
        )

    async def add_malformed() -> None:
        await asyncio.to_thread(write, "part-99999.csv", [("not-a-number", "bad")])

    before = [0]

    async def add_rows_before(rows: Sequence[Row]) -> None:
        # "part-0-..." sorts before "part-00000.csv", each one before the last.
        before[0] += 1
        await asyncio.to_thread(
            write, f"part-0-{99_999 - before[0]:05d}.csv", [(row["id"], row["name"]) for row in rows]
        )

    config = {
        "paths": [str(folder / "part-*.csv")],
        "column_types": {"id": "int64", "name": "string"},
        "block_size": 4096,
        "shard_by_file": True,
    }
    return SourceSetup(
        config,
        add_rows,
        unreachable={**config, "paths": [str(tmp_path / "missing" / "*.csv")]},
        add_malformed=add_malformed,
        add_rows_before=add_rows_before,
    )


def _sqlite(path: Path, *statements: str, rows: Sequence[Sequence[object]] = ()) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        found: list[tuple[Any, ...]] = []
        for statement in statements:
            found = (
                conn.executemany(statement, rows).fetchall() if rows else conn.execute(statement).fetchall()
            )
        return found


def _sqlite_rows(path: Path, table: str) -> list[dict[str, Any]]:
    """Every row and column of ``table`` (any spelling: quoted), none when it does not exist."""
    with sqlite3.connect(path) as conn:
        conn.row_factory = sqlite3.Row
        if not conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).fetchall():
            return []
        quoted = '"' + table.replace('"', '""') + '"'
        return [dict(row) for row in conn.execute(f"SELECT * FROM {quoted}")]


def sql_source(tmp_path: Path) -> SourceSetup:
    """A SQLite table ``items`` read in primary-key order, or by its cursor column ``updated``."""
    path = tmp_path / "source.db"
    _sqlite(path, "CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT, updated INTEGER)")
    tick = [0]

    async def add_rows(rows: Sequence[Row]) -> None:
        tick[0] += 1
        values = [(row["id"], row["name"], tick[0]) for row in rows]
        await asyncio.to_thread(_sqlite, path, "INSERT INTO items VALUES (?, ?, ?)", rows=values)

    async def update_rows(rows: Sequence[Row]) -> None:
        tick[0] += 1
        values = [(row["name"], tick[0], row["id"]) for row in rows]
        await asyncio.to_thread(
            _sqlite, path, "UPDATE items SET name = ?, updated = ? WHERE id = ?", rows=values
        )

    async def add_malformed() -> None:
        # SQLite keeps a BLOB in a TEXT column as it is: invalid UTF-8 has no Arrow string form.
        await asyncio.to_thread(_sqlite, path, "INSERT INTO items VALUES (999999, X'FFFE', 0)")

    config = {"url": f"sqlite:///{path}", "table": "items"}
    return SourceSetup(
        config,
        add_rows,
        unreachable={**config, "url": unreachable_url()},
        add_malformed=add_malformed,
        cursor_config={**config, "cursor": "updated"},
        update_rows=update_rows,
    )


def sql_sink(tmp_path: Path) -> SinkSetup:
    """A SQLite table ``items`` appended to (watermarked); ``items_keyed`` upserted by ``id``."""
    path = tmp_path / "sink.db"
    _sqlite(path, f"CREATE TABLE items (id INTEGER NOT NULL, name TEXT CHECK (length(name) <= {NAME_LIMIT}))")

    def reader(table: str) -> Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]]:
        async def read_back() -> list[dict[str, Any]]:
            if not await asyncio.to_thread(
                _sqlite, path, f"SELECT name FROM sqlite_master WHERE type = 'table' AND name = '{table}'"
            ):
                return []
            found = await asyncio.to_thread(_sqlite, path, f"SELECT id, name FROM {table}")
            return [{"id": row[0], "name": row[1]} for row in found]

        return read_back

    url = f"sqlite:///{path}"

    async def read_resource(table: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(_sqlite_rows, path, table)

    def write_to(table: str, policy: WritePolicy, key: tuple[str, ...]) -> dict[str, Any]:
        return {"url": url, "table": table, "mode": policy.value, "key": list(key)}

    return SinkSetup(
        {"url": url, "table": "items", "mode": "append"},
        reader("items"),
        read_resource=read_resource,
        write_to=write_to,
        keyed_config={"url": url, "table": "items_keyed", "mode": "upsert", "key": ["id"]},
        read_keyed=reader("items_keyed"),
        refused_rows=refused_rows(),
        unreachable={"url": unreachable_url(), "table": "items", "mode": "append"},
        configure=with_mode({"url": url, "table": "items"}),
    )
