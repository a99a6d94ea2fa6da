"""Epochs that span sensor ticks, PostgreSQL CDC into PostgreSQL with the default settings.

The sensor's runner reads into its open epoch in the background and seals it at the first safe source
boundary after its age (a second); a tick only reports. What holds, with the stream's and the sensor's
defaults (limits, budget, lease):

* a backlog of 20,000 one-row source transactions drains in a few ticks, each tick short;
* one 1,000,000-row source transaction is read across as many ticks as it needs: no epoch certifies
  part of it, nothing of it is visible at the destination before it is committed whole, and the
  test process's memory stays far below what holding its rows would take (they are staged in the
  destination's open transaction as they are read);
* a tick that certified says so in its reason (``certified N epochs ..., R rows``), one that waits on
  an open transaction says that, instead of "0 runs requested".
"""

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dagster as dg
import psutil
import psycopg
import pytest
from faucet_postgres.stream_sink import PostgresStreamingSinkSession
from stream_ticks import sensor_context

from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.protocol import EpochId, PartialResult, SinkBatch, WritePolicy
from faucet_dagster.state import StateStore
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.runner_cache import close_cached_streams
from faucet_dagster.streams.sensor import faucet_stream_sensor
from faucet_dagster.testing import PostgresServer

TICK_BOUND = 15.0
"""What a default tick must stay under (some deployments cut gRPC calls at 15 s)."""
LINES = "CREATE TABLE lines (order_id int, line int, qty int, PRIMARY KEY (order_id, line))"


class Cdc:
    """A source table with its slot and publication, a replica database, a state store, and sensor
    ticks with the default settings on one Dagster instance."""

    def __init__(self, source_url: str, target_url: str, name: str, tmp_path: Path) -> None:
        self.source_url, self.target_url, self.name = source_url, target_url, name
        self.state_url = f"sqlite:///{tmp_path / 'faucet_state.db'}"
        self.store = StateStore(self.state_url)
        self.cursor: str | None = None
        self.ticks: list[tuple[float, dg.SensorResult]] = []
        source = FaucetConnection(
            connector="postgres",
            config={
                "url": source_url,
                "slot": name,
                "publication": f"{name}_pub",
                "tables": ["public.lines"],
            },
        )
        self.execute(LINES)
        self.execute(LINES, url=target_url)
        assert source.setup_replication()["slot_created"]
        # Everything at its default but what names the servers and the table.
        self.stream = FaucetStream(
            name=name,
            source=FaucetEndpoint(source),
            sink=FaucetEndpoint(
                FaucetConnection(
                    connector="postgres", config={"url": target_url, "tables": {"public.lines": "lines"}}
                )
            ),
            resources=("public.lines",),
            policy=WritePolicy.APPLY_CHANGES,
            state_url=self.state_url,
        )
        self.sensor = faucet_stream_sensor(self.stream)

    def execute(self, statement: str, url: str | None = None) -> list[tuple[object, ...]]:
        with psycopg.connect(url or self.source_url, autocommit=True) as conn:
            cursor = conn.execute(statement)
            return cursor.fetchall() if cursor.description else []

    def tick(self, instance: dg.DagsterInstance) -> dg.SensorResult:
        began = time.monotonic()
        result = self.sensor.evaluate_tick(sensor_context(self.sensor, instance, self.cursor))
        seconds = time.monotonic() - began
        assert seconds < TICK_BOUND, f"a default tick took {seconds:.1f}s"
        self.cursor = result.cursor
        self.ticks.append((seconds, result))
        return result

    def digest(self, url: str) -> tuple[object, ...]:
        """Count, sums and an order-independent hash of the table, computed by the server."""
        [row] = self.execute(
            "SELECT count(*), sum(order_id::bigint), sum(qty::bigint), "
            "sum(hashtext(order_id || '/' || line || '/' || qty)::bigint) FROM lines",
            url=url,
        )
        return row


def rows_certified(cdc: Cdc) -> int:
    return sum(sum(c.row_counts.values()) for c in cdc.store.certificates(cdc.name))


def materializations(result: dg.SensorResult) -> list[dg.AssetMaterialization]:
    return [event for event in result.asset_events if isinstance(event, dg.AssetMaterialization)]


@pytest.fixture
def cdc(
    postgres_url: str, postgres_server: PostgresServer, unique_name: Callable[..., str], tmp_path: Path
) -> Iterator[Cdc]:
    replica = unique_name("replica")
    made = Cdc(postgres_url, postgres_server.create_database(replica), unique_name("span"), tmp_path)
    try:
        yield made
    finally:
        close_cached_streams()
        made.store.close()
        made.execute(f"SELECT pg_drop_replication_slot('{made.name}')")
        postgres_server.drop_database(replica)


