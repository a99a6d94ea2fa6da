"""The commit side of a PostgreSQL streaming sink session, and what the session's steps share: the
epoch's commit in one round trip, a refused commit, and a commit whose answer was lost, resolved.

``commit_epoch`` checks the owner fence first (the stream's row in the epochs table: the commit fails
with :class:`OwnershipLost` if a higher fencing token claimed the stream, or if the row's commit id is
no longer the one the epoch's watermarks came with: another session committed since), then applies
the staged changes (APPLY_CHANGES, :mod:`faucet_postgres.stream_changes`), records the epoch and moves
the watermarks, all in the same transaction, then commits. Fence, watermarks and ``COMMIT`` go in one
pipeline, one round trip: the fence refuses by raising an error in its own statement, so the
``COMMIT`` behind it is never executed (APPLY_CHANGES with staged changes waits for the fence's answer
before it applies them). A COMMIT a deferred constraint refuses names no row: the constraint is checked
at each batch from the epoch's retried attempt on (:attr:`~faucet_postgres.stream_tables.Tables.located`).
A commit whose answer is lost (the connection dropped) is resolved: the old backend is made to exit
(``pg_terminate_backend``) so its transaction can no longer finish, and the epoch row is read back,
compared by a random commit id (stored with the transaction id, for the receipts). Unresolvable means
:class:`UncertainOutcome`.

:class:`CommittingSession` holds the session's state and the steps its commit needs;
:class:`faucet_postgres.stream_sink.PostgresStreamingSinkSession` adds opening, beginning, applying,
aborting and closing.
"""

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg import sql

from faucet_dagster.protocol import (
    ConnectionFailed,
    Coverage,
    EpochId,
    FaucetError,
    LifecycleError,
    Receipt,
    StreamingSinkSession,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
    active_epoch,
)
from faucet_postgres import stream_zombies
from faucet_postgres.common import error_text, pg_error
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_changes import ChangeApplier
from faucet_postgres.stream_fence import StreamRows, fenced_out, is_fence_refusal
from faucet_postgres.stream_state import Committed, Epoch
from faucet_postgres.stream_tables import Tables
from faucet_postgres.stream_zombies import Backend, ensure_exited

Connection = psycopg.AsyncConnection[Any]


def _answered(exc: psycopg.Error, conn: Connection) -> bool:
    """Whether the server's answer to a commit shows that nothing of it took effect: an error answered
    on a live connection (the statement and everything after it, the COMMIT included, did not run),
    or the end of a transaction that sat idle too long (the server ended it before reading more)."""
    return bool(exc.sqlstate) and (
        not conn.broken or exc.sqlstate == stream_zombies.IDLE_IN_TRANSACTION_TIMEOUT
    )


def _first(row: tuple[Any, ...] | None) -> str:
    assert row is not None  # an aggregate returns one row
    return str(row[0])


