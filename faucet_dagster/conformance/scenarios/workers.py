"""The battery's side of a worker process: start it, send it requests, kill it.

Worker processes are forked from a fork server that has already imported the protocol, the pipeline
and the client libraries (:data:`PRELOAD`), so starting one costs milliseconds; each is a fresh
process, with nothing of an earlier worker in memory. A request that does not come back because the
process died (a crash armed at an effect, or a kill) raises :class:`Crashed`; a request still running
after the subject's timeout is a hang (the process is killed and :class:`Hung` raised).
"""

import asyncio
import contextlib
import io
import multiprocessing
import multiprocessing.context
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

from faucet_dagster.conformance.scenarios.agent import AgentPlan, Handle, RemoteError, Reply, serve
from faucet_dagster.protocol import ConfigError

PRELOAD = ("faucet_dagster.conformance.scenarios.preload",)
"""What the fork server imports once, for every worker it forks (see :mod:`.preload`)."""

_context_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


def _fork_server() -> multiprocessing.context.ForkServerContext:
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(PRELOAD))
            _context = context
        return _context


class _Popen(popen_forkserver.Popen):
    """The fork server's launch, without the parent's main module.

    multiprocessing re-runs the parent's ``__main__`` in every child it starts this way (to find
    functions defined there); the battery's worker needs none of it, and a main module that is a
    script without an ``if __name__ == "__main__"`` guard (or the ``faucet`` command, which imports
    every subcommand) would run or load in every worker. This is CPython's ``_launch`` with the two
    main-module entries of the preparation data left out.
    """

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_name", None)
        prep_data.pop("init_main_from_path", None)
        buf = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        _parent_w = os.dup(w)
        close_fds = util.close_fds  # type: ignore[attr-defined]
        self.finalizer = util.Finalize(self, close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)


class Crashed(Exception):
    """The worker died before it answered (a crash armed at an effect, or killed)."""

    def __init__(self, effects: int | None = None) -> None:
        super().__init__("the worker process died")
        self.effects = effects


class Hung(Exception):
    """The worker did not answer within the timeout: the call hangs (the worker was killed)."""


class Failed(Exception):
    """A call raised in the worker: :attr:`error` describes the exception."""

    def __init__(self, error: RemoteError, effects: tuple[str, ...] = ()) -> None:
        super().__init__(str(error))
        self.error = error
        self.effects = effects


class Worker:
    """One worker process running one connector role; requests are answered one at a time."""

    def __init__(self, plan: AgentPlan, *, timeout: float, name: str = "worker") -> None:
        context = _fork_server()
        self.plan = plan
        self.name = name
        self.timeout = timeout
        self.effects: tuple[str, ...] = ()
        """The effects the last request made (a crashable worker only)."""
        self._conn, child = context.Pipe()
        self.process = _Process(target=serve, args=(child, plan), daemon=True, name=name)
        try:
            self.process.start()
        except Exception as exc:  # pickling the plan: a spec whose factory is not importable
            raise ConfigError(
                f"the connector spec cannot be sent to a worker process ({type(exc).__name__}: {exc}); "
                "make its factories module-level classes or functions",
                where="faucet conformance",
            ) from exc
        finally:
            child.close()
        self._lock = asyncio.Lock()
        self._started = False

    async def start(self) -> None:
        """Wait until the worker built nothing yet but is ready (its imports done)."""
        if self._started:
            return
        reply = await self._receive()
        self._started = True
        if reply.error is not None:
            raise Failed(reply.error)

    async def request(self, operation: str, *args: Any, crash_at: int | None = None) -> Any:
        """Run ``operation`` in the worker; its value, or :class:`Failed`, :class:`Crashed`, :class:`Hung`."""
        await self.start()
        async with self._lock:
            try:
                self._conn.send((operation, args, crash_at))
            except (OSError, EOFError):
                raise Crashed() from None
            reply = await self._receive()
        self.effects = reply.effects
        if reply.error is not None:
            raise Failed(reply.error, reply.effects)
        return reply.value

    async def build(self, config: Mapping[str, Any]) -> Handle:
        handle = await self.request("build", dict(config))
        assert isinstance(handle, Handle)
        return handle

    async def call(
        self, handle: Handle, method: str, *args: Any, crash_at: int | None = None, **kwargs: Any
    ) -> Any:
        return await self.request("call", handle, method, args, kwargs, crash_at=crash_at)

    async def _receive(self) -> Reply:
        conn = self._conn
        timeout = self.timeout

        def wait() -> Reply | None:
            try:
                if not conn.poll(timeout):
                    return None
                reply = conn.recv()
            except (EOFError, OSError):
                raise Crashed() from None
            assert isinstance(reply, Reply)
            return reply

        reply = await asyncio.to_thread(wait)
        if reply is None:
            self.kill()
            raise Hung(f"{self.name} did not answer within {timeout:g}s")
        return reply

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL the worker (a crash: nothing of it runs after this), and wait for it to end."""
        pid = self.process.pid
        if pid is not None and self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.join(30)
        self._conn.close()

    async def stop(self) -> None:
        """End the worker when the battery is done with it (its connectors are not closed: the
        scenario closed what it meant to close; anything else ends with the process)."""
        await asyncio.to_thread(self.kill)


async def stop_all(workers: Sequence[Worker]) -> None:
    for worker in workers:
        await worker.stop()


__all__ = ["Crashed", "Failed", "Hung", "Worker", "stop_all"]
