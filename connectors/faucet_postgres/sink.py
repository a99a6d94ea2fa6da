"""The PostgreSQL bounded sink: COPY-based writes of Arrow batches into one table.

Modes (one per configured sink; ``capabilities().bounded_policies`` is exactly that mode):

- ``append``: ``COPY table FROM STDIN``, binary when every column has a binary encoder for its
  destination type, CSV otherwise (:func:`faucet_postgres.copy_arrow.copy_batch`).
- ``upsert``: COPY into a temporary staging table, then ``INSERT ... SELECT DISTINCT ON (key) ...
  ON CONFLICT (key) DO UPDATE``; within a batch the last row of a key wins, so replayed pages converge.
  The table needs a unique constraint on ``key`` (a table this sink creates gets it as primary key).
- ``delete``: COPY the batch's keys into a temporary staging table, then ``DELETE ... USING`` it.
- ``apply_changes``: change rows (``__faucet_op`` insert/update/delete) COPYed into a temporary
  staging table, then applied by key in row order with one set-based statement
  (:mod:`faucet_postgres.changes`): per key, its last change in the page wins. Replayed pages are
  skipped by the watermark, not by the key (re-applying an old page would move rows back).
- ``replace``: pages are copied into a new table (``CREATE TABLE ... (LIKE target INCLUDING ALL)``,
  or from the first batch's schema when there is no target), committed page by page; ``finish()``
  drops the target and renames the new table into its place in one transaction. A reader blocks for
  the instant of the swap and then sees the new table: never an empty or half-loaded one. The new
  table has the target's columns, defaults, constraints and indexes, and, granted in the swap's
  transaction, its owner and table privileges, so a replace changes the data and never who may read
  it (column privileges, triggers and row security policies are not carried over; a view depending
  on the target makes the swap fail with SchemaError rather than drop the view).

Every write is one transaction, committed before the method returns (durability TRANSACTIONAL;
``flush`` has nothing left to do). A missing table is created from the first batch's Arrow schema; a
batch column the table lacks is added with ``ADD COLUMN IF NOT EXISTS`` when ``schema_evolution`` is on
and refused with SchemaError when it is off. Every identifier goes through ``psycopg.sql``.

Watermark. ``write_batch_idempotent(records, token, bookmark)`` runs ``INSERT ... ON CONFLICT (sync_id) DO
UPDATE ... WHERE stored token < token`` on ``watermark_table`` first, in the same transaction as the
rows: a token not newer than the stored one writes nothing and returns 0, and two writers of one
``sync_id`` serialize on its row. The page's bookmark (JSON) is stored with the token, so a rerun after
a crash between this commit and the caller's record of it resumes from what the table holds
(``last_committed_bookmark``). Not in replace mode: a replace run rewrites the whole snapshot, which is
its own protection against replays.

Per-row results. ``write_batch_partial`` applies the batch under a savepoint; when the server refuses
rows (SQLSTATE class 22 or 23) it bisects under savepoints down to the refused rows and reports each
with the server's SQLSTATE and message; the other rows commit in one transaction.
"""

import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import psycopg
import pyarrow as pa
from psycopg import sql

from faucet_dagster.protocol import (
    DEFAULT_POLICY_OPERATIONS,
    AddColumn,
    CommitToken,
    ConfigError,
    DataError,
    DestinationReader,
    Durability,
    JsonValue,
    PartialResult,
    SchemaError,
    Sink,
    SinkCapabilities,
    UnsupportedOperation,
    WritePolicy,
    bisect_rejections,
)
from faucet_postgres import change_apply, change_schema, changes
from faucet_postgres.common import (
    PgColumn,
    add_columns,
    arrow_type,
    connect,
    create_table,
    current_schema,
    is_row_error,
    pg_error,
    row_error_reason,
    table_columns,
    table_name,
)
from faucet_postgres.config import PostgresSinkConfig
from faucet_postgres.copy_arrow import copy_batch

T = TypeVar("T")
Connection = psycopg.AsyncConnection[Any]

