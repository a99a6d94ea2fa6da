"""The DuckDB connector (source, sink, streaming sink) on real DuckDB files in tmp_path.

Faults are injected at exact points: a child process that dies (``os._exit``) inside the transaction
of a page or an epoch, right before its COMMIT, or right after it, before its caller could record
anything; and another process holding the file (DuckDB's one-writer rule).
"""

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from faucet_duckdb.database import DatabaseLocked

from faucet_dagster.protocol import (
    CommitToken,
    ConfigError,
    Coverage,
    DataError,
    DomainCoverage,
    EpochId,
    Identities,
    JsonValue,
    OrderingDomain,
    OwnershipLost,
    Role,
    SchemaError,
    Sink,
    SinkBatch,
    Source,
    UnsupportedOperation,
    WorkerIdentity,
    WritePolicy,
    get_connector,
)

STREAM = "orders_stream"
DOMAIN = OrderingDomain("nats", "orders", "", "2024-01-01T00:00:00Z#1", "nats.stream_sequence")
WORKER = WorkerIdentity("worker-a", 1)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def query(path: Path, sql: str) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(path)) as conn:
        return conn.execute(sql).fetchall()


def orders(ids: Sequence[int], version: int = 1) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [{"id": i, "name": f"n{i}v{version}"} for i in ids],
        schema=pa.schema([("id", pa.int64()), ("name", pa.string())]),
    )


def sink(path: Path, **config: Any) -> Sink:
    return get_connector("duckdb").sink({"path": str(path), "table": "orders", **config})


def source(path: Path, **config: Any) -> Source:
    return get_connector("duckdb").source({"path": str(path), "table": "orders", **config})


async def write(target: Sink, *batches: pa.RecordBatch, token: int | None = None) -> int:
    try:
        written = 0
        for batch in batches:
            if token is None:
                written += await target.write_batch(batch)
            else:
                written += await target.write_batch_idempotent(batch, CommitToken(token))
        await target.finish()
        return written
    finally:
        await target.close()


async def read_all(src: Source, batch_size: int, bookmark: JsonValue = None) -> tuple[list[Any], JsonValue]:
    if bookmark is not None:
        src.apply_start_bookmark(bookmark)
    rows: list[Any] = []
    try:
        async for page in src.stream_pages({}, batch_size):
            assert isinstance(page.records, pa.RecordBatch)
            rows.extend(page.records.to_pylist())
            bookmark = page.bookmark
    finally:
        await src.close()
    return rows, bookmark


# -- registration and capabilities -------------------------------------------------------------------


def test_registered_with_three_roles_and_each_mode_declares_what_it_does(tmp_path: Path) -> None:
    spec = get_connector("duckdb")
    assert set(spec.roles) == {Role.SOURCE, Role.SINK, Role.STREAMING_SINK}
    path = tmp_path / "w.duckdb"
    append = sink(path).capabilities()
    assert append.bounded_policies == {WritePolicy.APPEND} and append.atomic_watermark
    assert append.partial_results and append.schema_evolution
    upsert = sink(path, mode="upsert", key=["id"]).capabilities()
    assert upsert.bounded_policies == {WritePolicy.UPSERT} and upsert.atomic_watermark
    replace = sink(path, mode="replace").capabilities()
    assert replace.bounded_policies == {WritePolicy.REPLACE} and not replace.atomic_watermark
    streaming = spec.streaming_sink({"path": str(path), "table": "orders"}).capabilities()
    assert streaming.continuous_policies == {WritePolicy.APPEND, WritePolicy.UPSERT}
    assert streaming.atomic_watermark and streaming.owner_fencing
    assert not path.exists(), "building and asking capabilities opened the file"


def test_configs_refuse_memory_databases_and_upsert_without_key(tmp_path: Path) -> None:
    spec = get_connector("duckdb")
    for path in (":memory:", ":memory:shared", "md:warehouse"):
        with pytest.raises(ConfigError):
            spec.sink({"path": path, "table": "orders"})
    with pytest.raises(ConfigError, match="key"):
        spec.sink({"path": str(tmp_path / "w.duckdb"), "table": "orders", "mode": "upsert"})


# -- the bounded sink ----------------------------------------------------------------------------------


