"""Broken stream sources: sessions wrapping a shipped source's, each breaking one rule."""

import asyncio
import functools
import time
import uuid
import zlib
from collections.abc import Sequence
from typing import Any, cast

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.conformance.seams import (
    WrappedSession,
    WrappedSource,
    real_role,
    spec_with,
    wrap_sessions,
)
from faucet_dagster.protocol import (
    Authority,
    CancelToken,
    ConnectionFailed,
    ConnectorSpec,
    Control,
    Coverage,
    DomainCoverage,
    Identities,
    IncarnationChanged,
    Membership,
    OrderingDomain,
    Position,
    PositionUnavailable,
    ProgressBoundary,
    ReadLimits,
    Records,
    RejectedRecord,
    Role,
    StreamRecordSink,
    StreamSession,
    StreamSource,
    TransactionBegin,
    TransactionEnd,
    WorkerIdentity,
)

# -- stream sources -----------------------------------------------------------------------------------


class LatestWhenUnavailableSource(WrappedSource):
    """Unavailable position: when its resume position is gone, starts over from what the provider
    still has (the "latest available" fallback)."""

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> StreamSession:
        try:
            return await super().open(resources, resume_positions, membership, worker)
        except PositionUnavailable:
            latest = await self.latest_available(resume_positions)
            return await super().open(resources, latest, membership, worker)

    async def latest_available(self, unavailable: Sequence[Position]) -> Sequence[Position]:
        """Where to read instead of ``unavailable``: from the start of what the provider keeps."""
        return ()


class SlotPositionSource(LatestWhenUnavailableSource):
    """Unavailable position (PostgreSQL CDC): when the slot was moved past the certified position,
    resumes where the slot now is (its ``confirmed_flush_lsn``: the "latest available" of a slot)."""

    def __init__(self, inner: StreamSource, url: str, slot: str) -> None:
        super().__init__(inner, WrappedSession)
        self.url = url
        self.slot = slot

    async def latest_available(self, unavailable: Sequence[Position]) -> Sequence[Position]:
        import psycopg

        async with await psycopg.AsyncConnection.connect(self.url) as conn:
            cursor = await conn.execute(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (self.slot,),
            )
            row = await cursor.fetchone()
        assert row is not None
        codecs = {codec.name: codec for codec in self.codecs()}
        moved = []
        for position in unavailable:
            codec = codecs[position.domain.codec]
            moved.append(Position(position.domain, codec.canonicalize(codec.validate(row[0]) - 1)))
        return moved


class IncarnationBlindSource(WrappedSource):
    """Re-creation: when the stream was deleted and created again, it keeps the certified sequence
    numbers and reads on from them in the new incarnation (it finds the new incarnation by peeking at
    the first message), so the new stream's first messages are skipped."""

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> StreamSession:
        try:
            return await super().open(resources, resume_positions, membership, worker)
        except IncarnationChanged:
            pass
        peek = _DomainPeek()
        probe = await self.inner.open(resources, (), membership, worker)
        try:
            await probe.read(peek, ReadLimits(records=1, bytes=None, idle=0.5, age=None), peek.stop)
        finally:
            await probe.close()
        if peek.domain is None:
            return await super().open(resources, (), membership, worker)
        moved = [
            Position(peek.domain, p.value)
            for p in resume_positions
            if p.domain.lineage == peek.domain.lineage
        ]
        return await super().open(resources, moved, membership, worker)


class _DomainPeek(StreamRecordSink):
    """Takes the domain of the first row written and stops the read (writes nothing anywhere)."""

    def __init__(self) -> None:
        self.domain: OrderingDomain | None = None
        self.stop = CancelToken()

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        self.domain = self.domain or domain
        self.stop.cancel()

    async def control(self, control: Control) -> None:
        return None


def _slot_position_source(config: Any) -> SlotPositionSource:
    real = real_role("postgres", Role.STREAM_SOURCE)
    return SlotPositionSource(cast(StreamSource, real.factory(config)), config.url, config.slot)


def slot_position_source() -> ConnectorSpec:
    return spec_with("postgres", Role.STREAM_SOURCE, _slot_position_source)


class ForwardingSink(StreamRecordSink):
    """Forwards a read's writes and controls to the pipeline; subclasses change one thing."""

    def __init__(self, inner: StreamRecordSink) -> None:
        self.inner = inner

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        await self.inner.write(domain, rows, identities, resource=resource)

    async def control(self, control: Control) -> None:
        await self.inner.control(control)

    async def reject(self, record: RejectedRecord) -> None:
        await self.inner.reject(record)


