"""PostgreSQL change data capture: a StreamSource reading a logical replication slot through pgoutput.

What it emits
    CHANGES in strict commit order. Each source transaction becomes ``TransactionBegin``, its rows
    (resource ``schema.table``), ``TransactionEnd`` at its commit LSN; a transaction without rows of
    the selected tables (a heartbeat, say) becomes a ``ProgressBoundary`` at its commit LSN. A row
    holds the table's columns (typed, see :mod:`faucet_postgres.pgoutput`), the operation in
    ``__faucet_op`` (``insert``, ``update``, ``delete``) and, in ``__faucet_unchanged``, the TOASTed
    columns an update did not send (null and "keep the destination's value"). An insert or update
    carries the whole new row; a delete carries the replica identity key (the whole old row under
    ``REPLICA IDENTITY FULL``), its other columns null. An update that changes the key becomes a
    delete of the old key followed by an insert of the new row, so applying changes in order by key
    is always right. A TRUNCATE of a selected table raises :class:`UnsupportedOperation`: it has no
    row form, and dropping it silently would leave the replica wrong.

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
    last boundary it delivered. Each call decodes up to the WAL insert position read just before it,
    with the WAL flushed that far (see ``_flushed_through``): decoding to a flush position that lies
    inside a record would wait for a transaction left open elsewhere in the cluster.

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
"""

import asyncio
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
import pyarrow as pa
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.types.string import TextLoader

from faucet_dagster.protocol import (
    Authority,
    CancelToken,
    ConfigError,
    ConnectionFailed,
    Coverage,
    DataError,
    DomainCoverage,
    Emits,
    Identities,
    IncarnationChanged,
    IntegrityError,
    LifecycleError,
    Membership,
    Operation,
    Ordering,
    OrderingDomain,
    Position,
    PositionCodec,
    PositionUnavailable,
    ProgressBoundary,
    ReadLimits,
    Replay,
    SchemaError,
    SourceCapabilities,
    StreamRecordSink,
    StreamSession,
    StreamSource,
    TransactionBegin,
    TransactionEnd,
    UnsupportedOperation,
    WorkerIdentity,
)
from faucet_postgres import pgoutput as pg
from faucet_postgres.cdc_config import HEARTBEAT_PREFIX, MARKER_TABLE, PostgresCdcConfig, qualified_name
from faucet_postgres.codecs import PostgresLsnCodec
from faucet_postgres.common import connect, error_text, pg_error

SOURCE = "postgres"
"""The ``source`` of this connector's ordering domains."""

MIN_SERVER_VERSION = 150000
"""PostgreSQL 15: publication column lists and row filters, which the snapshot honours."""

_CODEC = PostgresLsnCodec()
_FETCH_ROWS = 5_000
_MIN_POLL = 0.05
_INSERT, _UPDATE, _DELETE = Operation.INSERT.value, Operation.UPDATE.value, Operation.DELETE.value
_T = TypeVar("_T")

Connection = psycopg.AsyncConnection[tuple[Any, ...]]


class PostgresCdcSource(StreamSource):
    """The change source of one slot and publication; building it does no I/O."""

    connector_name = "postgres"

    def __init__(self, config: PostgresCdcConfig) -> None:
        self.config = config

    def capabilities(self) -> SourceCapabilities:
        """CHANGES in strict commit order with transaction boundaries; bounded with ``stop_at_open``."""
        return SourceCapabilities(
            emits=Emits.CHANGES,
            operations=frozenset({Operation.INSERT, Operation.UPDATE, Operation.DELETE}),
            ordering=Ordering.STRICT_GLOBAL,
            replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
            bounded=self.config.stop_at_open,
            continuous=not self.config.stop_at_open,
            deterministic=True,
            transaction_boundaries=True,
            event_identity=True,
        )

    def codecs(self) -> Sequence[PositionCodec[Any]]:
        return (_CODEC,)

    async def setup_replication(self, tables: Sequence[str] = ()) -> "ReplicationSetup":
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
    ) -> "PostgresCdcSession":
        """Check the slot against the certified position and copy it; see the module docstring.

        ``resources`` are ``schema.table`` names of published tables (none: ``config.tables``, or
        every table of the publication). The slot is one domain (partition ``""``): a worker whose
        ``membership`` does not own it gets a session that reads nothing.
        """
        session = PostgresCdcSession(self.config, membership.owns(self.config.slot, ""))
        await session.start(resources or self.config.tables, resume_positions)
        return session


@dataclass(frozen=True)
class _Published:
    """A table of the publication, with the columns and row filter pgoutput applies to it."""

    oid: int
    name: str
    columns: tuple[str, ...]
    row_filter: str | None
    partitioned: bool


@dataclass(frozen=True)
class _SlotFacts:
    """What one round trip tells about the server, the slot and its incarnation marker."""

    server_version: int
    wal_level: str
    encoding: str
    system_identifier: str
    flush_lsn: int
    has_publication: bool
    has_markers: bool
    slot_type: str | None
    plugin: str | None
    slot_database: str | None
    database: str
    wal_status: str | None


class _Table:
    """A published table as the stream sees it: its relation, Arrow schema and whether it is read."""

    __slots__ = ("key_indexes", "relation", "resource", "schema", "selected", "where", "width")

    def __init__(self, relation: pg.Relation, selected: bool, key_indexes: tuple[int, ...]) -> None:
        self.relation = relation
        self.selected = selected
        self.resource = relation.qualified_name
        self.key_indexes = key_indexes
        """The columns whose change makes an update a delete and an insert (see :func:`_change_rows`);
        the change rows mark them ``faucet.key`` (under REPLICA IDENTITY FULL: the primary key)."""
        self.schema = pg.relation_schema(relation, key_indexes)
        self.where = f"table {self.resource}"
        self.width = len(relation.columns)

    def batch(self, rows: "_Rows") -> pa.RecordBatch:
        """The Arrow batch of buffered rows (raises :class:`DataError` for a value with no Arrow form)."""
        columns = list(zip(*rows.values, strict=True)) if self.width else []
        arrays = [
            pg.column_array(values, column, self.where)
            for values, column in zip(columns, self.relation.columns, strict=True)
        ]
        arrays.append(pa.array(rows.operations, pa.string()))
        arrays.append(pa.array(rows.unchanged, pa.list_(pa.string())))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


