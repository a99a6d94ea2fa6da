"""A certified sequence range of the stream, re-read for ``faucet verify`` (``StreamSource.replay``).

The range is read through the session the sources share (:class:`~faucet_nats.source.NatsStreamSession`)
with an ephemeral consumer of its own, as the bounded source reads: the stream's durable consumer is
never touched, and acknowledgements only release the ephemeral consumer's window. The session decodes,
rejects malformed messages and proves delivery gaps as a stream's reads do, and ends at the range's
end (``until``), so rows and event identities are the ones the epoch had.

Not replayable (:class:`PositionUnavailable`): messages of the range were removed (purged, expired,
limited away; for a range from the stream's beginning, any before the first stored sequence), or the
stream holds fewer messages than the range ends at. The stream deleted and recreated under the same
name raises :class:`IncarnationChanged`.
"""

from faucet_dagster.protocol import (
    CancelToken,
    DomainCoverage,
    IncarnationChanged,
    IntegrityError,
    Position,
    PositionUnavailable,
    ReadLimits,
    StreamRecordSink,
)
from faucet_nats.config import NatsSourceConfig
from faucet_nats.source import CODEC, NatsStreamSession, where_of


async def _owner_always() -> None:
    """The replay's acknowledgements release its own ephemeral consumer's window only."""


async def replay_range(
    config: NatsSourceConfig, coverage: DomainCoverage, sink: StreamRecordSink, cancel: CancelToken
) -> None:
    """Write the messages of ``coverage`` (after ``start`` up to ``end``) into ``sink``."""
    domain, where = coverage.domain, where_of(config)
    if (domain.source, domain.resource, domain.partition) != (
        config.source_name,
        config.stream,
        config.partition,
    ):
        raise IntegrityError(f"the range belongs to {domain}, not to this source", where=where)
    end = CODEC.validate(coverage.end)
    start = None if coverage.start is None else CODEC.validate(coverage.start)
    positions = () if coverage.start is None else (Position(domain, coverage.start),)
    session = await NatsStreamSession.open(
        config,
        positions,
        owned=True,
        worker=None,
        durable=False,
        bounded=True,
        max_ack_pending=2 * config.chunk_messages,
        until=end,
    )
    try:
        facts = session.facts
        assert facts is not None  # set by open
        if session.domain.incarnation != domain.incarnation:
            raise IncarnationChanged(
                f"the stream is incarnation {session.domain.incarnation} now, the certified range belongs "
                f"to {domain.incarnation} (deleted and re-created)",
                where=where,
            )
        if start is None and facts.first_seq > facts.configured_first_seq:
            raise PositionUnavailable(
                f"the range starts at the stream's beginning; messages {facts.configured_first_seq} to "
                f"{facts.first_seq - 1} were removed since",
                where=where,
            )
        if facts.last_seq < end:
            raise PositionUnavailable(
                f"the range ends at sequence {end}, the stream at {facts.last_seq}: it lost messages",
                where=where,
            )
        limits = ReadLimits(records=2 * config.chunk_messages, bytes=None, idle=None, age=None)
        while not session.finished and not cancel.cancelled:
            coverage_read = await session.read(sink, limits, cancel)
            if coverage_read.empty:
                if not session.finished and not cancel.cancelled:
                    raise IntegrityError("the re-read stopped before the range's end", where=where)
                break
            await session.acknowledge(coverage_read, _owner_always)
    finally:
        await session.close()


__all__ = ["replay_range"]
