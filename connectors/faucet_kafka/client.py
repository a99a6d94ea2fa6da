"""confluent-kafka underneath the Kafka source: settings, one thread per client, metadata and watermarks.

confluent-kafka calls block, so each client lives on its own single thread (:class:`ClientThread`):
every call of a client runs there, one at a time, and the event loop only awaits. Errors of the
client become typed FaucetErrors here, in one place.

Broker facts this module works around (DESIGN.md section 8): Tansu answers ListOffsets(latest) with
the base offset of the partition's last record batch plus one, which is below the real high
watermark when that batch holds several records, while its fetch responses carry the real one. So
the high watermark that bounds a read or vouches for a resume position is taken from a fetch
response (:func:`fetched_high_watermarks`), never from ListOffsets alone.
"""

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec

from faucet_dagster.protocol import (
    AuthError,
    ConfigError,
    ConnectionFailed,
    CredentialsFileAuth,
    FaucetError,
    IntegrityError,
    PositionUnavailable,
    TokenAuth,
    UserPasswordAuth,
)
from faucet_kafka.config import KafkaSourceConfig

T = TypeVar("T")

TopicPartitionKey = tuple[str, int]
"""(topic, partition): how partitions are keyed throughout the connector."""

LOG = logging.getLogger("faucet_kafka.librdkafka")

_AUTH_CODES = frozenset(
    {
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError._AUTHENTICATION,
    }
)
_POSITION_CODES = frozenset({KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET})
_MISSING_CODES = frozenset(
    {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION}
)


_EARLIEST: Any = OffsetSpec.earliest()  # type: ignore[no-untyped-call]


def where_of(topic: str, partition: int | None = None, offset: int | None = None) -> str:
    """How errors name a place in Kafka: ``topic orders partition 2 offset 1042``."""
    text = f"topic {topic}"
    if partition is not None:
        text += f" partition {partition}"
    if offset is not None:
        text += f" offset {offset}"
    return text


def client_settings(config: KafkaSourceConfig) -> dict[str, Any]:
    """librdkafka settings for an admin client or a producer: servers, security, extra properties."""
    settings: dict[str, Any] = {
        "bootstrap.servers": config.bootstrap_servers,
        "security.protocol": config.security_protocol,
        "logger": LOG,
        **config.client_properties,
        **{name: value.get_secret_value() for name, value in config.secret_properties.items()},
    }
    auth = config.auth
    if isinstance(auth, UserPasswordAuth):
        settings["sasl.mechanism"] = config.sasl_mechanism
        settings["sasl.username"] = auth.config.username
        settings["sasl.password"] = auth.config.password.get_secret_value()
    elif isinstance(auth, TokenAuth | CredentialsFileAuth):
        raise ConfigError(
            f"the Kafka source authenticates with user_password (SASL) or none, not {auth.type}",
            where=f"kafka {config.bootstrap_servers}",
        )
    return settings


FETCH_DEFAULTS: dict[str, Any] = {"fetch.queue.backoff.ms": 10}
"""librdkafka defaults of every consumer, which ``client_properties`` may override. Once a partition's
prefetch queue passes its threshold (``queued.min.messages``, 100,000), librdkafka postpones that
partition's next fetch by ``fetch.queue.backoff.ms``, 1,000 ms by default: a reader faster than that
drains the queue and then waits out the rest of the second (the bench's 200,000 messages from four
partitions: consumed in 1.22 s with the default, 0.31 s with 10 ms). The prefetch stays bounded by
``queued.max.messages.kbytes`` either way."""


def consumer_settings(config: KafkaSourceConfig, on_error: Callable[[KafkaError], None]) -> dict[str, Any]:
    """Settings of a consumer that never moves on its own.

    No auto commit and no auto offset store (only ``acknowledge`` commits); ``auto.offset.reset``
    ``error`` so the client never silently jumps to another offset when one is out of range;
    read_committed so aborted transactions are never delivered.
    """
    return {
        **FETCH_DEFAULTS,
        **client_settings(config),
        "group.id": config.group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "error",
        "enable.partition.eof": False,
        "error_cb": on_error,
    }


