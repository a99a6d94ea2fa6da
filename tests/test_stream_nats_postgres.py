"""NATS JetStream to PostgreSQL through the continuous runner and the Dagster sensor, on real servers.

Runner- and sensor-level behaviour: every message lands once while sensor ticks run, certificates
chain and are reported once, and each interruption of seed 000 leaves no loss, no duplicate and no
acknowledgement of uncertified work. Connector-level behaviour (consumer settings, keep-alive
details, COPY formats) is tested beside each connector.

Faults are injected at exact points by wrapping the real PostgreSQL sink session (a commit that
waits for a second worker, a slow apply); everything else is the real connectors, servers and store.
"""

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
import nats
import psycopg
import pytest
from faucet_nats.config import NatsSourceConfig
from faucet_nats.source import NatsStreamSource
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_sink import PostgresStreamingSink
from stream_ticks import SensorTicks, certified_rows, reported_sequences, sensor_context, ticks_reporting

from faucet_dagster.cli.main import main
from faucet_dagster.components import FaucetComponent
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.pipeline import PipelineOptions, ResourceSchema
from faucet_dagster.protocol import (
    Coverage,
    DataError,
    EpochCertificate,
    EpochId,
    IncarnationChanged,
    OwnershipLost,
    PositionUnavailable,
    ReadLimits,
    Receipt,
    SinkBatch,
    SinkCommitState,
    StreamingSink,
    StreamingSinkSession,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
)
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore
from faucet_dagster.streams.certificates import CERTIFICATE_CHECK
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.definitions import build_stream_defs
from faucet_dagster.streams.runner_cache import close_cached_streams
from faucet_dagster.streams.sensor import faucet_stream_sensor

T = TypeVar("T")
COLUMNS = {"id": "int64 not null", "name": "string"}


