"""The stream runners cached in this process (one per stream and state store), their event loop, and
their closing when the process stops.

A sensor tick finds its stream's :class:`~faucet_dagster.runner.continuous.StreamRunner` here, with its
open sessions, its background reader and its lease: ticks run on different threads, so each runner
sits behind a lock. The cache is an optimisation, never the source of truth: everything a runner needs
is read from the state store when it opens its sessions.

A process that stops closes its runners (:func:`close_cached_streams`, at interpreter exit). A stream
whose sensor still ticks is read on first, for at most ``EXIT_LINGER_SECONDS``, until a newer process
asks for it (a hand-over) or the next tick is overdue: the daemon replaces its code servers every 60 s,
the old one exits about 20 s later, and the new one ticks each sensor up to an interval after the old
one did; without the wait the stream would stand still in between. Then, within
``EXIT_CLOSE_SECONDS``, each runner seals and certifies its open epoch, closes its sessions and releases
its lease. A close that does not finish in time is abandoned; when the stream's sink cannot take back what
it wrote (NATS publishes during ``apply``), its last epoch's writes may reach the destination with no
certificate naming them, so the stream is marked uncertain in the state store before the process
exits: no process takes it over until an operator checked the destination and ran ``faucet streams
release``.
"""

import asyncio
import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from faucet_dagster.protocol import FaucetError
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.runner.loop import BackgroundLoop
from faucet_dagster.state import StateStore

logger = logging.getLogger(__name__)

EXIT_CLOSE_SECONDS = 10.0
"""How long a stopping process waits for its streams to close before it exits anyway."""
EXIT_LINGER_SECONDS = 25.0
"""How long, at most, an exiting process goes on reading a stream its sensor still ticks, waiting for
a newer process to take it over (``StreamRunner.linger``), before it closes it: the daemon's code
server exits 20 s after its replacement started, which ticks each sensor up to an interval (30 s by
default) after the old one did. Not when the process exits on an interrupt (Ctrl-C, or SIGTERM where
it is one). An orchestrator's grace period should leave it and ``EXIT_CLOSE_SECONDS``."""
LOOP_MARGIN_SECONDS = 2.0
"""How much longer than the closes' time the closing thread waits for the event loop to answer."""


@dataclass
class StreamHandle:
    """A stream's cached runner and store in this process; ``lock`` is held while a tick runs."""

    runner: StreamRunner
    store: StateStore
    lock: threading.Lock = field(default_factory=threading.Lock)


_handles: dict[tuple[str, str | None], StreamHandle] = {}
_handles_lock = threading.Lock()
_background: BackgroundLoop | None = None


def stream_loop() -> BackgroundLoop:
    """The process's event loop for stream sessions (created on first use)."""
    global _background
    with _handles_lock:
        if _background is None:
            _background = BackgroundLoop("faucet-streams")
            _at_interpreter_exit(_close_at_exit)
        return _background


def _at_interpreter_exit(callback: Callable[[], None]) -> None:
    """Call ``callback`` when the interpreter begins to exit, before its thread pools shut down.

    ``atexit`` runs too late: by then ``concurrent.futures`` refuses new work ("cannot schedule new
    futures after interpreter shutdown"), and every close needs the loop's executor for the state
    store. ``threading._register_atexit`` callbacks run first, newest first, before non-daemon threads
    (a code server's gRPC pool) are joined; ``atexit`` is the fallback where it does not exist.
    """
    register: Callable[[Callable[[], None]], None] | None = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(callback)
    except RuntimeError:  # missing, or the interpreter is exiting already
        atexit.register(callback)


def cached_runner(name: str, state_url: str | None, build: Callable[[], StreamSpec]) -> StreamHandle:
    """The cached runner of stream ``name`` (state store ``state_url``) in this process, created on
    first use from ``build()`` (no I/O)."""
    key = (name, state_url)
    with _handles_lock:
        handle = _handles.get(key)
        if handle is None:
            store = StateStore(state_url)
            handle = StreamHandle(StreamRunner(build(), store), store)
            _handles[key] = handle
        return handle


