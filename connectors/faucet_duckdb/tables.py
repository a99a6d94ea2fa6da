"""Destination tables as both DuckDB sinks write them, inside the caller's transaction.

A batch is registered with the connection as the view ``faucet_batch`` (DuckDB scans the Arrow data
in place, no copy), then: the table is created from the batch's columns when missing (the key as its
primary key when there is one), a column the table lacks is added (``ADD COLUMN IF NOT EXISTS``) or
refused, a column whose type DuckDB would convert with loss is refused (:func:`check_types`), and the
rows are inserted (``INSERT ... BY NAME``) or merged by key (``MERGE INTO ... WHEN MATCHED THEN UPDATE
BY NAME WHEN NOT MATCHED THEN INSERT BY NAME``, the batch's last row per key). Every function here is
blocking and runs on the connector's worker thread.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from faucet_dagster.protocol import (
    AddColumn,
    SchemaError,
)
from faucet_duckdb.database import (
    arrow_for_duckdb,
    check_types,
    first_row,
    qualified,
    quote,
    rollback_quietly,
)

BATCH_VIEW = "faucet_batch"

Columns = dict[str, str]
"""A table's columns and their DuckDB types, in order."""

NULL_TYPE = '"NULL"'
"""DuckDB's type of an Arrow column of nulls only: such a column is created as VARCHAR."""


def storable(kind: str) -> str:
    """The column type to create for values of DuckDB type ``kind``."""
    return "VARCHAR" if kind == NULL_TYPE else kind


@dataclass(frozen=True)
class Target:
    """A destination table as a write sees it."""

    schema: str
    table: str
    columns: Columns

    @property
    def name(self) -> str:
        return qualified(self.schema, self.table)

    @property
    def label(self) -> str:
        return f"{self.schema}.{self.table}"


def columns_of(conn: duckdb.DuckDBPyConnection, schema: str, table: str) -> Columns | None:
    """The table's columns (None: no such table), as the caller's transaction sees them."""
    found = conn.execute(
        "SELECT column_name, data_type FROM duckdb_columns() WHERE database_name = current_database() "
        "AND schema_name = ? AND table_name = ? ORDER BY column_index",
        [schema, table],
    ).fetchall()
    return {str(name): str(kind) for name, kind in found} or None


def primary_key(conn: duckdb.DuckDBPyConnection, schema: str, table: str) -> list[str]:
    """The table's primary key columns (empty: it has none)."""
    found = first_row(
        conn,
        "SELECT constraint_column_names FROM duckdb_constraints() WHERE database_name = current_database() "
        "AND schema_name = ? AND table_name = ? AND constraint_type = 'PRIMARY KEY'",
        [schema, table],
    )
    return [] if found is None else [str(name) for name in found[0]]


def arrow_schema(conn: duckdb.DuckDBPyConnection, target: Target) -> pa.Schema:
    """The table's columns as the Arrow types DuckDB reads them as."""
    empty = conn.sql(f"SELECT * FROM {target.name} LIMIT 0").to_arrow_table()
    return empty.schema


def row_count(conn: duckdb.DuckDBPyConnection, schema: str, table: str) -> int | None:
    if columns_of(conn, schema, table) is None:
        return None
    found = first_row(conn, f"SELECT count(*) FROM {qualified(schema, table)}")
    return int(found[0]) if found else 0


@contextmanager
def registered(conn: duckdb.DuckDBPyConnection, batch: pa.RecordBatch) -> Iterator[None]:
    """``batch`` registered as :data:`BATCH_VIEW` inside the context.

    A statement that fails aborts DuckDB's transaction, in which not even the view can be dropped: on
    an error the transaction is rolled back first (the caller was going to), so the error raised is
    the statement's own."""
    conn.register(BATCH_VIEW, arrow_for_duckdb(batch))
    try:
        yield
    except BaseException:
        rollback_quietly(conn)
        conn.unregister(BATCH_VIEW)
        raise
    conn.unregister(BATCH_VIEW)


