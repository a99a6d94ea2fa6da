"""The DuckDB streaming sink: one transaction per epoch, with its watermarks and owner fence inside.

Epoch lifecycle:

* ``begin_epoch`` starts collecting the epoch: nothing is sent to DuckDB yet;
* ``apply`` checks the batch (a row without its key is refused at once, DataError naming its event
  identity) and keeps it, as Arrow, until the commit: an epoch's rows are held in memory, as large as
  the stream's read limits let an epoch grow;
* ``commit_epoch`` runs one DuckDB transaction under the file's writer lock
  (:func:`faucet_duckdb.database.writer_lock`): it reads the stream's fence and watermarks, fails with
  :class:`OwnershipLost` if a higher fencing token claimed the stream, drops every row at or below its
  domain's watermark (a replay: :class:`CommittedEpochs`), writes the rest (APPEND: ``INSERT ... BY
  NAME`` from Arrow; UPSERT: ``MERGE INTO`` by key, the last row per key winning), creating or
  evolving tables as the bounded sink does, records the epoch and its watermarks, and commits. A
  value the table refuses fails the commit (DataError, nothing of the epoch remains: abort, then the
  next epoch commits). The epoch's rows are judged against the watermarks read in the same
  transaction, under the lock: a replay is skipped even if another session of the stream committed
  since this one began.
* ``abort_epoch`` drops the collected batches: nothing of the epoch reached DuckDB.

Owner fencing is checked atomically: ``open`` claims the stream's row in the epochs table with the
worker's fencing token (refused if a higher one holds it), and every commit reads that row in its
own transaction, under the writer lock that every writing faucet connector of the file in this
process takes, while DuckDB's file lock keeps every other process out. No other writer can move the
row between the check and the commit.

Uncertain commits. The commit runs in a worker thread; a caller that gives up waiting (cancelled)
leaves it to finish. The session then knows the outcome only by reading it back: the next call (or
``close_session``) waits for the commit to end (the lock), reads the epochs row and compares the
commit's random id. ``close_session`` returning means nothing of the session can land later.
"""

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import duckdb

from faucet_dagster.protocol import (
    CommittedEpochs,
    ConfigError,
    Coverage,
    DataError,
    Durability,
    EpochId,
    FaucetError,
    HeldEpoch,
    HeldEpochs,
    LifecycleError,
    OrderingDomain,
    OwnershipLost,
    Position,
    Receipt,
    ResourceTally,
    SinkBatch,
    SinkCapabilities,
    SinkCommitState,
    StreamingSink,
    StreamingSinkSession,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
    upsert_rows,
)
from faucet_duckdb import tables
from faucet_duckdb.config import DuckDbStreamingSinkConfig
from faucet_duckdb.database import (
    Connect,
    DuckDbFile,
    file_uri,
    first_row,
    is_row_error,
    qualified,
    quote,
    rollback_quietly,
)

POLICIES = frozenset({WritePolicy.APPEND, WritePolicy.UPSERT})


@dataclass(frozen=True)
class _Committed:
    """What a commit did: the stream's state after it and the tallies by resource."""

    state: CommittedEpochs
    tallies: dict[str, ResourceTally]


