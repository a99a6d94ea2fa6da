"""The Kafka source: a continuous StreamSource (epochs) and a bounded Source (one finite read).

Ordering domain: one partition of one topic incarnation (``incarnation`` = cluster id + topic id), so
a position of a deleted-and-recreated topic never compares with the new log. Position: the partition
offset (codec ``kafka.offset``); a coverage or bookmark ends at the last offset it covers, and a
resume starts at that offset + 1. Event identity: (domain, offset, ordinal 0).

Continuous: ``open`` assigns the partitions the membership owns (no consumer-group membership, so no
rebalance), checked as :class:`~faucet_kafka.reader.KafkaReader` describes; ``read`` hands rows to
the pipeline in large batches and ends every covered partition with a ``ProgressBoundary`` (each
Kafka offset is a safe boundary: read_committed delivers only committed transactions, whole);
``acknowledge`` commits ``end + 1`` per partition to the configured consumer group, with the
coverage, worker and fencing token as offset metadata, and only after ``authority()`` confirmed
ownership. Nothing else ever commits: auto commit is off.
"""

import asyncio
import bisect
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar

import pyarrow as pa
from confluent_kafka import Message, TopicPartition
from confluent_kafka.admin import AdminClient

from faucet_dagster.protocol import (
    Authority,
    CancelToken,
    ConfigError,
    Coverage,
    DataError,
    DiscoveredDataset,
    DomainCoverage,
    Emits,
    EventIdentity,
    FetchContext,
    Identities,
    IntegrityError,
    JsonValue,
    LifecycleError,
    Membership,
    Operation,
    Ordering,
    OrderingDomain,
    Page,
    Position,
    PositionCodec,
    ProgressBoundary,
    ReadLimits,
    Records,
    RejectedRecord,
    Replay,
    Source,
    SourceCapabilities,
    SourceLag,
    StreamRecordSink,
    StreamSession,
    StreamSource,
    WorkerIdentity,
)
from faucet_dagster.protocol.json_rows import JsonRun
from faucet_kafka.client import (
    ClientThread,
    TopicPartitionKey,
    client_settings,
    commit_metadata,
    describe,
    list_topics,
    offsets_of,
    where_of,
)
from faucet_kafka.codecs import KafkaOffsetCodec
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.decode import Decoder, raw_schema, row_columns
from faucet_kafka.reader import CODEC, KafkaReader, PartitionState, ReadTracker


def _capabilities(config: KafkaSourceConfig, *, continuous: bool) -> SourceCapabilities:
    return SourceCapabilities(
        emits=Emits.MESSAGES,
        operations=frozenset({Operation.INSERT}),
        ordering=Ordering.PARTITION,
        replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
        bounded=not continuous,
        continuous=continuous,
        # Continuous: re-reading an offset range of a domain yields the same records at the same
        # positions. Bounded: pages interleave partitions differently on every run, so no.
        deterministic=continuous,
        transaction_boundaries=False,
        event_identity=True,
        # Only the bounded source has discover() and enumerate_shards()/apply_shard(); a stream is
        # divided among workers by membership, not by shards.
        discover=not continuous,
        shardable=not continuous,
        columns=row_columns(config),
    )


INLINE_DECODE_MESSAGES = 512
"""Consume batches up to this many messages are decoded on the event loop (the hand-off to a worker
thread would cost more than parsing them)."""


