"""DuckDB: the bounded source and sink and the streaming sink, on a fresh file per check.

The battery's rows are added and read back through DuckDB's own Python client in this process (one
DuckDB database per file and process: these connections share it with the connector's, as a notebook
in the same process would).
"""

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from faucet_dagster.conformance.setup import Row, SinkSetup, SourceSetup
from faucet_dagster.conformance.targets._common import NAME_LIMIT, refused_rows, with_mode


def _duckdb(path: Path, *statements: str, rows: Sequence[Sequence[object]] = ()) -> list[tuple[Any, ...]]:
    import duckdb

    with duckdb.connect(str(path)) as conn:
        found: list[tuple[Any, ...]] = []
        for statement in statements:
            if rows:
                conn.executemany(statement, [list(row) for row in rows])
            else:
                found = conn.execute(statement).fetchall()
        return found


def _items(path: Path) -> None:
    _duckdb(
        path, f"CREATE TABLE items (id BIGINT NOT NULL, name VARCHAR CHECK (length(name) <= {NAME_LIMIT}))"
    )


def _read_all(path: Path, table: str) -> list[dict[str, Any]]:
    """Every row of ``table`` with every column (none when there is no such table)."""
    import duckdb

    with duckdb.connect(str(path)) as conn:
        exists = conn.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [table]).fetchall()
        if not exists[0][0]:
            return []
        quoted = '"' + table.replace('"', '""') + '"'
        cursor = conn.execute(f"SELECT * FROM {quoted}")
        names = [column[0] for column in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _reader(path: Path, table: str) -> Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]]:
    async def read_back() -> list[dict[str, Any]]:
        return await asyncio.to_thread(_read_all, path, table)

    return read_back


def _unreachable(tmp_path: Path, table: str) -> dict[str, Any]:
    """A file in a folder that is a file: it can never be opened."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    return {"path": str(blocker / "db.duckdb"), "table": table, "lock_timeout": 0}


def duckdb_source(tmp_path: Path) -> SourceSetup:
    """A table ``items`` (id BIGINT PRIMARY KEY, name VARCHAR) read in primary-key order."""
    path = tmp_path / "source.duckdb"
    _duckdb(path, "CREATE TABLE items (id BIGINT PRIMARY KEY, name VARCHAR)")

    async def add_rows(rows: Sequence[Row]) -> None:
        values = [(row["id"], row["name"]) for row in rows]
        await asyncio.to_thread(_duckdb, path, "INSERT INTO items VALUES (?, ?)", rows=values)

    config = {"path": str(path), "table": "items"}
    return SourceSetup(config, add_rows, unreachable=_unreachable(tmp_path, "items"))


def duckdb_sink(tmp_path: Path) -> SinkSetup:
    """``items`` (name at most 40 characters) appended to with the watermark; ``items_keyed`` upserted."""
    path = tmp_path / "sink.duckdb"
    _items(path)
    config = {"path": str(path), "table": "items"}
    return SinkSetup(
        {**config, "mode": "append"},
        _reader(path, "items"),
        keyed_config={**config, "table": "items_keyed", "mode": "upsert", "key": ["id"]},
        read_keyed=_reader(path, "items_keyed"),
        refused_rows=refused_rows(),
        unreachable={**_unreachable(tmp_path, "items"), "mode": "append"},
        configure=with_mode(config),
    )


def duckdb_streaming_sink(tmp_path: Path) -> SinkSetup:
    """Epochs into ``items`` (name at most 40 characters), one transaction each."""
    path = tmp_path / "stream.duckdb"
    _items(path)
    return SinkSetup(
        {"path": str(path), "table": "items"},
        _reader(path, "items"),
        refused_rows=refused_rows(),
        unreachable=_unreachable(tmp_path, "items"),
    )
