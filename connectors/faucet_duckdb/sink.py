"""The DuckDB sink: Arrow batches into one table of a DuckDB file, one transaction per batch.

Modes (one per configured sink; ``capabilities().bounded_policies`` is exactly that mode):

- ``append``: ``INSERT INTO ... BY NAME`` straight from the Arrow batch (DuckDB scans it in place).
- ``upsert``: ``MERGE INTO ... ON key`` (update by name, or insert by name); within a batch the last row
  of a key wins, so replaying pages converges. A row without its key is refused (DataError).
- ``replace``: rows go to a staging table (the target's columns and primary key, or created from the
  first batch); ``finish()`` drops the target and renames the staging table into its place in one
  transaction (DuckDB's DDL is transactional), so a reader sees the old table or the new one, never an
  empty or half-loaded one. The new table keeps the target's columns, types and primary key; not its
  other indexes, defaults or comments.

Every ``write_batch`` is one committed transaction: DuckDB writes its WAL at commit, so a crash
mid-batch leaves nothing of it (durability TRANSACTIONAL; ``flush`` has nothing left to do). A missing
table is created from the first batch's columns; a column the table lacks is added when
``schema_evolution`` is on and refused (SchemaError) when it is off; a column whose values DuckDB would
convert (a DOUBLE into a BIGINT column rounds) is refused, naming it.

Per-row results. ``write_batch_partial`` writes the batch in one transaction; when the table refuses
a row (a constraint, a value its column cannot hold), the refused rows are found by bisection, each
probe a transaction rolled back (DuckDB has no savepoints, and a failed statement aborts its
transaction), and the other rows are written in one transaction. The writer lock is released between
probes: a row another writer of the process makes refusable meanwhile fails that last write whole.

Watermark. ``write_batch_idempotent(records, token)`` writes the rows and advances the commit token of
this sink's ``sync_id`` in ``watermark_table`` in the same transaction; a token not newer than the
stored one writes nothing and returns 0. Append and upsert only: a replace run rewrites the whole
snapshot, its own protection against replays. ``scope_watermark`` keeps one token per shard.

The file. The sink opens the file at its first call and holds it until ``close`` (see
:mod:`faucet_duckdb.database` for DuckDB's one-writer rule and :class:`DatabaseLocked`).
"""

import hashlib
import json
from collections.abc import Sequence

import duckdb
import pyarrow as pa

from faucet_dagster.protocol import (
    AddColumn,
    CommitConflict,
    CommitToken,
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
    upsert_rows,
)
from faucet_duckdb import tables
from faucet_duckdb.config import DuckDbSinkConfig
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

_SYNC_ID_LENGTH = 200


