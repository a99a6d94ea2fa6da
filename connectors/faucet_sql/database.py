"""What the SQL source and sink share: the engine, error wrapping and the Arrow <-> SQL type mapping.

SQLAlchemy's engine is blocking: every call that touches the database runs in a worker thread
(``asyncio.to_thread``), one connection per call, so the event loop never blocks. On SQLite the
engine emits its own ``BEGIN`` (``BEGIN IMMEDIATE`` for writers) instead of letting the driver do it,
so DDL is transactional there too (REPLACE swaps tables inside one transaction) and savepoints work.
"""

import datetime as dt
import hashlib
import os
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url

from faucet_dagster.protocol import (
    AuthError,
    ConfigError,
    ConnectionFailed,
    DataError,
    FaucetError,
    SchemaError,
    UserPasswordAuth,
)
from faucet_dagster.protocol.json_values import json_text
from faucet_sql.config import SqlConnection, SqlTable

ROW_VALUE_DIALECTS = frozenset({"postgresql", "sqlite", "mysql", "mariadb", "duckdb"})
"""Dialects whose ``(a, b) > (x, y)`` row-value comparison is known to work."""

TRANSACTIONAL_DDL_DIALECTS = frozenset({"postgresql", "sqlite"})
"""Dialects where DROP/ALTER TABLE commit or roll back with the transaction (atomic REPLACE)."""


class Database:
    """One configured database: a lazily created engine plus the names used in messages.

    Building it does no I/O and imports no driver; the engine is created on first use.
    ``writer`` makes SQLite transactions ``BEGIN IMMEDIATE`` (take the write lock up front, so two
    writers queue instead of failing half-way); ``must_exist`` refuses a SQLite file that does not
    exist (a source) instead of creating it; a writer creates the file's folder when missing.
    """

    def __init__(self, config: SqlTable, *, writer: bool) -> None:
        self.config = config
        self.writer = writer
        self.url = _engine_url(config)
        self.dialect = self.url.get_backend_name()
        self._engine: Engine | None = None

    @property
    def safe_url(self) -> str:
        """The URL without credentials nor query (driver options), for messages and dataset URIs."""
        shown = make_url(self.config.url).set(query={})
        if isinstance(self.config.auth, UserPasswordAuth):
            shown = shown.set(username=self.config.auth.config.username)
        return shown.render_as_string(hide_password=True)

    def qualified(self, table: str | None = None) -> str:
        name = table or self.config.table
        return name if self.config.schema_name is None else f"{self.config.schema_name}.{name}"

    def where(self, table: str | None = None) -> str:
        return f"{self.safe_url}#{self.qualified(table)}"

    @property
    def engine(self) -> Engine:
        """The engine, created on first use (blocking callers only)."""
        if self._engine is None:
            self._engine = self._create_engine()
        return self._engine

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def _create_engine(self) -> Engine:
        if self.dialect == "sqlite":
            database = self.url.database or ""
            if database in ("", ":memory:") or "mode=memory" in str(self.url.query):
                raise ConfigError(
                    "an in-memory SQLite database cannot be shared between the worker threads that "
                    "run the queries; use a file",
                    where=self.safe_url,
                )
            if not self.writer and not os.path.isfile(database):
                raise ConfigError(f"SQLite database file not found: {database!r}", where=self.safe_url)
            if self.writer:
                folder = os.path.dirname(os.path.abspath(database))
                try:
                    os.makedirs(folder, exist_ok=True)
                except OSError as exc:
                    raise ConfigError(
                        f"cannot create the folder of the SQLite database: {exc.strerror}", where=folder
                    ) from exc
        try:
            engine = sa.create_engine(self.url, json_serializer=_json_serializer)
        except (sa.exc.ArgumentError, ImportError) as exc:
            raise ConfigError(f"cannot use the database URL: {exc}", where=self.safe_url) from exc
        if self.dialect == "sqlite":
            begin = "BEGIN IMMEDIATE" if self.writer else "BEGIN"

            @event.listens_for(engine, "connect")
            def _driver_leaves_transactions_to_us(dbapi_connection: Any, record: Any) -> None:
                dbapi_connection.isolation_level = None

            @event.listens_for(engine, "begin")
            def _begin(connection: sa.Connection) -> None:
                connection.exec_driver_sql(begin)

        return engine