def run(factory: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await factory()

    return asyncio.run(main())


def one_epoch(runner: StreamRunner) -> EpochCertificate | None:
    """Run one epoch of ``runner``, then close it (joining its sessions, giving its lease up)."""

    async def scenario() -> EpochCertificate | None:
        try:
            return await runner.run_epoch()
        finally:
            await runner.close()

    return run(scenario)


class Env:
    """One test's NATS stream, PostgreSQL database and state store."""

    def __init__(self, nats_url: str, postgres_url: str, name: str, tmp_path: Path) -> None:
        self.nats_url = nats_url
        self.postgres_url = postgres_url
        self.stream = name
        self.table = f"{name}_rows"
        self.state_url = f"sqlite:///{tmp_path / 'state' / 'faucet_state.db'}"
        self.store = StateStore(self.state_url)
        self.published = 0

    def source_config(self, **extra: Any) -> dict[str, Any]:
        return {"servers": [self.nats_url], "stream": self.stream, "columns": COLUMNS, **extra}

    def sink_config(self) -> dict[str, Any]:
        return {"url": self.postgres_url, "table": self.table}

    def spec(
        self, *, sink: StreamingSink | None = None, limits: ReadLimits | None = None, **source: Any
    ) -> StreamSpec:
        return StreamSpec(
            name=self.stream,
            source=NatsStreamSource(NatsSourceConfig.parse(self.source_config(**source))),
            sink=sink or self.sink(),
            resources=(self.stream,),
            limits=limits or ReadLimits(records=5_000, idle=0.3),
            lease_seconds=30,
        )

    def sink(self) -> PostgresStreamingSink:
        return PostgresStreamingSink(PostgresStreamingSinkConfig.parse(self.sink_config()))

    def runner(self, worker: str = "w1", **kwargs: Any) -> StreamRunner:
        return StreamRunner(self.spec(**kwargs), self.store, worker_id=worker)

    async def create_stream(self) -> None:
        client = await nats.connect(self.nats_url)
        try:
            await client.jetstream().add_stream(name=self.stream, subjects=[f"{self.stream}.>"])
        finally:
            await client.close()

    async def delete_stream(self) -> None:
        client = await nats.connect(self.nats_url)
        try:
            await client.jetstream().delete_stream(self.stream)
        finally:
            await client.close()

    def publish(self, count: int, payload: Callable[[int], bytes] | None = None) -> None:
        """Publish ``count`` messages ``{"id": n, "name": ...}`` with the next ids, stored on return."""
        first = self.published

        async def send() -> None:
            client = await nats.connect(self.nats_url, pending_size=64 * 1024 * 1024)
            try:
                js = client.jetstream()
                for n in range(first, first + count):
                    data = payload(n) if payload else json.dumps({"id": n, "name": f"row-{n}"}).encode()
                    await client.publish(f"{self.stream}.rows", data)
                await client.flush()
                deadline = time.monotonic() + 30
                while (await js.stream_info(self.stream)).state.last_seq < first + count:
                    assert time.monotonic() < deadline, "JetStream did not store the messages"
                    await asyncio.sleep(0.02)
            finally:
                await client.close()

        asyncio.run(send())
        self.published += count

    def ids(self) -> list[int]:
        with psycopg.connect(self.postgres_url) as conn:
            exists = conn.execute("SELECT to_regclass(%s)", (self.table,)).fetchone()
            if exists is None or exists[0] is None:
                return []
            return [row[0] for row in conn.execute(f'SELECT id FROM "{self.table}" ORDER BY id')]

    def consumer(self) -> Any:
        async def info() -> Any:
            client = await nats.connect(self.nats_url)
            try:
                consumers = await client.jetstream().consumers_info(self.stream)
                assert len(consumers) == 1
                return consumers[0]
            finally:
                await client.close()

        return asyncio.run(info())


@pytest.fixture
def env(nats_url: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path) -> Iterator[Env]:
    created = Env(nats_url, postgres_url, unique_name("s"), tmp_path)
    asyncio.run(created.create_stream())
    yield created
    close_cached_streams()
    created.store.close()


def chain(certificates: Sequence[EpochCertificate]) -> None:
    """Each certificate follows the previous one in sequence and starts where it ended."""
    end: str | None = None
    for index, certificate in enumerate(certificates, start=1):
        assert certificate.sequence == index
        [item] = certificate.coverage
        assert item.start == end, f"certificate {index} starts at {item.start}, the previous ended at {end}"
        end = item.end


class FaultySinkSession(StreamingSinkSession):
    """The real PostgreSQL session, with a hook awaited before ``apply`` or ``commit_epoch``."""

    def __init__(self, inner: StreamingSinkSession, before: dict[str, Callable[[], Awaitable[None]]]) -> None:
        self.inner = inner
        self.before = before

    async def last_committed(self) -> SinkCommitState | None:
        return await self.inner.last_committed()

    async def begin_epoch(self, epoch: EpochId) -> None:
        await self.inner.begin_epoch(epoch)

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        if "apply" in self.before:
            await self.before["apply"]()
        await self.inner.apply(epoch, batch)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        if "commit" in self.before:
            await self.before.pop("commit")()
        return await self.inner.commit_epoch(epoch, coverage)

    async def abort_epoch(self, epoch: EpochId) -> None:
        await self.inner.abort_epoch(epoch)

    async def close_session(self) -> None:
        if "close" in self.before:
            await self.before["close"]()
        await self.inner.close_session()


class FaultySink(StreamingSink):
    connector_name = "postgres"

    def __init__(
        self, inner: PostgresStreamingSink, before: dict[str, Callable[[], Awaitable[None]]]
    ) -> None:
        self.inner = inner
        self.before = before

    def capabilities(self) -> Any:
        return self.inner.capabilities()

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        return FaultySinkSession(await self.inner.open(stream, policy, key, worker), self.before)


# -- delivery through the sensor ----------------------------------------------------------------


def test_messages_published_while_sensor_ticks_run_land_once_and_are_reported_once(
    env: Env, tmp_path: Path
) -> None:
    total = 100_000
    stream = FaucetStream(
        name=env.stream,
        source=FaucetEndpoint(FaucetConnection(connector="nats", config=env.source_config())),
        sink=FaucetEndpoint(FaucetConnection(connector="postgres", config=env.sink_config())),
        resources=(env.stream,),
        limits=ReadLimits(records=10_000, idle=0.3, age=5.0),
        state_url=env.state_url,
    )
    sensor = faucet_stream_sensor(stream, budget_seconds=1)
    key = stream.asset_spec().key
    publisher = threading.Thread(target=lambda: [env.publish(10_000) for _ in range(total // 10_000)])
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        cursor: str | None = None
        publisher.start()
        ticks = 0
        lost_once = False
        while True:
            ticks += 1
            assert ticks < 200, "the stream did not catch up"
            data = sensor.evaluate_tick(sensor_context(sensor, instance, cursor))
            if data.asset_events and not lost_once:
                lost_once = True  # this tick "timed out": Dagster never stored its events or cursor
                continue
            for event in data.asset_events:
                instance.report_runless_asset_event(event)
            cursor = data.cursor
            if not publisher.is_alive() and len(env.ids()) == total and not data.asset_events:
                break
        publisher.join()
        materializations = instance.fetch_materializations(key, limit=10_000).records
        checks = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(key, CERTIFICATE_CHECK), limit=10_000
        )

    assert env.ids() == list(range(total)), "every message exactly once"
    certificates = env.store.certificates(env.stream)
    chain(certificates)
    assert sum(sum(c.row_counts.values()) for c in certificates) == total
    assert sum(r.rows_written for c in certificates for r in c.receipts) == total
    reported = [
        sequence
        for record in materializations
        if record.asset_materialization is not None
        for sequence in reported_sequences(record.asset_materialization)
    ]
    assert sorted(reported) == [c.sequence for c in certificates], "each certificate reported once"
    # One materialization and one certificate evaluation a tick, whatever the epochs it covers.
    assert len(checks) == len(materializations) < len(certificates)
    last = materializations[0].asset_materialization
    assert last is not None
    assert last.metadata["faucet/last_certificate"].value["digest"] == certificates[-1].digest
    assert last.metadata["faucet/fencing_token"].value == str(certificates[-1].fencing_token)
    coverage = last.metadata["faucet/coverage"].value.records[0].data
    assert coverage["end"] == certificates[-1].coverage[0].end
    assert env.store.reported_through(env.stream) >= certificates[-2].sequence


# -- interruptions ------------------------------------------------------------------------------


def test_a_sink_slower_than_ack_wait_causes_no_redelivery(env: Env) -> None:
    env.publish(3_000)

    async def slow() -> None:
        await asyncio.sleep(1.5)

    sink = FaultySink(env.sink(), {"apply": slow})
    stream = StreamRunner(
        env.spec(sink=sink, limits=ReadLimits(records=3_000, idle=0.3), ack_wait=1.0, chunk_messages=1_000),
        env.store,
        worker_id="w1",
    )

    certificate = one_epoch(stream)
    assert certificate is not None and certificate.coverage[0].end == "3000"
    assert env.ids() == list(range(3_000))
    consumer = env.consumer()
    assert consumer.num_redelivered == 0, "the keep-alive held every message past AckWait"
    assert consumer.ack_floor.stream_seq == 3_000


def test_cancellation_during_a_read_certifies_and_acknowledges_nothing(env: Env) -> None:
    env.publish(2_000)

    async def scenario() -> None:
        applied = asyncio.Event()

        async def signal() -> None:
            applied.set()

        waiting = ReadLimits(records=None, idle=30.0, age=60.0)  # the read only ends when cancelled
        spec = env.spec(sink=FaultySink(env.sink(), {"apply": signal}), limits=waiting, chunk_messages=500)
        # Small batches: the pipeline applies rows to the sink while the read is still going.
        stream = StreamRunner(
            replace(spec, pipeline=PipelineOptions(batch_rows=500)), env.store, worker_id="w1"
        )
        task = asyncio.create_task(stream.run_epoch())
        await asyncio.wait_for(applied.wait(), 30)
        stream.cancel()
        assert await task is None
        assert env.store.certificates(env.stream) == []
        assert await asyncio.to_thread(env.ids) == [], "the aborted epoch left nothing behind"
        await stream.close()
        assert (await asyncio.to_thread(env.consumer)).ack_floor.stream_seq == 0
        resumed = env.runner(worker="w2")
        certificate = await resumed.run_epoch()
        await resumed.close()
        assert certificate is not None and certificate.coverage[0].start is None
        assert certificate.coverage[0].end == "2000"

    run(scenario)
    assert env.ids() == list(range(2_000))
    assert env.consumer().ack_floor.stream_seq == 2_000


def test_ownership_lost_before_the_ack_refuses_it_and_the_destination_fences_the_commit(env: Env) -> None:
    env.publish(1_000)

    async def scenario() -> None:
        takeover: dict[str, Callable[[], Awaitable[None]]] = {}
        old = StreamRunner(env.spec(sink=FaultySink(env.sink(), takeover)), env.store, worker_id="old")
        new = StreamRunner(env.spec(), env.store, worker_id="new")

        async def second_worker_commits_first() -> None:
            await asyncio.to_thread(env.store.release, env.stream)
            certificate = await new.run_epoch()
            assert certificate is not None and certificate.fencing_token == 2

        assert (await old.run_epoch()) is not None  # the table exists before the takeover
        await asyncio.to_thread(env.publish, 500)
        takeover["commit"] = second_worker_commits_first
        with pytest.raises(OwnershipLost, match="claimed the stream"):
            await old.run_epoch()
        await asyncio.to_thread(env.publish, 500)
        assert (await new.run_epoch()) is not None
        # The old worker's session cannot acknowledge: it forgot the lease it lost.
        with pytest.raises(OwnershipLost, match="old holds no lease"):
            await old._authority()
        await new.close()
        await old.close(release=False)

    run(scenario)
    certificates = env.store.certificates(env.stream)
    assert [c.worker for c in certificates] == ["old", "new", "new"]
    chain(certificates)
    assert env.ids() == list(range(2_000))


def test_a_crash_after_the_destination_commit_replays_without_duplicates(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    env.publish(1_500)
    persist = env.store.append_certificate

    def crash(certificate: EpochCertificate, lease: Any) -> bool:
        raise ConnectionError("the worker died before persisting the certificate")

    monkeypatch.setattr(env.store, "append_certificate", crash)
    crashed = env.runner(worker="crashed", limits=ReadLimits(records=1_000, idle=0.3))
    with pytest.raises(ConnectionError):
        run(crashed.run_epoch)
    assert env.ids() == list(range(1_000)), "the destination committed the epoch"
    assert env.store.certificates(env.stream) == [] and env.consumer().ack_floor.stream_seq == 0
    monkeypatch.setattr(env.store, "append_certificate", persist)
    env.store.release(env.stream)  # the crashed worker's lease, without waiting for it to expire

    recovering = env.runner(worker="next", limits=ReadLimits(records=200, idle=0.3))

    async def recover() -> list[EpochCertificate]:
        try:
            return await recovering.run_epochs(30)
        finally:
            await recovering.close()

    certificates = run(recover)
    assert certificates[0].sequence == 1 and int(certificates[0].coverage[0].end) >= 1_000
    assert sum(r.rows_skipped for r in certificates[0].receipts) == 1_000
    chain(env.store.certificates(env.stream))
    assert env.ids() == list(range(1_500))
    assert env.consumer().ack_floor.stream_seq == 1_500


def test_an_uncertain_close_blocks_takeover_until_released(env: Env) -> None:
    env.publish(100)

    async def uncertain() -> None:
        raise UncertainOutcome("a COPY may still be in flight", where="test")

    stream = StreamRunner(
        env.spec(sink=FaultySink(env.sink(), {"close": uncertain})), env.store, worker_id="w1"
    )

    async def first() -> None:
        assert await stream.run_epoch() is not None
        await stream.close()

    with pytest.raises(UncertainOutcome):
        run(first)
    other = env.runner(worker="w2")
    with pytest.raises(UncertainOutcome, match="faucet streams release"):
        run(other.run_epoch)
    assert main(["streams", "release", env.stream, "--state-url", env.state_url]) == 0
    env.publish(50)

    certificate = one_epoch(other)
    assert certificate is not None and certificate.coverage[0].start == "100"
    assert env.ids() == list(range(150))


def test_a_purged_resume_position_is_unavailable_and_nothing_is_written(env: Env) -> None:
    env.publish(100)
    assert one_epoch(env.runner()) is not None
    env.publish(100)

    async def purge() -> None:
        client = await nats.connect(env.nats_url)
        try:
            await client.jetstream().purge_stream(env.stream, seq=150)  # keeps 150..200
        finally:
            await client.close()

    run(purge)
    before = env.ids()
    with pytest.raises(PositionUnavailable):
        run(env.runner(worker="w2").run_epoch)
    assert env.ids() == before and len(env.store.certificates(env.stream)) == 1


def test_a_deleted_and_recreated_stream_is_a_new_incarnation_and_nothing_is_written(env: Env) -> None:
    env.publish(100)
    assert one_epoch(env.runner()) is not None
    run(env.delete_stream)
    run(env.create_stream)
    env.published = 0
    env.publish(300)
    with pytest.raises(IncarnationChanged):
        run(env.runner(worker="w2").run_epoch)
    assert env.ids() == list(range(100)) and len(env.store.certificates(env.stream)) == 1


def test_a_message_that_does_not_fit_halts_or_goes_to_the_dead_letter_route(env: Env) -> None:
    env.publish(10)
    env.publish(1, lambda n: json.dumps({"id": "eleven", "name": "bad"}).encode())
    env.publish(9)
    declared = {env.stream: ResourceSchema.from_columns(COLUMNS)}
    spec = env.spec(columns=None)  # the source hands JSON rows over; the pipeline's schema decides
    halting = StreamRunner(replace(spec, schemas=declared), env.store, worker_id="w1")
    with pytest.raises(DataError, match="does not fit"):
        run(halting.run_epoch)
    assert env.ids() == [] and env.store.certificates(env.stream) == []
    run(lambda: halting.close())
    routed = {env.stream: ResourceSchema.from_columns(COLUMNS, on_bad_row="dead_letter")}
    dead_letter = StreamRunner(replace(spec, schemas=routed), env.store, worker_id="w2")

    certificate = one_epoch(dead_letter)
    assert certificate is not None and certificate.dead_lettered == {env.stream: 1}
    assert env.ids() == [n for n in range(20) if n != 10]
    [letter] = env.store.dead_letters(env.stream)
    assert letter["event"].endswith("@11#0") and json.loads(letter["payload"])["id"] == "eleven"


# -- the sensor's other ticks ---------------------------------------------------------------------


def faucet_stream(env: Env) -> FaucetStream:
    return FaucetStream(
        name=env.stream,
        source=FaucetEndpoint(FaucetConnection(connector="nats", config=env.source_config())),
        sink=FaucetEndpoint(FaucetConnection(connector="postgres", config=env.sink_config())),
        resources=(env.stream,),
        limits=ReadLimits(records=1_000, idle=0.3),
        state_url=env.state_url,
    )


def test_a_tick_skips_while_another_worker_holds_the_lease_and_fails_on_an_uncertain_stream(env: Env) -> None:
    env.publish(10)
    sensor = faucet_stream_sensor(faucet_stream(env), budget_seconds=2)
    held = env.store.acquire_lease(env.stream, "another-code-server", 30)
    data = sensor.evaluate_tick(sensor_context(sensor))
    assert not [event for event in data.asset_events if isinstance(event, dg.AssetMaterialization)]
    assert "waiting on a lease another worker holds" in str(data.skip_message)
    assert env.ids() == []
    # Marked before the holder lets go: the first tick's reader may still wait for this lease in the
    # background, and must find the stream uncertain, not free, the moment it is released.
    env.store.mark_uncertain(env.stream, "the previous worker's close timed out")
    env.store.release_lease(held)
    ticks = SensorTicks(sensor, None)
    ticks.cursor = data.cursor
    halted = ticks.until_halted("uncertain")  # once the background reader met the mark
    assert "faucet streams release" in str(halted.skip_message)
    env.store.release(env.stream)
    released = len(ticks.results)
    ticks.until(lambda: bool(ticks.reported), "the records reported after the release")
    # The report, its certificate evaluation, and the health check passing again.
    events = [event for result in ticks.results[released:] for event in result.asset_events]
    assert len(events) == 3 and env.ids() == list(range(10))


def test_stream_definitions_load_and_the_certificate_check_verifies_the_chain(env: Env) -> None:
    stream = faucet_stream(env)
    defs = build_stream_defs([stream], budget_seconds=2)
    dg.Definitions.validate_loadable(defs)
    sensor = defs.resolve_sensor_def(f"{env.stream}_stream")
    env.publish(2_500)
    # Epochs are sealed at 1,000 records or by age (how many depends on the machine's speed).
    ticks = SensorTicks(sensor, None)
    ticks.until(
        lambda: (
            certified_rows(env.store.certificates(env.stream)) >= 2_500
            and ticks.reported[-1:] == [len(env.store.certificates(env.stream))]
        ),
        "2,500 rows certified and reported",
    )
    results = ticks.results
    count = len(env.store.certificates(env.stream))
    assert json.loads(str(results[-1].cursor))["reported_through"] == {env.stream: count}
    events = [e for data in results for e in data.asset_events]
    materializations = [e for e in events if isinstance(e, dg.AssetMaterialization)]
    evaluations = [e for e in events if isinstance(e, dg.AssetCheckEvaluation)]
    assert sum(m.metadata["faucet/rows_written"].value for m in materializations) == 2_500
    # One certificate evaluation per report; the health check once, when the stream first certified.
    assert all(e.passed for e in evaluations) and len(evaluations) == len(materializations) + 1
    [check] = [c for c in defs.asset_checks or [] if CERTIFICATE_CHECK in {k.name for k in c.check_keys}]
    result = check()
    assert result.passed and result.metadata["faucet/certificates_checked"].value == count


def test_a_stream_declared_in_the_component_yaml_runs_through_its_sensor(env: Env) -> None:
    component = FaucetComponent.resolve_from_yaml(
        f"""
connections:
  events: {{connector: nats, config: {{servers: ["{env.nats_url}"]}}}}
  warehouse: {{connector: postgres, config: {{url: "{env.postgres_url}"}}}}
streams:
  - name: {env.stream}
    source:
      connection: events
      config: {{stream: {env.stream}, columns: {{id: "int64 not null", name: string}}}}
    sink: {{connection: warehouse, config: {{table: {env.table}}}}}
    resources: [{env.stream}]
    schemas: {{{env.stream}: {{columns: {{id: "int64 not null", name: string}}, key: [id]}}}}
    epoch: {{records: 400, idle_seconds: 0.3}}
    state_url: "{env.state_url}"
    budget_seconds: 5
    asset: {{key: raw/events, group: streams}}
"""
    )
    defs = component.build_stream_defs()
    dg.Definitions.validate_loadable(defs)
    [spec] = list(defs.assets or [])
    assert isinstance(spec, dg.AssetSpec) and spec.key == dg.AssetKey(["raw", "events"])
    assert spec.group_name == "streams" and spec.kinds == {"faucet", "nats", "postgres"}
    sensor = defs.resolve_sensor_def(f"{env.stream}_stream")
    assert sensor.default_status == dg.DefaultSensorStatus.STOPPED
    env.publish(1_000)
    results = ticks_reporting(sensor, 3)
    materializations = [
        e for data in results for e in data.asset_events if isinstance(e, dg.AssetMaterialization)
    ]
    # One materialization per reporting tick, covering every certificate since the last: how many
    # ticks the three epochs take depends on the machine's speed.
    assert materializations
    assert {m.asset_key for m in materializations} == {dg.AssetKey(["raw", "events"])}
    assert env.ids() == list(range(1_000))
