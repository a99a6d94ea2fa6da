"""How the state store (:mod:`.store`) reaches its database: the URL, the engine, transactions.

SQLite (the default, a file under ``$DAGSTER_HOME``) or PostgreSQL (psycopg 3). SQLite runs in WAL
mode with ``BEGIN IMMEDIATE`` for transactions that write, so a compare-and-set holds the write lock
from its start; a read-only transaction is a deferred ``BEGIN`` that neither waits for nor blocks a
writer. Driver errors become the store's own: a corrupt SQLite file a ConfigError saying what to do,
anything else ConnectionFailed naming the action. No message shows the URL's password or query.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError, DatabaseError, SQLAlchemyError

from faucet_dagster.protocol import ConfigError, ConnectionFailed
from faucet_dagster.state.tables import ADDED_COLUMNS, metadata

STATE_URL_ENV = "FAUCET_STATE_URL"
STATE_FILE_NAME = "faucet_state.db"


def default_state_url() -> str:
    """``$FAUCET_STATE_URL``, else a SQLite file under ``$DAGSTER_HOME``; a ConfigError if neither is set."""
    explicit = os.environ.get(STATE_URL_ENV)
    if explicit:
        return explicit
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        raise ConfigError(
            f"no state store: set {STATE_URL_ENV} (a SQLAlchemy URL) or DAGSTER_HOME (a SQLite file there)",
            where=STATE_URL_ENV,
        )
    return f"sqlite:///{Path(home).expanduser().resolve() / STATE_FILE_NAME}"


def _normalize_url(url: str) -> sa.URL:
    try:
        parsed = sa.make_url(url)
    except (ArgumentError, ValueError):
        # Never echo the URL (SQLAlchemy's message does): it might hold a secret.
        raise ConfigError(
            "the state store URL is not a SQLAlchemy URL (dialect[+driver]://user@host/database)",
            where=STATE_URL_ENV,
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigError(
            f"the state store supports SQLite and PostgreSQL, not {parsed.get_backend_name()}",
            where=STATE_URL_ENV,
        )
    return parsed


_CORRUPT = ("file is not a database", "database disk image is malformed")
"""How SQLite reports a file that is not (or no longer) a database."""


def _corrupt(exc: SQLAlchemyError) -> bool:
    return isinstance(exc, DatabaseError) and any(text in str(exc) for text in _CORRUPT)


class StoreDatabase:
    """The store's engine, with its tables created (and columns added since an earlier version)."""

    def __init__(self, url: str | None = None) -> None:
        parsed = _normalize_url(url or default_state_url())
        # The store has no auth field: a password may be in the URL (or PGPASSWORD), so every message
        # shows the URL without it and without the query, where driver options such as sslpassword live.
        self.where = f"state store {parsed.set(query={}).render_as_string(hide_password=True)}"
        self._sqlite = parsed.get_backend_name() == "sqlite"
        self._path = parsed.database or ""
        if self._sqlite and parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        self._engine: Engine = sa.create_engine(parsed, pool_pre_ping=not self._sqlite)
        if self._sqlite:
            _configure_sqlite(self._engine)
        with self._translate("create the tables"):
            metadata.create_all(self._engine)
            _add_missing_columns(self._engine)

    def insert(self, table: sa.Table) -> Any:
        """An ``INSERT`` into ``table`` in the database's dialect (which has ``on_conflict_do_*``)."""
        return (sqlite_insert if self._sqlite else postgresql_insert)(table)

    def close(self) -> None:
        """Release the engine's connections."""
        self._engine.dispose()

    @contextmanager
    def _translate(self, action: str) -> Iterator[None]:
        try:
            yield
        except SQLAlchemyError as exc:
            if self._sqlite and _corrupt(exc):
                raise ConfigError(
                    f"could not {action}: the state store file {self._path} is corrupt or not a SQLite "
                    "database; restore it from a backup, or move it aside to start an empty store (the "
                    "streams' certificates, leases and dead letters would then be gone)",
                    where=self.where,
                ) from exc
            raise ConnectionFailed(f"could not {action}: {type(exc).__name__}", where=self.where) from exc

    @contextmanager
    def transaction(self, action: str, *, read_only: bool = False) -> Iterator[Connection]:
        """One transaction. ``read_only`` (it writes nothing): on SQLite a deferred ``BEGIN``, a WAL
        reader that neither waits for the write lock nor makes a writer wait."""
        with self._translate(action):
            if not read_only:
                with self._engine.begin() as conn:
                    yield conn
                return
            with self._engine.connect() as conn:
                conn.execution_options(**{_READ_ONLY: True})
                with conn.begin():
                    yield conn


def _add_missing_columns(engine: Engine) -> None:
    """Add the columns of :data:`ADDED_COLUMNS` a store of an earlier version lacks.

    All are nullable, so ``ALTER TABLE ... ADD COLUMN`` works on SQLite and PostgreSQL alike; a
    process adding them at the same moment as this one makes the statement fail, and the columns
    are there when it is inspected again.
    """
    for table_name, columns in ADDED_COLUMNS.items():
        table = metadata.tables[table_name]
        for attempt in range(2):
            present = {column["name"] for column in sa.inspect(engine).get_columns(table_name)}
            missing = [name for name in columns if name not in present]
            if not missing:
                break
            try:
                with engine.begin() as conn:
                    for name in missing:
                        kind = table.c[name].type.compile(dialect=engine.dialect)
                        conn.exec_driver_sql(f"ALTER TABLE {table_name} ADD COLUMN {name} {kind}")
            except SQLAlchemyError:
                if attempt:
                    raise


def _configure_sqlite(engine: Engine) -> None:
    """WAL for concurrent readers, a busy timeout for concurrent writers, fsync on commit, and
    ``BEGIN IMMEDIATE`` so a transaction holds the write lock from its start (compare-and-set)."""

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event below emits BEGIN itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(_READ_ONLY) else "BEGIN IMMEDIATE")


_READ_ONLY = "faucet_read_only"
"""The execution option of a transaction that writes nothing (:meth:`StoreDatabase.transaction`)."""
