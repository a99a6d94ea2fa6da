"""Epochs pipelined two deep: epoch N+1 is read while epoch N commits, certifies and acknowledges.

The serial epoch (read and seal, commit, certify, acknowledge, then the next read) leaves the source
idle while the destination commits and the destination idle while the source reads. Here the next
epoch starts reading as soon as the one before it is sealed. What stays as it was, and how:

* **One active epoch per sink session** (``begin_epoch``, ``apply``, ``commit_epoch``). Epoch N+1 is
  begun at the sink only once N's commit returned (:meth:`Flight.may_begin`); the batches it reads
  before that wait in its pipeline, in order and bounded (``PipelineOptions.read_ahead_bytes``, see
  :mod:`faucet_dagster.pipeline.writer`). A second sink session per stream was the other way: it
  would also overlap N+1's *applies* with N's commit, but it doubles the destination's connections and
  fences, and what two sessions do is ordered by nothing a sink promises (a NATS sink's publishes and
  watermark, a PostgreSQL sink's fence and watermark rows). The read, the decoding and the integrity
  checks of N+1, the costly part of a read, overlap N's commit without it.
* **Certificates in sequence.** N+1 commits only after N's certificate is persisted
  (:meth:`Flight.may_commit`), so the destination is never more than one epoch ahead of the
  certificates (the one recovery knows how to reconcile), and acknowledges only after N was
  acknowledged (:meth:`Flight.may_acknowledge`). Nothing is acknowledged before its certificate.
* **One call at a time on the source session** (the :class:`StreamSession` contract): N's lag and
  acknowledgement take turns with N+1's reads (``StreamSessions.turn``); N+1 reads in short slices
  while N is in flight, so they get their turn within a fraction of a second.
* **A failure rewinds the read-ahead.** An epoch that fails marks its later gates failed, interrupts
  the read of the epoch after it and waits until that one is discarded (:class:`PreviousEpochFailed`:
  nothing of it was committed, its held batches are dropped, an epoch it began at the sink is
  aborted); only then does the failed epoch abort, rewind or drop the sessions, so the next epoch (or
  the next owner) reads again from the certified positions. An epoch that ends early (cancelled,
  nothing new) waits for the one before it to finish its work before it rewinds the source.

The commit order itself stays in one function (``StreamRunner._run_epoch``); this module holds the
hand-off points it waits on and the loop (:func:`pipelined`) that starts each epoch.
"""

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from faucet_dagster.protocol import CancelToken, Coverage, EpochCertificate, EpochId, LifecycleError

Outcome = EpochCertificate | None
"""What one epoch ends with: its certificate, or None (nothing new, or its read was cancelled)."""


class PreviousEpochFailed(LifecycleError):
    """The epoch before this one failed before it was acknowledged: this one, read ahead, is
    discarded (the failure that counts is its predecessor's, whose rewind covers it)."""


