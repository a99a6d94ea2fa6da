"""PostgreSQL: the bounded source and sink, the streaming sink, and the CDC source (a replication slot)."""

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from faucet_dagster.conformance.setup import ReadBlocked, Row, SinkSetup, SourceSetup
from faucet_dagster.conformance.targets._common import (
    NAME_LIMIT,
    refused_rows,
    run_setup,
    unreachable_url,
    with_mode,
)
from faucet_dagster.protocol import WritePolicy


async def _pg(url: str, *statements: str, rows: Sequence[Sequence[object]] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url) as conn:
        found: list[tuple[Any, ...]] = []
        for statement in statements:
            async with conn.cursor() as cursor:
                if rows:
                    await cursor.executemany(statement, rows)
                else:
                    await cursor.execute(statement)
                    found = await cursor.fetchall() if cursor.description else []
        return found


def _pg_rows(rows: Sequence[Row]) -> list[tuple[object, ...]]:
    return [(row["id"], row["name"]) for row in rows]


def _pg_reader(url: str, table: str) -> Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]]:
    async def read_back() -> list[dict[str, Any]]:
        if (await _pg(url, f"SELECT to_regclass('public.{table}') IS NOT NULL"))[0][0] is False:
            return []
        return [{"id": i, "name": name} for i, name in await _pg(url, f"SELECT id, name FROM public.{table}")]

    return read_back


async def _pg_table(url: str, table: str) -> list[dict[str, Any]]:
    """Every row and column of ``public.<table>`` (an identifier of any spelling), none when missing."""
    import psycopg
    from psycopg import sql
    from psycopg.rows import dict_row

    name = sql.Identifier("public", table)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = conn.cursor(row_factory=dict_row)
        await cursor.execute("SET lock_timeout = '200ms'")
        await cursor.execute("SELECT to_regclass(%s) IS NOT NULL AS present", (name.as_string(conn),))
        found = await cursor.fetchone()
        if not found or not found["present"]:
            return []
        try:
            await cursor.execute(sql.SQL("SELECT * FROM {}").format(name))
        except psycopg.errors.LockNotAvailable as exc:
            raise ReadBlocked(f"table {table!r} is locked: {exc}") from None
        return [dict(row) for row in await cursor.fetchall()]


def _pg_unreachable(table: str) -> dict[str, Any]:
    return {"url": unreachable_url(), "table": table, "connect_timeout": 2}


def postgres_source(postgres_url: str) -> SourceSetup:
    """A table ``items`` (id bigint primary key, name text, score numeric(10, 2), updated bigint) in a
    fresh database, read in key order, or by the cursor ``updated``."""
    run_setup(
        lambda: _pg(
            postgres_url,
            "CREATE TABLE items (id bigint PRIMARY KEY, name text, score numeric(10, 2), updated bigint)",
        )
    )
    tick = [0]

    async def add_rows(rows: Sequence[Row]) -> None:
        tick[0] += 1
        values = [(*pair, tick[0]) for pair in _pg_rows(rows)]
        await _pg(postgres_url, "INSERT INTO items (id, name, updated) VALUES (%s, %s, %s)", rows=values)

    async def update_rows(rows: Sequence[Row]) -> None:
        tick[0] += 1
        values = [(row["name"], tick[0], row["id"]) for row in rows]
        await _pg(postgres_url, "UPDATE items SET name = %s, updated = %s WHERE id = %s", rows=values)

    async def add_malformed() -> None:
        # numeric NaN has no decimal128 form.
        await _pg(postgres_url, "INSERT INTO items VALUES (999999, 'nan', 'NaN')")

    config = {"url": postgres_url, "table": "items", "fetch_rows": 100}
    return SourceSetup(
        config,
        add_rows,
        unreachable=_pg_unreachable("items"),
        add_malformed=add_malformed,
        cursor_config={**config, "cursor": "updated"},
        update_rows=update_rows,
    )


def postgres_sink(postgres_url: str) -> SinkSetup:
    """``items`` (name at most 40 characters) appended to with the watermark; ``items_keyed`` upserted."""
    run_setup(
        lambda: _pg(postgres_url, f"CREATE TABLE items (id bigint NOT NULL, name varchar({NAME_LIMIT}))")
    )

    def write_to(table: str, policy: WritePolicy, key: tuple[str, ...]) -> dict[str, Any]:
        return {"url": postgres_url, "table": table, "mode": policy.value, "key": list(key)}

    return SinkSetup(
        {"url": postgres_url, "table": "items", "mode": "append"},
        _pg_reader(postgres_url, "items"),
        read_resource=lambda table: _pg_table(postgres_url, table),
        write_to=write_to,
        keyed_config={"url": postgres_url, "table": "items_keyed", "mode": "upsert", "key": ["id"]},
        read_keyed=_pg_reader(postgres_url, "items_keyed"),
        refused_rows=refused_rows(),
        unreachable=_pg_unreachable("items"),
        configure=with_mode({"url": postgres_url, "table": "items"}),
    )