def _engine_url(config: SqlConnection) -> URL:
    url = make_url(config.url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    if isinstance(config.auth, UserPasswordAuth):
        url = url.set(
            username=config.auth.config.username, password=config.auth.config.password.get_secret_value()
        )
    return url


def _json_serializer(value: Any) -> str:
    # One module-level function: psycopg caches its JSON dumpers by function (a closure would leak).
    return json_text(value, "a nested value written")


def staging_name(qualified_table: str, purpose: str) -> str:
    """A stable table name for ``purpose`` (``stage``) derived from the target's qualified name.

    Stable, so a leftover from a crashed run is found and dropped by the next one; short, so it fits
    every database's identifier limit.
    """
    digest = hashlib.sha1(qualified_table.encode()).hexdigest()[:16]
    return f"_faucet_{purpose}_{digest}"


_AUTH = ("password authentication failed", "pg_hba.conf", "access denied")
"""How refused credentials read when a connection fails before any SQLSTATE exists."""


def db_error(exc: Exception, *, where: str, doing: str) -> FaucetError:
    """The FaucetError for a SQLAlchemy or driver error raised while ``doing`` something at ``where``.

    The caller raises it ``from exc``. Connection problems are retryable ConnectionFailed; refused
    credentials AuthError; a missing table or column ConfigError/SchemaError; refused values DataError.
    """
    if isinstance(exc, FaucetError):
        return exc
    message = f"{doing} failed: {error_text(exc)}"
    original = getattr(exc, "orig", None)
    sqlstate = str(getattr(original, "sqlstate", "") or "")
    lowered = str(exc).lower()
    connecting = isinstance(exc, sa.exc.OperationalError) and not sqlstate
    if (
        isinstance(exc, sa.exc.NoSuchTableError)
        or "no such table" in lowered
        or sqlstate in ("42P01", "3F000", "3D000")
        or (connecting and "does not exist" in lowered)
    ):
        return ConfigError(message, where=where)
    if sqlstate.startswith("28") or sqlstate == "42501" or (connecting and any(m in lowered for m in _AUTH)):
        return AuthError(message, where=where)
    if "no such column" in lowered or "has no column" in lowered or sqlstate.startswith("42"):
        return SchemaError(message, where=where)
    if is_row_error(exc):
        return DataError(message, where=where)
    if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError | sa.exc.DisconnectionError):
        if "unable to open database file" in lowered:
            return ConfigError(message, where=where)
        return ConnectionFailed(message, where=where)
    return FaucetError(message, where=where)


def is_row_error(exc: BaseException) -> bool:
    """True when the database refused the values of a row (a constraint, a conversion): the rows may
    go to the dead-letter route. Anything else (connection, missing table, syntax) is not a bad row."""
    if isinstance(exc, DataError):
        return True  # a nested value JSON cannot hold: psycopg calls the serializer itself, unwrapped
    if isinstance(exc, sa.exc.IntegrityError | sa.exc.DataError):
        return True
    original = getattr(exc, "orig", None)
    sqlstate = str(getattr(original, "sqlstate", "") or "")
    if sqlstate[:2] in ("22", "23"):
        return True
    # A value the driver or a type's bind processor cannot convert fails before reaching the database
    # (a JSON value JSON cannot hold: the serializer's DataError).
    return isinstance(exc, sa.exc.StatementError) and isinstance(
        original, TypeError | ValueError | OverflowError | DataError
    )


