"""What every check uses: the subject under test, time limits, and the probes at either end.

A source under test writes into the real :class:`~faucet_dagster.pipeline.EpochPipeline`, which
enforces epoch completion; the pipeline applies its batches to a :class:`ProbeSinkSession`, the
battery's observer (like singer-sdk's captured target output): it keeps what was applied and can
block (a slow sink) or refuse (a failed write) one apply. A sink under test receives
:class:`~faucet_dagster.protocol.SinkBatch` values the battery builds from standard rows.
"""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa

from faucet_dagster.conformance.options import ConformanceFailure, ConformanceOptions
from faucet_dagster.conformance.setup import Row, SinkSetup, SourceSetup
from faucet_dagster.pipeline import Pipeline, ResourceSchema
from faucet_dagster.protocol import (
    CancelToken,
    Control,
    Coverage,
    DomainCoverage,
    EpochId,
    EpochMismatch,
    FaucetError,
    Identities,
    LifecycleError,
    Membership,
    OrderingDomain,
    Position,
    ReadLimits,
    Receipt,
    Records,
    RejectedRecord,
    Role,
    Sink,
    SinkBatch,
    SinkCommitState,
    Source,
    StreamingSink,
    StreamingSinkSession,
    StreamRecordSink,
    StreamSession,
    StreamSource,
    WorkerIdentity,
    WritePolicy,
    record_count,
)
from faucet_dagster.protocol.registry import ConnectorSpec

T = TypeVar("T")

STREAM = "conformance"
RESOURCE = "items"
DOMAIN = OrderingDomain("conformance", RESOURCE, "0", "incarnation-1", "kafka.offset")
"""The ordering domain of the batches the battery hands a streaming sink (positions are the ids)."""
ROW_SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string())])
QUIET = ReadLimits(records=None, bytes=None, idle=0.5, age=None)
"""Read limits for draining a stream source: end a read after half a second with nothing new."""


@dataclass
class Subject:
    """One connector role under test, with a fresh setup against the real system."""

    spec: ConnectorSpec
    role: Role
    setup: SourceSetup | SinkSetup
    options: ConformanceOptions
    fresh: Callable[[], SourceSetup | SinkSetup] | None = None
    """A new setup against the same servers (the generated scenarios use one per run, after
    ``setup``); ``None``: only ``setup`` exists, so one scenario runs and a failure is not shrunk."""

    @property
    def label(self) -> str:
        return f"{self.spec.name} {self.role.value}"

    @property
    def source_setup(self) -> SourceSetup:
        assert isinstance(self.setup, SourceSetup), f"{self.label} has no source setup"
        return self.setup

    @property
    def sink_setup(self) -> SinkSetup:
        assert isinstance(self.setup, SinkSetup), f"{self.label} has no sink setup"
        return self.setup

    def build(self, config: Any = None) -> object:
        """The connector in this role, built from ``config`` (default: the setup's config)."""
        return self.spec.build(self.role, dict(self.setup.config) if config is None else config)

    def source(self, config: Any = None) -> Source:
        built = self.build(config)
        assert isinstance(built, Source)
        return built

    def sink(self, config: Any = None) -> Sink:
        built = self.build(config)
        assert isinstance(built, Sink)
        return built

    def stream_source(self, config: Any = None) -> StreamSource:
        built = self.build(config)
        assert isinstance(built, StreamSource)
        return built

    def streaming_sink(self, config: Any = None) -> StreamingSink:
        built = self.build(config)
        assert isinstance(built, StreamingSink)
        return built

    async def within(self, step: Awaitable[T], rule: str, what: str, timeout: float | None = None) -> T:
        """Await ``step``; a step still running after the timeout breaks ``rule`` (a hang)."""
        limit = self.options.timeout if timeout is None else timeout
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await step
        except TimeoutError:
            if not deadline.expired():
                raise  # the step's own TimeoutError, not our limit: the check judges it
            raise ConformanceFailure(rule, f"{what} did not return within {limit:g}s (a hang)") from None


def ids_of(records: Records) -> list[int]:
    """The ``id`` of every record, in order."""
    if isinstance(records, pa.RecordBatch):
        if record_count(records) == 0:
            return []
        return [int(value) for value in records.column("id").to_pylist()]
    return [int(row["id"]) for row in records]


