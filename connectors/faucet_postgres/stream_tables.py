"""The destination tables of a PostgreSQL streaming sink session (:mod:`faucet_postgres.stream_sink`):
created when missing, evolved when a batch brings new columns, and written by APPEND (COPY),
UPSERT and VERSIONED_UPSERT (a staging table merged with ``INSERT ... ON CONFLICT``: the last row
per key wins; for VERSIONED_UPSERT only a newer version replaces a row), all in the epoch's
transaction.
"""

import hashlib
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql

from faucet_dagster.protocol import ConfigError, DataError, RejectedRow, SchemaError, WritePolicy
from faucet_postgres import change_schema, refusals
from faucet_postgres.common import PgColumn, add_columns, create_table, table_columns, table_name
from faucet_postgres.config import PostgresStreamingSinkConfig
from faucet_postgres.copy_arrow import copy_batch
from faucet_postgres.stream_state import Target

Connection = psycopg.AsyncConnection[Any]

_ORDINAL = "__faucet_ordinal"
_ORDINAL_COLUMN = PgColumn(_ORDINAL, "int8", "bigint", -1, False)


_SEQUENCE_BITS = 32


def epoch_stamp(stream: str, sequence: int) -> int:
    """What ``epoch_column`` holds for epoch ``sequence`` of ``stream``: the stream's id (31 bits of the
    crc32 of its name) above the sequence (32 bits), so streams (and a stream's partition groups) that
    share a table tell their epochs apart."""
    return (zlib.crc32(stream.encode()) & 0x7FFF_FFFF) << _SEQUENCE_BITS | sequence


def stamped_sequence(stamp: int) -> int:
    """The epoch sequence an :func:`epoch_stamp` holds."""
    return stamp & ((1 << _SEQUENCE_BITS) - 1)


def stamp_epoch(records: pa.RecordBatch, column: str, stamp: int) -> pa.RecordBatch:
    """``records`` with ``column`` (``epoch_column``) holding ``stamp`` (:func:`epoch_stamp`) on every
    row (replacing a column of that name the rows carry): the epoch that last wrote each row, for
    ``faucet verify``."""
    stamp_array = pa.array([stamp] * records.num_rows, pa.int64())
    index = records.schema.get_field_index(column)
    if index >= 0:
        return records.set_column(index, column, stamp_array)
    return records.append_column(column, stamp_array)


