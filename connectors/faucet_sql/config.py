"""Configs of the SQL (SQLAlchemy) source and sink. Only pydantic and the protocol are imported here.

The database is a SQLAlchemy URL without credentials (``sqlite:///data/warehouse.db``,
``postgresql://app@db.example.com/shop``): neither a password in it nor a query parameter carrying one
(``?password=``, ``?sslpassword=``...); credentials go in ``auth`` (``user_password``), so the password
is a ``SecretStr`` that never reaches logs, metadata or errors. A ``postgresql://`` URL without a
driver uses psycopg 3. Table, schema and column names the database would truncate (PostgreSQL: more
than 63 bytes; others: SQLAlchemy's dialect limit) are refused here, naming them.
"""

import functools
from datetime import datetime
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from faucet_dagster.protocol import (
    POSTGRES_MAX_IDENTIFIER_BYTES,
    Auth,
    ConnectorConfig,
    NoAuth,
    UserPasswordAuth,
    check_write_key,
    identifier_too_long,
    refuse_url_credentials,
)

SqlWriteMode = Literal["append", "upsert", "replace"]


_KNOWN_CHARACTER_LIMITS = {"mysql": 64, "mariadb": 64, "mssql": 128, "oracle": 128}
"""Servers' identifier limits where SQLAlchemy's dialect class states a looser one until it connects."""