class _Deliverer:
    """Decodes one partition's messages and hands rows (and malformed records) to their destination."""

    def __init__(self, config: KafkaSourceConfig) -> None:
        self.config = config
        self._decoder = Decoder(config)

    def decode(self, state: PartitionState, messages: Sequence[Message]) -> list[JsonRun]:
        """Decode ``messages``; with the ``halt`` policy a malformed one raises DataError naming it."""
        runs = self._decoder.decode(messages)
        if self.config.on_malformed == "halt":
            self._halt_on_malformed(state, messages, runs)
        return runs

    async def decode_all(
        self, batches: Sequence[tuple[PartitionState, Sequence[Message]]]
    ) -> list[list[JsonRun]]:
        """:meth:`decode` each partition's batch, in a worker thread when they hold more than
        ``INLINE_DECODE_MESSAGES`` messages: Arrow parses without the GIL, so the event loop meanwhile
        drives the sink's write in flight (the COPY of the batch before) instead of waiting for it.

        With declared columns the partitions' batches are parsed in one Arrow call (one fixed cost
        per consume batch, not per partition) and its runs cut back at the partitions' boundaries:
        the same rows, reasons and errors as each batch decoded alone."""

        def decode() -> list[list[JsonRun]]:
            if len(batches) > 1 and self._decoder.parses_columns:
                return self._decode_joined(batches)
            return [self.decode(state, messages) for state, messages in batches]

        if sum(len(messages) for _, messages in batches) <= INLINE_DECODE_MESSAGES:
            return decode()
        return await asyncio.to_thread(decode)

    def _decode_joined(
        self, batches: Sequence[tuple[PartitionState, Sequence[Message]]]
    ) -> list[list[JsonRun]]:
        joined = [message for _, messages in batches for message in messages]
        runs = self._decoder.decode(joined)
        decoded: list[list[JsonRun]] = []
        index = base = 0
        for state, messages in batches:
            stop = base + len(messages)
            mine: list[JsonRun] = []
            while index < len(runs) and runs[index].start < stop:
                run = runs[index]
                first, last = max(run.start, base), min(run.stop, stop)
                rows = run.rows
                if isinstance(rows, pa.RecordBatch):
                    rows = rows.slice(first - run.start, last - first)
                mine.append(JsonRun(first - base, last - base, rows, run.reason))
                if run.stop > stop:
                    break  # the run goes on into the next partition's batch
                index += 1
            if self.config.on_malformed == "halt":
                self._halt_on_malformed(state, messages, mine)
            decoded.append(mine)
            base = stop
        return decoded

    def _halt_on_malformed(
        self, state: PartitionState, messages: Sequence[Message], runs: list[JsonRun]
    ) -> None:
        for run in runs:
            if run.rows is None:
                where = where_of(state.topic, state.partition, messages[run.start].offset())
                raise DataError(run.reason, where=where)

    async def write(
        self,
        sink: StreamRecordSink,
        state: PartitionState,
        messages: Sequence[Message],
        offsets: list[int],
        runs: Sequence[JsonRun],
    ) -> None:
        """Write the decoded ``runs`` of ``messages`` (at ``offsets``) to ``sink``, rejecting malformed
        ones, in offset order."""
        positions = list(map(str, offsets))
        for run in runs:
            if run.rows is not None:
                if run.start or run.stop != len(positions):
                    ids = Identities(positions[run.start : run.stop])
                else:
                    ids = Identities(positions)
                await sink.write(state.domain, run.rows, ids)
                continue
            offset = offsets[run.start]
            await sink.reject(
                RejectedRecord(
                    EventIdentity(state.domain, positions[run.start]),
                    run.reason,
                    messages[run.start].value() or b"",
                    where_of(state.topic, state.partition, offset),
                )
            )


