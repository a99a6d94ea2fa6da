"""Crash points between synchronous calls: the calls that reach outside a worker process, counted.

A crash that falls only where a coroutine waits never splits two commits made inside one
synchronous call (a client library's blocking method run in a thread, one SQLite transaction after
another). So a worker process counts its *effects*: every call into a client library that can change
something outside the process (a statement executed, a commit, a COPY chunk, a message published, an
offset committed, a file renamed). A crash armed at effect ``k`` kills the process (SIGKILL, no
cleanup, as a machine losing power) right before the ``k``-th such call since it was armed, whichever
thread makes it.

The calls are seen through :func:`sys.setprofile` in every thread: a Python function's first entry
(a coroutine resumed after an await is not a new call) and a C function's call. They are named
``module:qualified name``; :data:`EFFECTS` names those of the client libraries faucet's connectors
use, and a connector using another library adds its own (``ConformanceOptions.effects``). The count
does not depend on the machine's speed: it counts calls, never time, and calls that depend on time
(keep-alives, heartbeats, polling) are not effects.
"""

import opcode
import os
import signal
import sys
import threading
import types
from collections.abc import Iterable
from typing import Any

EFFECTS: frozenset[str] = frozenset(
    {
        # SQLite (the sqlite3 module's C methods; SQLAlchemy's pysqlite dialect calls these)
        *(
            f"sqlite3:{kind}.{method}"
            for kind in ("Connection", "Cursor")
            for method in ("execute", "executemany", "executescript")
        ),
        "sqlite3:Connection.commit",
        # psycopg 3 (a statement executed, a commit, a COPY chunk and its end)
        "psycopg.cursor:Cursor.execute",
        "psycopg.cursor:Cursor.executemany",
        "psycopg.cursor_async:AsyncCursor.execute",
        "psycopg.cursor_async:AsyncCursor.executemany",
        "psycopg.connection:Connection.commit",
        "psycopg.connection_async:AsyncConnection.commit",
        *(f"psycopg._copy:Copy.{method}" for method in ("write", "write_row", "finish")),
        *(f"psycopg._copy_async:AsyncCopy.{method}" for method in ("write", "write_row", "finish")),
        # nats-py (a message published, a key written, a delivery settled; never a keep-alive)
        "nats.aio.client:Client.publish",
        "nats.js.client:JetStreamContext.publish",
        *(f"nats.js.kv:KeyValue.{method}" for method in ("put", "create", "update", "delete", "purge")),
        *(f"nats.aio.msg:Msg.{method}" for method in ("ack", "ack_sync", "nak", "term")),
        # confluent-kafka (a record produced, an offset committed, a transaction ended)
        "cimpl:Producer.produce",
        "cimpl:Producer.commit_transaction",
        "cimpl:Producer.send_offsets_to_transaction",
        "cimpl:Consumer.commit",
        "cimpl:Consumer.store_offsets",
        # the file system (a file moved into place or removed)
        *(f"posix:{call}" for call in ("replace", "rename", "unlink", "remove", "ftruncate")),
    }
)
"""The effects of the client libraries faucet's connectors use, as ``module:qualified name``."""

_RESUME = opcode.opmap.get("RESUME")


def _first_entry(frame: types.FrameType) -> bool:
    """Whether a profile ``call`` event is a function's first entry, not a coroutine or generator
    resumed (CPython 3.11+: the RESUME at the frame's position has oparg 0 only at the start)."""
    if _RESUME is None:
        return True
    code, at = frame.f_code.co_code, frame.f_lasti
    return not (0 <= at < len(code) - 1 and code[at] == _RESUME and code[at + 1] != 0)


def _c_name(function: Any) -> str:
    owner = getattr(function, "__objclass__", None)
    if owner is None:
        bound = getattr(function, "__self__", None)
        owner = type(bound) if bound is not None and not isinstance(bound, types.ModuleType) else None
    module = getattr(owner, "__module__", None) or getattr(function, "__module__", None) or ""
    return f"{module}:{getattr(function, '__qualname__', '')}"


class EffectCounter:
    """Counts effects while armed; kills the process at the armed one. Install it in a fresh worker
    process only (:meth:`install`): it profiles every call of every thread."""

    def __init__(self, effects: Iterable[str]) -> None:
        self.effects = frozenset(effects)
        self.armed = False
        self.crash_at: int | None = None
        self.seen: list[str] = []
        self._lock = threading.Lock()

    def install(self) -> None:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def arm(self, crash_at: int | None) -> None:
        """Count from zero; with ``crash_at``, die right before effect number ``crash_at``."""
        with self._lock:
            self.seen = []
            self.crash_at = crash_at
            self.armed = True

    def disarm(self) -> tuple[str, ...]:
        """Stop counting; the effects seen since :meth:`arm`, in order."""
        with self._lock:
            self.armed = False
            self.crash_at = None
            return tuple(self.seen)

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if not self.armed:
            return
        if event == "call":
            if not _first_entry(frame):
                return
            name = f"{frame.f_globals.get('__name__', '')}:{frame.f_code.co_qualname}"
        elif event == "c_call":
            name = _c_name(arg)
        else:
            return
        if name in self.effects:
            self._effect(name)

    def _effect(self, name: str) -> None:
        with self._lock:
            if not self.armed:
                return
            index = len(self.seen)
            self.seen.append(name)
            crash = self.crash_at is not None and index >= self.crash_at
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["EFFECTS", "EffectCounter"]
