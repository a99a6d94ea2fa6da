"""The PostgreSQL streaming sink: one transaction per epoch, with its watermark and owner fence inside.

Epoch lifecycle on one connection (psycopg 3, asyncio):

* ``begin_epoch`` takes the stream's per-domain watermarks as the session's last commit left them
  (:class:`~faucet_postgres.stream_state.Committed`); the first epoch of a session (and the first
  after a failed or uncertain commit) reads them, starting the transaction. Otherwise the
  transaction begins with the epoch's first statement;
* ``apply`` drops the rows at or below their domain's watermark (a replay), then COPYs the rest into
  the table (APPEND), or into a temporary staging table merged with ``INSERT ... ON CONFLICT``
  (UPSERT: the last row per key wins; VERSIONED_UPSERT: only a newer version replaces a row), or
  stages change rows (APPLY_CHANGES) in a temporary table per destination table;
* a batch is applied under a savepoint (the first prepared while the source reads, with the
  transaction's BEGIN; the next ones sent with the release of the previous one:
  :class:`~faucet_postgres.refusals.Savepoints`): rows the server refuses (SQLSTATE class 22 or 23)
  are found by bisection (:mod:`faucet_postgres.refusals`) and either reported (``apply_partial``:
  the pipeline dead-letters them, the others stay applied) or named in a DataError by their event
  identity (``apply``). APPLY_CHANGES judges the destination at commit: a refused change is found by bisection
  over the stage's keys and named by its position, key and constraint, never dead-lettered;
* ``commit_epoch`` checks the owner fence first (the stream's row in the epochs table: the commit
  fails with :class:`OwnershipLost` if a higher fencing token claimed the stream, or if the row's
  commit id is no longer the one the epoch's watermarks came with: another session committed
  since), then applies the staged changes (APPLY_CHANGES, :mod:`faucet_postgres.stream_changes`),
  records the epoch and moves the watermarks, all in the same transaction, then commits. Fence,
  watermarks and ``COMMIT`` go in one pipeline, one round trip: the fence refuses by raising an
  error in its own statement, so the ``COMMIT`` behind it is never executed (APPLY_CHANGES with
  staged changes waits for the fence's answer before it applies them). A commit whose answer is lost
  (the connection dropped) is resolved: the old backend is made to exit (``pg_terminate_backend``)
  so its transaction can no longer finish, and the epoch row is read back, compared by a random
  commit id (stored with the transaction id, for the receipts). Unresolvable means
  :class:`UncertainOutcome`;
* ``abort_epoch`` rolls back. Everything of an epoch is tentative until its commit: abort undoes all
  of it, and nothing of earlier committed epochs.

APPLY_CHANGES (staging by table, applied by key in commit order at the commit) is described with its
code, :mod:`faucet_postgres.stream_changes`; the tables APPEND, UPSERT and VERSIONED_UPSERT write, in
:mod:`faucet_postgres.stream_tables`; the stream's fence, epoch and watermark rows and the statements
on them, in :mod:`faucet_postgres.stream_fence`.

``open`` claims the fence (the epochs row's token becomes the worker's, unless a higher one holds it:
then OwnershipLost), so an older worker's commit fails from that moment on, checked by the database
atomically with its effects.

Zombies and locks (a previous owner frozen with its epoch open, the server timeouts every connection
sets, what a lock wait that timed out means) are described with their code,
:mod:`faucet_postgres.stream_zombies`.
"""

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
import pyarrow as pa

from faucet_dagster.protocol import (
    DEFAULT_POLICY_OPERATIONS,
    ConfigError,
    ConnectionFailed,
    Coverage,
    DataError,
    DestinationReader,
    Durability,
    EpochId,
    EpochMismatch,
    FaucetError,
    LifecycleError,
    OwnershipLost,
    PartialResult,
    Receipt,
    RejectedRow,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    StreamingSink,
    StreamingSinkSession,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
)
from faucet_postgres import changes, stream_zombies
from faucet_postgres.common import connect, current_schema, pg_error
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_changes import ChangeApplier
from faucet_postgres.stream_fence import StreamRows, fenced_out, is_fence_refusal
from faucet_postgres.stream_state import Committed, Epoch, Tally
from faucet_postgres.stream_tables import Tables, epoch_stamp, stamp_epoch
from faucet_postgres.stream_zombies import Backend, backend_of, ensure_exited

Connection = psycopg.AsyncConnection[Any]
Connect = Callable[..., Awaitable[Connection]]
"""How the sink opens connections: :func:`faucet_postgres.common.connect`'s signature."""