class KafkaStreamSession(StreamSession):
    """A session over the partitions its membership owns; reads and acknowledgements are serialized.

    After a read that raised or was cancelled (rows may have reached the pipeline without a
    boundary), the next read first seeks every partition back to where the last accepted boundary
    left it, so nothing between is ever skipped.
    """

    def __init__(self, reader: KafkaReader, worker: WorkerIdentity) -> None:
        self._reader = reader
        self._worker = worker
        self._deliverer = _Deliverer(reader.config)
        self._lock = asyncio.Lock()
        self._closed = False
        self._rewind = False

    @property
    def domains(self) -> tuple[OrderingDomain, ...]:
        """The ordering domains (partitions) this session reads."""
        return tuple(state.domain for state in self._reader.parts.values())

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        """Read from where the last read ended until a limit (or cancellation), then end each partition
        that delivered with a ProgressBoundary at its end offset and return that coverage.

        Every Kafka offset is a safe boundary, so a limit ends the read at the consume batch that
        reached it (``records`` exactly: batches are cut to it). Rows before a cancellation are
        covered the same way, since each delivered record is complete. Raises DataError (``halt``),
        IntegrityError (an offset delivered twice, or a skipped record found by the gap re-read),
        PositionUnavailable (the broker reports an offset out of range) or ConnectionFailed.
        """
        async with self._lock:
            self._check_open()
            if self._rewind:
                await self._reader.seek({key: state.next_offset for key, state in self._reader.parts.items()})
                self._rewind = False
            try:
                return await self._read(sink, limits, cancel)
            except BaseException:
                self._rewind = True
                raise

    async def _read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        reader, config = self._reader, self._reader.config
        loop = asyncio.get_running_loop()
        tracker = reader.tracker()
        started = last_data = loop.time()
        records = payload_bytes = 0

        def poll() -> "asyncio.Task[list[Message]]":
            now = loop.time()
            want = (
                config.batch_size
                if limits.records is None
                else min(config.batch_size, limits.records - records)
            )
            timeout = config.poll_timeout
            if limits.idle is not None:
                timeout = min(timeout, max(0.01, limits.idle - (now - last_data)))
            if limits.age is not None:
                timeout = min(timeout, max(0.01, limits.age - (now - started)))
            return asyncio.ensure_future(reader.poll(want, timeout))

        # At most one consume in flight, started before the batch it follows is decoded and written
        # (on the client's thread, overlapping them) and only when the read will go on after that
        # batch: what it consumes is always delivered in this read, so the consumer's position, which
        # ``finish`` ends the coverage at, never passes an undelivered record.
        pending: asyncio.Task[list[Message]] | None = None
        try:
            while pending is not None or not cancel.cancelled:
                task, pending = pending or poll(), None
                messages = await task
                now = loop.time()
                if messages:
                    last_data = now
                    records += len(messages)
                    if limits.bytes is not None:
                        payload_bytes += sum(len(message.value() or b"") for message in messages)
                done = (
                    (limits.records is not None and records >= limits.records)
                    or (limits.bytes is not None and payload_bytes >= limits.bytes)
                    or (limits.age is not None and now - started >= limits.age)
                    or (limits.idle is not None and now - last_data >= limits.idle)
                )
                if messages and not done and not cancel.cancelled:
                    pending = poll()
                groups = [(key, batch, offsets_of(batch)) for key, batch in reader.group(messages).items()]
                for key, _, offsets in groups:
                    tracker.observe(key, offsets)
                decoded = await self._deliverer.decode_all(
                    [(reader.parts[key], batch) for key, batch, _ in groups]
                )
                for (key, batch, offsets), runs in zip(groups, decoded, strict=True):
                    await self._deliverer.write(sink, reader.parts[key], batch, offsets, runs)
                if done:
                    break
        finally:
            if pending is not None:
                # A failure left a consume in flight: join it (the next read seeks back first).
                await asyncio.wait([pending])
                if not pending.cancelled():
                    pending.exception()
        ends = await reader.finish(tracker, list(tracker.last))
        covered: list[DomainCoverage] = []
        for key, end in ends.items():
            state = reader.parts[key]
            await sink.control(ProgressBoundary(state.domain, str(end)))
            start = None if state.boundary is None else str(state.boundary)
            covered.append(DomainCoverage(state.domain, start, str(end)))
        reader.advance(ends)
        return Coverage(tuple(covered))

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        """Commit ``end + 1`` of each covered partition to the group, after ``authority()`` confirms.

        ``authority()`` is awaited before the commit request, also when every partition was already
        committed (nothing is then sent); an OwnershipLost from it propagates and nothing is
        committed. Coverage of a domain this session does not read, or past what it read, raises
        IntegrityError. Returns once the broker stored the offsets.
        """
        async with self._lock:
            self._check_open()
            commits: list[tuple[PartitionState, DomainCoverage, int]] = []
            for item in coverage.domains:
                state = self._reader.by_domain.get(item.domain)
                if state is None:
                    raise IntegrityError(
                        "the coverage names a domain this session does not read", where=str(item.domain)
                    )
                end = CODEC.validate(item.end)
                if state.boundary is None or end > state.boundary:
                    raise IntegrityError(
                        f"the coverage ends at {end}, past what this session read", where=str(item.domain)
                    )
                if state.acknowledged is None or end > state.acknowledged:
                    commits.append((state, item, end))
            await authority()
            if not commits:
                return
            offsets = [
                TopicPartition(
                    state.topic,
                    state.partition,
                    end + 1,
                    metadata=commit_metadata(
                        {
                            "faucet": "certified",
                            "from": item.start,
                            "to": item.end,
                            "incarnation": state.domain.incarnation,
                            "worker": self._worker.worker_id,
                            "fencing_token": self._worker.fencing_token,
                        }
                    ),
                )
                for state, item, end in commits
            ]
            await self._reader.commit(offsets)
            for state, _, end in commits:
                state.acknowledged = end

    async def lag(self) -> tuple[SourceLag, ...]:
        """Per partition, the offsets after where the reads reached up to the high watermark of the
        consumer's latest fetch response (no extra request; transaction markers count as offsets).
        Kafka does not tell when its newest record was written without fetching it: no seconds."""
        async with self._lock:
            self._check_open()
            highs = await self._reader.head_offsets()
        return tuple(
            SourceLag(
                state.domain,
                None if state.boundary is None else str(state.boundary),
                str(highs[key] - 1) if highs[key] > 0 else None,
                max(0, highs[key] - state.next_offset),
                "offsets",
            )
            for key, state in self._reader.parts.items()
        )

    async def close(self) -> None:
        """Wait for an outstanding read or acknowledgement, then close the consumer and join its thread.

        Idempotent. Offsets not acknowledged stay uncommitted; the next open resumes from the
        certified positions it is given.
        """
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            await self._reader.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError("the Kafka session is closed", where=self._reader.where)