def test_append_upsert_and_replace_land_what_they_say(tmp_path: Path) -> None:
    path = tmp_path / "w.duckdb"
    assert run(write(sink(path), orders([1, 2]), orders([3]))) == 3
    assert query(path, "SELECT id, name FROM orders ORDER BY id") == [(1, "n1v1"), (2, "n2v1"), (3, "n3v1")]
    # UPSERT creates its table with the key as primary key; within a batch the last row of a key wins.
    keyed = pa.concat_batches([orders([1, 2], version=1), orders([2], version=2)])
    run(write(sink(path, table="keyed", mode="upsert", key=["id"]), keyed, orders([1], version=3)))
    assert query(path, "SELECT id, name FROM keyed ORDER BY id") == [(1, "n1v3"), (2, "n2v2")]
    # REPLACE: the table holds exactly the last run's rows, swapped in at finish.
    run(write(sink(path, mode="replace"), orders([7, 8])))
    assert query(path, "SELECT id FROM orders ORDER BY id") == [(7,), (8,)]


def test_replace_leaves_the_old_table_whole_until_finish(tmp_path: Path) -> None:
    path = tmp_path / "w.duckdb"
    run(write(sink(path), orders([1, 2, 3])))

    async def scenario() -> None:
        target = sink(path, mode="replace")
        try:
            await target.write_batch(orders([10]))
            # Another connection of this process sees the old table until the swap.
            assert query(path, "SELECT count(*) FROM orders") == [(3,)]
            await target.finish()
        finally:
            await target.close()

    run(scenario())
    assert query(path, "SELECT id FROM orders") == [(10,)]
    assert not [t for (t,) in query(path, "SELECT table_name FROM duckdb_tables()") if "stage" in t]


def test_a_replayed_token_writes_nothing_and_replace_has_no_watermark(tmp_path: Path) -> None:
    path = tmp_path / "w.duckdb"
    assert run(write(sink(path), orders([1, 2]), token=5)) == 2
    assert run(write(sink(path), orders([1, 2]), token=5)) == 0  # the same page again
    assert run(write(sink(path), orders([3]), token=4)) == 0  # an older one
    assert run(write(sink(path), orders([3]), token=6)) == 1
    assert query(path, "SELECT id FROM orders ORDER BY id") == [(1,), (2,), (3,)]

    async def token_of(target: Sink) -> CommitToken | None:
        try:
            return await target.last_committed_token()
        finally:
            await target.close()

    assert run(token_of(sink(path))) == CommitToken(6)
    assert run(token_of(sink(path, sync_id="another"))) is None
    with pytest.raises(UnsupportedOperation):
        run(write(sink(path, mode="replace"), orders([1]), token=7))


def test_two_writers_of_one_sync_in_one_process_write_a_page_once(tmp_path: Path) -> None:
    """Two DuckDB transactions reading the same token conflict when both update it (one fails), or,
    when one committed after the other's snapshot but before its update, both advance it (a lost
    update): the writers of one file take turns, so the second sees the first's token and skips."""
    path = tmp_path / "w.duckdb"
    run(write(sink(path), orders([0]), token=0))

    async def race(round_: int) -> list[int]:
        rows = orders(range(round_ * 100, round_ * 100 + 100))
        return list(await asyncio.gather(*(write(sink(path), rows, token=round_) for _ in range(2))))

    for round_ in range(1, 11):
        assert sorted(run(race(round_))) == [0, 100], f"round {round_}"
    assert query(path, "SELECT count(*), count(DISTINCT id) FROM orders") == [(1001, 1001)]


def test_rows_the_table_refuses_are_reported_by_index_and_the_others_land(tmp_path: Path) -> None:
    path = tmp_path / "w.duckdb"
    query(path, "CREATE TABLE orders (id BIGINT PRIMARY KEY, name VARCHAR CHECK (length(name) <= 4))")
    batch = pa.RecordBatch.from_pylist(
        [
            {"id": 1, "name": "ok"},
            {"id": 2, "name": "too long"},
            {"id": 3, "name": "ok"},
            {"id": 4, "name": "x" * 9},
        ]
    )

    async def scenario() -> Any:
        target = sink(path)
        try:
            with pytest.raises(DataError, match="CHECK"):
                await target.write_batch(batch)
            return await target.write_batch_partial(batch)
        finally:
            await target.close()

    result = run(scenario())
    assert result.written == 2
    assert [row.index for row in result.rejected] == [1, 3]
    assert all("CHECK" in row.reason for row in result.rejected)
    assert query(path, "SELECT id FROM orders ORDER BY id") == [(1,), (3,)]


