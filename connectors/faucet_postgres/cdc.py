"""PostgreSQL change data capture: a StreamSource reading a logical replication slot through pgoutput.

What it emits
    CHANGES in strict commit order. Source transactions become ``TransactionBegin``, their rows
    (resource ``schema.table``), ``TransactionEnd`` at a commit LSN; complete transactions read
    together are delivered as one group (one pair of controls ending at the group's last commit), so a
    backlog of small transactions costs little per transaction. A group without rows of the selected
    tables (heartbeats, say) becomes a ``ProgressBoundary`` at its last commit LSN. A row
    holds the table's columns (typed, see :mod:`faucet_postgres.pgoutput`), the operation in
    ``__faucet_op`` (``insert``, ``update``, ``delete``, ``truncate``) and, in ``__faucet_unchanged``,
    the TOASTed columns an update did not send (null and "keep the destination's value"). An insert or
    update carries the whole new row; a delete carries the replica identity key (the whole old row
    under ``REPLICA IDENTITY FULL``), its other columns null. An update that changes the key becomes a
    delete of the old key followed by an insert of the new row, so applying changes in order by key
    is always right; TOASTed columns it left out are named on the insert (keep the old row's values).
    A TRUNCATE becomes one ``truncate`` row (every data column null) per selected table.

Positions and identity
    One ordering domain per slot: ``OrderingDomain("postgres", slot, "", incarnation,
    "postgres.lsn")``. A position ``X`` means "every transaction whose commit LSN is at most ``X``";
    the position of a transaction is its commit LSN (the LSN of its commit record, as pgoutput's
    Begin message gives it), so rows can be written before the transaction's end is read. A row's
    event identity is (domain, commit LSN, ordinal), the ordinal numbering the rows of the
    transaction in source order; re-reading yields the same identities. The incarnation is
    ``<system identifier>:<slot>:<marker>``: ``marker`` is a UUID that :func:`setup_replication`
    records in ``faucet_cdc_slots`` whenever it creates the slot, so a slot dropped and created again
    through it is another incarnation, and a server restored elsewhere with another system
    identifier is too.

Reading without consuming
    The slot is never consumed by a read. A session copies the slot into a temporary slot of its own
    connection (``pg_copy_logical_replication_slot``, which starts exactly where the slot is) and
    consumes the copy with ``pg_logical_slot_get_binary_changes`` through a server-side cursor,
    ``changes_per_call`` messages per call. PostgreSQL decodes a transaction whole at its commit, so
    every call ends at a transaction end, and the cursor hands its rows over in chunks: a
    transaction of any size is written to the pipeline in ``batch_rows`` pieces and certified only at
    its end. The copy goes away with the connection (PostgreSQL also drops it on any error of that
    connection); after an interrupted or failed read the session makes a new copy and moves it to the
    last boundary it delivered. A read ends at the first transaction end after one of its limits
    (records, bytes, age), even inside a call: the rest of the call is dropped with the copy, which
    the next read replaces (after the acknowledgement, so nothing is decoded twice). Each call
    decodes up to the WAL insert position read just before it, with the WAL flushed that far (see
    ``_flushed_through``): decoding to a flush position that lies inside a record would wait for a
    transaction left open elsewhere in the cluster.

Acknowledgement
    ``acknowledge`` awaits ``authority()`` and then ``pg_replication_slot_advance(slot, X + 1)``:
    PostgreSQL skips a transaction whose commit record starts before the slot's confirmed position,
    so ``X + 1`` releases exactly the transactions at or before ``X``. A slot confirmed past the
    certified position, a missing slot, invalidated WAL or another incarnation raise
    :class:`PositionUnavailable` or :class:`IncarnationChanged` on open and on acknowledgement; the
    session never restarts silently from the slot's current position. A stream without a certified
    position starts where ``setup_replication`` created the slot and refuses a slot already moved
    past that point.

Heartbeat
    A read that finds nothing, when the stream has had no boundary for ``heartbeat_interval``
    seconds, writes ``pg_logical_emit_message(true, 'faucet-heartbeat', slot)`` in a transaction of
    its own. Its commit comes back as a progress boundary, whose acknowledgement moves the slot (and
    the WAL it holds) forward while the published tables are idle.

Snapshot
    With ``snapshot``, a stream without a certified position first reads its tables at one point:
    a replication connection creates a temporary slot with ``EXPORT_SNAPSHOT``, whose consistent
    point ``P`` is exactly the boundary between the transactions the exported snapshot sees and the
    ones logical decoding delivers from ``P``; the session imports that snapshot (``SET TRANSACTION
    SNAPSHOT``, REPEATABLE READ) and reads each table through a cursor (honouring the publication's
    column lists and row filters), as inserts of one source transaction at position ``P - 1``; then
    it moves its copy of the slot to ``P``. No change is both in the snapshot and delivered, and none
    is in neither.

Requires PostgreSQL 15 or later, ``wal_level = logical``, a UTF-8 database and a role with the
REPLICATION attribute (the snapshot also needs a replication connection to be allowed).

Modules: :mod:`.cdc_server` (connections, server and slot facts), :mod:`.cdc_setup` (publication,
slot and marker), :mod:`.cdc_slot` (attach, acknowledge, close), :mod:`.cdc_session` (reading and
decoding), :mod:`.cdc_snapshot` (the snapshot), :mod:`.cdc_rows` (change rows and the transaction
writer); this module holds the source and names what other code imports.
"""

