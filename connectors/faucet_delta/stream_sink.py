"""The Delta Lake streaming sink: one Delta commit per epoch, its watermarks and owner fence inside.

Every resource of the stream lands in one table (``uri``): an epoch is one commit, never one per
table. Epoch lifecycle:

* ``begin_epoch`` starts collecting the epoch: nothing is sent to the table yet;
* ``apply`` checks the batch (UPSERT: a row without its key is refused at once, DataError naming its
  event identity) and keeps it, as Arrow, until the commit: an epoch's rows are held in memory, as
  large as the stream's read limits let an epoch grow;
* ``commit_epoch`` loads the table's latest snapshot, reads the stream's state from it (below), fails
  with :class:`OwnershipLost` if a higher fencing token claimed the stream, drops every row at or
  below its domain's watermark (a replay: :class:`CommittedEpochs`), and writes the rest in ONE Delta
  commit based on that snapshot: APPEND through ``write_deltalake(mode="append")``, UPSERT through
  MERGE on the key (the last row of a key in the epoch wins), a column the table lacks merged into
  its schema, a missing table created. An epoch with no row left still commits (no files): the
  watermark moves. The only case that commits nothing is an epoch without rows before the table
  exists: there is nothing to protect (``last_committed`` stays None, so the runner has nothing to
  reconcile);
* ``abort_epoch`` drops the collected batches: nothing of the epoch reached the table.

The stream's state is in the table's log, written by the epoch's own commit:

* transaction identifiers (``CommitProperties.app_transactions``): ``<app>:epoch:<stream>`` at the
  epoch's sequence, ``<app>:owner:<stream>`` at the epoch's fencing token, and, for every domain whose
  positions are integers (Kafka offsets, JetStream sequences), ``<app>:watermark:<stream>@<source>/
  <resource>/<partition>`` at its watermark, readable by any Delta client (``transaction_version``);
* the commit's metadata (``faucet.stream``, ``faucet.epoch``, ``faucet.epoch_token`` and
  ``faucet.watermarks``, every domain's watermark with its incarnation and codec), from which
  ``last_committed`` and the next commit read the exact positions: the newest commit of the stream
  whose epoch is the snapshot's ``<app>:epoch:<stream>`` version (searched in the log's history; a commit
  the log's retention removed raises IntegrityError).

Why a replay is skipped atomically and fencing is real: a commit carries the stream's identifiers,
and Delta's optimistic commit fails a transaction when a commit that landed after its snapshot wrote
an identifier it carries (delta-rs: ConcurrentTransaction). So the rows are judged, and the fence
checked, against the snapshot the commit is based on, and any other commit of the stream since (an
uncertain earlier commit, a newer owner's claim) makes this one conflict: it is retried from a fresh
snapshot, where the watermark or the higher token is seen. ``open`` claims the stream: an empty
commit setting ``<app>:owner:<stream>`` to the worker's token (refused with OwnershipLost when a
higher one holds it). Before the table exists there is nothing to hold a claim: the first commit
(which creates the table) carries the owner's token, and a stale worker can commit one epoch that
creates the table after a newer one opened; its rows are then below the watermarks the newer worker's
commits read, so nothing is duplicated.

Writers of the table in one process take turns under the bounded sink's process-wide lock; other
processes are met by Delta's optimistic commit (a conflict is retried from a fresh snapshot up to
``COMMIT_ATTEMPTS`` times, then raised as the retryable CommitConflict).

Stores. The table is local or on S3, located and reached as the bounded sink's (``uri`` and ``s3``,
:class:`DeltaSinkConfig`): on S3 the log entry of a commit is a conditional put, so the optimistic
commit above holds between processes there too.

Uncertain commits. The commit runs in a worker thread; a caller that gives up waiting (cancelled)
leaves it to finish. The next call, or ``close_session``, waits for it and learns its outcome from its
result. ``close_session`` returning means nothing of the session can land later.
"""

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import PurePath, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError

from faucet_dagster.protocol import (
    CommittedEpochs,
    ConfigError,
    Coverage,
    Durability,
    EpochId,
    HeldEpoch,
    HeldEpochs,
    IntegerPositionCodec,
    IntegrityError,
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
    WorkerIdentity,
    WritePolicy,
    default_codec_registry,
    upsert_rows,
)
from faucet_delta.sink import DeltaSink, arrow_schema, merge_by_key
from faucet_delta.stream_config import DeltaStreamingSinkConfig

