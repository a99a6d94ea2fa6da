"""A stream's open source and sink sessions, kept across epochs: opened at the certified positions and
reconciled with what the sink last committed, aborted and rewound, dropped.

The continuous runner (:mod:`.continuous`) owns one :class:`StreamSessions` and calls it from its
single commit order; nothing here decides the order of an epoch's steps. The source session takes one
call at a time (the :class:`StreamSession` contract) while two epochs are in flight (one read while the
other commits, :mod:`.pipelined`): every read, lag and acknowledgement takes :attr:`StreamSessions.turn`.
"""

import asyncio
import logging

from faucet_dagster.pipeline import EpochPipeline
from faucet_dagster.protocol import (
    CancelToken,
    Coverage,
    EpochId,
    FaucetError,
    Position,
    ReadLimits,
    StreamingSinkSession,
    StreamSession,
    UncertainOutcome,
    WorkerIdentity,
)
from faucet_dagster.runner.recovery import adopted_coverage, advance, reconcile
from faucet_dagster.runner.spec import StreamSpec
from faucet_dagster.state import Lease, StateStore

logger = logging.getLogger(__name__)


class StreamSessions:
    """The sessions of one stream in one worker, and the positions they were opened at.

    ``certified`` are the certified positions (the source resumes after them), ``next_sequence`` the
    next epoch's sequence, ``recover_to`` the sink's watermark while an epoch it committed before its
    certificate is read again, ``adopted`` the coverage of such an epoch certified from the sink's own
    watermark instead (a source whose re-read would not give the rows the sink committed).
    """

    def __init__(self, spec: StreamSpec, store: StateStore, worker_id: str) -> None:
        self.spec = spec
        self.store = store
        self.worker_id = worker_id
        self.source: StreamSession | None = None
        self.sink: StreamingSinkSession | None = None
        self.token: int | None = None
        self.certified: tuple[Position, ...] = ()
        self.next_sequence = 0
        self.recover_to: tuple[Position, ...] = ()
        self.adopted: Coverage | None = None
        self.turn = asyncio.Lock()
        """Held by each call on the source session (read, lag, acknowledgement): one at a time."""
        self.closing_sink: StreamingSinkSession | None = None
        """A sink session whose ``close_session`` is in progress."""
        self._atomic = spec.sink.capabilities().atomic_watermark
        self._adopts = not spec.source.capabilities().deterministic and self._atomic

    async def open(self, lease: Lease) -> tuple[StreamSession, StreamingSinkSession]:
        """The open sessions for ``lease``'s token; (re)opened at the certified positions if needed.

        Opening reconciles the sink's last commit with the last certificate. A deterministic source
        resumes at the certified positions whatever the sink holds, so it is opened while the sink is
        (a source whose epoch may be adopted from the sink's watermark is opened after it). Blocks
        until both are open; when the sink fails to open, a source opened beside it is closed again.
        """
        if self.token is not None and self.token != lease.fencing_token:
            await self.drop(None)
        worker = WorkerIdentity(self.worker_id, lease.fencing_token)
        opening: asyncio.Future[StreamSession] | None = None
        if self.sink is None:
            last = await asyncio.to_thread(self.store.last_certificate, self.spec.name)
            self.certified = await asyncio.to_thread(self.store.certified_positions, self.spec.name)
            self.next_sequence = (last.sequence if last else 0) + 1
            if self.source is None and not self._adopts:
                opening = asyncio.ensure_future(self._open_source(worker, self.certified))
            try:
                await self._open_sink(worker, lease)
            except BaseException as exc:
                if opening is not None:
                    await self._discard_opening(opening, exc)
                raise
        if self.source is None:
            if opening is None:
                resume = self.certified if self.adopted is None else advance(self.certified, self.adopted)
                opening = asyncio.ensure_future(self._open_source(worker, resume))
            self.source = await opening
            self.token = lease.fencing_token
        assert self.sink is not None
        return self.source, self.sink

    async def _open_sink(self, worker: WorkerIdentity, lease: Lease) -> None:
        """Open the sink session and reconcile what it last committed with the last certificate."""
        session = await self.spec.sink.open(self.spec.name, self.spec.policy, self.spec.key, worker)
        self.sink = session
        self.token = lease.fencing_token
        try:
            committed = await session.last_committed()
            self.recover_to = reconcile(self.spec.name, committed, self.certified, self.next_sequence - 1)
            # What an older owner dead-lettered for an epoch the destination does not hold never
            # committed: its replay routes again what it still rejects. A sink whose watermark is
            # not committed with the data may hold the epoch after it, whose dead letters stay.
            held = self.next_sequence - 1 if committed is None else committed.epoch.sequence
            through = held if self._atomic else held + 1
            await asyncio.to_thread(
                self.store.discard_uncommitted_dead_letters, self.spec.name, through, lease.fencing_token
            )
        except BaseException as exc:
            await self.drop(exc)
            raise
        if self.recover_to and self._adopts:
            self.adopted = adopted_coverage(self.certified, self.recover_to)
            self.recover_to = ()

    async def _open_source(self, worker: WorkerIdentity, resume: tuple[Position, ...]) -> StreamSession:
        return await self.spec.source.open(self.spec.resources, resume, self.spec.membership, worker)

    async def _discard_opening(self, opening: "asyncio.Future[StreamSession]", cause: BaseException) -> None:
        """Close the source session opened beside a sink that failed to open; failures go on ``cause``."""
        await asyncio.wait([opening])
        if opening.cancelled():
            return
        failure = opening.exception()
        if failure is not None:
            cause.add_note(f"opening the source session beside it failed too: {failure!r}")
            return
        self.source = opening.result()
        await self.close_source(cause)

    async def read(
        self, session: StreamSession, pipeline: EpochPipeline, limits: ReadLimits, cancel: CancelToken
    ) -> Coverage:
        """One read of ``session`` into ``pipeline``, in its turn."""
        async with self.turn:
            return await session.read(pipeline, limits, cancel)

    def certify(self, epoch: EpochId, coverage: Coverage) -> None:
        """``epoch`` with ``coverage`` is certified: the positions and the sequence move on."""
        self.certified = advance(self.certified, coverage)
        self.next_sequence = epoch.sequence + 1
        if self.recover_to:
            logger.warning(
                "stream %s: recovered epoch %s committed before its certificate", self.spec.name, epoch
            )
            self.recover_to = ()

    async def abort(
        self,
        epoch: EpochId,
        pipeline: EpochPipeline,
        *,
        rewind: bool,
        cause: BaseException | None = None,
    ) -> None:
        """Abort ``epoch`` at the sink (if its pipeline began it there); with ``rewind``, close the
        source session so it reopens at the certified positions. Failures while cleaning up are
        attached to ``cause`` (or raised)."""
        inflight = await pipeline.discard()
        if inflight is not None and cause is not None and inflight is not cause:
            cause.add_note(f"a batch in flight failed too: {inflight!r}")
        sink = self.sink
        if sink is not None and pipeline.begun:
            try:
                await sink.abort_epoch(epoch)
            except FaucetError as exc:
                if cause is None:
                    await self.drop(exc)
                    raise
                cause.add_note(f"aborting epoch {epoch} failed too: {exc}")
                await self.drop(cause)
                return
        if rewind:
            await self.close_source(cause)

    async def close_source(self, cause: BaseException | None) -> None:
        session, self.source = self.source, None
        if session is None:
            return
        try:
            await session.close()
        except FaucetError as exc:
            if cause is None:
                raise
            cause.add_note(f"closing the source session failed too: {exc}")

    async def drop(self, cause: BaseException | None) -> None:
        """Close both sessions. An uncertain sink close marks the stream uncertain in the store.

        With a ``cause`` (already failing), close failures are attached to it; without, raised.
        """
        await self.close_source(cause)
        session, self.sink = self.sink, None
        self.token = None
        self.recover_to = ()
        self.adopted = None
        if session is None:
            return
        self.closing_sink = session
        try:
            await session.close_session()
        except UncertainOutcome as exc:
            await asyncio.to_thread(self.store.mark_uncertain, self.spec.name, exc.message)
            if cause is None:
                raise
            cause.add_note(f"closing the sink session was uncertain; the stream is marked uncertain: {exc}")
        except FaucetError as exc:
            if cause is None:
                raise
            cause.add_note(f"closing the sink session failed too: {exc}")
        finally:
            self.closing_sink = None