class _StateTables:
    """The statements on one stream's rows of the epochs and watermarks tables."""

    def __init__(self, config: DuckDbStreamingSinkConfig, stream: str) -> None:
        self.stream = stream
        self.schema = config.schema_name
        self.epochs = qualified(config.schema_name, config.epochs_table)
        self.watermarks = qualified(config.schema_name, config.watermarks_table)

    def create_and_claim(self, conn: duckdb.DuckDBPyConnection, token: int) -> bool:
        """Create the tables if missing and claim the fence with ``token`` (committed): False when a
        higher token holds it."""
        conn.begin()
        try:
            if self.schema != "main":
                conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quote(self.schema)}")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.epochs} (stream VARCHAR PRIMARY KEY, "
                "fencing_token BIGINT NOT NULL, epoch_sequence BIGINT, epoch_fencing_token BIGINT, "
                "commit_id VARCHAR, committed_at TIMESTAMPTZ)"
            )
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.watermarks} (stream VARCHAR NOT NULL, "
                "source VARCHAR NOT NULL, resource VARCHAR NOT NULL, partition VARCHAR NOT NULL, "
                "incarnation VARCHAR NOT NULL, codec VARCHAR NOT NULL, position VARCHAR NOT NULL, "
                "epoch_sequence BIGINT NOT NULL, PRIMARY KEY (stream, source, resource, partition))"
            )
            claimed = conn.execute(
                f"INSERT INTO {self.epochs} AS e (stream, fencing_token) VALUES (?, ?) "
                "ON CONFLICT (stream) DO UPDATE SET fencing_token = excluded.fencing_token "
                "WHERE e.fencing_token <= excluded.fencing_token RETURNING fencing_token",
                [self.stream, token],
            ).fetchall()
            conn.commit()
        except BaseException:
            rollback_quietly(conn)
            raise
        return bool(claimed)

    def holder(self, conn: duckdb.DuckDBPyConnection) -> tuple[int, str | None] | None:
        """The fencing token holding the stream and its last commit id (None: no row)."""
        found = first_row(
            conn, f"SELECT fencing_token, commit_id FROM {self.epochs} WHERE stream = ?", [self.stream]
        )
        return None if found is None else (int(found[0]), None if found[1] is None else str(found[1]))

    def read(self, conn: duckdb.DuckDBPyConnection) -> CommittedEpochs:
        """The stream's committed epoch and watermarks as ``conn``'s transaction sees them."""
        found = conn.execute(
            f"SELECT e.epoch_sequence, e.epoch_fencing_token, w.source, w.resource, w.partition, "
            f"w.incarnation, w.codec, w.position FROM {self.epochs} e LEFT JOIN {self.watermarks} w "
            "ON w.stream = e.stream WHERE e.stream = ? AND e.epoch_sequence IS NOT NULL",
            [self.stream],
        ).fetchall()
        last: EpochId | None = None
        marks: list[Position] = []
        for sequence, token, source, resource, partition, incarnation, codec, position in found:
            last = EpochId(self.stream, int(sequence), int(token))
            if source is not None:
                domain = OrderingDomain(source, resource, partition, incarnation, codec)
                marks.append(Position(domain, position))
        return CommittedEpochs.of(last, marks)

    def record(
        self, conn: duckdb.DuckDBPyConnection, epoch: EpochId, commit_id: str, marks: Sequence[Position]
    ) -> None:
        """Record ``epoch`` as the stream's last (under ``commit_id``) and its watermarks."""
        conn.execute(
            f"UPDATE {self.epochs} SET epoch_sequence = ?, epoch_fencing_token = ?, commit_id = ?, "
            "committed_at = now() WHERE stream = ?",
            [epoch.sequence, epoch.fencing_token, commit_id, self.stream],
        )
        if marks:
            conn.executemany(
                f"INSERT INTO {self.watermarks} VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (stream, source, resource, partition) DO UPDATE SET "
                "incarnation = excluded.incarnation, codec = excluded.codec, "
                "position = excluded.position, epoch_sequence = excluded.epoch_sequence",
                [
                    [
                        self.stream,
                        *mark.domain.lineage,
                        mark.domain.incarnation,
                        mark.domain.codec,
                        mark.value,
                        epoch.sequence,
                    ]
                    for mark in marks
                ],
            )


def _capabilities(config: DuckDbStreamingSinkConfig) -> SinkCapabilities:
    return SinkCapabilities(
        # This object is the streaming role; the bounded sink declares its own policies.
        bounded_policies=frozenset(),
        continuous_policies=POLICIES,
        requires_key=frozenset({WritePolicy.UPSERT}),
        durability=Durability.TRANSACTIONAL,
        atomic_watermark=True,
        owner_fencing=True,
        schema_evolution=config.schema_evolution,
    )


