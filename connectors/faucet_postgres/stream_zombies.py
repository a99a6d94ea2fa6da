"""Zombies and locks of the PostgreSQL streaming sink (:mod:`faucet_postgres.stream_sink`): what a
lock wait, an idle transaction the server ended or a concurrent table creation means for the epoch,
and the exit of the server process behind a commit whose answer was lost.

Zombies and locks. An epoch's open transaction holds locks until it ends: a table it created (and
the catalog entries of its name), a column it added, rows of the keys it upserted, the epochs row once
its commit began. A previous owner frozen with its epoch open (a stopped VM, a long pause) keeps them,
and its successor would wait for them for as long as the frozen connection lives. Every connection
of the sink therefore sets two server timeouts for its session
(:meth:`~faucet_postgres.stream_sink.PostgresStreamingSink.connection`):

* ``lock_timeout``: a statement that waited that long for a lock fails; the sink raises a retryable
  FaucetError saying so, listing the other transactions of the database open at least that long
  (process ids, states and ages: the holder is among them). The runner aborts the epoch as for any
  failure before the commit; the next epoch (the next tick) tries again;
* ``idle_in_transaction_session_timeout``: the server ends a connection whose transaction sat idle
  that long, rolling the epoch back and freeing its locks. Kept at or below the stream's lease, a
  frozen owner's transaction ends about when its lease expires. When it wakes up, its next statement
  fails (ConnectionFailed, retryable: nothing of the epoch remains, the runner aborts it; the lease it
  lost then stops it with OwnershipLost); a COMMIT whose connection was ended is resolved as not
  committed by the commit id read-back.

Tables are created inside the epoch's transaction, so an aborted epoch leaves no empty table behind;
a successor waiting on such a creation is bounded by the same two timeouts.

A commit whose answer is lost is judged only after the server process that ran it exited
(:func:`ensure_exited` terminates it if it still runs): its transaction then either committed before
or rolls back, never later.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from faucet_dagster.protocol import ConnectionFailed, FaucetError, UncertainOutcome
from faucet_postgres.common import error_text, pg_error
from faucet_postgres.config import PostgresStreamingSinkConfig

Connection = psycopg.AsyncConnection[Any]
OpenConnection = Callable[..., Awaitable[Connection]]
"""``open(autocommit=...)``: a new connection of the sink, with its session timeouts set."""

_BACKEND_EXIT_WAIT = 10.0
_UNIQUE_VIOLATION = "23505"
_CATALOG_NAME_INDEXES = ("pg_type_typname_nsp_index", "pg_class_relname_nsp_index")
"""The catalog's unique names: a concurrent creation of one table collides on one of them."""
_LOCK_NOT_AVAILABLE = "55P03"
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
"""SQLSTATE of a session the server ended for sitting idle in its transaction (before reading more)."""


async def failure(
    exc: psycopg.Error,
    config: PostgresStreamingSinkConfig,
    open_connection: OpenConnection,
    current: Connection | None,
    *,
    where: str,
    doing: str,
) -> FaucetError:
    """:func:`pg_error`, saying what a lock wait that timed out or a transaction the server ended
    for idling means here (both retryable: the runner aborts the epoch, the next one retries).
    ``current`` is the session's connection (left out of the transactions listed)."""
    error = pg_error(exc, where=where, doing=doing)
    if exc.sqlstate == _LOCK_NOT_AVAILABLE:
        seconds = config.lock_timeout
        return FaucetError(
            f"{doing} waited {seconds:g} s (lock_timeout) for a lock held by another transaction: "
            f"another worker's open epoch? {await _old_transactions(open_connection, current, seconds)}; "
            "the epoch is to be aborted and retried (nothing of it was kept)",
            where=where,
            retryable=True,
        )
    if exc.sqlstate == _UNIQUE_VIOLATION and exc.diag.constraint_name in _CATALOG_NAME_INDEXES:
        # Two epochs (the workers of one stream's partition groups) created one table at once: the
        # loser's CREATE TABLE IF NOT EXISTS collides in the catalog; the table exists when retried.
        return FaucetError(
            f"{doing} failed: another transaction created the same table or type at the same "
            "moment (the workers of one stream's partition groups); the epoch is to be aborted and "
            "retried (nothing of it was kept)",
            where=where,
            retryable=True,
        )
    if exc.sqlstate == IDLE_IN_TRANSACTION_TIMEOUT:
        idle = config.idle_in_transaction_session_timeout
        return ConnectionFailed(
            f"{error.message}: the epoch's transaction sat idle longer than "
            f"idle_in_transaction_session_timeout ({idle:g} s), "
            "so the server ended it and nothing of the epoch remains (a paused worker, or read limits "
            "longer than the timeout)",
            where=where,
        )
    return error


async def _old_transactions(
    open_connection: OpenConnection, current: Connection | None, seconds: float
) -> str:
    """The other sessions of this database whose transaction began at least ``seconds`` ago (the
    lock holders are among them), as ``pid (state, age)``; read on a separate connection. Only
    process ids, states and ages: never query text."""
    ours = current.info.backend_pid if current is not None else 0
    try:
        probe = await open_connection(autocommit=True)
        try:
            cursor = await probe.execute(
                "SELECT pid, state, extract(epoch FROM now() - xact_start)::float8 "
                "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND pid <> %s AND xact_start <= now() - make_interval(secs => %s) "
                "ORDER BY xact_start LIMIT 5",
                (ours, seconds),
            )
            found = await cursor.fetchall()
        finally:
            await probe.close()
    except (psycopg.Error, FaucetError) as exc:
        text = exc.message if isinstance(exc, FaucetError) else error_text(exc)
        return f"(the open transactions could not be listed: {text})"
    if not found:
        return "(no other transaction of this database is that old now: it ended since)"
    listed = ", ".join(f"pid {pid} ({state or 'state hidden'}, {age:.0f} s)" for pid, state, age in found)
    return f"(transactions open at least that long: {listed})"


@dataclass(frozen=True)
class Backend:
    """The server process behind a connection: what must have exited before a lost commit is judged."""

    pid: int
    started: Any


async def backend_of(conn: Connection, where: str) -> Backend:
    """The server process of ``conn`` (read, then the read's transaction rolled back)."""
    try:
        cursor = await conn.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        )
        row = await cursor.fetchone()
        await conn.rollback()
    except psycopg.Error as exc:
        raise pg_error(exc, where=where, doing="identifying the server process") from exc
    if row is None:
        raise ConnectionFailed("the server does not list this connection's process", where=where)
    return Backend(int(row[0]), row[1])


async def ensure_exited(probe: Connection, backend: Backend, where: str) -> None:
    """Return once the server process ``backend`` has exited, terminating it if it still runs (its
    transaction then either committed before or rolls back, never later). UncertainOutcome if it
    does not exit in time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _BACKEND_EXIT_WAIT
    query = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s AND backend_start = %s"
    try:
        while True:
            cursor = await probe.execute(query, (backend.pid, backend.started))
            if await cursor.fetchone() is None:
                return
            if loop.time() >= deadline:
                raise UncertainOutcome(
                    f"server process {backend.pid} that ran the commit does not exit", where=where
                )
            await asyncio.sleep(0.05)
    except psycopg.Error as exc:
        raise pg_error(exc, where=where, doing="waiting for the old server process to exit") from exc