def wrap_kafka_error(exc: BaseException, action: str, where: str) -> FaucetError:
    """The FaucetError for a confluent-kafka failure of ``action`` at ``where``."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if isinstance(error, KafkaError):
        code = error.code()
        message = f"{action} failed: {error.str()}"
        if code in _AUTH_CODES:
            return AuthError(message, where=where)
        if code in _POSITION_CODES:
            return PositionUnavailable(message, where=where)
        if code in _MISSING_CODES:
            return ConfigError(message, where=where)
        return ConnectionFailed(message, where=where, retryable=error.retriable() or not error.fatal())
    return ConnectionFailed(f"{action} failed: {exc}", where=where)


class ClientThread:
    """One dedicated thread for one confluent-kafka client: its calls run there, one at a time.

    ``call`` returns when the call returned; cancelling the awaiting task does not interrupt a call
    that already started (it finishes on its thread), and the next call waits for it. ``close``
    waits for every queued call and stops the thread, so after it returns no call of the client is
    in flight. A plain thread rather than an executor: it also works while the interpreter exits
    (a Dagster code server closes its streams at exit), and a call stuck in the client never holds
    the exit up (daemon).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            function, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function())
            except BaseException as exc:  # noqa: BLE001 (handed to the awaiting task, which raises it)
                future.set_exception(exc)

    async def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if not self._thread.is_alive():
            raise ConnectionFailed("the Kafka client thread is closed", where="kafka", retryable=False)
        future: Future[T] = Future()
        self._queue.put((partial(function, *args, **kwargs), future))
        return await asyncio.wrap_future(future)

    async def close(self) -> None:
        if not self._thread.is_alive():
            return
        await self.call(lambda: None)  # every earlier call has returned once this one ran
        self._queue.put(None)
        self._thread.join()


@dataclass(frozen=True)
class TopicInfo:
    """A topic as the cluster describes it now: its id (the incarnation) and its partitions."""

    name: str
    topic_id: str
    partitions: tuple[int, ...]


def canonical_topic_id(raw: Any) -> str:
    """A confluent-kafka ``Uuid`` as the standard UUID text (stable, comparable, no slashes)."""
    high = raw.get_most_significant_bits() & (2**64 - 1)
    low = raw.get_least_significant_bits() & (2**64 - 1)
    return str(uuid.UUID(int=(high << 64) | low))


def describe(
    admin: AdminClient, topics: Sequence[str], timeout: float, where: str
) -> tuple[str, dict[str, TopicInfo | None]]:
    """The cluster id and each topic's description (``None`` for a topic that does not exist).

    Blocking: run it on the admin client's thread.
    """
    try:
        cluster = admin.describe_cluster(request_timeout=timeout).result()
    except KafkaException as exc:
        raise wrap_kafka_error(exc, "describing the cluster", where) from exc
    cluster_id = cluster.cluster_id
    if not cluster_id:
        raise ConnectionFailed("the cluster reported no cluster id", where=where)
    described: dict[str, TopicInfo | None] = {}
    if not topics:
        return str(cluster_id), described
    futures = admin.describe_topics(TopicCollection(list(topics)), request_timeout=timeout)
    for name, future in futures.items():
        try:
            result = future.result()
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() in _MISSING_CODES:
                described[name] = None
                continue
            raise wrap_kafka_error(exc, "describing the topic", where_of(name)) from exc
        described[name] = TopicInfo(
            name,
            canonical_topic_id(result.topic_id),
            tuple(sorted(partition.id for partition in result.partitions)),
        )
    return str(cluster_id), described


