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
- :func:`copy_batch`: COPY one Arrow record batch into a table, in binary where every column has a
  binary encoder for its destination type (about 1.4x faster on the server than CSV), else in CSV
  written by pyarrow's C++ writer. No per-row Python on either path except for bytea and nested
  values in CSV.
"""

import array
import asyncio
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
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
    constraint violation): such rows may go to the dead-letter route. Anything else is not a bad row."""
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


# -- COPY of Arrow batches ------------------------------------------------------------------------

CopyFormat = Literal["binary", "csv"]

_BINARY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
_BINARY_TRAILER = b"\xff\xff"
_NO_SEPARATOR = pa.scalar(b"", pa.large_binary())
_POSTGRES_EPOCH_US = 946_684_800_000_000
_POSTGRES_EPOCH_DAYS = 10_957
INFINITE = (-(2**63), 2**63 - 1)
"""``-infinity`` and ``infinity`` of a timestamp column in Arrow: the smallest and largest int64 (in
the column's unit), as PostgreSQL stores them; written back as infinities."""
INFINITE_DATES = (-(2**31), 2**31 - 1)
"""``-infinity`` and ``infinity`` of a date column in Arrow (date32): the smallest and largest int32."""


@dataclass(frozen=True)
class CopyPayload:
    """One batch encoded for ``COPY ... FROM STDIN``: its format and its bytes (header included)."""

    format: CopyFormat
    chunks: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(memoryview(chunk)) for chunk in self.chunks)


def encode_copy(batch: pa.RecordBatch, columns: Mapping[str, PgColumn] | None) -> CopyPayload:
    """Encode ``batch`` for COPY into columns of the given destination types.

    Binary when every column has a binary encoder for its destination type (integers, floats and
    booleans into the same or a wider-typed column, text into text/varchar/json/jsonb, bytes into bytea,
    timestamps and dates), else CSV. ``columns=None`` (types unknown) always means CSV. Blocks on CPU
    (pyarrow releases the GIL): run it in a worker thread for large batches.
    """
    if columns is not None:
        try:
            fields = [
                _binary_field(batch.column(i), columns[field.name]) for i, field in enumerate(batch.schema)
            ]
        except (
            KeyError,
            _NoBinary,
            pa.ArrowInvalid,
            pa.ArrowTypeError,
            pa.ArrowNotImplementedError,
            OverflowError,
        ):
            # A column without a binary encoder, or a value the exact cast refuses: let the server
            # parse text and report the bad rows itself.
            pass
        else:
            return CopyPayload(
                "binary", (_BINARY_HEADER, _binary_rows(fields, batch.num_rows), _BINARY_TRAILER)
            )
    return CopyPayload("csv", (_csv(batch),))


INLINE_ENCODE_ROWS = 256
"""Batches up to this many rows are encoded for COPY on the event loop (:func:`copy_batch`)."""


async def copy_batch(
    conn: "psycopg.AsyncConnection[Any]",
    target: "sql.Composable",
    batch: pa.RecordBatch,
    columns: Mapping[str, PgColumn] | None,
) -> int:
    """COPY ``batch`` into ``target`` (a table identifier) inside the connection's current transaction.

    The batch's column names are the destination columns. Encoding runs in a worker thread so the event
    loop stays free, except for a batch of at most ``INLINE_ENCODE_ROWS`` rows, encoded on the loop (in
    microseconds: the hand-off to a thread would cost more). Returns the number of rows copied; psycopg
    errors propagate unchanged (the caller knows what it was doing: wrap them with :func:`pg_error`).
    """
    if batch.num_rows == 0:
        return 0
    if batch.num_rows <= INLINE_ENCODE_ROWS:
        payload = encode_copy(batch, columns)
    else:
        payload = await asyncio.to_thread(encode_copy, batch, columns)
    names = sql.SQL(", ").join(map(sql.Identifier, batch.schema.names))
    options = sql.SQL("FORMAT binary" if payload.format == "binary" else "FORMAT csv")
    statement = sql.SQL("COPY {} ({}) FROM STDIN ({})").format(target, names, options)
    async with conn.cursor() as cursor, cursor.copy(statement) as copy:
        for chunk in payload.chunks:
            await copy.write(chunk)
    return int(batch.num_rows)


class _NoBinary(Exception):
    """The column has no binary encoder for its destination type."""