class KafkaStreamSource(StreamSource):
    """The continuous Kafka source. Building it does no I/O; ``open`` connects.

    ``session_type`` is the session class ``open`` returns: a subclass of the source can set its own
    :class:`KafkaStreamSession` subclass that overrides one session method (and calls ``super()``).
    """

    connector_name = "kafka"
    session_type: ClassVar[type[KafkaStreamSession]] = KafkaStreamSession

    def __init__(self, config: KafkaSourceConfig) -> None:
        self.config = config

    def capabilities(self) -> SourceCapabilities:
        return _capabilities(self.config, continuous=True)

    def codecs(self) -> Sequence[PositionCodec[Any]]:
        return (KafkaOffsetCodec(),)

    async def check(self) -> None:
        """Connect, authenticate and find every configured topic (``faucet check``), as the bounded
        source checks: a missing topic raises ConfigError naming it."""
        await KafkaSource(self.config).check()

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> KafkaStreamSession:
        """Open a session (a ``session_type``) on the partitions of ``resources`` (topics) that
        ``membership`` owns.

        Each starts at its certified offset + 1, or at its low watermark without one; see
        :meth:`KafkaReader.open` for the checks and what they raise.
        """
        unknown = sorted(set(resources) - set(self.config.topics))
        if unknown or not resources:
            raise ConfigError(
                f"the stream selects {', '.join(unknown) or 'no topic'}; the source is configured for "
                f"{', '.join(self.config.topics)}",
                where=f"kafka {self.config.bootstrap_servers}",
            )
        reader = KafkaReader(self.config, worker.worker_id)
        try:
            await reader.open(
                list(resources),
                lambda topic, partition: membership.owns(topic, str(partition)),
                resume_positions,
                "beginning",
            )
        except BaseException:
            await reader.close()
            raise
        return self.session_type(reader, worker)


