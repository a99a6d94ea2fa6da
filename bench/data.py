"""Prepared inputs shared by scenarios, so a scenario and its baseline read the very same data.

Each helper fills its source once per run (untimed) and returns its name; later calls return the same.
"""

import asyncio

import nats
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from faucet_kafka.client import FETCH_DEFAULTS

from bench.context import BenchContext

KAFKA_PARTITIONS = 4
#: librdkafka producer settings for bulk loads.
KAFKA_PRODUCER_CONFIG: dict[str, str | int] = {"linger.ms": 5, "batch.num.messages": 10000}
#: Consumer group settings. Tansu completes a new group's first join after about half the session
#: timeout (23 s with librdkafka's default of 45 s), so keep it at the usual broker minimum.
KAFKA_CONSUMER_CONFIG: dict[str, str | int | bool] = {
    # The fetch settings faucet's consumers have (librdkafka's 1 s backoff would stall the raw loop).
    **FETCH_DEFAULTS,
    "auto.offset.reset": "earliest",
    "enable.auto.commit": False,
    "session.timeout.ms": 6000,
}
NATS_PENDING_BYTES = 256 * 1024 * 1024


def create_topic(ctx: BenchContext, prefix: str, partitions: int = KAFKA_PARTITIONS) -> str:
    """Create a fresh topic (deleted at the end of the run) and return its name."""
    topic = ctx.unique(prefix)
    admin = AdminClient({"bootstrap.servers": ctx.kafka_bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)

    def delete() -> None:
        admin.delete_topics([topic])[topic].result(30)

    ctx.on_close(delete)
    return topic


def produce_all(bootstrap: str, topic: str, keys: list[bytes], values: list[bytes]) -> int:
    """Produce ``values`` (with ``keys``) and block until every message is acknowledged.

    Returns the number of messages delivered; raises ``RuntimeError`` if any delivery failed. Delivery
    reports are requested for failures only, so checking costs nothing on the happy path.
    """
    failed: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failed.append(err)

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            **KAFKA_PRODUCER_CONFIG,
            "delivery.report.only.error": True,
            "on_delivery": on_delivery,
        }
    )
    for key, value in zip(keys, values, strict=True):
        while True:
            try:
                producer.produce(topic, key=key, value=value)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.05)
    remaining = producer.flush(120)
    if remaining or failed:
        raise RuntimeError(
            f"producing to {topic}: {remaining} undelivered after 120 s, {len(failed)} failed "
            f"(first: {failed[0] if failed else None})"
        )
    return len(values)


def message_keys(ctx: BenchContext) -> list[bytes]:
    """The dataset's keys as bytes (the ``key`` column)."""
    return ctx.shared("keys", lambda: [r[1].encode() for r in ctx.dataset()])


def kafka_source_topic(ctx: BenchContext) -> str:
    """A topic holding the dataset's payloads, keyed by the ``key`` column, in 4 partitions."""

    def fill() -> str:
        topic = create_topic(ctx, "src")
        produce_all(ctx.kafka_bootstrap, topic, message_keys(ctx), ctx.payloads())
        return topic

    return ctx.shared("kafka_source_topic", fill)


NATS_PUBLISH_WINDOW = 2_000
"""JetStream publishes awaiting their acknowledgement at once while a stream is filled."""


def nats_source_stream(ctx: BenchContext) -> str:
    """A JetStream stream (subjects ``<stream>.>``) holding the dataset's payloads, in order."""
    return ctx.shared("nats_source_stream", lambda: asyncio.run(_fill_stream(ctx)))


async def _fill_stream(ctx: BenchContext) -> str:
    url, stream, payloads = ctx.nats_url, ctx.unique("src"), ctx.payloads()
    nc = await nats.connect(url, pending_size=NATS_PENDING_BYTES)
    try:
        js = nc.jetstream()
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        subject = f"{stream}.rows"
        # Acknowledged publishes, a window at a time: JetStream may drop plain core publishes that
        # arrive faster than it stores them, which left the stream short of the dataset.
        for start in range(0, len(payloads), NATS_PUBLISH_WINDOW):
            window = payloads[start : start + NATS_PUBLISH_WINDOW]
            await asyncio.gather(*(js.publish(subject, payload, timeout=60) for payload in window))
        stored = (await js.stream_info(stream)).state.messages
        if stored != len(payloads):
            raise RuntimeError(f"stream {stream} holds {stored} messages, expected {len(payloads)}")
    finally:
        await nc.close()
    ctx.on_close(lambda: asyncio.run(_delete_stream(url, stream)))
    return stream


async def _delete_stream(url: str, stream: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()
