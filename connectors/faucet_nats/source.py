"""The NATS JetStream source: the continuous StreamSource (epochs) and the session both sources read through.

Ordering domain: one stream incarnation, or the part of it a subject filter selects
(``OrderingDomain(source_name, stream, subject filter or "", "<created>#<first seq>",
"nats.stream_sequence")``), so a position of a deleted-and-recreated stream never compares with the
new one. Position: the stream sequence; a coverage or bookmark ends at the last sequence it covers,
and a resume starts at that sequence + 1. Event identity: (domain, stream sequence, ordinal 0).

Continuous: ``open`` checks the certified position is still stored (else
:class:`PositionUnavailable`, never a later start) and belongs to this incarnation (else
:class:`IncarnationChanged`), then recreates the durable consumer there (see
:mod:`faucet_nats.consumer` for how delivery gaps are proven empty and messages kept alive).
``read`` hands rows to the pipeline in large runs and ends with one ``ProgressBoundary`` at the last
sequence written (every JetStream message is a safe boundary: there are no transactions).
``acknowledge`` sends one confirmed cumulative acknowledgement for the last covered sequence, after
``authority()`` confirmed ownership. Nothing else ever acknowledges. ``lag`` counts the stream
sequences after the last read's end up to the stream's last sequence, with the age of that end's
message against the newest one (server timestamps).

The bounded Source (:mod:`faucet_nats.bounded`) reads through the same session, with an ephemeral
consumer.
"""

import asyncio
from collections.abc import Awaitable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client

from faucet_dagster.protocol import (
    Authority,
    CancelToken,
    ConfigError,
    ConnectionFailed,
    Coverage,
    DataError,
    DomainCoverage,
    Emits,
    EventIdentity,
    FaucetError,
    Identities,
    IncarnationChanged,
    IntegrityError,
    LifecycleError,
    Membership,
    Operation,
    Ordering,
    OrderingDomain,
    Position,
    PositionCodec,
    PositionUnavailable,
    ProgressBoundary,
    ReadLimits,
    RejectedRecord,
    Replay,
    SourceCapabilities,
    SourceLag,
    StreamRecordSink,
    StreamSession,
    StreamSource,
    WorkerIdentity,
)
from faucet_nats.chunks import DATA, Chunk
from faucet_nats.codecs import NatsStreamSequenceCodec
from faucet_nats.config import NatsSourceConfig
from faucet_nats.consumer import PushConsumer
from faucet_nats.decode import Decoder
from faucet_nats.jetstream import (
    NO_MESSAGE_FOUND,
    JetStreamApi,
    JetStreamRefused,
    StreamFacts,
    connect,
    stream_missing,
)
from faucet_nats.replay import read_range

CODEC = NatsStreamSequenceCodec()
INLINE_DECODE_MESSAGES = 512
"""Chunks up to this many messages are decoded on the event loop (a worker thread's hand-off costs more)."""
T = TypeVar("T")


def capabilities(config: NatsSourceConfig, *, continuous: bool) -> SourceCapabilities:
    schema = config.declared_schema()
    return SourceCapabilities(
        emits=Emits.MESSAGES,
        operations=frozenset({Operation.INSERT}),
        # One stream read by one consumer: every message of the domain in one total order.
        ordering=Ordering.STRICT_GLOBAL,
        replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
        bounded=not continuous,
        continuous=continuous,
        # A stream sequence names one immutable message: re-reading a range yields the same records.
        deterministic=True,
        transaction_boundaries=False,
        event_identity=True,
        discover=False,
        shardable=False,
        columns=None if schema is None else tuple(schema.names),
        # A bounded read has no dead-letter route for source records (a malformed one raises DataError).
        dead_letters=continuous and config.on_malformed == "dead_letter",
    )


def where_of(config: NatsSourceConfig) -> str:
    return f"nats stream {config.stream}" + (f" subject {config.subject}" if config.subject else "")


def _domain(config: NatsSourceConfig, facts: StreamFacts) -> OrderingDomain:
    return OrderingDomain(config.source_name, config.stream, config.partition, facts.incarnation, CODEC.name)


