"""The Kafka source: its capabilities and the continuous StreamSource (epochs); the bounded Source
(one finite read) is :mod:`faucet_kafka.bounded`.

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
from collections.abc import Sequence
from typing import Any, ClassVar

from confluent_kafka import Message, TopicPartition

from faucet_dagster.protocol import (
    Authority,
    CancelToken,
    ConfigError,
    Coverage,
    DomainCoverage,
    Emits,
    IntegrityError,
    LifecycleError,
    Membership,
    Operation,
    Ordering,
    OrderingDomain,
    Position,
    PositionCodec,
    ProgressBoundary,
    ReadLimits,
    Replay,
    SourceCapabilities,
    SourceLag,
    StreamRecordSink,
    StreamSession,
    StreamSource,
    WorkerIdentity,
)
from faucet_kafka.client import (
    commit_metadata,
    offsets_of,
    partitions_of,
)
from faucet_kafka.codecs import KafkaOffsetCodec
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.decode import row_columns
from faucet_kafka.deliver import Deliverer
from faucet_kafka.reader import CODEC, KafkaReader, PartitionState


def capabilities(config: KafkaSourceConfig, *, continuous: bool) -> SourceCapabilities:
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
        # A bounded read has no dead-letter route for source records (a malformed one raises DataError).
        dead_letters=continuous and config.on_malformed == "dead_letter",
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
        self._deliverer = Deliverer(reader.config)
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
        return capabilities(self.config, continuous=True)

    def codecs(self) -> Sequence[PositionCodec[Any]]:
        return (KafkaOffsetCodec(),)

    async def check(self) -> None:
        """Connect, authenticate and find every configured topic (``faucet check``), as the bounded
        source checks: a missing topic raises ConfigError naming it."""
        await partitions_of(self.config, self.config.topics)

    async def replay(self, coverage: DomainCoverage, sink: StreamRecordSink, cancel: CancelToken) -> None:
        """Re-read one certified partition range for ``faucet verify`` (:mod:`faucet_kafka.replay`)."""
        from faucet_kafka.replay import replay_range

        await replay_range(self.config, coverage, sink, cancel)

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
