"""PostgreSQL change data capture: change rows decoded by the CDC source against a raw peek-decode loop.

Both read the same slot, which neither consumes: the dataset inserted into a published table
``(id bigint, k text, payload jsonb)`` in transactions of 1,000 rows after the slot was created.

``cdc.raw_peek_decode`` is the floor any Python pgoutput reader pays: ``pg_logical_slot_peek_binary_changes``
through a server-side cursor, every message decoded by :func:`faucet_postgres.pgoutput.decode`.
``cdc.pg_source`` is the StreamSource: its session reads a copy of the slot in reads of 50,000 rows,
types every value into Arrow, and writes rows and transaction controls to a counting sink; timed from
opening the session to the last transaction end.
"""

import asyncio
import time

import psycopg
from faucet_postgres import pgoutput
from faucet_postgres.cdc import PostgresCdcSource, setup_replication
from faucet_postgres.cdc_config import PostgresCdcConfig
from psycopg import sql

from bench.context import BenchContext
from bench.registry import Measurement, scenario
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
READ_ROWS = 50_000
FETCH_ROWS = 5_000


def _slot(ctx: BenchContext) -> PostgresCdcConfig:
    """A slot and publication over a table the dataset was inserted into afterwards (made once per run)."""

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

    return ctx.shared("cdc_slot", prepare)


@scenario("cdc.raw_peek_decode")
def raw_peek_decode(ctx: BenchContext) -> Measurement:
    """pg_logical_slot_peek_binary_changes through a server-side cursor, every pgoutput message decoded."""
    config = _slot(ctx)

    async def run() -> tuple[int, float]:
        inserts = 0
        async with await psycopg.AsyncConnection.connect(ctx.postgres_url) as conn:
            start = time.perf_counter()
            cursor = conn.cursor("peek", binary=True)
            await cursor.execute(
                "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                "'proto_version', '1', 'publication_names', %s)",
                (config.slot, config.publication),
            )
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
        limits = ReadLimits(records=READ_ROWS, idle=0.2)
        try:
            while not (await session.read(counted, limits, CancelToken())).empty:
                pass
        finally:
            await session.close()
        return counted, counted.last_end - start

    counted, seconds = asyncio.run(run())
    expected = (ctx.rows, -(-ctx.rows // TRANSACTION_ROWS))
    if (counted.rows, counted.transactions) != expected:
        raise RuntimeError(
            f"read {counted.rows} rows in {counted.transactions} transactions, expected {expected}"
        )
    return Measurement(counted.rows, seconds, {"transactions": counted.transactions})
