"""The PostgreSQL streaming sink against the real PostgreSQL of the test session.

Faults are injected at exact points: a connection whose COMMIT reaches the server but whose answer is
lost (a thin wrapper around the real connection), a server process terminated from another connection
just before COMMIT, and a read-back connection that cannot be opened.
"""

import asyncio
import random
import re
from collections.abc import Sequence
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from faucet_postgres.common import connect
from faucet_postgres.config import PostgresConnection, PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink, PostgresStreamingSinkSession

from faucet_dagster.protocol import (
    ConfigError,
    ConnectionFailed,
    Coverage,
    DataError,
    DomainCoverage,
    EpochId,
    EpochMismatch,
    FaucetError,
    Identities,
    LifecycleError,
    OrderingDomain,
    OwnershipLost,
    Role,
    SchemaError,
    SinkBatch,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
    get_connector,
)

STREAM = "orders_stream"
DOMAIN = OrderingDomain("nats", "orders", "", "2024-01-01T00:00:00Z#1", "nats.stream_sequence")
WORKER = WorkerIdentity("worker-a", 1)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def epoch(sequence: int, token: int = 1) -> EpochId:
    return EpochId(STREAM, sequence, token)


def batch(
    at: EpochId, rows: Sequence[dict[str, Any]], positions: Sequence[int], resource: str = "orders"
) -> SinkBatch:
    records = pa.RecordBatch.from_pylist(
        list(rows), schema=pa.schema([("id", pa.int64()), ("name", pa.string()), ("version", pa.int64())])
    )
    return SinkBatch(at, resource, DOMAIN, records, Identities([str(p) for p in positions]))


def covering(start: int | None, end: int) -> Coverage:
    return Coverage((DomainCoverage(DOMAIN, None if start is None else str(start), str(end)),))


def rows(ids: Sequence[int], version: int = 1) -> list[dict[str, Any]]:
    return [{"id": i, "name": f"n{i}v{version}", "version": version} for i in ids]


def sink_for(url: str, **settings: Any) -> PostgresStreamingSink:
    return PostgresStreamingSink(PostgresStreamingSinkConfig(url=url, table="orders", **settings))


