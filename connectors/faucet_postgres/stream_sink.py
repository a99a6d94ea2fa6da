"""The PostgreSQL streaming sink: one transaction per epoch, with its watermark and owner fence inside.

Epoch lifecycle on one connection (psycopg 3, asyncio):

* ``begin_epoch`` starts the transaction and reads the stream's per-domain watermarks in it;
* ``apply`` drops the rows at or below their domain's watermark (a replay), then COPYs the rest into
  the table (APPEND), or into a temporary staging table merged with ``INSERT ... ON CONFLICT``
  (UPSERT: the last row per key wins; VERSIONED_UPSERT: only a newer version replaces a row), or
  stages change rows (APPLY_CHANGES) in a temporary table per destination table;
* a batch is applied under a savepoint: rows the server refuses (SQLSTATE class 22 or 23) are found
  by bisection (:mod:`faucet_postgres.refusals`) and either reported (``apply_partial``: the pipeline
  dead-letters them, the others stay applied) or named in a DataError by their event identity
  (``apply``). APPLY_CHANGES judges the destination at commit: a refused change is found by bisection
  over the stage's keys and named by its position, key and constraint, never dead-lettered;
* ``commit_epoch`` checks the owner fence first (the stream's row in the epochs table: the commit
  fails with :class:`OwnershipLost` if a higher fencing token claimed the stream), then applies the
  staged changes (APPLY_CHANGES, below), records the epoch and moves the watermarks, all in the same
  transaction,
  then commits. A commit whose answer is lost (the connection dropped) is resolved: the old backend is
  made to exit (``pg_terminate_backend``) so its transaction can no longer finish, and the epoch row is
  read back, compared by a random commit id. Unresolvable means :class:`UncertainOutcome`;
* ``abort_epoch`` rolls back. Everything of an epoch is tentative until its commit: abort undoes all
  of it, and nothing of earlier committed epochs.

APPLY_CHANGES applies change rows (``__faucet_op`` insert/update/delete, ``__faucet_unchanged``) by key
in commit order, whatever order the batches of the epoch arrived in: every row is staged with its
position (which must be an integer position: an LSN, an offset, a sequence) and ordinal, and at commit
each table gets its keys' last changes in one set-based statement (:mod:`faucet_postgres.changes`).
Tables are applied one after another in the epoch's transaction, so foreign keys between replicated
tables must be ``DEFERRABLE INITIALLY DEFERRED`` in the destination. The key is the stream's key, else
each table's ``faucet.key`` columns (the PostgreSQL change source marks its replica identity). A table
is fed from one ordering domain only: changes of two domains have no common order.

``open`` claims the fence (the epochs row's token becomes the worker's, unless a higher one holds it:
then OwnershipLost), so an older worker's commit fails from that moment on, checked by the database
atomically with its effects.

Zombies and locks. An epoch's open transaction holds locks until it ends: a table it created (and
the catalog entries of its name), a column it added, rows of the keys it upserted, the epochs row once
its commit began. A previous owner frozen with its epoch open (a stopped VM, a long pause) keeps them,
and its successor would wait for them for as long as the frozen connection lives. Every connection
of the sink therefore sets two server timeouts for its session (:meth:`PostgresStreamingSink.connection`):

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
"""

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from faucet_dagster.protocol import (
    DEFAULT_POLICY_OPERATIONS,
    ConfigError,
    ConnectionFailed,
    Coverage,
    DataError,
    Durability,
    EpochId,
    EpochMismatch,
    EventIdentity,
    FaucetError,
    Identities,
    IntegerPositionCodec,
    IntegrityError,
    LifecycleError,
    OrderingDomain,
    OwnershipLost,
    PartialResult,
    Position,
    Receipt,
    RejectedRow,
    SchemaError,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    StreamingSink,
    StreamingSinkSession,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
    default_codec_registry,
)
from faucet_postgres import change_schema, changes, refusals
from faucet_postgres.common import (
    PgColumn,
    add_columns,
    connect,
    copy_batch,
    create_table,
    current_schema,
    error_text,
    is_row_error,
    pg_error,
    row_error_reason,
    table_columns,
    table_name,
)
from faucet_postgres.config import PostgresStreamingSinkConfig

Connection = psycopg.AsyncConnection[Any]
Connect = Callable[..., Awaitable[Connection]]
"""How the sink opens connections: :func:`faucet_postgres.common.connect`'s signature."""