def _binary_field(values: pa.Array, column: PgColumn) -> pa.Array:
    """Each value as a binary COPY field (4-byte big-endian length, then the value), NULL as -1.

    Raises _NoBinary when the destination type has no encoder for this Arrow type, and ArrowInvalid
    when a value does not fit the destination exactly (the caller falls back to CSV).
    """
    source = values.type
    target = column.type_name
    text = pa.types.is_string(source) or pa.types.is_large_string(source)
    if pa.types.is_dictionary(source):
        return _binary_field(values.dictionary_decode(), column)
    if target in _NUMBER_TYPES:
        kind, code = _NUMBER_TYPES[target]
        if not (pa.types.is_integer(source) or (pa.types.is_floating(source) and pa.types.is_floating(kind))):
            raise _NoBinary
        return _fixed(values, values.cast(kind), code, kind.byte_width)
    if target == "bool" and pa.types.is_boolean(source):
        one, zero = pa.scalar(b"\x01", pa.large_binary()), pa.scalar(b"\x00", pa.large_binary())
        return _prefixed(values, pc.if_else(values, one, zero), 1)
    if target in ("text", "varchar", "bpchar", "json") and text:
        return _variable(values.cast(pa.large_string()).cast(pa.large_binary()))
    if target == "jsonb" and text:
        version = pa.scalar(b"\x01", pa.large_binary())
        return _variable(
            pc.binary_join_element_wise(
                version, values.cast(pa.large_string()).cast(pa.large_binary()), _NO_SEPARATOR
            )
        )
    if target == "bytea" and (pa.types.is_binary(source) or pa.types.is_large_binary(source)):
        return _variable(values.cast(pa.large_binary()))
    if target in ("timestamp", "timestamptz") and pa.types.is_timestamp(source):
        # Arrow keeps UTC instants; a naive timestamp is taken as UTC, as the session's TimeZone does.
        micros = values.cast(pa.timestamp("us", tz=source.tz), safe=False).cast(pa.int64())
        shifted = pc.subtract(micros, pa.scalar(_POSTGRES_EPOCH_US, pa.int64()))
        return _fixed(values, _infinities_kept(micros, shifted, INFINITE, pa.int64()), "q", 8)
    if target == "date" and pa.types.is_date(source):
        days = values.cast(pa.date32()).cast(pa.int32())
        shifted = pc.subtract(days, pa.scalar(_POSTGRES_EPOCH_DAYS, pa.int32()))
        return _fixed(values, _infinities_kept(days, shifted, INFINITE_DATES, pa.int32()), "i", 4)
    raise _NoBinary


def _infinities_kept(
    values: pa.Array, shifted: pa.Array, extremes: tuple[int, int], kind: pa.DataType
) -> pa.Array:
    """``shifted``, except where ``values`` is an infinity (an extreme), which stays as it is: the
    binary form of PostgreSQL's infinities is the same extreme."""
    low, high = (pa.scalar(value, kind) for value in extremes)
    infinite = pc.or_(pc.equal(values, low), pc.equal(values, high))
    if not pc.any(infinite).as_py():
        return shifted
    return pc.if_else(infinite, values, shifted)


_NUMBER_TYPES: Mapping[str, tuple[pa.DataType, str]] = {
    "int2": (pa.int16(), "h"),
    "int4": (pa.int32(), "i"),
    "int8": (pa.int64(), "q"),
    "float4": (pa.float32(), "f"),
    "float8": (pa.float64(), "d"),
}


def _network_order(values: pa.Array, code: str, width: int) -> pa.Array:
    """Fixed-width numbers as ``binary(width)`` values in network (big-endian) byte order."""
    assert values.type.byte_width == width, (values.type, width)
    data = array.array(code)
    data.frombytes(
        memoryview(values.buffers()[1])[values.offset * width : (values.offset + len(values)) * width]
    )
    if sys.byteorder == "little":
        data.byteswap()
    return pa.Array.from_buffers(pa.binary(width), len(values), [None, pa.py_buffer(data)])


def _fixed(original: pa.Array, values: pa.Array, code: str, width: int) -> pa.Array:
    """Fixed-width fields: the constant length, then the value; NULL where ``original`` is null."""
    return _prefixed(original, _network_order(values, code, width).cast(pa.large_binary()), width)


