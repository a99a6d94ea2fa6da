"""The slot side of a change session: attaching (a temporary copy of the slot, positioned after what
was certified or delivered), checking the slot and its incarnation marker, acknowledging (advancing
the slot), and closing. :class:`faucet_postgres.cdc_session.PostgresCdcSession` adds the reading."""

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from faucet_dagster.protocol import (
    Authority,
    ConfigError,
    ConnectionFailed,
    Coverage,
    IncarnationChanged,
    IntegrityError,
    LifecycleError,
    OrderingDomain,
    Position,
    PositionUnavailable,
    SourceLag,
    StreamSession,
)
from faucet_postgres.cdc_config import MARKER_TABLE, PostgresCdcConfig
from faucet_postgres.cdc_ddl import HISTORY_TABLE, check_capture, publication_added_after
from faucet_postgres.cdc_rows import Table
from faucet_postgres.cdc_server import (
    CODEC,
    SOURCE,
    Connection,
    SlotFacts,
    check_server,
    check_slot,
    connect_cdc,
    slot_facts,
    slot_where,
    unkeyed_error,
    unkeyed_tables,
)
from faucet_postgres.common import error_text, pg_error


@dataclass(frozen=True)
class Published:
    """A table of the publication, with the columns and row filter pgoutput applies to it."""

    oid: int
    name: str
    columns: tuple[str, ...]
    row_filter: str | None
    partitioned: bool


