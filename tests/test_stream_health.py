"""Stream health a user sees in Dagster, on real servers: each certificate's lag behind the source's
head (NATS messages and seconds, Kafka offsets, PostgreSQL WAL bytes), the epoch's numbers Dagster plots,
``faucet/rows_written`` rather than ``dagster/row_count``, the ``faucet_stream_health`` check failing
on a stalled stream with the reason and the remedy, and the lag in ``faucet streams status``.
"""

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import nats
import psycopg
import pytest
from faucet_nats.source import NatsStreamSession
from faucet_postgres.codecs import PostgresLsnCodec
from kafka_topics import create_topic, produce_json
from stream_ticks import SensorTicks, sensor_context, ticks_reporting

from faucet_dagster.cli.main import main
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.protocol import (
    ConnectionFailed,
    EpochCertificate,
    ReadLimits,
    SourceLag,
    WritePolicy,
)
from faucet_dagster.runner import continuous
from faucet_dagster.runner.continuous import StreamRunner
from faucet_dagster.state import StateStore
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.health import HEALTH_CHECK, health_check
from faucet_dagster.streams.reports import Report, report_metadata
from faucet_dagster.streams.runner_cache import close_cached_streams
from faucet_dagster.streams.sensor import faucet_stream_sensor, tick_budget
from faucet_dagster.testing import PostgresServer

COLUMNS = {"id": "int64 not null", "name": "string"}


class NatsEnv:
    """One test's JetStream stream, PostgreSQL database and state store."""

    def __init__(self, nats_url: str, postgres_url: str, name: str, tmp_path: Path) -> None:
        self.nats_url = nats_url
        self.postgres_url = postgres_url
        self.name = name
        self.table = f"{name}_rows"
        self.state_url = f"sqlite:///{tmp_path / 'faucet_state.db'}"
        self.store = StateStore(self.state_url)
        self.published = 0

    def stream(self, records: int = 1_000) -> FaucetStream:
        source = {"servers": [self.nats_url], "stream": self.name, "columns": COLUMNS}
        return FaucetStream(
            name=self.name,
            source=FaucetEndpoint(FaucetConnection(connector="nats", config=source)),
            sink=FaucetEndpoint(
                FaucetConnection(connector="postgres", config={"url": self.postgres_url, "table": self.table})
            ),
            resources=(self.name,),
            limits=ReadLimits(records=records, idle=0.3),
            lease_seconds=30,
            state_url=self.state_url,
        )

    def publish(self, count: int) -> None:
        """Publish ``count`` messages with the next ids; returns once JetStream stored them."""
        first = self.published

        async def send() -> None:
            client = await nats.connect(self.nats_url)
            try:
                js = client.jetstream()
                for n in range(first, first + count):
                    await js.publish(f"{self.name}.rows", json.dumps({"id": n, "name": f"r{n}"}).encode())
            finally:
                await client.close()

        asyncio.run(send())
        self.published += count


