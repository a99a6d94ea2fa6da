"""The open epoch under a sensor: read in the background, sealed by its age, its size or a stop.

Under a sensor the runner reads in the background of the code server (:mod:`.reader` starts it on the
first tick): epochs run back to back, pipelined (:mod:`.pipelined`: the next is read while the last
commits), each read in short reads that each end at a safe source boundary. The open epoch is *due*,
and sealed at the end of the read in progress (its next safe boundary), when

* it is ``limits.age`` seconds old (about a second by default: what a row waits, at most, before its
  epoch is sealed, committed and visible at the destination);
* it is full: ``limits.records`` rows or ``limits.bytes`` bytes (its memory bound: nothing is
  dropped, and a backlog drains at the speed the source and the sink allow);
* a stop or a hand-over asks for a seal (:meth:`EpochClock.request`).

An epoch with nothing read is never sealed: it waits (nothing is begun at the sink for it, see
:mod:`faucet_dagster.pipeline.writer`). A tick does not seal anything: it reports what the store
certified and says what the reader is doing (:class:`Pending`).

A read inside a source transaction goes on until the transaction ends, however long that takes: a
source's limits are targets, never places to cut a transaction. Its rows reach the sink as they are
read (a transactional sink holds them in its open epoch, invisible until the commit), so memory stays
bounded by the pipeline's batches, never by the transaction.

The reader stops when no tick came for ``stop_after`` seconds (the sensor was stopped, or the daemon
ticks another process): it first seals its open epoch at the next safe boundary, as a hand-over does,
so what a sink that cannot take back its writes (NATS publishes during ``apply``) received is
certified, not rolled back and replayed after the sink's duplicate window.

Nothing here changes what is certified: the seal, commit and certificate are the runner's single commit
order, and an open epoch that dies with its process is rolled back and replayed from the certified
positions.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from faucet_dagster.pipeline import EpochPipeline
from faucet_dagster.protocol import CancelToken, Coverage, EpochId, Position, ReadLimits
from faucet_dagster.runner.recovery import merge, reaches

READ_SLICE_SECONDS = 1.0
"""The longest read of an open epoch outside a source transaction (how long a stop's seal waits)."""
SEAL_SLICE_SECONDS = 0.1
"""The shortest read of an open epoch: the reads end this soon after the epoch becomes due by age."""
READ_IDLE_SECONDS = 0.5
"""A read of an open epoch with nothing new returns after this long (or the stream's ``idle``)."""
EMPTY_READ_PAUSE = 0.2
"""Seconds an open epoch waits after a read that returned nothing (a source that returns at once when it
cannot deliver more, such as a full acknowledgement window) before it reads again."""
DEFAULT_AGE_SECONDS = 1.0
"""The age at which an open epoch is due when the stream's limits set none."""

Read = Callable[[EpochPipeline, ReadLimits, CancelToken], Awaitable[Coverage]]
"""One read of the source session into the open epoch (the runner's, taking the session's turn)."""


@dataclass(frozen=True)
class Pending:
    """What a tick found not certified yet: the reader's open epoch, or the reader starting.

    ``phase`` is ``starting`` (taking the lease, opening the sessions), ``reading`` (the open epoch
    reads; ``epoch``, ``rows`` and ``seconds`` describe it), ``recovering`` (the open epoch re-reads
    what the destination committed before its certificate) or ``committing`` (the open epoch was
    sealed and is being committed). ``committing`` names an earlier epoch being committed while
    ``epoch`` is read (pipelined). ``age`` is the stream's epoch age: an open epoch older than it by
    more than a read is inside a source transaction.
    """

    phase: str
    epoch: EpochId | None
    rows: int
    seconds: float
    lease_wait: str | None = None
    """While the reader waits to take the lease: who holds it (``LeaseBusy.describe``)."""
    committing: EpochId | None = None
    age: float = DEFAULT_AGE_SECONDS

    def describe(self) -> str:
        """For people (the tick's skip reason)."""
        if self.lease_wait is not None:
            return (
                f"waiting {self.seconds:.0f}s so far to take the lease: {self.lease_wait}; the first "
                "epoch is read, sealed and certified as soon as it is taken (a holder that died cannot "
                "hand over: its lease expires), and a later tick reports it"
            )
        if self.phase == "starting" or self.epoch is None:
            return (
                f"no epoch open yet: taking the lease and opening the sessions ({self.seconds:.1f}s so far); "
                "epochs are then sealed in the background and a later tick reports them"
            )
        epoch = f"epoch {self.epoch.sequence}"
        if self.phase == "committing":
            return f"{epoch} was sealed with {self.rows} rows and is being committed; a later tick reports it"
        if self.committing is not None and self.rows == 0:
            return (
                f"epoch {self.committing.sequence} was sealed and is being committed; a later tick reports it"
            )
        if self.phase == "recovering":
            return (
                f"{epoch} re-reads the source up to what the destination committed before its certificate "
                f"({self.rows} rows so far, {self.seconds:.0f}s); it is sealed once it gets there"
            )
        committing = (
            "" if self.committing is None else f"; epoch {self.committing.sequence} is being committed"
        )
        if self.seconds <= self.age + READ_SLICE_SECONDS:
            return (
                f"{epoch} is open with {self.rows} rows read ({self.seconds:.1f}s); it is sealed at its "
                f"next safe source boundary after {self.age:g}s, in the background{committing}"
            )
        return (
            f"{epoch} is open for {self.seconds:.0f}s with {self.rows} rows read: the read in progress "
            "has not reached a safe source boundary yet (a source transaction still open); the rows wait "
            "in the open epoch, invisible at a transactional destination, and the epoch is sealed when "
            "the transaction ends"
        )


class EpochClock:
    """When the reader's open epoch is due, what ticks see of it, and when the reader stops. One loop.

    ``requested`` counts seal requests (stops and hand-overs), ``served`` the request the last sealed
    epoch served.
    """

    def __init__(self, limits: ReadLimits) -> None:
        self.limits = limits
        self.age = DEFAULT_AGE_SECONDS if limits.age is None else limits.age
        self.requested = 0
        self.served = 0
        self.stopping = False
        self.stopped_idle = False
        self.phase = "starting"
        self.epoch: EpochId | None = None
        self.pipeline: EpochPipeline | None = None
        self.committing: EpochId | None = None
        self.committing_rows = 0
        self.since = 0.0
        self.last_tick = 0.0
        self.stop_after: float | None = None
        self._sealing = 0
        self._event: asyncio.Event | None = None

    def ticked(self, now: float, stop_after: float | None) -> None:
        """A tick came at loop time ``now``; the reader stops when none came for ``stop_after`` seconds."""
        self.last_tick, self.stop_after = now, stop_after

    def request(self) -> int:
        """Ask the open epoch to be sealed at its next safe boundary; returns the request's number."""
        self.requested += 1
        self.changed()
        return self.requested

    def changed(self) -> None:
        """Wake everything waiting on the clock."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout: float | None, cancel: CancelToken | None = None) -> None:
        """Until something changes (a request, an epoch sealed or ended, a stop), ``cancel``, or
        ``timeout``."""
        if self._event is None:
            self._event = asyncio.Event()
        waiters: set[asyncio.Future[object]] = {asyncio.ensure_future(self._event.wait())}
        if cancel is not None:
            waiters.add(asyncio.ensure_future(cancel.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def begun(self, epoch: EpochId, pipeline: EpochPipeline, now: float) -> None:
        """Epoch ``epoch`` is read now (the one before it, if any, is committing)."""
        self.epoch, self.pipeline, self.since, self.phase = epoch, pipeline, now, "reading"
        self.changed()

    def sealed(self, epoch: EpochId) -> None:
        """``epoch`` was sealed: it is committed now, and the next one read."""
        self.committing = epoch
        self.committing_rows = 0 if self.pipeline is None else self.pipeline.rows_read
        self.served = max(self.served, self._sealing)
        if self.epoch == epoch:
            self.epoch, self.pipeline, self.phase = None, None, "starting"
        self.changed()

    def ended(self, epoch: EpochId | None) -> None:
        """``epoch`` ended: certified, dropped empty or failed (None: before it had an id)."""
        if epoch is not None and self.committing == epoch:
            self.committing = None
        if epoch is None or self.epoch == epoch:
            self.epoch, self.pipeline, self.phase = None, None, "starting"
            self.since = asyncio.get_running_loop().time()
        self.changed()

    def going(self) -> bool:
        """False once the reader is asked to stop."""
        return not self.stopping

    @property
    def settled(self) -> bool:
        """True when nothing read is waiting to be certified (no rows in the open epoch, nothing
        committing) and the reader runs (not starting)."""
        reading = self.pipeline is not None and self.pipeline.rows_read > 0
        return self.phase != "starting" and not reading and self.committing is None

    def pending(self, now: float) -> Pending:
        rows = 0 if self.pipeline is None else self.pipeline.rows_read
        seconds = max(0.0, now - self.since)
        if self.phase == "starting" and self.committing is not None:
            return Pending("committing", self.committing, self.committing_rows, seconds, age=self.age)
        return Pending(self.phase, self.epoch, rows, seconds, committing=self.committing, age=self.age)

    def idle_too_long(self, now: float) -> bool:
        """True when no tick came for ``stop_after`` seconds: the reader stops."""
        return self.stop_after is not None and now - self.last_tick > self.stop_after

    def due(self, pipeline: EpochPipeline, now: float) -> bool:
        """Whether the open epoch is sealed at the end of the read in progress: it read something and
        is old enough, full, or a seal was asked for."""
        if not pipeline.has_evidence:
            return False
        return self.full(pipeline) or now - self.since >= self.age or self.requested > self._sealing

    def full(self, pipeline: EpochPipeline) -> bool:
        limits = self.limits
        return (limits.records is not None and pipeline.rows_written >= limits.records) or (
            limits.bytes is not None and pipeline.bytes_written >= limits.bytes
        )

    def slice(self, pipeline: EpochPipeline, now: float) -> ReadLimits:
        """The limits of the next read into ``pipeline``'s epoch, begun at loop time ``now``: what is
        left of its records and bytes, and an age that ends the read when the epoch becomes due (at
        least ``SEAL_SLICE_SECONDS``, at most ``READ_SLICE_SECONDS``; the longest while it read
        nothing: a read returns ``idle`` seconds after its last row anyway)."""
        limits = self.limits
        records = None if limits.records is None else max(1, limits.records - pipeline.rows_written)
        size = None if limits.bytes is None else max(1, limits.bytes - pipeline.bytes_written)
        left = self.since + self.age - now
        if self.requested > self._sealing:
            left = 0.0
        if not pipeline.has_evidence:
            left = READ_SLICE_SECONDS
        age = min(READ_SLICE_SECONDS, max(SEAL_SLICE_SECONDS, left))
        return ReadLimits(
            records=records,
            bytes=size,
            idle=READ_IDLE_SECONDS if limits.idle is None else min(limits.idle, READ_IDLE_SECONDS),
            age=age,
        )

    async def read(
        self, read: Read, pipeline: EpochPipeline, cancel: CancelToken, recover_to: tuple[Position, ...]
    ) -> Coverage | None:
        """Read into the open epoch until it is due (never short of ``recover_to``, the destination's
        watermark while recovering); the coverage of every read, or None when cancelled, or stopped
        with nothing read."""
        loop = asyncio.get_running_loop()
        coverage = Coverage()
        while not cancel.cancelled:
            now = loop.time()
            recovering = bool(recover_to) and not reaches(coverage, recover_to)
            self.phase = "recovering" if recovering else "reading"
            if not recovering and self.due(pipeline, now):
                self._sealing = self.requested
                self.phase = "committing"
                return coverage
            if self.stopping and not pipeline.has_evidence:
                return None
            limits = self.slice(pipeline, now)
            if recovering and self.full(pipeline):  # read on to the destination's watermark
                limits = ReadLimits(idle=READ_IDLE_SECONDS, age=READ_SLICE_SECONDS)
            more = await read(pipeline, limits, cancel)
            if cancel.cancelled:
                break
            coverage = merge(coverage, more)
            if more.empty:
                await self.wait(EMPTY_READ_PAUSE, cancel)
        return None
