"""NATS JetStream into a table through the continuous runner, on the real NATS server: a DuckDB file
and a Delta table (each test runs on both).

Every message lands once across epochs; a worker that dies after the table's commit but before its
certificate is replayed without a duplicate; an epoch whose commit dies inside it (DuckDB: the
connection raising right before COMMIT, after rows and watermarks were written in its transaction;
Delta: right before the Delta commit, after its snapshot was read and its rows prepared) leaves
nothing behind and the next worker lands it once.
"""

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import nats
import pytest
from deltalake import DeltaTable
from faucet_delta.stream_config import DeltaStreamingSinkConfig
from faucet_delta.stream_sink import DeltaStreamingSink
from faucet_duckdb.config import DuckDbStreamingSinkConfig
from faucet_duckdb.stream_sink import DuckDbStreamingSink
from faucet_nats.config import NatsSourceConfig
from faucet_nats.source import NatsStreamSource

from faucet_dagster.protocol import EpochCertificate, ReadLimits, StreamingSink
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore
from faucet_dagster.streams.reports import table_metadata

T = TypeVar("T")
COLUMNS = {"id": "int64 not null", "name": "string"}
BUDGET_SECONDS = 120.0


def run(factory: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await factory()

    return asyncio.run(main())


class WorkerDied(Exception):
    """The worker died at the injected point (not an OSError: no connector error maps it)."""


class DiesBeforeCommit:
    """The real DuckDB connection, whose first COMMIT of a transaction that wrote watermarks (an
    epoch's, its rows written before them) raises instead of committing: the worker dying inside
    the epoch's transaction. (Delta: :meth:`before_delta_commit`.)"""

    armed = False

    @staticmethod
    def before_delta_commit() -> None:
        """Called by the Delta sink right before its commit, its snapshot read and rows prepared."""
        if DiesBeforeCommit.armed:
            DiesBeforeCommit.armed = False
            raise WorkerDied("the worker died right before the epoch's Delta commit")

    def __init__(self, conn: duckdb.DuckDBPyConnection) -> None:
        self._conn = conn
        self._marks_written = False

    def executemany(self, query: str, parameters: Any) -> Any:
        self._marks_written = "_faucet_stream_watermarks" in query
        return self._conn.executemany(query, parameters)

    def commit(self) -> None:
        if DiesBeforeCommit.armed and self._marks_written:
            DiesBeforeCommit.armed = False
            raise WorkerDied("the worker died inside the epoch's transaction")
        self._conn.commit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class Env:
    """One test's NATS stream, destination (a DuckDB file or a Delta table) and state store."""

    def __init__(self, nats_url: str, name: str, tmp_path: Path, destination: str) -> None:
        self.nats_url = nats_url
        self.stream = name
        self.destination = destination
        self.path = tmp_path / "warehouse.duckdb" if destination == "duckdb" else tmp_path / "lake" / "events"
        self.store = StateStore(f"sqlite:///{tmp_path / 'faucet_state.db'}")
        self.published = 0

    def sink(self, *, dying: bool) -> StreamingSink:
        if self.destination == "delta":
            before_commit = DiesBeforeCommit.before_delta_commit if dying else None
            return DeltaStreamingSink(
                DeltaStreamingSinkConfig(uri=str(self.path)), before_commit=before_commit
            )
        config = DuckDbStreamingSinkConfig(path=str(self.path), table="events")
        connect: Any = (lambda path: DiesBeforeCommit(duckdb.connect(path))) if dying else duckdb.connect
        return DuckDbStreamingSink(config, connect=connect)

    def runner(self, worker: str, limits: ReadLimits, *, dying: bool = False) -> StreamRunner:
        source = {"servers": [self.nats_url], "stream": self.stream, "columns": COLUMNS}
        spec = StreamSpec(
            name=self.stream,
            source=NatsStreamSource(NatsSourceConfig.parse(source)),
            sink=self.sink(dying=dying),
            resources=(self.stream,),
            limits=limits,
            lease_seconds=30,
        )
        return StreamRunner(spec, self.store, worker_id=worker)

    def publish(self, count: int) -> None:
        first = self.published

        async def send() -> None:
            client = await nats.connect(self.nats_url)
            try:
                js = client.jetstream()
                for n in range(first, first + count):
                    await client.publish(
                        f"{self.stream}.rows", json.dumps({"id": n, "name": f"r{n}"}).encode()
                    )
                await client.flush()
                deadline = time.monotonic() + 60
                while (await js.stream_info(self.stream)).state.last_seq < first + count:
                    assert time.monotonic() < deadline, "JetStream did not store the messages"
                    await asyncio.sleep(0.02)
            finally:
                await client.close()

        asyncio.run(send())
        self.published += count

    def ids(self) -> list[int]:
        if not self.path.exists():
            return []
        if self.destination == "delta":
            return sorted(
                DeltaTable(str(self.path)).to_pyarrow_table(columns=["id"]).column("id").to_pylist()
            )
        with duckdb.connect(str(self.path)) as conn:
            if not conn.execute(
                "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'events'"
            ).fetchall()[0][0]:
                return []
            return [row[0] for row in conn.execute("SELECT id FROM events ORDER BY id").fetchall()]

    def acknowledged(self) -> int:
        async def info() -> int:
            client = await nats.connect(self.nats_url)
            try:
                [consumer] = await client.jetstream().consumers_info(self.stream)
                return int(consumer.ack_floor.stream_seq)
            finally:
                await client.close()

        return asyncio.run(info())


@pytest.fixture(params=["duckdb", "delta"])
def env(
    nats_url: str, unique_name: Callable[..., str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Env]:
    created = Env(nats_url, unique_name("d"), tmp_path, request.param)

    async def create() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(name=created.stream, subjects=[f"{created.stream}.>"])
        finally:
            await client.close()

    asyncio.run(create())
    yield created
    created.store.close()


def epochs(runner: StreamRunner) -> list[EpochCertificate]:
    """Epochs until the source has nothing new (or one fails). The budget is generous: a tight one
    cuts a read short on a loaded machine, and its epoch is aborted instead of committed."""

    async def scenario() -> list[EpochCertificate]:
        try:
            return await runner.run_epochs(BUDGET_SECONDS)
        finally:
            await runner.close()

    return run(scenario)


def test_messages_land_once_across_epochs_and_are_acknowledged_after_certification(env: Env) -> None:
    env.publish(1_200)
    certificates = epochs(env.runner("w1", ReadLimits(records=500, idle=0.3)))
    assert sum(r.rows_written for c in certificates for r in c.receipts) == 1_200
    assert env.ids() == list(range(1_200))
    assert env.acknowledged() == 1_200
    details = certificates[0].receipts[0].details
    name = "warehouse.main.events" if env.destination == "duckdb" else "lake.events"
    assert f"{details['database']}.{details['table']}" == name
    assert table_metadata(certificates[0].receipts)["dagster/table_name"] == name
    if env.destination == "delta":  # one Delta commit per epoch, its version in the receipt
        versions = [int(c.receipts[0].details["version"]) for c in certificates if c.receipts]
        assert versions == list(range(versions[0], versions[0] + len(versions)))
        assert DeltaTable(str(env.path)).transaction_version(f"faucet:events:epoch:{env.stream}") == len(
            certificates
        )


def test_a_worker_dying_after_the_tables_commit_is_replayed_without_duplicates(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    env.publish(1_500)
    persist = env.store.append_certificate

    def crash(certificate: EpochCertificate, lease: Any) -> bool:
        raise ConnectionError("the worker died before persisting the certificate")

    monkeypatch.setattr(env.store, "append_certificate", crash)
    with pytest.raises(ConnectionError):
        epochs(env.runner("crashed", ReadLimits(records=1_000, idle=0.3)))
    assert env.ids() == list(range(1_000)), "the epoch's commit did not land"
    assert env.store.certificates(env.stream) == [] and env.acknowledged() == 0
    monkeypatch.setattr(env.store, "append_certificate", persist)
    env.store.release(env.stream)

    certificates = epochs(env.runner("next", ReadLimits(records=300, idle=0.3)))
    assert sum(r.rows_skipped for r in certificates[0].receipts) >= 300
    assert sum(r.rows_skipped for c in certificates for r in c.receipts) == 1_000
    assert env.ids() == list(range(1_500))
    assert env.acknowledged() == 1_500


def test_a_worker_dying_inside_the_epochs_commit_leaves_nothing_and_loses_nothing(env: Env) -> None:
    env.publish(300)
    epochs(env.runner("w1", ReadLimits(records=300, idle=0.3)))
    assert env.ids() == list(range(300))
    env.publish(500)
    DiesBeforeCommit.armed = True
    with pytest.raises(WorkerDied):
        epochs(env.runner("dying", ReadLimits(records=300, idle=0.3), dying=True))
    assert not DiesBeforeCommit.armed, "the fault was not reached"
    assert env.ids() == list(range(300)), "rows of the epoch that died were committed"
    assert env.acknowledged() == 300
    env.store.release(env.stream)
    certificates = epochs(env.runner("next", ReadLimits(records=300, idle=0.3)))
    assert sum(r.rows_skipped for c in certificates for r in c.receipts) == 0
    assert env.ids() == list(range(800))
    assert env.acknowledged() == 800
