"""The reading side of a change session: decoding the slot's copy into change rows, one source
transaction at a time, with the snapshot first and heartbeats while idle (see :mod:`faucet_postgres.cdc`)."""

import asyncio
import time

import psycopg

from faucet_dagster.protocol import (
    CancelToken,
    Coverage,
    DomainCoverage,
    IntegrityError,
    LifecycleError,
    ReadLimits,
    SchemaError,
    StreamRecordSink,
)
from faucet_postgres import pgoutput as pg
from faucet_postgres.cdc_config import HEARTBEAT_PREFIX
from faucet_postgres.cdc_ddl import (
    DDL_PREFIX,
    DdlMessage,
    TableHistory,
    columns_at,
    parse_message,
    publication_added_after,
)
from faucet_postgres.cdc_rows import (
    DELETE,
    GROUP_TRANSACTIONS,
    INSERT,
    TRUNCATE,
    UPDATE,
    Table,
    TransactionWriter,
    change_rows,
    joining_relation,
)
from faucet_postgres.cdc_server import CODEC, Connection, Interrupted, interruptible
from faucet_postgres.cdc_slot import Published, SlotSession
from faucet_postgres.cdc_snapshot import read_snapshot
from faucet_postgres.common import pg_error

_FETCH_ROWS = 5_000
_BEGIN, _COMMIT = ord("B"), ord("C")
_KEPT_ENCODED = {
    (ord(kind) << 8) | ord(tuple_marker): operation
    for kind, tuple_marker, operation in (
        ("I", "N", INSERT),
        ("U", "N", UPDATE),  # no old image: the key did not change (change_rows: one update row)
        ("D", "K", DELETE),
        ("D", "O", DELETE),
    )
}
"""Change messages whose one tuple is the change row's values, by type and tuple marker (first and
sixth byte), and the row's operation: kept encoded for their batch to decode in bulk."""
_MIN_POLL = 0.05


class _Progress:
    """What one read has done against its limits."""

    def __init__(self, limits: ReadLimits, messages_per_row: float | None = None) -> None:
        self.limits = limits
        self.messages_per_row = messages_per_row
        """The rate the session's earlier reads saw (None: none yet), for this read's first call."""
        self.started = self.last_new = time.monotonic()
        self.bytes = 0
        self.messages = 0
        """Messages decoded by the read (change rows, and the transactions' controls around them)."""

    def messages_for(self, rows: int, rows_read: int) -> int:
        """How many messages to decode for ``rows`` more change rows, at the messages per row seen so
        far (before the read has seen rows: the session's earlier reads, else one), with a margin. Small
        transactions carry more controls than rows (a one-row transaction is three messages): counting
        messages as rows made a read of small transactions take a dozen server calls, each of which
        reads the WAL again from the slot's restart point, and the first call of every read one more.
        Overshooting only decodes a few transactions past the read's end."""
        if rows <= 0:
            return 1
        if rows_read > 0 and self.messages > rows_read:
            return int(rows * self.messages / rows_read * 1.1) + 1
        if rows_read <= 0 and self.messages_per_row is not None and self.messages_per_row > 1:
            # No margin on an earlier read's rate: past the read's end, the call decodes transactions
            # the next read decodes again (a tenth of a read of large transactions); short of it, the
            # read makes one more, small call.
            return int(rows * self.messages_per_row) + 1
        return rows

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