class Flight:
    """One epoch of a pipeline: the hand-off points the epoch after it waits on. One event loop.

    Each point resolves once, True when the epoch passed it, False when it failed or ended before.
    """

    def __init__(self, previous: "Flight | None" = None) -> None:
        loop = asyncio.get_running_loop()
        self.previous = previous
        self.next: Flight | None = None
        if previous is not None:
            previous.next = self
        self.epoch: EpochId | None = None
        self.coverage: Coverage | None = None
        """The sealed coverage: where the epoch after it starts."""
        self.overlapping = False
        """True when the epoch after it may be read before this one ends (not while recovering)."""
        self._sealed: asyncio.Future[bool] = loop.create_future()
        self._committed: asyncio.Future[bool] = loop.create_future()
        self._certified: asyncio.Future[bool] = loop.create_future()
        self._acknowledged: asyncio.Future[bool] = loop.create_future()
        self._settled = asyncio.Event()
        self._read: CancelToken | None = None
        self._interrupted = False

    # -- what the epoch passed -------------------------------------------------------------------

    def sealed(self, epoch: EpochId, coverage: Coverage, *, overlapping: bool) -> None:
        self.epoch, self.coverage, self.overlapping = epoch, coverage, overlapping
        _resolve(self._sealed, True)

    def committed(self) -> None:
        _resolve(self._committed, True)

    def certified(self) -> None:
        _resolve(self._certified, True)

    def acknowledged(self) -> None:
        _resolve(self._acknowledged, True)
        self._settled.set()

    @property
    def in_flight(self) -> bool:
        """True until the epoch is acknowledged or failed."""
        return not self._acknowledged.done()

    # -- what the epoch waits for ----------------------------------------------------------------

    async def may_begin(self) -> None:
        """Return once the epoch before this one was committed at the sink (a sink session has one
        active epoch); raise :class:`PreviousEpochFailed` when it failed."""
        await self._after(None if self.previous is None else self.previous._committed, "committed")

    async def may_commit(self) -> None:
        """Return once the certificate of the epoch before this one is persisted."""
        await self._after(None if self.previous is None else self.previous._certified, "certified")

    async def may_acknowledge(self) -> None:
        """Return once the epoch before this one was acknowledged (acknowledgements in sequence)."""
        await self._after(None if self.previous is None else self.previous._acknowledged, "acknowledged")

    async def _after(self, point: "asyncio.Future[bool] | None", what: str) -> None:
        if point is None:
            return
        if not await asyncio.shield(point):
            before = self.previous.epoch if self.previous is not None else None
            raise PreviousEpochFailed(f"the epoch before this one ({before}) failed before it was {what}")

    # -- reads of the epoch ----------------------------------------------------------------------

    def reading(self, token: CancelToken) -> None:
        """``token`` cancels the epoch's read in progress (interrupted at once if it already was)."""
        self._read = token
        if self._interrupted:
            token.cancel()

    def interrupt(self) -> None:
        """Cancel the epoch's read, now or when it starts."""
        self._interrupted = True
        if self._read is not None:
            self._read.cancel()

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    # -- ending early ----------------------------------------------------------------------------

    async def quiesce(self, *, failed: bool) -> None:
        """Before this epoch's clean-up touches the sessions (abort, rewind, drop): mark its remaining
        points not passed; when it ``failed``, interrupt the epoch after it and wait until that one is
        discarded; then wait until the epoch before it ended its own work (acknowledged or failed),
        so a rewind never closes the source under that one's acknowledgement."""
        for point in (self._sealed, self._committed, self._certified, self._acknowledged):
            _resolve(point, False)
        after = self.next
        if after is not None:
            if failed:
                after.interrupt()
            await after._settled.wait()
        before = self.previous
        if before is not None:
            await asyncio.shield(before._acknowledged)

    def settle(self) -> None:
        """The epoch's clean-up is done (the epoch before it may clean up in turn)."""
        self._settled.set()


def _resolve(point: "asyncio.Future[bool]", passed: bool) -> None:
    if not point.done():
        point.set_result(passed)


async def pipelined(
    run: Callable[[Flight], Awaitable[Outcome]],
    *,
    more: Callable[[], bool],
    ahead: Callable[[], bool],
) -> AsyncGenerator[Outcome, None]:
    """Run epochs back to back (``run(flight)`` is one epoch in the commit order) while ``more()``:
    each next epoch starts once the one before it is sealed, when ``ahead()`` allows reading ahead
    then (else once it ended). Yields every epoch's outcome, in sequence, as soon as it ended (a
    certificate once it is acknowledged); raises the first failure
    once every epoch in flight settled (a later one's :class:`PreviousEpochFailed` is dropped).
    Leaving the loop early (``aclose``) interrupts the read ahead and waits for both epochs."""
    previous: tuple[Flight, asyncio.Task[Outcome]] | None = None
    current: tuple[Flight, asyncio.Task[Outcome]] | None = None
    try:
        while more():
            flight = Flight(None if previous is None else previous[0])
            task = asyncio.ensure_future(run(flight))
            current = (flight, task)
            # Until this epoch is sealed or ended; the one before it is yielded as soon as it ends.
            while not (task.done() or flight._sealed.done()):
                points: list[asyncio.Future[Any]] = [task, flight._sealed]
                if previous is not None:
                    points.append(previous[1])
                await asyncio.wait(points, return_when=asyncio.FIRST_COMPLETED)
                if previous is not None and previous[1].done():
                    outcome = await previous[1]
                    previous[0].next = flight.previous = None  # passed: the chain ends here (memory)
                    previous = None
                    yield outcome
            if previous is not None:  # sealed before the one before it ended: no third in flight
                outcome = await previous[1]
                previous[0].next = flight.previous = None
                previous = None
                yield outcome
            if not task.done() and flight.overlapping and flight._sealed.result() and ahead():
                previous, current = current, None
                continue
            current = None
            yield await task
        if previous is not None:
            last, previous = previous, None
            yield await last[1]
    finally:
        for held in (current, previous):
            if held is None:
                continue
            held[0].interrupt()
            await asyncio.wait([held[1]])
            if not held[1].cancelled():
                held[1].exception()  # retrieved: the failure raised above is the one that counts


__all__ = ["Flight", "Outcome", "PreviousEpochFailed", "pipelined"]