class SlotSession(StreamSession):
    """A session on one slot: attaches a temporary copy, acknowledges by advancing the slot itself.

    Reads and acknowledgements are serialized; ``close`` waits for the one in progress.
    """

    def __init__(self, config: PostgresCdcConfig, owned: bool) -> None:
        self.config = config
        self._owned = owned
        self._where = slot_where(config)
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
        """The selected tables known by OID (None: every table of the publication), as at open."""
        self._has_selection_column = False
        self._selected_names: frozenset[str] | None = None
        """The selected tables by name (None: all): a table that joins the publication later, or is
        created again under a selected name, is selected by its name."""
        self._published: dict[int, Published] = {}
        self._tables: dict[int, Table] = {}
        self._joining: dict[int, Table] = {}
        """Tables that joined the publication in this session, by OID: their rows' messages follow."""
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
                target = CODEC.validate(item.end) + 1
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
        wanted = CODEC.canonicalize(target)
        if confirmed is None:
            raise PositionUnavailable(
                f"the slot was dropped; {wanted} cannot be acknowledged", where=self._where
            )
        if marker is None or not domain.incarnation.endswith(f":{marker}"):
            raise IncarnationChanged(
                "the slot was created again since this session opened; nothing is acknowledged",
                where=self._where,
            )
        await self._record_selection(conn)
        order = CODEC.compare(CODEC.validate(confirmed), target)
        if order > 0:
            raise PositionUnavailable(
                f"the slot is confirmed at {confirmed}, past the certified {wanted}: "
                "it was advanced out of band",
                where=self._where,
            )
        if order < 0:
            await self._advance(conn, self.config.slot, target)

    async def _record_selection(self, conn: Connection) -> None:
        """Record, in the slot's marker, the tables this stream reads, by OID (``NULL``: all of the
        publication): a later session that selects another table checks it was resynced
        (:meth:`_check_selection`); a table renamed keeps its OID."""
        if not self._has_selection_column:
            return
        selected = None if self._selected is None else sorted({*self._selected, *self._joining})
        try:
            await conn.execute(
                sql.SQL(
                    "UPDATE {} SET selected_relids = %s::oid[] WHERE slot_name = %s "
                    "AND selected_relids IS DISTINCT FROM %s::oid[]"
                ).format(sql.Identifier(self.config.metadata_schema, MARKER_TABLE)),
                (selected, self.config.slot, selected),
            )
        except psycopg.Error as exc:
            await self._detach()
            raise pg_error(exc, doing="recording the stream's tables", where=self._where) from exc

    async def _check_selection(self, conn: Connection, resume: int) -> None:
        """A table this session selects that the stream did not select up to the certified position
        ``resume`` had its changes up to there read and not delivered: refused, unless it was resynced
        after that point (it joined the publication again, arriving with its rows)."""
        try:
            cursor = await conn.execute(
                sql.SQL("SELECT selected_relids::int8[] FROM {} WHERE slot_name = %s").format(
                    sql.Identifier(self.config.metadata_schema, MARKER_TABLE)
                ),
                (self.config.slot,),
            )
            row = await cursor.fetchone()
            before = None if row is None or row[0] is None else set(row[0])
            if before is None:
                return
            now = self._selected or {oid: published.name for oid, published in self._published.items()}
            added = sorted(name for oid, name in now.items() if oid not in before)
            schema, publication = self.config.metadata_schema, self.config.publication
            missed = [
                name
                for name in added
                if not await publication_added_after(conn, schema, name, publication, lsn=resume)
            ]
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading the stream's tables", where=self._where) from exc
        if missed:
            names = ", ".join(missed)
            raise ConfigError(
                f"table(s) {names} were not read by this stream up to its certified position "
                f"{CODEC.canonicalize(resume)}: their changes until then are not in it. Resync them: in "
                f"one transaction, ALTER PUBLICATION {publication} DROP TABLE {names}; ALTER PUBLICATION "
                f"{publication} ADD TABLE {names} (each then arrives with its rows at that point), and "
                "the stream resumes",
                where=self._where,
            )

    async def _advance(self, conn: Connection, slot: str, target: int) -> None:
        """``pg_replication_slot_advance(slot, target)``, checked to have reached ``target``."""
        wanted = CODEC.canonicalize(target)
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
        reached = None if row is None or row[0] is None else CODEC.validate(row[0])
        if reached != target:
            raise IntegrityError(f"slot {slot} advanced to {row and row[0]}, not {wanted}", where=self._where)

    # -- lag -----------------------------------------------------------------------------------------

    async def lag(self) -> tuple[SourceLag, ...]:
        """WAL bytes from where the reads reached to the server's current WAL flush position.

        Never quite 0 when caught up: the WAL also holds the last commit record itself, checkpoints,
        other databases' writes and, on the same server, the destination's. No seconds: the WAL does
        not tell when its newest record was written. Nothing while the session holds no connection
        (after an interruption: the next read attaches again).
        """
        async with self._busy:
            conn, domain = self._conn, self._domain
            if self._closed or conn is None or domain is None:
                return ()
            try:
                cursor = await conn.execute("SELECT pg_current_wal_flush_lsn()::text")
                row = await cursor.fetchone()
            except psycopg.Error as exc:
                raise pg_error(exc, doing="reading the current WAL position", where=self._where) from exc
        assert row is not None  # one row by construction
        head = CODEC.validate(row[0])
        reached = self._created_lsn if self._position is None else self._position
        position = None if self._position is None else CODEC.canonicalize(self._position)
        return (SourceLag(domain, position, CODEC.canonicalize(head), max(0, head - reached), "WAL bytes"),)

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
        conn = await connect_cdc(self.config)
        try:
            await self._attach_on(conn, resume, resources)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def _attach_on(self, conn: Connection, resume: Position | None, resources: Sequence[str]) -> None:
        config = self.config
        facts = await slot_facts(conn, config)
        check_server(facts, self._where)
        marker = await self._marker(conn, facts, expected=resume is not None or self._domain is not None)
        domain = OrderingDomain(
            SOURCE, config.slot, "", f"{facts.system_identifier}:{config.slot}:{marker[0]}", CODEC.name
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
                self._position = CODEC.validate(resume.value)
            self._domain = domain
            self._created_lsn = marker[1]
            self._snapshot_pending = config.snapshot and self._position is None
            if config.stop_at_open:
                self._end = facts.flush_lsn
            await self._select(conn, resources)
            self._has_selection_column = await self._selection_column(conn)
            if self._position is not None and self._has_selection_column:
                await self._check_selection(conn, self._position)
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
        confirmed = CODEC.validate(row[0])
        if self._snapshot_pending:
            return  # the snapshot decides where the changes start
        target = self._created_lsn if self._position is None else self._position + 1
        start = (
            "its creation point"
            if self._position is None
            else f"the certified {CODEC.canonicalize(target - 1)}"
        )
        if confirmed > target:
            raise PositionUnavailable(
                f"the slot is confirmed at {row[0]}, past {start} (advanced out of band, or dropped and "
                "created again): the changes in between are gone",
                where=self._where,
            )
        if target > facts.flush_lsn:
            raise PositionUnavailable(
                f"the server's WAL ends at {CODEC.canonicalize(facts.flush_lsn)}, before {start}: "
                "the server was restored from an older backup",
                where=self._where,
            )
        if confirmed < target:
            await self._advance(conn, self._temp_slot, target)

    async def _marker(self, conn: Connection, facts: SlotFacts, *, expected: bool) -> tuple[str, int]:
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
                marker = (row[0], CODEC.validate(row[1]))
        if facts.slot_type is None:
            if not expected:
                raise ConfigError(
                    "the slot does not exist; create it with setup_replication", where=self._where
                )
            raise PositionUnavailable(
                "the slot was dropped: the changes it held for this stream are gone", where=self._where
            )
        check_slot(facts, self._where)
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
        self._published = {row[0]: Published(row[0], row[1], tuple(row[2]), row[3], row[4]) for row in rows}
        try:
            unkeyed = await unkeyed_tables(
                conn, resources or [published.name for published in self._published.values()]
            )
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading the tables' replica identities", where=self._where) from exc
        if unkeyed:
            raise unkeyed_error(unkeyed, self._where)
        await check_capture(conn, self.config.metadata_schema, self._where)
        if not resources:
            self._selected = None
            self._selected_names = None
            return
        by_name = {published.name: oid for oid, published in self._published.items()}
        for name in resources:
            if name not in by_name and (earlier := await self._named_until_later(conn, name)) is not None:
                by_name[name] = earlier
        missing = [name for name in resources if name not in by_name]
        if missing:
            raise ConfigError(
                f"table(s) {', '.join(missing)} are not in publication {self.config.publication} "
                f"(it has: {', '.join(sorted(by_name)) or 'none'})",
                where=self._where,
            )
        self._selected = {by_name[name]: name for name in resources if name in by_name}
        self._selected_names = frozenset(resources)

    async def _named_until_later(self, conn: Connection, name: str) -> int | None:
        """The OID of the table that had ``name`` at the certified position and, after it, left the
        publication or was renamed (None: no such table): the session reads up to that point and
        stops there naming the statement (``_ddl``, ``_remember``)."""
        if self._position is None:
            return None
        history = sql.Identifier(self.config.metadata_schema, HISTORY_TABLE)
        position = CODEC.canonicalize(self._position)
        try:
            cursor = await conn.execute(
                sql.SQL(
                    "SELECT h.relid::int8 FROM {history} AS h WHERE h.table_name = %s "
                    "AND h.at_lsn <= %s::pg_lsn AND h.event IN ('columns', 'publication_add') "
                    "AND EXISTS (SELECT 1 FROM {history} AS l WHERE l.relid = h.relid "
                    "AND l.at_lsn > %s::pg_lsn AND (l.table_name <> %s OR "
                    "(l.event = 'publication_drop' AND l.publication = %s))) ORDER BY h.id DESC LIMIT 1"
                ).format(history=history),
                (name, position, position, name, self.config.publication),
            )
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading the DDL history", where=self._where) from exc
        return None if row is None else int(row[0])

    async def _selection_column(self, conn: Connection) -> bool:
        """Whether the marker table records selections (a setup by this version made it)."""
        try:
            cursor = await conn.execute(
                "SELECT 1 FROM pg_attribute WHERE attname = 'selected_relids' AND NOT attisdropped "
                "AND attrelid = to_regclass(format('%%I.%%I', %s::text, %s::text))",
                (self.config.metadata_schema, MARKER_TABLE),
            )
            return await cursor.fetchone() is not None
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading the slot's marker", where=self._where) from exc

    def is_selected(self, name: str) -> bool:
        """Whether the stream reads the table named ``name`` (``schema.table``)."""
        return self._selected_names is None or name in self._selected_names
