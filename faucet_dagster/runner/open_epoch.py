"""Epochs that span ticks: the open epoch, read between sensor ticks and sealed when a tick asks.

Under a sensor, the runner reads in the background (:meth:`StreamRunner.tick
<faucet_dagster.runner.continuous.StreamRunner.tick>` starts it): an epoch is begun at the sink, and the
source session reads into it in short reads, each ending at a safe source boundary. A tick asks for a
seal (:meth:`EpochClock.request`); the open epoch serves it at the end of the read in progress, that is
at the next safe boundary, after at least one read of its own (when the last read found nothing, after
one more begun after the request, so what reached the source before the tick is in the epoch it
seals): the runner then seals, commits, certifies, acknowledges and begins the next epoch.

How long a read lasts outside a source transaction is how long a tick's seal waits for it. A tick that
says when the next one can come at the earliest (``quiet_until``: a sensor's ticks are at least its
minimum interval apart) lets the reads before then last ``READ_SLICE_SECONDS`` (few boundaries, the
destination written in few batches); from then on, and whenever a seal is asked for, reads last
``SEAL_SLICE_SECONDS``, so the tick the daemon sends (as late as its loop makes it) waits a fraction
of a second for its seal. Without ``quiet_until`` every read is a short one.

A read inside a source transaction goes on until the transaction ends, however many ticks that takes;
its rows reach the sink as they are read (a transactional sink holds them in its open epoch, invisible
until the commit), so memory stays bounded by the pipeline's batches, never by the transaction.

Bounds: the open epoch ends at the first safe boundary after ``limits.records`` rows or
``limits.bytes`` bytes (it is *full*) and is sealed then without waiting for a tick, as one open for
``MAX_OPEN_SECONDS`` is (the next tick reports both): a reader that waited for the tick would sit idle
for the rest of the sensor's interval, capping the stream at ``limits.records`` per interval. Nothing
is dropped, and memory stays bounded by one epoch. So a backlog drains at the speed the source and the
sink allow, between ticks as during them, and a tick waits for its own seal only. A reader
that no tick asked anything for ``stop_after`` seconds (the sensor was stopped, the daemon ticks
another process) aborts its open epoch and stops, and the runner gives its lease up.

Nothing here changes what is certified: the seal, commit and certificate are the runner's single commit
order, and an open epoch that dies with its process is rolled back and replayed from the certified
positions.
"""

import asyncio
from dataclasses import dataclass

from faucet_dagster.pipeline import EpochPipeline
from faucet_dagster.protocol import CancelToken, Coverage, EpochId, Position, ReadLimits, StreamSession
from faucet_dagster.runner.recovery import merge, reaches

READ_SLICE_SECONDS = 1.0
"""The longest read of an open epoch outside a source transaction, while no tick can come before it ends."""
SEAL_SLICE_SECONDS = 0.1
"""The longest read of an open epoch outside a source transaction once a tick can come (or asked for a
seal): how long a seal request waits for the read in progress to reach its boundary."""
TICK_GUARD_SECONDS = 1.0
"""How much sooner than its interval after a tick the next one is expected: what reaching the runner
takes a tick (the daemon's own work, the gRPC call, the sensor's start) varies by up to this much."""
READ_IDLE_SECONDS = 0.5
"""A read of an open epoch with nothing new returns after this long (or the stream's ``idle``)."""
MAX_OPEN_SECONDS = 60.0
"""An open epoch no tick sealed for this long is sealed by the reader itself at its next boundary (and
reported by the next tick), so a destination transaction never sits open longer, whatever the sensor's
interval (a PostgreSQL destination ends transactions idle for ``idle_in_transaction_session_timeout``,
120 s by default)."""
EMPTY_READ_PAUSE = 0.2
"""Seconds an open epoch waits after a read that returned nothing (a source that returns at once when it
cannot deliver more, such as a full acknowledgement window) before it reads again."""


@dataclass(frozen=True)
class Pending:
    """What a tick found when its budget ended before the open epoch was sealed and certified."""

    phase: str
    epoch: EpochId | None
    rows: int
    seconds: float
    lease_wait: str | None = None
    """While the reader waits to take the lease: who holds it (``LeaseBusy.describe``)."""

    def describe(self) -> str:
        """For people (the tick's skip reason)."""
        if self.lease_wait is not None:
            return (
                f"waiting {self.seconds:.0f}s so far to take the lease: {self.lease_wait}; the first "
                "epoch is sealed and certified as soon as it is taken (a holder that died cannot hand "
                "over: its lease expires), and the next tick reports it"
            )
        if self.phase == "starting" or self.epoch is None:
            return (
                f"no epoch open yet: taking the lease and opening the sessions ({self.seconds:.1f}s so far); "
                "the next tick seals the first epoch"
            )
        epoch = f"epoch {self.epoch.sequence}"
        if self.phase == "committing":
            return (
                f"{epoch} was sealed with {self.rows} rows and is being committed; the next tick reports it"
            )
        if self.phase == "recovering":
            return (
                f"{epoch} re-reads the source up to what the destination committed before its certificate "
                f"({self.rows} rows so far, {self.seconds:.0f}s); it is sealed once it gets there"
            )
        return (
            f"{epoch} is open for {self.seconds:.0f}s with {self.rows} rows read: the read in progress "
            "has not reached a safe source boundary yet (a source transaction still open); the rows wait "
            "in the open epoch, invisible at the destination, and the epoch is sealed when the "
            "transaction ends, on a later tick if need be"
        )


