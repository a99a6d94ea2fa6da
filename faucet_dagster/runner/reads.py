"""The reads of an epoch, and their interruption: to the limits in one call, or until the open epoch is
due under a sensor; each read of the source session in its turn, each cancellable.

A read is interrupted by :meth:`EpochReads.cancel` (any thread; the next read if none runs), by
:meth:`EpochReads.interrupt` (the read in progress only: a hand-over, a lease lost) and by the epoch
before it when that one fails (:meth:`.pipelined.Flight.interrupt`). Cancellation is an interruption,
never evidence that a source transaction ended: an interrupted read returns None, and its epoch is
aborted and rewound. A cancel that lets the read in progress finish (``cancel(finish=True)``, a stop
for a sink whose writes cannot be taken back) ends its epoch at the next safe boundary instead.

An epoch read in one call reads to the first safe boundary after its limits, in one read of the source
session as long as data comes: a read is not cut into slices by time (a PostgreSQL change source ends a
read inside a server call by dropping its copy of the slot, which the next read makes again from the
slot's acknowledged position). An epoch read ahead, while the epoch before it is in flight, stops a read
after ``AHEAD_IDLE_SECONDS`` with nothing new instead of its ``idle``, so that epoch's acknowledgement
(which takes the session's turn after the read) is not held up by a source with nothing to say; it
then reads on to its limits. While recovering an epoch the destination committed before its
certificate, it reads on to the destination's watermark.
"""

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator

from faucet_dagster.pipeline import EpochPipeline
from faucet_dagster.protocol import CancelToken, Coverage, FaucetError, ReadLimits, SourceLag, StreamSession
from faucet_dagster.runner.open_epoch import EpochClock
from faucet_dagster.runner.pipelined import Flight
from faucet_dagster.runner.recovery import merge, reaches
from faucet_dagster.runner.sessions import StreamSessions

logger = logging.getLogger(__name__)

AHEAD_IDLE_SECONDS = 0.05
"""How long a read of an epoch read ahead waits with nothing new before it lets the acknowledgement of
the epoch before it take the source session (then it reads on)."""