class CommittingSession(StreamingSinkSession):
    """A streaming sink session's state and its commit (see the module docstring). Calls are
    serialized by the runner."""

    _config: PostgresStreamingSinkConfig
    _connection: Callable[..., Awaitable[Connection]]
    """Opens a new connection of the sink (``autocommit=...``)."""
    _conn: Connection | None
    _stream: str
    _policy: WritePolicy
    _worker: WorkerIdentity
    _where: str
    _database: str
    _rows: StreamRows | None
    """The stream's fence, epoch and watermark rows (named once the session is prepared)."""
    _backend: Backend | None
    _tables: Tables
    _changes: ChangeApplier
    _used: float
    """When the session's last call (begin or apply) ended."""
    _preparing: asyncio.Future[None] | None
    """The first savepoint of the active epoch, created while the source reads (:meth:`_prepared`)."""
    _committed: Committed | None
    """The committed state as of this session's last commit (None: read at the next begin)."""
    _active: Epoch | None
    _uncertain: Epoch | None
    _pending_commit: str | None
    _closed: bool

    async def _read_state(self, conn: Connection, *, doing: str) -> Committed:
        try:
            return await self._stream_rows().read(conn)
        except psycopg.Error as exc:
            raise pg_error(exc, where=self._where, doing=doing) from exc

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        """Fence check, epoch row, watermarks and rows in one transaction, committed in the same round
        trip (APPLY_CHANGES with staged changes: the fence first, then the changes, then the rest);
        see the module docstring."""
        state = self._active_epoch(epoch, "commit")
        if state.failed:
            raise LifecycleError(f"epoch {epoch} failed; abort it", where=self._where)
        conn = self._live()
        try:
            await self._prepared()
        except psycopg.Error as exc:
            state.failed = True
            raise await self._failure(exc, where=self._where, doing=f"committing epoch {epoch}") from exc
        commit_id = uuid.uuid4().hex
        marks = state.next_watermarks(coverage)
        # Until this commit is known to have taken effect, the next epoch reads the state again.
        self._committed = None
        fence = self._stream_rows().fence(epoch, commit_id, state.begun)
        fenced: str | None = None
        if state.changes or self._idle_long():
            # The fence on its own first. APPLY_CHANGES: after the fence, a zombie's epoch is refused
            # as fenced, never judged against rows its successor already applied (which would look
            # like divergence). An epoch idle long enough for the server to have ended its session:
            # the server's reason is read as the answer to one statement (a pipeline loses it).
            try:
                alone = await conn.execute(*fence)
                fenced = _first(await alone.fetchone())
                await self._changes.apply_all(conn, state)
            except psycopg.Error as exc:
                state.failed = True
                raise await self._commit_refused(exc, epoch) from exc
        self._pending_commit = commit_id
        refused: psycopg.Error | None = None
        try:
            try:
                async with conn.pipeline():
                    cursor = None if fenced is not None else await conn.execute(*fence)
                    if marks:
                        # Not closed before the pipeline's sync, which hands it its (empty) results.
                        many = conn.cursor()
                        await many.executemany(*self._stream_rows().watermarks(epoch, marks))
                    # The COMMIT syncs the pipeline: one round trip. A statement refused before it
                    # leaves it unexecuted (the transaction in error). Raised after the block.
                    try:
                        await conn.commit()
                    except psycopg.Error as exc:
                        if not _answered(exc, conn):
                            raise
                        refused = exc
            except psycopg.errors.PipelineAborted:
                # The answers to the statements the refused one left unexecuted came after its own
                # (separate reads, on a loaded machine): the block's exit reports them. The refusal
                # is the answer.
                if refused is None:
                    raise
            if refused is not None:
                raise refused
            if cursor is not None:
                fenced = _first(await cursor.fetchone())
        except BaseException as exc:
            if isinstance(exc, psycopg.Error) and _answered(exc, conn):
                # The server answered: a statement was refused (the fence, a deferred constraint, a
                # serialization failure) and the transaction rolled back or is in error, or the
                # server had ended the idle transaction before any of it ran. Nothing of the epoch
                # remains.
                self._pending_commit = None
                state.failed = True
                raise await self._commit_refused(exc, epoch) from exc
            # No answer (connection lost, or the caller gave up waiting): the epoch may have committed.
            self._uncertain = state
            if not isinstance(exc, psycopg.Error):
                raise
            committed = await self._resolve(cause=exc)
            if committed is None:
                state.failed = True
                raise ConnectionFailed(
                    f"the connection was lost during the commit of epoch {epoch}, which did not take "
                    "effect (read back after its server process exited)",
                    where=self._where,
                ) from exc
            fenced = committed
        assert fenced is not None
        self._pending_commit = None
        self._active = None
        self._committed = state.begun.after(epoch, marks, fenced)
        return self._receipts(state, transaction=fenced.partition(":")[2])

    async def _commit_refused(self, exc: psycopg.Error, epoch: EpochId) -> FaucetError:
        """The error for a commit the server refused (the epoch is failed; its transaction is rolled
        back here): OwnershipLost when it was the fence, naming the token that holds the stream.

        A deferred constraint refusing the COMMIT (SQLSTATE class 23) names no row: it is checked at
        each batch from the epoch's next attempt on (:attr:`Tables.located`), where the rows it
        refuses are found by bisection, then routed to the dead-letter route or named."""
        if not is_fence_refusal(exc):
            constraint = getattr(exc.diag, "constraint_name", None)
            deferred = (exc.sqlstate or "").startswith("23") and self._policy is not WritePolicy.APPLY_CHANGES
            if deferred and constraint:
                schema = getattr(exc.diag, "schema_name", None) or self._tables.schema
                name = sql.Identifier(schema, constraint).as_string()
                if name not in self._tables.located:
                    self._tables.located.add(name)
                    await self._rollback_quietly()
                    return FaucetError(
                        f"committing epoch {epoch} failed: {error_text(exc)}; constraint {constraint} is "
                        "deferred to COMMIT, which names no row: the epoch is to be aborted and retried, "
                        "checking it at each batch, where the rows it refuses are found (routed to the "
                        "dead-letter route, or named)",
                        where=self._where,
                        retryable=True,
                    )
            return await self._failure(exc, where=self._where, doing=f"committing epoch {epoch}")
        await self._rollback_quietly()
        holder: int | None = None
        conn = self._conn
        if conn is not None and not conn.broken and not conn.closed:
            try:
                holder = await self._stream_rows().holder(conn)
                await conn.rollback()
            except psycopg.Error:
                await self._rollback_quietly()
        return fenced_out(epoch, holder, self._where)

    def _check_usable(self) -> None:
        if self._closed:
            raise LifecycleError("the session is closed", where=self._where)
        if self._uncertain is not None:
            raise UncertainOutcome(
                f"the commit of epoch {self._uncertain.epoch} has an unknown outcome", where=self._where
            )

    def _active_epoch(self, epoch: EpochId, doing: str) -> Epoch:
        self._check_usable()
        return active_epoch(self._active, epoch, doing, self._where)

    async def _prepared(self, *, quietly: bool = False) -> None:
        """Wait for the savepoint begin_epoch prepares (before any other statement of the epoch); its
        failure is raised (``quietly``: dropped, the epoch being rolled back anyway). Shielded: a
        caller cancelled meanwhile leaves it to finish, for the abort to wait for."""
        task = self._preparing
        if task is None:
            return
        if quietly:
            await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # retrieved, and dropped
            self._preparing = None
            return
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._preparing = None

    def _idle_long(self) -> bool:
        """Whether the connection sat idle, since the session's last call, for half the server's
        ``idle_in_transaction_session_timeout`` or more (0: no timeout)."""
        timeout = self._config.idle_in_transaction_session_timeout
        return timeout > 0 and time.monotonic() - self._used >= timeout / 2

    def _stream_rows(self) -> StreamRows:
        if self._rows is None:
            raise LifecycleError("the session was not prepared", where=self._where)
        return self._rows

    def _live(self) -> Connection:
        if self._conn is None:
            raise LifecycleError("the session is closed", where=self._where)
        return self._conn

    async def _failure(self, exc: psycopg.Error, *, where: str, doing: str) -> FaucetError:
        """:func:`stream_zombies.failure` of this session (lock waits, idle transactions ended)."""
        return await stream_zombies.failure(
            exc, self._config, self._connection, self._conn, where=where, doing=doing
        )

    async def _rollback_quietly(self) -> None:
        """Roll back; a broken connection needs none (the server rolls back when it ends).

        Tables created in the rolled back transaction are gone: the table cache is dropped with it.
        """
        self._tables.forget()
        conn = self._conn
        if conn is None or conn.broken or conn.closed:
            return
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE:
            # An apply cancelled while its COPY was starting (a tick's deadline) leaves the connection
            # in COPY IN mode: no ROLLBACK can be sent on it ("another command is already in
            # progress"). Ending the connection ends the transaction on the server; the next epoch
            # reconnects.
            await conn.close()
            return
        try:
            await conn.rollback()
        except psycopg.Error as exc:
            if not conn.broken:
                raise pg_error(exc, where=self._where, doing="rolling back") from exc

    def _receipts(self, state: Epoch, *, transaction: str) -> tuple[Receipt, ...]:
        receipts = []
        for resource, tally in sorted(state.tallies.items()):
            details = {
                "database": self._database,
                "table": tally.table,
                "policy": self._policy.value,
                "transaction_id": transaction,
            }
            if tally.first is not None and tally.last is not None:
                details |= {"first_position": tally.first, "last_position": tally.last}
            pending = state.changes.get(self._config.table_for(resource))
            if pending is not None:
                details |= pending.counts.details()
            receipts.append(Receipt(resource, tally.written, tally.skipped, details))
        return tuple(receipts)

    async def _resolve(self, *, cause: BaseException | None) -> str | None:
        """Decide a commit whose answer was lost: wait for (or force) the exit of the server process
        that ran it, then read the epoch row back. Its stored commit id (``<id>:<transaction>``) when
        it committed, else None. Raises UncertainOutcome when that cannot be established."""
        state, commit_id = self._uncertain, self._pending_commit
        assert state is not None and commit_id is not None
        try:
            probe = await self._connection(autocommit=True)
            try:
                if self._backend is not None:
                    await ensure_exited(probe, self._backend, self._where)
                found = await self._read_state(probe, doing="reading back a commit")
            finally:
                await probe.close()
        except FaucetError as exc:
            raise UncertainOutcome(
                f"the commit of epoch {state.epoch} was sent and its outcome cannot be read back: "
                f"{exc.message}",
                where=self._where,
            ) from (cause or exc)
        self._uncertain = None
        self._pending_commit = None
        self._committed = None
        # The old connection is gone either way; the next epoch opens a new one.
        self._tables.forget()
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
        if found.commit_id is None or found.commit_id.partition(":")[0] != commit_id:
            return None
        return found.commit_id


__all__ = ["CommittingSession", "Connection"]
