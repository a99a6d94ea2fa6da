"""The fixed cost of one epoch: lease, begin, a one-message read, seal, commit, certificate, acknowledgement.

``stream.epoch_overhead`` runs epochs of one NATS message each into PostgreSQL APPEND through the
continuous runner (certificates in a SQLite state store) and times every epoch on its own, after one
untimed epoch that opens the sessions. It reports the epochs as its rows and prints the median and 90th
percentile epoch time (target: median <= 25 ms). The messages are in the stream before the first epoch,
so no epoch waits for the provider. Always 200 epochs, whatever ``--rows`` says.
"""

import asyncio
import statistics
import tempfile
import time

import nats
import psycopg
from faucet_nats.config import NatsSourceConfig
from faucet_nats.source import NatsStreamSource
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink
from psycopg import sql

from bench.context import BenchContext
from bench.registry import Measurement, scenario
from faucet_dagster.protocol import ReadLimits
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore

EPOCHS = 200


async def _publish(url: str, stream: str, count: int) -> None:
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        for i in range(count):
            await js.publish(f"{stream}.rows", f'{{"i": {i}, "name": "user-{i}", "score": 0.5}}'.encode())
    finally:
        await client.close()


@scenario("stream.epoch_overhead")
def epoch_overhead(ctx: BenchContext) -> Measurement:
    """One-message epochs, NATS to PostgreSQL through the runner: each epoch timed (median printed)."""
    stream, table = ctx.unique("overhead"), ctx.unique("overhead_pg")
    asyncio.run(_publish(ctx.nats_url, stream, EPOCHS + 1))
    folder = tempfile.mkdtemp(prefix="faucet-bench-")
    store = StateStore(f"sqlite:///{folder}/state.db")
    spec = StreamSpec(
        name=table,
        source=NatsStreamSource(
            NatsSourceConfig(
                servers=(ctx.nats_url,),
                stream=stream,
                columns={"i": "int64", "name": "string", "score": "float64"},
            )
        ),
        sink=PostgresStreamingSink(PostgresStreamingSinkConfig(url=ctx.postgres_url, table=table)),
        resources=(stream,),
        limits=ReadLimits(records=1, bytes=None, idle=5.0, age=None),
    )

    async def run() -> list[float]:
        runner = StreamRunner(spec, store)
        try:
            if await runner.run_epoch() is None:  # opens the sessions, creates the table
                raise RuntimeError("the first epoch certified nothing")
            times = []
            for _ in range(EPOCHS):
                start = time.perf_counter()
                certificate = await runner.run_epoch()
                times.append(time.perf_counter() - start)
                if certificate is None or sum(certificate.row_counts.values()) != 1:
                    raise RuntimeError(f"an epoch did not certify exactly one message: {certificate}")
            return times
        finally:
            await runner.close()

    times = asyncio.run(run())
    store.close()
    with psycopg.connect(ctx.postgres_url) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    if row is None or row[0] != EPOCHS + 1:
        raise RuntimeError(f"{table} holds {row} rows, expected {EPOCHS + 1}")
    median = statistics.median(times)
    p90 = statistics.quantiles(times, n=10)[-1]
    print(f"# stream.epoch_overhead: median {median * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms per epoch")
    return Measurement(
        EPOCHS, sum(times), {"median_ms": round(median * 1000, 2), "p90_ms": round(p90 * 1000, 2)}
    )
