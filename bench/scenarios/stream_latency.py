"""Publish-to-visible latency of a stream under its sensor's cadence, at a fixed publishing rate.

``stream.latency_nats_to_pg`` and ``stream.latency_kafka_to_pg`` publish ``RATE`` messages a second
for ``SECONDS`` seconds (``{"i": n}``; NATS: JetStream publishes, Kafka: a 4-partition topic) while the
continuous runner moves them into PostgreSQL APPEND with the stream defaults (epochs sealed about a
second old or at 50,000 records, pipelined) driven as the sensor drives it: ``tick`` on the code
server's background loop every ``TICK_SECONDS`` (the sensor's default interval), the first one starting
the reader without waiting (the sensor's default starting budget). A message's latency runs from its
publish acknowledgement (the broker stored it) to the moment a poller, querying the destination every
``POLL_SECONDS``, first sees its row committed. Reported: the median, 99th percentile and largest
latency, and the check that the table holds every message exactly once (0 lost, 0 duplicated).

Always ``RATE * SECONDS`` messages, whatever ``--rows`` says; the rate is the scenario's "rows/s".
"""

import asyncio
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import nats
import psycopg
from confluent_kafka import KafkaError, Message, Producer
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
from faucet_dagster.protocol import StreamSource
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.runner.loop import BackgroundLoop
from faucet_dagster.state import StateStore

RATE = 1_000
SECONDS = 20.0
TICK_SECONDS = 30.0
POLL_SECONDS = 0.02
DRAIN_SECONDS = 120.0
COLUMNS = {"i": "int64"}


class Visibility(threading.Thread):
    """Polls ``table`` for rows it has not seen; records when each ``i`` was first seen."""

    def __init__(self, url: str, table: str, total: int) -> None:
        super().__init__(daemon=True)
        self.url, self.table, self.total = url, table, total
        self.seen: dict[int, float] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        low = 0
        query = sql.SQL("SELECT i FROM {} WHERE i >= %s").format(sql.Identifier(self.table))
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stopped.is_set() and len(self.seen) < self.total:
                try:
                    rows = conn.execute(query, (low,)).fetchall()
                except psycopg.errors.UndefinedTable:
                    rows = []  # the sink creates the table with its first epoch
                now = time.time()
                for (i,) in rows:
                    self.seen.setdefault(i, now)
                while low in self.seen:
                    low += 1
                self.stopped.wait(POLL_SECONDS)


def _ticks(loop: BackgroundLoop, runner: StreamRunner, stopped: threading.Event) -> None:
    """The sensor's cadence: a tick now (starting the reader without waiting), then every interval."""
    while True:
        loop.run(runner.tick(10.0, stop_after=120.0, starting_budget=0.0, interval=TICK_SECONDS))
        if stopped.wait(TICK_SECONDS):
            return


async def _publish_nats(url: str, stream: str, sent: dict[int, float]) -> None:
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        started = time.monotonic()
        for n in range(int(RATE * SECONDS)):
            await js.publish(f"{stream}.rows", f'{{"i": {n}}}'.encode())
            sent[n] = time.time()
            await asyncio.sleep(max(0.0, started + (n + 1) / RATE - time.monotonic()))
    finally:
        await client.close()


