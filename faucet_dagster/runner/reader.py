"""The reader a sensor's ticks keep running: epochs read, sealed and certified in the background.

The first tick (and the first after the reader failed or stopped) starts a task on the runner's event
loop that runs epochs back to back, pipelined (:mod:`.pipelined`), each sealed when it is due
(:mod:`.open_epoch`: its age, about a second by default, its size, or a stop), then committed,
certified and acknowledged in the runner's single commit order. A tick does not wait for any of it:
it says what is not certified yet (:class:`~faucet_dagster.runner.open_epoch.Pending`) and the sensor
reports what the store certified since the last tick. So a row is visible at the destination about
a second after it reached the source, whatever the sensor's interval, and the serial sensor daemon
is never held up by a stream.

The reader stops when no tick came for ``stop_after`` seconds, when the runner closes and when a
newer worker asks for the stream (a hand-over). Each stop first seals the open epoch at its next safe
boundary and certifies it (:meth:`Reader.stop`): a sink that cannot take back its writes (NATS
publishes during ``apply``) waits for that boundary however long the source transaction in progress
takes; a transactional sink waits ``seal_within`` seconds at most, then its open epoch is rolled back
(nothing of it is visible) and read again by the next owner.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from faucet_dagster.runner.open_epoch import EpochClock, Pending

logger = logging.getLogger(__name__)

Epochs = Callable[[EpochClock], Awaitable[None]]
"""Runs epochs with ``clock`` until it stops (the runner's pipelined loop under its serial lock)."""
IDLE_CHECK_SECONDS = 1.0
"""How often the reader looks whether a tick came within ``stop_after``."""


class Reader:
    """A stream's background reader and the clock its epochs are sealed by. One event loop.

    ``epochs(clock)`` runs the epochs; ``lease_waiting()`` says on whom taking the lease waits;
    ``interrupt()`` cancels the read in progress (its epoch is rolled back); ``seal_within`` is how
    long a stop waits for the open epoch's seal (None: however long it takes); ``on_idle_stop(s)``
    closes the sessions and releases the lease after the reader stopped for want of ticks for ``s``
    seconds.
    """

    def __init__(
        self,
        name: str,
        clock: EpochClock,
        epochs: Epochs,
        *,
        lease_waiting: Callable[[], str | None],
        interrupt: Callable[[], None],
        seal_within: float | None,
        on_idle_stop: Callable[[float], Awaitable[None]],
    ) -> None:
        self.name = name
        self.clock = clock
        self._epochs = epochs
        self._lease_waiting = lease_waiting
        self._interrupt = interrupt
        self._seal_within = seal_within
        self._on_idle_stop = on_idle_stop
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._interval: float | None = None
        self.started = False
        """Whether the latest :meth:`tick` started the reader (this process's first, or after one ended)."""

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def tick(
        self,
        budget_seconds: float,
        *,
        stop_after: float | None,
        starting_budget: float | None,
        interval: float | None = None,
    ) -> Pending | None:
        """Keep the reader running and say what is not certified yet (None: nothing; the reader runs
        and holds no row it has not certified). Raises the reader's failure, once; the tick after it
        starts a new reader. A tick that starts the reader waits, at most ``starting_budget`` seconds
        (default ``budget_seconds``), until it took the lease and opened the sessions, so a failure to
        start is raised by that tick. The reader stops when no tick came for ``stop_after`` seconds.
        ``interval`` is when the next tick comes at the earliest (:meth:`linger` waits for it)."""
        loop = asyncio.get_running_loop()
        clock = self.clock
        clock.ticked(loop.time(), stop_after)
        self._interval = interval
        self.started = False
        if not self.running:
            failure, self._failure, self._task = self._failure, None, None
            if failure is not None:
                raise failure
            clock.stopping = clock.stopped_idle = False
            clock.since = loop.time()
            clock.phase = "starting"
            self._task = loop.create_task(self._run(), name=f"faucet-read-{self.name}")
            self.started = True
            wait = budget_seconds if starting_budget is None else starting_budget
            deadline = loop.time() + wait
            task = self._task
            while clock.phase == "starting" and not task.done() and loop.time() < deadline:
                await clock.wait(deadline - loop.time())
            if task.done():
                failure, self._failure = self._failure, None
                if failure is not None:
                    raise failure
        return None if clock.settled else self._pending(loop.time())

    def _pending(self, now: float) -> Pending:
        return replace(self.clock.pending(now), lease_wait=self._lease_waiting())

    async def _run(self) -> None:
        clock = self.clock
        running = asyncio.ensure_future(self._epochs(clock))
        watch = asyncio.ensure_future(self._watch_ticks(running))
        try:
            await running
        except Exception as exc:  # noqa: BLE001 - handed to the next tick, which raises it
            self._failure = exc
        finally:
            watch.cancel()
            await asyncio.wait([watch])
            clock.phase = "starting"
            clock.changed()
        if clock.stopped_idle and self._failure is None:
            try:
                await self._on_idle_stop(clock.stop_after or 0.0)
            except Exception as exc:  # noqa: BLE001 - handed to the next tick, which raises it
                self._failure = exc

    async def _watch_ticks(self, running: "asyncio.Future[None]") -> None:
        """Stop the reader when no tick came for ``stop_after`` seconds: its open epoch is sealed at
        its next safe boundary and certified (within ``seal_within``, else rolled back)."""
        clock = self.clock
        loop = asyncio.get_running_loop()
        while not clock.idle_too_long(loop.time()):
            await asyncio.sleep(IDLE_CHECK_SECONDS)
        clock.stopped_idle = True
        await self._stop_running(running, self._seal_within)

    async def _stop_running(self, running: "asyncio.Future[None]", seal_within: float | None) -> None:
        clock = self.clock
        clock.stopping = True
        clock.request()
        done, _ = await asyncio.wait([running], timeout=seal_within)
        if not done:
            logger.warning(
                "stream %s: the open epoch reached no safe boundary within %.1fs; it is rolled back",
                self.name,
                seal_within or 0.0,
            )
            self._interrupt()

    async def linger(self, longest: float, margin: float) -> None:
        """Wait while the reader runs, at most ``longest`` seconds and until ``margin`` seconds past
        the next tick's earliest time (none: no wait); a hand-over stops the reader, and this returns."""
        task, interval = self._task, self._interval
        if task is None or task.done() or interval is None:
            return
        loop = asyncio.get_running_loop()
        until = min(loop.time() + longest, self.clock.last_tick + interval + margin)
        if until > loop.time():
            await asyncio.wait([task], timeout=until - loop.time())

    async def stop(self, *, seal_within: float | None) -> None:
        """Stop the reader (if it runs, and it is not the caller): its open epoch is sealed at its next
        safe boundary, certified and acknowledged, and no epoch is read after it; one not sealed
        within ``seal_within`` seconds (None: however long it takes) is interrupted (rolled back)."""
        task = self._task
        if task is None or task is asyncio.current_task():
            return
        if not task.done():
            await self._stop_running(task, seal_within)
            await asyncio.wait([task])
        self._task = None
        self._failure = None


__all__ = ["Reader"]