def close_cached_streams(timeout: float | None = None, *, linger: float = 0.0) -> None:
    """Close every runner cached in this process and forget it (tests, shutdown).

    With ``linger``, the runners whose sensors still tick first go on reading, at most that many
    seconds, until a newer process takes each over or its next tick is overdue (``StreamRunner.linger``;
    a second interrupt, such as Ctrl-C, ends the wait). Then each close seals the open epoch at its
    next safe boundary and certifies it, joins the sessions and gives the lease up, so another worker
    takes the stream over at once (see :meth:`StreamRunner.close`); the runners close concurrently.
    Every runner is closed even when one close fails (each failure is logged with its stream); then
    the first failure is raised (an :class:`UncertainOutcome` has marked its stream uncertain by
    then). With ``timeout``, the closes that have not finished by then are abandoned and logged: the
    leases expire, and a stream whose sink cannot take back its writes is marked uncertain in the
    store first (see the module docstring).
    """
    loop = _background
    with _handles_lock:
        handles = list(_handles.items())
        _handles.clear()
    if loop is not None and linger > 0:
        _linger_all(loop, [handle.runner for _, handle in handles], linger)
    ends = None if timeout is None else time.monotonic() + timeout
    held: list[tuple[str, StreamHandle]] = []
    for (name, _), handle in handles:
        left = None if ends is None else max(0.0, ends - time.monotonic())
        if handle.lock.acquire(timeout=-1 if left is None else left):
            held.append((name, handle))
        else:
            logger.error("faucet stream %s: a tick still runs; not closed (its lease expires)", name)
            _abandon(name, handle)
    if loop is None:
        for _, handle in held:
            handle.lock.release()
            handle.store.close()
        return
    left = None if ends is None else max(0.0, ends - time.monotonic())
    try:
        # The loop's own bound is the closes' one; the margin covers a loop thread held up itself.
        bound = None if left is None else left + LOOP_MARGIN_SECONDS
        outcomes = loop.run(_close_all([handle.runner for _, handle in held], left), timeout=bound)
    except TimeoutError:
        outcomes = [_ABANDONED] * len(held)
    failures: list[FaucetError] = []
    for (name, handle), outcome in zip(held, outcomes, strict=True):
        handle.lock.release()
        if outcome is _ABANDONED:
            logger.error("faucet stream %s did not close in %.0fs; its lease expires", name, timeout or 0.0)
            _abandon(name, handle)
            continue  # the abandoned close may still use the store
        if isinstance(outcome, FaucetError):
            logger.error("closing faucet stream %s failed: %s", name, outcome)
            failures.append(outcome)
        handle.store.close()
    if failures:
        raise failures[0]


def _linger_all(loop: BackgroundLoop, runners: Sequence[StreamRunner], longest: float) -> None:
    """Let the readers run on, at most ``longest`` seconds (see :func:`close_cached_streams`)."""

    async def linger() -> None:
        await asyncio.gather(*(runner.linger(longest) for runner in runners if runner.reading))

    try:
        loop.run(linger(), timeout=longest + LOOP_MARGIN_SECONDS)
    except TimeoutError:
        logger.warning("faucet streams: the readers did not stop lingering in %.0fs", longest)
    except KeyboardInterrupt:
        logger.warning("faucet streams: interrupted while waiting for newer processes; closing now")


_ABANDONED = object()
"""The outcome of a close that did not finish within its time."""


async def _close_all(runners: Sequence[StreamRunner], timeout: float | None) -> list[object]:
    """Close ``runners`` concurrently, for at most ``timeout`` seconds: each one's failure (a
    :class:`FaucetError`), None, or ``_ABANDONED`` (still closing; left running)."""
    closes = [asyncio.ensure_future(runner.close()) for runner in runners]
    if closes:
        await asyncio.wait(closes, timeout=timeout)
    outcomes: list[object] = []
    for close in closes:
        if not close.done():
            outcomes.append(_ABANDONED)
        elif close.cancelled():
            outcomes.append(None)
        else:
            failure = close.exception()
            if failure is not None and not isinstance(failure, FaucetError):
                raise failure
            outcomes.append(failure)
    return outcomes


def _abandon(name: str, handle: StreamHandle) -> None:
    """A close left unfinished: mark the stream uncertain when destination effects may follow."""
    reason = handle.runner.abandoned_effects()
    if reason is None:
        return
    try:
        handle.store.mark_uncertain(name, reason)
    except FaucetError as exc:
        logger.error("faucet stream %s: could not be marked uncertain (%s): %s", name, exc, reason)
        return
    logger.error(
        "faucet stream %s is marked uncertain: %s. No process takes it over until an operator checked "
        "the destination and ran `faucet streams release %s`",
        name,
        reason,
        name,
    )


def _close_at_exit() -> None:
    interrupted = getattr(sys, "last_type", None) is KeyboardInterrupt  # the main thread's last error
    try:
        close_cached_streams(timeout=EXIT_CLOSE_SECONDS, linger=0.0 if interrupted else EXIT_LINGER_SECONDS)
    except FaucetError:
        pass  # logged with its stream by close_cached_streams; at exit there is no caller to tell
    finally:
        if _background is not None:
            _background.close()
