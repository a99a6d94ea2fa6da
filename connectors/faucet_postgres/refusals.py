"""Rows PostgreSQL refuses inside an open transaction, found without losing the transaction.

The streaming sink applies a batch in the epoch's transaction, under a savepoint: when the server
refuses it for a row-level reason (SQLSTATE class 22, a value the column type refuses; class 23, a
constraint), only the savepoint is rolled back and the batch is bisected, under savepoints, down to
the refused rows (:func:`faucet_dagster.protocol.bisect_rejections`, as the bounded sink's
``write_batch_partial`` does). The other rows stay applied, in their order, in the same transaction:
they commit with the epoch or not at all.
"""

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg import sql

from faucet_dagster.protocol import RejectedRow, bisect_rejections
from faucet_postgres.common import is_row_error, row_error_reason

ApplySlice = Callable[[int, int], Awaitable[int]]
"""``apply(start, stop)`` applies rows ``start`` to ``stop`` (exclusive); returns the rows written."""


async def apply_finding_refusals(
    conn: "psycopg.AsyncConnection[Any]", count: int, apply: ApplySlice
) -> tuple[int, tuple[RejectedRow, ...]]:
    """Apply rows ``0`` to ``count`` through ``apply`` inside the open transaction of ``conn``; return
    what ``apply`` reported written and the refused rows (by index, ascending, with SQLSTATE and the
    server's message). One savepoint when nothing is refused; ``O(k log n)`` with ``k`` refused rows.
    Any other failure propagates (the transaction is then the caller's to abort)."""
    written = 0

    async def attempt(start: int, stop: int) -> str | None:
        nonlocal written
        try:
            async with savepoint(conn):
                done = await apply(start, stop)
        except psycopg.Error as exc:
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
    name = sql.Identifier(f"faucet_{uuid.uuid4().hex[:12]}")
    await conn.execute(sql.SQL("SAVEPOINT {}").format(name))
    try:
        yield
    except psycopg.Error:
        if not conn.broken and conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            await conn.execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(name))
        raise
    await conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(name))


__all__ = ["ApplySlice", "apply_finding_refusals", "savepoint"]