def table(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT id, name, version FROM orders ORDER BY id, name").fetchall()


async def commit_one(
    session: PostgresStreamingSinkSession, at: EpochId, ids: Sequence[int], start: int | None, end: int
) -> None:
    await session.begin_epoch(at)
    await session.apply(at, batch(at, rows(ids), ids))
    await session.commit_epoch(at, covering(start, end))


def test_registered_as_the_streaming_sink_role_of_postgres(postgres_url: str) -> None:
    spec = get_connector("postgres")
    built = spec.streaming_sink({"url": postgres_url, "table": "orders"})
    capabilities = built.capabilities()
    assert Role.STREAMING_SINK in spec.roles
    assert capabilities.continuous_policies == {
        WritePolicy.APPEND,
        WritePolicy.UPSERT,
        WritePolicy.VERSIONED_UPSERT,
        WritePolicy.APPLY_CHANGES,
    }
    assert capabilities.atomic_watermark and capabilities.owner_fencing


def test_append_epochs_commit_rows_watermark_and_receipts(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            assert await session.last_committed() is None
            first = epoch(1)
            await session.begin_epoch(first)
            await session.apply(first, batch(first, rows([1, 2]), [1, 2]))
            await session.apply(first, batch(first, rows([3]), [3]))
            receipts = await session.commit_epoch(first, covering(None, 3))
            assert [(r.resource, r.rows_written, r.rows_skipped) for r in receipts] == [("orders", 3, 0)]
            assert receipts[0].details["first_position"] == "1"
            assert receipts[0].details["last_position"] == "3"
            assert receipts[0].details["table"] == "public.orders"
            state = await session.last_committed()
            assert state is not None
            assert state.epoch == first
            assert [(p.domain, p.value) for p in state.watermarks] == [(DOMAIN, "3")]
        finally:
            await session.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1, 2, 3]


def test_replayed_rows_at_or_below_the_watermark_are_dropped(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            await commit_one(session, epoch(1), range(1, 11), None, 10)
            # The epoch is replayed (its certificate was lost), and reads on further.
            replay = epoch(2)
            await session.begin_epoch(replay)
            await session.apply(replay, batch(replay, rows(range(5, 16)), range(5, 16)))
            receipts = await session.commit_epoch(replay, covering(None, 15))
            assert (receipts[0].rows_written, receipts[0].rows_skipped) == (5, 6)
            # A replay entirely at or below the watermark writes nothing and keeps the watermark.
            again = epoch(3)
            await session.begin_epoch(again)
            await session.apply(again, batch(again, rows(range(1, 16)), range(1, 16)))
            receipts = await session.commit_epoch(again, covering(None, 12))
            assert (receipts[0].rows_written, receipts[0].rows_skipped) == (0, 15)
            state = await session.last_committed()
            assert state is not None and [p.value for p in state.watermarks] == ["15"]
        finally:
            await session.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == list(range(1, 16))


def test_upsert_converges_on_replay(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.UPSERT, ("id",), WORKER)
        try:
            first = epoch(1)
            await session.begin_epoch(first)
            # The same key twice in one batch: the later row wins.
            await session.apply(first, batch(first, [*rows([1, 2]), *rows([1], version=2)], [1, 2, 3]))
            await session.commit_epoch(first, covering(None, 3))
            second = epoch(2)
            await session.begin_epoch(second)
            await session.apply(second, batch(second, rows([2, 3], version=3), [4, 5]))
            await session.commit_epoch(second, covering(3, 5))
        finally:
            await session.close_session()

    run(scenario())
    expected = [(1, "n1v2", 2), (2, "n2v3", 3), (3, "n3v3", 3)]
    assert table(postgres_url) == expected

    async def replay() -> None:
        # A new worker replays everything from the start under a new epoch: nothing changes.
        session = await sink_for(postgres_url).open(
            STREAM, WritePolicy.UPSERT, ("id",), WorkerIdentity("worker-b", 2)
        )
        try:
            at = epoch(3, token=2)
            await session.begin_epoch(at)
            await session.apply(at, batch(at, [*rows([1, 2]), *rows([1], version=2)], [1, 2, 3]))
            await session.apply(at, batch(at, rows([2, 3], version=3), [4, 5]))
            receipts = await session.commit_epoch(at, covering(None, 5))
            assert (receipts[0].rows_written, receipts[0].rows_skipped) == (0, 5)
        finally:
            await session.close_session()

    run(replay())
    assert table(postgres_url) == expected


def test_versioned_upsert_applies_only_newer_versions(postgres_url: str) -> None:
    async def scenario() -> None:
        sink = sink_for(postgres_url, version_column="version")
        session = await sink.open(STREAM, WritePolicy.VERSIONED_UPSERT, ("id",), WORKER)
        try:
            at = epoch(1)
            await session.begin_epoch(at)
            # Out of order within a batch and across batches: the highest version wins.
            await session.apply(at, batch(at, [*rows([1], version=5), *rows([1], version=3)], [1, 2]))
            await session.apply(at, batch(at, [*rows([1], version=4), *rows([2], version=1)], [3, 4]))
            await session.apply(at, batch(at, rows([2], version=2), [5]))
            await session.commit_epoch(at, covering(None, 5))
            with pytest.raises(DataError, match="null in key or version"):
                bad = epoch(2)
                await session.begin_epoch(bad)
                await session.apply(bad, batch(bad, [{"id": 9, "name": "x", "version": None}], [6]))
            await session.abort_epoch(epoch(2))
        finally:
            await session.close_session()

    run(scenario())
    assert table(postgres_url) == [(1, "n1v5", 5), (2, "n2v2", 2)]


def test_lifecycle_and_epoch_mismatches_are_refused(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            one, two = epoch(1), epoch(2)
            with pytest.raises(LifecycleError):
                await session.apply(one, batch(one, rows([1]), [1]))
            with pytest.raises(LifecycleError):
                await session.commit_epoch(one, covering(None, 1))
            with pytest.raises(LifecycleError):
                await session.abort_epoch(one)
            with pytest.raises(EpochMismatch):
                await session.begin_epoch(epoch(1, token=7))
            await session.begin_epoch(one)
            with pytest.raises(LifecycleError):
                await session.begin_epoch(one)
            with pytest.raises(EpochMismatch):
                await session.apply(one, batch(two, rows([1]), [1]))
            with pytest.raises(EpochMismatch):
                await session.apply(two, batch(two, rows([1]), [1]))
            with pytest.raises(EpochMismatch):
                await session.commit_epoch(two, covering(None, 1))
            await session.apply(one, batch(one, rows([1]), [1]))
            await session.commit_epoch(one, covering(None, 1))
            with pytest.raises(LifecycleError):
                await session.apply(one, batch(one, rows([2]), [2]))
            with pytest.raises(LifecycleError):
                await session.commit_epoch(one, covering(None, 1))
        finally:
            await session.close_session()
        with pytest.raises(LifecycleError):
            await session.begin_epoch(two)

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1]


def test_a_failed_apply_leaves_only_abort_and_writes_nothing(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await sink_for(postgres_url, create_tables=False).open(
            STREAM, WritePolicy.APPEND, (), WORKER
        )
        try:
            at = epoch(1)
            await session.begin_epoch(at)
            with pytest.raises(ConfigError, match="does not exist"):
                await session.apply(at, batch(at, rows([1]), [1]))
            await session.abort_epoch(at)
        finally:
            await session.close_session()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id bigint, name text)")
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            at = epoch(1)
            await session.begin_epoch(at)
            with pytest.raises(SchemaError, match="version"):
                await session.apply(at, batch(at, rows([2]), [2]))
            with pytest.raises(LifecycleError, match="abort"):
                await session.apply(at, batch(at, rows([3]), [3]))
            with pytest.raises(LifecycleError, match="abort"):
                await session.commit_epoch(at, covering(None, 2))
            await session.abort_epoch(at)
        finally:
            await session.close_session()

    run(scenario())
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (0,)


def answers_after_a_refusal_come_later(monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool], list[int]]:
    """Inject, once, after the first list returned holds True: the answers behind a refused
    statement's in a pipeline (those of the statements it left unexecuted) come in a later read, as on
    a loaded machine, whichever of psycopg's two reads (``pipeline_communicate`` while sending,
    ``fetch_many`` after) brought the refusal. The second list holds 1 once the injection took effect."""
    from psycopg import _pipeline_base, pq

    communicate, fetch_many = _pipeline_base.pipeline_communicate, _pipeline_base.fetch_many
    armed: list[bool] = []
    injected: list[int] = []
    later: list[Any] = []  # answers read from the server, handed on by the next read
    gap: list[bool] = []  # the next fetch finds nothing yet
    refusing: list[Any] = []  # the connection whose answers these are: no other reads them

    def refused(results: Any) -> bool:
        return bool(armed and results) and results[-1].status == pq.ExecStatus.FATAL_ERROR

    def communicate_in_pieces(pgconn: Any, commands: Any) -> Any:
        held = later if pgconn in refusing else []
        fetched = held + (yield from communicate(pgconn, commands))
        held.clear()
        for index, results in enumerate(fetched):
            if refused(results) and not injected:
                injected.append(1)
                refusing.append(pgconn)
                later.extend(fetched[index + 1 :])
                if not later:
                    gap.append(True)
                return fetched[: index + 1]
        return fetched

    def fetch_in_pieces(pgconn: Any) -> Any:
        if gap and pgconn in refusing:
            gap.clear()
            return []
        if later and pgconn in refusing:
            return later.pop(0)
        results = yield from fetch_many(pgconn)
        if refused(results) and not injected:
            injected.append(1)
            refusing.append(pgconn)
            gap.append(True)
        return results

    monkeypatch.setattr(_pipeline_base, "pipeline_communicate", communicate_in_pieces)
    monkeypatch.setattr(_pipeline_base, "fetch_many", fetch_in_pieces)
    return armed, injected


@pytest.mark.parametrize("answers", ["together", "in pieces"])
def test_a_stale_fencing_token_commits_nothing(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch, answers: str
) -> None:
    """The fence, the watermarks and the COMMIT go in one pipeline; "in pieces": the fence's refusal
    comes from the COMMIT and the statements it left unexecuted from the pipeline's exit
    (PipelineAborted), which is still the fence's refusal, never a lost connection."""
    armed, injected = answers_after_a_refusal_come_later(monkeypatch) if answers == "in pieces" else ([], [1])

    async def scenario() -> None:
        old = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        new: PostgresStreamingSinkSession | None = None
        try:
            stale = epoch(1)
            await old.begin_epoch(stale)
            await old.apply(stale, batch(stale, rows([1, 2]), [1, 2]))
            # A second worker takes the stream over: opening claims the fence with token 2.
            new = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("b", 2))
            armed.append(True)  # the commit's pipeline only
            with pytest.raises(OwnershipLost):
                await old.commit_epoch(stale, covering(None, 2))
            await old.abort_epoch(stale)
            assert await new.last_committed() is None
            current = epoch(1, token=2)
            await new.begin_epoch(current)
            await new.apply(current, batch(current, rows([1, 2]), [1, 2]))
            await new.commit_epoch(current, covering(None, 2))
            with pytest.raises(OwnershipLost):
                await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        finally:
            await old.close_session()
            if new is not None:
                await new.close_session()

    run(scenario())
    assert injected, "no refused statement was answered: the injection did not take effect"
    assert [row[0] for row in table(postgres_url)] == [1, 2]