class DuckDbStreamingSink(StreamingSink):
    """The continuous DuckDB sink; see the module docstring. ``connect`` opens the file (tests wrap it
    to inject a fault at an exact point)."""

    connector_name = "duckdb"

    def __init__(self, config: DuckDbStreamingSinkConfig, *, connect: Connect = duckdb.connect) -> None:
        self.config = config
        self._connect = connect

    def capabilities(self) -> SinkCapabilities:
        return _capabilities(self.config)

    async def check(self) -> None:
        """Open the file (created if missing), which fails when another process holds it."""
        file = DuckDbFile(self.config, writer=True, connect=self._connect)
        try:
            await file.call("checking the database", lambda conn: conn.execute("SELECT 1").fetchall())
        finally:
            await file.close()

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> "DuckDbStreamingSinkSession":
        """Open the file, create the state tables if needed, and claim the stream's owner fence."""
        where = f"{file_uri(self.config)} stream {stream}"
        if policy not in POLICIES:
            raise ConfigError(f"policy {policy.value} is not a continuous DuckDB policy", where=where)
        if policy is WritePolicy.UPSERT and not key:
            raise ConfigError("policy upsert needs a key", where=where)
        # Held only during each call (a commit, a read of the fence): between epochs the file is free.
        file = DuckDbFile(self.config, writer=True, where=where, connect=self._connect, hold=False)
        state = _StateTables(self.config, stream)
        try:
            claimed = await file.call(
                "preparing the stream state", state.create_and_claim, worker.fencing_token
            )
            if not claimed:
                raise OwnershipLost(
                    f"a fencing token above {worker.fencing_token} holds the stream at the destination",
                    where=where,
                )
        except BaseException:
            await file.close()
            raise
        return DuckDbStreamingSinkSession(self.config, file, state, policy, tuple(key), worker, where)