class EpochReads:
    """The reads of one stream's epochs and the cancel token of the one in progress."""

    def __init__(self, sessions: StreamSessions, stream: str) -> None:
        self._sessions = sessions
        self._stream = stream
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: CancelToken | None = None
        self._requested = False
        self._finishing: CancelToken | None = None
        self._lock = threading.Lock()

    def cancel(self, *, finish: bool = False) -> None:
        """Interrupt the read in progress, or the next one if none runs. Thread-safe.

        With ``finish`` the read in progress is not interrupted: its epoch ends at the first safe
        boundary after the source read under way returns (within the epoch's limits), so it is sealed
        and certified, and the read after it is interrupted. That is a stop for a sink whose writes
        cannot be taken back: interrupting an epoch that already published would leave its writes
        uncertified, replayed by the next owner."""
        with self._lock:
            token, loop = self._token, self._loop
            if token is None or loop is None:
                self._requested = True
            elif finish:
                self._finishing = token
            else:
                loop.call_soon_threadsafe(token.cancel)

    def interrupt(self) -> None:
        """Interrupt the read in progress, if any (unlike :meth:`cancel`, never the next one)."""
        with self._lock:
            token, loop = self._token, self._loop
            if token is not None and loop is not None:
                loop.call_soon_threadsafe(token.cancel)

    def forget_cancel(self) -> None:
        """Drop a :meth:`cancel` no read took yet (the runner closed)."""
        self._requested = False

    @contextlib.contextmanager
    def _cancellable(self, flight: Flight) -> Iterator[CancelToken]:
        """A cancel token for the reads of one epoch, reachable by :meth:`cancel` meanwhile (and by
        the epoch before it, which interrupts it when it fails)."""
        token = CancelToken()
        with self._lock:
            self._loop, self._token = asyncio.get_running_loop(), token
            if self._requested:
                self._requested = False
                token.cancel()
        flight.reading(token)
        try:
            yield token
        finally:
            with self._lock:
                if self._token is token:
                    self._token = None
                if self._finishing is token:
                    self._finishing = None
                    self._requested = True

    def _finishes(self, token: CancelToken) -> bool:
        """Whether the read holding ``token`` was asked to end at its next safe boundary."""
        with self._lock:
            return self._finishing is token

    async def to_limits(
        self,
        session: StreamSession,
        pipeline: EpochPipeline,
        limits: ReadLimits,
        deadline: float | None,
        flight: Flight,
    ) -> Coverage | None:
        """Read to a safe boundary (while recovering, on to the sink's watermark); None when
        cancelled (``deadline``: a time on the running loop's clock that cancels it)."""
        sessions = self._sessions
        recover_to = sessions.recover_to
        with self._cancellable(flight) as token:
            loop = asyncio.get_running_loop()
            timer = None if deadline is None else loop.call_at(deadline, token.cancel)
            try:
                coverage = await self._to_limits_ahead(session, pipeline, limits, token, flight)
                while recover_to and not token.cancelled and not reaches(coverage, recover_to):
                    more = await sessions.read(session, pipeline, limits, token)
                    if more.empty:
                        logger.warning(
                            "stream %s: the source has nothing more, short of the destination's watermark; "
                            "the recovery is tried again on the next run",
                            self._stream,
                        )
                        return None
                    coverage = merge(coverage, more)
            finally:
                if timer is not None:
                    timer.cancel()
        # Cancellation is an interruption, never evidence that a transaction or the recovery ended.
        return None if token.cancelled else coverage

    async def _to_limits_ahead(
        self,
        session: StreamSession,
        pipeline: EpochPipeline,
        limits: ReadLimits,
        cancel: CancelToken,
        flight: Flight,
    ) -> Coverage:
        """One read to ``limits``; while the epoch before is in flight, reads that each stop after
        ``AHEAD_IDLE_SECONDS`` with nothing new (see the module docstring), together to ``limits``."""
        loop = asyncio.get_running_loop()
        began = quiet_since = loop.time()
        coverage = Coverage()
        while True:
            before = flight.previous
            ahead = before is not None and before.in_flight
            now = loop.time()
            more = await self._sessions.read(
                session, pipeline, _left(limits, pipeline, now - began, ahead), cancel
            )
            coverage = merge(coverage, more)
            now = loop.time()
            if not more.empty:
                quiet_since = now
            if cancel.cancelled or not ahead or _reached(limits, pipeline, now - began, now - quiet_since):
                return coverage
            if self._finishes(cancel):
                return coverage

    async def lag(self, session: StreamSession, timeout: float) -> tuple[SourceLag, ...]:
        """How far the source's head is past the last read, for its epoch's certificate, in the source
        session's turn. Informational: bounded by ``timeout`` and never failing the epoch (a failure
        is logged, the lag left out)."""
        async with self._sessions.turn:
            try:
                return await asyncio.wait_for(session.lag(), timeout)
            except (FaucetError, TimeoutError) as exc:
                logger.warning("stream %s: the source's lag is unknown: %r", self._stream, exc)
                return ()

    async def until_due(
        self, clock: EpochClock, session: StreamSession, pipeline: EpochPipeline, flight: Flight
    ) -> Coverage | None:
        """Read into the open epoch under a sensor until it is due; None when cancelled."""
        sessions = self._sessions

        async def read(into: EpochPipeline, limits: ReadLimits, cancel: CancelToken) -> Coverage:
            coverage = await sessions.read(session, into, limits, cancel)
            if self._finishes(cancel):
                clock.stopping = True
                clock.request()  # the open epoch is due at the end of this read
            return coverage

        with self._cancellable(flight) as token:
            coverage = await clock.read(read, pipeline, token, sessions.recover_to)
        return None if token.cancelled else coverage


def _left(limits: ReadLimits, pipeline: EpochPipeline, elapsed: float, ahead: bool) -> ReadLimits:
    """What is left of the epoch's ``limits`` after ``elapsed`` seconds of its reads; an ``idle`` of at
    most ``AHEAD_IDLE_SECONDS`` while it is read ahead."""
    idle = limits.idle
    if ahead:
        idle = AHEAD_IDLE_SECONDS if idle is None else min(idle, AHEAD_IDLE_SECONDS)
    return ReadLimits(
        records=None if limits.records is None else max(1, limits.records - pipeline.rows_read),
        bytes=None if limits.bytes is None else max(1, limits.bytes - pipeline.bytes_written),
        idle=idle,
        age=None if limits.age is None else max(0.0, limits.age - elapsed),
    )


def _reached(limits: ReadLimits, pipeline: EpochPipeline, elapsed: float, quiet: float) -> bool:
    """Whether the epoch's reads so far met one of its limits."""
    return (
        (limits.records is not None and pipeline.rows_read >= limits.records)
        or (limits.bytes is not None and pipeline.bytes_written >= limits.bytes)
        or (limits.age is not None and elapsed >= limits.age)
        or (limits.idle is not None and quiet >= limits.idle)
    )


__all__ = ["AHEAD_IDLE_SECONDS", "EpochReads"]
