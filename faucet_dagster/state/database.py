"""How the state store (:mod:`.store`) reaches its database: the URL, the engine, transactions.

SQLite (the default, a file under ``$DAGSTER_HOME``) or PostgreSQL (psycopg 3). SQLite runs in WAL
mode with ``BEGIN IMMEDIATE`` for transactions that write, so a compare-and-set holds the write lock
from its start; a read-only transaction is a deferred ``BEGIN`` that neither waits for nor blocks a
writer. Driver errors become the store's own: a corrupt SQLite file a ConfigError saying what to do,
a database that cannot be reached or does not answer in time :class:`StateStoreUnavailable`,
anything else ConnectionFailed naming the action. No message shows the URL's password or query.

Every wait is bounded by the store's ``timeout`` (:data:`STATE_TIMEOUT` by default), counted from the
start of each operation (one transaction, or creating the tables): connecting, waiting for a pooled
connection, every statement and the commit (connecting may pass it by up to a second: libpq counts
whole seconds). A PostgreSQL server that stops answering (a frozen
process: its kernel still accepts and acknowledges bytes, so no TCP timeout fires, and it cannot run
its own ``statement_timeout``) is given up on from this side: each psycopg wait ends at the deadline,
the connection is closed (never reused half-way through a request) and the operation raises
:class:`StateStoreUnavailable`. A commit given up on this way may or may not have happened: every
write of the store is safe to retry (a retried certificate identical to the stored one is accepted, a
lease is compare-and-set). SQLite waits for another process's write lock at most ``timeout`` too.
"""

import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.abc import PQGen
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError, DatabaseError, DBAPIError, SQLAlchemyError
from sqlalchemy.exc import OperationalError as SAOperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from faucet_dagster.protocol import ConfigError, ConnectionFailed
from faucet_dagster.state.tables import ADDED_COLUMNS, metadata

STATE_URL_ENV = "FAUCET_STATE_URL"
STATE_FILE_NAME = "faucet_state.db"
STATE_TIMEOUT = 5.0
"""Seconds one state store operation may wait on its database in total (see the module docstring):
well inside a sensor tick's budget (at most 10 s), so a tick that meets a frozen store ends in time."""


class StateStoreUnavailable(ConnectionFailed):
    """The state store cannot be reached, or did not answer within its timeout: "state store
    unreachable". Retryable; what the operation wrote may or may not be committed (every write of the
    store is safe to retry)."""


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
    """The store's engine, with its tables created (and columns added since an earlier version).

    ``timeout``: seconds each operation may wait on the database in total (module docstring)."""

    def __init__(self, url: str | None = None, *, timeout: float = STATE_TIMEOUT) -> None:
        if not timeout > 0:
            raise ConfigError(
                f"the state store timeout must be positive, not {timeout!r}", where="state store"
            )
        parsed = _normalize_url(url or default_state_url())
        # The store has no auth field: a password may be in the URL (or PGPASSWORD), so every message
        # shows the URL without it and without the query, where driver options such as sslpassword live.
        self.where = f"state store {parsed.set(query={}).render_as_string(hide_password=True)}"
        self.timeout = timeout
        self._sqlite = parsed.get_backend_name() == "sqlite"
        self._path = parsed.database or ""
        if self._sqlite and parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        if self._sqlite:
            self._engine: Engine = sa.create_engine(parsed, pool_timeout=timeout)
            _configure_sqlite(self._engine, timeout)
        else:
            # libpq counts connect_timeout in whole seconds, at least 2.
            connect_args = {"connect_timeout": max(2, math.ceil(timeout))}
            self._engine = sa.create_engine(
                parsed, pool_pre_ping=True, pool_timeout=timeout, connect_args=connect_args
            )
            _bound_postgresql(self._engine)
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
        """Run one operation within the store's timeout, its failures translated (module docstring)."""
        with _deadline(self.timeout):
            try:
                yield
            except SQLAlchemyError as exc:
                if self._sqlite and _corrupt(exc):
                    raise ConfigError(
                        f"could not {action}: the state store file {self._path} is corrupt or not a "
                        "SQLite database; restore it from a backup, or move it aside to start an empty "
                        "store (the streams' certificates, leases and dead letters would then be gone)",
                        where=self.where,
                    ) from exc
                if _unreachable(exc):
                    raise StateStoreUnavailable(
                        f"state store unreachable: could not {action} ({_reason(exc)}; an operation "
                        f"waits at most {self.timeout:g}s)",
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


def _configure_sqlite(engine: Engine, timeout: float) -> None:
    """WAL for concurrent readers, a busy timeout (the store's timeout) for concurrent writers, fsync on
    commit, and ``BEGIN IMMEDIATE`` so a transaction holds the write lock from its start
    (compare-and-set)."""

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event below emits BEGIN itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute(f"PRAGMA busy_timeout={round(timeout * 1000)}")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(_READ_ONLY) else "BEGIN IMMEDIATE")