def test_a_zombie_that_committed_before_is_fenced_after_its_successor_committed(postgres_url: str) -> None:
    """A session carries its watermarks from commit to commit without reading them again; a worker
    that lost the stream after committing is still refused, by the token that holds the fence."""

    async def scenario() -> None:
        old = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        new: PostgresStreamingSinkSession | None = None
        try:
            await commit_one(old, epoch(1), [1, 2], None, 2)
            new = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("b", 2))
            await commit_one(new, epoch(2, token=2), [3, 4], 2, 4)
            stale = epoch(2)
            await old.begin_epoch(stale)
            await old.apply(stale, batch(stale, rows([3, 4, 5]), [3, 4, 5]))
            with pytest.raises(OwnershipLost, match="fencing token 2"):
                await old.commit_epoch(stale, covering(2, 5))
            await old.abort_epoch(stale)
            # The successor's next epoch is not disturbed by the zombie's refused commit.
            await commit_one(new, epoch(3, token=2), [5], 4, 5)
        finally:
            await old.close_session()
            if new is not None:
                await new.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1, 2, 3, 4, 5]


def test_a_session_whose_watermarks_moved_behind_it_commits_nothing_and_reads_them_again(
    postgres_url: str,
) -> None:
    """The watermarks a session carries from its last commit are checked at its next commit: when
    another session (here one under the same fencing token) committed meanwhile, the epoch, whose
    replayed rows were judged by watermarks that had moved, is refused; the next epoch reads them
    again and drops what the other session wrote."""

    async def scenario() -> None:
        first = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        second: PostgresStreamingSinkSession | None = None
        try:
            await commit_one(first, epoch(1), [1, 2], None, 2)
            second = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
            await commit_one(second, epoch(2), [3, 4], 2, 4)
            behind = epoch(2)
            await first.begin_epoch(behind)
            await first.apply(behind, batch(behind, rows([3, 4, 5]), [3, 4, 5]))
            with pytest.raises(OwnershipLost, match="committed after this session last read"):
                await first.commit_epoch(behind, covering(2, 5))
            await first.abort_epoch(behind)
            again = epoch(3)
            await first.begin_epoch(again)
            await first.apply(again, batch(again, rows([3, 4, 5]), [3, 4, 5]))
            receipts = await first.commit_epoch(again, covering(2, 5))
            assert (receipts[0].rows_written, receipts[0].rows_skipped) == (1, 2)
        finally:
            await first.close_session()
            if second is not None:
                await second.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1, 2, 3, 4, 5]


