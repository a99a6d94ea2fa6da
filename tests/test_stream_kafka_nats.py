"""Kafka to NATS JetStream through the continuous runner: the real broker, NATS and state store.

Every record lands once (the NATS sink suppresses replays by event identity within the stream's
duplicate window), certificates chain per partition, and the Kafka group's offsets follow the
certificates. The interruption after the destination commit and before the certificate is injected
at the exact point the certificate is persisted.
"""

import asyncio
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import nats
import pytest
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.source import KafkaStreamSource
from faucet_nats.sink import NatsStreamingSink
from faucet_nats.sink_config import NatsSinkConfig
from kafka_topics import committed, create_topic, produce_json
from stream_ticks import chained_ends, evaluate_ticks, lose_certificate, stored_ids

from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster.pipeline import PipelineOptions
from faucet_dagster.protocol import ConnectionFailed, EpochCertificate, ReadLimits
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore
from faucet_dagster.streams.declaration import FaucetStream

PARTITIONS = 4


@pytest.fixture
def pair(
    kafka_bootstrap: str, nats_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> dict[str, Any]:
    topic, group, target = unique_name("topic"), unique_name("group"), unique_name("out")
    create_topic(kafka_bootstrap, topic, PARTITIONS)

    async def create_stream() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(name=target, subjects=[f"{target}.rows"], duplicate_window=60)
        finally:
            await client.close()

    asyncio.run(create_stream())
    source = KafkaStreamSource(
        KafkaSourceConfig(bootstrap_servers=kafka_bootstrap, topics=(topic,), group_id=group)
    )
    sink = NatsStreamingSink(
        NatsSinkConfig(
            servers=(nats_url,),
            stream=target,
            subject=f"{target}.rows",
            duplicate_window=60,
            watermark_bucket=f"w_{target}",
        )
    )
    spec = StreamSpec(
        name=unique_name("stream"),
        source=source,
        sink=sink,
        resources=(topic,),
        limits=ReadLimits(records=700, idle=0.5),
    )
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    return {"topic": topic, "group": group, "target": target, "spec": spec, "store": store}


def test_kafka_to_nats_lands_every_record_once_with_chained_certificates(
    kafka_bootstrap: str, nats_url: str, pair: dict[str, Any]
) -> None:
    store: StateStore = pair["store"]
    produce_json(kafka_bootstrap, pair["topic"], 0, 2000)

    async def scenario() -> list[EpochCertificate]:
        runner = StreamRunner(pair["spec"], store, worker_id="w1")
        try:
            first = await runner.run_epochs(budget_seconds=30)
            produce_json(kafka_bootstrap, pair["topic"], 2000, 500)
            return first + await runner.run_epochs(budget_seconds=30)
        finally:
            await runner.close()

    certificates = asyncio.run(scenario())
    assert [c.sequence for c in certificates] == list(range(1, len(certificates) + 1))
    assert len(certificates) >= 4  # 2,500 records in epochs of at most 700
    assert sum(sum(c.row_counts.values()) for c in certificates) == 2500
    assert sum(r.rows_written for c in certificates for r in c.receipts) == 2500
    ends = chained_ends(certificates)
    assert ends == {str(p): "624" for p in range(PARTITIONS)}
    assert sorted(asyncio.run(stored_ids(nats_url, pair["target"]))) == list(range(2500))
    assert committed(kafka_bootstrap, pair["topic"], pair["group"]) == {p: 625 for p in range(PARTITIONS)}


def test_a_stop_after_the_open_epoch_published_certifies_it_instead_of_rolling_it_back(
    kafka_bootstrap: str, nats_url: str, pair: dict[str, Any]
) -> None:
    """NATS cannot take back what an epoch published. A stop (``cancel``) that lands after the open
    epoch published part of its rows lets the epoch end at its next safe boundary and certifies it;
    a rollback would leave those rows to the next owner, stored twice once the duplicate window passed.
    The read after the stop is interrupted."""
    store: StateStore = pair["store"]
    topic, target = pair["topic"], pair["target"]
    # No idle or age limit: the epoch ends only at 800 records, so the stop lands in its read.
    spec = replace(pair["spec"], limits=ReadLimits(records=800), pipeline=PipelineOptions(batch_rows=100))
    produce_json(kafka_bootstrap, topic, 0, 400)

    async def scenario() -> tuple[EpochCertificate | None, list[int], EpochCertificate | None]:
        runner = StreamRunner(spec, store, worker_id="w1")
        try:
            epoch = asyncio.ensure_future(runner.run_epoch())
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 120
            while not await stored_ids(nats_url, target):
                assert loop.time() < give_up, "the open epoch published nothing within 120s"
                assert not epoch.done(), "the epoch ended before it published"
                await asyncio.sleep(0.05)
            runner.cancel()
            await asyncio.to_thread(produce_json, kafka_bootstrap, topic, 400, 400)
            certificate = await asyncio.wait_for(epoch, 120)
            after = await asyncio.wait_for(runner.run_epoch(), 120)
            return certificate, await stored_ids(nats_url, target), after
        finally:
            await runner.close()

    certificate, published, after = asyncio.run(scenario())
    assert certificate is not None, "the stop rolled back an epoch that had published"
    assert sum(certificate.row_counts.values()) == 800
    assert sorted(published) == list(range(800))
    assert after is None
    assert store.certified_positions(spec.name), "the stopped epoch's positions are certified"


def test_crash_after_the_nats_commit_before_the_certificate_replays_without_duplicates(
    kafka_bootstrap: str, nats_url: str, pair: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    store: StateStore = pair["store"]
    produce_json(kafka_bootstrap, pair["topic"], 0, 1200)
    lose_certificate(store, monkeypatch, 2)

    async def scenario() -> list[EpochCertificate]:
        runner = StreamRunner(pair["spec"], store, worker_id="w1")
        try:
            certificates = [c for c in [await runner.run_epoch()] if c is not None]
            with pytest.raises(ConnectionFailed):
                await runner.run_epoch()  # committed at NATS, then the certificate is lost
            certified_rows = sum(certificates[0].row_counts.values())
            assert len(await stored_ids(nats_url, pair["target"])) > certified_rows, "NATS is ahead"
            certificates += await runner.run_epochs(budget_seconds=30)
            return certificates
        finally:
            await runner.close()

    certificates = asyncio.run(scenario())
    assert [c.sequence for c in certificates] == list(range(1, len(certificates) + 1))
    chained_ends(certificates)
    recovered = certificates[1]
    assert sum(r.rows_skipped for r in recovered.receipts) > 0, "the replay was suppressed by the stream"
    ids = asyncio.run(stored_ids(nats_url, pair["target"]))
    assert sorted(ids) == list(range(1200)), "every record once: no loss, no duplicate"
    assert committed(kafka_bootstrap, pair["topic"], pair["group"]) == {p: 300 for p in range(PARTITIONS)}


def test_kafka_to_nats_through_sensor_ticks_reports_each_certificate_once(
    kafka_bootstrap: str, nats_url: str, pair: dict[str, Any], tmp_path: Path
) -> None:
    spec: StreamSpec = pair["spec"]
    source, sink = spec.source, spec.sink
    assert isinstance(source, KafkaStreamSource) and isinstance(sink, NatsStreamingSink)
    stream = FaucetStream(
        name=spec.name,
        source=FaucetConnection(connector="kafka", config=source.config.model_dump(mode="json")).using(),
        sink=FaucetConnection(connector="nats", config=sink.config.model_dump(mode="json")).using(),
        resources=spec.resources,
        limits=spec.limits,
        state_url=f"sqlite:///{tmp_path / 'sensor-state.db'}",
    )
    sequences, certificates = evaluate_ticks(
        stream,
        [partial(produce_json, kafka_bootstrap, pair["topic"], batch * 600, 600) for batch in range(3)],
        rows=1800,
    )
    assert sequences == list(range(1, len(sequences) + 1)), "each certificate reported once, in order"
    assert [c.sequence for c in certificates] == sequences
    assert chained_ends(certificates) == {str(p): "449" for p in range(PARTITIONS)}
    assert sorted(asyncio.run(stored_ids(nats_url, pair["target"]))) == list(range(1800))
    assert committed(kafka_bootstrap, pair["topic"], pair["group"]) == {p: 450 for p in range(PARTITIONS)}