class ImpatientSession(WrappedSession):
    """Slow sink: gives up when the pipeline blocks it longer than 0.3 s."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        return await asyncio.wait_for(self.inner.read(sink, limits, cancel), 0.3)


class LoopBlockingSession(WrappedSession):
    """Slow sink: waits out its sink's backpressure with a blocking sleep in line with the read (the
    keep-alive replaced by a sleep), so nothing renews the deliveries meanwhile."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        class Blocking(ForwardingSink):
            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                time.sleep(2.5)  # the defect under test: the loop stalls
                await self.inner.write(domain, rows, identities, resource=resource)

        return await self.inner.read(Blocking(sink), limits, cancel)


class DeafSession(WrappedSession):
    """Cancellation: never hears the runner's cancel token."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        return await self.inner.read(sink, limits, CancelToken())


class CancelIsAnErrorSession(WrappedSession):
    """Cancellation: reports a cancelled read as a failure (raises) instead of returning the coverage
    of the boundaries it had reached."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        coverage = await self.inner.read(sink, limits, cancel)
        if cancel.cancelled:
            raise ConnectionFailed("the read was cancelled", where="CancelIsAnErrorSession")
        return coverage


class LimitCutSession(WrappedSession):
    """Partial transaction: treats the record limit as the place to stop, inside a transaction too:
    after ``limits.records`` rows it declares a progress boundary at the last row and stops."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        stop = CancelToken()
        cut: list[DomainCoverage] = []
        budget = limits.records

        class Limiter(ForwardingSink):
            written = 0

            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                if cut:
                    return
                await self.inner.write(domain, rows, identities, resource=resource)
                self.written += len(identities)
                if budget is not None and self.written >= budget:
                    last = identities.positions[-1]
                    cut.append(DomainCoverage(domain, None, last))
                    stop.cancel()
                    await self.inner.control(ProgressBoundary(domain, last))

            async def control(self, control: Control) -> None:
                if not cut:
                    await self.inner.control(control)

        async def relay() -> None:
            await cancel.wait()
            stop.cancel()

        relaying = asyncio.ensure_future(relay())
        try:
            coverage = await self.inner.read(Limiter(sink), limits, stop)
        finally:
            relaying.cancel()
        return Coverage(tuple(cut)) if cut else coverage


class CutTransactionSession(WrappedSession):
    """Partial transaction: stops inside a source transaction and covers its rows anyway."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        stop = CancelToken()
        cut: list[DomainCoverage] = []

        class Cutter(ForwardingSink):
            inside = False

            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                await self.inner.write(domain, rows, identities, resource=resource)
                if self.inside and not cut:
                    cut.append(DomainCoverage(domain, None, identities.positions[-1]))
                    stop.cancel()

            async def control(self, control: Control) -> None:
                if not cut:
                    await self.inner.control(control)
                    self.inside = isinstance(control, TransactionBegin) or (
                        self.inside and not isinstance(control, TransactionEnd)
                    )

        coverage = await self.inner.read(Cutter(sink), limits, stop)
        return Coverage(tuple(cut)) if cut else coverage


class UnaskingSession(WrappedSession):
    """Ownership: acknowledges without asking the authority."""

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        async def always() -> None:
            return None

        await self.inner.acknowledge(coverage, always)


class AskOnceSession(WrappedSession):
    """Ownership: asks the authority on the session's first successful acknowledgement only, and
    trusts that answer afterwards."""

    trusted = False

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        if not self.trusted:
            await authority()
            self.trusted = True

        async def remembered() -> None:
            return None

        await self.inner.acknowledge(coverage, remembered)


class SpeculativeSession(WrappedSession):
    """Speculative acknowledgement: acknowledges what a read covered before returning it."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        coverage = await self.inner.read(sink, limits, cancel)
        if not coverage.empty:
            await self.inner.acknowledge(coverage, _no_authority)
        return coverage


class AckOnCloseSession(WrappedSession):
    """Speculative acknowledgement: acknowledges everything it read when the session closes (a
    "commit on close" consumer), certified or not."""

    read_so_far: list[Coverage]

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        coverage = await self.inner.read(sink, limits, cancel)
        if not coverage.empty:
            self.__dict__.setdefault("read_so_far", []).append(coverage)
        return coverage

    async def close(self) -> None:
        for coverage in self.__dict__.get("read_so_far", []):
            await self.inner.acknowledge(coverage, _no_authority)
        await self.inner.close()


async def _no_authority() -> None:
    """What a careless session passes on instead of the runner's authority: asks nobody."""


