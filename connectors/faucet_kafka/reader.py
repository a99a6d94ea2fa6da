"""The part the continuous session and the bounded source share: a consumer that proves what it read.

A :class:`KafkaReader` owns one consumer (on its own thread) assigned to a fixed set of partitions;
it never joins a consumer group, so nothing rebalances under it. Opening checks each start offset
against the partition's incarnation (cluster id + topic id), its low watermark and its high
watermark (from a fetch response) and raises instead of ever starting elsewhere. Reading keeps, per
partition, the offsets each read delivered (:class:`ReadTracker`) so the end of a read can prove no
record was skipped on the way (:meth:`KafkaReader.finish`).
"""

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from faucet_dagster.protocol import (
    ConfigError,
    ConnectionFailed,
    IncarnationChanged,
    IntegrityError,
    OrderingDomain,
    Position,
    PositionUnavailable,
)
from faucet_kafka.client import (
    _MISSING_CODES,
    ClientThread,
    TopicInfo,
    TopicPartitionKey,
    client_settings,
    consumer_settings,
    describe,
    fetched_high_watermarks,
    low_watermarks,
    offsets_of,
    partition_of,
    raise_message_error,
    where_of,
    wrap_kafka_error,
)
from faucet_kafka.codecs import KafkaOffsetCodec
from faucet_kafka.config import KafkaSourceConfig

LOG = logging.getLogger("faucet_kafka")
CODEC = KafkaOffsetCodec()
EMPTY_READ_CHECK_SECONDS = 1.0
"""How often a reader that delivers nothing proves its topics' incarnations (a read that delivered
records always does)."""
_RAISED_CLIENT_ERRORS = frozenset({KafkaError._ALL_BROKERS_DOWN, KafkaError._AUTHENTICATION})


def _missing(exc: KafkaException) -> bool:
    """The broker answered that a topic or partition does not exist."""
    error = exc.args[0] if exc.args else None
    return isinstance(error, KafkaError) and error.code() in _MISSING_CODES


@dataclass
class PartitionState:
    """One assigned partition: its domain, the next offset to read and the last boundary reached.

    ``boundary`` is the offset the last read ended at (a coverage starts after it; ``None``: the
    partition's beginning); ``acknowledged`` the last offset committed to the group by this reader.
    """

    topic: str
    partition: int
    domain: OrderingDomain
    next_offset: int
    boundary: int | None
    acknowledged: int | None = None

    @property
    def key(self) -> TopicPartitionKey:
        return (self.topic, self.partition)


@dataclass
class ReadTracker:
    """The offsets one read delivered, per partition: strictly increasing, gaps remembered.

    A gap is a run of offsets the consumer passed without delivering a record: transaction markers
    and aborted transactions under read_committed, or compacted records. Each is verified before the
    read returns coverage over it.
    """

    expected: dict[TopicPartitionKey, int]
    last: dict[TopicPartitionKey, int] = field(default_factory=dict)
    gaps: dict[TopicPartitionKey, list[tuple[int, int]]] = field(default_factory=dict)

    def observe(self, key: TopicPartitionKey, offsets: list[int]) -> None:
        """Record ``offsets`` (one partition, in delivery order) or raise IntegrityError."""
        expected = self.expected[key]
        first = offsets[0]
        # Fast path, one C-level comparison: the offsets are exactly the next ones.
        if first != expected or offsets != list(range(first, first + len(offsets))):
            for offset in offsets:
                if offset < expected:
                    raise IntegrityError(
                        f"offset {offset} was delivered again or out of order (expected {expected} or later)",
                        where=where_of(key[0], key[1], offset),
                    )
                if offset > expected:
                    self.gaps.setdefault(key, []).append((expected, offset))
                expected = offset + 1
        self.last[key] = offsets[-1]
        self.expected[key] = offsets[-1] + 1

    def add_gap(self, key: TopicPartitionKey, start: int, stop: int) -> None:
        self.gaps.setdefault(key, []).append((start, stop))


Fallback = Literal["beginning", "committed"]


