"""``faucet verify`` at the issue's rate: a stream certified in 1-second epochs of 5,000 messages, then
every certificate checked again (chain, the ranges re-read at the source, the rows at the destination).

* ``stream.nats_to_pg_5k``: the continuous runner, NATS to PostgreSQL APPEND with the sink's
  ``epoch_column``, epochs of 5,000 messages (what a stream at 5,000 messages/s certifies each second);
* ``verify.nats_to_pg``: that stream's certificates verified (the stream is run first, untimed): its
  rate against the stream's says how long verifying takes against writing, and its certificates per
  second what one day of them (86,400) costs;
* ``verify.kafka_to_pg``: the same for Kafka (4 partitions: each certificate covers up to 4 domains);
* ``stream.nats_to_pg_epoch_column``: ``stream.nats_to_pg`` with the sink's ``epoch_column``: what the
  column costs the write path.

Each verification must find every certificate verified (else the run fails).
"""

import asyncio
import tempfile
import time

import psycopg
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.source import KafkaStreamSource
from faucet_nats.config import NatsSourceConfig
from faucet_nats.source import NatsStreamSource
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink
from psycopg import sql

from bench import data
from bench.context import BenchContext
from bench.registry import Measurement, scenario
from bench.streams import run_until
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import ReadLimits, StreamSource
from faucet_dagster.runner.continuous import StreamSpec
from faucet_dagster.state import StateStore
from faucet_dagster.verify import Outcome, VerifyOptions, verify_stream

EPOCH_MESSAGES = 5_000
"""One second of a stream at 5,000 messages/s: the epoch a sensor-driven stream certifies each second."""
COLUMNS = {"i": "int64", "name": "string", "score": "float64"}
EPOCH_COLUMN = "_faucet_epoch"


def _spec(ctx: BenchContext, source: StreamSource, resource: str, table: str, epoch: int) -> StreamSpec:
    return StreamSpec(
        name=table,
        source=source,
        sink=PostgresStreamingSink(
            PostgresStreamingSinkConfig(url=ctx.postgres_url, table=table, epoch_column=EPOCH_COLUMN)
        ),
        resources=(resource,),
        schemas={resource: ResourceSchema.from_columns(COLUMNS)},
        limits=ReadLimits(records=epoch, bytes=None, idle=1.0, age=None),
    )


def _nats(ctx: BenchContext, epoch: int) -> tuple[StreamSpec, StateStore]:
    stream = data.nats_source_stream(ctx)
    source = NatsStreamSource(NatsSourceConfig(servers=(ctx.nats_url,), stream=stream, columns=COLUMNS))
    store = StateStore(f"sqlite:///{tempfile.mkdtemp(prefix='faucet-bench-')}/state.db")
    return _spec(ctx, source, stream, ctx.unique("verify_pg"), epoch), store


def _kafka(ctx: BenchContext, epoch: int) -> tuple[StreamSpec, StateStore]:
    topic = data.kafka_source_topic(ctx)
    source = KafkaStreamSource(
        KafkaSourceConfig(
            bootstrap_servers=ctx.kafka_bootstrap, topics=(topic,), group_id=ctx.unique("g"), columns=COLUMNS
        )
    )
    store = StateStore(f"sqlite:///{tempfile.mkdtemp(prefix='faucet-bench-')}/state.db")
    return _spec(ctx, source, topic, ctx.unique("verify_kpg"), epoch), store


def _stream(ctx: BenchContext, spec: StreamSpec, store: StateStore) -> Measurement:
    seconds, epochs = asyncio.run(run_until(spec, store, ctx.rows))
    store.close()
    return Measurement(ctx.rows, seconds, {"epochs": epochs})


def _verify(ctx: BenchContext, spec: StreamSpec, store: StateStore) -> Measurement:
    asyncio.run(run_until(spec, store, ctx.rows))  # untimed: what is verified
    start = time.perf_counter()
    report = asyncio.run(verify_stream(spec, store, VerifyOptions(first=1, limit=10**9, record=False)))
    seconds = time.perf_counter() - start
    store.close()
    problems = [item.summary() for item in report.verifications if item.outcome is not Outcome.VERIFIED]
    if problems or report.rows_compared != ctx.rows:
        raise RuntimeError(f"the verification found {len(problems)} problems: {problems[:3]}")
    certificates = len(report.verifications)
    return Measurement(
        ctx.rows,
        seconds,
        {
            "certificates": certificates,
            "certificates_per_second": round(certificates / seconds, 1),
            "rows_replayed": report.rows_replayed,
            "rows_compared": report.rows_compared,
            "day_at_5000_per_second_hours": round(86_400 * 5_000 / (ctx.rows / seconds) / 3600, 2),
        },
    )


@scenario("stream.nats_to_pg_5k", baseline="raw.nats_push")
def nats_to_pg_5k(ctx: BenchContext) -> Measurement:
    """The continuous runner, NATS to PostgreSQL APPEND with an epoch column, epochs of 5,000 messages."""
    return _stream(ctx, *_nats(ctx, EPOCH_MESSAGES))


@scenario("verify.nats_to_pg", baseline="stream.nats_to_pg_5k")
def verify_nats_to_pg(ctx: BenchContext) -> Measurement:
    """faucet verify of every certificate of that stream: re-read from NATS, compared in PostgreSQL."""
    return _verify(ctx, *_nats(ctx, EPOCH_MESSAGES))


@scenario("verify.kafka_to_pg", baseline="stream.kafka_to_pg")
def verify_kafka_to_pg(ctx: BenchContext) -> Measurement:
    """faucet verify of a Kafka stream (4 partitions) certified in epochs of 5,000 into PostgreSQL."""
    return _verify(ctx, *_kafka(ctx, EPOCH_MESSAGES))


@scenario("stream.nats_to_pg_epoch_column", baseline="stream.nats_to_pg")
def nats_to_pg_epoch_column(ctx: BenchContext) -> Measurement:
    """stream.nats_to_pg with the sink's epoch_column: what stamping each row with its epoch costs."""
    spec, store = _nats(ctx, 50_000)
    measured = _stream(ctx, spec, store)
    return Measurement(measured.rows, measured.seconds, {**measured.details, **_row_bytes(ctx, spec.name)})


def _row_bytes(ctx: BenchContext, table: str) -> dict[str, float]:
    """The table's bytes per row with the epoch column, and as a copy without it (untimed)."""
    with psycopg.connect(ctx.postgres_url, autocommit=True) as conn:
        bare = f"{table}_bare"
        conn.execute(
            sql.SQL("CREATE TABLE {} AS SELECT i, name, score FROM {}").format(
                sql.Identifier(bare), sql.Identifier(table)
            )
        )
        sizes = [
            conn.execute("SELECT pg_total_relation_size(%s)", (name,)).fetchone() or (0,)
            for name in (table, bare)
        ]
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(bare)))
    return {
        "bytes_per_row_with_column": round(sizes[0][0] / ctx.rows, 1),
        "bytes_per_row_without": round(sizes[1][0] / ctx.rows, 1),
    }
