"""PostgreSQL change data capture: change rows decoded by the CDC source against a raw peek-decode loop.

Both read the same slot, which neither consumes: the dataset inserted into a published table
``(id bigint, k text, payload jsonb)`` in transactions of 1,000 rows after the slot was created, once
per round (a slot made in round 1 would have round 5 decode everything rounds 1 to 4 wrote).

``cdc.raw_peek_decode`` is the floor any Python pgoutput reader pays: ``pg_logical_slot_peek_binary_changes``
through a server-side cursor, every message decoded by :func:`faucet_postgres.pgoutput.decode`.
``cdc.pg_source`` is the StreamSource: its session reads a copy of the slot in reads of 50,000 rows,
types every value into Arrow, and writes rows and transaction controls to a counting sink; timed from
opening the session to the last transaction end.

Replicated end to end, into a table ``(id bigint PRIMARY KEY, k text, payload jsonb)`` of the run's
second database (out of the source database's decoding, as a production replica), 50,000 change rows
at a time:

``cdc.raw_peek_decode_apply`` is the floor of a hand-written replicator: the peek-decode loop, and at
the first transaction end after each 50,000 rows a COPY of the rows' texts into a temporary table, one
``INSERT ... ON CONFLICT (id) DO UPDATE`` and a commit.
``cdc.apply_changes`` is the product: the continuous runner (lease, begin, read through the pipeline,
seal, the sink's APPLY_CHANGES commit, certificate in a SQLite state store, slot acknowledgement) from
a copy of the slot, timed from the first lease to the last acknowledgement.
"""

import asyncio
import time
from typing import Any

import psycopg
from faucet_postgres import pgoutput
from faucet_postgres.cdc import PostgresCdcSource, setup_replication
from faucet_postgres.cdc_config import PostgresCdcConfig
from psycopg import sql

from bench.context import BenchContext
from bench.registry import Measurement, scenario
from bench.replication import EPOCH_ROWS, drop_slot, peek, replicate
from bench.streams import seconds_per_step
from faucet_dagster.protocol import (
    CancelToken,
    Control,
    Identities,
    Membership,
    OrderingDomain,
    ReadLimits,
    Records,
    StreamRecordSink,
    TransactionEnd,
    WorkerIdentity,
    record_count,
)

TRANSACTION_ROWS = 1_000
FETCH_ROWS = 5_000


def _slot(ctx: BenchContext) -> PostgresCdcConfig:
    """A slot and publication over a table the dataset was inserted into afterwards (made once per round)."""

    def prepare() -> PostgresCdcConfig:
        table, slot = ctx.unique("cdc"), ctx.unique("cdc_slot")
        config = PostgresCdcConfig(
            url=ctx.postgres_url,
            slot=slot,
            publication=f"{slot}_pub",
            tables=(f"public.{table}",),
            heartbeat_interval=0,
        )
        with psycopg.connect(ctx.postgres_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, k text, payload jsonb)").format(
                    sql.Identifier(table)
                )
            )
        asyncio.run(setup_replication(config))
        rows = ctx.dataset()
        copy_sql = sql.SQL("COPY {} (id, k, payload) FROM STDIN").format(sql.Identifier(table))
        with psycopg.connect(ctx.postgres_url) as conn:
            for start in range(0, len(rows), TRANSACTION_ROWS):
                with conn.cursor().copy(copy_sql) as copy:
                    for row in rows[start : start + TRANSACTION_ROWS]:
                        copy.write_row(row)
                conn.commit()
        return config

    return ctx.per_round("cdc_slot", prepare, lambda earlier: drop_slot(ctx, earlier.slot))


@scenario("cdc.raw_peek_decode")
def raw_peek_decode(ctx: BenchContext) -> Measurement:
    """pg_logical_slot_peek_binary_changes through a server-side cursor, every pgoutput message decoded."""
    config = _slot(ctx)

    async def run() -> tuple[int, float]:
        inserts = 0
        async with await psycopg.AsyncConnection.connect(ctx.postgres_url) as conn:
            start = time.perf_counter()
            cursor = await peek(conn, config)
            while batch := await cursor.fetchmany(FETCH_ROWS):
                for (data,) in batch:
                    if isinstance(pgoutput.decode(data), pgoutput.Insert):
                        inserts += 1
            return inserts, time.perf_counter() - start

    inserts, seconds = asyncio.run(run())
    if inserts != ctx.rows:
        raise RuntimeError(f"decoded {inserts} inserts, expected {ctx.rows}")
    return Measurement(inserts, seconds)


class _Count(StreamRecordSink):
    """Counts rows and notes when the last transaction ended."""

    def __init__(self) -> None:
        self.rows = 0
        self.transactions = 0
        self.last_end = 0.0

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        self.rows += record_count(rows)

    async def control(self, control: Control) -> None:
        if isinstance(control, TransactionEnd):
            self.transactions += 1
            self.last_end = time.perf_counter()