POLICIES = frozenset(
    {WritePolicy.APPEND, WritePolicy.UPSERT, WritePolicy.VERSIONED_UPSERT, WritePolicy.APPLY_CHANGES}
)
_MAX_BIGINT = 2**63 - 1
_ORDINAL = "__faucet_ordinal"
_STATE_LOCK = 0x66617563  # an advisory lock id ("fauc"), held while the state tables are created
_BACKEND_EXIT_WAIT = 10.0
_UNIQUE_VIOLATION = "23505"
_CATALOG_NAME_INDEXES = ("pg_type_typname_nsp_index", "pg_class_relname_nsp_index")
"""The catalog's unique names: a concurrent creation of one table collides on one of them."""
_LOCK_NOT_AVAILABLE = "55P03"
_IDLE_IN_TRANSACTION_TIMEOUT = "25P03"


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


@dataclass(frozen=True)
class _Backend:
    """The server process behind a connection: what must have exited before a lost commit is judged."""

    pid: int
    started: Any


@dataclass
class _Target:
    """A destination table as this session knows it."""

    schema: str
    table: str
    columns: dict[str, PgColumn]
    stage: sql.Identifier | None = None
    from_changes: bool = False
    """APPLY_CHANGES created the table (its column types follow the change rows' Arrow types)."""

    @property
    def identifier(self) -> sql.Identifier:
        return table_name(self.schema, self.table)

    @property
    def label(self) -> str:
        return f"{self.schema}.{self.table}"


@dataclass
class _Tally:
    """What an epoch did to one resource so far."""

    table: str
    written: int = 0
    skipped: int = 0
    first: str | None = None
    last: str | None = None


@dataclass
class _Changes:
    """APPLY_CHANGES: one destination table's staged changes in the active epoch (``counts`` includes
    the stages applied before a schema change within the epoch)."""

    target: _Target
    stage: changes.ChangeStage
    domain: tuple[str, str, str]
    schema: pa.Schema
    ordering: OrderingDomain
    """The domain the changes come from (its codec prints a position)."""
    counts: changes.ChangeCounts = changes.NO_CHANGES
    last_position: int = 0
    """The highest position staged."""