def _check_available(config: NatsSourceConfig, facts: StreamFacts, after: int) -> None:
    """Raise PositionUnavailable unless the stream still stores everything after sequence ``after``."""
    where = where_of(config)
    if after > facts.last_seq:
        raise PositionUnavailable(
            f"the position {after} is past the stream's last sequence {facts.last_seq}: the stream lost "
            "messages it had stored",
            where=where,
        )
    if after + 1 < facts.first_seq:
        raise PositionUnavailable(
            f"messages {after + 1} to {facts.first_seq - 1} were removed (purged, expired or deleted) "
            f"before they were read; the stream now starts at {facts.first_seq}",
            where=where,
        )


def _resume_after(
    config: NatsSourceConfig, domain: OrderingDomain, positions: Sequence[Position]
) -> int | None:
    """The certified sequence of ``domain`` among ``positions`` (None: start at the beginning)."""
    where = where_of(config)
    found: int | None = None
    for position in positions:
        known = position.domain
        if (known.source, known.resource) != (domain.source, domain.resource):
            continue
        if known.partition != domain.partition:
            raise ConfigError(
                f"a certified position belongs to subject filter {known.partition or '(none)'!r}, the "
                f"config selects {domain.partition or '(none)'!r}: changing the filter would re-read or "
                "skip messages; use a new stream name",
                where=where,
            )
        if known.codec != domain.codec:
            raise IntegrityError(f"a certified position uses codec {known.codec!r}", where=where)
        if known.incarnation != domain.incarnation:
            raise IncarnationChanged(
                f"the stream was deleted and recreated: it is incarnation {domain.incarnation}, the "
                f"certified position {position.value} belongs to {known.incarnation}",
                where=where,
            )
        if found is not None:
            raise IntegrityError("two certified positions name this domain", where=where)
        found = CODEC.validate(position.value)
    return found


async def stream_facts(
    api: JetStreamApi, config: NatsSourceConfig, *, known_incarnation: bool
) -> StreamFacts:
    try:
        return await api.stream(config.stream)
    except FaucetError as exc:
        if not stream_missing(exc):
            raise
        if known_incarnation:
            raise IncarnationChanged(
                "the stream was deleted: the certified position's incarnation no longer exists",
                where=where_of(config),
            ) from exc
        raise ConfigError("the stream does not exist", where=where_of(config)) from exc


async def close_client(client: Client, where: str) -> None:
    try:
        await client.close()
    except (nats.errors.Error, OSError) as exc:
        raise ConnectionFailed(f"closing the connection failed: {type(exc).__name__}", where=where) from exc