def test_schema_evolution_adds_a_column_or_refuses_it_and_a_lossy_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "w.duckdb"
    run(write(sink(path), orders([1])))
    wider = pa.RecordBatch.from_pylist([{"id": 2, "name": "b", "coupon": "c2"}])
    with pytest.raises(SchemaError, match="coupon"):
        run(write(sink(path, schema_evolution=False), wider))
    assert [c for (c,) in query(path, "SELECT column_name FROM (DESCRIBE orders)")] == ["id", "name"]
    run(write(sink(path), wider))
    assert query(path, "SELECT id, coupon FROM orders ORDER BY id") == [(1, None), (2, "c2")]
    rounded = pa.RecordBatch.from_pylist([{"id": 2.5, "name": "x"}])
    with pytest.raises(SchemaError, match=r"id \(DOUBLE into BIGINT\)"):
        run(write(sink(path), rounded))
    assert query(path, "SELECT count(*) FROM orders") == [(2,)]


def test_the_tables_columns_are_read_again_when_the_file_was_let_go_between_pages(tmp_path: Path) -> None:
    """The sink reads the table's columns at its first page and not again while its connection holds
    the file. Let go between two pages (``close``), the table can change (here ``name`` becomes an
    INTEGER column), so the next page is checked against it again: refused, naming the column, not
    cast."""
    path = tmp_path / "w.duckdb"

    async def scenario() -> None:
        target = sink(path)
        try:
            await target.write_batch_idempotent(orders([1]), CommitToken(1))
            await target.write_batch_idempotent(orders([2]), CommitToken(2))
            await target.close()
            query(path, "DROP TABLE orders; CREATE TABLE orders (id BIGINT, name INTEGER)")
            with pytest.raises(SchemaError, match=r"name \(VARCHAR into INTEGER\)"):
                await target.write_batch_idempotent(orders([3]), CommitToken(3))
        finally:
            await target.close()

    run(scenario())
    assert query(path, "SELECT count(*) FROM orders") == [(0,)]


