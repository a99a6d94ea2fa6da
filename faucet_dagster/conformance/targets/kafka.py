"""Kafka: the bounded and the continuous source (a topic and a consumer group)."""

import asyncio
import json
import time
from collections.abc import Callable, Sequence

from faucet_dagster.conformance.setup import Row, SourceSetup
from faucet_dagster.conformance.targets._common import (
    closed_port,
)

KAFKA_PARTITIONS = 2


def kafka_source(kafka_bootstrap: str, unique_name: Callable[..., str]) -> SourceSetup:
    """A fresh topic of two partitions (a row goes to partition ``id % 2``) of JSON records."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    topic, group = unique_name("t"), unique_name("g")
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, KAFKA_PARTITIONS, 1)])[topic].result(timeout=30)

    def produce(values: Sequence[tuple[int, bytes]]) -> None:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
        for key, value in values:
            producer.produce(topic, value, key=str(key).encode(), partition=key % KAFKA_PARTITIONS)
        if producer.flush(30):
            raise TimeoutError(f"records for topic {topic} were not acknowledged")

    async def add_rows(rows: Sequence[Row]) -> None:
        values = [(int(row["id"]), json.dumps(dict(row)).encode()) for row in rows]
        await asyncio.to_thread(produce, values)

    async def add_malformed() -> None:
        await asyncio.to_thread(produce, [(0, b"{not json")])

    def committed() -> str:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group, "enable.auto.commit": False}
        )
        try:
            found = consumer.committed(
                [TopicPartition(topic, p) for p in range(KAFKA_PARTITIONS)], timeout=10
            )
            return ",".join(str(item.offset) for item in found)
        finally:
            consumer.close()

    async def acknowledged() -> str:
        return await asyncio.to_thread(committed)

    def replace_topic() -> None:
        from confluent_kafka import KafkaException

        admin.delete_topics([topic])[topic].result(timeout=30)
        for _ in range(300):  # deletion is asynchronous: create again once the name is free
            try:
                admin.create_topics([NewTopic(topic, KAFKA_PARTITIONS, 1)])[topic].result(timeout=30)
                return
            except KafkaException:
                time.sleep(0.1)
        raise TimeoutError(f"topic {topic} could not be created again")

    async def recreate() -> None:
        await asyncio.to_thread(replace_topic)

    config = {
        "bootstrap_servers": kafka_bootstrap,
        "topics": [topic],
        "group_id": group,
        "batch_size": 100,
        "poll_timeout": 0.1,
        # librdkafka prefetches up to 64 MiB per partition by default (native memory): check 2 sees
        # that as buffering the dataset. These bound what a Kafka read holds.
        "client_properties": {"queued.max.messages.kbytes": "64", "max.partition.fetch.bytes": "65536"},
    }
    return SourceSetup(
        config,
        add_rows,
        resources=(topic,),
        unreachable={**config, "bootstrap_servers": f"127.0.0.1:{closed_port()}", "request_timeout": 2},
        add_malformed=add_malformed,
        acknowledged=acknowledged,
        recreate=recreate,
        domain_of=lambda row: str(int(row["id"]) % KAFKA_PARTITIONS),
    )
