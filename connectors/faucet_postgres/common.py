"""What every PostgreSQL piece shares: connection config, errors, identifiers, types and COPY of Arrow.

Used by the bounded source (:mod:`faucet_postgres.source`), the bounded sink
(:mod:`faucet_postgres.sink`) and the streaming sink. psycopg 3 is used through its asyncio API.

- :class:`~faucet_postgres.config.PostgresConnection` (re-exported here): the connection part of
  every config (URL or host/port/database, the adjacently tagged ``auth`` with a ``SecretStr``
  password, TLS mode). :func:`connect` opens an
  ``AsyncConnection`` with the session settings the encoders below rely on (UTC, ISO dates, hex
  bytea), wrapping failures in FaucetErrors.
- :func:`pg_error` / :func:`row_error_reason`: psycopg errors to FaucetErrors by SQLSTATE class.
- :func:`table_name`, :func:`table_columns`, :func:`create_table`, :func:`add_columns`: identifiers
  (always through ``psycopg.sql``) and the catalog.
- :func:`pg_type` / :func:`arrow_type`: Arrow <-> PostgreSQL types.

COPY of Arrow batches (binary or CSV) is :mod:`faucet_postgres.copy_arrow`.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql

from faucet_dagster.protocol import (
    AuthError,
    ConfigError,
    ConnectionFailed,
    DataError,
    FaucetError,
    SchemaError,
    postgres_identifier_problem,
)
from faucet_postgres.config import PostgresConnection

SESSION_SETTINGS = (
    "SET TimeZone = 'UTC'",
    "SET DateStyle = 'ISO, YMD'",
    "SET bytea_output = 'hex'",
    "SET extra_float_digits = 1",
)
"""Session settings every connection gets: naive timestamps mean UTC, dates print as ISO, bytea as hex,
and floats print with the shortest text that reads back to the same value."""


async def connect(
    config: PostgresConnection, *, autocommit: bool = False, settings: Mapping[str, str] | None = None
) -> "psycopg.AsyncConnection[Any]":
    """Open a connection with :data:`SESSION_SETTINGS` and ``settings`` (run-time parameters by name,
    e.g. ``lock_timeout``) applied for its whole session. Raises ConnectionFailed (retryable) when the
    server cannot be reached and AuthError when it refuses the credentials."""
    where = config.safe_url()
    try:
        conn = await psycopg.AsyncConnection.connect(config.conninfo(), autocommit=True)
    except psycopg.Error as exc:
        raise pg_error(exc, where=where, doing="connecting") from exc
    try:
        for statement in SESSION_SETTINGS:
            await conn.execute(statement)
        for name, value in (settings or {}).items():
            await conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        await conn.set_autocommit(autocommit)
    except psycopg.Error as exc:
        await conn.close()
        raise pg_error(exc, where=where, doing="setting up the session") from exc
    return conn


# -- errors ---------------------------------------------------------------------------------------

_AUTH_MESSAGES = ("password authentication failed", "pg_hba.conf")


def pg_error(exc: BaseException, *, where: str, doing: str) -> FaucetError:
    """The FaucetError for a psycopg error raised while ``doing`` something at ``where`` (raise it
    ``from exc``). By SQLSTATE class: 08, 57 and connections that failed are ConnectionFailed
    (retryable); 28 and 42501 AuthError; 42P01, 3F000 and 3D000 (no such table, schema, database)
    ConfigError;
    other 42 and 2BP01 (dependent objects) SchemaError; 22/23 DataError; 40 (serialization failure,
    deadlock) and 55P03 (a lock wait that reached ``lock_timeout``) a retryable FaucetError; 25P03
    (the server ended a connection idle in a transaction past ``idle_in_transaction_session_timeout``,
    rolling it back) ConnectionFailed.
    """
    if isinstance(exc, FaucetError):
        return exc
    state = getattr(exc, "sqlstate", None) or ""
    message = f"{doing} failed: {error_text(exc)}"
    lowered = str(exc).lower()
    if (
        state.startswith("28")
        or state == "42501"
        or (not state and any(m in lowered for m in _AUTH_MESSAGES))
    ):
        return AuthError(message, where=where)
    if state in ("42P01", "3F000", "3D000") or (not state and "does not exist" in lowered):
        # No such table, schema or database (a refused connection carries no SQLSTATE, only text).
        return ConfigError(message, where=where)
    if state.startswith("42") or state == "2BP01":
        return SchemaError(message, where=where)
    if state[:2] in ("22", "23"):
        return DataError(message, where=where)
    if state.startswith("40"):
        return FaucetError(message, where=where, retryable=True)
    if state == "55P03":
        return FaucetError(
            f"{message} (another transaction held a lock longer than lock_timeout)",
            where=where,
            retryable=True,
        )
    if (
        state.startswith(("08", "57"))
        or state == "25P03"
        or (not state and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError))
    ):
        return ConnectionFailed(message, where=where)
    return FaucetError(message, where=where)


def is_row_error(exc: BaseException) -> bool:
    """True when the server refused the values of rows (SQLSTATE class 22 data exception or 23
    constraint violation), or the encoder did (a :class:`DataError`: a NaN in a nested value, which
    JSON cannot hold): such rows may go to the dead-letter route. Anything else is not a bad row."""
    if isinstance(exc, DataError):
        return True
    state = getattr(exc, "sqlstate", None) or ""
    return state[:2] in ("22", "23")


def error_text(exc: BaseException) -> str:
    """The server's primary message (plus detail), or the exception text for client-side errors."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None)
    if not primary:
        text = str(exc).strip()
        return text.splitlines()[0] if text else type(exc).__name__
    detail = getattr(diag, "message_detail", None)
    return f"{primary} ({detail})" if detail else str(primary)


