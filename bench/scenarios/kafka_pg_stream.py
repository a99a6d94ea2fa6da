"""Continuous Kafka to PostgreSQL or DuckDB APPEND through the runner, against the raw loops.

All read the 4-partition topic ``raw.kafka_to_pg`` reads. ``stream.kafka_to_pg`` is the whole product
path (lease, begin, read through the pipeline, seal, commit with the per-partition watermark, certificate
in a SQLite state store, offsets committed to the group) with JSON payloads parsed into typed columns
``(i, name, score)`` (declared on the source, so whole batches are parsed by Arrow);
``stream.kafka_to_pg_text`` hands the payload through as text (format ``text``: columns key, value,
headers, timestamp, topic, partition, offset), like the raw loop does. ``stream.kafka_to_duckdb`` is
the JSON path into a new DuckDB file (the streaming sink: each epoch one DuckDB transaction with its
watermarks and the owner's fence), against ``raw.kafka_consume`` (the consume loop alone: there is no
hand-written DuckDB loop to compare with). Each checks the row count afterwards.
"""

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Literal

import duckdb
import psycopg
from faucet_duckdb.config import DuckDbStreamingSinkConfig
from faucet_duckdb.stream_sink import DuckDbStreamingSink
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
from faucet_dagster.protocol import ReadLimits, StreamingSink
from faucet_dagster.runner.continuous import StreamSpec
from faucet_dagster.state import StateStore

EPOCH_MESSAGES = 50_000
QUIX_CHILD = ROOT / "bench" / "quix_child.py"
BYTEWAX_CHILD = ROOT / "bench" / "bytewax_child.py"
COLUMNS = {"i": "int64", "name": "string", "score": "float64"}


def _postgres(ctx: BenchContext, table: str) -> tuple[StreamingSink, Callable[[], int]]:
    """The PostgreSQL streaming sink into ``table``, and how to count the table's rows."""

    def count() -> int:
        with psycopg.connect(ctx.postgres_url) as conn:
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
        return -1 if row is None else int(row[0])

    return PostgresStreamingSink(PostgresStreamingSinkConfig(url=ctx.postgres_url, table=table)), count


def _duckdb(folder: str, table: str) -> tuple[StreamingSink, Callable[[], int]]:
    """The DuckDB streaming sink into ``table`` of a new file in ``folder``, and how to count its rows."""
    path = os.path.join(folder, "warehouse.duckdb")

    def count() -> int:
        with duckdb.connect(path) as conn:
            row = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
        return -1 if row is None else int(row[0])

    return DuckDbStreamingSink(DuckDbStreamingSinkConfig(path=path, table=table)), count


def _run(
    ctx: BenchContext,
    fmt: Literal["json", "text"],
    landing: Callable[[str, str], tuple[StreamingSink, Callable[[], int]]],
) -> Measurement:
    """The stream from the source topic through ``landing(folder, table)``'s sink; checks the count."""
    topic, table = data.kafka_source_topic(ctx), ctx.unique("kstream")
    folder = tempfile.mkdtemp(prefix="faucet-bench-")
    ctx.on_close(lambda: shutil.rmtree(folder))
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
    sink, count = landing(folder, table)
    spec = StreamSpec(
        name=table,
        source=source,
        sink=sink,
        resources=(topic,),
        schemas={topic: ResourceSchema.from_columns(COLUMNS)} if fmt == "json" else {},
        limits=ReadLimits(records=EPOCH_MESSAGES, bytes=None, idle=1.0, age=None),
    )

    seconds, certificates = asyncio.run(run_until(spec, store, ctx.rows))
    store.close()
    if (found := count()) != ctx.rows:
        raise RuntimeError(f"{table} holds {found} rows, expected {ctx.rows}")
    steps = seconds_per_step(certificates)
    return Measurement(ctx.rows, seconds, {"epochs": len(certificates), "seconds_per_step": steps})


@scenario("stream.kafka_to_pg", baseline="raw.kafka_to_pg")
def kafka_to_pg(ctx: BenchContext) -> Measurement:
    """The continuous runner, Kafka JSON to typed PostgreSQL columns, APPEND, epochs of 50,000."""
    return _run(ctx, "json", lambda _folder, table: _postgres(ctx, table))


@scenario("stream.kafka_to_pg_text", baseline="raw.kafka_to_pg")
def kafka_to_pg_text(ctx: BenchContext) -> Measurement:
    """The continuous runner, Kafka payloads as text columns into PostgreSQL, APPEND, epochs of 50,000."""
    return _run(ctx, "text", lambda _folder, table: _postgres(ctx, table))


@scenario("stream.kafka_to_duckdb", baseline="raw.kafka_consume")
def kafka_to_duckdb(ctx: BenchContext) -> Measurement:
    """The continuous runner, Kafka JSON to typed columns of a new DuckDB file, APPEND, epochs of 50,000."""
    return _run(ctx, "json", _duckdb)


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