from collections.abc import Sequence
from typing import Any

from faucet_dagster.protocol import (
    CancelToken,
    DomainCoverage,
    Emits,
    Membership,
    Operation,
    Ordering,
    Position,
    PositionCodec,
    PositionUnavailable,
    Replay,
    SourceCapabilities,
    StreamRecordSink,
    StreamSource,
    WorkerIdentity,
)
from faucet_postgres.cdc_config import PostgresCdcConfig
from faucet_postgres.cdc_server import CODEC, MIN_SERVER_VERSION, SOURCE
from faucet_postgres.cdc_session import PostgresCdcSession
from faucet_postgres.cdc_setup import ReplicationSetup, setup_replication


class PostgresCdcSource(StreamSource):
    """The change source of one slot and publication; building it does no I/O."""

    connector_name = "postgres"

    def __init__(self, config: PostgresCdcConfig) -> None:
        self.config = config

    def capabilities(self) -> SourceCapabilities:
        """CHANGES in strict commit order with transaction boundaries; bounded with ``stop_at_open``."""
        return SourceCapabilities(
            emits=Emits.CHANGES,
            operations=frozenset({Operation.INSERT, Operation.UPDATE, Operation.DELETE, Operation.TRUNCATE}),
            ordering=Ordering.STRICT_GLOBAL,
            replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
            bounded=self.config.stop_at_open,
            continuous=not self.config.stop_at_open,
            # A new snapshot is taken at another point on every attempt: re-reading a stream that
            # has none certified yields other rows (the runner then never re-reads it, see
            # faucet_dagster.runner.continuous). From a certified position, decoding is deterministic.
            deterministic=not self.config.snapshot,
            transaction_boundaries=True,
            event_identity=True,
        )

    def codecs(self) -> Sequence[PositionCodec[Any]]:
        return (CODEC,)

    async def replay(self, coverage: DomainCoverage, sink: StreamRecordSink, cancel: CancelToken) -> None:
        """A certified range cannot be re-read (``faucet verify`` says so, never "ok"): the slot
        confirmed it when its epoch was acknowledged, and logical decoding never delivers again what a
        slot confirmed (the WAL behind it is recycled)."""
        raise PositionUnavailable(
            f"the change stream after {coverage.start} up to {coverage.end} was confirmed to slot "
            f"{self.config.slot} when its epoch was certified; a replication slot never delivers again what "
            "it confirmed",
            where=str(coverage.domain),
        )

    async def setup_replication(self, tables: Sequence[str] = ()) -> ReplicationSetup:
        """Create (or complete) this source's publication, marker and slot: :func:`setup_replication`
        with this source's config. What ``faucet cdc setup`` and ``FaucetConnection.setup_replication``
        call, through the connector registry."""
        return await setup_replication(self.config, tables)

    async def open(
        self,
        resources: Sequence[str],
        resume_positions: Sequence[Position],
        membership: Membership,
        worker: WorkerIdentity,
    ) -> PostgresCdcSession:
        """Check the slot against the certified position and copy it; see the module docstring.

        ``resources`` are ``schema.table`` names of published tables (none: ``config.tables``, or
        every table of the publication). The slot is one domain (partition ``""``): a worker whose
        ``membership`` does not own it gets a session that reads nothing.
        """
        session = PostgresCdcSession(self.config, membership.owns(self.config.slot, ""))
        await session.start(resources or self.config.tables, resume_positions)
        return session


__all__ = [
    "MIN_SERVER_VERSION",
    "SOURCE",
    "PostgresCdcSession",
    "PostgresCdcSource",
    "ReplicationSetup",
    "setup_replication",
]
