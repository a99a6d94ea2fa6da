"""What every DuckDB role shares: opening the file (and DuckDB's one-writer rule), running calls off the
event loop one at a time, wrapping DuckDB's errors, quoting names and judging column types.

One writer per file. DuckDB lets one process open a database file for writing, and while it has it
open no other process can open it at all (a process that opened it read-only keeps writers out too).
Inside one process every connection to a file shares one database (DuckDB caches it by path), so two
syncs or a sync and a stream of one process write the same file side by side. When another process
holds the file, :meth:`DuckDbFile.connect` retries for the config's ``lock_timeout`` and then raises
:class:`DatabaseLocked` naming that process (DuckDB's lock error carries its PID; its command line is
read from ``/proc`` where the OS allows), never hangs.

Writers of one file in one process take turns. DuckDB's transactions are snapshots, and an UPDATE
of a row another transaction committed after the snapshot was taken overwrites it without a conflict
(a lost update): a watermark or an owner fence read and advanced in one transaction would not be
atomic against another writer of the same process. So every call of every writing connector of one
file runs under that file's process-wide lock (:func:`writer_lock`): a read, check and write of the
watermark is never interleaved with another one. Other processes are kept out by DuckDB's file lock.

Blocking. DuckDB's calls block (and release the GIL while a query runs). Every call of one connector
runs in a worker thread (``asyncio.to_thread``) under its lock (the file's writer lock, or the
connector's own for a reader), so a connection is never used by two threads at once, and a coroutine
cancelled while its call runs leaves the call to finish: ``close`` waits for it (the lock) before
closing, so nothing a closed connector started lands later.
"""

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import duckdb
import pyarrow as pa

from faucet_dagster.protocol import (
    CommitConflict,
    ConfigError,
    ConnectionFailed,
    DataError,
    FaucetError,
    SchemaError,
)
from faucet_duckdb.config import DuckDbConnection

P = ParamSpec("P")
T = TypeVar("T")

Connection = duckdb.DuckDBPyConnection
Connect = Callable[[str], Connection]
"""How a connector opens its connection from the file's path: ``duckdb.connect`` (tests wrap it to
inject a fault at an exact point)."""

_LOCK_RETRY_SECONDS = 0.1
_HOLDER = re.compile(r"Conflicting lock is held in (?P<program>.*?) \(PID (?P<pid>\d+)\)")


class DatabaseLocked(ConnectionFailed):
    """Another process holds the DuckDB file (DuckDB allows one writing process per file, and no reader
    beside it). Retryable: the file can be written once that process closes it. ``holder_pid`` is the
    holder's process id when DuckDB named it."""

    def __init__(self, message: str, *, where: str, holder_pid: int | None) -> None:
        super().__init__(message, where=where)
        self.holder_pid = holder_pid


def file_uri(config: DuckDbConnection) -> str:
    """``duckdb:///<absolute path>``: the file, as dataset URIs name it."""
    return f"duckdb://{Path(config.path).expanduser().absolute().as_posix()}"


def quote(name: str) -> str:
    """``name`` as a DuckDB identifier (double quotes, a quote inside doubled)."""
    return '"' + name.replace('"', '""') + '"'


def qualified(schema: str, table: str) -> str:
    return f"{quote(schema)}.{quote(table)}"


def literal(text: str) -> str:
    """``text`` as a SQL string literal (for DDL, where DuckDB takes no parameters)."""
    return "'" + text.replace("'", "''") + "'"


_WRITER_LOCKS: dict[Path, threading.Lock] = {}
_WRITER_LOCKS_GUARD = threading.Lock()


def writer_lock(path: Path) -> threading.Lock:
    """The process-wide lock the writing connectors of the file at ``path`` take turns under."""
    with _WRITER_LOCKS_GUARD:
        return _WRITER_LOCKS.setdefault(path, threading.Lock())


