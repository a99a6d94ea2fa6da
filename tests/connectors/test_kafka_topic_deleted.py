"""A Kafka topic deleted (or deleted and recreated) under a live reader: the reading process lives on
and its read ends with a typed error naming the topic and partition, never a crash nor a silent read
of another log.

The broker is Tansu behind the relay of :mod:`faucet_dagster.testing.servers.kafka_shim`: Tansu's own
answer to a deleted topic's Fetch (an all-zero topic id with leader tags) crashes librdkafka 2.16 with
SIGSEGV, which no client setting avoids (a reader idle at the head, fetching, is the one it hits:
4 of 5 runs against Tansu itself); Kafka echoes the id asked for, and so does the relay. The reader
runs in a process of its own so a crash is seen as its exit code, not as the test's."""

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kafka_topics import create_topic, delete_topic, produce_json

from faucet_dagster.testing.servers import ConformantFetchKafkaServer

READER = Path(__file__).parent.parent / "kafka_live_reader.py"


@pytest.fixture(scope="module")
def relayed_bootstrap() -> Iterator[str]:
    server = ConformantFetchKafkaServer()
    try:
        yield server.start().bootstrap
    finally:
        server.close()


def reader_after(bootstrap: str, topic: str, change: Callable[[], None], *, at_head: bool) -> tuple[int, str]:
    """Start the reader, apply ``change`` once it reads (``at_head``: once a read found nothing new),
    return its exit code and output."""
    reader = subprocess.Popen(
        [sys.executable, str(READER), bootstrap, topic, *(["head"] if at_head else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert reader.stdout is not None
    first = reader.stdout.readline()
    assert first.strip() == "reading", first + reader.stdout.read()
    change()
    try:
        out, _ = reader.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        reader.kill()
        out, _ = reader.communicate()
    return reader.returncode, out


@pytest.mark.parametrize(
    ("recreated", "at_head"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["deleted", "recreated", "deleted-at-head", "recreated-at-head"],
)
def test_a_topic_deleted_under_a_live_reader_ends_its_read_with_a_typed_error(
    relayed_bootstrap: str, unique_name: Callable[..., str], recreated: bool, at_head: bool
) -> None:
    """``at_head``: the reader has read everything before the deletion, so every read after it
    delivers nothing; the deletion must still end one (under load, the plain case often ends up
    there too: the reader drains 400 records before the deletion lands)."""
    topic = unique_name("topic")
    create_topic(relayed_bootstrap, topic, 2)
    produce_json(relayed_bootstrap, topic, 0, 400, partitions=2)

    def change() -> None:
        delete_topic(relayed_bootstrap, topic)
        if recreated:
            create_topic(relayed_bootstrap, topic, 2)
            produce_json(relayed_bootstrap, topic, 1000, 400, partitions=2)

    code, out = reader_after(relayed_bootstrap, topic, change, at_head=at_head)
    assert code == 0, f"the reader exited with {code} (-11: SIGSEGV; 1: 60 s of reads, no error): {out}"
    # Recreated: the read that ends first sees the topic gone, or a new one in its place.
    expected = ("IncarnationChanged", "PositionUnavailable") if recreated else ("PositionUnavailable",)
    assert any(f"raised {name}" in out for name in expected), out
    assert f"topic {topic} partition 0" in out, out
