"""Publish sample order events for the example's streams.

``python -m example_project.publish nats|kafka [COUNT]`` publishes COUNT (default 10,000) order events
to the server named by ``$FAUCET_EXAMPLE_NATS_URL`` or ``$FAUCET_EXAMPLE_KAFKA_BOOTSTRAP``, creating
what the streams in ``defs/streams/defs.yaml`` read when it is missing: the JetStream stream
``ORDER_EVENTS`` (subjects ``order_events.>``, file storage) or the 4-partition Kafka topic
``order_events``. It returns once the server acknowledged every event. Each event is a JSON object, a
status change of one of the sample orders::

    {"event_id": "5f0c...", "order_id": 1234, "status": "shipped", "amount": 42.5}

Exit status: 0 when every event was acknowledged, 1 when the server refused or could not be reached
(the reason is printed), 2 on bad arguments.
"""

import argparse
import asyncio
import json
import os
import random
import sys
import uuid
from collections.abc import Sequence

import nats
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from example_project import KAFKA_BOOTSTRAP_ENV, NATS_URL_ENV
from example_project.sample_data import MONTHS, ORDERS_PER_MONTH, STATUSES

NATS_STREAM = "ORDER_EVENTS"
NATS_SUBJECT = "order_events.status"
KAFKA_TOPIC = "order_events"
KAFKA_PARTITIONS = 4
PUBLISH_WINDOW = 1_000
"""JetStream publishes awaiting their acknowledgement at once."""


def order_events(count: int) -> list[dict[str, object]]:
    """``count`` fresh events: a new ``event_id`` each, for random sample orders."""
    rng = random.Random()
    return [
        {
            "event_id": uuid.uuid4().hex,
            "order_id": rng.randint(1, MONTHS * ORDERS_PER_MONTH),
            "status": rng.choice(STATUSES),
            "amount": round(rng.uniform(3, 400), 2),
        }
        for _ in range(count)
    ]


async def ensure_nats_stream(js: JetStreamContext) -> None:
    """Create the JetStream stream ``ORDER_EVENTS`` unless it exists (the stream's source reads it)."""
    try:
        await js.stream_info(NATS_STREAM)
    except NotFoundError:
        await js.add_stream(name=NATS_STREAM, subjects=["order_events.>"])


def ensure_kafka_topic(bootstrap: str) -> None:
    """Create the topic ``order_events`` unless it exists (the stream's source reads it)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    if KAFKA_TOPIC not in admin.list_topics(timeout=10).topics:
        admin.create_topics([NewTopic(KAFKA_TOPIC, KAFKA_PARTITIONS, 1)])[KAFKA_TOPIC].result(30)


async def publish_nats(url: str, events: Sequence[dict[str, object]]) -> int:
    """Publish ``events`` to ``ORDER_EVENTS`` (created if missing); every one acknowledged on return."""

    async def quiet(_error: Exception) -> None:
        """nats-py would log each failed attempt; connect() raises the outcome."""

    client = await nats.connect([url], connect_timeout=5, max_reconnect_attempts=3, error_cb=quiet)
    try:
        js = client.jetstream()
        await ensure_nats_stream(js)
        for start in range(0, len(events), PUBLISH_WINDOW):
            window = events[start : start + PUBLISH_WINDOW]
            await asyncio.gather(*(js.publish(NATS_SUBJECT, json.dumps(e).encode()) for e in window))
    finally:
        await client.close()
    return len(events)


def publish_kafka(bootstrap: str, events: Sequence[dict[str, object]]) -> int:
    """Produce ``events`` to ``order_events`` (created if missing), keyed by order; all acknowledged."""
    ensure_kafka_topic(bootstrap)
    failed: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            failed.append(error)

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "on_delivery": on_delivery})
    for event in events:
        while True:
            try:
                producer.produce(KAFKA_TOPIC, key=str(event["order_id"]).encode(), value=json.dumps(event))
                break
            except BufferError:  # the local queue is full: let deliveries drain
                producer.poll(0.05)
    undelivered = producer.flush(60)
    if undelivered or failed:
        raise KafkaException(
            f"{undelivered} events undelivered after 60 s, {len(failed)} refused "
            f"(first: {failed[0] if failed else None})"
        )
    return len(events)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m example_project.publish", description="Publish sample order events."
    )
    parser.add_argument("target", choices=("nats", "kafka"), help="where to publish")
    parser.add_argument("count", type=int, nargs="?", default=10_000, help="events (default 10000)")
    args = parser.parse_args(argv)
    target, count = args.target, args.count
    if count < 1:
        parser.error("count must be at least 1")
    variable = NATS_URL_ENV if target == "nats" else KAFKA_BOOTSTRAP_ENV
    address = os.environ.get(variable)
    if not address:
        parser.error(f"set {variable} to the {target} server to publish to")
    events = order_events(count)
    try:
        if target == "nats":
            published = asyncio.run(publish_nats(address, events))
        else:
            published = publish_kafka(address, events)
    except (NatsError, KafkaException, OSError) as exc:
        print(f"publishing to {target} at {address} failed: {exc}", file=sys.stderr)
        return 1
    where = f"JetStream stream {NATS_STREAM}" if target == "nats" else f"Kafka topic {KAFKA_TOPIC}"
    print(f"published {published} order events to {where} at {address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
