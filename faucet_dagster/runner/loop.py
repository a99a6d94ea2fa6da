"""A long-lived event loop on a daemon thread, for sessions that outlive one synchronous call.

``run_sync`` (:mod:`.sync`) gives each call a fresh loop and closes it, which suits a bounded sync. A
continuous stream keeps its source and sink sessions open between sensor ticks, and their network
clients belong to the loop they were opened on; :class:`BackgroundLoop` keeps that loop running on
its own thread so ticks on any thread can submit coroutines to it.
"""

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An event loop running forever on a daemon thread until :meth:`close`."""

    def __init__(self, name: str = "faucet-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], *, timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block the calling thread until it finishes (result or raise).

        With ``timeout``, raises :class:`TimeoutError` after that many seconds and cancels ``coro``.
        Must not be called from the loop's own thread (it would wait for itself).
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BackgroundLoop.run was called from its own loop thread")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the loop, join its thread and close it. Coroutines still running are abandoned."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