def _publish_kafka(bootstrap: str, topic: str, sent: dict[int, float]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": "all"})

    def delivered(n: int) -> Callable[[KafkaError | None, Message], None]:
        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                raise RuntimeError(f"message {n} was not delivered: {err}")
            sent[n] = time.time()

        return on_delivery

    started = time.monotonic()
    for n in range(int(RATE * SECONDS)):
        producer.produce(
            topic, f'{{"i": {n}}}'.encode(), partition=n % data.KAFKA_PARTITIONS, on_delivery=delivered(n)
        )
        producer.poll(0)
        time.sleep(max(0.0, started + (n + 1) / RATE - time.monotonic()))
    if producer.flush(30) != 0:
        raise RuntimeError("the producer did not deliver every message")


def _latency(
    ctx: BenchContext,
    name: str,
    source: StreamSource,
    resource: str,
    publish: Callable[[dict[int, float]], None],
) -> Measurement:
    table = ctx.unique(f"{name}_pg")
    total = int(RATE * SECONDS)
    folder = tempfile.mkdtemp(prefix="faucet-bench-")
    store = StateStore(f"sqlite:///{folder}/state.db")
    spec = StreamSpec(
        name=table,
        source=source,
        sink=PostgresStreamingSink(PostgresStreamingSinkConfig(url=ctx.postgres_url, table=table)),
        resources=(resource,),
    )
    loop = BackgroundLoop("bench-code-server")
    runner = StreamRunner(spec, store)
    visibility = Visibility(ctx.postgres_url, table, total)
    stopped = threading.Event()
    ticks = threading.Thread(target=_ticks, args=(loop, runner, stopped), daemon=True)
    sent: dict[int, float] = {}
    try:
        ticks.start()
        visibility.start()
        start = time.perf_counter()
        publish(sent)
        seconds = time.perf_counter() - start
        visibility.join(DRAIN_SECONDS)
    finally:
        stopped.set()
        visibility.stopped.set()
        ticks.join()
        loop.run(runner.close())
        loop.close()
        store.close()
    with psycopg.connect(ctx.postgres_url) as conn:
        count, distinct = conn.execute(
            sql.SQL("SELECT count(*), count(DISTINCT i) FROM {}").format(sql.Identifier(table))
        ).fetchone() or (0, 0)
    lost, duplicated = total - distinct, count - distinct
    if lost or duplicated or len(sent) != total:
        raise RuntimeError(f"{table}: {lost} lost, {duplicated} duplicated, {len(sent)} of {total} sent")
    latencies = sorted(visibility.seen[n] - sent[n] for n in range(total))
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (total - 1))]
    print(
        f"# {name}: {total} messages at {RATE}/s, a tick every {TICK_SECONDS:.0f}s: publish to visible "
        f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms; "
        "0 lost, 0 duplicated"
    )
    details = {
        "p50_ms": round(p50 * 1000, 1),
        "p99_ms": round(p99 * 1000, 1),
        "max_ms": round(latencies[-1] * 1000, 1),
        "lost": lost,
        "duplicated": duplicated,
    }
    return Measurement(total, seconds, details)


@scenario("stream.latency_nats_to_pg")
def latency_nats_to_pg(ctx: BenchContext) -> Measurement:
    """Publish-to-visible latency, NATS to PostgreSQL at 1,000/s under the sensor's cadence (p50, p99)."""
    stream = ctx.unique("latency")

    async def create() -> None:
        client = await nats.connect(ctx.nats_url)
        try:
            await client.jetstream().add_stream(name=stream, subjects=[f"{stream}.>"])
        finally:
            await client.close()

    asyncio.run(create())
    source = NatsStreamSource(NatsSourceConfig(servers=(ctx.nats_url,), stream=stream, columns=COLUMNS))
    return _latency(
        ctx,
        "stream.latency_nats_to_pg",
        source,
        stream,
        lambda sent: asyncio.run(_publish_nats(ctx.nats_url, stream, sent)),
    )


@scenario("stream.latency_kafka_to_pg")
def latency_kafka_to_pg(ctx: BenchContext) -> Measurement:
    """Publish-to-visible latency, Kafka to PostgreSQL at 1,000/s under the sensor's cadence (p50, p99)."""
    topic = data.create_topic(ctx, "latency")
    source = KafkaStreamSource(
        KafkaSourceConfig(
            bootstrap_servers=ctx.kafka_bootstrap, topics=(topic,), group_id=ctx.unique("g"), columns=COLUMNS
        )
    )
    return _latency(
        ctx,
        "stream.latency_kafka_to_pg",
        source,
        topic,
        lambda sent: _publish_kafka(ctx.kafka_bootstrap, topic, sent),
    )
