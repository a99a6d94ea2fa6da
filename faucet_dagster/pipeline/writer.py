"""How an epoch's pipeline hands batches to the sink session: in order, at most one ``apply`` in
flight (the backpressure a slow sink puts on the source), and the in-flight one joined on abort.
"""

import asyncio
from collections.abc import Awaitable, Callable

from faucet_dagster.protocol import EpochId, PartialResult, SinkBatch, StreamingSinkSession

Refused = Callable[[SinkBatch, PartialResult], Awaitable[None]]
"""Routes the rows of a batch the sink refused (``apply_partial``) to the dead-letter route."""


class SinkWriter:
    """Hands batches to ``apply`` in order, with at most one ``apply`` in flight."""

    def __init__(self, session: StreamingSinkSession, epoch: EpochId) -> None:
        self._session = session
        self._epoch = epoch
        self._inflight: asyncio.Task[None] | None = None

    async def submit(self, batch: SinkBatch, refused: Refused | None = None) -> None:
        """Apply ``batch`` in the background; with ``refused``, through ``apply_partial``, handing it
        the rows the sink refused (before the batch counts as applied)."""
        await self.drain()
        self._inflight = asyncio.create_task(self._apply(batch, refused))

    async def _apply(self, batch: SinkBatch, refused: Refused | None) -> None:
        if refused is None:
            await self._session.apply(self._epoch, batch)
            return
        result = await self._session.apply_partial(self._epoch, batch)
        if result.rejected:
            await refused(batch, result)

    async def drain(self) -> None:
        """Wait for the batch in flight; its failure is raised here."""
        task = self._inflight
        if task is not None:
            try:
                await task
            finally:
                if task.done():
                    self._inflight = None

    async def discard(self) -> BaseException | None:
        """Stop and join the batch in flight (the epoch is being aborted); return its failure, if any."""
        task, self._inflight = self._inflight, None
        if task is None:
            return None
        if not task.done():
            task.cancel()
        await asyncio.wait([task])
        return None if task.cancelled() else task.exception()