class Tables:
    """The tables one session writes, as far as it knows them (a cache that a rolled back
    transaction invalidates: :meth:`forget`). ``schema`` is the destination schema, set when the
    session is prepared."""

    def __init__(
        self, config: PostgresStreamingSinkConfig, policy: WritePolicy, key: tuple[str, ...], where: str
    ) -> None:
        self._config = config
        self._policy = policy
        self._key = key
        self._where = where
        self.schema = ""
        self._targets: dict[str, Target] = {}
        self._savepoints = refusals.Savepoints()
        self.located: set[str] = set()
        """Deferred constraints (schema-qualified, quoted) a COMMIT refused: checked at each batch from
        then on, so the rows they refuse are found (the epoch's next attempt routes or names them)."""
        self._immediate: set[str] = set()
        """The deferred constraints made IMMEDIATE in the current transaction."""

    def forget(self) -> None:
        """Tables created in a rolled back transaction are gone: the cache is dropped with it."""
        self._targets.clear()
        self._savepoints.forget()

    def new_transaction(self) -> None:
        """Staging tables are dropped at the end of each transaction, and its savepoints and
        ``SET CONSTRAINTS`` with it."""
        for target in self._targets.values():
            target.stage = None
        self._savepoints.forget()
        self._immediate.clear()

    async def prepare(self, conn: Connection) -> None:
        """Create the next batch's savepoint ahead (beginning the transaction if none is open):
        :meth:`~faucet_postgres.refusals.Savepoints.prepare`."""
        await self._savepoints.prepare(conn)

    async def target(
        self,
        conn: Connection,
        table: str,
        schema: pa.Schema,
        key: Sequence[str],
        *,
        change_rows: bool = False,
    ) -> Target:
        """The table for a batch of ``schema``: created when missing (``key`` as its primary key),
        checked for missing columns (added with ``schema_evolution``). For ``change_rows``
        (APPLY_CHANGES, ``schema`` without the operation columns) it is created, evolved and checked
        through :mod:`faucet_postgres.change_schema`."""
        target = self._targets.get(table)
        if (
            target is None
            or not set(schema.names) <= set(target.columns)
            or (
                change_rows
                and (target.reconciled is None or not schema.equals(target.reconciled, check_metadata=True))
            )
        ):
            self._savepoints.spoil()
            where = f"{self._where} table {table}"
            columns = await table_columns(conn, self.schema, table)
            from_changes = False
            if columns is None:
                if not self._config.create_tables:
                    raise ConfigError(f"table {self.schema}.{table} does not exist", where=self._where)
                make = change_schema.create_table if change_rows else create_table
                columns = await make(conn, self.schema, table, schema, key)
                from_changes = change_rows
                await self._index_epochs(conn, table, columns)
            elif change_rows:
                # The source's columns, by attribute number: renamed, dropped, added again, added.
                evolution = self._config.schema_evolution
                columns = await change_schema.reconcile(conn, self.schema, table, schema, evolution, where)
                from_changes = await change_schema.created_from_changes(conn, self.schema, table)
            epoch = self._config.epoch_column
            if epoch is not None and epoch in schema.names and epoch not in columns:
                # The sink's own column: added whatever schema_evolution says, as the sink created it.
                columns = await add_columns(conn, self.schema, table, [schema.field(epoch)])
                await self._index_epochs(conn, table, columns)
            missing = [item for item in schema if item.name not in columns]
            if missing:
                if not self._config.schema_evolution:
                    raise SchemaError(
                        f"table {self.schema}.{table} has no column(s) "
                        f"{', '.join(item.name for item in missing)} (schema_evolution is off)",
                        where=self._where,
                    )
                columns = await add_columns(conn, self.schema, table, missing)
            deferred = () if change_rows else await _deferred_constraints(conn, self.schema, table)
            target = Target(
                self.schema, table, columns, from_changes=from_changes, reconciled=schema, deferred=deferred
            )
            self._targets[table] = target
        if change_rows:
            change_schema.check_types(
                target.columns, schema, target.from_changes, f"{self._where} table {table}"
            )
        return target

    async def _index_epochs(self, conn: Connection, table: str, columns: Mapping[str, Any]) -> None:
        """A BRIN index on the epoch column of a table this sink created or gave the column: it keeps
        ``faucet verify``'s reads of an epoch's rows to those rows (a few kilobytes for millions of
        rows, appended in epoch order)."""
        epoch = self._config.epoch_column
        if epoch is None or epoch not in columns:
            return
        name = (
            "_faucet_epochs_" + hashlib.blake2b(f"{self.schema}.{table}".encode(), digest_size=8).hexdigest()
        )
        await conn.execute(
            sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} USING brin ({})").format(
                sql.Identifier(name), table_name(self.schema, table), sql.Identifier(epoch)
            )
        )

    def _version_column(self) -> str | None:
        return self._config.version_column if self._policy is WritePolicy.VERSIONED_UPSERT else None

    def _check_keys(self, records: pa.RecordBatch) -> None:
        """Keyed policies: the key (and version) columns are present and hold no null."""
        names = records.schema.names
        missing = [column for column in self._key if column not in names]
        version = self._version_column()
        if version is not None and version not in names:
            missing.append(version)
        if missing:
            raise SchemaError(f"the batch has no column(s) {', '.join(missing)}", where=self._where)
        nulls = [
            column for column in (*self._key, *([version] if version else [])) if records[column].null_count
        ]
        if nulls:
            raise DataError(f"null in key or version column(s) {', '.join(nulls)}", where=self._where)

    async def _ensure_stage(self, conn: Connection, target: Target, names: Sequence[str]) -> None:
        """The epoch's staging table of ``target`` (created outside any savepoint, so a refused
        slice rolled back to its savepoint leaves it in place)."""
        if target.stage is None:
            self._savepoints.spoil()
            target.stage = sql.Identifier(f"_faucet_stage_{uuid.uuid4().hex[:12]}")
            await conn.execute(
                sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                    target.stage, sql.SQL(", ").join(map(sql.Identifier, names)), target.identifier
                )
            )
            await conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint").format(target.stage, sql.Identifier(_ORDINAL))
            )

    async def _merge(self, conn: Connection, target: Target, records: pa.RecordBatch) -> int:
        """Keyed apply through the staging table: one row per key (the newest), then INSERT ON CONFLICT."""
        names = records.schema.names
        version = self._version_column()
        assert target.stage is not None  # made by _ensure_stage
        ordinals = pa.array(range(records.num_rows), pa.int64())
        staged = records.append_column(_ORDINAL, ordinals)
        stage_columns = {**{name: target.columns[name] for name in names}, _ORDINAL: _ORDINAL_COLUMN}
        await copy_batch(conn, target.stage, staged, stage_columns)
        columns = sql.SQL(", ").join(map(sql.Identifier, names))
        keys = sql.SQL(", ").join(map(sql.Identifier, self._key))
        newest = [*([sql.SQL("{} DESC").format(sql.Identifier(version))] if version else [])]
        order = sql.SQL(", ").join(
            [*map(sql.Identifier, self._key), *newest, sql.SQL("{} DESC").format(sql.Identifier(_ORDINAL))]
        )
        others = [name for name in names if name not in self._key]
        action: sql.Composable
        if others:
            action = sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(name), sql.Identifier(name))
                    for name in others
                )
            )
            if version is not None:
                action = sql.SQL("{} WHERE t.{} IS NULL OR t.{} < EXCLUDED.{}").format(
                    action, *[sql.Identifier(version)] * 3
                )
        else:
            action = sql.SQL("DO NOTHING")
        cursor = await conn.execute(
            sql.SQL(
                "INSERT INTO {} AS t ({}) SELECT DISTINCT ON ({}) {} FROM {} ORDER BY {} ON CONFLICT ({}) {}"
            ).format(target.identifier, columns, keys, columns, target.stage, order, keys, action)
        )
        written = max(cursor.rowcount, 0)
        await conn.execute(sql.SQL("TRUNCATE {}").format(target.stage))
        return written

    async def write_rows(
        self, conn: Connection, target: Target, records: pa.RecordBatch
    ) -> tuple[int, tuple[RejectedRow, ...]]:
        """APPEND, UPSERT, VERSIONED_UPSERT: write ``records`` under a savepoint (released with the next
        one: :class:`~faucet_postgres.refusals.Savepoints`), bisecting down to the rows the server
        refuses; returns the rows written and the refused ones.

        A constraint the destination would check only at COMMIT (``DEFERRABLE``) refuses nothing at a
        statement, so its rows could not be found: the table's deferrable unique, primary key and
        exclusion constraints (none needs deferring within an epoch: rows are only added or
        replaced), and every deferred constraint a COMMIT already refused (:attr:`located`), are
        made ``IMMEDIATE`` for the epoch's transaction first."""
        immediate = [
            name for name in (*target.deferred, *sorted(self.located)) if name not in self._immediate
        ]
        if immediate:
            self._savepoints.spoil()
            await conn.execute(
                sql.SQL("SET CONSTRAINTS {} IMMEDIATE").format(sql.SQL(", ").join(map(sql.SQL, immediate)))
            )
            self._immediate.update(immediate)
        if self._policy is WritePolicy.APPEND:

            async def write(start: int, stop: int) -> int:
                part = records.slice(start, stop - start)
                return await copy_batch(conn, target.identifier, part, target.columns)

        else:
            self._check_keys(records)
            await self._ensure_stage(conn, target, records.schema.names)

            async def write(start: int, stop: int) -> int:
                return await self._merge(conn, target, records.slice(start, stop - start))

        return await refusals.apply_finding_refusals(
            conn, records.num_rows, write, savepoints=self._savepoints
        )


async def _deferred_constraints(conn: Connection, schema: str, table: str) -> tuple[str, ...]:
    """The DEFERRABLE unique, primary key and exclusion constraints of ``schema.table``, qualified and
    quoted for ``SET CONSTRAINTS``."""
    cursor = await conn.execute(
        "SELECT format('%%I.%%I', n.nspname, c.conname) FROM pg_constraint AS c "
        "JOIN pg_namespace AS n ON n.oid = c.connamespace "
        "WHERE c.conrelid = to_regclass(format('%%I.%%I', %s::text, %s::text)) AND c.condeferrable "
        "AND c.contype IN ('u', 'p', 'x') ORDER BY 1",
        (schema, table),
    )
    return tuple(str(row[0]) for row in await cursor.fetchall())