class NatsStreamSession(StreamSession):
    """A session on one stream (domain) through one push consumer; see the module docstring.

    ``finished`` is True once a bounded session has read the stream's last sequence at open.
    ``suppressed`` counts redeliveries of messages this session already held (zero while the
    keep-alive does its job).
    """

    def __init__(
        self,
        config: NatsSourceConfig,
        client: Client,
        consumer: PushConsumer | None,
        domain: OrderingDomain,
        *,
        resumed: int | None,
        end: int | None,
    ) -> None:
        self._config = config
        self._client = client
        self._consumer = consumer
        self.domain = domain
        self._where = where_of(config)
        self._decoder = Decoder(config)
        self._position = resumed
        self._end = end
        self._finished = end is not None and consumer is not None and consumer.max_seen >= end
        self._lock = asyncio.Lock()
        self._closed = False
        self.facts: StreamFacts | None = None
        """The stream as ``open`` found it."""

    @classmethod
    async def open(
        cls,
        config: NatsSourceConfig,
        positions: Sequence[Position],
        *,
        owned: bool,
        worker: WorkerIdentity | None,
        durable: bool,
        bounded: bool,
        max_ack_pending: int | None = None,
        after: int | None = None,
        until: int | None = None,
    ) -> "NatsStreamSession":
        """Connect, check the certified position, and (when ``owned``) create the consumer there.

        ``after`` (a bounded read only) starts right after that sequence of the current incarnation
        instead, when it is past the certified position: everything up to it is at the destination.
        ``until`` (a bounded read only) ends it at that sequence instead of the stream's last.
        """
        where = where_of(config)
        client = await connect(config, where=where)
        try:
            api = JetStreamApi(client, config)
            facts = await stream_facts(api, config, known_incarnation=bool(positions))
            domain = _domain(config, facts)
            resumed = _resume_after(config, domain, positions)
            if after is not None and (resumed is None or after > resumed):
                resumed = after
            if resumed is not None:
                _check_available(config, facts, resumed)
            start_after = resumed if resumed is not None else max(facts.first_seq - 1, 0)
            consumer = None
            if owned:
                settings = (
                    config
                    if max_ack_pending is None
                    else config.model_copy(update={"max_ack_pending": max_ack_pending})
                )
                consumer = PushConsumer(
                    client,
                    api,
                    settings,
                    facts,
                    start_after=start_after,
                    durable=durable,
                    worker=worker,
                    where=where,
                )
                await consumer.start()
            end = (facts.last_seq if until is None else until) if bounded else None
            session = cls(config, client, consumer, domain, resumed=resumed, end=end)
            session.facts = facts
            return session
        except BaseException:
            await client.close()
            raise

    @property
    def finished(self) -> bool:
        return self._finished or self._consumer is None

    @property
    def suppressed(self) -> int:
        return 0 if self._consumer is None else self._consumer.suppressed

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        """Write new messages into ``sink`` until a limit is reached, then one boundary at the last.

        Returns empty coverage when nothing new arrived within ``limits.idle`` (or the bounded
        session is finished, or this worker does not own the domain), and when cancelled: whatever
        was written since the read began is then not covered and is read again by the next read.
        """
        async with self._lock:
            self._check_open()
            consumer = self._consumer
            if consumer is None or self._finished:
                return Coverage()
            taken: list[Chunk] = []
            covered = False
            try:
                end, at_end = await self._read_chunks(consumer, sink, limits, cancel, taken)
                if cancel.cancelled:
                    return Coverage()
                if end is None:
                    self._finished = at_end
                    return Coverage()
                if not await _unless_cancelled(sink.control(ProgressBoundary(self.domain, str(end))), cancel):
                    return Coverage()
                consumer.mark_covered(taken)
                covered = True
                self._finished = at_end
                start = None if self._position is None else str(self._position)
                self._position = end
                return Coverage((DomainCoverage(self.domain, start, str(end)),))
            finally:
                if not covered:
                    consumer.give_back([chunk for chunk in taken if chunk in consumer.reading])

    async def _read_chunks(
        self,
        consumer: PushConsumer,
        sink: StreamRecordSink,
        limits: ReadLimits,
        cancel: CancelToken,
        taken: list[Chunk],
    ) -> tuple[int | None, bool]:
        """Write chunks until a limit; return the last sequence written (None: nothing) and whether a
        bounded session reached its end."""
        loop = asyncio.get_running_loop()
        config = self._config
        began = last_new = loop.time()
        written = size = 0
        end: int | None = None
        max_pending = consumer.max_ack_pending
        while not cancel.cancelled:
            if consumer.failure is not None:
                # A status the server sent (the consumer deleted, deliveries lost): say precisely why.
                raise await consumer.diagnose() or consumer.failure
            now = loop.time()
            if (
                (limits.records is not None and written >= limits.records)
                or (limits.bytes is not None and size >= limits.bytes)
                or (limits.age is not None and now - began >= limits.age)
            ):
                return end, False
            await consumer.intake(with_stamps=self._decoder.needs_stamps)
            room = (
                config.chunk_messages
                if limits.records is None
                else min(config.chunk_messages, limits.records - written)
            )
            chunk = consumer.take(room, upto=self._end)
            if chunk is not None:
                last_new = loop.time()
                await consumer.prove(chunk)
                taken.append(chunk)
                if not await self._write(sink, chunk, cancel):
                    return None, False
                written += len(chunk)
                if limits.bytes is not None:
                    size += sum(len(msg[DATA]) for msg in chunk.msgs)
                end = chunk.last
                if self._end is not None and end >= self._end:
                    return end, True
                continue
            # Nothing ready: stop on idle, a bounded end or a full acknowledgement window; else wait.
            if not consumer.has_incoming:
                await consumer.prove_ahead()
            if (
                self._end is not None
                and not consumer.has_incoming
                and await consumer.nothing_until(self._end)
            ):
                return end, True
            if now - consumer.activity > 2 * config.idle_heartbeat and not consumer.has_incoming:
                # An idle consumer sends a heartbeat every idle_heartbeat: silence means it is gone
                # (the stream deleted or recreated, the consumer taken over) or the link is down.
                failure = await consumer.diagnose()
                if failure is not None:
                    raise failure
            if limits.idle is not None and now - last_new >= limits.idle:
                return end, False
            if 0 < max_pending <= consumer.held and not consumer.has_incoming:
                # The server sends nothing more until something is acknowledged: end at a boundary.
                return end, False
            deadlines = [config.idle_heartbeat]
            if limits.idle is not None:
                deadlines.append(last_new + limits.idle - now)
            if limits.age is not None:
                deadlines.append(began + limits.age - now)
            if self._end is not None:
                deadlines.append(0.05)
            await _unless_cancelled(consumer.wait(max(0.0, min(deadlines))), cancel)
        return None, False

    async def _write(self, sink: StreamRecordSink, chunk: Chunk, cancel: CancelToken) -> bool:
        """Decode ``chunk`` and hand its rows (and malformed messages) to ``sink`` in stream order.

        Returns False when cancelled before everything was handed over.
        """
        if len(chunk) <= INLINE_DECODE_MESSAGES:
            runs = self._decoder.decode(chunk.msgs, chunk.seqs, chunk.stamps)
        else:
            # Arrow parses without the GIL: meanwhile the event loop receives the next deliveries.
            runs = await asyncio.to_thread(self._decoder.decode, chunk.msgs, chunk.seqs, chunk.stamps)
        for run in runs:
            positions = chunk.positions
            if run.rows is not None:
                if run.start or run.stop != len(chunk):
                    positions = positions[run.start : run.stop]
                step: Awaitable[None] = sink.write(self.domain, run.rows, Identities(positions))
            else:
                where = f"{self._where} sequence {positions[run.start]}"
                if self._config.on_malformed == "halt":
                    raise DataError(run.reason, where=where)
                step = sink.reject(
                    RejectedRecord(
                        EventIdentity(self.domain, positions[run.start]),
                        run.reason,
                        chunk.msgs[run.start][DATA],
                        where,
                        self._config.stream,
                    )
                )
            if not await _unless_cancelled(step, cancel):
                return False
        return True

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        """Acknowledge the certified ``coverage`` cumulatively, after ``authority()`` (see module doc)."""
        async with self._lock:
            self._check_open()
            consumer = self._consumer
            end = None
            for item in coverage.domains:
                if item.domain != self.domain:
                    if item.domain.lineage == self.domain.lineage:
                        raise IncarnationChanged(
                            f"the coverage belongs to incarnation {item.domain.incarnation}, this session "
                            f"reads {self.domain.incarnation}",
                            where=self._where,
                        )
                    raise IntegrityError(
                        f"the coverage names another domain: {item.domain}", where=self._where
                    )
                end = CODEC.validate(item.end)
            if consumer is None:
                if end is not None:
                    raise IntegrityError(
                        "this worker does not own the domain it acknowledges", where=self._where
                    )
                return
            if end is not None and (self._position is None or end > self._position):
                raise IntegrityError(
                    f"acknowledging sequence {end}, past what this session read ({self._position})",
                    where=self._where,
                )
            await consumer.acknowledge(consumer.acked if end is None else end, authority)

    async def lag(self) -> tuple[SourceLag, ...]:
        """Stream sequences after where the reads reached, up to the stream's last sequence (with a
        subject filter, other subjects' messages count too), and how much older the message there is
        than the newest one by their server timestamps. One STREAM.INFO request, and one message read
        when behind and the message where the reads reached is no longer held by the session (its
        acknowledgement subject carries its timestamp until it is acknowledged). Nothing for a worker
        that does not own the domain."""
        consumer = self._consumer
        if consumer is None or self._closed:
            return ()
        api = JetStreamApi(self._client, self._config)
        head = await api.stream(self._config.stream)
        reached = self._position if self._position is not None else consumer.facts.first_seq - 1
        behind = max(0, head.last_seq - reached)
        seconds: float | None = 0.0
        if behind:
            seconds = None
            held = consumer.stamp_of(reached) if reached > 0 else None
            if held is not None:
                at: datetime | None = _EPOCH + timedelta(microseconds=held // 1000)
            else:
                at = await self._message_time(api, reached) if reached > 0 else None
            newest = _rfc3339(head.last_time)
            if at is not None and newest is not None:
                seconds = max(0.0, (newest - at).total_seconds())
        position = None if self._position is None else str(self._position)
        return (SourceLag(self.domain, position, str(head.last_seq), behind, "messages", seconds),)

    async def _message_time(self, api: JetStreamApi, seq: int) -> datetime | None:
        """The server timestamp of the message at ``seq`` (None: it is no longer stored)."""
        body = {"seq": seq}
        try:
            answer = await api.request(f"STREAM.MSG.GET.{self._config.stream}", body, where=self._where)
        except JetStreamRefused as exc:
            if exc.err_code == NO_MESSAGE_FOUND:
                return None
            raise
        try:
            return _rfc3339(str(answer["message"]["time"]))
        except (KeyError, TypeError) as exc:
            raise ConnectionFailed("JetStream sent a message without its time", where=self._where) from exc

    async def close(self) -> None:
        """Join an outstanding read or acknowledgement, then stop the consumer and disconnect.

        Unacknowledged messages stay with the server; the next open resumes at the certified position.
        """
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._consumer is not None:
                    await self._consumer.close()
            finally:
                await close_client(self._client, self._where)

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError("the session is closed", where=self._where)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _rfc3339(text: str) -> datetime | None:
    """A JetStream timestamp (RFC 3339 in UTC, nanoseconds) as an aware datetime; None when it is not
    one (the lag then has no seconds)."""
    stamp, _, fraction = text.removesuffix("Z").partition(".")
    try:
        return datetime.fromisoformat(f"{stamp}.{(fraction + '000000')[:6]}+00:00")
    except ValueError:
        return None


async def _unless_cancelled(step: Awaitable[T], cancel: CancelToken) -> bool:
    """Await ``step`` unless ``cancel`` fires first (then ``step`` is cancelled); True if it completed."""
    task = asyncio.ensure_future(step)
    if task.done():
        task.result()
        return True
    waiter = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True


class NatsStreamSource(StreamSource):
    """The continuous NATS JetStream source (one stream, optionally filtered by subject)."""

    connector_name = "nats"

    def __init__(self, config: NatsSourceConfig) -> None:
        self.config = config

    def capabilities(self) -> SourceCapabilities:
        return capabilities(self.config, continuous=True)

    def codecs(self) -> Sequence[PositionCodec[Any]]:
        return (CODEC,)

    async def replay(self, coverage: DomainCoverage, sink: StreamRecordSink, cancel: CancelToken) -> None:
        """Re-read one certified sequence range for ``faucet verify`` (:mod:`faucet_nats.replay`)."""
        config, domain = self.config, coverage.domain
        if domain.lineage != (config.source_name, config.stream, config.partition):
            raise IntegrityError(f"the range belongs to {domain}, not to this source", where=where_of(config))
        start = () if coverage.start is None else (Position(domain, coverage.start),)
        session = await NatsStreamSession.open(
            config,
            start,
            owned=True,
            worker=None,
            durable=False,
            bounded=True,
            max_ack_pending=2 * config.chunk_messages,
            until=CODEC.validate(coverage.end),
        )
        try:
            await read_range(session, coverage, sink, cancel, where_of(config))
        finally:
            await session.close()

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> NatsStreamSession:
        """Open a session on the configured stream (the only resource) after its certified position."""
        config = self.config
        unknown = sorted(set(resources) - {config.stream})
        if unknown:
            raise ConfigError(
                f"this source reads stream {config.stream!r} only, not {', '.join(unknown)}",
                where=where_of(config),
            )
        return await NatsStreamSession.open(
            config,
            resume_positions,
            owned=membership.owns(config.stream, config.partition),
            worker=worker,
            durable=True,
            bounded=config.bounded,
        )
