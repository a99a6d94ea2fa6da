"""In-memory stream source and sink with fault knobs, for runner and pipeline tests.

They exist only to put a fault at an exact point of the epoch (a source reporting coverage past its
last boundary, a read cancelled mid-transaction, a commit that fails or whose outcome is unknown, a
close that cannot promise anything). Delivery end to end is tested against real NATS and PostgreSQL.

The source serves a list of JSON rows at positions 1..N of one domain (codec
``nats.stream_sequence``). The sink keeps committed rows in memory with a per-domain watermark and,
like the PostgreSQL APPEND sink, drops replayed rows at or below its watermark.
"""

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from faucet_dagster.protocol import (
    Authority,
    CancelToken,
    Coverage,
    Delivery,
    DomainCoverage,
    Durability,
    Emits,
    EpochId,
    EpochMismatch,
    Identities,
    IncarnationChanged,
    LifecycleError,
    Membership,
    Operation,
    Ordering,
    OrderingDomain,
    Position,
    PositionCodec,
    ProgressBoundary,
    ReadLimits,
    Receipt,
    Replay,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    SourceCapabilities,
    StreamingSink,
    StreamingSinkSession,
    StreamRecordSink,
    StreamSession,
    StreamSource,
    TransactionBegin,
    TransactionEnd,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
    default_codec_registry,
)

CODEC = "nats.stream_sequence"


def domain(incarnation: str = "inc-1") -> OrderingDomain:
    return OrderingDomain("memory", "items", "0", incarnation, CODEC)


@dataclass
class SourceFaults:
    """Where the scripted source misbehaves."""

    coverage_past_boundary: int = 0
    """Report coverage this many positions past the last boundary it sent."""
    transaction_size: int = 0
    """Wrap every ``transaction_size`` rows in a source transaction (0: progress boundaries only)."""
    block_after_rows: int | None = None
    """After this many rows of a read, wait (keep the transaction open) until cancelled."""
    before_acknowledge: Callable[[], Awaitable[None]] | None = None
    """Awaited when ``acknowledge`` is called, before anything is acknowledged."""


