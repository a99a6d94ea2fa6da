"""The columns of a replica fed change rows, when the source table's columns change (DDL).

A source table's columns change under a running change stream: a column is added (with a default or
without), dropped, or changes type. The change rows then have a new schema, and the replica must
follow it so it stays equal to the source, or refuse with a :class:`SchemaError` naming the column and
the way out. What PostgreSQL does not write to the WAL decides which: the value rows older than a new
column hold (its constant default, kept once in ``pg_attribute.attmissingval``) reaches the replica as
field metadata (:data:`MISSING_METADATA`); the values a volatile default or a type change gave every
row by rewriting the table reach it nowhere.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql

from faucet_dagster.protocol import SchemaError
from faucet_postgres.common import PgColumn, add_columns, arrow_type, pg_type, table_name
from faucet_postgres.common import create_table as create_plain_table

MISSING_METADATA = b"faucet.missing"
"""Field metadata: the value (output-function text) that rows older than the column hold at the source
(PostgreSQL's ``attmissingval`` of a column added with a constant default). A table evolved for the
column gets it in its existing rows."""

UNLOGGED_DEFAULT_METADATA = b"faucet.unlogged_default"
"""Field metadata ``b"true"``: the column has a default but no missing value, so rows older than the
column may hold values the change stream never carried (a volatile default rewrote the table)."""

CREATED_COMMENT = "faucet: created from change rows"
"""The comment of a table APPLY_CHANGES created: its column types are the change rows' Arrow types,
so a type that differs later is a type change at the source."""


async def create_table(
    conn: "psycopg.AsyncConnection[Any]", schema: str, table: str, data: pa.Schema, key: Sequence[str]
) -> dict[str, PgColumn]:
    """Create a missing table for change rows of ``data`` (``key`` as primary key), marked with
    :data:`CREATED_COMMENT`."""
    columns = await create_plain_table(conn, schema, table, data, key)
    await conn.execute(
        sql.SQL("COMMENT ON TABLE {} IS {}").format(table_name(schema, table), sql.Literal(CREATED_COMMENT))
    )
    return columns


async def created_from_changes(conn: "psycopg.AsyncConnection[Any]", schema: str, table: str) -> bool:
    """True when :func:`create_table` made ``schema.table``."""
    cursor = await conn.execute(
        "SELECT obj_description(to_regclass(format('%%I.%%I', %s::text, %s::text)), 'pg_class')",
        (schema, table),
    )
    row = await cursor.fetchone()
    return row is not None and row[0] == CREATED_COMMENT


async def evolve(
    conn: "psycopg.AsyncConnection[Any]", schema: str, table: str, fields: Sequence[pa.Field], where: str
) -> dict[str, PgColumn]:
    """Add the columns of ``fields`` so the table equals the source: a column the source added with a
    constant default gets that value in the existing rows (``ADD COLUMN ... DEFAULT`` then ``DROP
    DEFAULT``: PostgreSQL stores it once, as the source did, without rewriting the table).

    Raises :class:`SchemaError` for a column whose older rows hold values the stream never carried
    (:data:`UNLOGGED_DEFAULT_METADATA`), naming the way out: add the column to the table yourself,
    with the source's values, and the stream resumes.
    """
    unlogged = [
        item.name for item in fields if (item.metadata or {}).get(UNLOGGED_DEFAULT_METADATA) == b"true"
    ]
    if unlogged:
        names = ", ".join(unlogged)
        raise SchemaError(
            f"column(s) {names} were added at the source with a default that is not a constant (or the "
            "table was rewritten since): the values its existing rows got are not in the change stream. "
            f"Add {names} to {schema}.{table} yourself with the source's values (for example ALTER TABLE "
            "... ADD COLUMN, then UPDATE from a copy of the source's key and column), and the stream "
            "resumes",
            where=where,
        )
    plain = []
    for item in fields:
        missing = (item.metadata or {}).get(MISSING_METADATA)
        if missing is None:
            plain.append(item)
            continue
        target, column = table_name(schema, table), sql.Identifier(item.name)
        await conn.execute(
            sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {} DEFAULT {}").format(
                target, column, pg_type(item.type), sql.Literal(missing.decode())
            )
        )
        await conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP DEFAULT").format(target, column))
    return await add_columns(conn, schema, table, plain)


def check_types(columns: Mapping[str, PgColumn], data: pa.Schema, from_changes: bool, where: str) -> None:
    """Refuse change rows whose column type differs from a table :func:`create_table` made (its types
    are the change rows' own): the source changed the column's type, rewriting its rows outside the
    change stream. A table made by someone else is not checked (its types are its owner's choice)."""
    if not from_changes:
        return
    for item in data:
        column = columns.get(item.name)
        if column is None or arrow_type(column) == item.type:
            continue
        raise SchemaError(
            f"column {item.name} changed type at the source (its change rows are now {item.type}, the "
            f"replica's column {column.type_sql} is {arrow_type(column)}): the rows the ALTER rewrote "
            "at the source are not in the change stream. Alter the replica's column the same way "
            f"(ALTER TABLE ... ALTER COLUMN {item.name} TYPE ... USING the source's conversion), and the "
            "stream resumes",
            where=where,
        )


__all__ = [
    "CREATED_COMMENT",
    "MISSING_METADATA",
    "UNLOGGED_DEFAULT_METADATA",
    "check_types",
    "create_table",
    "created_from_changes",
    "evolve",
]