POLICIES = frozenset({WritePolicy.APPEND, WritePolicy.UPSERT})
COMMIT_ATTEMPTS = 5
"""Commits tried from a fresh snapshot when another writer's commit conflicts, before CommitConflict."""
STREAM, EPOCH, EPOCH_TOKEN, WATERMARKS = (
    "faucet.stream",
    "faucet.epoch",
    "faucet.epoch_token",
    "faucet.watermarks",
)
"""The commit metadata keys that hold a stream's committed epoch and watermarks."""
HISTORY_LIMITS = (16, 1000, None)
"""How many of the newest commits to search for the stream's last epoch, in turn (None: all)."""


@dataclass(frozen=True)
class _Committed:
    """What a commit did: the table's version after it (None: nothing committed) and the tallies."""

    version: int | None
    tallies: dict[str, ResourceTally]


class _StreamTable:
    """One stream's state in the table and its commits; blocking, run in a worker thread under the
    table's lock (through the bounded sink's ``_run``, which also turns delta-rs errors into
    FaucetErrors)."""

    def __init__(
        self,
        config: DeltaStreamingSinkConfig,
        stream: str,
        policy: WritePolicy,
        key: tuple[str, ...],
        before_commit: Callable[[], None] | None,
    ) -> None:
        self.config = config
        self.table = DeltaSink(config.table())
        self.stream = stream
        self.policy = policy
        self.key = key
        # A kind after the table's app id, then the stream: no stream's name can spell another
        # stream's identifier of another kind.
        app = config.table().transaction_app_id()
        self.epoch_app = f"{app}:epoch:{stream}"
        self.owner_app = f"{app}:owner:{stream}"
        self._watermark_app = f"{app}:watermark:{stream}"
        self.where = f"{self.table.dataset_uri()} stream {stream}"
        local = self.table._local
        self.folder: PurePath = local if local is not None else PurePosixPath(urlsplit(self.table.uri).path)
        """The table's folder (on S3, its path in the bucket)."""
        self._before_commit = before_commit

    def domain_app(self, domain: OrderingDomain) -> str:
        return f"{self._watermark_app}@{'/'.join(domain.lineage)}"

    # -- the state in the log ---------------------------------------------------------------------

    def state(self, table: DeltaTable | None) -> tuple[CommittedEpochs, int | None]:
        """The stream's committed epoch and watermarks, and the owner's fencing token, in ``table``'s
        snapshot."""
        if table is None:
            return CommittedEpochs(), None
        owner = table.transaction_version(self.owner_app)
        sequence = table.transaction_version(self.epoch_app)
        if sequence is None:
            return CommittedEpochs(), owner
        snapshot = table.version()
        for limit in HISTORY_LIMITS:
            commits = table.history(limit)
            for commit in commits:
                if (
                    int(commit.get("version", -1)) <= snapshot
                    and commit.get(STREAM) == self.stream
                    and commit.get(EPOCH) == str(sequence)
                ):
                    return _parse_state(self.stream, commit), owner
            if limit is None or len(commits) < limit:
                break
        raise IntegrityError(
            f"the table's log records epoch {sequence} of the stream, but not the commit that wrote it "
            "(the log's retention removed it): its watermarks cannot be read",
            where=self.where,
        )

    def read(self) -> CommittedEpochs:
        return self.state(self.table.open_table())[0]

    def claim(self, token: int) -> bool:
        """Record ``token`` as the stream's owner (an empty commit) unless a higher one holds it:
        False then. A missing table holds no claim (its first commit will)."""
        for attempt in range(COMMIT_ATTEMPTS):
            table = self.table.checked_table()
            if table is None:
                return True
            owner = table.transaction_version(self.owner_app)
            if owner is not None and owner >= token:
                return owner == token
            try:
                self._write_empty(table, [Transaction(self.owner_app, token)], {STREAM: self.stream})
                return True
            except CommitFailedError:
                if attempt + 1 == COMMIT_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    # -- the epoch's commit -----------------------------------------------------------------------

    def commit(self, state: HeldEpoch, coverage: Coverage) -> _Committed:
        """The epoch in one commit, retried from a fresh snapshot when another commit conflicts."""
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                return self._commit_once(state, coverage)
            except CommitFailedError:
                if attempt + 1 == COMMIT_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _commit_once(self, state: HeldEpoch, coverage: Coverage) -> _Committed:
        epoch = state.epoch
        table = self.table.checked_table()
        committed, owner = self.state(table)
        if owner is not None and owner > epoch.fencing_token:
            raise OwnershipLost(
                f"fencing token {owner} holds the stream, above this worker's {epoch.fencing_token}; "
                f"epoch {epoch} was not committed",
                where=self.where,
            )
        tallies: dict[str, ResourceTally] = {}
        parts: list[pa.Table] = []
        for batch in state.batches:
            kept = committed.rows_above(batch, self.where)
            tallies.setdefault(batch.resource, ResourceTally()).add(kept)
            if kept.records.num_rows:
                parts.append(self.table.conformed(kept.records, table))
        marks = committed.next_watermarks(coverage)
        transactions = [
            Transaction(self.epoch_app, epoch.sequence),
            Transaction(self.owner_app, epoch.fencing_token),
        ]
        registry = default_codec_registry()
        for mark in marks:
            codec = registry.get(mark.domain.codec)
            if isinstance(codec, IntegerPositionCodec):
                transactions.append(
                    Transaction(self.domain_app(mark.domain), int(codec.validate(mark.value)))
                )
        after = committed.after(epoch, marks)
        metadata = {
            STREAM: self.stream,
            EPOCH: str(epoch.sequence),
            EPOCH_TOKEN: str(epoch.fencing_token),
            WATERMARKS: json.dumps([asdict(mark) for mark in after.watermarks.values()]),
        }
        if not parts:
            if table is None:
                return _Committed(None, tallies)  # nothing written, nothing to protect
            if self._before_commit is not None:
                self._before_commit()
            return _Committed(self._write_empty(table, transactions, metadata), tallies)
        data = pa.concat_tables(parts, promote_options="permissive")
        if self.key:
            data = pa.Table.from_batches([upsert_rows(_one_batch(data), self.key, self.where)])
        properties = CommitProperties(app_transactions=transactions, custom_metadata=metadata)
        if self._before_commit is not None:
            self._before_commit()
        if table is not None and self.key:
            merge_by_key(table, data, self.key, evolve=self.config.schema_evolution, properties=properties)
            return _Committed(table.version(), tallies)
        evolve = self.config.schema_evolution and table is not None
        uri, options = self.table.uri, self.table._options
        try:
            write_deltalake(
                table if table is not None else uri,
                data,
                storage_options=None if table is not None else options,
                # The first commit creates the table, or fails if another writer created it since the
                # snapshot was read: then its state must judge these rows (retried as a conflict).
                mode="append" if table is not None else "error",
                schema_mode="merge" if evolve else None,
                partition_by=(list(self.config.partition_by) or None) if table is None else None,
                commit_properties=properties,
            )
        except DeltaError as exc:
            if table is None and DeltaTable.is_deltatable(uri, storage_options=options):
                raise CommitFailedError(f"another writer created the table: {exc}") from exc
            raise
        created = table if table is not None else DeltaTable(uri, storage_options=options)
        return _Committed(created.version(), tallies)

    def _write_empty(
        self, table: DeltaTable, transactions: list[Transaction], metadata: dict[str, str]
    ) -> int:
        """A commit without files: the transaction identifiers and metadata only."""
        empty = pa.Table.from_batches([], schema=arrow_schema(table))
        properties = CommitProperties(app_transactions=transactions, custom_metadata=metadata)
        write_deltalake(table, empty, mode="append", commit_properties=properties)
        return int(table.version())