def _prefixed(original: pa.Array, raw: pa.Array, width: int) -> pa.Array:
    joined = pc.binary_join_element_wise(
        pa.scalar(width.to_bytes(4, "big"), pa.large_binary()), raw, _NO_SEPARATOR
    )
    return _nulls_marked(original, joined)


def _variable(values: pa.Array) -> pa.Array:
    """Variable-length fields (large_binary): the value's big-endian int32 length, then the value."""
    lengths = pc.fill_null(pc.binary_length(values).cast(pa.int32()), 0)
    prefix = _network_order(lengths, "i", 4).cast(pa.large_binary())
    return _nulls_marked(values, pc.binary_join_element_wise(prefix, values, _NO_SEPARATOR))


def _nulls_marked(original: pa.Array, fields: pa.Array) -> pa.Array:
    """``fields`` with the NULL field (length -1) where ``original`` is null."""
    if not original.null_count:
        return fields
    return pc.if_else(pc.is_null(original), pa.scalar(b"\xff\xff\xff\xff", pa.large_binary()), fields)


def _binary_rows(fields: Sequence[pa.Array], num_rows: int) -> Any:
    """The tuples of a binary COPY: per row a 2-byte field count, then its fields; one contiguous buffer."""
    count = pa.scalar(len(fields).to_bytes(2, "big"), pa.large_binary())
    rows = pc.binary_join_element_wise(count, *fields, _NO_SEPARATOR)
    offsets = memoryview(rows.buffers()[1]).cast("q")
    start, end = offsets[rows.offset], offsets[rows.offset + num_rows]
    return memoryview(rows.buffers()[2])[start:end]


def _csv(batch: pa.RecordBatch) -> pa.Buffer:
    """``batch`` as CSV for ``COPY ... (FORMAT csv)``: NULL unquoted-empty, text always quoted (so an
    empty string stays one), bytea as ``\\x`` hex, nested values as JSON, durations as intervals."""
    columns = [_csv_ready(column) for column in batch.columns]
    ready = pa.RecordBatch.from_arrays(columns, names=batch.schema.names)
    sink = pa.BufferOutputStream()
    pa_csv.write_csv(ready, sink, pa_csv.WriteOptions(include_header=False))
    return sink.getvalue()


def _csv_ready(values: pa.Array) -> pa.Array:
    kind = values.type
    if pa.types.is_dictionary(kind):
        return _csv_ready(values.dictionary_decode())
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        return pa.array(
            [None if value is None else "\\x" + value.hex() for value in values.to_pylist()], pa.string()
        )
    if pa.types.is_nested(kind):
        return pa.array(
            [None if value is None else json.dumps(value, default=str) for value in values.to_pylist()],
            pa.string(),
        )
    if pa.types.is_duration(kind):
        micros = values.cast(pa.duration("us"), safe=False).cast(pa.int64()).cast(pa.string())
        return pc.binary_join_element_wise(micros, " microseconds", "")
    if pa.types.is_timestamp(kind) or pa.types.is_date32(kind):
        storage, extremes = (
            (pa.int32(), INFINITE_DATES) if pa.types.is_date32(kind) else (pa.int64(), INFINITE)
        )
        raw = values.cast(storage)
        later, earlier = (pc.equal(raw, pa.scalar(value, storage)) for value in reversed(extremes))
        if pc.any(later).as_py() or pc.any(earlier).as_py():
            finite = pc.if_else(pc.or_(later, earlier), pa.scalar(None, kind), values)
            text = _csv_ready(finite).cast(pa.string())
            return pc.if_else(later, "infinity", pc.if_else(earlier, "-infinity", text))
        if pa.types.is_timestamp(kind) and kind.unit == "ns":
            return values.cast(pa.timestamp("us", tz=kind.tz), safe=False)
    if pa.types.is_float16(kind):
        return values.cast(pa.float32())
    if pa.types.is_string_view(kind):
        return values.cast(pa.string())
    return values


__all__ = [
    "SESSION_SETTINGS",
    "CopyFormat",
    "CopyPayload",
    "PgColumn",
    "PostgresConnection",
    "add_columns",
    "arrow_type",
    "connect",
    "copy_batch",
    "create_table",
    "current_schema",
    "encode_copy",
    "error_text",
    "is_row_error",
    "pg_error",
    "pg_type",
    "primary_key",
    "row_error_reason",
    "table_columns",
    "table_name",
]