@pytest.fixture
def env(
    nats_url: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> Iterator[NatsEnv]:
    created = NatsEnv(nats_url, postgres_url, unique_name("h"), tmp_path)

    async def create() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(name=created.name, subjects=[f"{created.name}.>"])
        finally:
            await client.close()

    asyncio.run(create())
    yield created
    close_cached_streams()
    created.store.close()


def database_name(url: str) -> str:
    with psycopg.connect(url) as conn:
        return conn.info.dbname


def materializations(result: dg.SensorResult | Any) -> list[dg.AssetMaterialization]:
    return [event for event in result.asset_events if isinstance(event, dg.AssetMaterialization)]


def health(result: dg.SensorResult | Any) -> list[dg.AssetCheckEvaluation]:
    return [
        event
        for event in result.asset_events
        if isinstance(event, dg.AssetCheckEvaluation) and event.check_name == HEALTH_CHECK
    ]


def value(metadata: Any, key: str) -> Any:
    return metadata[key].value


def one_epoch(stream: FaucetStream, store: StateStore, limits: ReadLimits | None = None) -> EpochCertificate:
    """Run one epoch of ``stream`` with a runner of its own, then close it; its certificate."""
    runner = StreamRunner(stream.build_spec(), store, worker_id="w1")

    async def scenario() -> EpochCertificate | None:
        try:
            return await runner.run_epoch(limits)
        finally:
            await runner.close()

    certificate = asyncio.run(scenario())
    assert certificate is not None, "the epoch certified nothing"
    return certificate


# -- lag and the plotted numbers ------------------------------------------------------------------


def test_each_certificate_carries_its_lag_behind_the_nats_head_and_the_epochs_numbers(
    env: NatsEnv, capsys: pytest.CaptureFixture[str]
) -> None:
    env.publish(2_500)
    sensor = faucet_stream_sensor(env.stream(records=1_000), budget_seconds=20)
    with dg.instance_for_test() as instance:
        results = ticks_reporting(sensor, 3, instance)
    reports = [(m.metadata, m.description) for result in results for m in materializations(result)]
    result = results[-1]
    # One materialization a tick, whatever it certified: its numbers are the tick's, its lag the newest
    # certificate's, the one the tick's reason states (never an older epoch's lag beside "lag 0").
    assert sum(value(m, "faucet/epochs") for m, _ in reports) == 3
    assert sum(value(m, "faucet/rows_written") for m, _ in reports) == 2_500
    for m, description in reports:
        assert str(description).startswith("certified ")
        lag = value(m, "faucet/lag_positions")
        assert f"lag {lag} messages" in str(description) or (lag == 0 and "lag 0 messages" in description)
    [[last, _]] = [r for r in reports[-1:]]
    assert value(last, "faucet/lag_positions") == 0 and value(last, "faucet/lag_seconds") == 0
    assert "lag 0 messages (caught up)" in str(result.skip_message)
    assert {value(m, "faucet/lag_unit") for m, _ in reports} == {"messages"}
    # The epochs' rows have their own key; dagster/row_count would mean the table's rows.
    assert all("dagster/row_count" not in m for m, _ in reports)
    assert {value(m, "dagster/table_name") for m, _ in reports} == {
        f"{database_name(env.postgres_url)}.public.{env.table}"
    }
    for m, _ in reports:
        # Numbers a plot draws are numbers; identifiers a plot must not draw are text.
        for measure in ("faucet/rows_per_second", "faucet/busy_seconds"):
            assert isinstance(m[measure], dg.FloatMetadataValue) and value(m, measure) > 0
        for measure in ("faucet/epochs", "faucet/rows_written", "faucet/lag_positions"):
            assert isinstance(m[measure], dg.IntMetadataValue)
        for identifier in ("faucet/first_sequence", "faucet/last_sequence", "faucet/fencing_token"):
            assert isinstance(m[identifier], dg.TextMetadataValue)
        assert value(m, "faucet/rows_dead_lettered") == "0"
        assert "blake2b-256" in value(m, "faucet/digest_covers")
        domains = [record.data["domain"] for record in value(m, "faucet/coverage").records]
        assert domains == [f"nats/{env.name}"], "a domain is shown without its incarnation"
    sequences = [
        int(record.data["sequence"]) for m, _ in reports for record in value(m, "faucet/certificates").records
    ]
    assert sequences == [1, 2, 3]
    [passed] = [e for r in results for e in health(r)]  # reported once: when the stream first certified
    assert passed.passed
    assert "stalled" not in str(result.skip_message)

    certificates = env.store.certificates(env.name)
    [first] = certificates[0].lag
    assert (first.position, first.head, first.behind, first.unit) == ("1000", "2500", 1_500, "messages")
    assert EpochCertificate.from_json(certificates[0].to_json()).lag == certificates[0].lag

    assert main(["streams", "status", env.name, "--state-url", env.state_url]) == 0
    out = capsys.readouterr().out
    assert f"lag at epoch 3 (certified {certificates[-1].created_at}):" in out
    assert "0 messages (0.0s) behind in" in out
    assert main(["streams", "status", env.name, "--state-url", env.state_url, "--json"]) == 0
    [status] = json.loads(capsys.readouterr().out)
    assert [item["behind"] for item in status["lag"]] == [0]


def test_the_nats_lag_in_seconds_is_the_age_of_the_certified_message_against_the_newest(env: NatsEnv) -> None:
    env.publish(10)
    time.sleep(1.5)
    env.publish(10)
    certificate = one_epoch(env.stream(), env.store, ReadLimits(records=10, idle=0.3))
    [lag] = certificate.lag
    assert (lag.position, lag.head, lag.behind) == ("10", "20", 10)
    # Message 10 was stored at least 1.5 s before message 20 (server timestamps).
    assert lag.seconds is not None and 1.5 <= lag.seconds < 120


def test_the_kafka_lag_is_the_offsets_after_each_certified_partition_end(
    kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    topic = unique_name("topic")
    create_topic(kafka_bootstrap, topic, 4)
    produce_json(kafka_bootstrap, topic, 0, 1_000, partitions=4)
    kafka = FaucetConnection(
        connector="kafka", config={"bootstrap_servers": kafka_bootstrap, "group_id": unique_name("group")}
    )
    stream = FaucetStream(
        name=unique_name("stream"),
        source=kafka.using(topics=[topic]),
        sink=FaucetConnection(connector="postgres", config={"url": postgres_url}).using(table="orders"),
        resources=(topic,),
        limits=ReadLimits(records=100, idle=0.5),
        state_url=f"sqlite:///{tmp_path / 'state.db'}",
    )
    with StateStore(stream.state_url) as store:
        certificate = one_epoch(stream, store)
    assert sum(certificate.row_counts.values()) == 100
    assert len(certificate.lag) == 4 and {item.unit for item in certificate.lag} == {"offsets"}
    # 250 records per partition: offsets 0 to 249, the head is 249 in each.
    assert {item.head for item in certificate.lag} == {"249"}
    assert sum(item.behind for item in certificate.lag) == 900
    ends = {item.domain: int(item.end) for item in certificate.coverage}
    for item in certificate.lag:
        read = ends[item.domain] + 1 if item.domain in ends else 0
        assert item.behind == 250 - read and item.seconds is None


# -- a stalled stream ------------------------------------------------------------------------------


def test_a_stalled_stream_fails_the_health_check_once_with_the_reason_and_the_remedy(env: NatsEnv) -> None:
    env.publish(10)
    stream = env.stream()
    key = stream.asset_spec().key
    sensor = faucet_stream_sensor(stream, budget_seconds=5)
    on_demand = health_check(env.state_url, [env.name], key)
    with dg.instance_for_test() as instance:
        # Another worker holds the lease: a warning naming it, not "0 runs requested".
        held = env.store.acquire_lease(env.name, "another-code-server", 30)
        result = sensor.evaluate_tick(sensor_context(sensor, instance, None))
        [waiting] = health(result)
        assert not waiting.passed and waiting.severity == dg.AssetCheckSeverity.WARN
        assert "waiting on a lease another worker holds: another-code-server" in value(
            waiting.metadata, "faucet/reason"
        )
        assert f"faucet streams release --force {env.name}" in value(waiting.metadata, "faucet/remedy")
        assert str(result.skip_message).startswith("stalled: waiting on a lease")
        assert "Remedy:" in str(result.skip_message) and materializations(result) == []

        # Marked uncertain (before the lease is released, so that the background reader, waiting on the
        # lease, finds the stream uncertain, not free): the stream is halted. The tick does not fail (its
        # stack trace would fill the daemon's log on every tick): it says so, and the check fails once,
        # with the remedy. A later tick says halted, once the reader met the mark.
        env.store.mark_uncertain(env.name, "the previous worker's close timed out")
        env.store.release_lease(held)
        ticks = SensorTicks(sensor, instance)
        ticks.cursor = result.cursor
        first = ticks.until_halted("uncertain")
        [failing] = health(first)
        assert not failing.passed and failing.severity == dg.AssetCheckSeverity.ERROR
        assert "halted on UncertainOutcome" in str(failing.description)
        assert "faucet streams release" in value(failing.metadata, "faucet/remedy")
        reasons = [str(first.skip_message)]
        for _ in range(2):
            later = ticks.tick()
            reasons.append(str(later.skip_message))
            assert health(later) == [], "a halt is reported to the check once, not on every tick"
        assert [reason.split(": ", 1)[0].split(" (")[-1] for reason in reasons] == [
            "1 tick)",
            "2 ticks)",
            "3 ticks)",
        ]
        assert all(
            r.startswith("halted since ") and "Remedy:" in r and "faucet streams release" in r
            for r in reasons
        )
        evaluated = on_demand()
        assert not evaluated.passed and "marked uncertain" in str(evaluated.description)

        # Released: the stream certifies again and the check passes again.
        env.store.release(env.name)
        released = len(ticks.results)
        ticks.until(lambda: bool(ticks.reported), "a certificate after the release")
        after = ticks.results[released:]
        assert sum(len(materializations(r)) for r in after) == 1
        assert [e.passed for r in after for e in health(r)] == [True]
        assert on_demand().passed


def test_a_tick_writes_what_it_did_to_its_log_and_an_idle_one_leaves_the_instance_closed(
    env: NatsEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code server evaluates a tick with an instance ref: ``context.log`` opens the instance (and
    stores the tick's log at its end), inside the daemon's serial sensor loop. A tick that reported
    something writes its summary there ("View logs"); one with nothing to say leaves it closed."""
    env.publish(10)
    sensor = faucet_stream_sensor(env.stream(), budget_seconds=20)
    # Certified in the background; the tick below reports it (its cursor is none: from the store's mark).
    ticks_reporting(sensor, 1)
    opened: list[object] = []
    from_ref = dg.DagsterInstance.from_ref

    def counting(ref: Any) -> dg.DagsterInstance:
        opened.append(ref)
        return from_ref(ref)

    monkeypatch.setattr(dg.DagsterInstance, "from_ref", staticmethod(counting))

    def tick(instance: dg.DagsterInstance, cursor: str | None, n: int) -> Any:
        with dg.SensorEvaluationContext(
            instance_ref=instance.get_ref(),
            last_tick_completion_time=None,
            last_run_key=None,
            cursor=cursor,
            log_key=["faucet", sensor.name, str(n)],
            repository_name="__repository__",
            repository_def=sensor_context(sensor).repository_def,
            sensor_name=sensor.name,
        ) as context:
            return sensor.evaluate_tick(context)

    with dg.instance_for_test() as instance:
        result = tick(instance, None, 1)
        assert len(materializations(result)) == 1 and [e.passed for e in health(result)] == [True]
        assert str(result.skip_message).startswith("certified 1 epoch (1 to 1), 10 rows; lag ")
        assert materializations(result)[0].description == result.skip_message
        assert opened, "the tick's summary went to its log"
        opened.clear()
        idle = tick(instance, result.cursor, 2)
        assert idle.asset_events == [] and "nothing new" in str(idle.skip_message)
        assert opened == []


def test_the_default_budget_leaves_what_a_tick_costs_the_daemon_out_of_the_streams_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS", raising=False)
    # Five streams share 30 s: 4.8 s each as the daemon sees a tick, its own 0.5 s of it included.
    assert tick_budget(interval=30, streams=5) == pytest.approx(4.3)
    assert tick_budget(interval=30, streams=10) == 2.0  # never below 2 s
    assert tick_budget(interval=30) == 10.0 and tick_budget(3.0, interval=30, streams=10) == 3.0


def test_a_default_tick_that_starts_the_reader_leaves_the_first_epoch_to_the_background(
    env: NatsEnv,
) -> None:
    """The daemon evaluates a code location's sensors one at a time and gives its locations new code
    servers every 60 s: a tick that starts its stream's reader does not hold the loop while the reader
    takes the lease, opens the sessions and reads; the next tick reports that first epoch."""
    env.publish(10)
    sensor = faucet_stream_sensor(env.stream())  # the default budget
    with dg.instance_for_test() as instance:
        first = sensor.evaluate_tick(sensor_context(sensor, instance, None))
        assert materializations(first) == [] and health(first) == []
        assert str(first.skip_message).startswith("started reading in this process")
        ends = time.monotonic() + 120
        while not env.store.certificates(env.name):
            assert time.monotonic() < ends, "the first epoch was not certified in the background"
            time.sleep(0.1)
        second = sensor.evaluate_tick(sensor_context(sensor, instance, first.cursor))
    [materialization] = materializations(second)
    assert value(materialization.metadata, "faucet/rows_written") == 10
    assert [e.passed for e in health(second)] == [True]


def test_the_cdc_lag_is_the_wal_after_the_certified_transaction(
    postgres_url: str, postgres_server: PostgresServer, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    slot, replica = unique_name("cdc"), unique_name("replica")
    target_url = postgres_server.create_database(replica)
    sink = {"url": target_url, "tables": {"public.lines": "lines"}}

    def execute(statement: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(postgres_url) as conn:
            cursor = conn.execute(statement)
            return cursor.fetchall() if cursor.description else []

    def flushed() -> int:
        [(lsn,)] = execute("SELECT pg_current_wal_flush_lsn()::text")
        return PostgresLsnCodec().validate(lsn)

    execute("CREATE TABLE lines (id int PRIMARY KEY, qty int)")
    source = FaucetConnection(
        connector="postgres",
        config={
            "url": postgres_url,
            "slot": slot,
            "publication": f"{slot}_pub",
            "tables": ["public.lines"],
            "heartbeat_interval": 0,
            "poll_interval": 0.05,
        },
    )
    assert source.setup_replication()["slot_created"]
    execute("INSERT INTO lines SELECT g, g FROM generate_series(1, 10) g")
    after_first = flushed()
    execute("INSERT INTO lines SELECT g, g FROM generate_series(11, 5000) g")
    after_second = flushed()
    stream = FaucetStream(
        name=slot,
        source=FaucetEndpoint(source),
        sink=FaucetEndpoint(FaucetConnection(connector="postgres", config=sink)),
        resources=("public.lines",),
        policy=WritePolicy.APPLY_CHANGES,
        limits=ReadLimits(records=5, idle=0.3),
        state_url=f"sqlite:///{tmp_path / 'state.db'}",
    )
    try:
        with StateStore(stream.state_url) as store:
            certificate = one_epoch(stream, store)
    finally:
        postgres_server.drop_database(replica)
    # The epoch ends at the first transaction's commit; the second one's WAL is all behind.
    assert certificate.row_counts == {"public.lines": 10}
    [lag] = certificate.lag
    [covered] = certificate.coverage
    assert lag.unit == "WAL bytes" and lag.seconds is None and lag.position == covered.end
    assert PostgresLsnCodec().validate(str(lag.head)) >= after_second
    assert lag.behind >= after_second - after_first > 0


def test_a_source_that_cannot_say_its_lag_still_certifies_without_it(
    env: NatsEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lag is informational: failing or hanging at the exact point it is read, it is left out."""

    async def fails(self: NatsStreamSession) -> tuple[SourceLag, ...]:
        raise ConnectionFailed("the server went away while asked for its head", where="test")

    async def hangs(self: NatsStreamSession) -> tuple[SourceLag, ...]:
        await asyncio.sleep(60)
        return ()

    monkeypatch.setattr(continuous, "LAG_TIMEOUT", 0.5)
    for lag in (fails, hangs):
        monkeypatch.setattr(NatsStreamSession, "lag", lag)
        env.publish(10)
        started = time.monotonic()
        certificate = one_epoch(env.stream(), env.store)
        assert certificate.lag == () and sum(certificate.row_counts.values()) == 10
        assert time.monotonic() - started < 30
    metadata = report_metadata(Report((certificate,)))
    assert "faucet/lag_positions" not in metadata and "faucet/rows_written" in metadata