@dataclass
class _Rows:
    """Rows of one table buffered within a transaction, with their ordinals."""

    values: list[Sequence[str | None]] = field(default_factory=list)
    operations: list[str] = field(default_factory=list)
    unchanged: list[list[str] | None] = field(default_factory=list)
    ordinals: list[int] = field(default_factory=list)


class _TransactionWriter:
    """One source transaction at a time: its rows buffered per table, written in pieces, then its end.

    ``TransactionBegin`` goes to the sink before the transaction's first rows; a transaction without
    rows of the selected tables ends as a ``ProgressBoundary``. Rows of one table keep their order;
    ordinals number all rows of the transaction in source order.
    """

    def __init__(self, domain: OrderingDomain, sink: StreamRecordSink, batch_rows: int) -> None:
        self._domain = domain
        self._sink = sink
        self._batch_rows = batch_rows
        self._pending: dict[_Table, _Rows] = {}
        self._buffered = 0
        self._transaction_id = ""
        self._position = -1
        self._canonical = ""
        self._ordinal = 0
        self._begun = False
        self.is_open = False
        self.rows = 0

    @property
    def position(self) -> int:
        return self._position

    def begin(self, transaction_id: str, position: int) -> None:
        if self.is_open:
            raise IntegrityError(
                f"transaction {transaction_id} began inside transaction {self._transaction_id}",
                where=str(self._domain),
            )
        self._transaction_id = transaction_id
        self._position = position
        self._canonical = _CODEC.canonicalize(position)
        self._ordinal = 0
        self._begun = False
        self.is_open = True

    def add(
        self, table: _Table, values: Sequence[str | None], operation: str, unchanged: list[str] | None
    ) -> bool:
        """Buffer one row; True when the buffered rows reached ``batch_rows`` (then call :meth:`flush`)."""
        if not self.is_open:
            raise IntegrityError(
                f"a change of {table.resource} came outside a transaction", where=str(self._domain)
            )
        if len(values) != table.width:
            raise IntegrityError(
                f"a row of {len(values)} values came for {table.width} columns", where=table.where
            )
        rows = self._pending.get(table)
        if rows is None:
            rows = self._pending[table] = _Rows()
        rows.values.append(values)
        rows.operations.append(operation)
        rows.unchanged.append(unchanged)
        rows.ordinals.append(self._ordinal)
        self._ordinal += 1
        self._buffered += 1
        self.rows += 1
        return self._buffered >= self._batch_rows

    async def flush(self) -> None:
        """Write every buffered row to the sink (after ``TransactionBegin``, the first time)."""
        for table in list(self._pending):
            await self.flush_table(table)

    async def flush_table(self, table: _Table) -> None:
        rows = self._pending.pop(table, None)
        if rows is None:
            return
        self._buffered -= len(rows.operations)
        if not self._begun:
            await self._sink.control(TransactionBegin(self._domain, self._transaction_id))
            self._begun = True
        identities = Identities([self._canonical] * len(rows.ordinals), rows.ordinals)
        await self._sink.write(self._domain, table.batch(rows), identities, resource=table.resource)

    async def end(self) -> int:
        """Write the rest and the transaction's boundary; return its position."""
        await self.flush()
        if self._begun:
            await self._sink.control(TransactionEnd(self._domain, self._transaction_id, self._canonical))
        else:
            await self._sink.control(ProgressBoundary(self._domain, self._canonical))
        self.is_open = False
        return self._position


class _Progress:
    """What one read has done against its limits."""

    def __init__(self, limits: ReadLimits) -> None:
        self.limits = limits
        self.started = self.last_new = time.monotonic()
        self.bytes = 0

    def limit_reached(self, rows: int) -> bool:
        limits = self.limits
        return (
            (limits.records is not None and rows >= limits.records)
            or (limits.bytes is not None and self.bytes >= limits.bytes)
            or (limits.age is not None and time.monotonic() - self.started >= limits.age)
        )

    def quiet_long_enough(self) -> bool:
        """True when the idle or the age limit is reached (a read with nothing new then returns)."""
        now = time.monotonic()
        idle, age = self.limits.idle, self.limits.age
        return (idle is not None and now - self.last_new >= idle) or (
            age is not None and now - self.started >= age
        )

    def time_left(self, default: float) -> float:
        now = time.monotonic()
        left = [default]
        if self.limits.idle is not None:
            left.append(self.last_new + self.limits.idle - now)
        if self.limits.age is not None:
            left.append(self.started + self.limits.age - now)
        return max(0.0, min(left))


class _Interrupted(Exception):
    """The cancel token fired while a server call was in flight."""


