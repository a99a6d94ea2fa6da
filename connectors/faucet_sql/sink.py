"""The SQL sink: writes Arrow batches into one table of any SQLAlchemy database (SQLite by default).

Modes (one per configured sink; ``capabilities().bounded_policies`` is exactly that mode):

- ``append``: INSERT every row.
- ``upsert``: insert, or update the row with the same ``key``: ``INSERT ... ON CONFLICT (key) DO
  UPDATE`` on SQLite and PostgreSQL, ``ON DUPLICATE KEY UPDATE`` on MySQL/MariaDB, and elsewhere a
  DELETE of the batch's keys followed by an INSERT in the same transaction. Within a batch the last
  row of a key wins, so replaying pages converges.
- ``replace``: rows go to a staging table (a copy of the target's columns, or created from the first
  batch); ``finish()`` drops the target and renames the staging table into its place in one
  transaction, so a reader sees the old table or the new one, never an empty or half-loaded one. Only
  on databases with transactional DDL (SQLite, PostgreSQL). The staging table keeps the target's
  columns, types, nullability and primary key, and the swap re-creates the target's indexes (unique
  or not, on columns) under their names; not its defaults, check constraints or grants. A target
  index on an expression is refused with SchemaError before anything is written.

Every ``write_batch`` is one committed transaction (durability TRANSACTIONAL; ``flush`` has nothing
left to do). The table is created from the first batch's Arrow schema when missing (``key`` becomes
the primary key in upsert mode). A batch column the table lacks is added (ALTER TABLE ADD COLUMN)
when ``schema_evolution`` is on and refused with SchemaError when it is off.

Watermark. ``write_batch_idempotent(records, token, bookmark)`` writes the rows and advances the commit
token of this sink's ``sync_id`` in ``watermark_table`` in the same transaction, with the page's
bookmark (JSON), which ``last_committed_bookmark`` reads back so a rerun resumes from what the table
holds; a token not newer than the stored one writes nothing and returns 0. Append and upsert only: a
replace run always rewrites the whole snapshot, which is its own protection against replays.

Per-row results. ``write_batch_partial`` applies the batch under a savepoint and, when the database
refuses rows (a constraint, a value it cannot store), bisects under savepoints down to the refused rows,
which it reports with the database's message; the other rows commit in one transaction.
"""

import asyncio
import hashlib
import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import pyarrow as pa
import sqlalchemy as sa

from faucet_dagster.protocol import (
    AddColumn,
    CommitToken,
    ConfigError,
    DataError,
    Durability,
    JsonValue,
    PartialResult,
    SchemaError,
    Sink,
    SinkCapabilities,
    UnsupportedOperation,
    WritePolicy,
    bisect_rejections,
    last_row_per_key,
)
from faucet_sql.config import SqlSinkConfig
from faucet_sql.database import (
    TRANSACTIONAL_DDL_DIALECTS,
    Database,
    arrow_type,
    db_error,
    error_text,
    is_row_error,
    sql_type,
    staging_name,
    utc_now,
)

P = ParamSpec("P")
T = TypeVar("T")

_SYNC_ID_LENGTH = 200


