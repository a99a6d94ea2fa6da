"""Broken streaming sinks: sessions wrapping a shipped sink's, each breaking one rule."""

import asyncio
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.conformance.broken.common import _next_open, wrapping
from faucet_dagster.protocol import (
    ConnectorSpec,
    Coverage,
    EpochId,
    FaucetError,
    Identities,
    Receipt,
    Role,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    StreamingSink,
    StreamingSinkSession,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
)

# -- streaming sinks ----------------------------------------------------------------------------------


class WrappedSinkSession(StreamingSinkSession):
    """A sink session forwarding everything to the real one; subclasses break one method."""

    def __init__(self, inner: StreamingSinkSession, opened: int, worker: WorkerIdentity) -> None:
        self.inner = inner
        self.opened = opened
        self.worker = worker
        self.active: EpochId | None = None
        self.background: list[asyncio.Task[Any]] = []

    async def last_committed(self) -> SinkCommitState | None:
        return await self.inner.last_committed()

    async def begin_epoch(self, epoch: EpochId) -> None:
        await self.inner.begin_epoch(epoch)
        self.active = epoch

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        await self.inner.apply(epoch, batch)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        receipts = await self.inner.commit_epoch(epoch, coverage)
        self.active = None
        return receipts

    async def abort_epoch(self, epoch: EpochId) -> None:
        await self.inner.abort_epoch(epoch)
        self.active = None

    async def close_session(self) -> None:
        await self.inner.close_session()


class WrappedStreamingSink(StreamingSink):
    """A streaming sink whose sessions are wrapped in ``session_type``; ``claims`` overrides
    capability fields."""

    def __init__(
        self,
        inner: StreamingSink,
        session_type: type[WrappedSinkSession],
        claims: dict[str, Any] | None = None,
    ) -> None:
        self.inner = inner
        self.session_type = session_type
        self.claims = claims or {}
        self.connector_name = inner.connector_name

    def capabilities(self) -> SinkCapabilities:
        from dataclasses import replace

        return replace(self.inner.capabilities(), **self.claims)

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> StreamingSinkSession:
        return self.session_type(await self.inner.open(stream, policy, key, worker), _next_open(), worker)


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
    """Replay: gives each row an identity made from the session (the attempt), not the source."""

    def ordinal(self) -> int:
        return self.opened

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        renumbered = Identities(batch.identities.positions, [self.ordinal()] * len(batch.identities))
        await self.inner.apply(
            epoch, SinkBatch(batch.epoch, batch.resource, batch.domain, batch.records, renumbered)
        )


class TokenIdentitySession(AttemptIdentitySession):
    """Replay: gives each row an identity made from the fencing token of the worker's lease."""

    def ordinal(self) -> int:
        return self.worker.fencing_token


_KEEP: list[asyncio.Task[Any]] = []
"""Background tasks of the broken sessions, kept referenced until their loop ends."""


def streaming_sink(
    name: str, session_type: type[WrappedSinkSession], claims: dict[str, Any] | None = None
) -> ConnectorSpec:
    return wrapping(
        name, Role.STREAMING_SINK, lambda inner: WrappedStreamingSink(inner, session_type, claims)
    )
