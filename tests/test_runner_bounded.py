"""The bounded runner against real files, SQLite and the real PostgreSQL of the test session.

Each behaviour runs against every table sink: the SQL sink on SQLite (the embedded default), the SQL
sink on PostgreSQL, the PostgreSQL sink and the DuckDB sink. Faults are injected at exact points
only: ``on_page`` raising right after a page was committed, and a list-backed source emitting a
malformed JSON row at a known position.
"""

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import duckdb
import nats
import psycopg
import pytest
import sqlalchemy as sa

from faucet_dagster.planner import Mechanism
from faucet_dagster.protocol import (
    CommitToken,
    ConfigError,
    DataError,
    Delivery,
    Emits,
    FetchContext,
    IntegrityError,
    Operation,
    Ordering,
    Page,
    PlanError,
    PositionUnavailable,
    Records,
    Replay,
    SchemaError,
    Sink,
    Source,
    SourceCapabilities,
    WritePolicy,
    get_connector,
)
from faucet_dagster.protocol.config import ConnectorConfig
from faucet_dagster.runner.bounded import run_bounded_sync
from faucet_dagster.runner.bounded_values import BoundedSyncResult, PageReport, SyncSettings
from faucet_dagster.runner.sync import run_sync


def write_csv(path: Path, first: int, count: int, *, extra: str | None = None) -> Path:
    """Rows ``first .. first + count - 1`` of (id, name, amount[, extra])."""
    header = "id,name,amount" + (f",{extra}" if extra else "")
    lines = [header] + [
        f"{i},name {i},{i * 0.25}" + (f",{extra}-{i}" if extra else "") for i in range(first, first + count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def files_source(*patterns: Path | str, **config: Any) -> Source:
    return get_connector("files").source({"paths": [str(p) for p in patterns], **config})


@dataclass
class Target:
    """A destination database reached through one sink connector, and a way to look inside it."""

    name: str
    connector: str
    url: str

    def sink(self, table: str, **config: Any) -> Sink:
        where = {"path": self.url} if self.connector == "duckdb" else {"url": self.url}
        return get_connector(self.connector).sink({**where, "table": table, **config})

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        if self.connector == "duckdb":
            with duckdb.connect(self.url) as connection:
                return connection.execute(sql).fetchall()
        engine = sa.create_engine(self.url.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            with engine.connect() as connection:
                return [tuple(row) for row in connection.execute(sa.text(sql))]
        finally:
            engine.dispose()

    def ids(self, table: str) -> list[int]:
        return [row[0] for row in self.query(f'SELECT id FROM "{table}" ORDER BY id')]

    def columns(self, table: str) -> list[str]:
        if self.connector == "duckdb":
            return [row[0] for row in self.query(f'SELECT column_name FROM (DESCRIBE "{table}")')]
        engine = sa.create_engine(self.url.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            return [column["name"] for column in sa.inspect(engine).get_columns(table)]
        finally:
            engine.dispose()


TARGETS = ["sql-sqlite", "sql-postgres", "postgres", "duckdb"]


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "sql-sqlite":
        return Target(request.param, "sql", f"sqlite:///{tmp_path / 'warehouse.db'}")
    if request.param == "duckdb":
        return Target(request.param, "duckdb", str(tmp_path / "warehouse.duckdb"))
    url = request.getfixturevalue("postgres_url")
    return Target(request.param, "postgres" if request.param == "postgres" else "sql", url)


def sync(
    source: Source,
    sink: Sink,
    settings: SyncSettings | None = None,
    **kwargs: Any,
) -> BoundedSyncResult:
    """Run one sync to completion and close the connectors, as a caller does."""

    async def go() -> BoundedSyncResult:
        connectors = [source, sink, *([kwargs["dead_letter"]] if kwargs.get("dead_letter") else [])]
        try:
            return await run_bounded_sync(source, sink, settings or SyncSettings(), **kwargs)
        finally:
            for connector in connectors:
                await connector.close()

    return run_sync(go())


# -- append, resume, crash -------------------------------------------------------------------------


def test_append_then_resume_moves_only_new_rows(target: Target, tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 1, 1500)
    write_csv(tmp_path / "b.csv", 1501, 700)
    first = sync(files_source(tmp_path / "*.csv"), target.sink("orders"), SyncSettings(batch_size=400))
    assert (first.rows_read, first.rows_written, first.rows_skipped) == (2200, 2200, 0)
    assert first.pages == 6  # a.csv: 400, 400, 400, 300; b.csv: 400, 300 (a page never spans files)
    assert first.plan.delivery is Delivery.EFFECTIVELY_ONCE
    assert Mechanism.ATOMIC_WATERMARK in first.plan.mechanisms
    assert first.commit_token == CommitToken(2200)
    assert first.schema is not None and {"id", "name", "amount"} <= set(first.schema.names)

    write_csv(tmp_path / "c.csv", 2201, 333)
    second = sync(
        files_source(tmp_path / "*.csv"),
        target.sink("orders"),
        SyncSettings(batch_size=400),
        start_bookmark=first.bookmark,
        last_token=first.commit_token,
    )
    assert (second.rows_read, second.rows_written, second.pages) == (333, 333, 1)
    assert second.commit_token == CommitToken(2533)
    assert target.ids("orders") == list(range(1, 2534))

    third = sync(
        files_source(tmp_path / "*.csv"),
        target.sink("orders"),
        start_bookmark=second.bookmark,
        last_token=second.commit_token,
    )
    assert (third.rows_read, third.rows_written, third.pages) == (0, 0, 0)
    assert third.bookmark == second.bookmark and third.commit_token == second.commit_token


class Crash(Exception):
    """The process dying right after a page's commit, before the caller stored the result."""


def crash_after_page(number: int) -> Callable[[PageReport], None]:
    def on_page(report: PageReport) -> None:
        if report.number == number:
            raise Crash(f"crashed after committing page {number}")

    return on_page


@pytest.mark.parametrize("rerun_batch_size", [500, 300], ids=["same-pages", "other-pages"])
def test_crash_after_sink_commit_leaves_no_duplicate(
    target: Target, tmp_path: Path, rerun_batch_size: int
) -> None:
    write_csv(tmp_path / "a.csv", 1, 1000)
    done = sync(files_source(tmp_path / "*.csv"), target.sink("orders"), SyncSettings(batch_size=500))
    write_csv(tmp_path / "b.csv", 1001, 2000)

    # Pages 1 and 2 of b.csv (1000 rows) commit at the sink; the result is never stored.
    with pytest.raises(Crash):
        sync(
            files_source(tmp_path / "*.csv"),
            target.sink("orders"),
            SyncSettings(batch_size=500),
            start_bookmark=done.bookmark,
            last_token=done.commit_token,
            on_page=crash_after_page(2),
        )
    assert target.ids("orders") == list(range(1, 2001))

    # The next run is given what the caller stored (the bookmark and token of `done`); the sink holds
    # more, with the bookmark of its last page: the run resumes from that one, re-reading nothing.
    rerun = sync(
        files_source(tmp_path / "*.csv"),
        target.sink("orders"),
        SyncSettings(batch_size=rerun_batch_size),
        start_bookmark=done.bookmark,
        last_token=done.commit_token,
    )
    assert (rerun.rows_read, rerun.rows_skipped, rerun.rows_written) == (1000, 0, 1000)
    assert rerun.commit_token == CommitToken(3000)
    assert target.ids("orders") == list(range(1, 3001))


@pytest.mark.parametrize("where", ["before", "between", "after"])
def test_a_file_that_appears_before_between_or_after_the_files_read_is_read_once(
    target: Target, tmp_path: Path, where: str
) -> None:
    """The issue's case: a run commits pages and dies before its result is stored; a new file appears,
    sorting before, between or after the files read; the rerun, given the old bookmark and token,
    delivers every row once. The sink's watermark keeps each page's bookmark (the files by path, size
    and mtime): the rerun resumes from it, not from a count of rows, which a file sorting first
    shifts (150 rows lost and 150 duplicated before)."""
    write_csv(tmp_path / "b.csv", 1, 150)
    write_csv(tmp_path / "d.csv", 151, 150)
    with pytest.raises(Crash):
        sync(
            files_source(tmp_path / "*.csv"),
            target.sink("orders"),
            SyncSettings(batch_size=75),
            on_page=crash_after_page(4),
        )
    assert target.ids("orders") == list(range(1, 301))
    name = {"before": "a.csv", "between": "c.csv", "after": "e.csv"}[where]
    write_csv(tmp_path / name, 301, 150)
    rerun = sync(files_source(tmp_path / "*.csv"), target.sink("orders"), SyncSettings(batch_size=75))
    ids = target.ids("orders")
    lost, duplicated = set(range(1, 451)) - set(ids), len(ids) - len(set(ids))
    assert (len(lost), duplicated) == (0, 0), f"{len(lost)} rows lost, {duplicated} duplicated"
    assert ids == list(range(1, 451)), "every row once"
    assert (rerun.rows_read, rerun.rows_written, rerun.rows_skipped) == (150, 150, 0)
    assert rerun.plan.delivery is Delivery.EFFECTIVELY_ONCE
    again = sync(
        files_source(tmp_path / "*.csv"),
        target.sink("orders"),
        start_bookmark=rerun.bookmark,
        last_token=rerun.commit_token,
    )
    assert again.rows_read == 0


async def nats_request(url: str, subject: str, body: Mapping[str, Any] | None = None) -> None:
    client = await nats.connect(url)
    try:
        reply = await client.request(f"$JS.API.{subject}", json.dumps(body or {}).encode(), timeout=10)
        assert "error" not in json.loads(reply.data), reply.data
    finally:
        await client.close()


async def nats_publish(url: str, subject: str, ids: range) -> None:
    client = await nats.connect(url)
    try:
        jetstream = client.jetstream()
        for i in ids:
            await jetstream.publish(subject, json.dumps({"id": i, "name": f"n{i}"}).encode())
    finally:
        await client.close()


def test_nats_rerun_after_a_crash_resumes_by_position_when_retention_moved_the_start(
    target: Target, nats_url: str, unique_name: Callable[..., str]
) -> None:
    stream = unique_name("s")
    run_sync(nats_request(nats_url, f"STREAM.CREATE.{stream}", {"name": stream, "subjects": [f"{stream}.>"]}))
    run_sync(nats_publish(nats_url, f"{stream}.e", range(1, 301)))
    config = {"servers": [nats_url], "stream": stream, "columns": {"id": "int64 not null", "name": "string"}}

    def source() -> Source:
        return get_connector("nats").source(config)

    # Pages 1 and 2 (messages 1 to 200) commit at the sink; the result (bookmark, token) is lost.
    with pytest.raises(Crash):
        sync(source(), target.sink("events"), SyncSettings(batch_size=100), on_page=crash_after_page(2))
    assert target.ids("events") == list(range(1, 201))
    # Before the rerun the source changes: retention removes the 10 oldest, 20 new messages arrive.
    run_sync(nats_request(nats_url, f"STREAM.PURGE.{stream}", {"seq": 11}))
    run_sync(nats_publish(nats_url, f"{stream}.e", range(301, 321)))

    rerun = sync(source(), target.sink("events"), SyncSettings(batch_size=100))
    assert rerun.plan.delivery is Delivery.EFFECTIVELY_ONCE
    # The source's true state: every message it ever held, each exactly once (a row count would
    # have skipped 11 to 210 as "already written" and lost 201 to 210).
    assert target.ids("events") == list(range(1, 321))
    assert (rerun.rows_read, rerun.rows_written, rerun.commit_token) == (120, 120, CommitToken(320))

    # Retention past what the sink holds is loss: reported, and nothing past it is written.
    with pytest.raises(Crash):
        sync(source(), target.sink("late"), SyncSettings(batch_size=100), on_page=crash_after_page(1))
    assert target.ids("late") == list(range(11, 111))
    run_sync(nats_request(nats_url, f"STREAM.PURGE.{stream}", {"seq": 150}))
    with pytest.raises(PositionUnavailable, match="111 to 149"):
        sync(source(), target.sink("late"), SyncSettings(batch_size=100))
    assert target.ids("late") == list(range(11, 111))


def test_a_table_changed_between_crash_and_rerun_loses_nothing(target: Target, tmp_path: Path) -> None:
    database = tmp_path / "source.db"
    engine = sa.create_engine(f"sqlite:///{database}")
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE items (id INTEGER PRIMARY KEY, u INTEGER NOT NULL)"))
        connection.execute(
            sa.text("INSERT INTO items VALUES " + ",".join(f"({i}, {i})" for i in range(1, 301)))
        )

    def source() -> Source:
        return get_connector("sql").source({"url": f"sqlite:///{database}", "table": "items", "cursor": "u"})

    with pytest.raises(Crash):
        sync(source(), target.sink("items"), SyncSettings(batch_size=100), on_page=crash_after_page(2))
    # Before the rerun the table changes as tables do: a row read already is updated (its cursor
    # moves past the others) and one is deleted. A count of rows re-read no longer names a position.
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE items SET u = 1000 WHERE id = 50"))
        connection.execute(sa.text("DELETE FROM items WHERE id = 60"))
    engine.dispose()
    rerun = sync(source(), target.sink("items"), SyncSettings(batch_size=100))
    # Nothing the table holds is missing (a row count would have skipped id 201 as "written"): the
    # rerun resumes after the position the sink keeps with its watermark (u = 200), so it reads the
    # rows past it once, the updated row's new version (u = 1000) included, as any next run would.
    assert sorted(target.ids("items")) == sorted([*range(1, 301), 50])
    assert (rerun.rows_read, rerun.rows_skipped) == (101, 0)
    # A table source is not deterministic, but its pages' bookmarks name positions, which the sink
    # keeps: the plan promises effectively-once, and keeps it.
    assert rerun.plan.delivery is Delivery.EFFECTIVELY_ONCE


def test_sink_ahead_of_everything_reread_is_an_integrity_error(target: Target, tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 1, 100)
    sync(files_source(tmp_path / "a.csv"), target.sink("orders"))
    # A caller that lost its token but kept a bookmark past the data: the sink (at 100) is ahead.
    done = sync(files_source(tmp_path / "a.csv"), target.sink("other"))
    # The sink keeps the bookmark of what it holds: the run resumes from it, with nothing to read.
    resumed = sync(files_source(tmp_path / "a.csv"), target.sink("orders"), start_bookmark=done.bookmark)
    assert (resumed.rows_read, resumed.commit_token) == (0, CommitToken(100))
    # A deterministic source into a watermark that counts rows only cannot line the two up.
    counting = target.sink("orders")
    counting_caps = replace(counting.capabilities(), watermark_bookmark=False)
    counting.capabilities = lambda: counting_caps  # type: ignore[method-assign]
    source = files_source(tmp_path / "a.csv")
    source_caps = replace(source.capabilities(), deterministic=True)
    source.capabilities = lambda: source_caps  # type: ignore[method-assign]
    with pytest.raises(IntegrityError, match="ahead"):
        sync(source, counting, start_bookmark=done.bookmark)
    assert target.ids("orders") == list(range(1, 101))


def test_replace_reads_the_whole_snapshot_every_run(target: Target, tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 1, 250)
    first = sync(files_source(tmp_path / "a.csv"), target.sink("snapshot", mode="replace"))
    again = sync(
        files_source(tmp_path / "a.csv"),
        target.sink("snapshot", mode="replace"),
        start_bookmark=first.bookmark,
        last_token=first.commit_token,
    )
    assert again.plan.policy is WritePolicy.REPLACE
    assert (again.rows_read, again.rows_written) == (250, 250)
    assert target.ids("snapshot") == list(range(1, 251))


def test_replace_of_one_shard_is_refused(target: Target, tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 1, 10)
    with pytest.raises(ConfigError, match="every other shard"):
        sync(
            files_source(tmp_path / "*.csv", shard_by_file=True),
            target.sink("snapshot", mode="replace"),
            shard=str(tmp_path / "a.csv"),
        )


def test_shards_keep_their_own_watermarks_in_one_table(target: Target, tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 1, 300)
    write_csv(tmp_path / "b.csv", 301, 300)

    def shard_sync(name: str, **kwargs: Any) -> BoundedSyncResult:
        return sync(
            files_source(tmp_path / "*.csv", shard_by_file=True),
            target.sink("orders"),
            SyncSettings(batch_size=100),
            shard=str(tmp_path / name),
            **kwargs,
        )

    a = shard_sync("a.csv")
    assert a.plan.delivery is Delivery.EFFECTIVELY_ONCE and a.commit_token == CommitToken(300)
    # Shard b starts its own token sequence at 0 (one shared watermark, at 300, would skip it all),
    # crashes after its second page, and its rerun resumes after the 200 rows it committed.
    with pytest.raises(Crash):
        shard_sync("b.csv", on_page=crash_after_page(2))
    b = shard_sync("b.csv")
    assert (b.rows_read, b.rows_skipped, b.rows_written) == (100, 0, 100)
    assert b.commit_token == CommitToken(300)
    assert target.ids("orders") == list(range(1, 601))


# -- dead letters -----------------------------------------------------------------------------------


def test_rows_the_sink_rejects_go_to_the_dead_letter_route(target: Target, tmp_path: Path) -> None:
    # The destination refuses negative amounts; the source has two of them among 300 rows.
    write_csv(tmp_path / "a.csv", 1, 300)
    text = (tmp_path / "a.csv").read_text().replace("\n7,name 7,1.75\n", "\n7,name 7,-1.75\n")
    (tmp_path / "a.csv").write_text(text.replace("\n250,name 250,62.5\n", "\n250,name 250,-62.5\n"))
    target.query("SELECT 1")  # the database exists (SQLite: created on first connect)
    _create_checked_table(target)
    dead = target.sink("rejected")
    result = sync(
        files_source(tmp_path / "a.csv"),
        target.sink("orders"),
        SyncSettings(batch_size=100),
        dead_letter=dead,
        context={"run_id": "run-42"},
    )
    assert (result.rows_read, result.rows_written, result.rows_dead_lettered) == (300, 298, 2)
    assert Mechanism.ATOMIC_WATERMARK not in result.plan.mechanisms  # a dead-letter route rules it out
    assert target.ids("orders") == [i for i in range(1, 301) if i not in (7, 250)]
    rows = target.query('SELECT source, shard, run_id, page, "row", stage, reason, record FROM rejected')
    by_id = {json.loads(row[7])["id"]: row for row in rows}
    assert sorted(by_id) == [7, 250]
    source, shard, run_id, page, row, stage, reason, record = by_id[250]
    assert source.startswith("file://") and source.endswith("a.csv")
    assert (shard, run_id, page, row, stage) == (None, "run-42", 3, 49, "write")
    assert "amount" in reason.lower() or "check" in reason.lower()
    assert json.loads(record) == {"id": 250, "name": "name 250", "amount": -62.5}


def _create_checked_table(target: Target) -> None:
    statement = (
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, name TEXT, amount DOUBLE PRECISION CHECK (amount >= 0))"
    )
    if target.url.startswith("sqlite"):
        engine = sa.create_engine(target.url)
        with engine.begin() as connection:
            connection.execute(sa.text(statement.replace("DOUBLE PRECISION", "REAL")))
        engine.dispose()
    elif target.connector == "duckdb":
        target.query(statement)
    else:
        with psycopg.connect(target.url, autocommit=True) as connection:
            connection.execute(statement)


class ListSource(Source):
    """Fault injection: JSON pages from a list, one of them holding a malformed row at a known place."""

    connector_name = "list"
    config_model = ConnectorConfig

    def __init__(self, pages: Sequence[Sequence[Mapping[str, Any]]]) -> None:
        self.pages = pages

    def dataset_uri(self) -> str:
        return "list://test"

    def capabilities(self) -> SourceCapabilities:
        return SourceCapabilities(
            emits=Emits.ROWS,
            operations=frozenset({Operation.INSERT}),
            ordering=Ordering.STRICT_GLOBAL,
            replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
            bounded=True,
            continuous=False,
            deterministic=True,
        )

    async def fetch(self, ctx: FetchContext) -> Records:
        return [row for page in self.pages for row in page]

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        for number, page in enumerate(self.pages, start=1):
            yield Page(list(page), {"page": number})


def test_rows_that_do_not_convert_go_to_the_dead_letter_route(target: Target) -> None:
    good = [{"id": i, "name": f"n{i}", "amount": i * 1.5} for i in range(1, 6)]
    malformed: dict[str, Any] = {"id": 6, "name": "n6", "amount": {"not": "a number"}}
    pages: list[list[dict[str, Any]]] = [good[:3], [good[3], malformed, good[4]]]
    result = sync(ListSource(pages), target.sink("orders"), dead_letter=target.sink("rejected"))
    assert (result.rows_read, result.rows_written, result.rows_dead_lettered) == (6, 5, 1)
    assert result.bookmark == {"page": 2}
    assert target.ids("orders") == [1, 2, 3, 4, 5]
    [(page, row, stage, reason, record)] = target.query(
        'SELECT page, "row", stage, reason, record FROM rejected'
    )
    assert (page, row, stage) == (2, 1, "convert")
    assert "does not convert" in reason
    assert json.loads(record) == malformed


def test_without_a_dead_letter_route_a_malformed_row_fails_the_run(target: Target) -> None:
    pages: list[list[dict[str, Any]]] = [[{"id": 1, "amount": 1.5}, {"id": 2, "amount": {"x": 1}}]]
    with pytest.raises(DataError) as raised:
        sync(ListSource(pages), target.sink("orders"))
    assert "page 1" in str(raised.value) and "dead-letter" in str(raised.value)


def test_effectively_once_with_a_dead_letter_route_is_refused_before_anything_is_written(
    target: Target, tmp_path: Path
) -> None:
    write_csv(tmp_path / "a.csv", 1, 10)
    with pytest.raises(PlanError) as raised:
        sync(
            files_source(tmp_path / "a.csv"),
            target.sink("orders"),
            SyncSettings(delivery=Delivery.EFFECTIVELY_ONCE),
            dead_letter=target.sink("rejected"),
        )
    assert "effectively-once-unreachable" in raised.value.codes
    assert "dead-letter" in str(raised.value)
    tables = target.query(
        "SELECT name FROM sqlite_master WHERE type = 'table'"
        if target.url.startswith("sqlite")
        else "SELECT table_name FROM information_schema.tables"
        if target.connector == "duckdb"
        else "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
    )
    assert not [name for (name,) in tables if name in ("orders", "rejected")]


# -- schema evolution --------------------------------------------------------------------------------


def test_evolution_on_adds_the_new_column(target: Target, tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 1, 50)
    first = sync(files_source(tmp_path / "*.csv"), target.sink("orders"))
    write_csv(tmp_path / "b.csv", 51, 50, extra="coupon")
    second = sync(
        files_source(tmp_path / "*.csv"),
        target.sink("orders"),
        SyncSettings(evolve_schema=True),
        start_bookmark=first.bookmark,
        last_token=first.commit_token,
    )
    assert second.evolved_columns == ("coupon",)
    assert second.rows_written == 50
    assert "coupon" in target.columns("orders")
    rows = target.query("SELECT id, coupon FROM orders WHERE id IN (1, 51) ORDER BY id")
    assert rows == [(1, None), (51, "coupon-51")]


def test_evolution_off_refuses_the_new_column_with_a_schema_error(target: Target, tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", 1, 50)
    first = sync(files_source(tmp_path / "*.csv"), target.sink("orders"))
    write_csv(tmp_path / "b.csv", 51, 50, extra="coupon")
    with pytest.raises(SchemaError) as raised:
        sync(
            files_source(tmp_path / "*.csv"),
            target.sink("orders"),
            start_bookmark=first.bookmark,
            last_token=first.commit_token,
        )
    assert "coupon" in str(raised.value) and "evolution is off" in str(raised.value)
    assert "coupon" not in target.columns("orders")
    assert target.ids("orders") == list(range(1, 51))


# -- the sync bridge ----------------------------------------------------------------------------------


async def _answer() -> int:
    await asyncio.sleep(0)
    return 42


def test_run_sync_works_with_and_without_a_running_loop() -> None:
    assert run_sync(_answer()) == 42

    async def inside_a_loop() -> tuple[int, str]:
        # A synchronous caller running on a thread whose loop is busy (a notebook, an async host).
        return run_sync(_answer()), threading.current_thread().name

    value, thread = asyncio.run(inside_a_loop())
    assert value == 42 and thread == "MainThread"

    async def failing() -> None:
        raise DataError("boom", where="here")

    with pytest.raises(DataError, match="boom"):
        run_sync(failing())