async def partitions_of(config: KafkaSourceConfig, topics: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Each of ``topics``' partition numbers, asked on a client thread of its own; a topic that
    does not exist raises ConfigError naming it."""
    thread = ClientThread("faucet-kafka-check")
    try:
        admin = AdminClient(client_settings(config))
        _, described = await thread.call(describe, admin, topics, config.request_timeout, dataset_uri(config))
    finally:
        await thread.close()
    partitions: dict[str, tuple[int, ...]] = {}
    for topic in topics:
        info = described.get(topic)
        if info is None:
            raise ConfigError(f"topic {topic} does not exist", where=where_of(topic))
        partitions[topic] = info.partitions
    return partitions


def dataset_uri(config: KafkaSourceConfig) -> str:
    """``kafka://<first bootstrap server>/<topics>``: where the source's messages name it."""
    first = config.bootstrap_servers.split(",")[0].strip()
    return f"kafka://{first}/{','.join(config.topics)}"


def list_topics(admin: AdminClient, timeout: float, where: str) -> list[str]:
    """Names of the cluster's topics, without internal ones (``__consumer_offsets``...). Blocking."""
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise wrap_kafka_error(exc, "listing topics", where) from exc
    return sorted(name for name in metadata.topics if not name.startswith("__"))


def low_watermarks(
    admin: AdminClient, partitions: Iterable[TopicPartitionKey], timeout: float
) -> dict[TopicPartitionKey, int]:
    """The earliest offset still in each partition (ListOffsets earliest, one request). Blocking."""
    request = {TopicPartition(topic, partition): _EARLIEST for topic, partition in partitions}
    if not request:
        return {}
    futures = admin.list_offsets(request, request_timeout=timeout)
    lows: dict[TopicPartitionKey, int] = {}
    for tp, future in futures.items():
        try:
            lows[(tp.topic, tp.partition)] = future.result().offset
        except KafkaException as exc:
            raise wrap_kafka_error(
                exc, "reading the low watermark", where_of(tp.topic, tp.partition)
            ) from exc
    return lows


def fetched_high_watermarks(
    config: KafkaSourceConfig,
    on_error: Callable[[KafkaError], None],
    starts: Mapping[TopicPartitionKey, int],
    timeout: float,
) -> dict[TopicPartitionKey, int]:
    """The high watermark (last stable offset: read_committed) of each partition, from a fetch response.

    A probe consumer of its own, fetching as little as the broker allows, is assigned at ``starts``
    and polled until every partition's fetch response arrived, then closed: the reading consumer is
    assigned once, never made to drop a large prefetch. A start beyond the end of the log raises
    :class:`PositionUnavailable` (a broker that reports offset-out-of-range) or yields a watermark
    below the start (one that does not: Tansu). Blocking.
    """
    if not starts:
        return {}
    # Small fetches: a broker that ignores max.partition.fetch.bytes (Tansu) still honours
    # fetch.max.bytes (which may not be below message.max.bytes), and a probe of a long log then takes
    # about 10 ms instead of 150-400 ms spent fetching records it throws away.
    probe = Consumer(
        {
            **consumer_settings(config, on_error),
            "max.partition.fetch.bytes": 1,
            "fetch.max.bytes": 1024,
            "message.max.bytes": 1024,
            "queued.min.messages": 1,
        }
    )
    try:
        probe.assign(
            [TopicPartition(topic, partition, offset) for (topic, partition), offset in starts.items()]
        )
        found: dict[TopicPartitionKey, int] = {}
        deadline = time.monotonic() + timeout
        while True:
            for key in starts:
                if key not in found:
                    _, high = probe.get_watermark_offsets(TopicPartition(*key), cached=True)
                    if high >= 0:
                        found[key] = high
            if len(found) == len(starts):
                return found
            if time.monotonic() >= deadline:
                missing = ", ".join(where_of(*key) for key in starts if key not in found)
                raise ConnectionFailed(f"no fetch response within {timeout}s", where=missing)
            for message in probe.consume(num_messages=1_000, timeout=0.05):
                if message.error() is not None:
                    raise_message_error(message)
    finally:
        probe.close()


def raise_message_error(message: Message) -> None:
    """Raise the FaucetError for a message that carries an error instead of a record."""
    error = message.error()
    topic, partition = message.topic(), message.partition()
    where = where_of(topic, partition) if topic and partition is not None and partition >= 0 else "kafka"
    raise wrap_kafka_error(KafkaException(error), "fetching", where)


def partition_of(message: Message) -> TopicPartitionKey:
    """The (topic, partition) a record message came from."""
    topic, partition = message.topic(), message.partition()
    if topic is None or partition is None:
        raise IntegrityError("the client delivered a record without topic or partition", where="kafka")
    return (topic, partition)


def offsets_of(messages: Sequence[Message]) -> list[int]:
    """The offsets of record messages, in order (one C-level pass: this is the hot path)."""
    offsets = list(map(Message.offset, messages))
    if None in offsets:
        raise IntegrityError("the client delivered a record without an offset", where="kafka")
    return cast(list[int], offsets)


def commit_metadata(fields: Mapping[str, object]) -> str:
    """Offset-commit metadata: compact JSON, truncated to Kafka's default 4096-byte limit."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return text[:4000]