class PostgresCdcSession(StreamSession):
    """A session on one slot: reads its temporary copy, acknowledges by advancing the slot itself.

    Reads and acknowledgements are serialized; ``close`` waits for the one in progress.
    """

    def __init__(self, config: PostgresCdcConfig, owned: bool) -> None:
        self.config = config
        self._owned = owned
        self._where = _where(config)
        self._publication_option = sql.Identifier(config.publication).as_string()
        self._busy = asyncio.Lock()
        self._conn: Connection | None = None
        self._temp_slot = ""
        self._domain: OrderingDomain | None = None
        self._created_lsn = 0
        self._position: int | None = None
        self._snapshot_pending = False
        self._end: int | None = None
        self._exhausted = False
        self._closed = False
        self._selected: dict[int, str] | None = None
        self._published: dict[int, _Published] = {}
        self._tables: dict[int, _Table] = {}
        self._last_boundary_at = self._last_heartbeat_at = time.monotonic()

    @property
    def domain(self) -> OrderingDomain:
        """The slot's ordering domain (known once the session started)."""
        if self._domain is None:
            raise LifecycleError("the session has not started", where=self._where)
        return self._domain

    @property
    def exhausted(self) -> bool:
        """True once a bounded (``stop_at_open``) session delivered everything it will deliver."""
        return self._exhausted

    async def start(self, resources: Sequence[str], resume_positions: Sequence[Position]) -> None:
        """Check the slot and the certified position, then attach (called once, by ``open``)."""
        if not self._owned:
            return
        resume = [p for p in resume_positions if p.domain.lineage == (SOURCE, self.config.slot, "")]
        if len(resume) > 1:
            raise IntegrityError("two certified positions name this slot", where=self._where)
        await self._attach(resume[0] if resume else None, resources)

    # -- reading ------------------------------------------------------------------------------------

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        async with self._busy:
            if self._closed:
                raise LifecycleError("read after close", where=self._where)
            if not self._owned:
                await _pause(_quiet_budget(limits), cancel)
                return Coverage()
            await self._attached()
            start = self._position
            writer = _TransactionWriter(self.domain, sink, self.config.batch_rows)
            try:
                await self._read_into(writer, _Progress(limits), cancel)
            except _Interrupted:
                # The copy was consumed past what reached the sink: copy again on the next read.
                await self._detach()
            except BaseException:
                await self._detach()
                raise
            if self._position is None or self._position == start:
                return Coverage()
            return Coverage(
                (
                    DomainCoverage(
                        self.domain,
                        None if start is None else _CODEC.canonicalize(start),
                        _CODEC.canonicalize(self._position),
                    ),
                )
            )

    async def _read_into(self, writer: _TransactionWriter, progress: _Progress, cancel: CancelToken) -> None:
        if self._snapshot_pending:
            await self._read_snapshot(writer, progress, cancel)
        backoff = _MIN_POLL
        first = self._position
        while not cancel.cancelled and not self._exhausted:
            if self._position != first and progress.limit_reached(writer.rows):
                return
            rows = writer.rows
            if await self._read_changes(writer, progress, cancel):
                if writer.rows > rows:  # a heartbeat is progress, not something new to wait for
                    progress.last_new = time.monotonic()
                backoff = _MIN_POLL
                continue
            if self._end is not None:
                self._exhausted = True
                return
            if progress.quiet_long_enough():
                return
            await self._heartbeat_if_due()
            await _pause(progress.time_left(backoff), cancel)
            backoff = min(backoff * 2, self.config.poll_interval)

    async def _read_changes(
        self, writer: _TransactionWriter, progress: _Progress, cancel: CancelToken
    ) -> int:
        """One server call: decode up to ``changes_per_call`` messages (whole transactions) into
        ``writer``. Returns how many messages came."""
        conn = self._connection()
        limits = progress.limits
        upto = self.config.changes_per_call
        if limits.records is not None:
            upto = max(1, min(upto, limits.records - writer.rows))
        seen = 0
        try:
            readable = await self._flushed_through(conn)
            end = _CODEC.canonicalize(readable if self._end is None else min(readable, self._end))
            async with conn.transaction():
                cursor = conn.cursor("faucet_cdc_changes", binary=True)
                await cursor.execute(
                    "SELECT data FROM pg_logical_slot_get_binary_changes(%s, %s::pg_lsn, %s, "
                    "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
                    (self._temp_slot, end, upto, self._publication_option),
                )
                tables, decode, insert = self._tables, pg.decode, pg.Insert
                while rows := await self._interruptible(cursor.fetchmany(_FETCH_ROWS), cancel):
                    seen += len(rows)
                    for (data,) in rows:
                        progress.bytes += len(data)
                        message = decode(data)
                        # Inserts inline (no coroutine per row): the bulk of most change streams.
                        if type(message) is insert and (table := tables.get(message.relation_oid)):
                            if table.selected and writer.add(table, message.new.values, _INSERT, None):
                                await writer.flush()
                        else:
                            await self._apply(message, writer)
                await cursor.close()
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading changes", where=self._where) from exc
        return seen

    async def _flushed_through(self, conn: Connection) -> int:
        """A WAL position every record before which is flushed: where a decoding call may stop.

        Left to itself, ``pg_logical_slot_get_changes`` decodes on to the flush position, and when
        that falls inside a record it waits for the rest of the record to be flushed. It does, whenever
        a transaction anywhere in the cluster wrote a record across a page boundary and stays open
        (the WAL writer flushes whole pages): the call then waits until that transaction ends, which
        may be never (the sink's own epoch transaction, on the same server). So the call stops at the
        insert position read here, and when WAL was inserted past the flush position, a transaction
        of our own commits first: its commit flushes the WAL up to it (no row, no change reaches the
        stream: PostgreSQL skips empty transactions).
        """
        try:
            cursor = await conn.execute(
                "SELECT pg_current_wal_insert_lsn()::text, pg_current_wal_flush_lsn()::text"
            )
            row = await cursor.fetchone()
            assert row is not None  # one row by construction
            inserted, flushed = _CODEC.validate(row[0]), _CODEC.validate(row[1])
            if inserted > flushed:
                async with conn.transaction():
                    await conn.execute("SET LOCAL synchronous_commit = on")
                    await conn.execute("SELECT pg_current_xact_id()")
        except psycopg.Error as exc:
            raise pg_error(exc, doing="flushing the WAL to decode", where=self._where) from exc
        return inserted

    async def _apply(self, message: pg.Message, writer: _TransactionWriter) -> None:
        """Route one decoded message into ``writer``."""
        if isinstance(message, pg.Insert):
            table = self._table(message.relation_oid)
            if table.selected and writer.add(table, message.new.values, _INSERT, None):
                await writer.flush()
        elif isinstance(message, pg.Update | pg.Delete):
            table = self._table(message.relation_oid)
            if table.selected:
                for values, operation, unchanged in _change_rows(message, table):
                    if writer.add(table, values, operation, unchanged):
                        await writer.flush()
        elif isinstance(message, pg.Begin):
            if self._position is not None and message.final_lsn <= self._position:
                raise IntegrityError(
                    f"a transaction committed at {_CODEC.canonicalize(message.final_lsn)} came after the "
                    f"position {_CODEC.canonicalize(self._position)} was delivered",
                    where=self._where,
                )
            writer.begin(f"{message.xid}/{_CODEC.canonicalize(message.final_lsn)}", message.final_lsn)
        elif isinstance(message, pg.Commit):
            if not writer.is_open or message.commit_lsn != writer.position:
                raise IntegrityError(
                    f"a commit at {_CODEC.canonicalize(message.commit_lsn)} closes no open transaction",
                    where=self._where,
                )
            self._position = await writer.end()
            self._last_boundary_at = time.monotonic()
        elif isinstance(message, pg.Relation):
            await self._remember(message, writer)
        elif isinstance(message, pg.Truncate):
            names = [self._table(oid).resource for oid in message.relation_oids if self._table(oid).selected]
            if names:
                raise UnsupportedOperation(
                    f"TRUNCATE of {', '.join(names)} in the transaction committed at "
                    f"{_CODEC.canonicalize(writer.position)} has no row form; the replica must be "
                    "rebuilt (a new slot with a snapshot)",
                    where=self._where,
                )
        # Type, Origin and logical messages (heartbeats) carry no rows.

    def _table(self, oid: int) -> _Table:
        table = self._tables.get(oid)
        if table is None:
            raise IntegrityError(
                f"a change names relation {oid} before its Relation message", where=self._where
            )
        return table

    async def _remember(self, relation: pg.Relation, writer: _TransactionWriter) -> _Table:
        """Keep ``relation``'s description; rows buffered under an older one are written first."""
        known = self._tables.get(relation.oid)
        if known is not None and known.relation == relation:
            return known
        if known is not None:
            await writer.flush_table(known)
        selected = self._selected is None or relation.oid in self._selected
        if (
            self._selected is not None
            and selected
            and self._selected[relation.oid] != relation.qualified_name
        ):
            raise SchemaError(
                f"table {self._selected[relation.oid]} was renamed to {relation.qualified_name}: "
                "name the new table in the stream's resources",
                where=self._where,
            )
        keys = tuple(index for index, column in enumerate(relation.columns) if column.key)
        if relation.replica_identity == "f" and selected:
            # FULL flags every column; the primary key (read from the catalog now) tells a key change
            # from an update of other columns. Without one, any change counts.
            keys = await self._primary_key(relation) or keys
        table = self._tables[relation.oid] = _Table(relation, selected, keys)
        return table

    async def _primary_key(self, relation: pg.Relation) -> tuple[int, ...]:
        try:
            cursor = await self._connection().execute(
                "SELECT a.attname::text FROM pg_index AS i JOIN pg_attribute AS a "
                "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey::int2[]) "
                "WHERE i.indrelid = %s AND i.indisprimary",
                (relation.oid,),
            )
            names = {row[0] for row in await cursor.fetchall()}
        except psycopg.Error as exc:
            raise pg_error(
                exc, doing="reading a primary key", where=f"table {relation.qualified_name}"
            ) from exc
        return tuple(index for index, column in enumerate(relation.columns) if column.name in names)

    async def _heartbeat_if_due(self) -> None:
        interval = self.config.heartbeat_interval
        now = time.monotonic()
        if interval <= 0 or now - max(self._last_boundary_at, self._last_heartbeat_at) < interval:
            return
        self._last_heartbeat_at = now
        try:
            await self._connection().execute(
                "SELECT pg_logical_emit_message(true, %s, %s)", (HEARTBEAT_PREFIX, self.config.slot)
            )
        except psycopg.Error as exc:
            raise pg_error(exc, doing="writing a heartbeat", where=self._where) from exc

    async def _interruptible(self, operation: Awaitable[_T], cancel: CancelToken) -> _T:
        """Await a server call; if ``cancel`` fires first, cancel it on the server, raise _Interrupted."""
        task = asyncio.ensure_future(operation)
        waiter = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        await self._connection().cancel_safe()
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # the cancelled query's error; the session is detached by the caller
        raise _Interrupted

    # -- the snapshot -------------------------------------------------------------------------------

    async def _read_snapshot(
        self, writer: _TransactionWriter, progress: _Progress, cancel: CancelToken
    ) -> None:
        """Deliver every selected table at one exported snapshot, then move the copy to its point."""
        conn = self._connection()
        export = await _connect(self.config, replication=True)
        try:
            try:
                cursor = export.cursor()
                await cursor.execute(
                    sql.SQL("CREATE_REPLICATION_SLOT {} TEMPORARY LOGICAL pgoutput EXPORT_SNAPSHOT").format(
                        sql.Identifier(f"{self._temp_slot}_x")
                    )
                )
                created = await cursor.fetchone()
            except psycopg.Error as exc:
                raise pg_error(exc, doing="exporting a snapshot", where=self._where) from exc
            if created is None:
                raise IntegrityError("CREATE_REPLICATION_SLOT returned nothing", where=self._where)
            point = _CODEC.validate(created[1])
            try:
                async with conn.transaction():
                    await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                    await conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(created[2])))
                    await export.close()  # the imported snapshot stays valid in this transaction
                    writer.begin(f"snapshot/{_CODEC.canonicalize(point)}", point - 1)
                    for published in self._snapshot_tables():
                        await self._snapshot_table(conn, published, writer, cancel)
            except psycopg.Error as exc:
                raise pg_error(exc, doing="reading the snapshot", where=self._where) from exc
        finally:
            await export.close()
        await self._advance(conn, self._temp_slot, point)
        self._position = await writer.end()
        self._snapshot_pending = False
        self._last_boundary_at = time.monotonic()
        progress.last_new = self._last_boundary_at

    def _snapshot_tables(self) -> list[_Published]:
        oids = self._published if self._selected is None else self._selected
        return sorted((self._published[oid] for oid in oids), key=lambda published: published.name)

    async def _snapshot_table(
        self, conn: Connection, published: _Published, writer: _TransactionWriter, cancel: CancelToken
    ) -> None:
        relation = await _catalog_relation(conn, published)
        table = await self._remember(relation, writer)
        schema, name = qualified_name(published.name)
        query = sql.SQL("SELECT {columns} FROM {only}{table}{where}").format(
            columns=sql.SQL(", ").join(sql.Identifier(column.name) for column in relation.columns),
            only=sql.SQL("" if published.partitioned else "ONLY "),
            table=sql.Identifier(schema, name),
            where=sql.SQL(f" WHERE {published.row_filter}" if published.row_filter else ""),
        )
        cursor = conn.cursor("faucet_cdc_snapshot")
        for column in relation.columns:
            # The output function's text, as pgoutput sends it: one parser for snapshot and changes.
            cursor.adapters.register_loader(column.type_oid, TextLoader)
        await cursor.execute(query)
        while rows := await self._interruptible(cursor.fetchmany(self.config.batch_rows), cancel):
            for row in rows:
                if writer.add(table, row, _INSERT, None):
                    await writer.flush()
        await cursor.close()

    # -- acknowledgement ----------------------------------------------------------------------------

    async def acknowledge(self, coverage: Coverage, authority: Authority) -> None:
        """Advance the slot to each certified end (+1), each advance preceded by ``authority()``."""
        async with self._busy:
            if self._closed:
                raise LifecycleError("acknowledge after close", where=self._where)
            for item in coverage.domains:
                if item.domain != self._domain:
                    raise IntegrityError(
                        f"coverage of {item.domain} was handed to the session of {self._domain}",
                        where=self._where,
                    )
                target = _CODEC.validate(item.end) + 1
                await authority()
                await self._acknowledge(target, item.domain)

    async def _acknowledge(self, target: int, domain: OrderingDomain) -> None:
        conn = await self._attached()
        try:
            cursor = await conn.execute(
                sql.SQL(
                    "SELECT s.confirmed_flush_lsn::text, m.incarnation::text FROM (SELECT 1) AS one "
                    "LEFT JOIN pg_replication_slots AS s ON s.slot_name = %s "
                    "LEFT JOIN {} AS m ON m.slot_name = %s"
                ).format(sql.Identifier(self.config.metadata_schema, MARKER_TABLE)),
                (self.config.slot, self.config.slot),
            )
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            await self._detach()
            raise pg_error(exc, doing="reading the slot before acknowledging", where=self._where) from exc
        assert row is not None  # one row by construction
        confirmed, marker = row
        wanted = _CODEC.canonicalize(target)
        if confirmed is None:
            raise PositionUnavailable(
                f"the slot was dropped; {wanted} cannot be acknowledged", where=self._where
            )
        if marker is None or not domain.incarnation.endswith(f":{marker}"):
            raise IncarnationChanged(
                "the slot was created again since this session opened; nothing is acknowledged",
                where=self._where,
            )
        order = _CODEC.compare(_CODEC.validate(confirmed), target)
        if order > 0:
            raise PositionUnavailable(
                f"the slot is confirmed at {confirmed}, past the certified {wanted}: "
                "it was advanced out of band",
                where=self._where,
            )
        if order < 0:
            await self._advance(conn, self.config.slot, target)

    async def _advance(self, conn: Connection, slot: str, target: int) -> None:
        """``pg_replication_slot_advance(slot, target)``, checked to have reached ``target``."""
        wanted = _CODEC.canonicalize(target)
        try:
            cursor = await conn.execute(
                "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, wanted)
            )
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            await self._detach()
            if exc.sqlstate == "42704":  # undefined_object: the slot is gone
                raise PositionUnavailable(f"slot {slot} was dropped", where=self._where) from exc
            if exc.sqlstate == "55000":  # object_not_in_prerequisite_state: invalidated, its WAL removed
                raise PositionUnavailable(
                    f"slot {slot} cannot be advanced: {error_text(exc)}", where=self._where
                ) from exc
            if exc.sqlstate == "55006":  # object_in_use: another process holds the slot for now
                raise ConnectionFailed(
                    f"slot {slot} is in use: {error_text(exc)}", where=self._where
                ) from exc
            raise pg_error(exc, doing=f"advancing slot {slot} to {wanted}", where=self._where) from exc
        reached = None if row is None or row[0] is None else _CODEC.validate(row[0])
        if reached != target:
            raise IntegrityError(f"slot {slot} advanced to {row and row[0]}, not {wanted}", where=self._where)

    # -- lifecycle ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Wait for a read or acknowledgement in progress, then drop the copy with its connection."""
        self._closed = True
        async with self._busy:
            await self._detach()

    def _connection(self) -> Connection:
        if self._conn is None:
            raise LifecycleError("the session has no connection (it was closed)", where=self._where)
        return self._conn

    async def _attached(self) -> Connection:
        """The session's connection, attached again (a new copy of the slot) after an interruption."""
        if self._conn is None:
            await self._attach(None, ())
        return self._connection()

    async def _detach(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def _attach(self, resume: Position | None, resources: Sequence[str]) -> None:
        """Connect, check the slot, and copy it positioned after what was delivered (or certified)."""
        conn = await _connect(self.config)
        try:
            await self._attach_on(conn, resume, resources)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def _attach_on(self, conn: Connection, resume: Position | None, resources: Sequence[str]) -> None:
        config = self.config
        facts = await _slot_facts(conn, config)
        _check_server(facts, self._where)
        marker = await self._marker(conn, facts, expected=resume is not None or self._domain is not None)
        domain = OrderingDomain(
            SOURCE, config.slot, "", f"{facts.system_identifier}:{config.slot}:{marker[0]}", _CODEC.name
        )
        first = self._domain is None
        if first:
            if resume is not None:
                if resume.domain.incarnation != domain.incarnation:
                    raise IncarnationChanged(
                        f"the certified position {resume.value} belongs to incarnation "
                        f"{resume.domain.incarnation!r}; the slot is now {domain.incarnation!r}",
                        where=self._where,
                    )
                self._position = _CODEC.validate(resume.value)
            self._domain = domain
            self._created_lsn = marker[1]
            self._snapshot_pending = config.snapshot and self._position is None
            if config.stop_at_open:
                self._end = facts.flush_lsn
            await self._select(conn, resources)
        elif domain != self._domain:
            raise IncarnationChanged(f"the slot is now incarnation {domain.incarnation!r}", where=self._where)
        self._temp_slot = f"{config.slot[:40]}_r{uuid.uuid4().hex[:12]}"
        try:
            await conn.execute(
                "SELECT pg_copy_logical_replication_slot(%s, %s, true)", (config.slot, self._temp_slot)
            )
            cursor = await conn.execute(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (self._temp_slot,),
            )
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            if exc.sqlstate in ("42704", "55000"):  # the slot is gone, or its WAL was removed
                raise PositionUnavailable(
                    f"the slot cannot be read: {error_text(exc)}", where=self._where
                ) from exc
            if exc.sqlstate and exc.sqlstate.startswith("53"):  # e.g. every replication slot is in use
                raise ConnectionFailed(
                    f"the slot cannot be copied: {error_text(exc)}", where=self._where
                ) from exc
            raise pg_error(exc, doing="copying the slot", where=self._where) from exc
        if row is None or row[0] is None:
            raise IntegrityError("the copy of the slot has no confirmed position", where=self._where)
        confirmed = _CODEC.validate(row[0])
        if self._snapshot_pending:
            return  # the snapshot decides where the changes start
        target = self._created_lsn if self._position is None else self._position + 1
        start = (
            "its creation point"
            if self._position is None
            else f"the certified {_CODEC.canonicalize(target - 1)}"
        )
        if confirmed > target:
            raise PositionUnavailable(
                f"the slot is confirmed at {row[0]}, past {start} (advanced out of band, or dropped and "
                "created again): the changes in between are gone",
                where=self._where,
            )
        if target > facts.flush_lsn:
            raise PositionUnavailable(
                f"the server's WAL ends at {_CODEC.canonicalize(facts.flush_lsn)}, before {start}: "
                "the server was restored from an older backup",
                where=self._where,
            )
        if confirmed < target:
            await self._advance(conn, self._temp_slot, target)

    async def _marker(self, conn: Connection, facts: _SlotFacts, *, expected: bool) -> tuple[str, int]:
        """The slot's incarnation marker and creation LSN; the slot must exist and fit.

        ``expected``: a position in the slot was certified or delivered, so a missing slot lost it.
        """
        config = self.config
        marker: tuple[str, int] | None = None
        if facts.has_markers:
            try:
                cursor = await conn.execute(
                    sql.SQL(
                        "SELECT incarnation::text, created_lsn::text FROM {} WHERE slot_name = %s"
                    ).format(sql.Identifier(config.metadata_schema, MARKER_TABLE)),
                    (config.slot,),
                )
                row = await cursor.fetchone()
            except psycopg.Error as exc:
                raise pg_error(exc, doing="reading the slot's marker", where=self._where) from exc
            if row is not None:
                marker = (row[0], _CODEC.validate(row[1]))
        if facts.slot_type is None:
            if not expected:
                raise ConfigError(
                    "the slot does not exist; create it with setup_replication", where=self._where
                )
            raise PositionUnavailable(
                "the slot was dropped: the changes it held for this stream are gone", where=self._where
            )
        _check_slot(facts, self._where)
        if facts.wal_status == "lost":
            raise PositionUnavailable(
                "the slot was invalidated: the WAL it needs was removed", where=self._where
            )
        if marker is None:
            raise ConfigError(
                f"the slot has no incarnation marker in {config.metadata_schema}.{MARKER_TABLE}; "
                "run setup_replication for it",
                where=self._where,
            )
        return marker

    async def _select(self, conn: Connection, resources: Sequence[str]) -> None:
        """Read the publication's tables and resolve the selected ones (ConfigError if unpublished)."""
        try:
            cursor = await conn.execute(
                "SELECT c.oid::int8, pt.schemaname || '.' || pt.tablename, pt.attnames::text[], "
                "pt.rowfilter, c.relkind = 'p' FROM pg_publication_tables AS pt "
                "JOIN pg_namespace AS n ON n.nspname = pt.schemaname "
                "JOIN pg_class AS c ON c.relnamespace = n.oid AND c.relname = pt.tablename "
                "WHERE pt.pubname = %s",
                (self.config.publication,),
            )
            rows = await cursor.fetchall()
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading the publication", where=self._where) from exc
        self._published = {row[0]: _Published(row[0], row[1], tuple(row[2]), row[3], row[4]) for row in rows}
        if not resources:
            self._selected = None
            return
        by_name = {published.name: oid for oid, published in self._published.items()}
        missing = [name for name in resources if name not in by_name]
        if missing:
            raise ConfigError(
                f"table(s) {', '.join(missing)} are not in publication {self.config.publication} "
                f"(it has: {', '.join(sorted(by_name)) or 'none'})",
                where=self._where,
            )
        self._selected = {by_name[name]: name for name in resources}


def _change_rows(
    message: pg.Update | pg.Delete, table: _Table
) -> list[tuple[Sequence[str | None], str, list[str] | None]]:
    """The change rows of an update or a delete (see the module docstring for their shape)."""
    old = message.old
    if isinstance(message, pg.Delete):
        return [(message.old.values, _DELETE, None)]
    values, missing = message.new.values, message.new.unchanged
    if missing and message.old_kind == "O" and old is not None:
        # REPLICA IDENTITY FULL: the old row holds the values the update left out.
        filled = list(values)
        for index in missing:
            filled[index] = old.values[index]
        values, missing = tuple(filled), ()
    if old is not None and any(
        old.values[index] != values[index] and index not in missing for index in table.key_indexes
    ):
        if missing:
            names = ", ".join(table.relation.columns[index].name for index in missing)
            raise DataError(
                f"an update changed the key and left the TOASTed column(s) {names} out; set REPLICA "
                "IDENTITY FULL on the table so their values are replicated",
                where=table.where,
            )
        return [(old.values, _DELETE, None), (values, _INSERT, None)]
    unchanged = [table.relation.columns[index].name for index in missing] if missing else None
    return [(values, _UPDATE, unchanged)]


async def _catalog_relation(conn: Connection, published: _Published) -> pg.Relation:
    """The Relation message pgoutput would send for ``published``, built from the catalog."""
    cursor = await conn.execute(
        "SELECT a.attname::text, a.atttypid::int8, a.atttypmod, "
        "c.relreplident = 'f' OR coalesce(a.attnum = ANY(i.indkey::int2[]), false), c.relreplident::text "
        "FROM pg_attribute AS a JOIN pg_class AS c ON c.oid = a.attrelid "
        "LEFT JOIN pg_index AS i ON i.indrelid = c.oid AND ((c.relreplident = 'd' AND i.indisprimary) "
        "OR (c.relreplident = 'i' AND i.indisreplident)) "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY(%s::name[]) "
        "ORDER BY a.attnum",
        (published.oid, list(published.columns)),
    )
    rows = await cursor.fetchall()
    schema, name = qualified_name(published.name)
    identity = rows[0][4] if rows else "d"
    return pg.Relation(
        published.oid,
        schema,
        name,
        identity,
        tuple(pg.Column(row[0], row[1], row[2], row[3]) for row in rows),
    )


async def _slot_facts(conn: Connection, config: PostgresCdcConfig) -> _SlotFacts:
    try:
        cursor = await conn.execute(
            "SELECT current_setting('server_version_num')::int, current_setting('wal_level'), "
            "current_setting('server_encoding'), (SELECT system_identifier::text FROM pg_control_system()), "
            "pg_current_wal_flush_lsn()::text, "
            "EXISTS (SELECT 1 FROM pg_publication WHERE pubname = %s), "
            "to_regclass(format('%%I.%%I', %s::text, %s::text)) IS NOT NULL, "
            "s.slot_type, s.plugin::text, s.database::text, current_database()::text, s.wal_status "
            "FROM (SELECT 1) AS one LEFT JOIN pg_replication_slots AS s ON s.slot_name = %s",
            (config.publication, config.metadata_schema, MARKER_TABLE, config.slot),
        )
        row = await cursor.fetchone()
    except psycopg.Error as exc:
        raise pg_error(exc, doing="reading the server and slot state", where=_where(config)) from exc
    assert row is not None  # one row by construction
    return _SlotFacts(
        server_version=row[0],
        wal_level=row[1],
        encoding=row[2],
        system_identifier=row[3],
        flush_lsn=_CODEC.validate(row[4]),
        has_publication=row[5],
        has_markers=row[6],
        slot_type=row[7],
        plugin=row[8],
        slot_database=row[9],
        database=row[10],
        wal_status=row[11],
    )


def _check_server(facts: _SlotFacts, where: str, *, publication: bool = True) -> None:
    """ConfigError unless the server can run logical replication for this connector."""
    if facts.server_version < MIN_SERVER_VERSION:
        raise ConfigError(f"PostgreSQL {facts.server_version} is too old: 15 or later is needed", where=where)
    if facts.wal_level != "logical":
        raise ConfigError(
            f"wal_level is {facts.wal_level!r}: logical replication needs wal_level = logical "
            "(set it in postgresql.conf and restart the server)",
            where=where,
        )
    if facts.encoding.upper() != "UTF8":
        raise ConfigError(f"the database encoding is {facts.encoding}; UTF8 is needed", where=where)
    if publication and not facts.has_publication:
        raise ConfigError("the publication does not exist; create it with setup_replication", where=where)


def _check_slot(facts: _SlotFacts, where: str) -> None:
    """ConfigError unless the existing slot is a logical pgoutput slot of this database."""
    if facts.slot_type != "logical" or facts.plugin != "pgoutput" or facts.slot_database != facts.database:
        raise ConfigError(
            f"the slot is a {facts.slot_type} slot of plugin {facts.plugin} on database "
            f"{facts.slot_database}; a logical pgoutput slot on {facts.database} is needed",
            where=where,
        )


# -- setup ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicationSetup:
    """What :func:`setup_replication` found or made."""

    slot: str
    publication: str
    tables: tuple[str, ...]
    incarnation: str
    created_lsn: str
    slot_created: bool
    publication_created: bool


async def setup_replication(config: PostgresCdcConfig, tables: Sequence[str] = ()) -> ReplicationSetup:
    """Create (or complete) the publication, the incarnation marker and the slot of ``config``.

    Idempotent: an existing publication gets the tables it lacks (none is removed); an existing slot
    is kept, and given a marker if it has none (its current position becomes its beginning). A new
    slot gets a new marker, so positions certified on a dropped slot of the same name fail with
    :class:`IncarnationChanged`. ``tables`` (``schema.table``) default to ``config.tables``. Raises
    :class:`ConfigError` when ``wal_level`` is not ``logical``, a table does not exist, or the slot
    exists with another plugin or database; :class:`AuthError` without the needed privileges.
    """
    wanted = tuple(tables) or config.tables
    for table in wanted:
        try:
            qualified_name(table)
        except ValueError as exc:
            raise ConfigError(str(exc), where=f"publication {config.publication}") from None
    where = _where(config)
    conn = await _connect(config)
    try:
        facts = await _slot_facts(conn, config)
        _check_server(facts, where, publication=False)
        if facts.slot_type is not None:
            _check_slot(facts, where)
        if not wanted and not facts.has_publication:
            raise ConfigError("name the tables of the new publication", where=where)
        try:
            publication_created = await _ensure_publication(conn, config, wanted, facts.has_publication)
            marker_table = sql.Identifier(config.metadata_schema, MARKER_TABLE)
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (slot_name text PRIMARY KEY, incarnation uuid NOT NULL, "
                    "created_lsn pg_lsn NOT NULL, publication text NOT NULL, "
                    "created_at timestamptz NOT NULL DEFAULT now())"
                ).format(marker_table)
            )
            cursor = await conn.execute(
                sql.SQL("SELECT incarnation::text, created_lsn::text FROM {} WHERE slot_name = %s").format(
                    marker_table
                ),
                (config.slot,),
            )
            marker = await cursor.fetchone()
            slot_created = facts.slot_type is None
            if slot_created:
                cursor = await conn.execute(
                    "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (config.slot,)
                )
                created = await cursor.fetchone()
                assert created is not None  # the function returns one row
                marker = None  # a new slot is a new incarnation
                created_lsn = created[0]
            else:
                cursor = await conn.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                    (config.slot,),
                )
                current = await cursor.fetchone()
                if current is None or current[0] is None:
                    raise ConfigError("the slot disappeared during the setup", where=where)
                created_lsn = current[0] if marker is None else marker[1]
            if marker is None:
                incarnation = str(uuid.uuid4())
                await conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (slot_name, incarnation, created_lsn, publication) "
                        "VALUES (%s, %s, %s::pg_lsn, %s) ON CONFLICT (slot_name) DO UPDATE SET "
                        "incarnation = EXCLUDED.incarnation, created_lsn = EXCLUDED.created_lsn, "
                        "publication = EXCLUDED.publication, created_at = now()"
                    ).format(marker_table),
                    (config.slot, incarnation, created_lsn, config.publication),
                )
            else:
                incarnation = marker[0]
            cursor = await conn.execute(
                "SELECT schemaname || '.' || tablename FROM pg_publication_tables "
                "WHERE pubname = %s ORDER BY 1",
                (config.publication,),
            )
            published = tuple(row[0] for row in await cursor.fetchall())
        except psycopg.Error as exc:
            raise pg_error(exc, doing="setting up replication", where=where) from exc
    finally:
        await conn.close()
    return ReplicationSetup(
        slot=config.slot,
        publication=config.publication,
        tables=published,
        incarnation=f"{facts.system_identifier}:{config.slot}:{incarnation}",
        created_lsn=_CODEC.canonicalize(_CODEC.validate(created_lsn)),
        slot_created=slot_created,
        publication_created=publication_created,
    )