class DuckDbFile:
    """One configured DuckDB file as a connector uses it: a connection opened on first use and kept
    until :meth:`close` (holding the file, see the module docstring), and the lock its calls run under.

    ``writer`` creates the file (and its folder) when missing; a reader refuses a missing file.
    ``where`` names the connector's dataset in errors.
    """

    def __init__(
        self,
        config: DuckDbConnection,
        *,
        writer: bool,
        where: str | None = None,
        connect: Connect = duckdb.connect,
        hold: bool = True,
    ) -> None:
        self.config = config
        self.writer = writer
        self.hold = hold
        """Keep the connection (the file) between calls; without, each call opens and closes it, so
        other processes (a notebook, an IO manager) can use the file between a stream's commits."""
        self.path = Path(config.path).expanduser().absolute()
        self.where = where or str(self.path)
        self._connect = connect
        self._conn: Connection | None = None
        self._lock = writer_lock(self.path.resolve()) if writer else threading.Lock()
        self.opened = 0
        """How many connections this object opened. While one stays open (``hold``), no other process
        writes the file (DuckDB's file lock) and this process's other writers only add tables and
        columns (a REPLACE swaps in a table of the same columns): what a call read of a table's
        columns holds until ``opened`` changes."""

    async def call(
        self, doing: str, function: Callable[Concatenate[Connection, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run ``function(connection, ...)`` in a worker thread under this file's lock (one call at a
        time), opening the connection first if needed; a DuckDB or Arrow error becomes the FaucetError
        :func:`wrap` names, saying it happened while ``doing`` it."""

        def work() -> T:
            with self._lock:
                try:
                    return function(self._connection(), *args, **kwargs)
                except (duckdb.Error, pa.ArrowException) as exc:
                    raise wrap(exc, where=self.where, doing=doing) from exc
                finally:
                    if not self.hold:
                        conn, self._conn = self._conn, None
                        if conn is not None:
                            conn.close()

        return await asyncio.to_thread(work)

    async def close(self) -> None:
        """Close the connection (after any call still running), releasing the file. Idempotent."""

        def work() -> None:
            with self._lock:
                conn, self._conn = self._conn, None
                if conn is not None:
                    conn.close()

        await asyncio.to_thread(work)

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._open()
            self.opened += 1
        return self._conn

    def _open(self) -> Connection:
        where = str(self.path)
        if self.writer:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(
                    f"cannot create the folder of the DuckDB file: {exc.strerror}", where=where
                ) from exc
        elif not self.path.is_file():
            raise ConfigError("DuckDB database file not found", where=where)
        deadline = time.monotonic() + self.config.lock_timeout
        while True:
            try:
                return self._connect(str(self.path))
            except duckdb.Error as exc:
                locked = locked_error(exc, where)
                if locked is None:
                    raise wrap(exc, where=where, doing="opening the database") from exc
                if time.monotonic() >= deadline:
                    raise locked from exc
            time.sleep(_LOCK_RETRY_SECONDS)


def locked_error(exc: BaseException, where: str) -> DatabaseLocked | None:
    """The :class:`DatabaseLocked` for DuckDB's lock error ``exc`` (None: it is another error)."""
    text = str(exc)
    if "Could not set lock on file" not in text:
        return None
    found = _HOLDER.search(text)
    pid = int(found.group("pid")) if found else None
    holder = "another process" if pid is None else f"process {pid} ({_command_of(pid, found)})"
    return DatabaseLocked(
        f"the DuckDB file is held by {holder}: DuckDB lets one process at a time open a file for "
        "writing, and no other process open it meanwhile. Close that process's connection (a notebook's "
        "duckdb.connect, a Dagster IO manager or resource holding it), or wait for it to finish; this "
        "connector waited lock_timeout seconds",
        where=where,
        holder_pid=pid,
    )


def _command_of(pid: int, found: re.Match[str] | None) -> str:
    """What process ``pid`` runs: its command line from /proc (where readable), else DuckDB's name."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        raw = b""
    words = [word.decode(errors="replace") for word in raw.split(b"\0") if word]
    if words:
        command = " ".join(words)
        return command if len(command) <= 200 else command[:197] + "..."
    return found.group("program") if found else "unknown program"


def wrap(exc: BaseException, *, where: str, doing: str) -> FaucetError:
    """The FaucetError for a DuckDB error raised while ``doing`` something at ``where``; the caller
    raises it ``from exc``. A value the table refuses (a constraint, a conversion) is a DataError, a
    missing table or column a SchemaError, a write-write conflict a retryable CommitConflict."""
    if isinstance(exc, FaucetError):
        return exc
    locked = locked_error(exc, where)
    if locked is not None:
        return locked
    message = (
        f"{doing} failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
    )
    if isinstance(exc, duckdb.TransactionException) and "Conflict on" in str(exc):
        return CommitConflict(message, where=where)
    if is_row_error(exc):
        return DataError(message, where=where)
    if isinstance(exc, duckdb.CatalogException | duckdb.BinderException):
        return SchemaError(message, where=where)
    if isinstance(exc, duckdb.IOException | duckdb.PermissionException):
        return ConfigError(message, where=where)
    if isinstance(exc, pa.ArrowException):
        return DataError(message, where=where)
    return FaucetError(message, where=where)


def first_row(
    conn: Connection, query: str, parameters: Sequence[object] | None = None
) -> tuple[Any, ...] | None:
    """The first row of ``query`` (None: no row), its result read to the end: DuckDB refuses the next
    statement on a connection whose last result is unfinished, which ``fetchone`` leaves."""
    rows = conn.execute(query, parameters).fetchall()
    return rows[0] if rows else None


def rollback_quietly(conn: Connection) -> None:
    """Roll back the open transaction, if any (a failed statement may have ended it already): the
    error being raised is the one that matters."""
    with contextlib.suppress(duckdb.Error):
        conn.rollback()


def is_row_error(exc: BaseException) -> bool:
    """True when DuckDB refused the values of rows (a constraint, a conversion, an out-of-range value)."""
    return isinstance(
        exc,
        duckdb.ConstraintException | duckdb.ConversionException | duckdb.OutOfRangeException,
    )


# -- column types ----------------------------------------------------------------------------------

_INTEGERS = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT")
_UNSIGNED = ("UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT", "UHUGEINT")


def _widens(stored: str, incoming: str) -> bool:
    """Whether a value of DuckDB type ``incoming`` lands in a column of type ``stored`` unchanged."""
    if stored == incoming or incoming == '"NULL"':  # a column of nulls only fits any column
        return True
    if stored in _INTEGERS and incoming in _INTEGERS:
        return _INTEGERS.index(incoming) <= _INTEGERS.index(stored)
    if stored in _UNSIGNED and incoming in _UNSIGNED:
        return _UNSIGNED.index(incoming) <= _UNSIGNED.index(stored)
    if stored in _INTEGERS and incoming in _UNSIGNED:
        return _UNSIGNED.index(incoming) < _INTEGERS.index(stored)
    return stored == "DOUBLE" and incoming == "FLOAT"


def check_types(stored: dict[str, str], incoming: Sequence[tuple[str, str]], where: str) -> None:
    """SchemaError naming every column whose incoming values the stored column would change (a DOUBLE
    into a BIGINT is rounded, a string into a DATE parsed): DuckDB would cast them silently."""
    changed = [
        f"{name} ({kind} into {stored[name]})"
        for name, kind in incoming
        if name in stored and not _widens(stored[name], kind)
    ]
    if changed:
        raise SchemaError(
            "the records' column type(s) differ from the table's and would be converted: "
            + ", ".join(changed),
            where=where,
        )


def arrow_for_duckdb(batch: pa.RecordBatch) -> pa.Table:
    """``batch`` as a table DuckDB reads as the columns it holds: dictionary columns decoded (DuckDB
    would make them ENUMs) and a column with no name refused."""
    for field in batch.schema:
        if not field.name:
            raise SchemaError("a column of the records has no name")
    table = pa.Table.from_batches([batch])
    if any(pa.types.is_dictionary(field.type) for field in batch.schema):
        table = table.cast(
            pa.schema(
                [
                    pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type)
                    for f in batch.schema
                ]
            )
        )
    return table


__all__ = [
    "Connect",
    "Connection",
    "DatabaseLocked",
    "DuckDbFile",
    "arrow_for_duckdb",
    "check_types",
    "file_uri",
    "first_row",
    "is_row_error",
    "literal",
    "locked_error",
    "qualified",
    "quote",
    "rollback_quietly",
    "wrap",
    "writer_lock",
]