def error_text(exc: BaseException) -> str:
    """The first line of the database's message (without SQLAlchemy's statement and parameters)."""
    original = getattr(exc, "orig", None)
    text = str(original if original is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- types ----------------------------------------------------------------------------------------

Converter = Callable[[list[Any]], list[Any]]


def arrow_type(sql_type: Any) -> pa.DataType:
    """The Arrow type a column of ``sql_type`` (a SQLAlchemy type) is read as.

    Integers are int64 (SQLite stores any integer in any INTEGER column); a NUMERIC with a precision
    up to 38 is decimal128, without one (or wider) a string so no digit is lost; JSON, UUID, arrays
    and unknown types are strings.
    """
    if isinstance(sql_type, sa.Boolean):
        return pa.bool_()
    if isinstance(sql_type, sa.Integer):
        return pa.int64()
    if isinstance(sql_type, sa.Float):
        return pa.float64()
    if isinstance(sql_type, sa.Numeric):
        precision, scale = sql_type.precision, sql_type.scale
        if precision is not None and 0 < precision <= 38:
            return pa.decimal128(precision, scale or 0)
        return pa.string()
    if isinstance(sql_type, sa.DateTime):
        return pa.timestamp("us", tz="UTC" if sql_type.timezone else None)
    if isinstance(sql_type, sa.Date):
        return pa.date32()
    if isinstance(sql_type, sa.Time):
        return pa.time64("us")
    if isinstance(sql_type, sa.Interval):
        return pa.duration("us")
    if isinstance(sql_type, sa.LargeBinary | sa.types._Binary):
        return pa.binary()
    return pa.string()


def converter(sql_type: Any, target: pa.DataType) -> Converter | None:
    """How to turn a column's Python values into values ``pa.array(..., target)`` accepts, or None
    when they already are."""
    if pa.types.is_string(target) and not isinstance(sql_type, sa.String | sa.Enum):
        return _to_text
    if (
        isinstance(sql_type, sa.Numeric)
        and not isinstance(sql_type, sa.Float)
        and pa.types.is_decimal(target)
    ):
        # SQLite hands back floats for NUMERIC columns; decimal128 wants Decimal or int.
        return lambda values: [_decimal(value) for value in values]
    return None


def _to_text(values: list[Any]) -> list[Any]:
    return [
        None
        if value is None
        else value
        if isinstance(value, str)
        else json_text(value, "a nested value read")
        if isinstance(value, dict | list)
        else str(value)
        for value in values
    ]


def _decimal(value: Any) -> Any:
    from decimal import Decimal

    return Decimal(repr(value)) if isinstance(value, float) else value


def sql_type(arrow: pa.DataType) -> Any:
    """The SQLAlchemy type a column of Arrow type ``arrow`` is created with."""
    if pa.types.is_dictionary(arrow):
        return sql_type(arrow.value_type)
    if pa.types.is_boolean(arrow):
        return sa.Boolean()
    if pa.types.is_integer(arrow):
        if arrow.bit_width <= 16 and pa.types.is_signed_integer(arrow):
            return sa.SmallInteger()
        if arrow.bit_width <= 16 or (arrow.bit_width == 32 and pa.types.is_signed_integer(arrow)):
            return sa.Integer()
        if pa.types.is_uint64(arrow):
            return sa.Numeric(20, 0)
        return sa.BigInteger()
    if pa.types.is_floating(arrow):
        return sa.Double() if arrow.bit_width == 64 else sa.Float()
    if pa.types.is_decimal(arrow):
        return sa.Numeric(arrow.precision, arrow.scale)
    if pa.types.is_timestamp(arrow):
        return sa.DateTime(timezone=arrow.tz is not None)
    if pa.types.is_date(arrow):
        return sa.Date()
    if pa.types.is_time(arrow):
        return sa.Time()
    if pa.types.is_duration(arrow):
        return sa.Interval()
    if pa.types.is_binary(arrow) or pa.types.is_large_binary(arrow) or pa.types.is_fixed_size_binary(arrow):
        return sa.LargeBinary()
    if pa.types.is_nested(arrow):
        return sa.JSON()
    return sa.Text()


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