def row_error_reason(exc: BaseException) -> str:
    """A rejected row's reason for the dead-letter route: SQLSTATE and the server's message."""
    state = getattr(exc, "sqlstate", None) or ""
    return f"{state}: {error_text(exc)}" if state else error_text(exc)


# -- identifiers and catalog ----------------------------------------------------------------------


def table_name(schema: str, table: str) -> "sql.Identifier":
    """``"schema"."table"``, quoted by psycopg whatever characters the names hold.

    A name PostgreSQL would truncate (more than 63 bytes: a table named after a long topic) raises
    ConfigError: the truncated name could be another table."""
    for name in (schema, table):
        problem = postgres_identifier_problem(name)
        if problem:
            raise ConfigError(problem, where=f"{schema}.{table}")
    return sql.Identifier(schema, table)


def column_identifiers(fields: Sequence[pa.Field], *, where: str) -> list["sql.Identifier"]:
    """The quoted names of columns created from data; SchemaError for a name PostgreSQL would
    truncate (more than 63 bytes), which would then not match the data's column."""
    for field in fields:
        problem = postgres_identifier_problem(field.name)
        if problem:
            raise SchemaError(f"a column of the data cannot be created: {problem}", where=where)
    return [sql.Identifier(field.name) for field in fields]


@dataclass(frozen=True)
class PgColumn:
    """One column of a table as the catalog describes it."""

    name: str
    type_name: str
    """``pg_type.typname`` (``int8``, ``timestamptz``, ``_int4`` for an int4 array)."""
    type_sql: str
    """``format_type(...)``: the type as SQL (``numeric(10,2)``), quoted by the server."""
    typmod: int
    not_null: bool


async def current_schema(conn: "psycopg.AsyncConnection[Any]") -> str:
    """The schema unqualified names resolve to (the first existing one on the search path)."""
    row = await (await conn.execute("SELECT current_schema()")).fetchone()
    if row is None or row[0] is None:
        raise ConfigError("the search path names no existing schema; set schema_name")
    return str(row[0])


async def table_columns(
    conn: "psycopg.AsyncConnection[Any]", schema: str, table: str
) -> dict[str, PgColumn] | None:
    """The columns of ``schema.table`` in order, or None when there is no such table (or view)."""
    cursor = await conn.execute(
        """
        SELECT a.attname, t.typname, format_type(a.atttypid, a.atttypmod), a.atttypmod, a.attnotnull
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_type t ON t.oid = a.atttypid
        WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped
          AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
        ORDER BY a.attnum
        """,
        (schema, table),
    )
    rows = await cursor.fetchall()
    if not rows:
        return None
    return {
        name: PgColumn(name, typname, type_sql, typmod, not_null)
        for name, typname, type_sql, typmod, not_null in rows
    }


async def primary_key(conn: "psycopg.AsyncConnection[Any]", schema: str, table: str) -> list[str]:
    """The primary key columns of ``schema.table`` in key order (empty when it has none)."""
    cursor = await conn.execute(
        """
        SELECT a.attname
        FROM pg_index i
        JOIN pg_class c ON c.oid = i.indrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, position) ON true
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
        WHERE n.nspname = %s AND c.relname = %s AND i.indisprimary
        ORDER BY k.position
        """,
        (schema, table),
    )
    return [str(row[0]) for row in await cursor.fetchall()]


