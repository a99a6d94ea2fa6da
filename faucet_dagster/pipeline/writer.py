"""How an epoch's pipeline hands batches to the sink session: in order, at most one ``apply`` in
flight (the backpressure a slow sink puts on the source), and the in-flight one joined on abort.

An epoch read ahead (the runner reads epoch N+1 while epoch N commits) cannot reach the sink yet: a
sink session has one active epoch at a time. Its writer is made with ``begin_after``: it begins the
epoch at the sink (``begin_epoch``) only once ``begin_after()`` returned (epoch N's commit did) and a
batch is ready to apply (or the epoch is sealed), and holds the batches submitted meanwhile, in order,
up to ``hold_bytes`` (past that, ``submit`` waits: the read-ahead's backpressure). So an epoch whose
source has nothing new holds nothing open at the sink either.
"""

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Literal

from faucet_dagster.protocol import EpochId, PartialResult, SinkBatch, StreamingSinkSession

Refused = Callable[[SinkBatch, PartialResult], Awaitable[None]]
"""Routes the rows of a batch the sink refused (``apply_partial``) to the dead-letter route."""


class SinkWriter:
    """Hands batches to ``apply`` in order, with at most one ``apply`` in flight.

    Without ``begin_after`` the epoch is active at the sink already. With it, the writer begins the
    epoch itself (see the module docstring); :attr:`begun` says whether ``begin_epoch`` returned, so
    an abort knows whether there is an epoch to abort at the sink.
    """

    def __init__(
        self,
        session: StreamingSinkSession,
        epoch: EpochId,
        *,
        begin_after: Callable[[], Awaitable[None]] | None = None,
        hold_bytes: int = 0,
    ) -> None:
        self._session = session
        self._epoch = epoch
        self._inflight: asyncio.Task[None] | None = None
        self._begin_after = begin_after
        self._hold_bytes = hold_bytes
        self._held: deque[tuple[SinkBatch, Refused | None]] = deque()
        self._held_size = 0
        self._opening: asyncio.Task[None] | None = None
        self._phase: Literal["waiting", "beginning", "applying"] = "waiting"
        self._discarded = False
        self.begun = begin_after is None
        """True once the epoch is active at the sink (begun by the caller, or by this writer)."""

    async def submit(self, batch: SinkBatch, refused: Refused | None = None) -> None:
        """Apply ``batch`` in the background; with ``refused``, through ``apply_partial``, handing it
        the rows the sink refused (before the batch counts as applied). Before the epoch is begun at
        the sink the batch is held, and this waits for the begin only past ``hold_bytes`` held."""
        if not self.begun:
            self._held.append((batch, refused))
            self._held_size += batch.records.nbytes
            opening = self._open()
            if self._held_size > self._hold_bytes:
                await opening
            return
        await self.drain()
        self._inflight = asyncio.create_task(self._apply(batch, refused))

    def _open(self) -> "asyncio.Task[None]":
        """The task that begins the epoch at the sink (after ``begin_after``) and then applies the
        held batches in order; started on first need."""
        if self._opening is None:
            self._opening = asyncio.create_task(self._begin_then_apply_held())
        return self._opening

    async def _begin_then_apply_held(self) -> None:
        assert self._begin_after is not None
        self._phase = "waiting"
        await self._begin_after()
        if self._discarded:
            return
        self._phase = "beginning"
        await self._session.begin_epoch(self._epoch)
        self.begun = True
        self._phase = "applying"
        while self._held and not self._discarded:
            batch, refused = self._held.popleft()
            self._held_size -= batch.records.nbytes
            await self._apply(batch, refused)

    async def _apply(self, batch: SinkBatch, refused: Refused | None) -> None:
        if refused is None:
            await self._session.apply(self._epoch, batch)
            return
        result = await self._session.apply_partial(self._epoch, batch)
        if result.rejected:
            await refused(batch, result)

    async def drain(self) -> None:
        """Wait for what was handed to the sink (the held batches once the epoch began, and the batch
        in flight); a failure is raised here. While the epoch waits to begin (``begin_after``), the
        held batches are not waited for: they are applied in order before :meth:`finish` returns."""
        if not self.begun and self._held_size <= self._hold_bytes:
            return
        await self._opened()
        task = self._inflight
        if task is not None:
            try:
                await task
            finally:
                if task.done():
                    self._inflight = None

    async def _opened(self) -> None:
        """Wait for the begin and the held batches; its failure is raised (again on every call)."""
        opening = self._opening
        if opening is not None:
            await opening
            if self._opening is opening:
                self._opening = None

    async def finish(self) -> None:
        """Begin the epoch at the sink if no batch did (an epoch of boundaries only), and wait until
        every batch submitted is applied: what the seal needs."""
        if not self.begun:
            self._open()
        await self._opened()
        await self.drain()

    async def discard(self) -> BaseException | None:
        """Stop and join the work in flight (the epoch is being aborted): a begin still waiting for
        ``begin_after`` or an apply is cancelled, a ``begin_epoch`` at the sink is let finish
        (:attr:`begun` then says so), the held batches are dropped. Returns the failure of what was
        in flight, if any."""
        self._discarded = True
        self._held.clear()
        self._held_size = 0
        failure: BaseException | None = None
        for task in (self._opening, self._inflight):
            if task is None:
                continue
            if not task.done() and not (task is self._opening and self._phase == "beginning"):
                task.cancel()
            await asyncio.wait([task])
            if failure is None and not task.cancelled():
                failure = task.exception()
        self._opening = self._inflight = None
        return failure
