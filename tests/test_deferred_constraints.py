"""What the destination refuses at COMMIT (a DEFERRABLE constraint) is located, so the dead-letter
route gets the row and the stream goes on; the real PostgreSQL of the test session.

A deferred constraint is checked at COMMIT, which names no row: bisection under savepoints finds
nothing, and before, the epoch failed at every attempt (the stream halted for good, whatever the
policy). Now a table's deferrable unique, primary key and exclusion constraints are checked at each
batch (found by bisection at once), and any other deferred constraint a COMMIT refused (a foreign
key) from the epoch's next attempt on.
"""

import asyncio
from collections.abc import Sequence
from typing import Any

import psycopg
import pyarrow as pa
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink

from faucet_dagster.protocol import (
    Coverage,
    DomainCoverage,
    EpochId,
    FaucetError,
    Identities,
    OrderingDomain,
    SinkBatch,
    WorkerIdentity,
    WritePolicy,
)

DOMAIN = OrderingDomain("nats", "orders", "", "2024-01-01T00:00:00Z#1", "nats.stream_sequence")
WORKER = WorkerIdentity("worker-a", 1)


def batch(at: EpochId, rows: Sequence[tuple[int, int]]) -> SinkBatch:
    records = pa.RecordBatch.from_pylist(
        [{"id": key, "parent": parent} for key, parent in rows],
        schema=pa.schema([("id", pa.int64()), ("parent", pa.int64())]),
    )
    return SinkBatch(at, "orders", DOMAIN, records, Identities([str(key) for key, _ in rows]))


def coverage(end: int) -> Coverage:
    return Coverage((DomainCoverage(DOMAIN, None, str(end)),))


def ids(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT id, parent FROM orders ORDER BY id").fetchall()


def test_a_deferred_unique_violation_is_a_located_row_and_the_epoch_commits(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigint UNIQUE DEFERRABLE INITIALLY DEFERRED, parent bigint)")
        conn.execute("INSERT INTO orders VALUES (5, 0)")

    async def scenario() -> None:
        sink = PostgresStreamingSink(PostgresStreamingSinkConfig(url=postgres_url, table="orders"))
        session = await sink.open("s", WritePolicy.APPEND, (), WORKER)
        try:
            at = EpochId("s", 1, 1)
            await session.begin_epoch(at)
            result = await session.apply_partial(at, batch(at, [(4, 0), (5, 1), (6, 0)]))
            assert [row.index for row in result.rejected] == [1], "the duplicate is found at the batch"
            assert "orders_id_key" in result.rejected[0].reason
            await session.commit_epoch(at, coverage(6))
        finally:
            await session.close_session()

    asyncio.run(scenario())
    assert ids(postgres_url) == [(4, 0), (5, 0), (6, 0)]


def test_a_deferred_foreign_key_refusing_the_commit_is_located_on_the_epochs_next_attempt(
    postgres_url: str,
) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE parents (id bigint PRIMARY KEY)")
        conn.execute("INSERT INTO parents VALUES (1), (2)")
        conn.execute(
            "CREATE TABLE orders (id bigint, parent bigint REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
        )

    async def scenario() -> None:
        sink = PostgresStreamingSink(PostgresStreamingSinkConfig(url=postgres_url, table="orders"))
        session = await sink.open("s", WritePolicy.APPEND, (), WORKER)
        rows = [(1, 1), (2, 9), (3, 2)]
        try:
            at = EpochId("s", 1, 1)
            await session.begin_epoch(at)
            first = await session.apply_partial(at, batch(at, rows))
            assert not first.rejected  # the constraint waits for the COMMIT
            try:
                await session.commit_epoch(at, coverage(3))
            except FaucetError as refused:
                assert refused.retryable and "orders_parent_fkey" in refused.message
            else:
                raise AssertionError("the COMMIT was not refused")
            await session.abort_epoch(at)
            # The next attempt checks the constraint at the batch: the row is found, the rest commits.
            await session.begin_epoch(at)
            again = await session.apply_partial(at, batch(at, rows))
            assert [row.index for row in again.rejected] == [1]
            await session.commit_epoch(at, coverage(3))
        finally:
            await session.close_session()

    asyncio.run(scenario())
    assert ids(postgres_url) == [(1, 1), (3, 2)]