POLICIES = frozenset(
    {WritePolicy.APPEND, WritePolicy.UPSERT, WritePolicy.VERSIONED_UPSERT, WritePolicy.APPLY_CHANGES}
)


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


def _capabilities(config: PostgresStreamingSinkConfig) -> SinkCapabilities:
    return SinkCapabilities(
        # This object is the streaming role; the bounded sink declares its own policies.
        bounded_policies=frozenset(),
        continuous_policies=POLICIES,
        accepted_operations={
            **DEFAULT_POLICY_OPERATIONS,
            WritePolicy.APPLY_CHANGES: changes.APPLIED_OPERATIONS,
        },
        # APPLY_CHANGES takes each table's key from the change rows (faucet.key) when none is given.
        requires_key=frozenset({WritePolicy.UPSERT, WritePolicy.VERSIONED_UPSERT, WritePolicy.DELETE}),
        durability=Durability.TRANSACTIONAL,
        atomic_watermark=True,
        owner_fencing=True,
        schema_evolution=config.schema_evolution,
    )


class PostgresStreamingSink(StreamingSink):
    """The continuous PostgreSQL sink; see the module docstring. ``connect`` opens its connections
    (tests wrap it to inject a fault at an exact point)."""

    connector_name = "postgres"

    def __init__(self, config: PostgresStreamingSinkConfig, *, connect: Connect = connect) -> None:
        self.config = config
        self._connect = connect

    async def connection(self, *, autocommit: bool) -> Connection:
        """A new connection with the config's ``lock_timeout`` and
        ``idle_in_transaction_session_timeout`` set for its whole session. Raises ConnectionFailed
        (retryable) when the server cannot be reached."""
        settings = self.config.timeout_settings()
        return await self._connect(self.config, autocommit=autocommit, settings=settings)

    async def check(self) -> None:
        """Connect and authenticate (``faucet check``); the tables are created when a stream opens."""
        conn = await self.connection(autocommit=True)
        await conn.close()

    def capabilities(self) -> SinkCapabilities:
        return _capabilities(self.config)

    async def reader(self, stream: str, policy: WritePolicy, key: Sequence[str]) -> DestinationReader:
        """Read back what ``stream`` wrote, for ``faucet verify`` (:mod:`faucet_postgres.verification`)."""
        from faucet_postgres.verification import PostgresDestinationReader, ReadTarget

        return PostgresDestinationReader(ReadTarget.of_stream(self.config), stream, policy, key)

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> "PostgresStreamingSinkSession":
        """Connect, create the state tables if needed, and claim the stream's owner fence."""
        config = self.config
        where = f"{config.safe_url()} stream {stream}"
        if policy not in POLICIES:
            raise ConfigError(f"policy {policy.value} is not a continuous PostgreSQL policy", where=where)
        if policy.keyed and policy is not WritePolicy.APPLY_CHANGES and not key:
            raise ConfigError(f"policy {policy.value} needs a key", where=where)
        if policy is WritePolicy.VERSIONED_UPSERT and not config.version_column:
            raise ConfigError("policy versioned_upsert needs version_column in the sink config", where=where)
        conn = await self.connection(autocommit=False)
        try:
            session = PostgresStreamingSinkSession(self, conn, stream, policy, tuple(key), worker)
            await session.prepare()
        except BaseException:
            await conn.close()
            raise
        return session