@dataclass
class _Epoch:
    """The active epoch: its watermarks at begin (by domain lineage), its tallies, its staged changes
    (by table)."""

    epoch: EpochId
    watermarks: dict[tuple[str, str, str], Position]
    tallies: dict[str, _Tally] = field(default_factory=dict)
    changes: dict[str, _Changes] = field(default_factory=dict)
    failed: bool = False


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
        self._schema = ""
        self._epochs = sql.Identifier("")
        self._watermarks = sql.Identifier("")
        self._backend: _Backend | None = None
        self._targets: dict[str, _Target] = {}
        self._active: _Epoch | None = None
        self._uncertain: _Epoch | None = None
        self._pending_commit: str | None = None
        self._closed = False

    # -- setup ------------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Create the state tables if missing and claim the owner fence with the worker's token."""
        conn = self._live()
        try:
            self._schema = self._config.schema_name or await current_schema(conn)
            state_schema = self._config.state_schema_name or self._schema
            self._epochs = table_name(state_schema, self._config.epochs_table)
            self._watermarks = table_name(state_schema, self._config.watermarks_table)
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_STATE_LOCK,))
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (stream text PRIMARY KEY, fencing_token bigint NOT NULL, "
                    "epoch_sequence bigint, epoch_fencing_token bigint, commit_id text, "
                    "committed_at timestamptz)"
                ).format(self._epochs)
            )
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (stream text NOT NULL, source text NOT NULL, "
                    "resource text NOT NULL, partition text NOT NULL, incarnation text NOT NULL, "
                    "codec text NOT NULL, position text NOT NULL, epoch_sequence bigint NOT NULL, "
                    "PRIMARY KEY (stream, source, resource, partition))"
                ).format(self._watermarks)
            )
            await conn.commit()
            cursor = await conn.execute(
                sql.SQL(
                    "INSERT INTO {} AS e (stream, fencing_token) VALUES (%s, %s) ON CONFLICT (stream) "
                    "DO UPDATE SET fencing_token = EXCLUDED.fencing_token "
                    "WHERE e.fencing_token <= EXCLUDED.fencing_token RETURNING fencing_token"
                ).format(self._epochs),
                (self._stream, self._worker.fencing_token),
            )
            claimed = await cursor.fetchone()
            await conn.commit()
        except psycopg.Error as exc:
            raise await self._failure(exc, where=self._where, doing="preparing the stream state") from exc
        if claimed is None:
            raise OwnershipLost(
                f"a fencing token above {self._worker.fencing_token} holds the stream at the destination",
                where=self._where,
            )
        self._backend = await _backend_of(conn, self._where)

    # -- reading state ----------------------------------------------------------------------------

    async def last_committed(self) -> SinkCommitState | None:
        """The last committed epoch and watermarks, read on a separate connection (committed data only)."""
        self._check_usable()
        probe = await self._connection(autocommit=True)
        try:
            found = await self._read_state(probe)
        finally:
            await probe.close()
        return None if found is None else found[0]

    async def _read_state(self, conn: Connection) -> tuple[SinkCommitState, str] | None:
        try:
            cursor = await conn.execute(
                sql.SQL(
                    "SELECT e.epoch_sequence, e.epoch_fencing_token, e.commit_id, w.source, w.resource, "
                    "w.partition, w.incarnation, w.codec, w.position FROM {} e LEFT JOIN {} w "
                    "ON w.stream = e.stream WHERE e.stream = %s AND e.epoch_sequence IS NOT NULL"
                ).format(self._epochs, self._watermarks),
                (self._stream,),
            )
            rows = await cursor.fetchall()
        except psycopg.Error as exc:
            raise pg_error(exc, where=self._where, doing="reading the last committed epoch") from exc
        if not rows:
            return None
        sequence, token, commit_id = rows[0][:3]
        watermarks = tuple(
            Position(OrderingDomain(source, resource, partition, incarnation, codec), position)
            for _, _, _, source, resource, partition, incarnation, codec, position in rows
            if source is not None
        )
        return SinkCommitState(EpochId(self._stream, int(sequence), int(token)), watermarks), str(commit_id)

    # -- the epoch lifecycle ----------------------------------------------------------------------

    async def begin_epoch(self, epoch: EpochId) -> None:
        """Open the epoch's transaction and read the watermarks its replayed rows are judged by."""
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
        try:
            cursor = await conn.execute(
                sql.SQL(
                    "SELECT source, resource, partition, incarnation, codec, position FROM {} "
                    "WHERE stream = %s"
                ).format(self._watermarks),
                (self._stream,),
            )
            rows = await cursor.fetchall()
        except psycopg.Error as exc:
            await self._rollback_quietly()
            raise pg_error(exc, where=self._where, doing=f"beginning epoch {epoch}") from exc
        watermarks = {
            (source, resource, partition): Position(
                OrderingDomain(source, resource, partition, incarnation, codec), position
            )
            for source, resource, partition, incarnation, codec, position in rows
        }
        self._active = _Epoch(epoch, watermarks)
        for target in self._targets.values():
            target.stage = None  # staging tables are dropped at the end of each transaction

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
        state = self._active_epoch(epoch, "apply")
        if batch.epoch != epoch:
            raise EpochMismatch(f"a batch of epoch {batch.epoch} was applied in {epoch}", where=self._where)
        if state.failed:
            raise LifecycleError(f"epoch {epoch} failed; abort it", where=self._where)
        records, identities, skipped, kept = self._above_watermark(state, batch)
        positions = identities.positions
        table = self._config.table_for(batch.resource)
        tally = state.tallies.setdefault(batch.resource, _Tally(table))
        tally.skipped += skipped
        if records.num_rows == 0:
            return PartialResult(written=0)
        conn = self._live()
        refused: tuple[RejectedRow, ...] = ()
        try:
            if self._policy is WritePolicy.APPLY_CHANGES:
                target, written = await self._stage_changes(
                    conn, state, table, batch.domain, records, identities
                )
            else:
                target = await self._target(
                    conn, table, records.schema, self._key if self._policy.keyed else ()
                )
                written, refused = await self._write_rows(conn, target, records)
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

    async def _write_rows(
        self, conn: Connection, target: _Target, records: pa.RecordBatch
    ) -> tuple[int, tuple[RejectedRow, ...]]:
        """APPEND, UPSERT, VERSIONED_UPSERT: write ``records`` under a savepoint, bisecting down to the
        rows the server refuses; returns the rows written and the refused ones."""
        if self._policy is WritePolicy.APPEND:

            async def write(start: int, stop: int) -> int:
                part = records.slice(start, stop - start)
                return await copy_batch(conn, target.identifier, part, target.columns)

        else:
            self._check_keys(records)
            await self._ensure_stage(conn, target, records.schema.names)

            async def write(start: int, stop: int) -> int:
                return await self._merge(conn, target, records.slice(start, stop - start))

        return await refusals.apply_finding_refusals(conn, records.num_rows, write)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        """Fence check, epoch row, watermarks and rows in one transaction; see the module docstring."""
        state = self._active_epoch(epoch, "commit")
        if state.failed:
            raise LifecycleError(f"epoch {epoch} failed; abort it", where=self._where)
        conn = self._live()
        commit_id = uuid.uuid4().hex
        marks = self._next_watermarks(state, coverage)
        try:
            cursor = await conn.execute(
                sql.SQL(
                    "UPDATE {} SET fencing_token = %(token)s, epoch_sequence = %(sequence)s, "
                    "epoch_fencing_token = %(token)s, commit_id = %(commit)s, committed_at = now() "
                    "WHERE stream = %(stream)s AND fencing_token <= %(token)s "
                    "RETURNING pg_current_xact_id()::text"
                ).format(self._epochs),
                {
                    "token": epoch.fencing_token,
                    "sequence": epoch.sequence,
                    "commit": commit_id,
                    "stream": self._stream,
                },
            )
            fenced = await cursor.fetchone()
            if fenced is None:
                state.failed = True
                await self._rollback_quietly()
                raise OwnershipLost(
                    f"a fencing token above {epoch.fencing_token} claimed the stream: epoch {epoch} "
                    "was rolled back",
                    where=self._where,
                )
            # After the fence: a zombie's epoch is refused as fenced, never judged against rows its
            # successor already applied (which would look like divergence).
            await self._apply_changes(conn, state)
            if marks:
                async with conn.cursor() as many:
                    await many.executemany(
                        sql.SQL(
                            "INSERT INTO {} AS w (stream, source, resource, partition, incarnation, codec, "
                            "position, epoch_sequence) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                            "ON CONFLICT (stream, source, resource, partition) DO UPDATE SET "
                            "incarnation = EXCLUDED.incarnation, codec = EXCLUDED.codec, "
                            "position = EXCLUDED.position, epoch_sequence = EXCLUDED.epoch_sequence"
                        ).format(self._watermarks),
                        [
                            (
                                self._stream,
                                *mark.domain.lineage,
                                mark.domain.incarnation,
                                mark.domain.codec,
                                mark.value,
                                epoch.sequence,
                            )
                            for mark in marks
                        ],
                    )
        except psycopg.Error as exc:
            state.failed = True
            raise await self._failure(exc, where=self._where, doing=f"committing epoch {epoch}") from exc
        receipts = self._receipts(state, transaction=str(fenced[0]))
        self._pending_commit = commit_id
        try:
            await conn.commit()
        except BaseException as exc:
            if isinstance(exc, psycopg.Error) and exc.sqlstate and not conn.broken:
                # The server answered: the transaction was rolled back (a deferred constraint, a
                # serialization failure). Nothing of the epoch remains.
                self._pending_commit = None
                state.failed = True
                raise pg_error(exc, where=self._where, doing=f"committing epoch {epoch}") from exc
            # No answer (connection lost, or the caller gave up waiting): the epoch may have committed.
            self._uncertain = state
            if not isinstance(exc, psycopg.Error):
                raise
            committed = await self._resolve(cause=exc)
            if not committed:
                state.failed = True
                raise ConnectionFailed(
                    f"the connection was lost during the commit of epoch {epoch}, which did not take "
                    "effect (read back after its server process exited)",
                    where=self._where,
                ) from exc
        self._pending_commit = None
        self._active = None
        return receipts

    async def abort_epoch(self, epoch: EpochId) -> None:
        """Roll the epoch's transaction back: none of its rows, watermarks or epoch row remain."""
        self._active_epoch(epoch, "abort")
        self._active = None
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
            if self._uncertain is not None:
                await self._resolve(cause=None)
            await self._rollback_quietly()
        finally:
            self._closed = True
            self._active = None
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

    def _active_epoch(self, epoch: EpochId, doing: str) -> _Epoch:
        self._check_usable()
        state = self._active
        if state is None:
            raise LifecycleError(f"{doing} of epoch {epoch} without an active epoch", where=self._where)
        if state.epoch != epoch:
            raise EpochMismatch(f"{doing} of epoch {epoch} while {state.epoch} is active", where=self._where)
        return state

    def _live(self) -> Connection:
        if self._conn is None:
            raise LifecycleError("the session is closed", where=self._where)
        return self._conn

    async def _failure(self, exc: psycopg.Error, *, where: str, doing: str) -> FaucetError:
        """:func:`pg_error`, saying what a lock wait that timed out or a transaction the server ended
        for idling means here (both retryable: the runner aborts the epoch, the next one retries)."""
        error = pg_error(exc, where=where, doing=doing)
        if exc.sqlstate == _LOCK_NOT_AVAILABLE:
            seconds = self._config.lock_timeout
            return FaucetError(
                f"{doing} waited {seconds:g} s (lock_timeout) for a lock held by another transaction: "
                f"another worker's open epoch? {await self._old_transactions(seconds)}; the epoch is "
                "to be aborted and retried (nothing of it was kept)",
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
        if exc.sqlstate == _IDLE_IN_TRANSACTION_TIMEOUT:
            idle = self._config.idle_in_transaction_session_timeout
            return ConnectionFailed(
                f"{error.message}: the epoch's transaction sat idle longer than "
                f"idle_in_transaction_session_timeout ({idle:g} s), "
                "so the server ended it and nothing of the epoch remains (a paused worker, or read limits "
                "longer than the timeout)",
                where=where,
            )
        return error

    async def _old_transactions(self, seconds: float) -> str:
        """The other sessions of this database whose transaction began at least ``seconds`` ago (the
        lock holders are among them), as ``pid (state, age)``; read on a separate connection. Only
        process ids, states and ages: never query text."""
        ours = self._conn.info.backend_pid if self._conn is not None else 0
        try:
            probe = await self._connection(autocommit=True)
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

    async def _reconnect_if_broken(self) -> Connection:
        """The connection, replaced by a new one when it broke or ended between epochs (no commit
        was pending: a lost commit is resolved first)."""
        conn = self._conn
        if conn is not None and not conn.broken and not conn.closed:
            return conn
        self._conn = None
        if conn is not None:
            await conn.close()
        conn = await self._connection(autocommit=False)
        self._conn = conn
        self._backend = await _backend_of(conn, self._where)
        return conn

    async def _rollback_quietly(self) -> None:
        """Roll back; a broken connection needs none (the server rolls back when it ends).

        Tables created in the rolled back transaction are gone: the table cache is dropped with it.
        """
        self._targets.clear()
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

    def _above_watermark(
        self, state: _Epoch, batch: SinkBatch
    ) -> tuple[pa.RecordBatch, Identities, int, list[int] | None]:
        """The rows of ``batch`` after its domain's watermark, their identities, how many were dropped,
        and the kept rows' indices in ``batch`` (``None``: every row was kept)."""
        records = batch.records
        positions = list(batch.identities.positions)
        mark = state.watermarks.get(batch.domain.lineage)
        if mark is None or mark.domain.incarnation != batch.domain.incarnation or not positions:
            return records, batch.identities, 0, None
        codec = default_codec_registry().get(batch.domain.codec)
        limit = codec.validate(mark.value)
        if isinstance(codec, IntegerPositionCodec):
            try:
                values = pa.array(positions, pa.string()).cast(pa.int64())
            except pa.ArrowInvalid as exc:
                raise IntegrityError(
                    f"a batch carries positions that are not {codec.name} positions", where=self._where
                ) from exc
            keep = pc.greater(values, limit)
        else:
            verdicts = {text: codec.compare(codec.validate(text), limit) > 0 for text in set(positions)}
            keep = pa.array([verdicts[text] for text in positions], pa.bool_())
        kept = int(pc.sum(keep).as_py() or 0)
        if kept == len(positions):
            return records, batch.identities, 0, None
        indices = pc.indices_nonzero(keep).to_pylist()
        ordinals = batch.identities.ordinals
        identities = Identities(
            [positions[index] for index in indices],
            None if ordinals is None else [ordinals[index] for index in indices],
        )
        return records.filter(keep), identities, len(positions) - kept, indices

    async def _target(
        self,
        conn: Connection,
        table: str,
        schema: pa.Schema,
        key: Sequence[str],
        *,
        change_rows: bool = False,
    ) -> _Target:
        """The table for a batch of ``schema``: created when missing (``key`` as its primary key),
        checked for missing columns (added with ``schema_evolution``). For ``change_rows``
        (APPLY_CHANGES, ``schema`` without the operation columns) it is created, evolved and checked
        through :mod:`faucet_postgres.change_schema`."""
        target = self._targets.get(table)
        if target is None or not set(schema.names) <= set(target.columns):
            where = f"{self._where} table {table}"
            columns = await table_columns(conn, self._schema, table)
            from_changes = False
            if columns is None:
                if not self._config.create_tables:
                    raise ConfigError(f"table {self._schema}.{table} does not exist", where=self._where)
                make = change_schema.create_table if change_rows else create_table
                columns = await make(conn, self._schema, table, schema, key)
                from_changes = change_rows
            elif change_rows:
                from_changes = await change_schema.created_from_changes(conn, self._schema, table)
            missing = [item for item in schema if item.name not in columns]
            if missing:
                if not self._config.schema_evolution:
                    raise SchemaError(
                        f"table {self._schema}.{table} has no column(s) "
                        f"{', '.join(item.name for item in missing)} (schema_evolution is off)",
                        where=self._where,
                    )
                if change_rows:
                    columns = await change_schema.evolve(conn, self._schema, table, missing, where)
                else:
                    columns = await add_columns(conn, self._schema, table, missing)
            target = _Target(self._schema, table, columns, from_changes=from_changes)
            self._targets[table] = target
        if change_rows:
            change_schema.check_types(
                target.columns, schema, target.from_changes, f"{self._where} table {table}"
            )
        return target

    def _version_column(self) -> str | None:
        return self._config.version_column if self._policy is WritePolicy.VERSIONED_UPSERT else None

    def _check_keys(self, records: pa.RecordBatch) -> None:
        """Keyed policies: the key (and version) columns are present and hold no null."""
        names = records.schema.names
        missing = [column for column in self._key if column not in names]
        version = self._version_column()
        if version is not None and version not in names:
            missing.append(version)
        if missing:
            raise SchemaError(f"the batch has no column(s) {', '.join(missing)}", where=self._where)
        nulls = [
            column for column in (*self._key, *([version] if version else [])) if records[column].null_count
        ]
        if nulls:
            raise DataError(f"null in key or version column(s) {', '.join(nulls)}", where=self._where)

    async def _ensure_stage(self, conn: Connection, target: _Target, names: Sequence[str]) -> None:
        """The epoch's staging table of ``target`` (created outside any savepoint, so a refused
        slice rolled back to its savepoint leaves it in place)."""
        if target.stage is None:
            target.stage = sql.Identifier(f"_faucet_stage_{uuid.uuid4().hex[:12]}")
            await conn.execute(
                sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                    target.stage, sql.SQL(", ").join(map(sql.Identifier, names)), target.identifier
                )
            )
            await conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint").format(target.stage, sql.Identifier(_ORDINAL))
            )

    async def _merge(self, conn: Connection, target: _Target, records: pa.RecordBatch) -> int:
        """Keyed apply through the staging table: one row per key (the newest), then INSERT ON CONFLICT."""
        names = records.schema.names
        version = self._version_column()
        assert target.stage is not None  # made by _ensure_stage
        ordinals = pa.array(range(records.num_rows), pa.int64())
        staged = records.append_column(_ORDINAL, ordinals)
        stage_columns = {**{name: target.columns[name] for name in names}, _ORDINAL: _ORDINAL_COLUMN}
        await copy_batch(conn, target.stage, staged, stage_columns)
        columns = sql.SQL(", ").join(map(sql.Identifier, names))
        keys = sql.SQL(", ").join(map(sql.Identifier, self._key))
        newest = [*([sql.SQL("{} DESC").format(sql.Identifier(version))] if version else [])]
        order = sql.SQL(", ").join(
            [*map(sql.Identifier, self._key), *newest, sql.SQL("{} DESC").format(sql.Identifier(_ORDINAL))]
        )
        others = [name for name in names if name not in self._key]
        action: sql.Composable
        if others:
            action = sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(name), sql.Identifier(name))
                    for name in others
                )
            )
            if version is not None:
                action = sql.SQL("{} WHERE t.{} IS NULL OR t.{} < EXCLUDED.{}").format(
                    action, *[sql.Identifier(version)] * 3
                )
        else:
            action = sql.SQL("DO NOTHING")
        cursor = await conn.execute(
            sql.SQL(
                "INSERT INTO {} AS t ({}) SELECT DISTINCT ON ({}) {} FROM {} ORDER BY {} ON CONFLICT ({}) {}"
            ).format(target.identifier, columns, keys, columns, target.stage, order, keys, action)
        )
        written = max(cursor.rowcount, 0)
        await conn.execute(sql.SQL("TRUNCATE {}").format(target.stage))
        return written

    async def _stage_changes(
        self,
        conn: Connection,
        state: _Epoch,
        table: str,
        domain: OrderingDomain,
        records: pa.RecordBatch,
        identities: Identities,
    ) -> tuple[_Target, int]:
        """APPLY_CHANGES: stage change rows with their commit order (see ``changes.stage``)."""
        where = f"{self._where} table {table}"
        layout = changes.change_layout(records.schema, self._key, where)
        pending = state.changes.get(table)
        if pending is not None and pending.domain != domain.lineage:
            raise IntegrityError(
                f"changes from {'/'.join(domain.lineage)} and {'/'.join(pending.domain)} go to one table: "
                "two ordering domains have no common order to apply them in",
                where=where,
            )
        positions = _integer_positions(domain, identities, where)
        if pending is None or pending.stage.layout != layout or pending.schema != records.schema:
            counts = changes.NO_CHANGES
            if pending is not None:
                # The source table's columns changed (DDL) within the epoch: the changes before it are
                # applied now, so the new columns' backfill reaches exactly their rows. That needs
                # them to precede every row of the new schema (one resource per table does).
                first = pc.min(positions).as_py()
                if first is not None and first < pending.last_position:
                    raise IntegrityError(
                        f"changes of another schema of table {table} came before changes already staged "
                        "(two resources write this table?): they cannot be applied in commit order",
                        where=where,
                    )
                counts = await self._apply_pending(conn, state, table, pending)
            data = changes.data_schema(records.schema)
            target = await self._target(conn, table, data, layout.created_key, change_rows=True)
            stage = await changes.create_stage(conn, target.identifier, target.columns, layout)
            stage.name_refused = True
            pending = state.changes[table] = _Changes(
                target, stage, domain.lineage, records.schema, domain, counts
            )
        rows = changes.staged_rows(records, layout, positions, _ordinals(identities), where)
        pending.last_position = max(pending.last_position, pc.max(positions).as_py() or 0)
        try:
            return pending.target, await changes.stage(conn, pending.stage, rows)
        except DataError as exc:
            raise _refused_change(exc, where, pending.ordering) from exc

    async def _apply_changes(self, conn: Connection, state: _Epoch) -> None:
        """APPLY_CHANGES: apply every table's staged changes (first step of the commit)."""
        for table, pending in state.changes.items():
            pending.counts = await self._apply_pending(conn, state, table, pending)

    async def _apply_pending(
        self, conn: Connection, state: _Epoch, table: str, pending: _Changes
    ) -> changes.ChangeCounts:
        """Apply one table's stage; the counts so far plus this stage's."""
        where = f"{self._where} table {table}"
        try:
            counts = await self._apply_stage(conn, pending, where)
            if counts.unexpected_inserts or counts.unexpected_changes:
                # The replica is not what the stream made it (written by something else, or a change was
                # lost or applied twice): committing would certify a diverged replica.
                example = "" if counts.surprise is None else f", key {counts.surprise}"
                raise IntegrityError(
                    f"the replica diverged from the change stream: {counts.unexpected_inserts} insert(s) "
                    f"of rows it held, {counts.unexpected_changes} update(s) or delete(s) of rows it "
                    f"lacked{example}; nothing of the epoch is committed",
                    where=where,
                )
            return pending.counts + counts
        except BaseException as exc:
            state.failed = True
            if isinstance(exc, psycopg.Error):
                raise await self._failure(exc, where=where, doing="applying the epoch's changes") from exc
            if isinstance(exc, pa.ArrowException):
                raise DataError(f"the changes cannot be encoded for COPY: {exc}", where=where) from exc
            raise

    async def _apply_stage(self, conn: Connection, pending: _Changes, where: str) -> changes.ChangeCounts:
        """Apply one table's stage under a savepoint. A change the destination refuses (a constraint,
        SQLSTATE class 22 or 23) raises DataError naming its position in the source (an LSN, an offset),
        its key and the constraint, found by bisection over the stage's keys. APPLY_CHANGES never
        dead-letters it: a replica missing one change diverges from its source."""
        target = pending.target.identifier
        try:
            await changes.copy_held(conn, pending.stage)
        except DataError as exc:
            raise _refused_change(exc, where, pending.ordering) from exc
        try:
            async with refusals.savepoint(conn):
                return await changes.apply_stage(conn, target, pending.stage, where)
        except psycopg.Error as exc:
            if not is_row_error(exc):
                raise
            found = await changes.refused_change(conn, target, pending.stage, where)
            if found is None:
                raise DataError(
                    f"the destination refused the epoch's changes: {row_error_reason(exc)} (no single "
                    "key's changes are refused alone)",
                    where=where,
                ) from exc
            codec = default_codec_registry().get(pending.ordering.codec)
            identity = EventIdentity(pending.ordering, codec.canonicalize(found.position), found.ordinal)
            raise DataError(
                f"the destination refused the change of key {found.key}: {found.reason}",
                where=f"{where} @ {identity}",
            ) from exc

    def _next_watermarks(self, state: _Epoch, coverage: Coverage) -> list[Position]:
        """The watermark per covered domain after this epoch: never behind the one it replaces."""
        marks: list[Position] = []
        for item in coverage.domains:
            new = Position(item.domain, item.end)
            old = state.watermarks.get(item.domain.lineage)
            if old is not None and old.domain == item.domain:
                codec = default_codec_registry().get(item.domain.codec)
                if codec.compare(codec.validate(old.value), codec.validate(item.end)) >= 0:
                    new = old
            marks.append(new)
        return marks

    def _receipts(self, state: _Epoch, *, transaction: str) -> tuple[Receipt, ...]:
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

    async def _resolve(self, *, cause: BaseException | None) -> bool:
        """Decide a commit whose answer was lost: wait for (or force) the exit of the server process
        that ran it, then read the epoch row back. True: it committed. Raises UncertainOutcome when
        that cannot be established."""
        state, commit_id = self._uncertain, self._pending_commit
        assert state is not None and commit_id is not None
        try:
            probe = await self._connection(autocommit=True)
            try:
                if self._backend is not None:
                    await _ensure_exited(probe, self._backend, self._where)
                found = await self._read_state(probe)
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
        # The old connection is gone either way; the next epoch opens a new one.
        self._targets.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
        return found is not None and found[1] == commit_id