def rows_batch(rows: Sequence[Row]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([dict(row) for row in rows], schema=ROW_SCHEMA)


def sink_batch(epoch: EpochId, rows: Sequence[Row], domain: OrderingDomain = DOMAIN) -> SinkBatch:
    """A batch of standard rows for ``epoch``; each row's position is its id (stable on replay)."""
    return SinkBatch(
        epoch, RESOURCE, domain, rows_batch(rows), Identities([str(int(row["id"])) for row in rows])
    )


def covering(rows: Sequence[Row], start: int | None = None, domain: OrderingDomain = DOMAIN) -> Coverage:
    """The coverage of a batch of ``rows`` (positions are ids) after certified ``start``."""
    end = max(int(row["id"]) for row in rows)
    return Coverage((DomainCoverage(domain, None if start is None else str(start), str(end)),))


def pairs(rows: Sequence[Row]) -> list[tuple[int, str]]:
    """``(id, name)`` of every row, sorted: destinations are compared as multisets."""
    return sorted((int(row["id"]), str(row["name"])) for row in rows)


class ProbeSinkSession(StreamingSinkSession):
    """The battery's observer at the end of a source's pipeline: keeps what is applied, per epoch.

    ``delay`` seconds are slept in the next ``apply`` (a slow sink); ``refuse`` is raised by the next
    ``apply`` (a failed write). Lifecycle misuse raises LifecycleError/EpochMismatch like a real sink.
    """

    def __init__(self) -> None:
        self.active: EpochId | None = None
        self.pending: list[SinkBatch] = []
        self.committed: list[SinkBatch] = []
        self.delay = 0.0
        self.refuse: FaucetError | None = None
        self.applying = asyncio.Event()

    async def last_committed(self) -> SinkCommitState | None:
        return None

    async def begin_epoch(self, epoch: EpochId) -> None:
        if self.active is not None:
            raise LifecycleError(f"epoch {self.active} is still active", where="probe sink")
        self.active, self.pending = epoch, []

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        if epoch != self.active or batch.epoch != epoch:
            raise EpochMismatch(f"a batch of {batch.epoch} in {self.active}", where="probe sink")
        self.applying.set()
        if self.delay:
            delay, self.delay = self.delay, 0.0
            await asyncio.sleep(delay)
        if self.refuse is not None:
            refused, self.refuse = self.refuse, None
            raise refused
        self.pending.append(batch)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        if epoch != self.active:
            raise LifecycleError(f"commit of {epoch} while {self.active} is active", where="probe sink")
        self.committed.extend(self.pending)
        self.active, self.pending = None, []
        return ()

    async def abort_epoch(self, epoch: EpochId) -> None:
        self.active, self.pending = None, []

    async def close_session(self) -> None:
        self.active = None

    def committed_ids(self) -> list[int]:
        return [i for batch in self.committed for i in ids_of(batch.records)]


WORKER = WorkerIdentity("conformance-worker", 1)
OTHER_WORKER = WorkerIdentity("conformance-takeover", 7)
"""The worker that takes the stream over after :data:`WORKER` stopped (another id, a higher token)."""


class Tap(StreamRecordSink):
    """Stands between a source's read and the pipeline: forwards everything, keeps the controls it
    saw, and awaits ``on_write`` (the number of rows written so far) after each write."""

    def __init__(
        self, inner: StreamRecordSink, on_write: Callable[[int], Awaitable[None]] | None = None
    ) -> None:
        self.inner = inner
        self.on_write = on_write
        self.controls: list[Control] = []
        self.rows = 0

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        await self.inner.write(domain, rows, identities, resource=resource)
        self.rows += record_count(rows)
        if self.on_write is not None:
            await self.on_write(self.rows)

    async def control(self, control: Control) -> None:
        await self.inner.control(control)
        self.controls.append(control)

    async def reject(self, record: RejectedRecord) -> None:
        await self.inner.reject(record)


async def _owner() -> None:
    """The authority of the battery's own epochs: this worker always holds the stream."""


@dataclass
class StreamDriver:
    """Runs epochs of a source session through the real pipeline into a probe, as the runner would:
    begin, read, seal, commit at the probe, then acknowledge with the authority given.

    ``certified`` are the positions of the epochs committed so far; ``events`` every certified
    event in commit order, as (domain, position, ordinal, id). ``worker`` is the identity sessions
    are opened with (a replay by another worker uses another one, with another fencing token).
    """

    subject: Subject
    rule: str
    session: StreamSession | None = None
    probe: ProbeSinkSession = field(default_factory=ProbeSinkSession)
    pipeline: Pipeline = field(default_factory=lambda: Pipeline(default_schema=ResourceSchema()))
    certified: tuple[Position, ...] = ()
    events: list[tuple[str, str, int, int]] = field(default_factory=list)
    controls: list[Control] = field(default_factory=list)
    sequence: int = 0
    acknowledge: bool = True
    worker: WorkerIdentity = WORKER

    async def open(self, source: StreamSource | None = None) -> StreamSession:
        """Open a session at the certified positions (closing a previous one first)."""
        await self.close()
        opened = source or self.subject.stream_source()
        self.session = await self.subject.within(
            opened.open(self.subject.source_setup.resources, self.certified, Membership(), self.worker),
            self.rule,
            "StreamSource.open",
        )
        return self.session

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await self.subject.within(session.close(), self.rule, "StreamSession.close")

    async def epoch(
        self,
        limits: ReadLimits,
        cancel: CancelToken | None = None,
        *,
        acknowledge: bool | None = None,
        authority: Callable[[], Awaitable[None]] = _owner,
        on_write: Callable[[int], Awaitable[None]] | None = None,
    ) -> tuple[Coverage, list[int]]:
        """One epoch; returns its coverage and the ids it certified (empty coverage: none).

        ``on_write`` is awaited after each write of the read (see :class:`Tap`).
        """
        session = self.session or await self.open()
        self.sequence += 1
        epoch = EpochId(STREAM, self.sequence, self.worker.fencing_token)
        await self.probe.begin_epoch(epoch)
        before = len(self.probe.committed)
        pipeline = self.pipeline.begin(epoch, self.probe, self.certified)
        tap = Tap(pipeline, on_write)
        token = cancel or CancelToken()
        try:
            coverage = await self.subject.within(
                session.read(tap, limits, token), self.rule, "StreamSession.read"
            )
            self.controls.extend(tap.controls)
            if token.cancelled:
                # Cancellation is an interruption: what it returned must still be sealable (no
                # coverage past an accepted boundary), but it is never certified; the runner aborts
                # the epoch and reopens the session at the certified positions.
                if not coverage.empty:
                    await pipeline.seal(coverage)
                raise _Interrupted
            if coverage.empty and not pipeline.has_evidence:
                await self.probe.abort_epoch(epoch)
                return coverage, []
            sealed = await pipeline.seal(coverage)
        except BaseException as exc:
            await pipeline.discard()
            await self.probe.abort_epoch(epoch)
            await self.close()
            if isinstance(exc, _Interrupted):
                return coverage, []
            raise
        await self.probe.commit_epoch(epoch, sealed.coverage)
        batches = self.probe.committed[before:]
        self.certified = advance(self.certified, sealed.coverage)
        for batch in batches:
            self.events.extend(
                (str(batch.domain), *_identity(batch.identities, index), event_id)
                for index, event_id in enumerate(ids_of(batch.records))
            )
        if (self.acknowledge if acknowledge is None else acknowledge) and not sealed.coverage.empty:
            await self.subject.within(
                session.acknowledge(sealed.coverage, authority), self.rule, "acknowledge"
            )
        return sealed.coverage, [i for batch in batches for i in ids_of(batch.records)]

    async def read_until(self, expected: set[int], limits: ReadLimits) -> list[int]:
        """Run epochs until every id in ``expected`` was certified, or ``options.timeout`` passed.

        Returns every id certified, in order (duplicates included). Nothing but the rows ends it
        early: a source that is slow to deliver (a loaded machine) is waited for, never judged by how
        long it stayed quiet; one that never delivers a row is judged after the timeout.
        """
        seen: list[int] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.subject.options.timeout
        while not expected <= set(seen) and loop.time() < deadline:
            _, ids = await self.epoch(limits)
            seen.extend(ids)
        return seen


class _Interrupted(Exception):
    """A read returned after its cancellation: the epoch is aborted and the session rewound."""


def _identity(identities: Identities, index: int) -> tuple[str, int]:
    return identities.positions[index], 0 if identities.ordinals is None else identities.ordinals[index]


def advance(certified: tuple[Position, ...], coverage: Coverage) -> tuple[Position, ...]:
    """The certified positions after ``coverage`` was certified."""
    positions = {position.domain.lineage: position for position in certified}
    for position in coverage.end_positions():
        positions[position.domain.lineage] = position
    return tuple(positions.values())


async def open_sink_session(
    subject: Subject, rule: str, *, token: int = 1, config: Any = None, worker: str = WORKER.worker_id
) -> StreamingSinkSession:
    """A session of the streaming sink under test for the battery's stream (APPEND)."""
    sink = subject.streaming_sink(config)
    return await subject.within(
        sink.open(STREAM, WritePolicy.APPEND, (), WorkerIdentity(worker, token)),
        rule,
        "StreamingSink.open",
    )


async def quietly_close(session: StreamingSinkSession | StreamSession | None) -> None:
    """Close a session the battery is done with, when a check already failed or moved on."""
    if session is None:
        return
    try:
        if isinstance(session, StreamingSinkSession):
            await asyncio.wait_for(session.close_session(), 30)
        else:
            await asyncio.wait_for(session.close(), 30)
    except (FaucetError, TimeoutError):
        pass  # the check's own verdict is what counts; this only releases clients