async def _ensure_publication(
    conn: Connection, config: PostgresCdcConfig, tables: Sequence[str], exists: bool
) -> bool:
    """Create the publication for ``tables``, or add the ones it lacks; True when it was created."""
    if not tables:
        return False
    where = f"publication {config.publication}"
    cursor = await conn.execute(
        "SELECT n.nspname || '.' || c.relname FROM pg_class AS c "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p') AND n.nspname || '.' || c.relname = ANY(%s)",
        (list(tables),),
    )
    found = {row[0] for row in await cursor.fetchall()}
    missing = [table for table in tables if table not in found]
    if missing:
        raise ConfigError(f"table(s) {', '.join(missing)} do not exist", where=where)
    identifiers = [sql.Identifier(*qualified_name(table)) for table in tables]
    name = sql.Identifier(config.publication)
    if not exists:
        await conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(name, sql.SQL(", ").join(identifiers))
        )
        return True
    cursor = await conn.execute(
        "SELECT puballtables, ARRAY(SELECT schemaname || '.' || tablename FROM pg_publication_tables "
        "WHERE pubname = %s) FROM pg_publication WHERE pubname = %s",
        (config.publication, config.publication),
    )
    row = await cursor.fetchone()
    assert row is not None  # the publication exists
    absent = [
        identifier for table, identifier in zip(tables, identifiers, strict=True) if table not in row[1]
    ]
    if absent and not row[0]:
        await conn.execute(
            sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(name, sql.SQL(", ").join(absent))
        )
    return False


