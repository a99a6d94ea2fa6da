"""A certified sequence range of the stream, re-read for ``faucet verify`` (``StreamSource.replay``).

The range is read through the session the sources share (:class:`~faucet_nats.source.NatsStreamSession`,
opened by :meth:`NatsStreamSource.replay <faucet_nats.source.NatsStreamSource.replay>`) with an
ephemeral consumer of its own, as the bounded source reads: the stream's durable consumer is never
touched, and acknowledgements only release the ephemeral consumer's window. The session decodes,
rejects malformed messages and proves delivery gaps as a stream's reads do, and ends at the range's
end (``until``), so rows and event identities are the ones the epoch had.

Not replayable (:class:`PositionUnavailable`): messages of the range were removed (purged, expired,
limited away; for a range from the stream's beginning, any before the first stored sequence), or the
stream holds fewer messages than the range ends at. The stream deleted and re-created under the same
name raises :class:`IncarnationChanged`.
"""

from typing import Protocol

from faucet_dagster.protocol import (
    CancelToken,
    Coverage,
    DomainCoverage,
    IncarnationChanged,
    IntegrityError,
    JsonValue,
    OrderingDomain,
    PositionUnavailable,
    ReadLimits,
    StreamRecordSink,
)
from faucet_nats.config import NatsSourceConfig
from faucet_nats.jetstream import JetStreamApi, StreamFacts, connect


class RangeSession(Protocol):
    """What :func:`read_range` needs of a bounded :class:`~faucet_nats.source.NatsStreamSession`."""

    domain: OrderingDomain
    facts: StreamFacts | None

    @property
    def finished(self) -> bool: ...
    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage: ...
    async def acknowledge(self, coverage: Coverage, authority: "Authorize") -> None: ...


class Authorize(Protocol):
    async def __call__(self) -> None: ...


async def _owner_always() -> None:
    """The replay's acknowledgements release its own ephemeral consumer's window only."""


async def read_range(
    session: RangeSession, coverage: DomainCoverage, sink: StreamRecordSink, cancel: CancelToken, where: str
) -> None:
    """Write what ``session`` (opened after ``coverage.start``, until ``coverage.end``) reads into
    ``sink``, after checking the stream still is the certified one and still holds the range."""
    facts, domain, end = session.facts, coverage.domain, int(coverage.end)
    assert facts is not None  # set by open
    if session.domain.incarnation != domain.incarnation:
        raise IncarnationChanged(
            f"the stream is incarnation {session.domain.incarnation} now, the certified range belongs to "
            f"{domain.incarnation} (deleted and re-created)",
            where=where,
        )
    if coverage.start is None:
        _check_first(facts, where)
    if facts.last_seq < end:
        raise PositionUnavailable(
            f"the range ends at sequence {end}, the stream at {facts.last_seq}: it lost messages", where=where
        )
    limits = ReadLimits(records=None, bytes=None, idle=None, age=None)
    while not session.finished and not cancel.cancelled:
        read = await session.read(sink, limits, cancel)
        if read.empty:
            if not session.finished and not cancel.cancelled:
                raise IntegrityError("the re-read stopped before the range's end", where=where)
            return
        await session.acknowledge(read, _owner_always)


async def check_beginning(config: NatsSourceConfig, where: str) -> None:
    """Before a re-read from the stream's beginning: the stream still holds its first messages."""
    client = await connect(config, where=where)
    try:
        facts = await JetStreamApi(client, config).stream(config.stream)
    finally:
        await client.close()
    _check_first(facts, where)


def _check_first(facts: StreamFacts, where: str) -> None:
    """A range from the stream's beginning needs its first messages: none removed since."""
    if facts.first_seq > facts.configured_first_seq:
        raise PositionUnavailable(
            f"the range starts at the stream's beginning; messages {facts.configured_first_seq} to "
            f"{facts.first_seq - 1} were removed since",
            where=where,
        )


def check_replayed(end: JsonValue | None, reached: JsonValue | None, where: str) -> None:
    """After a bounded re-read up to bookmark ``end``: it reached ``end`` in the same incarnation, or
    the stream no longer holds the run's messages (IncarnationChanged, PositionUnavailable)."""
    if not isinstance(end, dict):
        return
    if isinstance(reached, dict) and reached.get("incarnation") != end.get("incarnation"):
        raise IncarnationChanged(
            f"the stream is incarnation {reached.get('incarnation')} now, the run read "
            f"{end.get('incarnation')} (deleted and re-created)",
            where=where,
        )
    if not isinstance(reached, dict) or reached.get("sequence") != end.get("sequence"):
        got = None if not isinstance(reached, dict) else reached.get("sequence")
        raise PositionUnavailable(
            f"the re-read ended at sequence {got}, the run at {end.get('sequence')}: the stream lost "
            "messages",
            where=where,
        )


__all__ = ["RangeSession", "check_replayed", "read_range"]
