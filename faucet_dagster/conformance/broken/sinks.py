"""Broken streaming sinks: sessions wrapping a shipped sink's, each breaking one rule."""

import asyncio
import functools
import uuid
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.conformance.seams import WrappedSinkSession, WrappedStreamingSink, wrap_sessions
from faucet_dagster.protocol import (
    ConnectorSpec,
    Coverage,
    DomainCoverage,
    EpochId,
    FaucetError,
    Identities,
    OrderingDomain,
    Receipt,
    Role,
    SinkBatch,
    SinkCommitState,
    StreamingSinkSession,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
)

# -- streaming sinks ----------------------------------------------------------------------------------


class SwallowingSession(WrappedSinkSession):
    """Failed writes: a commit whose writes were refused reports success with no receipts."""

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        try:
            return await super().commit_epoch(epoch, coverage)
        except FaucetError:
            return ()


class DroppingRefusedSession(WrappedSinkSession):
    """Failed writes: drops the rows the destination would refuse (a name over 1 KiB) before
    applying the batch, and commits the epoch as if they were written."""

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        records = batch.records
        assert isinstance(records, pa.RecordBatch)
        keep = pc.less_equal(pc.utf8_length(records.column("name")), 512)
        kept = [p for p, k in zip(batch.identities.positions, keep.to_pylist(), strict=True) if k]
        ordinals = batch.identities.ordinals
        kept_ordinals = (
            None if ordinals is None else [o for o, k in zip(ordinals, keep.to_pylist(), strict=True) if k]
        )
        await self.inner.apply(
            epoch,
            SinkBatch(
                batch.epoch,
                batch.resource,
                batch.domain,
                records.filter(keep),
                Identities(kept, kept_ordinals),
            ),
        )


class StaleWatermarkSession(WrappedSinkSession):
    """Uncertain commit: ``last_committed()`` answers from a cache the first answer filled (a lagging
    replica), so after a commit whose answer was lost it reports what was committed before."""

    cached: list[SinkCommitState | None] = []

    async def last_committed(self) -> SinkCommitState | None:
        if not StaleWatermarkSession.cached:
            StaleWatermarkSession.cached.append(await self.inner.last_committed())
        return StaleWatermarkSession.cached[0]


class RebeginSession(WrappedSinkSession):
    """Lifecycle: ``begin_epoch`` while an epoch is active aborts that one and begins the new one."""

    async def begin_epoch(self, epoch: EpochId) -> None:
        if self.active is not None:
            await self.inner.abort_epoch(self.active)
        await super().begin_epoch(epoch)


class LateCommitSession(WrappedSinkSession):
    """Uncertain commit: a commit the caller gives up on goes on in the background, and
    ``close_session`` returns at once, leaving it (and the real close) to finish later. "Later" is
    0.25 s: well after the battery's first look at the destination once the close returned, even on
    a loaded machine (at 0.05 s the commit sometimes landed before that look, and was missed)."""

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        async def later() -> tuple[Receipt, ...]:
            await asyncio.sleep(0.25)
            return await self.inner.commit_epoch(epoch, coverage)

        task = asyncio.ensure_future(later())
        self.background.append(task)
        return await asyncio.shield(task)

    async def close_session(self) -> None:
        pending = list(self.background)

        async def close_later() -> None:
            await asyncio.gather(*pending, return_exceptions=True)
            await self.inner.close_session()

        self.background.append(asyncio.ensure_future(close_later()))
        _KEEP.extend(self.background)


class LenientSession(WrappedSinkSession):
    """Lifecycle: an apply outside an epoch is accepted, in an epoch of its own that it commits."""

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        if self.active is None:
            await self.inner.begin_epoch(epoch)
            await self.inner.apply(epoch, batch)
            await self.inner.commit_epoch(epoch, Coverage())
            return
        await self.inner.apply(epoch, batch)


class EagerCloseSession(WrappedSinkSession):
    """Shutdown: ``close_session`` returns at once and commits the outstanding epoch afterwards."""

    async def close_session(self) -> None:
        active = self.active

        async def finish() -> None:
            await asyncio.sleep(0.05)
            if active is not None:
                await self.inner.commit_epoch(active, Coverage())
            await self.inner.close_session()

        _KEEP.append(asyncio.ensure_future(finish()))


class ConfidentCloseSession(WrappedSinkSession):
    """Shutdown: reports a successful close when the real session says the shutdown is uncertain
    (it "only" released its client, with requests still unanswered)."""

    async def close_session(self) -> None:
        try:
            await self.inner.close_session()
        except UncertainOutcome:
            return


class FinishTheBatchSession(WrappedSinkSession):
    """Shutdown: a cancelled apply finishes its batch anyway (shielded from the cancellation) and
    returns as if nothing happened, the way a client library that swallows cancellations does."""

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        sending = asyncio.ensure_future(self.inner.apply(epoch, batch))
        try:
            await asyncio.shield(sending)
        except asyncio.CancelledError:
            await sending