def test_refused_rows_in_one_batch_of_many_leave_the_other_batches_applied(postgres_url: str) -> None:
    """Each batch's savepoint is released with the next one's creation: a batch bisected down to its
    refused row (rolled back to its own savepoints) keeps the batches before and after it."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigint CHECK (id <> 13), name text, version bigint)")

    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            at = epoch(1)
            await session.begin_epoch(at)
            for ids in ([1, 2], [3]):
                await session.apply(at, batch(at, rows(ids), ids))
            result = await session.apply_partial(at, batch(at, rows([11, 12, 13, 14]), [11, 12, 13, 14]))
            assert result.written == 3 and [row.index for row in result.rejected] == [2]
            for ids in ([21], [22, 23]):
                await session.apply(at, batch(at, rows(ids), ids))
            await session.commit_epoch(at, covering(None, 23))
            # The next epoch's savepoints start afresh; a refused row in apply fails that epoch only.
            failing = epoch(2)
            await session.begin_epoch(failing)
            await session.apply(failing, batch(failing, rows([24]), [24]))
            with pytest.raises(DataError, match=r"@ .*26"):  # named by its position
                await session.apply(failing, batch(failing, rows([25, 13]), [25, 26]))
            await session.abort_epoch(failing)
            await commit_one(session, epoch(2), [24, 25], 23, 25)
        finally:
            await session.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1, 2, 3, 11, 12, 14, 21, 22, 23, 24, 25]


def test_a_nested_value_json_cannot_hold_is_a_refused_row_and_the_others_commit(postgres_url: str) -> None:
    """A NaN in a nested value has no JSON form: the encoder refuses it (no SQLSTATE), and the row is
    refused by index for the dead-letter route as a row the server refused would be."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigint, doc jsonb)")
    doc = pa.struct([pa.field("raw", pa.binary()), pa.field("score", pa.float64())])
    records = pa.record_batch(
        {
            "id": pa.array([1, 2, 3], pa.int64()),
            "doc": pa.array([{"raw": b"\x01", "score": 0.5}, {"raw": b"", "score": float("nan")}, None], doc),
        }
    )

    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            at = epoch(1)
            await session.begin_epoch(at)
            result = await session.apply_partial(
                at, SinkBatch(at, "orders", DOMAIN, records, Identities(["1", "2", "3"]))
            )
            assert result.written == 2 and [row.index for row in result.rejected] == [1]
            assert "no JSON form: a NaN" in result.rejected[0].reason
            await session.commit_epoch(at, covering(None, 3))
        finally:
            await session.close_session()

    run(scenario())
    with psycopg.connect(postgres_url) as conn:
        landed = conn.execute("SELECT id, doc FROM orders ORDER BY id").fetchall()
    assert landed == [(1, {"raw": "\\x01", "score": 0.5}), (3, None)]