class DuckDbStreamingSinkSession(StreamingSinkSession):
    """One session of one stream on one connection to the file. Calls are serialized by the runner."""

    def __init__(
        self,
        config: DuckDbStreamingSinkConfig,
        file: DuckDbFile,
        state: _StateTables,
        policy: WritePolicy,
        key: tuple[str, ...],
        worker: WorkerIdentity,
        where: str,
    ) -> None:
        self._config = config
        self._file = file
        self._state = state
        self._policy = policy
        self._where = where
        self._epochs = HeldEpochs(state.stream, worker.fencing_token, key, where)
        self._pending: tuple[HeldEpoch, str] | None = None
        """A commit given up on (cancelled) before its outcome was known: the epoch and its commit id."""
        self._closed = False

    # -- reading state ----------------------------------------------------------------------------

    async def last_committed(self) -> SinkCommitState | None:
        """The last committed epoch and watermarks (committed data only)."""
        await self._check_usable()
        found = await self._file.call("reading the last committed epoch", self._read_committed)
        return found.state()

    def _read_committed(self, conn: duckdb.DuckDBPyConnection) -> CommittedEpochs:
        with conn.cursor() as probe:  # its own transaction: committed data only
            return self._state.read(probe)

    # -- the epoch lifecycle ----------------------------------------------------------------------

    async def begin_epoch(self, epoch: EpochId) -> None:
        await self._check_usable()
        self._epochs.begin(epoch)

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        """Keep ``batch`` for the commit, after checking what can be checked without the table: a
        row without its key (UPSERT) fails the epoch with a DataError naming its event identity."""
        await self._check_usable()
        self._epochs.hold(epoch, batch, f"{self._where} table {self._table_label(batch.resource)}")

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        """Fence check, rows above the watermarks, epoch row and watermarks in one transaction."""
        await self._check_usable()
        state = self._epochs.committable(epoch)
        commit_id = uuid.uuid4().hex
        self._pending = (state, commit_id)
        try:
            done = await self._file.call(
                f"committing epoch {epoch}", self._commit, state, coverage, commit_id
            )
        except asyncio.CancelledError:
            raise  # the commit may still finish: the next call reads its outcome back
        except BaseException:
            self._pending = None
            state.failed = True
            raise
        self._pending = None
        self._epochs.active = None
        return self._receipts(done.tallies)

    async def abort_epoch(self, epoch: EpochId) -> None:
        """Drop the epoch's batches: nothing of it reached DuckDB (a commit that failed rolled back)."""
        await self._check_usable()
        self._epochs.current(epoch, "abort")
        self._epochs.active = None

    async def close_session(self) -> None:
        """Wait for a commit still running (given up on by its caller), then release the file.

        Returning means nothing of the session can land later: a commit running in its worker thread
        holds the file's lock, which the close waits for.
        """
        if self._closed:
            return
        self._closed = True
        self._epochs.active = None
        self._pending = None
        await self._file.close()

    # -- the commit, on the file's worker thread ---------------------------------------------------

    def _commit(
        self, conn: duckdb.DuckDBPyConnection, state: HeldEpoch, coverage: Coverage, commit_id: str
    ) -> _Committed:
        epoch = state.epoch
        conn.begin()
        try:
            holder = self._state.holder(conn)
            if holder is None or holder[0] > epoch.fencing_token:
                token = "nobody" if holder is None else f"fencing token {holder[0]}"
                raise OwnershipLost(
                    f"{token} holds the stream's fence, above this worker's {epoch.fencing_token}; "
                    f"epoch {epoch} was rolled back",
                    where=self._where,
                )
            committed = self._state.read(conn)
            tallies: dict[str, ResourceTally] = {}
            for batch in state.batches:
                self._write(conn, batch, committed, tallies)
            marks = committed.next_watermarks(coverage)
            self._state.record(conn, epoch, commit_id, marks)
            conn.commit()
        except BaseException:
            rollback_quietly(conn)
            raise
        return _Committed(committed.after(epoch, marks), tallies)

    def _write(
        self,
        conn: duckdb.DuckDBPyConnection,
        batch: SinkBatch,
        committed: CommittedEpochs,
        tallies: dict[str, ResourceTally],
    ) -> None:
        table = self._config.table_for(batch.resource)
        label = f"{self._config.schema_name}.{table}"
        where = f"{self._where} table {label}"
        kept = committed.rows_above(batch, where)
        tally = tallies.setdefault(batch.resource, ResourceTally())
        records = kept.records
        if not records.num_rows:
            tally.add(kept)
            return
        key = self._epochs.key
        if key:
            records = upsert_rows(records, key, where)
        with tables.registered(conn, records):
            target = tables.prepare(
                conn,
                self._config.schema_name,
                table,
                tables.described(conn),
                key,
                evolve=self._config.schema_evolution,
                where=where,
            )
            try:
                if key:
                    tables.merge(conn, target, key)
                else:
                    tables.insert(conn, target)
            except duckdb.Error as exc:
                if not is_row_error(exc):
                    raise
                first = kept.identities.at(batch.domain, 0)
                last = kept.identities.positions[-1]
                raise DataError(
                    f"the destination refused a row of the batch: {str(exc).strip().splitlines()[0]}",
                    where=f"{where} @ {first} .. {last}",
                ) from exc
        tally.add(kept, records.num_rows)

    # -- helpers ------------------------------------------------------------------------------------

    async def _check_usable(self) -> None:
        if self._closed:
            raise LifecycleError("the session is closed", where=self._where)
        if self._pending is not None:
            await self._resolve()

    async def _resolve(self) -> None:
        """The outcome of a commit its caller gave up on: wait for it to end (the file's lock), then
        read the stream's commit id back."""
        assert self._pending is not None
        state, commit_id = self._pending
        try:
            found = await self._file.call("reading back a commit", self._read_commit_id)
        except FaucetError as exc:
            raise UncertainOutcome(
                f"the commit of epoch {state.epoch} was given up on and its outcome cannot be read back: "
                f"{exc.message}",
                where=self._where,
            ) from exc
        self._pending = None
        if found == commit_id:
            self._epochs.active = None  # it committed: the epoch is over
        else:
            state.failed = True  # it rolled back: only abort remains

    def _read_commit_id(self, conn: duckdb.DuckDBPyConnection) -> str | None:
        with conn.cursor() as probe:
            holder = self._state.holder(probe)
        return None if holder is None else holder[1]

    def _table_label(self, resource: str) -> str:
        return f"{self._config.schema_name}.{self._config.table_for(resource)}"

    def _receipts(self, tallies: dict[str, ResourceTally]) -> tuple[Receipt, ...]:
        receipts = []
        for resource, tally in sorted(tallies.items()):
            details: dict[str, str] = {
                # DuckDB's catalog name of the file (its stem): database.schema.table is DuckDB's
                # own full name of the table, as dagster/table_name states it.
                "database": self._file.path.stem,
                "file": str(self._file.path),
                "table": self._table_label(resource),
                "policy": self._policy.value,
            }
            receipts.append(Receipt(resource, tally.written, tally.skipped, details | tally.positions()))
        return tuple(receipts)


__all__ = ["POLICIES", "DuckDbStreamingSink", "DuckDbStreamingSinkSession"]
