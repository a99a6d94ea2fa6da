"""What the CDC scenarios share: peeking a slot, copies of a slot that a run may consume, and the
continuous runner replicating one."""

import asyncio
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from faucet_postgres.cdc import PostgresCdcSource, setup_replication
from faucet_postgres.cdc_config import PostgresCdcConfig
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink

from bench.context import BenchContext
from bench.streams import run_until
from faucet_dagster.protocol import EpochCertificate, ReadLimits, WritePolicy
from faucet_dagster.runner.continuous import StreamSpec
from faucet_dagster.state import StateStore

EPOCH_ROWS = 50_000


async def peek(
    conn: psycopg.AsyncConnection[Any], config: PostgresCdcConfig
) -> psycopg.AsyncServerCursor[Any]:
    """A server-side cursor over every pgoutput message ``config.slot`` holds (peeked: never consumed)."""
    cursor = conn.cursor("peek", binary=True)
    await cursor.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', %s)",
        (config.slot, config.publication),
    )
    return cursor


@contextmanager
def copied_slot(ctx: BenchContext, config: PostgresCdcConfig, prefix: str) -> Iterator[PostgresCdcConfig]:
    """``config`` on a new copy of its slot, from the same point (a runner advances the slot it reads),
    dropped when the block ends (the server has a slot for a few copies at a time)."""
    copy = config.model_copy(update={"slot": ctx.unique(prefix)})
    with psycopg.connect(ctx.postgres_url, autocommit=True) as conn:
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (config.slot, copy.slot))
    try:
        yield copy
    finally:
        drop_slot(ctx, copy.slot)


def drop_slot(ctx: BenchContext, slot: str) -> None:
    """Drop ``slot`` if it exists (its walsender gone: a session's close ends it)."""
    with psycopg.connect(ctx.postgres_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )


def replicate(
    ctx: BenchContext, config: PostgresCdcConfig, tables: Mapping[str, str], rows: int
) -> tuple[float, list[EpochCertificate]]:
    """The continuous runner from a copy of ``config``'s slot into ``tables`` (source table -> replica
    table, in the replica database): APPLY_CHANGES, epochs of 50,000 change rows, certificates in a
    SQLite state store, the slot acknowledged, pipelined as under a sensor; timed from the first lease
    until ``rows`` change rows are certified. Returns the seconds and the certificates.

    Reads have ``idle=0``: a read that finds nothing new returns at once, so the last epoch is sealed
    as soon as the server reports the slot caught up, as a baseline ends when its peek is exhausted.
    With the default ``idle=1.0`` the last, partial epoch would first wait a second for more changes:
    latency a live stream chooses to batch a trickle, no part of catching up a backlog."""
    with copied_slot(ctx, config, "cdc_copy") as copy:
        asyncio.run(setup_replication(copy))  # records the copy's incarnation
        folder = tempfile.mkdtemp(prefix="faucet-bench-")
        store = StateStore(f"sqlite:///{folder}/state.db")
        spec = StreamSpec(
            name=ctx.unique("cdc_stream"),
            source=PostgresCdcSource(copy),
            sink=PostgresStreamingSink(PostgresStreamingSinkConfig(url=ctx.replica_url, tables=dict(tables))),
            resources=copy.tables,
            policy=WritePolicy.APPLY_CHANGES,
            limits=ReadLimits(records=EPOCH_ROWS, bytes=None, idle=0.0, age=None),
        )
        try:
            return asyncio.run(run_until(spec, store, rows))
        finally:
            store.close()
            shutil.rmtree(folder, ignore_errors=True)