class _LostAnswer:
    """A real connection whose next COMMIT, once armed, reaches the server but its answer is lost
    (``after``), finds its server process terminated just before (``before``), or stalls before or
    after reaching the server (``stall_before``, ``stall_after``) until the caller gives up. Either way
    the client cannot know the outcome from what it saw."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], config: PostgresConnection) -> None:
        self._conn = conn
        self._config = config
        self.mode: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def commit(self) -> None:
        mode, self.mode = self.mode, None
        if mode == "stall_before":
            await asyncio.sleep(30)
        if mode == "before":
            killer = await connect(self._config, autocommit=True)
            try:
                await killer.execute("SELECT pg_terminate_backend(%s)", (self._conn.info.backend_pid,))
            finally:
                await killer.close()
            await asyncio.sleep(0.2)
        await self._conn.commit()
        if mode == "after":
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        if mode == "stall_after":
            await asyncio.sleep(30)


class _Faults:
    """A ``connect`` for the sink: session connections are wrapped; read-back connections can fail."""

    def __init__(self) -> None:
        self.sessions: list[_LostAnswer] = []
        self.refuse_probes = False

    async def __call__(self, config: PostgresConnection, *, autocommit: bool = False, **settings: Any) -> Any:
        if autocommit and self.refuse_probes:
            raise ConnectionFailed("the server cannot be reached (injected)", where="test")
        conn = await connect(config, autocommit=autocommit, **settings)
        if autocommit:
            return conn
        wrapped = _LostAnswer(conn, config)
        self.sessions.append(wrapped)
        return wrapped


def faulty_sink(url: str, faults: _Faults) -> PostgresStreamingSink:
    return PostgresStreamingSink(PostgresStreamingSinkConfig(url=url, table="orders"), connect=faults)


async def second_epoch_armed(session: PostgresStreamingSinkSession, faults: _Faults, mode: str) -> EpochId:
    """Commit epoch 1 (rows 1 and 2), begin epoch 2 with rows 3 and 4, and arm ``mode`` for its commit."""
    await commit_one(session, epoch(1), [1, 2], None, 2)
    at = epoch(2)
    await session.begin_epoch(at)
    await session.apply(at, batch(at, rows([3, 4]), [3, 4]))
    faults.sessions[-1].mode = mode
    return at


def test_a_commit_whose_answer_was_lost_is_resolved_as_committed(postgres_url: str) -> None:
    async def scenario() -> None:
        faults = _Faults()
        session = await faulty_sink(postgres_url, faults).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            at = await second_epoch_armed(session, faults, "after")
            receipts = await session.commit_epoch(at, covering(2, 4))
            assert receipts[0].rows_written == 2
            state = await session.last_committed()
            assert state is not None and state.epoch == at and state.watermarks[0].value == "4"
            # The session goes on, on a new connection.
            await commit_one(session, epoch(3), [5], 4, 5)
        finally:
            await session.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1, 2, 3, 4, 5]


def test_a_commit_whose_connection_died_before_it_is_resolved_as_not_committed(postgres_url: str) -> None:
    async def scenario() -> None:
        faults = _Faults()
        session = await faulty_sink(postgres_url, faults).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            at = await second_epoch_armed(session, faults, "before")
            with pytest.raises(ConnectionFailed, match="did not take effect"):
                await session.commit_epoch(at, covering(2, 4))
            await session.abort_epoch(at)
            state = await session.last_committed()
            assert state is not None and state.epoch == epoch(1)
            # The runner retries the epoch: it lands once.
            await commit_one(session, at, [3, 4], 2, 4)
        finally:
            await session.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1, 2, 3, 4]


def test_an_unresolvable_commit_is_uncertain_until_the_close(postgres_url: str) -> None:
    async def scenario() -> None:
        faults = _Faults()
        session = await faulty_sink(postgres_url, faults).open(STREAM, WritePolicy.APPEND, (), WORKER)
        at = epoch(1)
        await session.begin_epoch(at)
        await session.apply(at, batch(at, rows([1]), [1]))
        faults.sessions[-1].mode = "after"
        faults.refuse_probes = True
        with pytest.raises(UncertainOutcome):
            await session.commit_epoch(at, covering(None, 1))
        with pytest.raises(UncertainOutcome):
            await session.begin_epoch(epoch(2))
        with pytest.raises(UncertainOutcome):
            await session.close_session()
        # The outcome was in fact a commit: a later reader sees it, exactly once.
        reader = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            state = await reader.last_committed()
            assert state is not None and state.epoch == at
        finally:
            await reader.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1]


def test_close_with_outstanding_work(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        at = epoch(1)
        await session.begin_epoch(at)
        await session.apply(at, batch(at, rows([1, 2]), [1, 2]))
        # An active epoch with applied rows: nothing was committed, so nothing can land later.
        await session.close_session()
        await session.close_session()
        with pytest.raises(LifecycleError):
            await session.commit_epoch(at, covering(None, 2))

        # A commit interrupted while waiting for its answer: the close resolves it first.
        for mode in ("stall_before", "stall_after"):
            faults = _Faults()
            interrupted = await faulty_sink(postgres_url, faults).open(STREAM, WritePolicy.APPEND, (), WORKER)
            await interrupted.begin_epoch(at)
            await interrupted.apply(at, batch(at, rows([3]), [3]))
            faults.sessions[-1].mode = mode
            task = asyncio.ensure_future(interrupted.commit_epoch(at, covering(None, 3)))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            with pytest.raises(UncertainOutcome):
                await interrupted.begin_epoch(epoch(2))
            await interrupted.close_session()
            state = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
            try:
                committed = await state.last_committed()
            finally:
                await state.close_session()
            assert (committed is not None) == (mode == "stall_after")

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [3]


def test_abort_discards_the_epoch_with_the_table_it_created(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            at = epoch(1)
            await session.begin_epoch(at)
            await session.apply(at, batch(at, rows([1, 2]), [1, 2]))
            await session.abort_epoch(at)
            with psycopg.connect(postgres_url) as conn:
                assert conn.execute("SELECT to_regclass('public.orders')").fetchone() == (None,)
            assert await session.last_committed() is None
            # The same epoch again, after the abort: the table is created again and the rows land once.
            await commit_one(session, at, [1, 2], None, 2)
        finally:
            await session.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1, 2]


# -- zombies and locks ------------------------------------------------------------------------------


def test_the_session_timeouts_are_sent_in_milliseconds_and_zero_turns_them_off() -> None:
    config = PostgresStreamingSinkConfig(
        url="postgresql://localhost/db", lock_timeout=0.0004, idle_in_transaction_session_timeout=0
    )
    assert config.timeout_settings() == {"lock_timeout": "1", "idle_in_transaction_session_timeout": "0"}
    assert PostgresStreamingSinkConfig(url="postgresql://localhost/db").timeout_settings() == {
        "lock_timeout": "10000",
        "idle_in_transaction_session_timeout": "120000",
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", [WritePolicy.APPEND, WritePolicy.UPSERT])
def test_a_lock_held_by_another_workers_open_epoch_fails_the_epoch_retryably_within_lock_timeout(
    postgres_url: str, policy: WritePolicy
) -> None:
    """APPEND: the frozen owner's epoch created the table and never committed; UPSERT: it upserted
    key 1 of a table that exists. Either way its successor's epoch waits ``lock_timeout``, not for
    as long as the frozen connection lives, and fails retryably; once the lock is gone it commits."""
    key = ("id",) if policy.keyed else ()

    async def scenario() -> None:
        sink = sink_for(postgres_url, lock_timeout=0.5)
        zombie = await sink.open(STREAM, policy, key, WORKER)
        successor: PostgresStreamingSinkSession | None = None
        try:
            if policy is WritePolicy.UPSERT:
                await commit_one(zombie, epoch(1), [1], None, 1)
            frozen = epoch(2)
            await zombie.begin_epoch(frozen)
            await zombie.apply(frozen, batch(frozen, rows([1], version=2), [2]))
            successor = await sink.open(STREAM, policy, key, WorkerIdentity("worker-b", 2))
            at = epoch(2, token=2)
            await successor.begin_epoch(at)
            started = asyncio.get_running_loop().time()
            with pytest.raises(
                FaucetError, match=re.escape("waited 0.5 s (lock_timeout) for a lock")
            ) as caught:
                await asyncio.wait_for(successor.apply(at, batch(at, rows([1], version=3), [2])), 20)
            waited = asyncio.get_running_loop().time() - started
            assert caught.value.retryable and type(caught.value) is FaucetError
            assert 0.4 < waited < 10, waited
            # The frozen owner's connection is listed among the old transactions (its pid).
            assert re.search(r"pid \d+ \(idle in transaction, \d+ s\)", caught.value.message)
            await successor.abort_epoch(at)
            # The owner wakes up: its commit is fenced; its abort frees the lock; the retry commits.
            with pytest.raises(OwnershipLost):
                await zombie.commit_epoch(frozen, covering(1 if policy.keyed else None, 2))
            await zombie.abort_epoch(frozen)
            await asyncio.wait_for(commit_one(successor, at, [1, 5], 1 if policy.keyed else None, 2), 20)
        finally:
            await zombie.close_session()
            if successor is not None:
                await successor.close_session()

    run(scenario())
    assert table(postgres_url) == [(1, "n1v1", 1), (5, "n5v1", 1)]


@pytest.mark.timeout(60)
def test_the_server_ends_a_frozen_owners_idle_epoch_and_its_late_commit_fails(postgres_url: str) -> None:
    """The owner's epoch sits idle past ``idle_in_transaction_session_timeout``: the server ends its
    connection, freeing the table it was creating; the successor commits without waiting; the
    owner's late commit fails (nothing of its epoch lands) and its next epoch is fenced."""

    async def scenario() -> None:
        sink = sink_for(postgres_url, lock_timeout=5, idle_in_transaction_session_timeout=0.5)
        zombie = await sink.open(STREAM, WritePolicy.APPEND, (), WORKER)
        successor: PostgresStreamingSinkSession | None = None
        try:
            frozen = epoch(1)
            await zombie.begin_epoch(frozen)
            await zombie.apply(frozen, batch(frozen, rows([1, 2]), [1, 2]))
            await asyncio.sleep(1.5)  # frozen past the timeout
            successor = await sink.open(STREAM, WritePolicy.APPEND, (), WorkerIdentity("worker-b", 2))
            started = asyncio.get_running_loop().time()
            await asyncio.wait_for(commit_one(successor, epoch(1, token=2), [3, 4], None, 4), 20)
            assert asyncio.get_running_loop().time() - started < 4  # never waited for a lock
            with pytest.raises(ConnectionFailed, match="idle_in_transaction_session_timeout"):
                await zombie.commit_epoch(frozen, covering(None, 2))
            await zombie.abort_epoch(frozen)
            state = await zombie.last_committed()
            assert state is not None and state.epoch == epoch(1, token=2)
            # Its next epoch runs on a new connection, and the fence refuses it.
            again = epoch(2)
            await zombie.begin_epoch(again)
            await zombie.apply(again, batch(again, rows([5]), [5]))
            with pytest.raises(OwnershipLost):
                await zombie.commit_epoch(again, covering(4, 5))
            await zombie.abort_epoch(again)
        finally:
            await zombie.close_session()
            if successor is not None:
                await successor.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [3, 4]


def test_an_apply_cancelled_at_any_moment_is_aborted_and_the_next_epoch_commits(postgres_url: str) -> None:
    # A tick's deadline cancels the batch in flight (the pipeline's discard), then aborts the epoch.
    # Cancelled while its COPY is starting, psycopg leaves the connection in COPY IN mode, where a
    # ROLLBACK fails with "another command is already in progress": the abort must end the
    # transaction anyway. Many cancellations at small random moments hit that window.
    chooser = random.Random(17)

    async def scenario() -> None:
        session = await sink_for(postgres_url).open(STREAM, WritePolicy.APPEND, (), WORKER)
        try:
            await commit_one(session, epoch(1), [1], None, 1)
            for _ in range(80):
                at = epoch(2)
                await session.begin_epoch(at)
                task = asyncio.ensure_future(session.apply(at, batch(at, rows([2, 3]), [2, 3])))
                await asyncio.sleep(chooser.uniform(0, 0.02))
                task.cancel()
                await asyncio.wait([task])
                await session.abort_epoch(at)
            await commit_one(session, epoch(2), [2, 3], 1, 3)
        finally:
            await session.close_session()

    run(scenario())
    assert [row[0] for row in table(postgres_url)] == [1, 2, 3]