def postgres_streaming_sink(postgres_url: str) -> SinkSetup:
    """Epochs into a table per resource (``items``: name at most 40 characters), one transaction
    each, with schema evolution and ``version`` as the version column; ``stall`` stops the server
    processes of the database's open connections (a local server only)."""
    run_setup(
        lambda: _pg(postgres_url, f"CREATE TABLE items (id bigint NOT NULL, name varchar({NAME_LIMIT}))")
    )
    unreachable = _pg_unreachable("items")
    return SinkSetup(
        {"url": postgres_url, "schema_evolution": True, "version_column": "version"},
        _pg_reader(postgres_url, "items"),
        read_resource=lambda resource: _pg_table(postgres_url, resource),
        refused_rows=refused_rows(),
        unreachable=unreachable,
        stall=(lambda: _pg_stalled(postgres_url)) if _is_local(postgres_url) else None,
    )


def _is_local(url: str) -> bool:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")


@contextlib.asynccontextmanager
async def _pg_stalled(url: str) -> AsyncIterator[None]:
    """SIGSTOP the backend processes of every connection to ``url``'s database; SIGCONT on exit."""
    found = await _pg(
        url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    stopped: list[int] = []
    try:
        for (pid,) in found:
            if _process_name(int(pid)) == "postgres":  # never signal a process that is not the server's
                os.kill(int(pid), signal.SIGSTOP)
                stopped.append(int(pid))
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def postgres_cdc_source(postgres_url: str, unique_name: Callable[..., str]) -> SourceSetup:
    """Changes of ``public.items`` from a fresh slot; each ``add_rows`` is one source transaction."""
    from faucet_postgres import PostgresCdcConfig
    from faucet_postgres.cdc import setup_replication

    slot = unique_name("slot")
    config = {
        "url": postgres_url,
        "slot": slot,
        "publication": "faucet_conformance",
        "tables": ["public.items"],
        "heartbeat_interval": 0,
        "poll_interval": 0.1,
        "batch_rows": 10,
    }

    async def prepare() -> None:
        await _pg(postgres_url, "CREATE TABLE items (id bigint PRIMARY KEY, name text)")
        await setup_replication(PostgresCdcConfig.model_validate(config))

    run_setup(prepare)

    async def add_rows(rows: Sequence[Row]) -> None:
        await _pg(postgres_url, "INSERT INTO items (id, name) VALUES (%s, %s)", rows=_pg_rows(rows))

    async def update_rows(rows: Sequence[Row]) -> None:
        await _pg(
            postgres_url,
            "UPDATE items SET name = %s WHERE id = %s",
            rows=[(r["name"], r["id"]) for r in rows],
        )

    async def delete_rows(rows: Sequence[Row]) -> None:
        await _pg(postgres_url, "DELETE FROM items WHERE id = %s", rows=[(r["id"],) for r in rows])

    async def add_malformed() -> None:
        # A BC date has no Arrow form: the source must refuse it (DataError), never drop it.
        await _pg(postgres_url, "ALTER TABLE items ADD COLUMN IF NOT EXISTS born date")
        await _pg(
            postgres_url, "INSERT INTO items (id, name, born) VALUES (-1, 'malformed', '0044-03-15 BC')"
        )

    async def acknowledged() -> str:
        found = await _pg(
            postgres_url,
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{slot}'",
        )
        return str(found[0][0]) if found else ""

    async def cleanup() -> None:
        await _pg(
            postgres_url,
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            f"WHERE slot_name = '{slot}'",
        )

    async def advance_out_of_band() -> None:
        # What an operator (or a retention job) does to a slot holding too much WAL: the changes
        # committed so far are released unread.
        await _pg(
            postgres_url,
            f"SELECT pg_replication_slot_advance('{slot}', pg_current_wal_insert_lsn())",
        )

    return SourceSetup(
        config,
        add_rows,
        resources=("public.items",),
        unreachable={**config, "url": unreachable_url(), "connect_timeout": 2},
        add_malformed=add_malformed,
        acknowledged=acknowledged,
        cleanup=cleanup,
        make_unavailable=advance_out_of_band,
        update_rows=update_rows,
        delete_rows=delete_rows,
    )