_ORDINAL_COLUMN = PgColumn(_ORDINAL, "int8", "bigint", -1, False)


def _refused_change(exc: DataError, where: str, domain: OrderingDomain) -> DataError:
    """``exc`` (a staged row the server refused, :func:`changes.copy_held`) naming the row's event
    identity in ``domain``; ``exc`` itself for another DataError."""
    position = exc.details.get("position")
    if position is None:
        return exc
    codec = default_codec_registry().get(domain.codec)
    identity = EventIdentity(domain, codec.canonicalize(int(position)), int(exc.details.get("ordinal", 0)))
    return DataError(exc.message, where=f"{where} @ {identity}")


def _integer_positions(domain: OrderingDomain, identities: Identities, where: str) -> pa.Array:
    """The rows' positions as int64 (validated through the domain's codec), to order changes by."""
    codec = default_codec_registry().get(domain.codec)
    encoded = pa.array(identities.positions, pa.string()).dictionary_encode()
    values = []
    for text in encoded.dictionary.to_pylist():
        value = codec.validate(text)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_BIGINT:
            raise IntegrityError(
                f"apply_changes orders changes by position, and {codec.name} position {text!r} is not "
                "an integer",
                where=where,
            )
        values.append(value)
    return pc.take(pa.array(values, pa.int64()), encoded.indices)


def _ordinals(identities: Identities) -> pa.Array:
    ordinals = identities.ordinals
    return pa.array([0] * len(identities) if ordinals is None else ordinals, pa.int64())


async def _backend_of(conn: Connection, where: str) -> _Backend:
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
    return _Backend(int(row[0]), row[1])


async def _ensure_exited(probe: Connection, backend: _Backend, where: str) -> None:
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


__all__ = [
    "POLICIES",
    "Connect",
    "PostgresStreamingSink",
    "PostgresStreamingSinkSession",
]