# -- one writer per file --------------------------------------------------------------------------------


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """Another process (as a notebook would) holding a DuckDB file open until its stdin closes."""
    path = tmp_path / "held.duckdb"
    script = (
        "import duckdb, sys; c = duckdb.connect(sys.argv[1]); print('ready', flush=True); sys.stdin.read()"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield path, process
    finally:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(timeout=60)


def test_a_file_held_by_another_process_fails_naming_it_within_lock_timeout(
    holder: tuple[Path, subprocess.Popen[str]],
) -> None:
    path, process = holder
    started = time.monotonic()
    with pytest.raises(DatabaseLocked) as raised:
        run(write(sink(path, lock_timeout=1), orders([1])))
    waited = time.monotonic() - started
    assert raised.value.holder_pid == process.pid
    message = str(raised.value)
    assert f"process {process.pid}" in message and "duckdb.connect" in message  # its command line
    assert "one process at a time" in message and raised.value.retryable
    assert waited >= 1, "it did not wait lock_timeout for the holder"
    for role in (source(path, lock_timeout=0), get_connector("duckdb").streaming_sink({"path": str(path)})):
        with pytest.raises(DatabaseLocked):
            run(role.check())


def test_a_writer_waits_for_the_holder_to_let_go(holder: tuple[Path, subprocess.Popen[str]]) -> None:
    path, process = holder

    async def scenario() -> int:
        writing = asyncio.ensure_future(write(sink(path, lock_timeout=120), orders([1, 2])))
        await asyncio.sleep(0.5)
        assert not writing.done()
        assert process.stdin is not None
        process.stdin.close()  # the notebook closes
        return await writing

    assert run(scenario()) == 2
    assert query(path, "SELECT count(*) FROM orders") == [(2,)]


# -- crashes inside a page's transaction -------------------------------------------------------------

CRASHING_SINK = """
import asyncio, os, sys
import duckdb
import pyarrow as pa
from faucet_dagster.protocol import CommitToken, get_connector
from faucet_duckdb.sink import DuckDbSink

path, when = sys.argv[1], sys.argv[2]
first, count, token = (int(value) for value in sys.argv[3:6])


class Dying:
    # The real connection; the process dies right before (or right after) its COMMIT.
    def __init__(self, conn):
        self._conn = conn

    def commit(self):
        if when == "before-commit":
            os._exit(9)
        self._conn.commit()
        os._exit(9)

    def __getattr__(self, name):
        return getattr(self._conn, name)


config = DuckDbSink.config_model.model_validate({"path": path, "table": "orders"})
target = DuckDbSink(config, connect=lambda p: Dying(duckdb.connect(p)))
rows = pa.RecordBatch.from_pylist([{"id": i, "name": f"n{i}"} for i in range(first, first + count)])
asyncio.run(target.write_batch_idempotent(rows, CommitToken(token)))
"""


def die_writing(path: Path, when: str, first: int, count: int, token: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_SINK, str(path), when, str(first), str(count), str(token)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 9, done.stderr


@pytest.mark.parametrize("when", ["before-commit", "after-commit"])
def test_a_process_dying_around_a_pages_commit_loses_and_duplicates_nothing(
    tmp_path: Path, when: str
) -> None:
    path = tmp_path / "w.duckdb"
    assert run(write(sink(path), orders(range(1, 101)), token=100)) == 100
    die_writing(path, when, 101, 100, 200)
    landed = query(path, "SELECT count(*) FROM orders")[0][0]
    token = query(path, "SELECT token FROM _faucet_watermarks")[0][0]
    if when == "before-commit":
        # Rows and token were written in the transaction: neither survived the process.
        assert (landed, token) == (100, str(CommitToken(100)))
    else:
        assert (landed, token) == (200, str(CommitToken(200)))
    # The rerun replays the page with its token: written once, or skipped as already there.
    assert run(write(sink(path), orders(range(101, 201)), token=200)) == (
        100 if when == "before-commit" else 0
    )
    assert query(path, "SELECT count(*), count(DISTINCT id), min(id), max(id) FROM orders") == [
        (200, 200, 1, 200)
    ]


# -- the bounded source -----------------------------------------------------------------------------------


def test_keyset_pages_keep_ties_on_the_cursor_and_resume_after_the_bookmark(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    query(path, "CREATE TABLE orders (id BIGINT PRIMARY KEY, updated DATE, name VARCHAR)")
    query(
        path,
        "INSERT INTO orders SELECT i, DATE '2024-01-01' + (i // 250)::INTEGER, 'n' || i "
        "FROM range(1, 1001) t(i)",
    )
    rows, bookmark = run(read_all(source(path, cursor="updated"), 97))
    assert [row["id"] for row in rows] == list(range(1, 1001))
    assert set(rows[0]) == {"id", "updated", "name"}
    query(path, "INSERT INTO orders VALUES (1001, DATE '2030-01-01', 'late'), (0, NULL, 'no cursor')")
    more, _ = run(read_all(source(path, cursor="updated"), 97, bookmark))
    assert [row["id"] for row in more] == [1001]
    with pytest.raises(ConfigError, match="cursor or key changed"):
        run(read_all(source(path, cursor="name"), 10, bookmark))


def test_a_table_without_primary_key_needs_a_key_and_discover_lists_tables(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    query(path, "CREATE TABLE orders (id BIGINT, name VARCHAR); INSERT INTO orders VALUES (2, 'b'), (1, 'a')")
    with pytest.raises(ConfigError, match="no primary key"):
        run(read_all(source(path), 10))
    rows, _ = run(read_all(source(path, key=["id"], columns=["name"]), 10))
    assert rows == [{"name": "a"}, {"name": "b"}]

    async def discover() -> Any:
        src = source(path)
        try:
            return await src.discover()
        finally:
            await src.close()

    [found] = run(discover())
    assert found.name == "main.orders" and found.schema.names == ["id", "name"]
    with pytest.raises(ConfigError, match="not found"):
        run(read_all(source(tmp_path / "missing.duckdb"), 10))
    assert not (tmp_path / "missing.duckdb").exists()


# -- the streaming sink -------------------------------------------------------------------------------------


def epoch(sequence: int, token: int = 1) -> EpochId:
    return EpochId(STREAM, sequence, token)


def batch(at: EpochId, ids: Sequence[int], version: int = 1, **extra: Any) -> SinkBatch:
    rows = [{"id": i, "name": f"n{i}v{version}", **extra} for i in ids]
    return SinkBatch(
        at, "orders", DOMAIN, pa.RecordBatch.from_pylist(rows), Identities([str(i) for i in ids])
    )


def covering(start: int | None, end: int) -> Coverage:
    return Coverage((DomainCoverage(DOMAIN, None if start is None else str(start), str(end)),))


def streaming(path: Path, **config: Any) -> Any:
    return get_connector("duckdb").streaming_sink({"path": str(path), "table": "orders", **config})


async def commit(session: Any, at: EpochId, ids: Sequence[int], end: int, **extra: Any) -> Any:
    await session.begin_epoch(at)
    await session.apply(at, batch(at, ids, **extra))
    return await session.commit_epoch(at, covering(None, end))


def test_epochs_commit_rows_and_watermarks_and_a_replay_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "st.duckdb"

    async def scenario() -> None:
        session = await streaming(path).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            assert await session.last_committed() is None
            [receipt] = await commit(session, epoch(1), [1, 2, 3], 3)
            assert (receipt.rows_written, receipt.rows_skipped) == (3, 0)
            assert receipt.details["table"] == "main.orders" and receipt.details["last_position"] == "3"
            state = await session.last_committed()
            assert state.epoch == epoch(1) and [(p.domain, p.value) for p in state.watermarks] == [
                (DOMAIN, "3")
            ]
            # The epoch replayed with two more rows (a restart before its certificate).
            [again] = await commit(session, epoch(2), [1, 2, 3, 4, 5], 5)
            assert (again.rows_written, again.rows_skipped) == (2, 3)
        finally:
            await session.close_session()

    run(scenario())
    assert query(path, "SELECT id FROM orders ORDER BY id") == [(i,) for i in range(1, 6)]


def test_upsert_converges_and_evolution_adds_columns_in_the_epoch(tmp_path: Path) -> None:
    path = tmp_path / "st.duckdb"

    async def scenario() -> None:
        session = await streaming(path).open(STREAM, WritePolicy.UPSERT, ("id",), WORKER)
        try:
            await commit(session, epoch(1), [1, 2], 2)
            at = epoch(2)
            await session.begin_epoch(at)
            await session.apply(at, batch(at, [3], version=2, coupon="c"))
            await session.commit_epoch(at, covering(2, 3))
        finally:
            await session.close_session()
        fresh = await streaming(path, schema_evolution=False).open(
            STREAM, WritePolicy.UPSERT, ("id",), WORKER
        )
        try:
            at = epoch(3)
            await fresh.begin_epoch(at)
            await fresh.apply(at, batch(at, [4], extra_column=1))
            with pytest.raises(SchemaError, match="extra_column"):
                await fresh.commit_epoch(at, covering(3, 4))
            await fresh.abort_epoch(at)
        finally:
            await fresh.close_session()

    run(scenario())
    assert query(path, "SELECT id, name, coupon FROM orders ORDER BY id") == [
        (1, "n1v1", None),
        (2, "n2v1", None),
        (3, "n3v2", "c"),
    ]


def test_a_stale_fencing_token_commits_nothing(tmp_path: Path) -> None:
    path = tmp_path / "st.duckdb"

    async def scenario() -> None:
        old = await streaming(path).open(STREAM, WritePolicy.APPEND, (), WORKER)
        new = None
        try:
            stale = epoch(1)
            await old.begin_epoch(stale)
            await old.apply(stale, batch(stale, [1, 2]))
            new = await streaming(path).open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("b", 2))
            with pytest.raises(OwnershipLost, match="fencing token 2"):
                await old.commit_epoch(stale, covering(None, 2))
            await old.abort_epoch(stale)
            assert await new.last_committed() is None
            await commit(new, epoch(1, token=2), [1, 2], 2)
            with pytest.raises(OwnershipLost):
                await streaming(path).open(STREAM, WritePolicy.APPEND, (), WORKER)
        finally:
            await old.close_session()
            if new is not None:
                await new.close_session()

    run(scenario())
    assert query(path, "SELECT id FROM orders ORDER BY id") == [(1,), (2,)]


CRASHING_STREAM = """
import asyncio, os, sys
import duckdb
import pyarrow as pa
from faucet_dagster.protocol import (
    Coverage, DomainCoverage, EpochId, Identities, OrderingDomain, SinkBatch, WorkerIdentity, WritePolicy,
)
from faucet_duckdb.config import DuckDbStreamingSinkConfig
from faucet_duckdb.stream_sink import DuckDbStreamingSink

path, when, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
DOMAIN = OrderingDomain("nats", "orders", "", "2024-01-01T00:00:00Z#1", "nats.stream_sequence")


class Dying:
    def __init__(self, conn):
        self._conn = conn

    def commit(self):
        # Only the epoch's commit dies: the state tables' creation and the fence claim commit too.
        recorded = "SELECT count(*) FROM _faucet_stream_epochs WHERE epoch_sequence = 2"
        if self._conn.execute(recorded).fetchall()[0][0]:
            if when == "before-commit":
                os._exit(9)
            self._conn.commit()
            os._exit(9)
        self._conn.commit()

    def __getattr__(self, name):
        return getattr(self._conn, name)


async def main():
    config = DuckDbStreamingSinkConfig(path=path, table="orders")
    sink = DuckDbStreamingSink(config, connect=lambda p: Dying(duckdb.connect(p)))
    session = await sink.open("orders_stream", WritePolicy.APPEND, (), WorkerIdentity("w", 1))
    epoch = EpochId("orders_stream", 2, 1)
    ids = list(range(first, first + count))
    rows = pa.RecordBatch.from_pylist([{"id": i, "name": f"n{i}v1"} for i in ids])
    await session.begin_epoch(epoch)
    await session.apply(epoch, SinkBatch(epoch, "orders", DOMAIN, rows, Identities([str(i) for i in ids])))
    coverage = Coverage((DomainCoverage(DOMAIN, str(first - 1), str(first + count - 1)),))
    await session.commit_epoch(epoch, coverage)

asyncio.run(main())
"""


@pytest.mark.parametrize("when", ["before-commit", "after-commit"])
def test_a_worker_dying_around_an_epochs_commit_loses_and_duplicates_nothing(
    tmp_path: Path, when: str
) -> None:
    path = tmp_path / "st.duckdb"

    async def first() -> None:
        session = await streaming(path).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            await commit(session, epoch(1), list(range(1, 51)), 50)
        finally:
            await session.close_session()

    run(first())
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_STREAM, str(path), when, "51", "50"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 9, done.stderr

    async def restart() -> Any:
        session = await streaming(path).open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("w", 2))
        try:
            state = await session.last_committed()
            # The runner replays from its certificate (epoch 1): the whole of epoch 2 again.
            at = EpochId(STREAM, 2, 2)
            await session.begin_epoch(at)
            await session.apply(at, batch(at, list(range(51, 101))))
            [receipt] = await session.commit_epoch(at, covering(50, 100))
            return state, receipt
        finally:
            await session.close_session()

    state, receipt = run(restart())
    if when == "before-commit":
        assert state.epoch == epoch(1)
        assert (receipt.rows_written, receipt.rows_skipped) == (50, 0)
    else:
        assert state.epoch == EpochId(STREAM, 2, 1)
        assert (receipt.rows_written, receipt.rows_skipped) == (0, 50)
    assert query(path, "SELECT count(*), count(DISTINCT id), min(id), max(id) FROM orders") == [
        (100, 100, 1, 100)
    ]


def test_a_row_without_its_key_is_named_by_its_position(tmp_path: Path) -> None:
    path = tmp_path / "st.duckdb"

    async def scenario() -> None:
        session = await streaming(path).open(STREAM, WritePolicy.UPSERT, ("id",), WORKER)
        try:
            at = epoch(1)
            await session.begin_epoch(at)
            rows = pa.RecordBatch.from_pylist([{"id": 1, "name": "a"}, {"id": None, "name": "b"}])
            with pytest.raises(DataError) as raised:
                await session.apply(at, SinkBatch(at, "orders", DOMAIN, rows, Identities(["7", "8"])))
            assert "@ nats/orders" in str(raised.value) and "8" in str(raised.value)
            await session.abort_epoch(at)
        finally:
            await session.close_session()

    run(scenario())
    assert not os.path.exists(path) or not query(
        path, "SELECT * FROM duckdb_tables() WHERE table_name = 'orders'"
    )