class SqlSink(Sink):
    """A bounded sink into one table of any SQLAlchemy database (see the module docstring)."""

    connector_name = "sql"
    config_model = SqlSinkConfig

    def __init__(self, config: SqlSinkConfig) -> None:
        self.config = config
        self.db = Database(config, writer=True)
        self.mode = WritePolicy(config.mode)
        if self.mode is WritePolicy.REPLACE and self.db.dialect not in TRANSACTIONAL_DDL_DIALECTS:
            raise ConfigError(
                f"replace swaps tables inside one transaction, which {self.db.dialect} cannot do "
                f"(supported: {', '.join(sorted(TRANSACTIONAL_DDL_DIALECTS))})",
                where=self.db.safe_url,
            )
        self._stage = staging_name(self.db.qualified(), "stage")
        self._table: sa.Table | None = None
        """The table writes go to, as last committed (None: not looked up yet)."""
        self._staged = False
        """REPLACE: this run's staging table exists (leftovers of a crashed run were dropped)."""
        self._watermark_scope = config.watermark_scope()
        """The ``sync_id`` of the watermark row this sink reads and advances (see scope_watermark)."""
        self._bookmark_column = False
        """The watermark table is known to have its bookmark column."""

    # -- identity and capabilities ----------------------------------------------------------------

    def dataset_uri(self) -> str:
        return self.db.where()

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(
            bounded_policies=frozenset({self.mode}),
            durability=Durability.TRANSACTIONAL,
            atomic_watermark=self.mode in (WritePolicy.APPEND, WritePolicy.UPSERT),
            watermark_bookmark=self.mode in (WritePolicy.APPEND, WritePolicy.UPSERT),
            schema_evolution=self.config.schema_evolution,
            partial_results=True,
        )

    def dedups_by_key(self) -> bool:
        return self.mode is WritePolicy.UPSERT and bool(self.config.key)

    def write_mode(self) -> tuple[WritePolicy, tuple[str, ...]]:
        return self.mode, tuple(self.config.key)

    def scope_watermark(self, scope: str) -> bool:
        # One watermark row per shard: ``<sync_id>#<shard>``, or a digest of the shard when that
        # would not fit the sync_id column.
        suffix = scope
        if len(self.config.watermark_scope()) + 1 + len(scope) > _SYNC_ID_LENGTH:
            suffix = hashlib.blake2b(scope.encode(), digest_size=16).hexdigest()
        self._watermark_scope = f"{self.config.watermark_scope()}#{suffix}"
        return True

    # -- protocol methods ---------------------------------------------------------------------------

    async def check(self) -> None:
        await self._run(self._check)

    async def close(self) -> None:
        await asyncio.to_thread(self.db.dispose)

    async def write_batch(self, records: pa.RecordBatch) -> int:
        return await self._run(self._write, records, None)

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        if not self.capabilities().atomic_watermark:
            raise UnsupportedOperation(f"{self.mode.value} has no atomic watermark", where=self.dataset_uri())
        return await self._run(self._write, records, (token, bookmark))

    async def last_committed_token(self) -> CommitToken | None:
        committed = await self.last_committed_bookmark()
        return None if committed is None else committed[0]

    async def last_committed_bookmark(self) -> tuple[CommitToken, JsonValue | None] | None:
        if not self.capabilities().atomic_watermark:
            raise UnsupportedOperation(f"{self.mode.value} has no atomic watermark", where=self.dataset_uri())
        return await self._run(self._read_token)

    async def write_batch_partial(self, records: pa.RecordBatch) -> PartialResult:
        conn = await self._run(self.db.engine.connect)
        try:
            await self._run(conn.begin)
            table = await self._run(self._prepare, conn, records.schema)

            async def attempt(start: int, stop: int) -> str | None:
                return await self._run(self._attempt, conn, table, records.slice(start, stop - start))

            result = await bisect_rejections(records.num_rows, attempt)
            await self._run(conn.commit)
            self._committed(table)
            return result
        finally:
            await self._run(conn.close)

    async def finish(self) -> None:
        if self.mode is WritePolicy.REPLACE:
            await self._run(self._swap)

    async def current_schema(self) -> pa.Schema | None:
        return await self._run(self._current_schema)

    async def row_count(self) -> int | None:
        return await self._run(self._row_count)

    async def evolve_schema(self, changes: Sequence[AddColumn]) -> None:
        if not self.config.schema_evolution:
            raise SchemaError(
                f"schema evolution is off: not adding {', '.join(change.name for change in changes)}",
                where=self.dataset_uri(),
            )
        await self._run(self._evolve, changes)

    # -- blocking parts, run in a worker thread ---------------------------------------------------

    async def _run(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await asyncio.to_thread(function, *args, **kwargs)
        except sa.exc.SQLAlchemyError as exc:
            raise db_error(exc, where=self.dataset_uri(), doing="writing") from exc
        except pa.ArrowException as exc:
            raise DataError(f"the records cannot be written: {exc}", where=self.dataset_uri()) from exc

    def _write_name(self) -> str:
        return self._stage if self.mode is WritePolicy.REPLACE else self.config.table

    def _committed(self, table: sa.Table) -> None:
        """Remember what a committed transaction created (the caches follow commits only)."""
        self._table = table
        self._staged = self._staged or self.mode is WritePolicy.REPLACE

    def _check(self) -> None:
        with self.db.engine.connect() as conn:
            conn.execute(sa.select(sa.literal(1)))
            self._reflect(conn, self.config.table)

    def _write(self, batch: pa.RecordBatch, watermark: tuple[CommitToken, JsonValue | None] | None) -> int:
        with self.db.engine.connect() as conn:
            with conn.begin() as transaction:
                table = self._prepare(conn, batch.schema)
                if watermark is not None and not self._claim(conn, *watermark):
                    transaction.rollback()
                    return 0
                self._apply(conn, table, batch)
            self._committed(table)
        return int(batch.num_rows)

    def _attempt(self, conn: sa.Connection, table: sa.Table, rows: pa.RecordBatch) -> str | None:
        """Apply ``rows`` under a savepoint: None when they landed, the reason when refused."""
        savepoint = conn.begin_nested()
        try:
            self._apply(conn, table, rows)
        except (sa.exc.SQLAlchemyError, DataError) as exc:
            savepoint.rollback()
            if is_row_error(exc):
                return error_text(exc)
            raise
        savepoint.commit()
        return None

    def _apply(self, conn: sa.Connection, table: sa.Table, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if self.mode is not WritePolicy.UPSERT:
            conn.execute(sa.insert(table), batch.to_pylist())
            return
        batch = last_row_per_key(batch, self.config.key)
        rows = batch.to_pylist()
        statement = self._upsert_statement(table, batch.schema.names)
        if statement is None:
            # No native upsert: delete the batch's keys, then insert, in this transaction.
            key = [table.c[name] for name in self.config.key]
            match = sa.and_(*(column == sa.bindparam(f"k{i}") for i, column in enumerate(key)))
            keys = [{f"k{i}": row[column.name] for i, column in enumerate(key)} for row in rows]
            conn.execute(sa.delete(table).where(match), keys)
            statement = sa.insert(table)
        conn.execute(statement, rows)

    def _upsert_statement(self, table: sa.Table, names: Sequence[str]) -> Any:
        """The dialect's insert-or-update statement, or None when the dialect has none."""
        key = self.config.key
        updates = [name for name in names if name not in key]
        if self.db.dialect == "sqlite":
            from sqlalchemy.dialects import sqlite

            return _on_conflict(sqlite.insert(table), table, key, updates)
        if self.db.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return _on_conflict(postgresql.insert(table), table, key, updates)
        if self.db.dialect in ("mysql", "mariadb"):
            from sqlalchemy.dialects import mysql

            statement = mysql.insert(table)
            return statement.on_duplicate_key_update(
                {name: statement.inserted[name] for name in updates or key}
            )
        return None

    def _prepare(self, conn: sa.Connection, schema: pa.Schema) -> sa.Table:
        """The table ``schema``'s rows go to, created or evolved inside the caller's transaction."""
        self._check_column_names(schema.names)
        if self.mode is WritePolicy.REPLACE and not self._staged:
            table = self._create_stage(conn, schema)
        else:
            table = self._table if self._table is not None else self._reflect(conn, self._write_name())
        if table is None:
            table = self._create(conn, self._write_name(), [(f.name, sql_type(f.type)) for f in schema])
        new = [field for field in schema if field.name not in table.c]
        if new:
            if not self.config.schema_evolution:
                raise SchemaError(
                    f"the records have column(s) the table lacks: {', '.join(f.name for f in new)} "
                    "(schema evolution is off)",
                    where=self.dataset_uri(),
                )
            table = self._add_columns(conn, table, [AddColumn(f.name, f.type) for f in new])
        missing_key = [name for name in self.config.key if name not in schema.names]
        if self.mode is WritePolicy.UPSERT and missing_key:
            raise SchemaError(
                f"the records lack key column(s) {', '.join(missing_key)}", where=self.dataset_uri()
            )
        return table

    def _reflect(self, conn: sa.Connection, name: str) -> sa.Table | None:
        if not sa.inspect(conn).has_table(name, schema=self.config.schema_name):
            return None
        with warnings.catch_warnings():
            # Handled: _column_indexes finds SQLite's expression indexes itself.
            warnings.filterwarnings("ignore", "Skipped unsupported reflection of expression-based index")
            return sa.Table(name, sa.MetaData(), schema=self.config.schema_name, autoload_with=conn)

    def _create(self, conn: sa.Connection, name: str, columns: Sequence[tuple[str, Any]]) -> sa.Table:
        keyed = self.mode is WritePolicy.UPSERT
        table = sa.Table(
            name,
            sa.MetaData(),
            *(
                sa.Column(
                    column,
                    kind,
                    primary_key=keyed and column in self.config.key,
                    nullable=not (keyed and column in self.config.key),
                    autoincrement=False,
                )
                for column, kind in columns
            ),
            schema=self.config.schema_name,
        )
        table.create(conn)
        return table

    def _create_stage(self, conn: sa.Connection, schema: pa.Schema | None) -> sa.Table | None:
        """Drop a leftover staging table and create this run's: a copy of the target's columns, or
        from ``schema`` when there is no target (None when there is neither)."""
        leftover = sa.Table(self._stage, sa.MetaData(), schema=self.config.schema_name)
        conn.execute(sa.schema.DropTable(leftover, if_exists=True))
        target = self._reflect(conn, self.config.table)
        if target is not None:
            _column_indexes(
                conn, target, self.dataset_uri()
            )  # an index the swap cannot re-create: refuse now
            stage = sa.Table(
                self._stage,
                sa.MetaData(),
                *(
                    sa.Column(
                        column.name,
                        column.type,
                        nullable=column.nullable,
                        primary_key=column.primary_key,
                        autoincrement=False,
                    )
                    for column in target.columns
                ),
                schema=self.config.schema_name,
            )
            stage.create(conn)
            return stage
        if schema is None:
            return None
        return self._create(conn, self._stage, [(f.name, sql_type(f.type)) for f in schema])

    def _check_column_names(self, names: Sequence[str]) -> None:
        """SchemaError for a column of the data the database would not keep as named (too long)."""
        for name in names:
            problem = self.config.identifier_problem(name)
            if problem:
                raise SchemaError(
                    f"a column of the records cannot be created: {problem}", where=self.dataset_uri()
                )

    def _add_columns(self, conn: sa.Connection, table: sa.Table, changes: Sequence[AddColumn]) -> sa.Table:
        self._check_column_names([change.name for change in changes])
        preparer = conn.dialect.identifier_preparer
        for change in changes:
            if change.name in table.c:
                continue
            kind = sql_type(change.type).compile(dialect=conn.dialect)
            _ddl(
                conn,
                f"ALTER TABLE {preparer.format_table(table)} ADD COLUMN {preparer.quote(change.name)} {kind}",
            )
        reflected = self._reflect(conn, table.name)
        assert reflected is not None
        return reflected

    def _evolve(self, changes: Sequence[AddColumn]) -> None:
        with self.db.engine.connect() as conn:
            with conn.begin():
                if self.mode is WritePolicy.REPLACE and not self._staged:
                    table = self._create_stage(conn, None)
                else:
                    table = self._reflect(conn, self._write_name())
                if table is None:
                    # No table yet: the first write creates it with every column of its batch.
                    return
                table = self._add_columns(conn, table, changes)
            self._committed(table)

    def _current_schema(self) -> pa.Schema | None:
        with self.db.engine.connect() as conn:
            name = (
                self._write_name()
                if self._staged or self.mode is not WritePolicy.REPLACE
                else self.config.table
            )
            table = self._reflect(conn, name)
        if table is None:
            return None
        return pa.schema([pa.field(column.name, arrow_type(column.type)) for column in table.columns])

    def _row_count(self) -> int | None:
        with self.db.engine.connect() as conn:
            table = self._reflect(conn, self.config.table)
            if table is None:
                return None
            return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())

    def _swap(self) -> None:
        """REPLACE: put the staging table in the target's place in one transaction."""
        with self.db.engine.connect() as conn, conn.begin():
            stage = self._reflect(conn, self._stage) if self._staged else self._create_stage(conn, None)
            if stage is None:
                # Nothing was written and there is no table to empty: nothing to replace.
                return
            target = self._reflect(conn, self.config.table)
            indexes = [] if target is None else _column_indexes(conn, target, self.dataset_uri())
            if target is not None:
                conn.execute(sa.schema.DropTable(target))
            preparer = conn.dialect.identifier_preparer
            new_name = preparer.quote(self.config.table)
            _ddl(conn, f"ALTER TABLE {preparer.format_table(stage)} RENAME TO {new_name}")
            # Index names are unique per schema: the target's can be taken only once it is dropped.
            replaced = self._reflect(conn, self.config.table)
            assert replaced is not None
            for name, columns, unique in indexes:
                sa.Index(name, *(replaced.c[column] for column in columns), unique=unique).create(conn)
        self._staged = False
        self._table = None

    # -- watermark --------------------------------------------------------------------------------

    def _watermark_table(self) -> sa.Table:
        return sa.Table(
            self.config.watermark_table,
            sa.MetaData(),
            sa.Column("sync_id", sa.String(_SYNC_ID_LENGTH), primary_key=True),
            sa.Column("token", sa.String(CommitToken.WIDTH), nullable=False),
            sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("bookmark", sa.Text(), nullable=True),
            schema=self.config.schema_name,
        )

    def _claim(self, conn: sa.Connection, token: CommitToken, bookmark: JsonValue | None) -> bool:
        """Advance this sync's watermark to ``token`` (with the page's ``bookmark``) in the caller's
        transaction; False when the stored token is not older (a replayed page). The conditional
        UPDATE also locks the row, so two writers of one sync commit one after the other, never both
        past the same token."""
        watermark = self._watermark_table()
        watermark.create(conn, checkfirst=True)
        self._add_bookmark_column(conn, watermark)
        scope = self._watermark_scope
        values = {
            "token": str(token),
            "updated_at": utc_now(),
            "bookmark": None if bookmark is None else json.dumps(bookmark),
        }
        advanced = conn.execute(
            sa.update(watermark)
            .where(watermark.c.sync_id == scope, watermark.c.token < str(token))
            .values(**values)
        )
        if advanced.rowcount == 1:
            return True
        stored = conn.execute(sa.select(watermark.c.token).where(watermark.c.sync_id == scope)).first()
        if stored is not None:
            return False
        conn.execute(sa.insert(watermark).values(sync_id=scope, **values))
        return True

    def _add_bookmark_column(self, conn: sa.Connection, watermark: sa.Table) -> None:
        """Add the bookmark column to a watermark table an older version made (once per sink)."""
        if self._bookmark_column:
            return
        columns = {
            column["name"] for column in sa.inspect(conn).get_columns(watermark.name, watermark.schema)
        }
        if "bookmark" not in columns:
            target = self.db.engine.dialect.identifier_preparer.format_table(watermark)
            conn.exec_driver_sql(f"ALTER TABLE {target} ADD COLUMN bookmark TEXT")
        self._bookmark_column = True

    def _read_token(self) -> tuple[CommitToken, JsonValue | None] | None:
        watermark = self._watermark_table()
        with self.db.engine.connect() as conn:
            if not sa.inspect(conn).has_table(watermark.name, schema=self.config.schema_name):
                return None
            columns = {
                column["name"] for column in sa.inspect(conn).get_columns(watermark.name, watermark.schema)
            }
            bookmark = watermark.c.bookmark if "bookmark" in columns else sa.null()
            stored = conn.execute(
                sa.select(watermark.c.token, bookmark).where(watermark.c.sync_id == self._watermark_scope)
            ).first()
        if stored is None:
            return None
        return CommitToken.parse(stored[0]), None if stored[1] is None else json.loads(stored[1])


def _on_conflict(statement: Any, table: sa.Table, key: Sequence[str], updates: Sequence[str]) -> Any:
    """``INSERT ... ON CONFLICT (key) DO UPDATE`` (SQLite and PostgreSQL spell it alike)."""
    index = [table.c[name] for name in key]
    if not updates:
        return statement.on_conflict_do_nothing(index_elements=index)
    return statement.on_conflict_do_update(
        index_elements=index, set_={name: statement.excluded[name] for name in updates}
    )


def _column_indexes(conn: sa.Connection, table: sa.Table, where: str) -> list[tuple[str, list[str], bool]]:
    """The (name, columns, unique) of ``table``'s named indexes; SchemaError for one on an expression,
    which this sink cannot re-create on another table."""
    on_expressions = [
        str(index.name)
        for index in table.indexes
        if index.name is None or not index.columns or len(index.expressions) != len(index.columns)
    ]
    if conn.dialect.name == "sqlite":
        # SQLAlchemy leaves SQLite's expression indexes out of the reflection (with a warning only).
        declared = conn.execute(
            sa.text(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = :t AND sql IS NOT NULL"
            ),
            {"t": table.name},
        )
        on_expressions += sorted(
            {str(row[0]) for row in declared} - {str(index.name) for index in table.indexes}
        )
    if on_expressions:
        raise SchemaError(
            f"{table.name} has indexes on expressions ({', '.join(on_expressions)}): replace cannot "
            "re-create them on the new table",
            where=where,
        )
    return [
        (str(index.name), [column.name for column in index.columns], bool(index.unique))
        for index in table.indexes
    ]


def _ddl(conn: sa.Connection, statement: str) -> None:
    """Run DDL text built from identifiers quoted by the dialect's preparer.

    The preparer already doubles a ``%`` in a name for drivers whose paramstyle is %-based (psycopg,
    mysqlclient), and those drivers undo it on execution; the text goes to the driver as it is, so a
    ``%`` is neither lost nor doubled on any driver (``sa.DDL`` would %-format it once more)."""
    conn.exec_driver_sql(statement)