class AttemptIdentitySession(WrappedSinkSession):
    """Replay: gives each row an identity made from the session (the attempt's run id), not the
    source."""

    def ordinal(self) -> int:
        return self.attempt

    @functools.cached_property
    def attempt(self) -> int:
        return uuid.uuid4().int % 1_000_000

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        renumbered = Identities(batch.identities.positions, [self.ordinal()] * len(batch.identities))
        await self.inner.apply(
            epoch, SinkBatch(batch.epoch, batch.resource, batch.domain, batch.records, renumbered)
        )


class TokenIdentitySession(AttemptIdentitySession):
    """Replay: gives each row an identity made from the fencing token of the worker's lease."""

    def ordinal(self) -> int:
        return self.worker.fencing_token


# -- the dimensions the generated scenarios explore ----------------------------------------------


class StreamBlindSink(WrappedStreamingSink):
    """Several streams: keeps its state (owner fence, last epoch, watermarks) per destination, not
    per stream: every stream is opened under one name, as if one stream wrote the destination."""

    def destination_stream(self, stream: str) -> str:
        return StreamBlindSession.stream

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        session = await super().open(stream, policy, key, worker)
        if isinstance(session, StreamBlindSession):
            session.caller = stream
        return session


class StreamBlindSession(WrappedSinkSession):
    """The session of :class:`StreamBlindSink`: epochs renamed to the one stream, and back."""

    stream = "faucet"
    caller = "faucet"

    def _renamed(self, epoch: EpochId) -> EpochId:
        return EpochId(self.stream, epoch.sequence, epoch.fencing_token)

    async def last_committed(self) -> SinkCommitState | None:
        state = await self.inner.last_committed()
        if state is None:
            return None
        return SinkCommitState(
            EpochId(self.caller, state.epoch.sequence, state.epoch.fencing_token), state.watermarks
        )

    async def begin_epoch(self, epoch: EpochId) -> None:
        await super().begin_epoch(self._renamed(epoch))

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        renamed = self._renamed(epoch)
        await self.inner.apply(
            renamed, SinkBatch(renamed, batch.resource, batch.domain, batch.records, batch.identities)
        )

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        return await super().commit_epoch(self._renamed(epoch), coverage)

    async def abort_epoch(self, epoch: EpochId) -> None:
        await super().abort_epoch(self._renamed(epoch))


class OneWatermarkSession(WrappedSinkSession):
    """Several domains: keeps one watermark per resource, the highest position of any of its domains
    (the partition left out of the watermark's key), so a domain behind another looks replayed."""

    @staticmethod
    def _merged(domain: OrderingDomain) -> OrderingDomain:
        return OrderingDomain(domain.source, domain.resource, "0", domain.incarnation, domain.codec)

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        merged = SinkBatch(
            batch.epoch, batch.resource, self._merged(batch.domain), batch.records, batch.identities
        )
        await self.inner.apply(epoch, merged)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        ends: dict[OrderingDomain, DomainCoverage] = {}
        for item in coverage.domains:
            domain = self._merged(item.domain)
            held = ends.get(domain)
            if held is None or int(item.end) > int(held.end):
                ends[domain] = DomainCoverage(domain, item.start, item.end)
        return await super().commit_epoch(epoch, Coverage(tuple(ends.values())))


class MisroutedResourceSession(WrappedSinkSession):
    """Several resources: writes every batch to the first resource the session saw (the resource
    taken from the session's first batch, not from each batch)."""

    first: str | None = None

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        self.first = self.first or batch.resource
        moved = SinkBatch(batch.epoch, self.first, batch.domain, batch.records, batch.identities)
        await self.inner.apply(epoch, moved)


class FirstWinsUpsertSession(WrappedSinkSession):
    """Continuous upsert: of the rows of one key in a batch, keeps the first (a ``DISTINCT ON``
    without the batch's order), so a key inserted and updated in one epoch keeps its old value."""

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        if self.policy is not WritePolicy.UPSERT:
            await self.inner.apply(epoch, batch)
            return
        seen: set[object] = set()
        keep: list[int] = []
        for index, key in enumerate(batch.records.column("id").to_pylist()):
            if key not in seen:
                seen.add(key)
                keep.append(index)
        positions = [batch.identities.positions[index] for index in keep]
        records = batch.records.take(pa.array(keep, pa.int64()))
        await self.inner.apply(
            epoch, SinkBatch(batch.epoch, batch.resource, batch.domain, records, Identities(positions))
        )


class FoldedNamesSession(WrappedSinkSession):
    """Hostile identifiers: folds resource and column names to lower case, as SQL does with names it
    does not quote (``MixedCase`` lands in ``mixedcase``, where a reader of ``MixedCase`` finds nothing)."""

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        records = batch.records.rename_columns([name.lower() for name in batch.records.schema.names])
        folded = SinkBatch(batch.epoch, batch.resource.lower(), batch.domain, records, batch.identities)
        await self.inner.apply(epoch, folded)


_KEEP: list[asyncio.Task[Any]] = []
"""Background tasks of the broken sessions, kept referenced until their loop ends."""


def streaming_sink(
    name: str, session_type: type[WrappedSinkSession], claims: dict[str, Any] | None = None
) -> ConnectorSpec:
    return wrap_sessions(name, Role.STREAMING_SINK, session_type, claims)