_STAGE_ORDER = "_faucet_ord"
"""Column numbering a staging table's rows in COPY order (the last row of a key wins)."""


class PostgresSink(Sink):
    """A bounded sink into one PostgreSQL table (see the module docstring). ``connect`` opens its
    connection (:func:`faucet_postgres.common.connect`'s signature; fault tests wrap it to inject a
    fault at an exact point)."""

    connector_name = "postgres"
    config_model = PostgresSinkConfig

    def __init__(
        self, config: PostgresSinkConfig, *, connect: Callable[..., Awaitable[Connection]] = connect
    ) -> None:
        self.config = config
        self._connect = connect
        self.mode = WritePolicy(config.mode)
        digest = hashlib.sha1(f"{config.schema_name or ''}.{config.table}".encode()).hexdigest()[:16]
        self._stage = f"_faucet_stage_{digest}"
        self._conn: Connection | None = None
        self._schema: str | None = config.schema_name
        self._columns: dict[str, PgColumn] | None = None
        """The write table's columns, as last committed (None: not looked up yet)."""
        self._staged = False
        """REPLACE: this run's new table exists (a leftover of a crashed run was dropped)."""
        self._watermark_ready = False
        self._watermark_scope: str | None = None
        """The shard whose watermark row this sink reads and advances (see scope_watermark)."""
        self._pending: dict[str, Any] = {}
        """Attribute values learnt in the running transaction, set once it commits."""

    # -- identity and capabilities ----------------------------------------------------------------

    def dataset_uri(self) -> str:
        return self.config.table_uri()

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(
            bounded_policies=frozenset({self.mode}),
            accepted_operations={
                **DEFAULT_POLICY_OPERATIONS,
                WritePolicy.APPLY_CHANGES: changes.APPLIED_OPERATIONS,
            },
            # apply_changes takes the key from the change rows (faucet.key) when none is configured.
            requires_key=frozenset({WritePolicy.UPSERT, WritePolicy.VERSIONED_UPSERT, WritePolicy.DELETE}),
            durability=Durability.TRANSACTIONAL,
            atomic_watermark=self.mode is not WritePolicy.REPLACE,
            watermark_bookmark=self.mode is not WritePolicy.REPLACE,
            schema_evolution=self.config.schema_evolution,
            partial_results=True,
        )

    def dedups_by_key(self) -> bool:
        return self.mode in (WritePolicy.UPSERT, WritePolicy.DELETE) and bool(self.config.key)

    def write_mode(self) -> tuple[WritePolicy, tuple[str, ...]]:
        return self.mode, tuple(self.config.key)

    async def reader(self, name: str) -> DestinationReader:
        """Read back the table, for ``faucet verify`` (:mod:`faucet_postgres.verification`)."""
        from faucet_postgres.verification import PostgresDestinationReader, ReadTarget

        return PostgresDestinationReader(ReadTarget.of_table(self.config), name, self.mode, self.config.key)

    def scope_watermark(self, scope: str) -> bool:
        self._watermark_scope = scope
        return True

    # -- protocol methods ---------------------------------------------------------------------------

    async def check(self) -> None:
        await self._in_transaction("checking access", self._check)

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.close()

    async def write_batch(self, records: pa.RecordBatch) -> int:
        async def write(conn: Connection) -> int:
            columns = await self._prepare(conn, records.schema)
            await self._apply(conn, columns, records)
            return int(records.num_rows)

        return await self._in_transaction("writing", write)

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        if self.mode is WritePolicy.REPLACE:
            raise UnsupportedOperation("replace has no atomic watermark", where=self.dataset_uri())

        async def write(conn: Connection) -> int:
            columns = await self._prepare(conn, records.schema)
            if not await self._claim(conn, token, bookmark):
                raise _Stale
            await self._apply(conn, columns, records)
            return int(records.num_rows)

        try:
            return await self._in_transaction("writing", write)
        except _Stale:
            return 0

    async def last_committed_token(self) -> CommitToken | None:
        committed = await self.last_committed_bookmark()
        return None if committed is None else committed[0]

    async def last_committed_bookmark(self) -> tuple[CommitToken, JsonValue | None] | None:
        if self.mode is WritePolicy.REPLACE:
            raise UnsupportedOperation("replace has no atomic watermark", where=self.dataset_uri())

        async def read(conn: Connection) -> tuple[CommitToken, JsonValue | None] | None:
            schema = await self._resolved_schema(conn)
            columns = await table_columns(conn, schema, self.config.watermark_table)
            if columns is None:
                return None
            # The first write need not create it (CREATE TABLE IF NOT EXISTS costs 2-3.5 ms), only add
            # the bookmark column to a table an older version made.
            self._pending["_watermark_ready"] = "bookmark" in columns
            cursor = await conn.execute(
                sql.SQL("SELECT token, {} FROM {} WHERE sync_id = %s").format(
                    sql.SQL("bookmark" if "bookmark" in columns else "NULL::text"),
                    table_name(schema, self.config.watermark_table),
                ),
                (self._sync_id(schema),),
            )
            row = await cursor.fetchone()
            if row is None:
                return None
            return CommitToken.parse(str(row[0])), None if row[1] is None else json.loads(row[1])

        return await self._in_transaction("reading the watermark", read)

    async def write_batch_partial(self, records: pa.RecordBatch) -> PartialResult:
        async def write(conn: Connection) -> PartialResult:
            columns = await self._prepare(conn, records.schema)

            async def attempt(start: int, stop: int) -> str | None:
                try:
                    async with conn.transaction():
                        await self._apply(conn, columns, records.slice(start, stop - start))
                except (psycopg.Error, DataError) as exc:
                    if is_row_error(exc):
                        return row_error_reason(exc)
                    raise
                return None

            return await bisect_rejections(records.num_rows, attempt)

        return await self._in_transaction("writing", write)

    async def finish(self) -> None:
        if self.mode is WritePolicy.REPLACE:
            await self._in_transaction("swapping in the new table", self._swap)

    async def current_schema(self) -> pa.Schema | None:
        async def read(conn: Connection) -> pa.Schema | None:
            schema = await self._resolved_schema(conn)
            replacing = self.mode is WritePolicy.REPLACE and not self._staged
            columns = await table_columns(
                conn, schema, self.config.table if replacing else self._write_name()
            )
            if columns is None:
                return None
            if not replacing:
                # The write table's columns, as the next write would read them first.
                self._pending["_columns"] = columns
            return pa.schema([pa.field(column.name, arrow_type(column)) for column in columns.values()])

        return await self._in_transaction("reading the table's columns", read)

    async def row_count(self) -> int | None:
        async def count(conn: Connection) -> int | None:
            schema = await self._resolved_schema(conn)
            if await table_columns(conn, schema, self.config.table) is None:
                return None
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, self.config.table))
            row = await (await conn.execute(query)).fetchone()
            return None if row is None else int(row[0])

        return await self._in_transaction("counting the table's rows", count)

    async def evolve_schema(self, changes: Sequence[AddColumn]) -> None:
        if not self.config.schema_evolution:
            raise SchemaError(
                f"schema evolution is off: not adding {', '.join(change.name for change in changes)}",
                where=self.dataset_uri(),
            )

        async def evolve(conn: Connection) -> None:
            schema = await self._resolved_schema(conn)
            if self.mode is WritePolicy.REPLACE and not self._staged:
                columns = await self._create_stage(conn, None)
            else:
                columns = await table_columns(conn, schema, self._write_name())
            if columns is None:
                # No table yet: the first write creates it with every column of its batch.
                return
            fields = [pa.field(change.name, change.type) for change in changes]
            self._after_commit(await add_columns(conn, schema, self._write_name(), fields))

        await self._in_transaction("adding columns", evolve)

    # -- transactions -------------------------------------------------------------------------------

    async def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed:
            self._conn = await self._connect(self.config)
        return self._conn

    async def _in_transaction(self, doing: str, work: Callable[[Connection], Awaitable[T]]) -> T:
        """Run ``work`` in one transaction, committed when it returns and rolled back when it raises.

        psycopg errors become FaucetErrors; a broken connection is dropped so the next call reconnects.
        What ``work`` learnt about the table is kept only once the transaction committed.
        """
        conn = await self._connection()
        self._pending = {}
        try:
            async with conn.transaction():
                result = await work(conn)
        except psycopg.Error as exc:
            if conn.broken:
                self._conn = None
            raise pg_error(exc, where=self.dataset_uri(), doing=doing) from exc
        except pa.ArrowException as exc:
            raise DataError(
                f"{doing} failed: the records cannot be encoded: {exc}", where=self.dataset_uri()
            ) from exc
        for name, value in self._pending.items():
            setattr(self, name, value)
        return result

    def _after_commit(self, columns: dict[str, PgColumn]) -> None:
        """Cache the write table's columns (and, for replace, that the new table exists) on commit."""
        self._pending["_columns"] = columns
        if self.mode is WritePolicy.REPLACE:
            self._pending["_staged"] = True

    async def _resolved_schema(self, conn: Connection) -> str:
        if self._schema is None:
            self._schema = await current_schema(conn)
        return self._schema

    def _write_name(self) -> str:
        return self._stage if self.mode is WritePolicy.REPLACE else self.config.table

    def _sync_id(self, schema: str) -> str:
        base = self.config.sync_id or f"{schema}.{self.config.table}"
        if self._watermark_scope is None:
            return base
        # One watermark row per shard; a digest of the shard when it would not fit varchar(200).
        suffix = self._watermark_scope
        if len(base) + 1 + len(suffix) > 200:
            suffix = hashlib.blake2b(suffix.encode(), digest_size=16).hexdigest()
        return f"{base}#{suffix}"

    # -- work inside a transaction ------------------------------------------------------------------

    async def _check(self, conn: Connection) -> None:
        await self._resolved_schema(conn)
        await conn.execute("SELECT 1")

    async def _prepare(self, conn: Connection, schema: pa.Schema) -> dict[str, PgColumn]:
        """The write table's columns for rows of ``schema``: created or evolved in this transaction."""
        pg_schema = await self._resolved_schema(conn)
        name = self._write_name()
        key = self._created_key()
        if self.mode is WritePolicy.APPLY_CHANGES:
            # Change rows: the table has their data columns, keyed as the rows say.
            key = changes.change_layout(schema, self.config.key, self.dataset_uri()).created_key
            schema = changes.data_schema(schema)
        if self.mode is WritePolicy.REPLACE and not self._staged:
            columns = await self._create_stage(conn, schema)
        else:
            columns = (
                self._columns if self._columns is not None else await table_columns(conn, pg_schema, name)
            )
        if columns is None:
            if self.mode is WritePolicy.DELETE:
                raise ConfigError(
                    f"table {pg_schema}.{name} does not exist: nothing to delete from",
                    where=self.dataset_uri(),
                )
            columns = await create_table(conn, pg_schema, name, schema, key)
        new = [field for field in schema if field.name not in columns]
        if new:
            if not self.config.schema_evolution:
                raise SchemaError(
                    f"the records have column(s) the table lacks: {', '.join(f.name for f in new)} "
                    "(schema evolution is off)",
                    where=self.dataset_uri(),
                )
            if self.mode is WritePolicy.APPLY_CHANGES:
                # A column added at the source: its older rows' value too (see change_schema.evolve).
                columns = await change_schema.evolve(conn, pg_schema, name, new, self.dataset_uri())
            else:
                columns = await add_columns(conn, pg_schema, name, new)
        missing_key = [column for column in self.config.key if column not in schema.names]
        if self.mode in (WritePolicy.UPSERT, WritePolicy.DELETE) and missing_key:
            raise SchemaError(
                f"the records lack key column(s) {', '.join(missing_key)}", where=self.dataset_uri()
            )
        self._after_commit(columns)
        return columns

    def _created_key(self) -> Sequence[str]:
        """The primary key of a table this sink creates: the key, except in append mode."""
        return self.config.key if self.mode is not WritePolicy.APPEND else ()

    async def _apply(self, conn: Connection, columns: dict[str, PgColumn], batch: pa.RecordBatch) -> None:
        """Apply ``batch`` in the configured mode inside the current transaction (or savepoint)."""
        schema = await self._resolved_schema(conn)
        target = table_name(schema, self._write_name())
        types = columns if self.config.copy_format == "auto" else None
        if self.mode in (WritePolicy.APPEND, WritePolicy.REPLACE):
            await copy_batch(conn, target, batch, types)
            return
        if batch.num_rows == 0:
            return
        if self.mode is WritePolicy.APPLY_CHANGES:
            await self._apply_changes(conn, target, columns, batch)
            return
        key = self.config.key
        names = batch.schema.names if self.mode is WritePolicy.UPSERT else list(key)
        stage = sql.Identifier("pg_temp", "_faucet_batch")
        listed = sql.SQL(", ").join(map(sql.Identifier, names))
        keyed = sql.SQL(", ").join(map(sql.Identifier, key))
        await conn.execute(
            sql.SQL("CREATE TEMP TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(stage, listed, target)
        )
        await copy_batch(conn, stage, batch.select(names), types)
        if self.mode is WritePolicy.DELETE:
            match = sql.SQL(" AND ").join(
                sql.SQL("t.{0} = s.{0}").format(sql.Identifier(column)) for column in key
            )
            await conn.execute(
                sql.SQL("DELETE FROM {} AS t USING {} AS s WHERE {}").format(target, stage, match)
            )
        else:
            await conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint GENERATED ALWAYS AS IDENTITY").format(
                    stage, sql.Identifier(_STAGE_ORDER)
                )
            )
            updates = [name for name in names if name not in key]
            action = (
                sql.SQL("DO UPDATE SET {}").format(
                    sql.SQL(", ").join(
                        sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in updates
                    )
                )
                if updates
                else sql.SQL("DO NOTHING")
            )
            await conn.execute(
                sql.SQL(
                    "INSERT INTO {target} ({listed}) SELECT DISTINCT ON ({keyed}) {listed} FROM {stage} "
                    "ORDER BY {keyed}, {order} DESC ON CONFLICT ({keyed}) {action}"
                ).format(
                    target=target,
                    listed=listed,
                    keyed=keyed,
                    stage=stage,
                    order=sql.Identifier(_STAGE_ORDER),
                    action=action,
                )
            )
        await conn.execute(sql.SQL("DROP TABLE {}").format(stage))

    async def _apply_changes(
        self, conn: Connection, target: sql.Identifier, columns: dict[str, PgColumn], batch: pa.RecordBatch
    ) -> None:
        """APPLY_CHANGES: the page's change rows applied by key, in row order (a bounded page has no
        positions: its rows are in source order)."""
        where = self.dataset_uri()
        layout = changes.change_layout(batch.schema, self.config.key, where)
        order = pa.array(range(batch.num_rows), pa.int64())
        rows = changes.staged_rows(
            batch, layout, pa.repeat(pa.scalar(0, pa.int64()), batch.num_rows), order, where
        )
        stage = await changes.create_stage(conn, target, columns, layout)
        await changes.stage(conn, stage, rows)
        await change_apply.apply_stage(conn, target, stage, where)
        await conn.execute(sql.SQL("DROP TABLE {}").format(stage.identifier))

    async def _create_stage(self, conn: Connection, schema: pa.Schema | None) -> dict[str, PgColumn] | None:
        """Drop a leftover new table and create this run's: like the target, or from ``schema`` when
        there is no target (None when there is neither)."""
        pg_schema = await self._resolved_schema(conn)
        stage = table_name(pg_schema, self._stage)
        await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(stage))
        if await table_columns(conn, pg_schema, self.config.table) is not None:
            await conn.execute(
                sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                    stage, table_name(pg_schema, self.config.table)
                )
            )
            return await table_columns(conn, pg_schema, self._stage)
        if schema is None:
            return None
        return await create_table(conn, pg_schema, self._stage, schema, self._created_key())

    async def _swap(self, conn: Connection) -> None:
        """REPLACE: drop the target and rename the new table into its place, in this transaction."""
        pg_schema = await self._resolved_schema(conn)
        if not self._staged and await self._create_stage(conn, None) is None:
            # Nothing was written and there is no table to empty: nothing to replace.
            return
        await self._carry_privileges(conn, pg_schema)
        target = table_name(pg_schema, self.config.table)
        await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(target))
        await conn.execute(
            sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                table_name(pg_schema, self._stage), sql.Identifier(self.config.table)
            )
        )
        self._pending.update(_staged=False, _columns=None)

    async def _carry_privileges(self, conn: Connection, pg_schema: str) -> None:
        """REPLACE: give the new table the target's owner and table privileges (PUBLIC included), in
        the swap's transaction. Nothing to do when there is no target."""
        stage = table_name(pg_schema, self._stage)
        cursor = await conn.execute(
            "SELECT pg_get_userbyid(c.relowner), current_user FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
            (pg_schema, self.config.table),
        )
        found = await cursor.fetchone()
        if found is None:
            return
        owner, me = found
        if owner != me:
            await conn.execute(sql.SQL("ALTER TABLE {} OWNER TO {}").format(stage, sql.Identifier(owner)))
        cursor = await conn.execute(
            "SELECT CASE WHEN a.grantee = 0 THEN NULL ELSE pg_get_userbyid(a.grantee) END, "
            "a.privilege_type, a.is_grantable FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace, aclexplode(c.relacl) AS a "
            "WHERE n.nspname = %s AND c.relname = %s AND a.grantee <> c.relowner",
            (pg_schema, self.config.table),
        )
        for grantee, privilege, grantable in await cursor.fetchall():
            if privilege not in _TABLE_PRIVILEGES:
                raise SchemaError(
                    f"the target has a privilege this sink cannot carry over: {privilege}",
                    where=self.dataset_uri(),
                )
            await conn.execute(
                sql.SQL("GRANT {} ON TABLE {} TO {}{}").format(
                    sql.SQL(privilege),
                    stage,
                    sql.SQL("PUBLIC") if grantee is None else sql.Identifier(grantee),
                    sql.SQL(" WITH GRANT OPTION") if grantable else sql.SQL(""),
                )
            )

    async def _claim(self, conn: Connection, token: CommitToken, bookmark: JsonValue | None) -> bool:
        """Advance this sync's watermark to ``token`` (with the page's ``bookmark``) in the current
        transaction; False when the stored token is not older (a replayed page). The row lock
        serializes writers of one sync_id."""
        schema = await self._resolved_schema(conn)
        watermark = table_name(schema, self.config.watermark_table)
        if not self._watermark_ready:
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (sync_id varchar(200) PRIMARY KEY, token varchar(20) "
                    "NOT NULL, updated_at timestamptz NOT NULL DEFAULT now(), bookmark text)"
                ).format(watermark)
            )
            # A table an older version made has no bookmark column.
            await conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS bookmark text").format(watermark)
            )
            self._pending["_watermark_ready"] = True
        cursor = await conn.execute(
            sql.SQL(
                "INSERT INTO {} AS w (sync_id, token, updated_at, bookmark) VALUES (%s, %s, now(), %s) "
                "ON CONFLICT (sync_id) DO UPDATE SET token = EXCLUDED.token, updated_at = now(), "
                'bookmark = EXCLUDED.bookmark WHERE w.token COLLATE "C" < EXCLUDED.token COLLATE "C" '
                "RETURNING true"
            ).format(watermark),
            (self._sync_id(schema), str(token), None if bookmark is None else json.dumps(bookmark)),
        )
        return await cursor.fetchone() is not None


_TABLE_PRIVILEGES = frozenset(
    {"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER", "MAINTAIN"}
)
"""The table privileges aclexplode names (MAINTAIN from PostgreSQL 17)."""


class _Stale(Exception):
    """The token was not newer than the watermark: roll the transaction back and write nothing."""