# -- connections -----------------------------------------------------------------------------------


async def _connect(config: PostgresCdcConfig, *, replication: bool = False) -> Connection:
    """A session connection (:func:`faucet_postgres.common.connect`'s settings, which fix the texts
    :mod:`.pgoutput` parses, and no timeout that could end it while a slow sink blocks a read), or a
    replication connection (``replication=database``) for exporting a snapshot."""
    where = _where(config)
    if not replication:
        conn = await connect(config, autocommit=True)
        try:
            await conn.execute("SET statement_timeout = 0; SET idle_in_transaction_session_timeout = 0")
        except psycopg.Error as exc:
            await conn.close()
            raise pg_error(exc, where=where, doing="setting up the session") from exc
        return conn
    try:
        return await psycopg.AsyncConnection.connect(
            make_conninfo(config.conninfo(), replication="database"), autocommit=True
        )
    except psycopg.Error as exc:
        raise pg_error(exc, where=where, doing="opening a replication connection") from exc


def _where(config: PostgresCdcConfig) -> str:
    return f"slot {config.slot} on {config.safe_url()}"


def _quiet_budget(limits: ReadLimits) -> float:
    budgets = [value for value in (limits.idle, limits.age) if value is not None]
    return min(budgets) if budgets else float("inf")


async def _pause(seconds: float, cancel: CancelToken) -> None:
    """Sleep up to ``seconds``; return early when ``cancel`` fires."""
    if seconds <= 0 or cancel.cancelled:
        return
    waiter = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait({waiter}, timeout=None if seconds == float("inf") else seconds)
    finally:
        waiter.cancel()