@functools.lru_cache(maxsize=64)
def _identifier_limit(url: str) -> tuple[int | None, int | None, str]:
    """``(max_bytes, max_chars, database)`` of the identifiers of ``url``'s dialect: PostgreSQL counts
    bytes (63); others SQLAlchemy's dialect limit in characters (none for an unknown dialect)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import NoSuchModuleError

    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        return POSTGRES_MAX_IDENTIFIER_BYTES, None, "PostgreSQL"
    if backend in _KNOWN_CHARACTER_LIMITS:
        return None, _KNOWN_CHARACTER_LIMITS[backend], backend
    try:
        limit = parsed.get_dialect().max_identifier_length
    except NoSuchModuleError:
        return None, None, backend  # create_engine reports the unknown dialect, with the URL's safe form
    return None, int(limit) if limit else None, backend


class SqlConnection(ConnectorConfig):
    """Where the database is: a SQLAlchemy URL without a password, plus the adjacently tagged auth."""

    url: str = Field(min_length=1, description="SQLAlchemy URL without credentials.")
    auth: Auth = Field(default_factory=NoAuth, description="none or user_password.")

    @field_validator("url")
    @classmethod
    def _url_without_password(cls, url: str) -> str:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError

        try:
            parsed = make_url(url)
        except (ArgumentError, ValueError):
            # Never echo the URL: it might hold a secret.
            raise ValueError("not a SQLAlchemy URL (dialect[+driver]://user@host/database)") from None
        if parsed.password is not None:
            raise ValueError("the URL holds a password; put credentials in auth (user_password)")
        if parsed.get_backend_name() == "duckdb":
            # duckdb-engine's dialect answers PostgreSQL's catalog queries DuckDB does not have.
            raise ValueError(
                "DuckDB is not a dialect of the sql connector: use the duckdb connector "
                "(connector: duckdb, config: {path: <file>, table: <table>}), which writes Arrow natively"
            )
        try:
            # Loads the dialect's module, no I/O: a misspelt dialect fails here, not at a run.
            parsed.get_dialect()
        except NoSuchModuleError:
            raise ValueError(
                f"no SQLAlchemy dialect {parsed.drivername!r} is installed (sqlite, postgresql+psycopg, ...)"
            ) from None
        return refuse_url_credentials(url, auth_hint="auth (user_password)")

    @model_validator(mode="after")
    def _supported_auth(self) -> Self:
        if not isinstance(self.auth, NoAuth | UserPasswordAuth):
            raise ValueError(f"auth type {self.auth.type!r} is not supported (use none or user_password)")
        return self


class SqlTable(SqlConnection):
    """A table: ``table`` in ``schema_name`` (the connection's default schema when unset)."""

    table: str = Field(min_length=1)
    schema_name: str | None = None

    def identifier_problem(self, name: str) -> str | None:
        """Why the database would not keep ``name`` as written (too long), or None."""
        max_bytes, max_chars, database = _identifier_limit(self.url)
        return identifier_too_long(name, max_bytes=max_bytes, max_chars=max_chars, database=database)

    def configured_names(self) -> list[str]:
        """Every identifier this config names (tables, schema, columns)."""
        return [self.table, *([self.schema_name] if self.schema_name else [])]

    @model_validator(mode="after")
    def _names_kept(self) -> Self:
        for name in self.configured_names():
            problem = self.identifier_problem(name)
            if problem:
                raise ValueError(problem)
        return self


class CursorWindow(BaseModel):
    """Rows whose cursor is at or after ``start`` and before ``end`` (a time-window partition)."""

    model_config = ConfigDict(extra="forbid")
    start: datetime
    end: datetime


class SqlSourceConfig(SqlTable):
    """An incremental read of one table in ascending ``(cursor, key...)`` order.

    ``cursor`` is the column that grows as rows are added or changed (``updated_at``, an id); rows
    whose cursor is NULL are not read. ``key`` breaks ties between rows sharing a cursor value and must
    be unique with it; empty means the table's primary key. Without a cursor the table is read in key
    order and resumed after the last key. ``columns`` reads only those columns (empty: all).
    ``row_values`` chooses how ``(cursor, key) > (...)`` is written: ``auto`` uses a row-value
    comparison on dialects known to support it (PostgreSQL, SQLite, MySQL, MariaDB, DuckDB) and the
    expanded ``c > x OR (c = x AND k > y)`` form elsewhere. ``cursor_window`` reads only the rows whose
    (time) cursor is in ``[start, end)``: one time-window partition of a bounded sync.
    """

    cursor: str | None = None
    key: list[str] = Field(default_factory=list)
    columns: list[str] | None = None
    row_values: Literal["auto", "native", "expanded"] = "auto"
    cursor_window: CursorWindow | None = None

    @model_validator(mode="after")
    def _window_needs_cursor(self) -> Self:
        if self.cursor_window is not None and not self.cursor:
            raise ValueError("cursor_window (time partitions) needs a cursor: the table's time column")
        return self

    def configured_names(self) -> list[str]:
        return [
            *super().configured_names(),
            *([self.cursor] if self.cursor else []),
            *self.key,
            *(self.columns or []),
        ]


class SqlSinkConfig(SqlTable):
    """A table written by ``mode``: append, upsert (by ``key``) or replace (staged, swapped at finish).

    The table is created from the first batch's Arrow schema when missing (with ``key`` as its primary
    key). ``schema_evolution`` adds a column the table lacks (ALTER TABLE ADD COLUMN); off, such a
    column raises SchemaError. The commit-token watermark lives in ``watermark_table`` (same schema as
    the table), one row per ``sync_id`` (default: the qualified table name), so several syncs into one
    database keep separate watermarks.
    """

    mode: SqlWriteMode = "append"
    key: list[str] = Field(default_factory=list)
    schema_evolution: bool = True
    sync_id: str | None = Field(default=None, min_length=1)
    watermark_table: str = Field(default="_faucet_watermarks", min_length=1)

    @model_validator(mode="after")
    def _key_for_upsert(self) -> Self:
        check_write_key(self.mode, self.key)
        return self

    def configured_names(self) -> list[str]:
        return [*super().configured_names(), *self.key, self.watermark_table]

    def watermark_scope(self) -> str:
        """The ``sync_id`` keying this sink's watermark row."""
        if self.sync_id is not None:
            return self.sync_id
        return self.table if self.schema_name is None else f"{self.schema_name}.{self.table}"