class PostgresCdcSession(SlotSession):
    """A session on one slot: reads its temporary copy, acknowledges by advancing the slot itself.

    Reads and acknowledgements are serialized; ``close`` waits for the one in progress.
    """

    _copy_ahead = False
    _messages_per_row: float | None = None
    """Messages decoded per change row by the last read that saw rows (see ``_Progress.messages_for``)."""
    """The copy was consumed past the last delivered boundary (a read ended inside a server call):
    the next read copies the slot again. The acknowledgement in between keeps the connection (it
    advances the slot itself), so the new copy starts where it was acknowledged, with nothing to
    decode twice."""

    # -- reading ------------------------------------------------------------------------------------

    async def read(self, sink: StreamRecordSink, limits: ReadLimits, cancel: CancelToken) -> Coverage:
        async with self._busy:
            if self._closed:
                raise LifecycleError("read after close", where=self._where)
            if not self._owned:
                await _pause(_quiet_budget(limits), cancel)
                return Coverage()
            if self._copy_ahead:
                self._copy_ahead = False
                await self._detach()
            await self._attached()
            start = self._position
            writer = TransactionWriter(self.domain, sink, self.config.batch_rows, self._delivered)
            try:
                progress = _Progress(limits, self._messages_per_row)
                await self._read_into(writer, progress, cancel)
                if writer.rows:
                    self._messages_per_row = progress.messages / writer.rows
            except Interrupted:
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
                        None if start is None else CODEC.canonicalize(start),
                        CODEC.canonicalize(self._position),
                    ),
                )
            )

    async def _read_into(self, writer: TransactionWriter, progress: _Progress, cancel: CancelToken) -> None:
        if self._snapshot_pending:
            await self._read_snapshot(writer, progress, cancel)
        backoff = _MIN_POLL
        first = self._position
        while not cancel.cancelled and not self._exhausted:
            if self._position != first and progress.limit_reached(writer.rows):
                return
            rows = writer.rows
            seen, stopped, caught_up = await self._read_changes(writer, progress, cancel)
            if stopped:
                return
            if seen:
                if writer.rows > rows:  # a heartbeat is progress, not something new to wait for
                    progress.last_new = time.monotonic()
                backoff = _MIN_POLL
                if not (caught_up and self._end is None and progress.quiet_long_enough()):
                    continue
                # The call decoded all the WAL there was when it began (the server had nothing more
                # then) and the idle or age limit is reached already (idle=0: return when caught up):
                # another call would only find that out again, decoding from the slot's restart point.
                return
            if self._end is not None:
                self._exhausted = True
                return
            if progress.quiet_long_enough():
                return
            await self._heartbeat_if_due()
            await _pause(progress.time_left(backoff), cancel)
            backoff = min(backoff * 2, self.config.poll_interval)

    async def _read_changes(
        self, writer: TransactionWriter, progress: _Progress, cancel: CancelToken
    ) -> tuple[int, bool, bool]:
        """One server call: decode up to ``changes_per_call`` messages (whole transactions) into
        ``writer``, delivered in groups of complete transactions. Returns how many messages came;
        True when the read's limits were reached at a transaction end inside the call: the read then
        stops there, and the copy (which the call consumed to its end) is dropped, so the next read
        copies the slot again from the last delivered boundary; and True when the call was caught up:
        fewer messages came than it asked for, so it decoded to the WAL's insert position as it was
        when the call began."""
        conn = self._connection()
        limits = progress.limits
        upto = self.config.changes_per_call
        if limits.records is not None:
            upto = max(1, min(upto, progress.messages_for(limits.records - writer.rows, writer.rows)))
        seen, stopped = 0, False
        try:
            readable = await self._flushed_through(conn)
            end = CODEC.canonicalize(readable if self._end is None else min(readable, self._end))
            async with conn.transaction():
                cursor = conn.cursor("faucet_cdc_changes", binary=True)
                await cursor.execute(
                    "SELECT data FROM pg_logical_slot_get_binary_changes(%s, %s::pg_lsn, %s, "
                    "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
                    (self._temp_slot, end, upto, self._publication_option),
                )
                tables, decode = self._tables, pg.decode
                begin_fields, commit_fields = pg.BEGIN_FIELDS, pg.COMMIT_FIELDS
                while not stopped and (
                    rows := await interruptible(conn, cursor.fetchmany(_FETCH_ROWS), cancel)
                ):
                    seen += len(rows)
                    progress.messages += len(rows)
                    # Rows and transaction controls inline (no coroutine, no message object): the bulk
                    # of every change stream. The rest (an update with an old image, a Relation, a
                    # truncate, a logical message) is decoded and goes through _apply; a malformed
                    # message raises from the decoder.
                    for (data,) in rows:
                        size = len(data)
                        progress.bytes += size
                        kind = data[0] if size else 0
                        if (
                            size > 7
                            and (operation := _KEPT_ENCODED.get((kind << 8) | data[5])) is not None
                            and (table := tables.get(int.from_bytes(data[1:5]))) is not None
                        ):
                            # Kept encoded: the batch decodes a table's changes in bulk, no Python
                            # object per value.
                            if table.selected and writer.add(table, data, operation, None):
                                await writer.flush()
                        elif kind == _BEGIN and size >= begin_fields.size + 1:
                            final_lsn, _, xid = begin_fields.unpack_from(data, 1)
                            self._begin(final_lsn, xid, writer)
                        elif kind == _COMMIT and size >= commit_fields.size + 1:
                            await writer.commit(commit_fields.unpack_from(data, 1)[1])
                            if progress.limit_reached(writer.rows):
                                stopped = True
                                await writer.close_group()
                                break
                            if writer.grouped >= GROUP_TRANSACTIONS:
                                await writer.close_group()
                        else:
                            await self._apply(decode(data), writer)
                await cursor.close()
            if not stopped:
                await writer.close_group()
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading changes", where=self._where) from exc
        self._copy_ahead = stopped
        return seen, stopped, not stopped and seen < upto

    def _delivered(self, position: int) -> None:
        """A boundary reached the sink: the position a new copy of the slot resumes after."""
        self._position = position
        self._last_boundary_at = time.monotonic()

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
            inserted, flushed = CODEC.validate(row[0]), CODEC.validate(row[1])
            if inserted > flushed:
                async with conn.transaction():
                    await conn.execute("SET LOCAL synchronous_commit = on")
                    await conn.execute("SELECT pg_current_xact_id()")
        except psycopg.Error as exc:
            raise pg_error(exc, doing="flushing the WAL to decode", where=self._where) from exc
        return inserted

    async def _apply(self, message: pg.Message, writer: TransactionWriter) -> None:
        """Route one decoded message into ``writer``."""
        if isinstance(message, pg.Insert):
            table = self._table(message.relation_oid)
            if table.selected and writer.add(table, message.new.values, INSERT, None):
                await writer.flush()
        elif isinstance(message, pg.Update | pg.Delete):
            table = self._table(message.relation_oid)
            if table.selected:
                for values, operation, unchanged in change_rows(message, table):
                    if writer.add(table, values, operation, unchanged):
                        await writer.flush()
        elif isinstance(message, pg.Begin | pg.Commit):
            # Well-formed ones never come here (the read's loop takes them); a Commit would be lost.
            raise IntegrityError(
                f"a transaction control came out of the read's order: {message}", where=self._where
            )
        elif isinstance(message, pg.Relation):
            await self._remember(message, writer)
        elif isinstance(message, pg.Truncate):
            # A truncate row per table: the sink deletes every row the table held before it.
            for oid in message.relation_oids:
                table = self._table(oid)
                if table.selected and writer.add(table, (None,) * table.width, TRUNCATE, None):
                    await writer.flush()
        elif isinstance(message, pg.LogicalMessage) and message.prefix == DDL_PREFIX:
            await self._ddl(parse_message(message.content, self._where), writer)
        # Type, Origin and other logical messages (heartbeats) carry no rows.

    async def _ddl(self, ddl: DdlMessage, writer: TransactionWriter) -> None:
        """A message of the DDL capture (:mod:`faucet_postgres.cdc_ddl`), where it happened in the
        stream: a selected table joining the publication arrives as a truncate and its rows (what it
        held then); one dropped as a truncate (the next table of its name starts from its own rows);
        one leaving the publication stops the stream, unless it joins it again later."""
        ours = ddl.publication == self.config.publication
        if not self.is_selected(ddl.table) or (ddl.event != "drop_table" and not ours):
            return
        if ddl.event == "publication_add":
            table = await self._remember(joining_relation(ddl), writer)
            self._joining[ddl.relid] = table
            if writer.add(table, (None,) * table.width, TRUNCATE, None):
                await writer.flush()
        elif ddl.event == "rows":
            table = self._joining.get(ddl.relid) or self._table(ddl.relid)
            for row in ddl.rows:
                if writer.add(table, row, INSERT, None):
                    await writer.flush()
        elif ddl.event == "drop_table":
            known = self._tables.get(ddl.relid)
            if (
                known is not None
                and known.selected
                and writer.add(known, (None,) * known.width, TRUNCATE, None)
            ):
                await writer.flush()
        elif ddl.event == "publication_drop":
            try:
                again = await publication_added_after(
                    self._connection(),
                    self.config.metadata_schema,
                    ddl.table,
                    self.config.publication,
                    event=ddl.id,
                )
            except psycopg.Error as exc:
                raise pg_error(exc, doing="reading the DDL history", where=self._where) from exc
            if not again:
                publication = self.config.publication
                raise SchemaError(
                    f"table {ddl.table} left publication {publication} ({_statement(ddl.statement)}): "
                    "its later changes do not reach the replica. Remove it from the stream's resources (the "
                    "replica keeps its rows as of this point), or add it to the publication again (ALTER "
                    f"PUBLICATION {self.config.publication} ADD TABLE {ddl.table}: it then arrives with "
                    "its rows), and the stream resumes",
                    where=self._where,
                )

    def _begin(self, final_lsn: int, xid: int, writer: TransactionWriter) -> None:
        """Open the transaction a Begin message announces (its commit LSN and xid) in ``writer``."""
        last = writer.position if writer.grouped else self._position
        if last is not None and last >= 0 and final_lsn <= last:
            raise IntegrityError(
                f"a transaction committed at {CODEC.canonicalize(final_lsn)} came after the "
                f"position {CODEC.canonicalize(last)} was read",
                where=self._where,
            )
        writer.begin(xid, final_lsn)

    def _table(self, oid: int) -> Table:
        table = self._tables.get(oid)
        if table is None:
            raise IntegrityError(
                f"a change names relation {oid} before its Relation message", where=self._where
            )
        return table

    async def _remember(self, relation: pg.Relation, writer: TransactionWriter) -> Table:
        """Keep ``relation``'s description (a new :class:`Table` when it changed), with what the DDL
        history says of its columns for the open transaction (attribute numbers, exact types,
        generated columns: :func:`faucet_postgres.cdc_ddl.columns_at`). Rows ``writer`` buffered
        under the older one stay with the older Table and are written before the newer ones (the
        writer keeps them in arrival order), each batch with the schema it was read under."""
        known = self._tables.get(relation.oid)
        if known is not None and known.relation == relation:
            return known
        selected = self.is_selected(relation.qualified_name)
        named = None if self._selected is None else self._selected.get(relation.oid)
        if named is not None and named != relation.qualified_name:
            history = await self._history(relation.oid, writer.position)
            statement = "" if history is None else _statement(history.statement)
            raise SchemaError(
                f"table {named} was renamed to {relation.qualified_name}"
                + (f" ({statement})" if statement else "")
                + ": its changes now come under the new name. Rename the stream's resource to "
                f"{relation.qualified_name} (and map it to the replica table in the sink's tables), and "
                "the stream resumes",
                where=self._where,
            )
        keys = tuple(index for index, column in enumerate(relation.columns) if column.key)
        if relation.replica_identity == "f" and selected:
            # FULL flags every column; the primary key (read from the catalog now) is the replica's
            # key. The rows are applied as a multiset (every update a delete of the whole old row and
            # an insert), which a key holding two rows within a transaction (a DEFERRABLE key, UPDATE
            # t SET id = id + 1) needs.
            keys = await self._primary_key(relation) or keys
        history = await self._history(relation.oid, writer.position) if selected else None
        if history is not None:
            # What rows older than each column hold, as of this transaction (the catalog holds now's).
            older = {
                column.name: column.missing
                for column in history.columns
                if column.missing is not None or column.has_default
            }
        else:
            older = await self._older_rows(relation) if selected else {}
        table = self._tables[relation.oid] = Table(relation, selected, keys, older, history)
        return table

    async def _history(self, relid: int, position: int) -> TableHistory | None:
        try:
            return await columns_at(self._connection(), self.config.metadata_schema, relid, position)
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading the DDL history", where=self._where) from exc

    async def _older_rows(self, relation: pg.Relation) -> dict[str, str | None]:
        """Per column with a default: what rows older than the column hold at the source.

        A column added with a constant default keeps it once, in ``pg_attribute.attmissingval``
        (PostgreSQL 11 and later), for every row that predates it: its text, so a replica adding the
        column gives those rows the same value. A default without a missing value (a volatile one
        rewrote the table, or a rewrite since) gives ``None``: those rows' values are unknown here.
        Read from the catalog as it is now; a missing value never changes while the column lives.
        """
        try:
            cursor = await self._connection().execute(
                "SELECT attname::text, CASE WHEN atthasmissing THEN (attmissingval::text::text[])[1] END, "
                "atthasmissing FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped "
                "AND (atthasmissing OR atthasdef)",
                (relation.oid,),
            )
            rows = await cursor.fetchall()
        except psycopg.Error as exc:
            raise pg_error(
                exc, doing="reading column defaults", where=f"table {relation.qualified_name}"
            ) from exc
        names = {column.name for column in relation.columns}
        return {name: value if has_missing else None for name, value, has_missing in rows if name in names}

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

    # -- the snapshot -------------------------------------------------------------------------------

    async def _read_snapshot(
        self, writer: TransactionWriter, progress: _Progress, cancel: CancelToken
    ) -> None:
        """Deliver every selected table at one exported snapshot, then move the copy to its point."""
        conn = self._connection()
        point = await read_snapshot(
            conn,
            self.config,
            self._temp_slot,
            self._snapshot_tables(),
            writer,
            self._remember,
            cancel,
            self._where,
        )
        await self._advance(conn, self._temp_slot, point)
        self._position = await writer.end()
        self._snapshot_pending = False
        self._last_boundary_at = time.monotonic()
        progress.last_new = self._last_boundary_at

    def _snapshot_tables(self) -> list[Published]:
        oids = self._published if self._selected is None else self._selected
        return sorted((self._published[oid] for oid in oids), key=lambda published: published.name)


def _statement(text: str) -> str:
    """A DDL statement's text for a message: one line, at most 200 characters."""
    line = " ".join(text.split())
    return line if len(line) <= 200 else line[:197] + "..."


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