class DuckDbSink(Sink):
    """A bounded sink into one table of a DuckDB file (see the module docstring)."""

    connector_name = "duckdb"
    config_model = DuckDbSinkConfig

    def __init__(self, config: DuckDbSinkConfig, *, connect: Connect = duckdb.connect) -> None:
        self.config = config
        self.mode = WritePolicy(config.mode)
        self.file = DuckDbFile(config, writer=True, where=self.dataset_uri(), connect=connect)
        self._key = tuple(config.key) if self.mode is WritePolicy.UPSERT else ()
        self._stage = "_faucet_stage_" + hashlib.sha1(self.label.encode()).hexdigest()[:16]
        self._staged = False
        """REPLACE: this run's staging table exists (a crashed run's leftover was dropped)."""
        self._watermark_scope = config.watermark_scope()
        self._watermark_ready = False
        """The watermark table exists with its bookmark column (its DDL runs once per sink)."""
        self._checked: tuple[pa.Schema, tables.Target, int] | None = None
        """The Arrow schema of the last committed batch, the table it was checked against and the
        connection (:attr:`DuckDbFile.opened`) that read it: a next batch of that schema goes to that
        table without reading the catalog again while that connection holds the file and this sink
        made no DDL of its own outside a write (evolve, replace)."""

    @property
    def label(self) -> str:
        return f"{self.config.schema_name}.{self.config.table}"

    # -- identity and capabilities ----------------------------------------------------------------

    def dataset_uri(self) -> str:
        return f"{file_uri(self.config)}#{self.label}"

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(
            bounded_policies=frozenset({self.mode}),
            durability=Durability.TRANSACTIONAL,
            atomic_watermark=self.mode in (WritePolicy.APPEND, WritePolicy.UPSERT),
            watermark_bookmark=self.mode in (WritePolicy.APPEND, WritePolicy.UPSERT),
            partial_results=True,
            schema_evolution=self.config.schema_evolution,
        )

    def dedups_by_key(self) -> bool:
        return self.mode is WritePolicy.UPSERT and bool(self.config.key)

    def write_mode(self) -> tuple[WritePolicy, tuple[str, ...]]:
        return self.mode, tuple(self.config.key)

    def scope_watermark(self, scope: str) -> bool:
        base = self.config.watermark_scope()
        suffix = scope
        if len(base) + 1 + len(scope) > _SYNC_ID_LENGTH:
            suffix = hashlib.blake2b(scope.encode(), digest_size=16).hexdigest()
        self._watermark_scope = f"{base}#{suffix}"
        return True

    # -- protocol methods ---------------------------------------------------------------------------

    async def check(self) -> None:
        await self.file.call("checking the database", _ping)

    async def close(self) -> None:
        await self.file.close()

    async def write_batch(self, records: pa.RecordBatch) -> int:
        return await self.file.call("writing", self._write, records, None)

    async def write_batch_partial(self, records: pa.RecordBatch) -> PartialResult:
        """The batch in one transaction; when the table refuses a row, the refused rows are found by
        bisection (each probe a transaction rolled back, DuckDB having no savepoints) and the others
        written in one transaction."""
        try:
            return PartialResult(written=await self.write_batch(records))
        except DataError:
            pass

        async def attempt(start: int, stop: int) -> str | None:
            part = records.slice(start, stop - start)
            return await self.file.call("checking rows", self._refusal, part)

        probed = await bisect_rejections(records.num_rows, attempt)
        refused = {row.index for row in probed.rejected}
        kept = records.filter(pa.array([index not in refused for index in range(records.num_rows)]))
        return PartialResult(written=await self.write_batch(kept), rejected=probed.rejected)

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        self._require_watermark()
        return await self.file.call("writing", self._write, records, (token, bookmark))

    async def last_committed_token(self) -> CommitToken | None:
        committed = await self.last_committed_bookmark()
        return None if committed is None else committed[0]

    async def last_committed_bookmark(self) -> tuple[CommitToken, JsonValue | None] | None:
        self._require_watermark()
        return await self.file.call("reading the watermark", self._read_token)

    async def finish(self) -> None:
        if self.mode is WritePolicy.REPLACE:
            await self.file.call("replacing the table", self._swap)

    async def current_schema(self) -> pa.Schema | None:
        return await self.file.call("reading the table's schema", self._current_schema)

    async def row_count(self) -> int | None:
        return await self.file.call(
            "counting rows", tables.row_count, self.config.schema_name, self.config.table
        )

    async def evolve_schema(self, changes: Sequence[AddColumn]) -> None:
        if not self.config.schema_evolution:
            raise SchemaError(
                f"schema evolution is off: not adding {', '.join(change.name for change in changes)}",
                where=self.dataset_uri(),
            )
        await self.file.call("adding columns", self._evolve, changes)

    # -- blocking parts, run on the file's worker thread ------------------------------------------

    def _require_watermark(self) -> None:
        if not self.capabilities().atomic_watermark:
            raise UnsupportedOperation(f"{self.mode.value} has no atomic watermark", where=self.dataset_uri())

    def _write_name(self) -> str:
        return self._stage if self.mode is WritePolicy.REPLACE else self.config.table

    def _write(
        self,
        conn: duckdb.DuckDBPyConnection,
        batch: pa.RecordBatch,
        token: tuple[CommitToken, JsonValue | None] | None,
    ) -> int:
        """Write ``batch`` in one transaction (with the token advanced in it, and the page's bookmark
        kept with it); 0 for a replayed token."""
        conn.begin()
        try:
            written, target = self._apply(conn, batch, token)
            if written is None:
                conn.rollback()
                return 0
            conn.commit()
        except BaseException:
            self._checked = None
            rollback_quietly(conn)
            raise
        self._checked = (batch.schema, target, self.file.opened)
        self._staged = self._staged or self.mode is WritePolicy.REPLACE
        # Committed with the token: the watermark table's DDL of this transaction holds from now on.
        self._watermark_ready = self._watermark_ready or token is not None
        return written

    def _apply(
        self,
        conn: duckdb.DuckDBPyConnection,
        batch: pa.RecordBatch,
        token: tuple[CommitToken, JsonValue | None] | None,
    ) -> tuple[int | None, tables.Target]:
        """Write ``batch`` in the caller's transaction; the rows written (None when ``token`` is not
        newer than the stored one: nothing was written) and the table they went to."""
        schema = batch.schema
        if self._key:
            batch = upsert_rows(batch, self._key, self.dataset_uri())
        if self.mode is WritePolicy.REPLACE and not self._staged:
            self._create_stage(conn)
        with tables.registered(conn, batch):
            checked = self._checked
            if checked is not None and checked[0].equals(schema) and checked[2] == self.file.opened:
                target = checked[1]
            else:
                target = tables.prepare(
                    conn,
                    self.config.schema_name,
                    self._write_name(),
                    tables.described(conn),
                    self._key,
                    evolve=self.config.schema_evolution,
                    where=self.dataset_uri(),
                )
            if token is not None and not self._claim(conn, *token):
                return None, target
            if batch.num_rows:
                if self._key:
                    tables.merge(conn, target, self._key)
                else:
                    tables.insert(conn, target)
        return int(batch.num_rows), target

    def _refusal(self, conn: duckdb.DuckDBPyConnection, batch: pa.RecordBatch) -> str | None:
        """Why the table refuses ``batch`` (None: it takes every row), found by writing it in a
        transaction that is always rolled back."""
        conn.begin()
        try:
            self._apply(conn, batch, None)
        except DataError as exc:
            return exc.message
        except duckdb.Error as exc:
            if not is_row_error(exc):
                raise
            return str(exc).strip().splitlines()[0]
        finally:
            rollback_quietly(conn)
        return None

    def _create_stage(self, conn: duckdb.DuckDBPyConnection) -> None:
        """Drop a leftover staging table and, when the target exists, create this run's with the
        target's columns and primary key (else the first batch creates it)."""
        schema = self.config.schema_name
        conn.execute(f"DROP TABLE IF EXISTS {qualified(schema, self._stage)}")
        columns = tables.columns_of(conn, schema, self.config.table)
        if columns is not None:
            tables.create(
                conn,
                schema,
                self._stage,
                list(columns.items()),
                tables.primary_key(conn, schema, self.config.table),
            )

    def _swap(self, conn: duckdb.DuckDBPyConnection) -> None:
        """REPLACE: put the staging table in the target's place in one transaction."""
        schema = self.config.schema_name
        self._checked = None
        conn.begin()
        try:
            if not self._staged:
                self._create_stage(conn)
            if tables.columns_of(conn, schema, self._stage) is None:
                conn.rollback()  # nothing was written and there is no table to empty
                return
            conn.execute(f"DROP TABLE IF EXISTS {qualified(schema, self.config.table)}")
            conn.execute(f"ALTER TABLE {qualified(schema, self._stage)} RENAME TO {quote(self.config.table)}")
            conn.commit()
        except BaseException:
            rollback_quietly(conn)
            raise
        self._staged = False

    def _current_schema(self, conn: duckdb.DuckDBPyConnection) -> pa.Schema | None:
        name = self._write_name() if self._staged else self.config.table
        columns = tables.columns_of(conn, self.config.schema_name, name)
        if columns is None:
            return None
        return tables.arrow_schema(conn, tables.Target(self.config.schema_name, name, columns))

    def _evolve(self, conn: duckdb.DuckDBPyConnection, changes: Sequence[AddColumn]) -> None:
        self._checked = None
        conn.begin()
        try:
            if self.mode is WritePolicy.REPLACE and not self._staged:
                self._create_stage(conn)
            name = self._write_name()
            columns = tables.columns_of(conn, self.config.schema_name, name)
            if columns is not None:  # else the first write creates it with every column of its batch
                target = tables.Target(self.config.schema_name, name, columns)
                tables.add_columns(conn, target, tables.duckdb_types(conn, changes))
            conn.commit()
        except BaseException:
            rollback_quietly(conn)
            raise
        self._staged = self._staged or self.mode is WritePolicy.REPLACE

    # -- watermark --------------------------------------------------------------------------------

    def _watermark_name(self) -> str:
        return qualified(self.config.schema_name, self.config.watermark_table)

    def _claim(self, conn: duckdb.DuckDBPyConnection, token: CommitToken, bookmark: JsonValue | None) -> bool:
        """Advance this sync's watermark to ``token``, with the page's ``bookmark`` (JSON), in the
        caller's transaction; False when the stored token is not older (a replayed page). Two
        transactions advancing one row conflict (DuckDB's optimistic concurrency): one of them fails
        with CommitConflict (the update's "Conflict on" error, or the first insert's duplicate key)."""
        name = self._watermark_name()
        if not self._watermark_ready:
            # A table an older version made has no bookmark column: added once.
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {name} (sync_id VARCHAR PRIMARY KEY, token VARCHAR NOT NULL, "
                "updated_at TIMESTAMPTZ NOT NULL, bookmark VARCHAR)"
            )
            conn.execute(f"ALTER TABLE {name} ADD COLUMN IF NOT EXISTS bookmark VARCHAR")
        text = None if bookmark is None else json.dumps(bookmark)
        # One statement on every page but a sync's first: the row is advanced only from an older token.
        advanced = first_row(
            conn,
            f"UPDATE {name} SET token = ?, updated_at = now(), bookmark = ? "
            "WHERE sync_id = ? AND token < ? RETURNING token",
            [str(token), text, self._watermark_scope, str(token)],
        )
        if advanced is not None:
            return True
        if first_row(conn, f"SELECT token FROM {name} WHERE sync_id = ?", [self._watermark_scope]):
            return False  # the stored token is not older: a replayed page
        try:
            conn.execute(
                f"INSERT INTO {name} (sync_id, token, updated_at, bookmark) VALUES (?, ?, now(), ?)",
                [self._watermark_scope, str(token), text],
            )
        except duckdb.ConstraintException as exc:
            raise CommitConflict(
                "another writer advanced the same watermark at the same time", where=self.dataset_uri()
            ) from exc
        return True

    def _read_token(self, conn: duckdb.DuckDBPyConnection) -> tuple[CommitToken, JsonValue | None] | None:
        columns = tables.columns_of(conn, self.config.schema_name, self.config.watermark_table)
        if columns is None:
            return None
        bookmark = "bookmark" if "bookmark" in columns else "NULL"
        stored = first_row(
            conn,
            f"SELECT token, {bookmark} FROM {self._watermark_name()} WHERE sync_id = ?",
            [self._watermark_scope],
        )
        if stored is None:
            return None
        return CommitToken.parse(str(stored[0])), None if stored[1] is None else json.loads(str(stored[1]))


def _ping(conn: duckdb.DuckDBPyConnection) -> None:
    conn.execute("SELECT 1").fetchall()


__all__ = ["DuckDbSink"]