def described(conn: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    """The registered batch's columns and their DuckDB types."""
    found = conn.execute(f"DESCRIBE SELECT * FROM {BATCH_VIEW}").fetchall()
    return [(str(row[0]), str(row[1])) for row in found]


def prepare(
    conn: duckdb.DuckDBPyConnection,
    schema: str,
    table: str,
    incoming: Sequence[tuple[str, str]],
    key: Sequence[str],
    *,
    evolve: bool,
    where: str,
) -> Target:
    """The table the registered batch (columns ``incoming``) goes to: created, evolved, type-checked."""
    columns = columns_of(conn, schema, table)
    if columns is None:
        return create(conn, schema, table, incoming, key)
    new = [(name, kind) for name, kind in incoming if name not in columns]
    if new:
        if not evolve:
            raise SchemaError(
                f"the records have column(s) the table lacks: {', '.join(name for name, _ in new)} "
                "(schema evolution is off)",
                where=where,
            )
        columns = add_columns(conn, Target(schema, table, columns), new)
    check_types(columns, incoming, where)
    missing = [name for name in key if name not in dict(incoming)]
    if missing:
        raise SchemaError(f"the records lack key column(s) {', '.join(missing)}", where=where)
    return Target(schema, table, columns)


def create(
    conn: duckdb.DuckDBPyConnection,
    schema: str,
    table: str,
    columns: Sequence[tuple[str, str]],
    key: Sequence[str],
) -> Target:
    """Create the table with ``columns`` (``key`` as its primary key, when given)."""
    missing = [name for name in key if name not in dict(columns)]
    if missing:
        raise SchemaError(f"the records lack key column(s) {', '.join(missing)}", where=f"{schema}.{table}")
    if schema != "main":
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quote(schema)}")
    parts = [f"{quote(name)} {storable(kind)}" for name, kind in columns]
    if key:
        parts.append(f"PRIMARY KEY ({', '.join(quote(name) for name in key)})")
    conn.execute(f"CREATE TABLE {qualified(schema, table)} ({', '.join(parts)})")
    return Target(schema, table, dict(columns))


def add_columns(
    conn: duckdb.DuckDBPyConnection, target: Target, columns: Sequence[tuple[str, str]]
) -> Columns:
    """``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` for each column; the table's columns after."""
    for name, kind in columns:
        conn.execute(f"ALTER TABLE {target.name} ADD COLUMN IF NOT EXISTS {quote(name)} {storable(kind)}")
    found = columns_of(conn, target.schema, target.table)
    assert found is not None
    return found


def duckdb_types(conn: duckdb.DuckDBPyConnection, changes: Sequence[AddColumn]) -> list[tuple[str, str]]:
    """The DuckDB types of the Arrow types of ``changes`` (as DuckDB reads those Arrow types)."""
    empty = pa.RecordBatch.from_arrays(
        [pa.array([], type=change.type) for change in changes], names=[change.name for change in changes]
    )
    with registered(conn, empty):
        return described(conn)


def insert(conn: duckdb.DuckDBPyConnection, target: Target) -> None:
    conn.execute(f"INSERT INTO {target.name} BY NAME SELECT * FROM {BATCH_VIEW}")


def merge(conn: duckdb.DuckDBPyConnection, target: Target, key: Sequence[str]) -> None:
    """Upsert the registered batch by ``key`` (prepared by :func:`faucet_dagster.protocol.upsert_rows`)."""
    match = " AND ".join(f"t.{quote(name)} = s.{quote(name)}" for name in key)
    conn.execute(
        f"MERGE INTO {target.name} AS t USING {BATCH_VIEW} AS s ON {match} "
        "WHEN MATCHED THEN UPDATE BY NAME WHEN NOT MATCHED THEN INSERT BY NAME"
    )


__all__ = [
    "BATCH_VIEW",
    "Columns",
    "Target",
    "add_columns",
    "arrow_schema",
    "columns_of",
    "create",
    "described",
    "duckdb_types",
    "insert",
    "merge",
    "prepare",
    "primary_key",
    "registered",
    "row_count",
]
