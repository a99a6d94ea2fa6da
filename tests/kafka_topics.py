"""Kafka helpers shared by the tests: topics, producing, and reading a group's committed offsets."""

import json
from collections.abc import Sequence

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(timeout=30)


def delete_topic(bootstrap: str, name: str) -> None:
    """Delete ``name``; close every consumer assigned to it first (DESIGN.md section 8)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([name])[name].result(timeout=30)


def produce(
    bootstrap: str, topic: str, values: Sequence[bytes], *, partitions: int = 4, start: int = 0
) -> None:
    """Produce ``values``, the ``n``-th to partition ``(start + n) % partitions``, keyed by that
    number, several records per batch (linger); returns when every record was acknowledged."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10_000})
    for index, value in enumerate(values, start):
        while True:
            try:
                producer.produce(topic, value, key=str(index).encode(), partition=index % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(60) == 0


def produce_json(bootstrap: str, topic: str, start: int, count: int, *, partitions: int = 4) -> None:
    """Produce ``{"id": i, "name": "n<i>"}`` for ``i`` in ``start .. start + count - 1``."""
    values = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(start, start + count)]
    produce(bootstrap, topic, values, partitions=partitions, start=start)


def committed(bootstrap: str, topic: str, group: str, partitions: int = 4) -> dict[int, int]:
    """The offsets ``group`` committed per partition (-1001: none)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in found}
    finally:
        consumer.close()
