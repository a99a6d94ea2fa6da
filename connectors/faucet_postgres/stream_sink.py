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
* ``commit_epoch`` checks the owner fence, applies staged changes, records the epoch and moves the
  watermarks in the epoch's transaction, and commits in one round trip; a commit whose answer was
  lost is resolved (:mod:`faucet_postgres.stream_commit`);
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
from collections.abc import Awaitable, Callable, Sequence

import psycopg
import pyarrow as pa

from faucet_dagster.protocol import (
    DEFAULT_POLICY_OPERATIONS,
    ConfigError,
    DataError,
    DestinationReader,
    Durability,
    EpochId,
    EpochMismatch,
    FaucetError,
    LifecycleError,
    OwnershipLost,
    PartialResult,
    RejectedRow,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    StreamingSink,
    WorkerIdentity,
    WritePolicy,
)
from faucet_postgres import changes
from faucet_postgres.common import connect, current_schema
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.stream_changes import ChangeApplier
from faucet_postgres.stream_commit import CommittingSession, Connection
from faucet_postgres.stream_fence import StreamRows
from faucet_postgres.stream_state import Committed, Epoch, Tally
from faucet_postgres.stream_tables import Tables, epoch_stamp, stamp_epoch
from faucet_postgres.stream_zombies import Backend, backend_of

Connect = Callable[..., Awaitable[Connection]]
"""How the sink opens connections: :func:`faucet_postgres.common.connect`'s signature."""

POLICIES = frozenset(
    {WritePolicy.APPEND, WritePolicy.UPSERT, WritePolicy.VERSIONED_UPSERT, WritePolicy.APPLY_CHANGES}
)


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


class PostgresStreamingSinkSession(CommittingSession):
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


__all__ = [
    "POLICIES",
    "Connect",
    "PostgresStreamingSink",
    "PostgresStreamingSinkSession",
]