class PostgresStreamingSinkSession(StreamingSinkSession):
    """One session of one stream on one connection. Calls are serialized by the runner."""

    def __init__(
        self,
        sink: PostgresStreamingSink,
        conn: Connection,
        stream: str,
        policy: WritePolicy,
        key: tuple[str, ...],
        worker: WorkerIdentity,
    ) -> None:
        self._config = sink.config
        self._connection = sink.connection
        self._conn: Connection | None = conn
        self._stream = stream
        self._policy = policy
        self._key = key
        self._worker = worker
        self._where = f"{sink.config.safe_url()} stream {stream}"
        self._database = conn.info.dbname  # for receipts: a table named fully, database.schema.table
        self._rows: StreamRows | None = None
        """The stream's fence, epoch and watermark rows (named once :meth:`prepare` knows the schema)."""
        self._backend: Backend | None = None
        self._tables = Tables(sink.config, policy, key, self._where)
        self._changes = ChangeApplier(key, self._where, self._tables, self._failure)
        self._used = time.monotonic()
        """When the session's last call (begin or apply) ended."""
        self._preparing: asyncio.Future[None] | None = None
        """The first savepoint of the active epoch, created while the source reads (:meth:`_prepared`)."""
        self._committed: Committed | None = None
        """The committed state as of this session's last commit (None: read at the next begin)."""
        self._active: Epoch | None = None
        self._uncertain: Epoch | None = None
        self._pending_commit: str | None = None
        self._closed = False

    # -- setup ------------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Create the state tables if missing and claim the owner fence with the worker's token."""
        conn = self._live()
        try:
            self._tables.schema = self._config.schema_name or await current_schema(conn)
            self._rows = StreamRows(
                self._stream,
                self._config.state_schema_name or self._tables.schema,
                self._config.epochs_table,
                self._config.watermarks_table,
            )
            claimed = await self._rows.create_and_claim(conn, self._worker.fencing_token)
        except psycopg.Error as exc:
            raise await self._failure(exc, where=self._where, doing="preparing the stream state") from exc
        if not claimed:
            raise OwnershipLost(
                f"a fencing token above {self._worker.fencing_token} holds the stream at the destination",
                where=self._where,
            )
        self._backend = await backend_of(conn, self._where)

    # -- reading state ----------------------------------------------------------------------------

    async def last_committed(self) -> SinkCommitState | None:
        """The last committed epoch and watermarks, read on a separate connection (committed data only)."""
        self._check_usable()
        probe = await self._connection(autocommit=True)
        try:
            return (await self._read_state(probe, doing="reading the last committed epoch")).state()
        finally:
            await probe.close()

    async def _read_state(self, conn: Connection, *, doing: str) -> Committed:
        try:
            return await self._stream_rows().read(conn)
        except psycopg.Error as exc:
            raise pg_error(exc, where=self._where, doing=doing) from exc

    # -- the epoch lifecycle ----------------------------------------------------------------------

    async def begin_epoch(self, epoch: EpochId) -> None:
        """Begin the epoch with the watermarks its replayed rows are judged by: the ones this session's
        last commit wrote, or, first (and after a failed or uncertain commit, or a new connection),
        read in the epoch's transaction, which is then open. Otherwise no statement is sent: the
        transaction begins with the epoch's first write (or its commit)."""
        self._check_usable()
        if self._active is not None:
            raise LifecycleError(f"epoch {self._active.epoch} is still active", where=self._where)
        if epoch.stream != self._stream or epoch.fencing_token != self._worker.fencing_token:
            raise EpochMismatch(
                f"epoch {epoch} is not for stream {self._stream} under fencing token "
                f"{self._worker.fencing_token}",
                where=self._where,
            )
        conn = await self._reconnect_if_broken()
        committed = self._committed
        if committed is None:
            try:
                committed = self._committed = await self._read_state(conn, doing=f"beginning epoch {epoch}")
            except FaucetError:
                await self._rollback_quietly()
                raise
        self._active = Epoch(epoch, committed)
        self._tables.new_transaction()
        if self._policy is not WritePolicy.APPLY_CHANGES:
            # The first batch's savepoint (and the transaction's BEGIN) while the source reads.
            self._preparing = asyncio.ensure_future(self._tables.prepare(conn))
        self._used = time.monotonic()

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        """Write ``batch``'s rows above their domain's watermark into its table (APPLY_CHANGES: into
        the table's stage), tentatively. A row the destination refuses fails the epoch with a
        DataError naming the row's event identity (source, resource, partition, position) and the
        server's reason (the constraint, the refused value's type)."""
        await self._apply(epoch, batch, partial=False)

    async def apply_partial(self, epoch: EpochId, batch: SinkBatch) -> PartialResult:
        """:meth:`apply`, leaving out the rows the destination refuses (SQLSTATE class 22 or 23),
        found by bisection under savepoints (:mod:`faucet_postgres.refusals`), and reporting them by
        index in ``batch``. APPLY_CHANGES refuses nothing row by row here (see the module docstring)."""
        return await self._apply(epoch, batch, partial=True)

    async def _apply(self, epoch: EpochId, batch: SinkBatch, *, partial: bool) -> PartialResult:
        try:
            return await self._apply_batch(epoch, batch, partial=partial)
        finally:
            self._used = time.monotonic()

    async def _apply_batch(self, epoch: EpochId, batch: SinkBatch, *, partial: bool) -> PartialResult:
        state = self._active_epoch(epoch, "apply")
        if batch.epoch != epoch:
            raise EpochMismatch(f"a batch of epoch {batch.epoch} was applied in {epoch}", where=self._where)
        if state.failed:
            raise LifecycleError(f"epoch {epoch} failed; abort it", where=self._where)
        records, identities, skipped, kept = state.above_watermark(batch, self._where)
        if self._config.epoch_column is not None and self._policy is not WritePolicy.APPLY_CHANGES:
            # Not change rows: in a table without a key, every column of a change is the row's identity.
            records = stamp_epoch(
                records, self._config.epoch_column, epoch_stamp(epoch.stream, epoch.sequence)
            )
        positions = identities.positions
        table = self._config.table_for(batch.resource)
        tally = state.tallies.setdefault(batch.resource, Tally(table))
        tally.skipped += skipped
        if records.num_rows == 0:
            return PartialResult(written=0)
        conn = self._live()
        refused: tuple[RejectedRow, ...] = ()
        try:
            await self._prepared()
            if self._policy is WritePolicy.APPLY_CHANGES:
                target, written = await self._changes.stage(
                    conn, state, table, batch.domain, records, identities
                )
            else:
                target = await self._tables.target(
                    conn, table, records.schema, self._key if self._policy.keyed else ()
                )
                written, refused = await self._tables.write_rows(conn, target, records)
        except BaseException as exc:
            # The transaction is unusable (or its state unknown, when cancelled): only abort remains.
            state.failed = True
            where = f"{self._where} table {table}"
            if isinstance(exc, psycopg.Error):
                raise await self._failure(exc, where=where, doing="applying a batch") from exc
            if isinstance(exc, pa.ArrowException):
                raise DataError(f"the batch cannot be encoded for COPY: {exc}", where=where) from exc
            raise
        if refused and not partial:
            state.failed = True
            more = f" ({len(refused) - 1} more row(s) of the batch refused)" if len(refused) > 1 else ""
            raise DataError(
                f"the destination refused the row: {refused[0].reason}{more}",
                where=f"{self._where} table {target.label} @ {identities.at(batch.domain, refused[0].index)}",
            )
        tally.table = target.label
        tally.written += written
        tally.first = tally.first or positions[0]
        tally.last = positions[-1]
        return PartialResult(
            written=records.num_rows - len(refused),
            rejected=tuple(
                RejectedRow(row.index if kept is None else kept[row.index], row.reason) for row in refused
            ),
        )

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
        back here): OwnershipLost when it was the fence, naming the token that holds the stream."""
        if not is_fence_refusal(exc):
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

    async def abort_epoch(self, epoch: EpochId) -> None:
        """Roll the epoch's transaction back: none of its rows, watermarks or epoch row remain."""
        self._active_epoch(epoch, "abort")
        self._active = None
        await self._prepared(quietly=True)
        await self._rollback_quietly()

    async def close_session(self) -> None:
        """Roll back an active epoch and disconnect.

        Raises :class:`UncertainOutcome` when a commit was sent and its outcome could not be
        resolved: its effects might still land. Without a sent commit nothing can land (PostgreSQL
        rolls back a transaction whose connection ends).
        """
        if self._closed:
            return
        try:
            await self._prepared(quietly=True)
            if self._uncertain is not None:
                await self._resolve(cause=None)
            await self._rollback_quietly()
        finally:
            self._closed = True
            self._active = None
            self._committed = None
            conn, self._conn = self._conn, None
            if conn is not None:
                await conn.close()

    # -- helpers ------------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise LifecycleError("the session is closed", where=self._where)
        if self._uncertain is not None:
            raise UncertainOutcome(
                f"the commit of epoch {self._uncertain.epoch} has an unknown outcome", where=self._where
            )

    def _active_epoch(self, epoch: EpochId, doing: str) -> Epoch:
        self._check_usable()
        state = self._active
        if state is None:
            raise LifecycleError(f"{doing} of epoch {epoch} without an active epoch", where=self._where)
        if state.epoch != epoch:
            raise EpochMismatch(f"{doing} of epoch {epoch} while {state.epoch} is active", where=self._where)
        return state

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

    async def _reconnect_if_broken(self) -> Connection:
        """The connection, replaced by a new one when it broke or ended between epochs (no commit
        was pending: a lost commit is resolved first)."""
        conn = self._conn
        if conn is not None and not conn.broken and not conn.closed:
            return conn
        self._conn = None
        self._committed = None
        if conn is not None:
            await conn.close()
        conn = await self._connection(autocommit=False)
        self._conn = conn
        self._backend = await backend_of(conn, self._where)
        return conn

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


__all__ = [
    "POLICIES",
    "Connect",
    "PostgresStreamingSink",
    "PostgresStreamingSinkSession",
]
