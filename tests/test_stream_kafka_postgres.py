"""Kafka to PostgreSQL (APPEND with the per-partition watermark) through the continuous runner and
sensor ticks: the real broker, PostgreSQL and state store.

The interruption after the destination commit and before the certificate is injected at the exact
point the certificate is persisted: the replay must leave no duplicate (rows at or below the
watermark are dropped) and the certificate must be recovered.
"""

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kafka_topics import committed, create_topic, produce
from stream_ticks import chained_ends, evaluate_ticks, lose_certificate

from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster.protocol import ConnectionFailed, EpochCertificate, ReadLimits
from faucet_dagster.runner.continuous import StreamRunner
from faucet_dagster.state import StateStore
from faucet_dagster.streams.declaration import FaucetStream

PARTITIONS = 4


def produce_dataset(bootstrap: str, topic: str, start: int, count: int) -> None:
    values = [
        json.dumps({"id": i, "name": f"user-{i}", "score": i * 0.5}).encode()
        for i in range(start, start + count)
    ]
    produce(bootstrap, topic, values, partitions=PARTITIONS, start=start)


def table_ids(url: str, table: str) -> list[int]:
    with psycopg.connect(url) as connection:
        return [row[0] for row in connection.execute(f'SELECT id FROM "{table}" ORDER BY id')]


@pytest.fixture
def stream(
    kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> FaucetStream:
    topic, group = unique_name("topic"), unique_name("group")
    create_topic(kafka_bootstrap, topic, PARTITIONS)
    kafka = FaucetConnection(
        connector="kafka", config={"bootstrap_servers": kafka_bootstrap, "group_id": group}
    )
    postgres = FaucetConnection(connector="postgres", config={"url": postgres_url})
    return FaucetStream(
        name=unique_name("stream"),
        source=kafka.using(topics=[topic]),
        sink=postgres.using(table="orders"),
        resources=(topic,),
        limits=ReadLimits(records=20_000, idle=0.5),
        state_url=f"sqlite:///{tmp_path / 'state.db'}",
    )


def topic_and_group(stream: FaucetStream) -> tuple[str, str]:
    config: Any = stream.source.config
    connection: Any = stream.source.connection
    return config["topics"][0], connection.config["group_id"]


def test_100k_kafka_messages_reach_postgres_once_through_sensor_ticks(
    kafka_bootstrap: str, postgres_url: str, stream: FaucetStream
) -> None:
    topic, group = topic_and_group(stream)
    sequences, certificates = evaluate_ticks(
        stream,
        [partial(produce_dataset, kafka_bootstrap, topic, batch * 50_000, 50_000) for batch in range(2)],
        budget_seconds=25,
        rows=100_000,
    )
    assert sequences == [c.sequence for c in certificates] == list(range(1, len(certificates) + 1))
    assert sum(sum(c.row_counts.values()) for c in certificates) == 100_000
    assert {c.delivery.value for c in certificates} == {"effectively_once"}
    assert chained_ends(certificates) == {str(p): "24999" for p in range(PARTITIONS)}
    assert table_ids(postgres_url, "orders") == list(range(100_000))
    assert committed(kafka_bootstrap, topic, group) == {p: 25_000 for p in range(PARTITIONS)}


def test_crash_after_the_postgres_commit_before_the_certificate_replays_without_duplicates(
    kafka_bootstrap: str, postgres_url: str, stream: FaucetStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic, group = topic_and_group(stream)
    produce_dataset(kafka_bootstrap, topic, 0, 1200)
    assert stream.state_url is not None
    store = StateStore(stream.state_url)
    lose_certificate(store, monkeypatch, 2)
    # Small epochs, so an epoch covers some partitions only and the recovery must reach the others.
    spec = replace(stream.build_spec(), limits=ReadLimits(records=700, idle=0.5))

    async def scenario() -> list[EpochCertificate]:
        runner = StreamRunner(spec, store, worker_id="w1")
        try:
            first = await runner.run_epoch()
            assert first is not None
            with pytest.raises(ConnectionFailed):
                await runner.run_epoch()  # committed in PostgreSQL, then the certificate is lost
            assert len(table_ids(postgres_url, "orders")) > sum(first.row_counts.values()), (
                "the sink is ahead"
            )
            return [first, *await runner.run_epochs(budget_seconds=20)]
        finally:
            await runner.close()

    certificates = asyncio.run(scenario())
    store.close()
    assert [c.sequence for c in certificates] == list(range(1, len(certificates) + 1))
    chained_ends(certificates)
    assert table_ids(postgres_url, "orders") == list(range(1200)), "every record once"
    assert committed(kafka_bootstrap, topic, group) == {p: 300 for p in range(PARTITIONS)}