def _one_batch(data: pa.Table) -> pa.RecordBatch:
    batches = data.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=data.schema)


def _parse_state(stream: str, commit: dict[str, Any]) -> CommittedEpochs:
    """The state an epoch's commit metadata recorded."""
    epoch = EpochId(stream, int(commit[EPOCH]), int(commit[EPOCH_TOKEN]))
    marks = [
        Position(OrderingDomain(**item["domain"]), str(item["value"]))
        for item in json.loads(str(commit[WATERMARKS]))
    ]
    return CommittedEpochs.of(epoch, marks)


class DeltaStreamingSink(StreamingSink):
    """The continuous Delta sink; see the module docstring. ``before_commit`` runs in the commit's
    thread right before the Delta commit, after its snapshot was read (tests inject a fault there)."""

    connector_name = "delta"

    def __init__(
        self, config: DeltaStreamingSinkConfig, *, before_commit: Callable[[], None] | None = None
    ) -> None:
        self.config = config
        self._before_commit = before_commit

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(
            # This object is the streaming role; the bounded sink declares its own policies.
            bounded_policies=frozenset(),
            continuous_policies=POLICIES,
            requires_key=frozenset({WritePolicy.UPSERT}),
            durability=Durability.TRANSACTIONAL,
            atomic_watermark=True,
            owner_fencing=True,
            schema_evolution=self.config.schema_evolution,
        )

    async def check(self) -> None:
        await DeltaSink(self.config.table()).check()

    async def open(
        self, stream: str, policy: WritePolicy, key: Sequence[str], worker: WorkerIdentity
    ) -> "DeltaStreamingSinkSession":
        """Claim the stream's owner fence in the table (when it exists) with the worker's token."""
        table = _StreamTable(self.config, stream, policy, tuple(key), self._before_commit)
        if policy not in POLICIES:
            raise ConfigError(f"policy {policy.value} is not a continuous Delta policy", where=table.where)
        if policy is WritePolicy.UPSERT and not key:
            raise ConfigError("policy upsert needs a key", where=table.where)
        if policy is WritePolicy.APPEND:
            table.key = ()
        claimed = await table.table.call("claiming the stream", table.claim, worker.fencing_token)
        if not claimed:
            raise OwnershipLost(
                f"a fencing token above {worker.fencing_token} holds the stream at the destination",
                where=table.where,
            )
        return DeltaStreamingSinkSession(table, worker)


