"""Continuous Kafka to PostgreSQL APPEND through the runner, against the raw consume-COPY-commit loop.

Both read the 4-partition topic ``raw.kafka_to_pg`` reads. ``stream.kafka_to_pg`` is the whole product
path (lease, begin, read through the pipeline, seal, commit with the per-partition watermark, certificate
in a SQLite state store, offsets committed to the group) with JSON payloads parsed into typed columns
``(i, name, score)`` (declared on the source, so whole batches are parsed by Arrow);
``stream.kafka_to_pg_text`` hands the payload through as text (format ``text``: columns key, value,
headers, timestamp, topic, partition, offset), like the raw loop does. Each checks the row count
afterwards.
"""

import asyncio
import tempfile
from typing import Literal

import psycopg
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.source import KafkaStreamSource
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink
from psycopg import sql

from bench import data
from bench.context import BenchContext
from bench.peers import ROOT, peer_venv, run_peer
from bench.registry import Measurement, scenario
from bench.streams import run_until, seconds_per_step
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.protocol import ReadLimits
from faucet_dagster.runner.continuous import StreamSpec
from faucet_dagster.state import StateStore

EPOCH_MESSAGES = 50_000
QUIX_CHILD = ROOT / "bench" / "quix_child.py"
BYTEWAX_CHILD = ROOT / "bench" / "bytewax_child.py"
COLUMNS = {"i": "int64", "name": "string", "score": "float64"}


def _run(ctx: BenchContext, fmt: Literal["json", "text"]) -> Measurement:
    topic, table = data.kafka_source_topic(ctx), ctx.unique("kstream_pg")
    folder = tempfile.mkdtemp(prefix="faucet-bench-")
    store = StateStore(f"sqlite:///{folder}/state.db")
    source = KafkaStreamSource(
        KafkaSourceConfig(
            bootstrap_servers=ctx.kafka_bootstrap,
            topics=(topic,),
            group_id=ctx.unique("g"),
            format=fmt,
            columns=COLUMNS if fmt == "json" else None,
        )
    )
    spec = StreamSpec(
        name=table,
        source=source,
        sink=PostgresStreamingSink(PostgresStreamingSinkConfig(url=ctx.postgres_url, table=table)),
        resources=(topic,),
        schemas={topic: ResourceSchema.from_columns(COLUMNS)} if fmt == "json" else {},
        limits=ReadLimits(records=EPOCH_MESSAGES, bytes=None, idle=1.0, age=None),
    )

    seconds, certificates = asyncio.run(run_until(spec, store, ctx.rows))
    store.close()
    with psycopg.connect(ctx.postgres_url) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    if row is None or row[0] != ctx.rows:
        raise RuntimeError(f"{table} holds {row and row[0]} rows, expected {ctx.rows}")
    steps = seconds_per_step(certificates)
    return Measurement(ctx.rows, seconds, {"epochs": len(certificates), "seconds_per_step": steps})


@scenario("stream.kafka_to_pg", baseline="raw.kafka_to_pg")
def kafka_to_pg(ctx: BenchContext) -> Measurement:
    """The continuous runner, Kafka JSON to typed PostgreSQL columns, APPEND, epochs of 50,000."""
    return _run(ctx, "json")


@scenario("stream.kafka_to_pg_text", baseline="raw.kafka_to_pg")
def kafka_to_pg_text(ctx: BenchContext) -> Measurement:
    """The continuous runner, Kafka payloads as text columns into PostgreSQL, APPEND, epochs of 50,000."""
    return _run(ctx, "text")


# -- peers ---------------------------------------------------------------------------------------------


def _quix(ctx: BenchContext, clock: Literal["from_assignment", "from_start"]) -> Measurement:
    venv = peer_venv("QUIX_VENV", ".venv-quix")
    assert venv is not None
    topic, table = data.kafka_source_topic(ctx), ctx.unique("quix_pg")
    command = [str(venv / "bin" / "python"), str(QUIX_CHILD), ctx.kafka_bootstrap, topic, ctx.postgres_url]
    report = run_peer("quixstreams", [*command, table, str(ctx.rows), clock])
    return Measurement(int(report["rows"]), float(report["seconds"]), {"clock": clock})


def quix_kafka_to_pg(ctx: BenchContext) -> Measurement:
    """quixstreams (its PostgreSQLSink) consuming the same topic into PostgreSQL, from the assignment."""
    return _quix(ctx, "from_assignment")


def quix_kafka_to_pg_from_start(ctx: BenchContext) -> Measurement:
    """quixstreams on the same topic, clocked as quix_peer.py does: from Application.run(), join included."""
    return _quix(ctx, "from_start")


def bytewax_kafka_to_pg(ctx: BenchContext) -> Measurement:
    """bytewax (its KafkaSource, a COPY sink per batch) on the same topic into PostgreSQL, from its start."""
    venv = peer_venv("BYTEWAX_VENV", ".venv-bytewax")
    assert venv is not None
    topic, table = data.kafka_source_topic(ctx), ctx.unique("bytewax_pg")
    command = [str(venv / "bin" / "python"), str(BYTEWAX_CHILD), ctx.kafka_bootstrap, topic, ctx.postgres_url]
    report = run_peer("bytewax", [*command, table, str(ctx.rows)])
    return Measurement(int(report["rows"]), float(report["seconds"]), {"clock": "from_start"})


if peer_venv("QUIX_VENV", ".venv-quix") is not None:
    scenario("peer.quix_kafka_to_pg", baseline="stream.kafka_to_pg")(quix_kafka_to_pg)
    scenario("peer.quix_kafka_to_pg_from_start", baseline="stream.kafka_to_pg")(quix_kafka_to_pg_from_start)
if peer_venv("BYTEWAX_VENV", ".venv-bytewax") is not None:
    scenario("peer.bytewax_kafka_to_pg", baseline="stream.kafka_to_pg")(bytewax_kafka_to_pg)