class KafkaReader:
    """One consumer over a fixed set of partitions, opened at checked offsets.

    Methods are coroutines that run the client's blocking calls on its own thread; they are not
    safe for concurrent use (the session serializes them).
    """

    def __init__(self, config: KafkaSourceConfig, name: str) -> None:
        self.config = config
        self.where = f"kafka {config.bootstrap_servers}"
        self.cluster_id = ""
        self.topics: dict[str, TopicInfo] = {}
        self.parts: dict[TopicPartitionKey, PartitionState] = {}
        self.by_domain: dict[OrderingDomain, PartitionState] = {}
        self.high_watermarks: dict[TopicPartitionKey, int] = {}
        self._thread = ClientThread(f"faucet-kafka-{name}")
        self._admin: AdminClient | None = None
        self._consumer: Consumer | None = None
        self._verifier: Consumer | None = None
        self._client_errors: list[KafkaError] = []
        self._incarnations_checked = float("-inf")

    # Opening

    async def open(
        self,
        topics: Sequence[str],
        owns: Callable[[str, int], bool],
        resume: Sequence[Position],
        fallback: Fallback,
    ) -> None:
        """Assign the owned partitions of ``topics`` after ``resume`` (else at ``fallback``), checked.

        Raises :class:`IncarnationChanged` for a position of a previous topic incarnation,
        :class:`PositionUnavailable` for a start below the low watermark (deleted by retention or
        truncation) or beyond the high watermark (the log was truncated), or for a position of a
        topic or partition that no longer exists. Never starts anywhere else.
        """
        timeout = self.config.request_timeout
        try:
            self._admin = admin = AdminClient(client_settings(self.config))
            self._consumer = Consumer(consumer_settings(self.config, self._client_errors.append))
        except KafkaException as exc:
            raise wrap_kafka_error(exc, "creating the Kafka clients", self.where) from exc
        self.cluster_id, described = await self._thread.call(describe, admin, topics, timeout, self.where)
        resumed = self._resume_offsets(topics, described, resume, owns)
        for topic in topics:
            info = described[topic]
            if info is None:
                raise ConfigError(f"topic {topic} does not exist", where=where_of(topic))
            self.topics[topic] = info
            for partition in info.partitions:
                if owns(topic, partition):
                    last = resumed.get((topic, partition))
                    state = PartitionState(
                        topic,
                        partition,
                        self.domain(info, partition),
                        -1 if last is None else last + 1,
                        last,
                    )
                    self.parts[state.key] = state
                    self.by_domain[state.domain] = state
        if not self.parts:
            return
        if fallback == "committed":
            await self._start_at_committed([state for state in self.parts.values() if state.next_offset < 0])
        lows = await self._thread.call(low_watermarks, admin, self.parts, timeout)
        for key, state in self.parts.items():
            low = lows[key]
            if state.next_offset < 0:
                state.next_offset = low
            elif state.next_offset < low:
                raise PositionUnavailable(
                    f"the resume offset {state.next_offset} is below the low watermark {low}: the records "
                    f"in between were deleted (retention or truncation); refusing to start later",
                    where=where_of(*key),
                )
        starts = {key: state.next_offset for key, state in self.parts.items()}
        self.high_watermarks = await self._thread.call(
            fetched_high_watermarks, self.config, self._client_errors.append, starts, timeout
        )
        for key, state in self.parts.items():
            high = self.high_watermarks[key]
            if state.next_offset > high:
                raise PositionUnavailable(
                    f"the resume offset {state.next_offset} is beyond the end of the log (high watermark "
                    f"{high}): the partition was truncated",
                    where=where_of(*key),
                )
        await self.seek({key: state.next_offset for key, state in self.parts.items()})

    def domain(self, info: TopicInfo, partition: int) -> OrderingDomain:
        return OrderingDomain(
            self.config.source_name,
            info.name,
            str(partition),
            f"{self.cluster_id}:{info.topic_id}",
            CODEC.name,
        )

    def _resume_offsets(
        self,
        topics: Sequence[str],
        described: Mapping[str, TopicInfo | None],
        resume: Sequence[Position],
        owns: Callable[[str, int], bool],
    ) -> dict[TopicPartitionKey, int]:
        """The last certified offset per owned partition, each checked against the live topic."""
        offsets: dict[TopicPartitionKey, int] = {}
        for position in resume:
            domain = position.domain
            if domain.source != self.config.source_name or domain.resource not in topics:
                continue
            where = where_of(domain.resource, None)
            if domain.codec != CODEC.name:
                raise IntegrityError(f"a {domain.codec} position is not a Kafka offset", where=where)
            try:
                partition = int(domain.partition)
            except ValueError:
                raise IntegrityError(f"partition {domain.partition!r} is not a number", where=where) from None
            if not owns(domain.resource, partition):
                continue
            where = where_of(domain.resource, partition)
            info = described.get(domain.resource)
            if info is None:
                raise PositionUnavailable("the topic of a certified position no longer exists", where=where)
            current = self.domain(info, partition).incarnation
            if domain.incarnation != current:
                raise IncarnationChanged(
                    f"the certified position belongs to incarnation {domain.incarnation}, the topic is now "
                    f"{current} (deleted and recreated): its offsets are another log",
                    where=where,
                )
            if partition not in info.partitions:
                raise PositionUnavailable(
                    "the partition of a certified position no longer exists", where=where
                )
            if (domain.resource, partition) in offsets:
                raise IntegrityError("two resume positions name this partition", where=where)
            offsets[(domain.resource, partition)] = CODEC.validate(position.value)
        return offsets

    async def _start_at_committed(self, states: Sequence[PartitionState]) -> None:
        if not states:
            return
        consumer = self._require_consumer()
        request = [TopicPartition(state.topic, state.partition) for state in states]
        try:
            committed = await self._thread.call(
                consumer.committed, request, timeout=self.config.request_timeout
            )
        except KafkaException as exc:
            raise wrap_kafka_error(
                exc, f"reading the offsets of group {self.config.group_id}", self.where
            ) from exc
        for state, tp in zip(states, committed, strict=True):
            if tp.error is not None:
                raise wrap_kafka_error(
                    KafkaException(tp.error), "reading a committed offset", where_of(*state.key)
                )
            if tp.offset >= 0:
                state.next_offset = tp.offset
                state.boundary = tp.offset - 1 if tp.offset > 0 else None

    async def seek(self, starts: Mapping[TopicPartitionKey, int]) -> None:
        """(Re)assign the consumer so each partition delivers from ``starts[key]`` on."""
        consumer = self._require_consumer()
        assignment = [
            TopicPartition(topic, partition, offset) for (topic, partition), offset in starts.items()
        ]
        try:
            await self._thread.call(consumer.assign, assignment)
        except KafkaException as exc:
            raise wrap_kafka_error(exc, "assigning partitions", self.where) from exc
        for key, offset in starts.items():
            self.parts[key].next_offset = offset

    # Reading

    async def poll(self, max_messages: int, timeout: float) -> list[Message]:
        """Up to ``max_messages`` messages, waiting at most ``timeout`` seconds; client errors raised."""
        consumer = self._require_consumer()
        try:
            messages: list[Message] = await self._thread.call(consumer.consume, max_messages, timeout)
        except KafkaException as exc:
            raise wrap_kafka_error(exc, "fetching", self.where) from exc
        self._raise_client_errors()
        return messages

    def group(self, messages: list[Message]) -> dict[TopicPartitionKey, list[Message]]:
        """Messages by partition, in delivery order; a message carrying an error raises it.

        Column-wise (one C-level pass per attribute): a consume batch holds runs of a few partitions,
        each run a slice of the batch."""
        count = len(messages)
        if not count:
            return {}
        errors = list(map(Message.error, messages))
        if errors.count(None) != count:
            raise_message_error(next(m for m, e in zip(messages, errors, strict=True) if e is not None))
        topics = list(map(Message.topic, messages))
        partitions = list(map(Message.partition, messages))
        if None in topics or None in partitions:
            raise IntegrityError("the client delivered a record without topic or partition", where="kafka")
        one_topic = topics.count(topics[0]) == count
        keys: list[object] = list(partitions) if one_topic else list(zip(topics, partitions, strict=True))
        backwards = keys[::-1]
        grouped: dict[TopicPartitionKey, list[Message]] = {}
        for first, item in sorted((keys.index(item), item) for item in set(keys)):
            key = cast(TopicPartitionKey, (topics[0], item) if one_topic else item)
            if key not in self.parts:
                raise IntegrityError(
                    "a message of a partition this reader does not read", where=where_of(*key)
                )
            stop = count - backwards.index(item)
            if keys.count(item) == stop - first:
                grouped[key] = messages[first:stop]
            else:
                grouped[key] = [m for m, k in zip(messages, keys, strict=True) if k == item]
        return grouped

    def tracker(self) -> ReadTracker:
        return ReadTracker({key: state.next_offset for key, state in self.parts.items()})

    async def finish(
        self,
        tracker: ReadTracker,
        keys: Iterable[TopicPartitionKey],
        stops: Mapping[TopicPartitionKey, int] | None = None,
    ) -> dict[TopicPartitionKey, int]:
        """The offset each of ``keys`` (partitions that delivered) safely ends at, proven gap-free.

        The end is the consumer's position minus one (never at or past ``stops[key]``): past the last
        record when only transaction markers follow it. Every gap inside the read, and between the
        last record and that end, is re-read with a second consumer: a record it delivers inside a
        gap means the read skipped it (IntegrityError); none means the broker itself holds no
        deliverable record there. The caller moves ``next_offset`` once the ends are accepted.

        The incarnations are checked first, also when nothing was delivered (at most every
        ``EMPTY_READ_CHECK_SECONDS`` then, so an idle stream does not ask the broker twice per read): a
        reader at the head of a deleted topic reads nothing forever, and librdkafka only logs that the
        topic is gone.
        """
        keys = list(keys)
        if keys or time.monotonic() - self._incarnations_checked >= EMPTY_READ_CHECK_SECONDS:
            await self.check_incarnations()
        if not keys:
            return {}
        positions = await self.positions(keys)
        ends: dict[TopicPartitionKey, int] = {}
        for key in keys:
            last = tracker.last[key]
            position = positions[key] if stops is None else min(positions[key], stops[key])
            end = max(last, position - 1)
            if end > last:
                tracker.add_gap(key, last + 1, end + 1)
            ends[key] = end
        gaps = {key: spans for key, spans in tracker.gaps.items() if key in ends}
        if gaps and self.config.verify_offset_gaps:
            await self._thread.call(self._verify_gaps, gaps)
        return ends

    async def check_incarnations(self) -> None:
        """Prove every topic read is still the incarnation opened (one DescribeCluster and one
        DescribeTopics request): a read's records then came from it, since a topic id never returns.

        The client does not say so itself: librdkafka follows a topic deleted and recreated under
        the same name to its new id and goes on fetching at the old offsets (its own FIXME), and
        reports a deleted one only in its debug log. Raises :class:`PositionUnavailable` for a topic
        that was deleted, :class:`IncarnationChanged` for one recreated (or a cluster replaced),
        each naming the topic and the first partition read."""
        if self._admin is None or not self.topics:
            return
        cluster_id, described = await self._thread.call(
            describe, self._admin, list(self.topics), self.config.request_timeout, self.where
        )
        self._incarnations_checked = time.monotonic()
        for name, opened in self.topics.items():
            partition = min((key[1] for key in self.parts if key[0] == name), default=None)
            where = where_of(name, partition)
            now = described.get(name)
            if now is None:
                raise PositionUnavailable(
                    f"the topic was deleted while this session read it (incarnation {self.cluster_id}:"
                    f"{opened.topic_id}): its unread records are gone",
                    where=where,
                )
            if now.topic_id != opened.topic_id or cluster_id != self.cluster_id:
                raise IncarnationChanged(
                    f"the topic was deleted and recreated while this session read it: incarnation "
                    f"{self.cluster_id}:{opened.topic_id} is now {cluster_id}:{now.topic_id}, another log",
                    where=where,
                )

    def advance(self, ends: Mapping[TopicPartitionKey, int]) -> None:
        """Record that reads ended (accepted boundaries) at ``ends``: the next read starts after them."""
        for key, end in ends.items():
            state = self.parts[key]
            state.boundary = end
            state.next_offset = end + 1

    async def head_offsets(self) -> dict[TopicPartitionKey, int]:
        """Each partition's high watermark (read_committed: its last stable offset) as of the consumer's
        latest fetch response, never below the one captured at open. No request: fetch responses
        carry the real watermark (module docstring of :mod:`faucet_kafka.client`)."""
        consumer = self._require_consumer()

        def cached() -> dict[TopicPartitionKey, int]:
            found = {}
            for key in self.parts:
                found[key] = consumer.get_watermark_offsets(TopicPartition(*key), cached=True)[1]
            return found

        try:
            highs = await self._thread.call(cached)
        except KafkaException as exc:
            raise wrap_kafka_error(exc, "reading the high watermarks", self.where) from exc
        return {key: max(high, self.high_watermarks.get(key, 0)) for key, high in highs.items()}

    async def positions(self, keys: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, int]:
        """The consumer's position (next offset it delivers) per partition; -1001 before any delivery."""
        consumer = self._require_consumer()
        try:
            result = await self._thread.call(consumer.position, [TopicPartition(*key) for key in keys])
        except KafkaException as exc:
            raise wrap_kafka_error(exc, "reading positions", self.where) from exc
        return {(tp.topic, tp.partition): tp.offset for tp in result}

    async def pause(self, keys: Iterable[TopicPartitionKey]) -> None:
        """Stop fetching ``keys`` (a bounded read that reached their stop offsets)."""
        consumer = self._require_consumer()
        try:
            await self._thread.call(consumer.pause, [TopicPartition(*key) for key in keys])
        except KafkaException as exc:
            raise wrap_kafka_error(exc, "pausing partitions", self.where) from exc

    def _verify_gaps(self, gaps: Mapping[TopicPartitionKey, list[tuple[int, int]]]) -> None:
        if self._verifier is None:
            self._verifier = Consumer(consumer_settings(self.config, self._client_errors.append))
        verifier = self._verifier
        starts = {key: [start for start, _ in spans] for key, spans in gaps.items()}
        todo = {key: spans[-1][1] for key, spans in gaps.items()}
        verifier.assign(
            [TopicPartition(topic, partition, spans[0][0]) for (topic, partition), spans in gaps.items()]
        )
        deadline = time.monotonic() + self.config.request_timeout
        try:
            while todo:
                for message in verifier.consume(num_messages=self.config.batch_size, timeout=0.2):
                    if message.error() is not None:
                        raise_message_error(message)
                    key = partition_of(message)
                    offset = offsets_of([message])[0]
                    spans = gaps.get(key)
                    if spans is None or key not in todo:
                        continue
                    index = bisect.bisect_right(starts[key], offset) - 1
                    if index >= 0 and spans[index][0] <= offset < spans[index][1]:
                        raise IntegrityError(
                            "the read passed this record without delivering it (a re-read delivers it)",
                            where=where_of(key[0], key[1], offset),
                        )
                    if offset + 1 >= todo[key]:
                        del todo[key]
                if todo:
                    for tp in verifier.position([TopicPartition(*key) for key in todo]):
                        if tp.offset >= todo[(tp.topic, tp.partition)]:
                            del todo[(tp.topic, tp.partition)]
                if todo and time.monotonic() >= deadline:
                    raise ConnectionFailed(
                        f"could not re-read the skipped offsets within {self.config.request_timeout}s",
                        where=", ".join(where_of(*key) for key in todo),
                    )
        finally:
            verifier.assign([])

    # Acknowledging

    async def commit(self, offsets: Sequence[TopicPartition]) -> None:
        """Commit ``offsets`` (next offsets to read, with metadata) to the group; returns once stored."""
        consumer = self._require_consumer()
        request = list(offsets)

        def commit() -> list[TopicPartition]:
            return consumer.commit(offsets=request, asynchronous=False)

        try:
            result = await self._thread.call(commit)
        except KafkaException as exc:
            if _missing(exc):  # the topic existed when the session opened: deleted since
                await self.check_incarnations()
            raise wrap_kafka_error(
                exc, f"committing offsets to group {self.config.group_id}", self.where
            ) from exc
        for tp in result:
            if tp.error is not None:
                if _missing(KafkaException(tp.error)):
                    await self.check_incarnations()
                raise wrap_kafka_error(
                    KafkaException(tp.error), "committing an offset", where_of(tp.topic, tp.partition)
                )

    # Closing

    async def close(self) -> None:
        """Close the clients on their thread and join it: afterwards no client call is in flight."""
        errors: list[BaseException] = []
        for client in (self._consumer, self._verifier):
            if client is not None:
                try:
                    await self._thread.call(client.close)
                except (KafkaException, RuntimeError) as exc:  # every client is closed before reporting
                    errors.append(exc)
        self._consumer = self._verifier = None
        self._admin = None
        await self._thread.close()
        if errors:
            raise wrap_kafka_error(errors[0], "closing the consumer", self.where) from errors[0]

    def _require_consumer(self) -> Consumer:
        if self._consumer is None:
            raise ConnectionFailed("the Kafka reader is not open", where=self.where, retryable=False)
        return self._consumer

    def _raise_client_errors(self) -> None:
        errors, self._client_errors[:] = list(self._client_errors), []
        for error in errors:
            if error.fatal() or error.code() in _RAISED_CLIENT_ERRORS:
                raise wrap_kafka_error(KafkaException(error), "talking to the cluster", self.where)
            # librdkafka retries the others itself (a dropped idle connection, a slow broker).
            LOG.warning("Kafka client error (retried by the client): %s", error.str())