class DroppingSession(WrappedSession):
    """Unwritten position: drops the row with id 5 on its way to the pipeline, and covers it anyway."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        class Dropper(ForwardingSink):
            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                assert isinstance(rows, pa.RecordBatch)
                keep = pc.not_equal(rows.column("id"), 5)
                kept = [p for p, k in zip(identities.positions, keep.to_pylist(), strict=True) if k]
                await self.inner.write(domain, rows.filter(keep), Identities(kept), resource=resource)

        return await self.inner.read(Dropper(sink), limits, cancel)


class LateRowSession(WrappedSession):
    """Unwritten position (an ordering bug): the last row written before a progress boundary
    reaches the sink only after that boundary, which already vouched for its position."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        held: list[tuple[OrderingDomain, pa.RecordBatch, Identities, str | None]] = []

        class Reorder(ForwardingSink):
            async def release(self) -> None:
                while held:
                    domain, rows, identities, resource = held.pop()
                    await self.inner.write(domain, rows, identities, resource=resource)

            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                assert isinstance(rows, pa.RecordBatch)
                await self.release()
                last = rows.num_rows - 1
                positions, ordinals = list(identities.positions), identities.ordinals
                head = Identities(positions[:last], None if ordinals is None else list(ordinals[:last]))
                tail = Identities(positions[last:], None if ordinals is None else list(ordinals[last:]))
                if last > 0:
                    await self.inner.write(domain, rows.slice(0, last), head, resource=resource)
                held.append((domain, rows.slice(last), tail, resource))

            async def control(self, control: Control) -> None:
                await self.inner.control(control)
                await self.release()

        return await self.inner.read(Reorder(sink), limits, cancel)


class OverreachingSession(WrappedSession):
    """Unwritten position: covers one stream sequence past the last row it delivered (the stream's
    "last sequence" taken as the read's end), a position whose row never reached the sink."""

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        coverage = await self.inner.read(sink, limits, cancel)
        return Coverage(
            tuple(
                DomainCoverage(item.domain, item.start, str(int(item.end) + 1)) for item in coverage.domains
            )
        )


class RenumberingSession(WrappedSession):
    """Replay: gives each event the ordinals :meth:`ordinals` makes (subclasses build them from what
    a careless author would: the attempt, the worker, the lease), not from the source alone."""

    def ordinals(self, identities: Identities) -> list[int]:
        raise NotImplementedError

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        session = self

        class Renumber(ForwardingSink):
            async def write(
                self,
                domain: OrderingDomain,
                rows: Records,
                identities: Identities,
                *,
                resource: str | None = None,
            ) -> None:
                renumbered = Identities(identities.positions, session.ordinals(identities))
                await self.inner.write(domain, rows, renumbered, resource=resource)

        return await self.inner.read(Renumber(sink), limits, cancel)


class ReidentifyingSession(RenumberingSession):
    """Replay: numbers its events by the session (the attempt's run id), not by the source position
    alone."""

    def ordinals(self, identities: Identities) -> list[int]:
        return [self.attempt] * len(identities)

    @functools.cached_property
    def attempt(self) -> int:
        return uuid.uuid4().int % 1_000_000


class WorkerIdentitySession(RenumberingSession):
    """Replay: gives each event an ordinal made from the worker id (a replay by another worker looks
    like new events)."""

    def ordinals(self, identities: Identities) -> list[int]:
        return [zlib.crc32(self.worker.worker_id.encode()) % 1_000] * len(identities)


class LeaseIdentitySession(RenumberingSession):
    """Replay: numbers the events of a position from the fencing token of the lease it holds."""

    def ordinals(self, identities: Identities) -> list[int]:
        base = [0] * len(identities) if identities.ordinals is None else list(identities.ordinals)
        return [self.worker.fencing_token * 1_000 + ordinal for ordinal in base]


def stream_source(name: str, session_type: type[WrappedSession]) -> ConnectorSpec:
    return wrap_sessions(name, Role.STREAM_SOURCE, session_type)
