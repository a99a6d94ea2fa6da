"""Rows PostgreSQL refuses inside an open transaction, found without losing the transaction.

The streaming sink applies a batch in the epoch's transaction, under a savepoint: when the server
refuses it for a row-level reason (SQLSTATE class 22, a value the column type refuses; class 23, a
constraint), only the savepoint is rolled back and the batch is bisected, under savepoints, down to
the refused rows (:func:`faucet_dagster.protocol.bisect_rejections`, as the bounded sink's
``write_batch_partial`` does). The other rows stay applied, in their order, in the same transaction:
they commit with the epoch or not at all.

A session that applies many batches in one transaction passes :class:`Savepoints`: a savepoint whose
block succeeded is released with the next savepoint's creation, in one round trip, and the first one of
a transaction is sent with its ``BEGIN``, so a batch costs no savepoint round trip of its own; the
first can also be prepared ahead, while the session waits for its rows (:meth:`Savepoints.prepare`).
"""

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import psycopg
from psycopg import sql

from faucet_dagster.protocol import DataError, RejectedRow, bisect_rejections
from faucet_postgres.common import is_row_error, row_error_reason

ApplySlice = Callable[[int, int], Awaitable[int]]
"""``apply(start, stop)`` applies rows ``start`` to ``stop`` (exclusive); returns the rows written."""


async def apply_finding_refusals(
    conn: "psycopg.AsyncConnection[Any]",
    count: int,
    apply: ApplySlice,
    *,
    savepoints: "Savepoints | None" = None,
) -> tuple[int, tuple[RejectedRow, ...]]:
    """Apply rows ``0`` to ``count`` through ``apply`` inside the open transaction of ``conn`` (or the
    one it begins); return what ``apply`` reported written and the refused rows (by index, ascending,
    with SQLSTATE and the server's message). One savepoint when nothing is refused; ``O(k log n)`` with
    ``k`` refused rows. Any other failure propagates (the transaction is then the caller's to abort).
    ``savepoints``: the transaction's :class:`Savepoints` (releases deferred); else each savepoint is
    released when its block ends (:func:`savepoint`)."""
    written = 0

    def enter() -> "AbstractAsyncContextManager[None]":
        return savepoint(conn) if savepoints is None else savepoints.savepoint(conn)

    async def attempt(start: int, stop: int) -> str | None:
        nonlocal written
        try:
            async with enter():
                done = await apply(start, stop)
        except (psycopg.Error, DataError) as exc:
            if is_row_error(exc):
                return row_error_reason(exc)
            raise
        written += done
        return None

    result = await bisect_rejections(count, attempt)
    return written, result.rejected


@asynccontextmanager
async def savepoint(conn: "psycopg.AsyncConnection[Any]") -> AsyncIterator[None]:
    """A savepoint in the open transaction of ``conn``: released when the block ends, rolled back to
    when it raises a server error. Not on cancellation: a COPY cut short leaves the connection busy
    (no statement can be sent), and the caller aborts the whole transaction anyway."""
    name = _new_name()
    await conn.execute(sql.SQL("SAVEPOINT {}").format(name))
    async with _rolled_back_on_error(conn, name):
        yield
    await conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(name))


@asynccontextmanager
async def _rolled_back_on_error(
    conn: "psycopg.AsyncConnection[Any]", name: sql.Identifier
) -> AsyncIterator[None]:
    """Roll the open transaction of ``conn`` back to savepoint ``name`` when the block raises a
    server error that left the transaction failed (not when the connection broke), and re-raise."""
    try:
        yield
    except psycopg.Error:
        if not conn.broken and conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            await conn.execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(name))
        raise


class Savepoints:
    """The savepoints of one connection's transactions, their releases deferred.

    :meth:`savepoint` is :func:`savepoint` without a round trip of its own for the release: a block
    that succeeded leaves its savepoint in place, and the next savepoint of the same transaction
    releases it in the statement that creates the new one (``RELEASE a; SAVEPOINT b``, one round
    trip). A savepoint left in place changes nothing: no one rolls back to it, the statements after
    it are part of the transaction as before, and the transaction's end ends it (a commit commits
    it). The first savepoint of a transaction is sent in one pipeline with the ``BEGIN`` psycopg
    sends for it. Not shared between connections; the transaction's end is seen from the
    connection's status (idle: nothing left to release).
    """

    def __init__(self) -> None:
        self._pending: sql.Identifier | None = None
        self._ready: sql.Identifier | None = None

    def forget(self) -> None:
        """The transaction ended (committed or rolled back): nothing is left to release."""
        self._pending = self._ready = None

    async def prepare(self, conn: "psycopg.AsyncConnection[Any]") -> None:
        """Create the next savepoint now (with the transaction's ``BEGIN`` if none is open: one round
        trip), so that :meth:`savepoint` uses it without a round trip, unless :meth:`spoil` was called
        since. A session calls it while it waits for something else (the source's read)."""
        name = _new_name()
        async with conn.pipeline():
            await conn.execute(sql.SQL("SAVEPOINT {}").format(name))
        self._ready = name

    def spoil(self) -> None:
        """Statements are about to run outside any savepoint of :meth:`savepoint`: a prepared one can
        no longer be rolled back to without undoing them, so it is left for the next one to release."""
        if self._ready is not None:
            self._pending, self._ready = self._ready, None

    @asynccontextmanager
    async def savepoint(self, conn: "psycopg.AsyncConnection[Any]") -> AsyncIterator[None]:
        """A savepoint in the transaction of ``conn`` (begun if none is open): rolled back to when
        the block raises a server error, left for the next savepoint to release when it succeeds."""
        status = conn.info.transaction_status
        ready, self._ready = self._ready, None
        if ready is not None and status == psycopg.pq.TransactionStatus.INTRANS:
            async with _rolled_back_on_error(conn, ready):
                yield
            self._pending = ready
            return
        name = _new_name()
        create = sql.SQL("SAVEPOINT {}").format(name)
        pending, self._pending = self._pending, None
        if status == psycopg.pq.TransactionStatus.IDLE:
            async with conn.pipeline():  # with psycopg's BEGIN: one round trip
                await conn.execute(create)
        elif pending is not None:
            await conn.execute(sql.SQL("RELEASE SAVEPOINT {}; {}").format(pending, create))
        else:
            await conn.execute(create)
        async with _rolled_back_on_error(conn, name):
            yield
        self._pending = name


def _new_name() -> sql.Identifier:
    return sql.Identifier(f"faucet_{uuid.uuid4().hex[:12]}")


__all__ = ["ApplySlice", "Savepoints", "apply_finding_refusals", "savepoint"]