@dataclass
class MemoryLog:
    """The provider: rows at positions 1..N and what was acknowledged."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    incarnation: str = "inc-1"
    acknowledged: int = 0
    acknowledgements: list[int] = field(default_factory=list)
    reads: list[ReadLimits] = field(default_factory=list)
    """The limits of every read, in order."""

    def append(self, count: int, **extra: Any) -> None:
        start = len(self.rows)
        self.rows.extend(
            {"id": start + index + 1, "name": f"row-{start + index + 1}", **extra} for index in range(count)
        )


class MemorySession(StreamSession):
    """A session on the log. Like a provider's client, it takes one call at a time: a call while
    another runs (the runner's contract forbids it) fails loudly."""

    def __init__(self, log: MemoryLog, after: int, faults: SourceFaults, chunk: int) -> None:
        self.log = log
        self.position = after
        self.faults = faults
        self.chunk = chunk
        self.closed = False
        self.busy: str | None = None

    def _enter(self, call: str) -> None:
        if self.busy is not None:
            raise AssertionError(f"{call} called while {self.busy} runs on the same source session")
        self.busy = call

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        self._enter("read")
        try:
            return await self._read(sink, limits, cancel)
        finally:
            self.busy = None

    async def _read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        self.log.reads.append(limits)
        dom = domain(self.log.incarnation)
        start = boundary = self.position
        available = len(self.log.rows)
        target = available if limits.records is None else min(available, start + limits.records)
        size = self.faults.transaction_size
        sent = 0
        while self.position < target and not cancel.cancelled:
            # A transaction is finished even past the record target: limits are only targets.
            stop = min(available, self.position + size) if size else min(target, self.position + self.chunk)
            transaction = f"tx{self.position + 1}"
            if size:
                await sink.control(TransactionBegin(dom, transaction))
            for low in range(self.position, stop, self.chunk):
                high = min(stop, low + self.chunk)
                await sink.write(
                    dom, self.log.rows[low:high], Identities([str(p) for p in range(low + 1, high + 1)])
                )
                sent += high - low
                if self.faults.block_after_rows is not None and sent >= self.faults.block_after_rows:
                    await cancel.wait()  # interrupted inside the transaction: no coverage past its begin
                    return self._coverage(dom, start, boundary)
            self.position = stop
            if size:
                await sink.control(TransactionEnd(dom, transaction, str(stop)))
                boundary = stop
        if not size and self.position > boundary:
            await sink.control(ProgressBoundary(dom, str(self.position)))
            boundary = self.position
        return self._coverage(dom, start, boundary)

    def _coverage(self, dom: OrderingDomain, start: int, boundary: int) -> Coverage:
        if boundary == start and not self.faults.coverage_past_boundary:
            return Coverage()
        end = boundary + self.faults.coverage_past_boundary
        return Coverage((DomainCoverage(dom, None if start == 0 else str(start), str(end)),))

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        self._enter("acknowledge")
        try:
            if self.faults.before_acknowledge is not None:
                await self.faults.before_acknowledge()
            for item in coverage.domains:
                await authority()
                self.log.acknowledged = max(self.log.acknowledged, int(item.end))
                self.log.acknowledgements.append(int(item.end))
        finally:
            self.busy = None

    async def close(self) -> None:
        self.closed = True


class MemorySource(StreamSource):
    connector_name = "memory"

    def __init__(self, log: MemoryLog, faults: SourceFaults | None = None, chunk: int = 100) -> None:
        self.log = log
        self.faults = faults or SourceFaults()
        self.chunk = chunk
        self.sessions: list[MemorySession] = []
        self.opened_at: list[tuple[Position, ...]] = []

    def capabilities(self) -> SourceCapabilities:
        return SourceCapabilities(
            emits=Emits.MESSAGES,
            operations=frozenset({Operation.INSERT}),
            ordering=Ordering.PARTITION,
            replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
            bounded=False,
            continuous=True,
            deterministic=True,
            event_identity=True,
        )

    def codecs(self) -> Sequence[PositionCodec[Any]]:
        return [default_codec_registry().get(CODEC)]

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> StreamSession:
        self.opened_at.append(tuple(resume_positions))
        after = 0
        for position in resume_positions:
            if position.domain.incarnation != self.log.incarnation:
                raise IncarnationChanged("the memory log was recreated", where="memory")
            after = int(position.value)
        session = MemorySession(self.log, after, self.faults, self.chunk)
        self.sessions.append(session)
        return session


@dataclass
class SinkFaults:
    """Where the memory sink misbehaves."""

    commit_error: Exception | None = None
    """Raised by ``commit_epoch`` before anything is committed."""
    commit_then_error: Exception | None = None
    """Raised by ``commit_epoch`` after the epoch was committed (an unknown outcome)."""
    close_error: Exception | None = None
    apply_delay: float = 0.0
    apply_error: Exception | None = None
    before_commit: Callable[[EpochId], Awaitable[None]] | None = None
    """Awaited when ``commit_epoch`` is called, before anything is committed (it may raise)."""


@dataclass
class MemoryDestination:
    """What survives sink sessions: committed rows, the per-domain watermark, the last epoch."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    watermarks: dict[OrderingDomain, int] = field(default_factory=dict)
    last_epoch: EpochId | None = None
    calls: list[str] = field(default_factory=list)


class MemorySinkSession(StreamingSinkSession):
    def __init__(self, destination: MemoryDestination, faults: SinkFaults) -> None:
        self.destination = destination
        self.faults = faults
        self.active: EpochId | None = None
        self.pending: list[SinkBatch] = []

    async def last_committed(self) -> SinkCommitState | None:
        dest = self.destination
        if dest.last_epoch is None:
            return None
        return SinkCommitState(
            dest.last_epoch, tuple(Position(d, str(v)) for d, v in dest.watermarks.items())
        )

    async def begin_epoch(self, epoch: EpochId) -> None:
        self.destination.calls.append(f"begin {epoch.sequence}")
        if self.active is not None:
            raise LifecycleError(f"epoch {self.active} is still active")
        self.active = epoch
        self.pending = []

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        if epoch != self.active or batch.epoch != epoch:
            raise EpochMismatch(f"batch for {batch.epoch}, active {self.active}")
        self.destination.calls.append(f"apply {epoch.sequence} {batch.records.num_rows}")
        if self.faults.apply_delay:
            await asyncio.sleep(self.faults.apply_delay)
        if self.faults.apply_error is not None:
            raise self.faults.apply_error
        self.pending.append(batch)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        self.destination.calls.append(f"commit {epoch.sequence}")
        if epoch != self.active:
            raise EpochMismatch(f"commit of {epoch}, active {self.active}")
        if self.faults.before_commit is not None:
            await self.faults.before_commit(epoch)
        if self.faults.commit_error is not None:
            raise self.faults.commit_error
        written = skipped = 0
        for batch in self.pending:
            mark = self.destination.watermarks.get(batch.domain, 0)
            for row, position in zip(batch.records.to_pylist(), batch.identities.positions, strict=True):
                if int(position) <= mark:
                    skipped += 1
                else:
                    self.destination.rows.append(row)
                    written += 1
        for item in coverage.domains:
            self.destination.watermarks[item.domain] = max(
                self.destination.watermarks.get(item.domain, 0), int(item.end)
            )
        self.destination.last_epoch = epoch
        self.active = None
        self.pending = []
        if self.faults.commit_then_error is not None:
            raise self.faults.commit_then_error
        return (Receipt("items", written, skipped),)

    async def abort_epoch(self, epoch: EpochId) -> None:
        self.destination.calls.append(f"abort {epoch.sequence}")
        self.active = None
        self.pending = []

    async def close_session(self) -> None:
        self.destination.calls.append("close")
        if self.faults.close_error is not None:
            raise self.faults.close_error


class MemorySink(StreamingSink):
    connector_name = "memory"

    def __init__(
        self, destination: MemoryDestination | None = None, faults: SinkFaults | None = None
    ) -> None:
        self.destination = destination or MemoryDestination()
        self.faults = faults or SinkFaults()
        self.opened: list[WorkerIdentity] = []

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(
            bounded_policies=frozenset({WritePolicy.APPEND}),
            continuous_policies=frozenset({WritePolicy.APPEND}),
            durability=Durability.TRANSACTIONAL,
            atomic_watermark=True,
        )

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        self.opened.append(worker)
        return MemorySinkSession(self.destination, self.faults)


def arrow_schema(columns: Mapping[str, pa.DataType]) -> pa.Schema:
    return pa.schema([pa.field(name, kind) for name, kind in columns.items()])


__all__ = [
    "CODEC",
    "Delivery",
    "MemoryDestination",
    "MemoryLog",
    "MemorySink",
    "MemorySource",
    "SinkFaults",
    "SourceFaults",
    "UncertainOutcome",
    "domain",
]