@scenario("cdc.pg_source", baseline="cdc.raw_peek_decode")
def pg_source(ctx: BenchContext) -> Measurement:
    """The CDC StreamSource: typed change rows and transaction controls, reads of 50,000 rows."""
    config = _slot(ctx)

    async def run() -> tuple[_Count, float]:
        counted = _Count()
        start = time.perf_counter()
        session = await PostgresCdcSource(config).open((), (), Membership(), WorkerIdentity("bench", 1))
        limits = ReadLimits(records=EPOCH_ROWS, idle=0.2)
        try:
            while not (await session.read(counted, limits, CancelToken())).empty:
                pass
        finally:
            await session.close()
        return counted, counted.last_end - start

    counted, seconds = asyncio.run(run())
    # Complete transactions reach the sink in groups (one TransactionEnd per group), so ends are no
    # count of the source's transactions: at most one per transaction, at least one per read.
    transactions = -(-ctx.rows // TRANSACTION_ROWS)
    if counted.rows != ctx.rows or not 1 <= counted.transactions <= transactions:
        raise RuntimeError(
            f"read {counted.rows} rows with {counted.transactions} transaction ends, expected {ctx.rows} "
            f"rows with 1 to {transactions}"
        )
    return Measurement(counted.rows, seconds, {"transaction_ends": counted.transactions})


def _replica(ctx: BenchContext) -> str:
    """A new, empty replica table for the dataset's rows, in the replica database (not timed)."""
    table = ctx.unique("cdc_replica")
    with psycopg.connect(ctx.replica_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, k text, payload jsonb)").format(
                sql.Identifier(table)
            )
        )
    return table


def _check_replica(ctx: BenchContext, table: str) -> None:
    with psycopg.connect(ctx.replica_url) as conn:
        count, last = conn.execute(
            sql.SQL("SELECT count(*), max(id) FROM {}").format(sql.Identifier(table))
        ).fetchone() or (0, None)
    if (count, last) != (ctx.rows, ctx.rows - 1):
        raise RuntimeError(
            f"{table} holds {count} rows up to {last}, expected {ctx.rows} up to {ctx.rows - 1}"
        )


@scenario("cdc.raw_peek_decode_apply")
def raw_peek_decode_apply(ctx: BenchContext) -> Measurement:
    """Peek, decode, and per 50,000 rows COPY into a temp table, INSERT ... ON CONFLICT by key, commit."""
    config, table = _slot(ctx), _replica(ctx)
    target = sql.Identifier(table)

    async def apply(writer: psycopg.AsyncConnection[Any], rows: list[tuple[str | None, ...]]) -> None:
        async with writer.transaction():
            await writer.execute(
                sql.SQL("CREATE TEMP TABLE stage ON COMMIT DROP AS SELECT * FROM {} WITH NO DATA").format(
                    target
                )
            )
            async with (
                writer.cursor() as cursor,
                cursor.copy("COPY stage (id, k, payload) FROM STDIN") as copy,
            ):
                for row in rows:
                    await copy.write_row(row)
            await writer.execute(
                sql.SQL(
                    "INSERT INTO {} SELECT DISTINCT ON (id) * FROM stage ORDER BY id "
                    "ON CONFLICT (id) DO UPDATE SET k = EXCLUDED.k, payload = EXCLUDED.payload"
                ).format(target)
            )

    async def run() -> tuple[int, float]:
        applied = 0
        async with (
            await psycopg.AsyncConnection.connect(ctx.postgres_url) as reader,
            await psycopg.AsyncConnection.connect(ctx.replica_url) as writer,
        ):
            start = time.perf_counter()
            cursor = await peek(reader, config)
            pending: list[tuple[str | None, ...]] = []
            while batch := await cursor.fetchmany(FETCH_ROWS):
                for (data,) in batch:
                    message = pgoutput.decode(data)
                    if isinstance(message, pgoutput.Insert):
                        pending.append(message.new.values)
                    elif isinstance(message, pgoutput.Commit) and len(pending) >= EPOCH_ROWS:
                        await apply(writer, pending)
                        applied, pending = applied + len(pending), []
            if pending:
                await apply(writer, pending)
                applied += len(pending)
            return applied, time.perf_counter() - start

    applied, seconds = asyncio.run(run())
    _check_replica(ctx, table)
    return Measurement(applied, seconds)


@scenario("cdc.apply_changes", baseline="cdc.raw_peek_decode_apply")
def apply_changes(ctx: BenchContext) -> Measurement:
    """The continuous runner, CDC to PostgreSQL APPLY_CHANGES, epochs of 50,000 change rows, certified."""
    config, table = _slot(ctx), _replica(ctx)
    seconds, certificates = replicate(ctx, config, {resource: table for resource in config.tables}, ctx.rows)
    _check_replica(ctx, table)
    steps = seconds_per_step(certificates)
    return Measurement(ctx.rows, seconds, {"epochs": len(certificates), "seconds_per_step": steps})