async def create_table(
    conn: "psycopg.AsyncConnection[Any]",
    schema: str,
    table: str,
    arrow_schema: pa.Schema,
    key: Sequence[str] = (),
) -> dict[str, PgColumn]:
    """``CREATE TABLE IF NOT EXISTS`` from an Arrow schema (``key`` as primary key); returns its columns."""
    names = column_identifiers(list(arrow_schema), where=f"{schema}.{table}")
    columns = [
        sql.SQL("{} {}").format(name, pg_type(field.type))
        for name, field in zip(names, arrow_schema, strict=True)
    ]
    if key:
        columns.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, key))))
    await conn.execute(
        sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            table_name(schema, table), sql.SQL(", ").join(columns)
        )
    )
    created = await table_columns(conn, schema, table)
    assert created is not None
    return created


async def add_columns(
    conn: "psycopg.AsyncConnection[Any]", schema: str, table: str, fields: Sequence[pa.Field]
) -> dict[str, PgColumn]:
    """``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` for every field (idempotent); returns the columns."""
    names = column_identifiers(fields, where=f"{schema}.{table}")
    for name, field in zip(names, fields, strict=True):
        await conn.execute(
            sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                table_name(schema, table), name, pg_type(field.type)
            )
        )
    columns = await table_columns(conn, schema, table)
    if columns is None:
        raise ConfigError(f"table {schema}.{table} does not exist", where=f"{schema}.{table}")
    return columns


# -- types ----------------------------------------------------------------------------------------


def pg_type(arrow: pa.DataType) -> "sql.Composable":
    """The PostgreSQL type a column of Arrow type ``arrow`` is created with."""
    if pa.types.is_dictionary(arrow):
        return pg_type(arrow.value_type)
    if pa.types.is_decimal(arrow):
        return sql.SQL("numeric({}, {})").format(sql.Literal(arrow.precision), sql.Literal(arrow.scale))
    if pa.types.is_timestamp(arrow):
        return sql.SQL("timestamptz" if arrow.tz is not None else "timestamp")
    if pa.types.is_integer(arrow):
        width = arrow.bit_width + (0 if pa.types.is_signed_integer(arrow) else 1)
        return sql.SQL(
            "smallint"
            if width <= 16
            else "integer"
            if width <= 32
            else "bigint"
            if width <= 64
            else "numeric(20, 0)"
        )
    for check, name in _SIMPLE_TYPES:
        if check(arrow):
            return sql.SQL(name)
    return sql.SQL("text")


_SIMPLE_TYPES: tuple[tuple[Callable[[pa.DataType], bool], str], ...] = (
    (pa.types.is_boolean, "boolean"),
    (lambda t: pa.types.is_float16(t) or pa.types.is_float32(t), "real"),
    (pa.types.is_float64, "double precision"),
    (
        lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t),
        "bytea",
    ),
    (pa.types.is_date, "date"),
    (pa.types.is_time, "time"),
    (pa.types.is_duration, "interval"),
    (pa.types.is_nested, "jsonb"),
)


def arrow_type(column: PgColumn) -> pa.DataType:
    """The Arrow type a column is read as.

    A ``numeric(p, s)`` with ``p <= 38`` is decimal128, an unconstrained or wider numeric a string (no
    digit lost); ``timestamptz`` is UTC; intervals, UUIDs, JSON, arrays and other types are strings
    (arrays as JSON text).
    """
    if column.type_name == "numeric":
        if column.typmod >= 4:
            precision, scale = ((column.typmod - 4) >> 16) & 0xFFFF, (column.typmod - 4) & 0xFFFF
            if 0 < precision <= 38 and scale <= precision:
                return pa.decimal128(precision, scale)
        return pa.string()
    if column.type_name == "timestamptz":
        return pa.timestamp("us", tz="UTC")
    return _ARROW_BY_TYPNAME.get(column.type_name, pa.string())


_ARROW_BY_TYPNAME: Mapping[str, pa.DataType] = {
    "bool": pa.bool_(),
    "int2": pa.int16(),
    "int4": pa.int32(),
    "int8": pa.int64(),
    "oid": pa.int64(),
    "float4": pa.float32(),
    "float8": pa.float64(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us"),
    "time": pa.time64("us"),
    "bytea": pa.binary(),
}


__all__ = [
    "SESSION_SETTINGS",
    "PgColumn",
    "PostgresConnection",
    "add_columns",
    "arrow_type",
    "connect",
    "create_table",
    "current_schema",
    "error_text",
    "is_row_error",
    "pg_error",
    "pg_type",
    "primary_key",
    "row_error_reason",
    "table_columns",
    "table_name",
]