class EpochClock:
    """The seal requests of ticks and the state of the open epoch they are served by. One event loop.

    ``requested`` counts seal requests, ``served`` the request the last ended epoch served (a seal, or
    an empty epoch dropped).
    """

    def __init__(self, limits: ReadLimits) -> None:
        self.limits = limits
        self.requested = 0
        self.served = 0
        self.stopping = False
        self.stopped_idle = False
        self.phase = "starting"
        self.epoch: EpochId | None = None
        self.pipeline: EpochPipeline | None = None
        self.since = 0.0
        self.last_tick = 0.0
        self.quiet_until = 0.0
        """Loop time before which no seal request is expected (the next tick's earliest time): reads
        that end by then may be long ones."""
        self.stop_after: float | None = None
        self._sealing = 0
        self._event: asyncio.Event | None = None

    def ticked(self, now: float, interval: float | None, stop_after: float | None) -> None:
        """A tick came at loop time ``now``; the next comes ``interval`` seconds later at the earliest
        (None: unknown); the reader stops when none came for ``stop_after`` seconds."""
        self.last_tick, self.stop_after = now, stop_after
        self.quiet_until = 0.0 if interval is None else now + interval - TICK_GUARD_SECONDS

    def request(self) -> int:
        """Ask the open epoch to seal at its next safe boundary; returns the request's number."""
        self.requested += 1
        self.changed()
        return self.requested

    def changed(self) -> None:
        """Wake everything waiting on the clock."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout: float | None, cancel: CancelToken | None = None) -> None:
        """Until something changes (a request, an epoch ended, a stop), ``cancel`` or ``timeout``."""
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
        self.epoch, self.pipeline, self.since, self.phase = epoch, pipeline, now, "reading"

    def ended(self) -> None:
        """The open epoch ended (certified, or dropped empty): its seal request is served."""
        self.served = max(self.served, self._sealing)
        self.epoch, self.pipeline, self.phase = None, None, "starting"
        self.since = asyncio.get_running_loop().time()
        self.changed()

    def going(self) -> bool:
        """False once the reader is asked to stop."""
        return not self.stopping

    def pending(self, now: float) -> Pending:
        rows = 0 if self.pipeline is None else self.pipeline.rows_read
        return Pending(self.phase, self.epoch, rows, max(0.0, now - self.since))

    def idle_too_long(self, now: float) -> bool:
        """True when no tick came for ``stop_after`` seconds: the reader stops."""
        return self.stop_after is not None and now - self.last_tick > self.stop_after

    def slice(self, pipeline: EpochPipeline, now: float) -> ReadLimits | None:
        """The limits of the next read into ``pipeline``'s epoch, begun at loop time ``now``; None when
        the epoch is full. Its age: up to ``READ_SLICE_SECONDS`` while it ends before ``quiet_until``
        and no seal is asked for, else ``SEAL_SLICE_SECONDS`` (never beyond the stream's own ``age``)."""
        limits = self.limits
        records = None if limits.records is None else limits.records - pipeline.rows_written
        size = None if limits.bytes is None else limits.bytes - pipeline.bytes_written
        if (records is not None and records <= 0) or (size is not None and size <= 0):
            return None
        quiet = 0.0 if self.requested > self._sealing else self.quiet_until - now
        age = min(READ_SLICE_SECONDS, max(SEAL_SLICE_SECONDS, quiet))
        return ReadLimits(
            records=records,
            bytes=size,
            idle=READ_IDLE_SECONDS if limits.idle is None else min(limits.idle, READ_IDLE_SECONDS),
            age=age if limits.age is None else min(limits.age, age),
        )

    async def read(
        self,
        session: StreamSession,
        pipeline: EpochPipeline,
        cancel: CancelToken,
        recover_to: tuple[Position, ...],
    ) -> Coverage | None:
        """Read into the open epoch until a seal request is due (after one read at least, never short of
        ``recover_to``, the destination's watermark while recovering); the coverage of every read, or
        None when cancelled, stopped, or no tick came for ``stop_after`` seconds."""
        loop = asyncio.get_running_loop()
        coverage = Coverage()
        reads = 0
        # A read that found nothing before the seal was requested is not the epoch's last: one more
        # read takes what reached the source before the tick (a read that returned rows ends the epoch
        # at once, so a tick never waits on a further read of a busy source).
        stale, asked = False, 0
        while not (cancel.cancelled or self.stopping):
            if self.idle_too_long(loop.time()):
                self.stopping = self.stopped_idle = True
                break
            recovering = bool(recover_to) and not reaches(coverage, recover_to)
            self.phase = "recovering" if recovering else "reading"
            limits = self.slice(pipeline, loop.time())
            full = limits is None
            due = full or self.requested > self._sealing or loop.time() - self.since >= MAX_OPEN_SECONDS
            if stale and self.requested > asked and not full:
                due = False
            if reads and not recovering and due:
                self._sealing = self.requested
                self.phase = "committing"
                return coverage
            if limits is None:  # full while recovering: read on to the destination's watermark
                limits = ReadLimits(idle=READ_IDLE_SECONDS, age=READ_SLICE_SECONDS)
            asked = self.requested
            more = await session.read(pipeline, limits, cancel)
            reads += 1
            stale = more.empty
            if cancel.cancelled:
                break
            coverage = merge(coverage, more)
            if more.empty:
                await self.wait(EMPTY_READ_PAUSE, cancel)
        return None
