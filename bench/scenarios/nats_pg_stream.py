"""Continuous NATS JetStream to PostgreSQL APPEND in epochs of 50,000 messages, against the raw push consumer.

``stream.nats_to_pg`` is the whole product path: the continuous runner (lease, begin, read through the
pipeline, seal, commit, certificate in a SQLite state store, acknowledgement).
``stream.nats_to_pg_connectors`` drives the two connectors alone (begin, read, commit, acknowledge; each
batch applied as it is read), which shows what the runner and pipeline cost on top. Both read the stream
``raw.nats_push`` reads, into a table ``(i bigint, name text, score double precision)``, and check the
count and the last row afterwards.
"""

import asyncio
import tempfile
import time

import psycopg
from faucet_nats.config import NatsSourceConfig
from faucet_nats.source import NatsStreamSource
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink
from psycopg import sql

from bench import data
from bench.context import BenchContext
from bench.registry import Measurement, scenario
from bench.streams import run_until, seconds_per_step
from faucet_dagster.protocol import (
    CancelToken,
    Control,
    EpochId,
    Identities,
    Membership,
    OrderingDomain,
    ReadLimits,
    Records,
    SinkBatch,
    StreamingSinkSession,
    StreamRecordSink,
    WorkerIdentity,
    WritePolicy,
    as_record_batch,
)
from faucet_dagster.runner.continuous import StreamSpec
from faucet_dagster.state import StateStore

EPOCH_MESSAGES = 50_000
COLUMNS = {"i": "int64", "name": "string", "score": "float64"}


def _source(ctx: BenchContext, stream: str) -> NatsStreamSource:
    return NatsStreamSource(NatsSourceConfig(servers=(ctx.nats_url,), stream=stream, columns=COLUMNS))


def _sink(ctx: BenchContext, table: str) -> PostgresStreamingSink:
    return PostgresStreamingSink(PostgresStreamingSinkConfig(url=ctx.postgres_url, table=table))


def _check(ctx: BenchContext, table: str) -> None:
    with psycopg.connect(ctx.postgres_url) as conn:
        count, last = conn.execute(
            sql.SQL("SELECT count(*), max(i) FROM {}").format(sql.Identifier(table))
        ).fetchone() or (0, None)
    if (count, last) != (ctx.rows, ctx.rows - 1):
        raise RuntimeError(
            f"{table} holds {count} rows up to {last}, expected {ctx.rows} up to {ctx.rows - 1}"
        )


@scenario("stream.nats_to_pg", baseline="raw.nats_push")
def nats_to_pg(ctx: BenchContext) -> Measurement:
    """The continuous runner, NATS to PostgreSQL APPEND, epochs of 50,000 messages, certificates in SQLite."""
    stream, table = data.nats_source_stream(ctx), ctx.unique("stream_pg")
    folder = tempfile.mkdtemp(prefix="faucet-bench-")
    store = StateStore(f"sqlite:///{folder}/state.db")
    spec = StreamSpec(
        name=table,
        source=_source(ctx, stream),
        sink=_sink(ctx, table),
        resources=(stream,),
        limits=ReadLimits(records=EPOCH_MESSAGES, bytes=None, idle=1.0, age=None),
    )

    seconds, certificates = asyncio.run(run_until(spec, store, ctx.rows))
    store.close()
    _check(ctx, table)
    return Measurement(
        ctx.rows, seconds, {"epochs": len(certificates), "seconds_per_step": seconds_per_step(certificates)}
    )


class _Apply(StreamRecordSink):
    """Hands each written run straight to the sink session (no pipeline: the connectors' own cost)."""

    def __init__(self, session: StreamingSinkSession, epoch: EpochId) -> None:
        self.session, self.epoch = session, epoch

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        batch = SinkBatch(self.epoch, resource or domain.resource, domain, as_record_batch(rows), identities)
        await self.session.apply(self.epoch, batch)

    async def control(self, control: Control) -> None:
        return None


@scenario("stream.nats_to_pg_connectors", baseline="raw.nats_push")
def nats_to_pg_connectors(ctx: BenchContext) -> Measurement:
    """The NATS source and PostgreSQL streaming sink alone: begin, read 50,000, commit, acknowledge."""
    stream, table = data.nats_source_stream(ctx), ctx.unique("stream_pg")
    worker = WorkerIdentity("bench", 1)
    limits = ReadLimits(records=EPOCH_MESSAGES, bytes=None, idle=1.0, age=None)

    async def authority() -> None:
        return None

    async def run() -> tuple[float, int]:
        start = time.perf_counter()
        sink = await _sink(ctx, table).open(table, WritePolicy.APPEND, (), worker)
        source = await _source(ctx, stream).open([stream], (), Membership(), worker)
        epochs = rows = 0
        try:
            while rows < ctx.rows:
                epochs += 1
                epoch = EpochId(table, epochs, worker.fencing_token)
                await sink.begin_epoch(epoch)
                coverage = await source.read(_Apply(sink, epoch), limits, CancelToken())
                receipts = await sink.commit_epoch(epoch, coverage)
                await source.acknowledge(coverage, authority)
                rows += sum(receipt.rows_written for receipt in receipts)
            return time.perf_counter() - start, epochs
        finally:
            await source.close()
            await sink.close_session()

    seconds, epochs = asyncio.run(run())
    _check(ctx, table)
    return Measurement(ctx.rows, seconds, {"epochs": epochs})
