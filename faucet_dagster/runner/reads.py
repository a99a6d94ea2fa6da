"""The reads of an epoch, and their interruption: to the limits in one call, or until the open epoch is
due under a sensor; each read of the source session in its turn, each cancellable.

A read is interrupted by :meth:`EpochReads.cancel` (any thread; the next read if none runs), by
:meth:`EpochReads.interrupt` (the read in progress only: a hand-over, a lease lost) and by the epoch
before it when that one fails (:meth:`.pipelined.Flight.interrupt`). Cancellation is an interruption,
never evidence that a source transaction ended: an interrupted read returns None, and its epoch is
aborted and rewound.

An epoch read in one call reads to the first safe boundary after its limits in one read of the source
session (a read ahead included: the acknowledgement of the epoch before it waits for that read to end,
which is what a source that re-positions after an interrupted server call needs: a PostgreSQL change
source reads the next call from a fresh copy of its slot, which starts where the slot was acknowledged).
While recovering an epoch the destination committed before its certificate, it reads on to the
destination's watermark.
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


class EpochReads:
    """The reads of one stream's epochs and the cancel token of the one in progress."""

    def __init__(self, sessions: StreamSessions, stream: str) -> None:
        self._sessions = sessions
        self._stream = stream
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: CancelToken | None = None
        self._requested = False
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Interrupt the read in progress, or the next one if none runs. Thread-safe."""
        with self._lock:
            token, loop = self._token, self._loop
            if token is not None and loop is not None:
                loop.call_soon_threadsafe(token.cancel)
            else:
                self._requested = True

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
                coverage = await sessions.read(session, pipeline, limits, token)
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
            return await sessions.read(session, into, limits, cancel)

        with self._cancellable(flight) as token:
            coverage = await clock.read(read, pipeline, token, sessions.recover_to)
        return None if token.cancelled else coverage


__all__ = ["EpochReads"]