_READ_ONLY = "faucet_read_only"
"""The execution option of a transaction that writes nothing (:meth:`StoreDatabase.transaction`)."""


# -- bounded waits on PostgreSQL --------------------------------------------------------------------

_operation = threading.local()
"""The deadline (``time.monotonic()``) of the store operation running on this thread, if any."""


@contextmanager
def _deadline(timeout: float) -> Iterator[None]:
    """Bound every database wait of this thread to ``timeout`` seconds from now (an enclosing operation's
    earlier deadline stands)."""
    outer: float | None = getattr(_operation, "deadline", None)
    ends = time.monotonic() + timeout
    _operation.deadline = ends if outer is None else min(outer, ends)
    try:
        yield
    finally:
        _operation.deadline = outer


class _NoAnswer(psycopg.OperationalError):
    """The server did not answer before the operation's deadline; the connection was closed."""


class _BoundedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose every wait on the server ends at the running operation's deadline.

    psycopg waits on the socket without a limit, and a frozen server never answers (its kernel still
    acknowledges what is sent, so no TCP timeout fires). Past the deadline the wait stops, the
    connection is closed (its protocol state is mid-request: it must never be reused) and
    :class:`_NoAnswer` is raised; SQLAlchemy then sees a closed connection and discards it.
    """

    def wait(self, gen: PQGen[Any], interval: float = 0.1, timeout: float | None = None) -> Any:
        deadline: float | None = getattr(_operation, "deadline", None)
        if deadline is None:
            return super().wait(gen, interval, timeout)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.close()
            raise _NoAnswer("no time left to wait for the server")
        try:
            return super().wait(gen, interval, remaining if timeout is None else min(timeout, remaining))
        except psycopg.OperationalError:
            # psycopg's wait timeout (private type) is an OperationalError raised at the deadline; a
            # connection that broke by itself is closed already.
            if self.closed or time.monotonic() < deadline - 0.05:
                raise
            self.close()
            raise _NoAnswer(f"the server did not answer within {remaining:.1f}s") from None


def _bound_postgresql(engine: Engine) -> None:
    """Connect through :class:`_BoundedConnection`, within what is left of the operation's deadline.

    libpq counts ``connect_timeout`` in whole seconds, at least 2: a connection is not attempted with
    less than a second left (the operation then fails at once), so connecting can pass the deadline by
    at most a second."""

    @sa.event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        deadline: float | None = getattr(_operation, "deadline", None)
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining < 1.0:
                raise _NoAnswer("no time left to connect")
            cparams = {**cparams, "connect_timeout": max(2, math.floor(remaining))}
        return _BoundedConnection.connect(*cargs, **cparams)


def _unreachable(exc: SQLAlchemyError) -> bool:
    """A failure to reach the database or to get its answer in time (not a refused statement)."""
    if isinstance(exc, PoolTimeout | SAOperationalError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def _reason(exc: SQLAlchemyError) -> str:
    if isinstance(exc, PoolTimeout):
        return "no pooled connection became free"
    origin = exc.orig if isinstance(exc, DBAPIError) else None
    if isinstance(origin, _NoAnswer):
        return "no answer"
    if isinstance(origin, psycopg.errors.ConnectionTimeout):
        return "connecting timed out"
    text = str(origin).lower() if origin is not None else ""
    if "database is locked" in text:
        return "another process held the SQLite write lock"
    if "refused" in text:
        return "connection refused"
    return type(origin or exc).__name__
