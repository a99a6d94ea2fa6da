"""The stream runners cached in this process (one per stream and state store), their event loop, and
their closing when the process stops.

A sensor tick finds its stream's :class:`~faucet_dagster.runner.continuous.StreamRunner` here, with its
open sessions, its open epoch read between ticks and its lease: ticks run on different threads, so each
runner sits behind a lock. The cache is an optimisation, never the source of truth: everything a runner
needs is read from the state store when it opens its sessions.
"""

import atexit
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from faucet_dagster.protocol import FaucetError
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.runner.loop import BackgroundLoop
from faucet_dagster.state import StateStore

logger = logging.getLogger(__name__)

EXIT_CLOSE_SECONDS = 10.0
"""How long a stopping process waits for its streams to close before it exits anyway."""


@dataclass
class StreamHandle:
    """A stream's cached runner and store in this process; ``lock`` is held while epochs run."""

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


def close_cached_streams(timeout: float | None = None) -> None:
    """Close every runner cached in this process and forget it (tests, shutdown).

    Each close interrupts a running read, waits for the epoch in progress, joins its sessions and
    gives its lease up, so another worker takes the stream over at once. Every runner is closed even
    when one close fails (each failure is logged with its stream); then the first failure is raised
    (an :class:`UncertainOutcome` has marked its stream uncertain by then). With ``timeout``, the
    closes that have not finished by then are abandoned and logged (their leases expire).
    """
    loop = _background
    with _handles_lock:
        handles = list(_handles.items())
        _handles.clear()
    for _, handle in handles:
        handle.runner.cancel()
    ends = None if timeout is None else time.monotonic() + timeout
    failures: list[FaucetError] = []
    for (name, _), handle in handles:
        left = None if ends is None else max(0.0, ends - time.monotonic())
        if not handle.lock.acquire(timeout=-1 if left is None else left):
            logger.error("faucet stream %s: a tick still runs; not closed (its lease expires)", name)
            continue
        try:
            if loop is not None:
                left = None if ends is None else max(0.0, ends - time.monotonic())
                loop.run(handle.runner.close(), timeout=left)
        except FaucetError as exc:
            logger.error("closing faucet stream %s failed: %s", name, exc)
            failures.append(exc)
        except TimeoutError:
            logger.error("faucet stream %s did not close in %.0fs; its lease expires", name, timeout)
            handle.lock.release()
            continue  # the abandoned close may still use the store
        handle.lock.release()
        handle.store.close()
    if failures:
        raise failures[0]


def _close_at_exit() -> None:
    try:
        close_cached_streams(timeout=EXIT_CLOSE_SECONDS)
    except FaucetError:
        pass  # logged with its stream by close_cached_streams; at exit there is no caller to tell
    finally:
        if _background is not None:
            _background.close()