class DeltaStreamingSinkSession(StreamingSinkSession):
    """One session of one stream on one table. Calls are serialized by the runner."""

    def __init__(self, table: _StreamTable, worker: WorkerIdentity) -> None:
        self._table = table
        self._where = table.where
        self._epochs = HeldEpochs(table.stream, worker.fencing_token, table.key, table.where)
        self._pending: asyncio.Future[_Committed] | None = None
        """A commit given up on (cancelled) before it ended: its outcome is its result."""
        self._closed = False

    async def last_committed(self) -> SinkCommitState | None:
        await self._check_usable()
        found = await self._table.table.call("reading the last committed epoch", self._table.read)
        return found.state()

    async def begin_epoch(self, epoch: EpochId) -> None:
        await self._check_usable()
        self._epochs.begin(epoch)

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        """Keep ``batch`` for the commit; UPSERT: a row without its key fails the epoch at once."""
        await self._check_usable()
        self._epochs.hold(epoch, batch, self._where)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        """The fence check, the rows above the watermarks and the stream's state in one Delta commit."""
        await self._check_usable()
        state = self._epochs.committable(epoch)
        pending = asyncio.ensure_future(
            self._table.table.call(f"committing epoch {epoch}", self._table.commit, state, coverage)
        )
        self._pending = pending
        try:
            done = await asyncio.shield(pending)
        except asyncio.CancelledError:
            raise  # the commit may still finish: the next call waits for its outcome
        except BaseException:
            self._pending = None
            state.failed = True
            raise
        self._pending = None
        self._epochs.active = None
        return self._receipts(done)

    async def abort_epoch(self, epoch: EpochId) -> None:
        """Drop the epoch's batches: nothing of it reached the table (a failed commit wrote no log
        entry; Parquet files it may have written are unreferenced, removed by a later VACUUM)."""
        await self._check_usable()
        self._epochs.current(epoch, "abort")
        self._epochs.active = None

    async def close_session(self) -> None:
        """Wait for a commit still running (given up on by its caller): then nothing can land later."""
        if self._closed:
            return
        self._closed = True
        self._epochs.active = None
        pending, self._pending = self._pending, None
        if pending is not None:
            await asyncio.wait([pending])
            pending.exception()  # its outcome no longer matters: retrieved, never reported twice

    # -- helpers ------------------------------------------------------------------------------------

    async def _check_usable(self) -> None:
        if self._closed:
            raise LifecycleError("the session is closed", where=self._where)
        pending = self._pending
        if pending is None:
            return
        await asyncio.wait([pending])
        self._pending = None
        if pending.exception() is None:
            self._epochs.active = None  # it committed: the epoch is over
        elif self._epochs.active is not None:
            self._epochs.active.failed = True  # it failed: only abort remains

    def _receipts(self, done: _Committed) -> tuple[Receipt, ...]:
        receipts = []
        for resource, tally in sorted(done.tallies.items()):
            path = self._table.folder
            details: dict[str, str] = {
                # The folder holding the table and the table's folder: dagster/table_name, as the
                # bounded sink states it (lake.orders).
                "database": path.parent.name,
                "table": path.name,
                "uri": self._table.table.dataset_uri(),
                "policy": self._table.policy.value,
            }
            if done.version is not None:
                details["version"] = str(done.version)
            receipts.append(Receipt(resource, tally.written, tally.skipped, details | tally.positions()))
        return tuple(receipts)


__all__ = ["POLICIES", "DeltaStreamingSink", "DeltaStreamingSinkSession"]