class KafkaSource(Source):
    """The bounded Kafka source: from the bookmark (else the group's committed offsets, else the
    beginning) up to the high watermarks captured when the read starts.

    Bookmark: ``{"positions": [{"topic", "partition", "incarnation", "offset"}]}`` with the last
    offset read per partition; a bookmark of another topic incarnation raises IncarnationChanged.
    Shards are partitions (``topic/partition``). Pages hold at most ``batch_size`` records and carry
    a bookmark each. The bounded contract has no channel for records that cannot become rows, so
    ``on_malformed: dead_letter`` is refused here (a malformed record halts with DataError).
    """

    connector_name = "kafka"
    config_model = KafkaSourceConfig

    def __init__(self, config: KafkaSourceConfig) -> None:
        self.config = config
        self._start: list[Position] = []
        self._shard: TopicPartitionKey | None = None
        self._reached: JsonValue | None = None

    def capabilities(self) -> SourceCapabilities:
        return _capabilities(self.config, continuous=False)

    def dataset_uri(self) -> str:
        first = self.config.bootstrap_servers.split(",")[0].strip()
        return f"kafka://{first}/{','.join(self.config.topics)}"

    def state_key(self) -> str:
        key = f"kafka/{self.config.group_id}/{'+'.join(self.config.topics)}"
        return key if self._shard is None else f"{key}/{self._shard[0]}/{self._shard[1]}"

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        try:
            assert isinstance(bookmark, dict)
            items = bookmark["positions"]
            assert isinstance(items, list)
            self._start = [
                Position(
                    OrderingDomain(
                        self.config.source_name,
                        str(item["topic"]),
                        str(int(str(item["partition"]))),
                        str(item["incarnation"]),
                        CODEC.name,
                    ),
                    CODEC.canonicalize(CODEC.validate(item["offset"])),
                )
                for item in items
                if isinstance(item, dict)
            ]
            assert len(self._start) == len(items)
        except (AssertionError, KeyError, TypeError, ValueError, DataError):
            raise ConfigError(
                "the bookmark is not one this source wrote ({'positions': [{topic, partition, "
                "incarnation, offset}]})",
                where=self.dataset_uri(),
            ) from None

    def bookmark(self) -> JsonValue | None:
        return self._reached

    async def enumerate_shards(self) -> Sequence[str]:
        described = await self._describe(self.config.topics)
        return [f"{topic}/{partition}" for topic in self.config.topics for partition in described[topic]]

    def apply_shard(self, shard: str) -> None:
        topic, _, partition = shard.rpartition("/")
        if topic not in self.config.topics or not partition.isdigit():
            raise ConfigError(
                f"{shard!r} is not a shard of this source (topic/partition)", where=self.dataset_uri()
            )
        self._shard = (topic, int(partition))

    async def discover(self) -> Sequence[DiscoveredDataset]:
        thread = ClientThread("faucet-kafka-discover")
        try:
            admin = AdminClient(client_settings(self.config))
            names = await thread.call(list_topics, admin, self.config.request_timeout, self.dataset_uri())
            _, described = await thread.call(
                describe, admin, names, self.config.request_timeout, self.dataset_uri()
            )
        finally:
            await thread.close()
        schema = (
            self.config.declared_schema()
            if self.config.format == "json"
            else raw_schema(self.config.format == "text")
        )
        return [
            DiscoveredDataset(
                name, schema, {"partitions": str(len(info.partitions)), "topic_id": info.topic_id}
            )
            for name, info in described.items()
            if info is not None
        ]

    async def check(self) -> None:
        await self._describe(self.config.topics)

    async def _describe(self, topics: Sequence[str]) -> dict[str, tuple[int, ...]]:
        thread = ClientThread("faucet-kafka-check")
        try:
            admin = AdminClient(client_settings(self.config))
            _, described = await thread.call(
                describe, admin, topics, self.config.request_timeout, self.dataset_uri()
            )
        finally:
            await thread.close()
        partitions: dict[str, tuple[int, ...]] = {}
        for topic in topics:
            info = described.get(topic)
            if info is None:
                raise ConfigError(f"topic {topic} does not exist", where=where_of(topic))
            partitions[topic] = info.partitions
        return partitions

    async def fetch(self, ctx: FetchContext) -> Records:
        pages = [page.records async for page in self.stream_pages(ctx, 0)]
        return pages[0] if pages else []

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        """Read every partition (or the shard) from its start to the high watermark captured at start.

        The records after that watermark are left for the next run. Each page ends with every
        partition it read proven gap-free and carries the bookmark reached after it.
        """
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.dataset_uri())
        if self.config.on_malformed == "dead_letter":
            raise ConfigError(
                "a bounded Kafka read cannot route unparseable records to a dead-letter route; "
                "use on_malformed: halt",
                where=self.dataset_uri(),
            )
        shard = self._shard
        reader = KafkaReader(self.config, "bounded")
        try:
            await reader.open(
                self.config.topics,
                lambda topic, partition: shard is None or (topic, partition) == shard,
                self._start,
                "committed",
            )
            stops = dict(reader.high_watermarks)
            deliverer = _Deliverer(self.config)
            remaining = {key for key, state in reader.parts.items() if state.next_offset < stops[key]}
            self._reached = self._bookmark(reader)
            yielded = False
            while remaining:
                page, tracker = await self._read_page(reader, deliverer, stops, remaining, batch_size)
                ends = await reader.finish(tracker, list(tracker.last), stops)
                reader.advance(ends)
                self._reached = self._bookmark(reader)
                if page:
                    yielded = True
                    yield Page(_concat(page), self._reached)
            if not yielded:
                yield Page([], self._reached)
        finally:
            await reader.close()

    async def _read_page(
        self,
        reader: KafkaReader,
        deliverer: _Deliverer,
        stops: Mapping[TopicPartitionKey, int],
        remaining: set[TopicPartitionKey],
        batch_size: int,
    ) -> tuple[list[Records], ReadTracker]:
        """Records up to ``batch_size`` (0: all), dropping anything at or past a partition's stop."""
        tracker = reader.tracker()
        page: list[Records] = []
        rows = 0
        while remaining and (batch_size == 0 or rows < batch_size):
            want = (
                self.config.batch_size if batch_size == 0 else min(self.config.batch_size, batch_size - rows)
            )
            messages = await reader.poll(want, self.config.poll_timeout)
            for key, batch in reader.group(messages).items():
                stop = stops[key]
                offsets = offsets_of(batch)
                if offsets[-1] >= stop:
                    cut = bisect.bisect_left(offsets, stop)
                    batch, offsets = batch[:cut], offsets[:cut]
                if not batch:
                    continue
                tracker.observe(key, offsets)
                for run in deliverer.decode(reader.parts[key], batch):
                    # dead_letter is refused above: under halt, every run has rows.
                    assert run.rows is not None
                    page.append(run.rows)
                    rows += run.stop - run.start
            positions = await reader.positions(remaining)
            done = [key for key, position in positions.items() if position >= stops[key]]
            if done:
                await reader.pause(done)
                remaining.difference_update(done)
        return page, tracker

    @staticmethod
    def _bookmark(reader: KafkaReader) -> JsonValue:
        return {
            "positions": [
                {
                    "topic": state.topic,
                    "partition": state.partition,
                    "incarnation": state.domain.incarnation,
                    "offset": state.boundary,
                }
                for state in reader.parts.values()
                if state.boundary is not None
            ]
        }


def _concat(parts: list[Records]) -> Records:
    """One page's records: JSON objects joined in one list, or Arrow batches in one batch."""
    if isinstance(parts[0], pa.RecordBatch):
        return pa.concat_batches([part for part in parts if isinstance(part, pa.RecordBatch)])
    return [row for part in parts for row in part]