def test_a_backlog_of_20000_one_row_transactions_drains_with_the_default_settings(cdc: Cdc) -> None:
    # 20,000 transactions of one row each, committed one by one by the server.
    cdc.execute(
        "DO $$ BEGIN FOR i IN 0..19999 LOOP "
        "INSERT INTO lines VALUES (i / 100, i % 100, i); COMMIT; END LOOP; END $$"
    )
    with dg.instance_for_test() as instance:
        for _ in range(20):
            result = cdc.tick(instance)
            certified = sum(
                int(str(m.metadata["faucet/rows_written"].value)) for m in materializations(result)
            )
            if certified:
                assert str(result.skip_message).startswith("certified "), result.skip_message
                assert f"{certified} rows" in str(result.skip_message)
            if cdc.digest(cdc.target_url)[0] == 20_000:
                break
            time.sleep(0.5)
    assert cdc.digest(cdc.target_url) == cdc.digest(cdc.source_url)
    certificates = cdc.store.certificates(cdc.name)
    assert rows_certified(cdc) == 20_000
    print(
        f"\n20,000 one-row transactions: {len(cdc.ticks)} ticks, {len(certificates)} epochs, longest tick "
        f"{max(seconds for seconds, _ in cdc.ticks):.1f}s"
    )


class StalledDestination:
    """Holds the streaming sink inside an epoch once it has staged rows, until released: a destination
    that is slow in mid-transaction. The fault is injected at one exact point (after an ``apply``
    returned) so that a tick certainly comes while a source transaction is half read, whatever the
    machine's speed: a fast machine otherwise reads and certifies a 1,000,000-row transaction within
    one tick's budget, and nothing would span ticks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.released = threading.Event()
        self.held = threading.Event()
        apply, apply_partial = PostgresStreamingSinkSession.apply, PostgresStreamingSinkSession.apply_partial

        async def held_apply(session: PostgresStreamingSinkSession, epoch: EpochId, batch: SinkBatch) -> None:
            await apply(session, epoch, batch)
            await self.hold(batch)

        async def held_apply_partial(
            session: PostgresStreamingSinkSession, epoch: EpochId, batch: SinkBatch
        ) -> PartialResult:
            result = await apply_partial(session, epoch, batch)
            await self.hold(batch)
            return result

        monkeypatch.setattr(PostgresStreamingSinkSession, "apply", held_apply)
        monkeypatch.setattr(PostgresStreamingSinkSession, "apply_partial", held_apply_partial)

    async def hold(self, batch: SinkBatch) -> None:
        while batch.records.num_rows and not self.released.is_set():
            self.held.set()
            await asyncio.sleep(0.05)


@pytest.mark.slow
def test_one_million_row_transaction_spans_ticks_with_the_default_settings(
    cdc: Cdc, monkeypatch: pytest.MonkeyPatch
) -> None:
    stall = StalledDestination(monkeypatch)
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = {"rss": baseline}
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak["rss"] = max(peak["rss"], process.memory_info().rss)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with dg.instance_for_test() as instance:
        # The first tick starts the reader; the transaction below is read in the background.
        cdc.tick(instance)
        cdc.execute("INSERT INTO lines SELECT g / 1000, g % 1000, g FROM generate_series(0, 999999) g")
        waited: list[str] = []
        ends = time.monotonic() + 600
        while not rows_certified(cdc):
            assert time.monotonic() < ends, f"the transaction was not certified in 600s: {waited[-3:]}"
            result = cdc.tick(instance)
            if rows_certified(cdc):
                break
            waited.append(str(result.skip_message))
            if "open for" in waited[-1] and stall.held.is_set():
                # A tick saw the transaction half read, the destination held in the middle of it: let
                # the destination go on.
                stall.released.set()
            [(visible,)] = cdc.execute("SELECT count(*) FROM lines", url=cdc.target_url)
            # Committed (whole) in the background a moment before its certificate, never in part.
            assert visible in (0, 1_000_000), f"{visible} rows of the open transaction are visible"
            time.sleep(0.2)
        for _ in range(3):  # whatever the last tick left to report
            if not materializations(cdc.tick(instance)):
                break
    sampling.set()
    sampler.join()
    grown = (peak["rss"] - baseline) / 2**20
    # 1M change rows as Python objects take about 1 GB, as Arrow columns about 60 MB: the rows are
    # staged at the destination as they are read, in batches, never held whole.
    assert grown < 400, f"the process grew by {grown:.0f} MiB while reading the transaction"
    # Heartbeats of the source may be certified as epochs of their own, without rows.
    [certificate] = [c for c in cdc.store.certificates(cdc.name) if c.row_counts]
    assert certificate.row_counts == {"public.lines": 1_000_000}, "certified whole, in one epoch"
    assert cdc.digest(cdc.target_url) == cdc.digest(cdc.source_url)
    # A tick that waited said why: the open epoch's rows so far, or its commit in progress (before the
    # server's decoding reached the transaction, there was nothing new to read yet).
    assert stall.held.is_set(), "the destination was never held in mid-transaction"
    assert any("open for" in reason for reason in waited), "no tick waited on the open transaction"
    spanning = waited[next(i for i, reason in enumerate(waited) if "open for" in reason) :]
    assert all("open for" in reason or "being committed" in reason for reason in spanning), waited
    print(
        f"\n1,000,000-row transaction: {len(cdc.ticks)} ticks (longest "
        f"{max(seconds for seconds, _ in cdc.ticks):.1f}s), {len(waited)} waited on it; process grew "
        f"{grown:.0f} MiB"
    )
