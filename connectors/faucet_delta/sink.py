"""The Delta Lake sink: Arrow batches into one Delta table, one Delta commit per page.

Modes (one per configured sink; ``capabilities().bounded_policies`` is exactly that mode):

- ``append``: ``write_deltalake(mode="append")``; each page is one commit.
- ``upsert``: MERGE on the key (``when_matched_update_all``, ``when_not_matched_insert_all``); within a
  page the last row of a key wins; a row without its key is refused (DataError). The first page of a
  missing table creates it.
- ``replace``: the run's pages stream into one ``write_deltalake(mode="overwrite")`` running in a
  worker thread; ``finish()`` ends the stream and waits for its commit. Readers see the previous
  version until then; a run that fails or closes before ``finish`` aborts the stream and nothing is
  committed (the Parquet files it wrote are unreferenced, removed by a later ``VACUUM``), except, for a
  table that did not exist, the empty table its first page created.

Watermark. ``write_batch_idempotent(records, token)`` commits the page with the Delta transaction
identifier ``Transaction(app_id, token)`` in the same commit (``CommitProperties.app_transactions``):
the table's log records it atomically with the files. A page whose token is not above the table's
transaction version for the app id writes nothing and returns 0. Two writers committing the same app
id from one snapshot conflict in Delta's optimistic commit (the second fails with a retryable
CommitConflict, and its retry reads the first's version and skips); writers of one table in one
process also take turns under a process-wide lock. Append and upsert only.

Schemas. A missing table is created, empty, from the first page's Arrow schema (partitioned by
``partition_by``), in a commit of its own before the page's. A column the table lacks is merged into
its schema (``schema_mode="merge"``) when ``schema_evolution`` is on, refused (SchemaError) when off.
A column whose values the table's type would change (a float into a BIGINT column: delta-rs casts it
silently) is refused, naming it; a narrower integer or float is widened to the table's type.

Table version. Every commit this sink makes is made through a ``DeltaTable`` whose state delta-rs
advances to the version that commit created (a missing table is created first, so even the first
page commits through one); :meth:`DeltaSink.commit_details` reports the last of them as
``delta/table_version``, never a version read back later (another writer may have committed since).

Stores. A local table is a folder (created with its parents); an ``s3://`` table goes through
delta-rs's object store with the config's ``storage_options``, conditional puts on: the log entry of a
commit is created only if absent, so two writers of one version on S3 conflict as they do locally. The
secrets in those options reach delta-rs only: a delta-rs error is scrubbed of them before it is raised.

Blocking. delta-rs calls block; every call runs in a worker thread (``asyncio.to_thread``).
"""

import asyncio
import contextlib
import json
import queue
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, SchemaMismatchError, TableNotFoundError

from faucet_dagster.protocol import (
    REDACTED,
    AddColumn,
    AuthError,
    CommitConflict,
    CommitToken,
    ConfigError,
    ConnectionFailed,
    DataError,
    Durability,
    FaucetError,
    JsonValue,
    SchemaError,
    Sink,
    SinkCapabilities,
    UnsupportedOperation,
    WritePolicy,
    upsert_rows,
)
from faucet_delta.config import DeltaSinkConfig

P = ParamSpec("P")
T = TypeVar("T")

_TABLE_LOCKS: dict[str, threading.Lock] = {}
_TABLE_LOCKS_GUARD = threading.Lock()
_QUEUE_DEPTH = 2
BOOKMARK_APP, BOOKMARK_TOKEN, BOOKMARK = "faucet.app", "faucet.token", "faucet.bookmark"
"""The commit metadata keys that keep a page's bookmark with its transaction identifier."""
HISTORY_SEARCHED = 1000
"""Commits read back (newest first) to find the one that recorded the sync's transaction version."""
TABLE_VERSION = "delta/table_version"
"""The :meth:`DeltaSink.commit_details` key: the table version the sink's last commit of the run created."""
_END = object()
_ABORT = object()


def _table_lock(table: str) -> threading.Lock:
    """The process-wide lock the writers of the table at ``table`` (a resolved path or URI) take
    turns under."""
    with _TABLE_LOCKS_GUARD:
        return _TABLE_LOCKS.setdefault(table, threading.Lock())


class DeltaSink(Sink):
    """A bounded sink into one Delta table (see the module docstring)."""

    connector_name = "delta"
    config_model = DeltaSinkConfig

    def __init__(self, config: DeltaSinkConfig) -> None:
        self.config = config
        self.mode = WritePolicy(config.mode)
        self.uri = config.table_uri()
        self._options = config.storage_options()
        self._local = None if config.on_s3() else config.path()
        self._lock = _table_lock(self.uri if self._local is None else str(self._local.resolve()))
        self._key = tuple(config.key) if self.mode is WritePolicy.UPSERT else ()
        self._app_id = config.transaction_app_id()
        self._overwrite: _Overwrite | None = None
        self._committed_version: int | None = None

    # -- identity and capabilities ------------------------------------------------------------------

    def dataset_uri(self) -> str:
        if self._local is None:
            return f"delta+{self.uri}"
        return f"delta+file://{self._local.as_posix()}"

    def capabilities(self) -> SinkCapabilities:
        return SinkCapabilities(
            bounded_policies=frozenset({self.mode}),
            durability=Durability.TRANSACTIONAL,
            atomic_watermark=self.mode in (WritePolicy.APPEND, WritePolicy.UPSERT),
            watermark_bookmark=self.mode in (WritePolicy.APPEND, WritePolicy.UPSERT),
            schema_evolution=self.config.schema_evolution,
        )

    def dedups_by_key(self) -> bool:
        return self.mode is WritePolicy.UPSERT

    def write_mode(self) -> tuple[WritePolicy, tuple[str, ...]]:
        return self.mode, tuple(self.config.key)

    def scope_watermark(self, scope: str) -> bool:
        self._app_id = f"{self.config.transaction_app_id()}#{scope}"
        return True

    # -- protocol methods -----------------------------------------------------------------------------

    async def check(self) -> None:
        await self.call("checking the table", self.checked_table)

    async def close(self) -> None:
        overwrite, self._overwrite = self._overwrite, None
        if overwrite is not None:
            await asyncio.to_thread(overwrite.abort)

    async def write_batch(self, records: pa.RecordBatch) -> int:
        if self.mode is WritePolicy.REPLACE:
            return await self.call("writing the snapshot", self._stream, records)
        return await self.call("writing", self._write, records, None)

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        self._require_watermark()
        return await self.call("writing", self._write, records, (token, bookmark))

    async def last_committed_token(self) -> CommitToken | None:
        committed = await self.last_committed_bookmark()
        return None if committed is None else committed[0]

    async def last_committed_bookmark(self) -> tuple[CommitToken, JsonValue | None] | None:
        self._require_watermark()
        return await self.call("reading the transaction version", self._read_token)

    async def finish(self) -> None:
        if self.mode is WritePolicy.REPLACE:
            await self.call("replacing the table", self._commit_snapshot)

    def commit_details(self) -> Mapping[str, int | str]:
        version = self._committed_version
        return {} if version is None else {TABLE_VERSION: version}

    async def current_schema(self) -> pa.Schema | None:
        return await self.call("reading the table's schema", self._current_schema)

    async def row_count(self) -> int | None:
        return await self.call("counting rows", self._row_count)

    async def evolve_schema(self, changes: Sequence[AddColumn]) -> None:
        if not self.config.schema_evolution:
            raise SchemaError(
                f"schema evolution is off: not adding {', '.join(change.name for change in changes)}",
                where=self.dataset_uri(),
            )
        if self.mode is not WritePolicy.REPLACE:  # a replace's snapshot brings its own schema
            await self.call("adding columns", self._evolve, changes)

    # -- blocking parts, run in a worker thread -----------------------------------------------------

    async def call(self, doing: str, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``function`` in a worker thread under the table's lock; a delta-rs, Arrow or OS error
        becomes the FaucetError :func:`_error` names."""

        def work() -> T:
            with self._lock:
                try:
                    return function(*args, **kwargs)
                except FaucetError:
                    raise
                except (DeltaError, pa.ArrowException, OSError) as exc:
                    secrets = self.config.secrets()
                    error = _error(exc, where=self.dataset_uri(), doing=doing, secrets=secrets)
                    leaks = any(secret in str(exc) for secret in secrets)
                    raise error from (None if leaks else exc)  # a traceback prints its cause

        return await asyncio.to_thread(work)

    def _require_watermark(self) -> None:
        if not self.capabilities().atomic_watermark:
            raise UnsupportedOperation(f"{self.mode.value} has no atomic watermark", where=self.dataset_uri())

    def open_table(self) -> DeltaTable | None:
        """The table as it is now, or None while it does not exist (blocking: run it with :meth:`call`)."""
        if not DeltaTable.is_deltatable(self.uri, storage_options=self._options):
            return None
        try:
            return DeltaTable(self.uri, storage_options=self._options)
        except TableNotFoundError:
            return None

    def _created(self, schema: pa.Schema) -> DeltaTable:
        """The table, created with ``schema`` (partitioned by ``partition_by``) when missing: every
        write then goes through a ``DeltaTable``, which knows the version its commit created."""
        return DeltaTable.create(
            self.uri,
            schema=schema,
            mode="ignore",
            partition_by=list(self.config.partition_by) or None,
            storage_options=self._options,
        )

    def _committed(self, table: DeltaTable) -> None:
        """Keep the version ``table``'s last commit (this sink's, just made) created."""
        self._committed_version = int(table.version())

    def checked_table(self) -> DeltaTable | None:
        """:meth:`open_table`, after refusing a path that cannot hold the table (a file; a folder that
        cannot be created); an unreadable table is refused too (blocking: run it with :meth:`call`)."""
        if self._local is not None:
            self._make_folder(self._local)
        return self.open_table()

    def _make_folder(self, path: Path) -> None:
        if path.exists() and not path.is_dir():
            raise ConfigError("the table's path is a file, not a folder", where=self.dataset_uri())
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the table's folder: {exc.strerror}", where=self.dataset_uri()
            ) from exc

    def _write(self, batch: pa.RecordBatch, committed: tuple[CommitToken, JsonValue | None] | None) -> int:
        """Write ``batch`` in one Delta commit; with ``committed`` (the page's token and bookmark), the
        token as the commit's transaction identifier and the bookmark in its commit metadata."""
        table = self.checked_table()
        token = None if committed is None else committed[0]
        if token is not None and table is not None:
            stored = table.transaction_version(self._app_id)
            if stored is not None and stored >= token.sequence:
                return 0
        if self._key:
            batch = upsert_rows(batch, self._key, self.dataset_uri())
        data = self.conformed(batch, table)
        properties = None
        if committed is not None:
            token, bookmark = committed
            properties = CommitProperties(
                app_transactions=[Transaction(self._app_id, token.sequence)],
                custom_metadata={
                    BOOKMARK_APP: self._app_id,
                    BOOKMARK_TOKEN: str(token.sequence),
                    BOOKMARK: json.dumps(bookmark),
                },
            )
        created = table is None
        if table is None:
            table = self._created(data.schema)
            # Another writer may have created the table, and committed to it, since open_table() looked:
            # what it holds decides, as for a table that existed (its transaction, then MERGE).
            created = table.version() == 0
            stored = None if token is None else table.transaction_version(self._app_id)
            if token is not None and stored is not None and stored >= token.sequence:
                return 0
        if not created and self._key:
            merge_by_key(table, data, self._key, evolve=self.config.schema_evolution, properties=properties)
        else:
            write_deltalake(
                table,
                data,
                mode="append",
                schema_mode="merge" if self.config.schema_evolution and not created else None,
                commit_properties=properties,
            )
        self._committed(table)
        return int(batch.num_rows)

    def conformed(self, batch: pa.RecordBatch, table: DeltaTable | None) -> pa.Table:
        """``batch`` as the table stores it: dictionary columns decoded, narrower numbers widened to
        the table's types; a lossy type or (evolution off) a new column refused."""
        data = pa.Table.from_batches([batch])
        for index, field in enumerate(data.schema):
            if not field.name:
                raise SchemaError("a column of the records has no name", where=self.dataset_uri())
            if pa.types.is_dictionary(field.type):
                data = data.set_column(index, field.name, data.column(index).cast(field.type.value_type))
        if table is None:
            return data
        stored = arrow_schema(table)
        new = [name for name in data.schema.names if name not in stored.names]
        if new and not self.config.schema_evolution:
            raise SchemaError(
                f"the records have column(s) the table lacks: {', '.join(new)} (schema evolution is off)",
                where=self.dataset_uri(),
            )
        changed = [
            f"{field.name} ({field.type} into {stored.field(field.name).type})"
            for field in data.schema
            if field.name in stored.names and not _fits(field.type, stored.field(field.name).type)
        ]
        if changed:
            raise SchemaError(
                "the records' column type(s) differ from the table's and would be converted: "
                + ", ".join(changed),
                where=self.dataset_uri(),
            )
        target = pa.schema([stored.field(f.name) if f.name in stored.names else f for f in data.schema])
        return data.cast(target)

    def _read_token(self) -> tuple[CommitToken, JsonValue | None] | None:
        """The table's transaction version for this sync, and the bookmark its commit recorded (None
        when that commit's information is gone: the log's retention removed it)."""
        table = self.open_table()
        version = None if table is None else table.transaction_version(self._app_id)
        if table is None or version is None:
            return None
        for commit in table.history(HISTORY_SEARCHED):
            if commit.get(BOOKMARK_APP) == self._app_id and commit.get(BOOKMARK_TOKEN) == str(version):
                return CommitToken(int(version)), json.loads(str(commit[BOOKMARK]))
        return CommitToken(int(version)), None

    def _current_schema(self) -> pa.Schema | None:
        if self._overwrite is not None:
            return self._overwrite.schema
        table = self.open_table()
        return None if table is None else arrow_schema(table)

    def _row_count(self) -> int | None:
        table = self.open_table()
        return None if table is None else int(table.count())

    def _evolve(self, changes: Sequence[AddColumn]) -> None:
        table = self.open_table()
        if table is None:
            return  # the first write creates the table with every column of its page
        stored = arrow_schema(table)
        fields = [*stored, *(pa.field(c.name, c.type) for c in changes if c.name not in stored.names)]
        empty = pa.Table.from_batches([], schema=pa.schema(fields))
        write_deltalake(table, empty, mode="append", schema_mode="merge")
        self._committed(table)

    # -- replace ------------------------------------------------------------------------------------

    def _stream(self, batch: pa.RecordBatch) -> int:
        table = self.checked_table() if self._overwrite is None else None  # later pages: the overwrite's
        data = self.conformed(batch, None)
        if self._overwrite is None:
            if table is not None and not self.config.schema_evolution:
                self._refuse_other_schema(data.schema, arrow_schema(table))
            if table is None:
                table = self._created(data.schema)
            self._overwrite = _Overwrite(table, data.schema, self.config)
        self._overwrite.put(data, self.dataset_uri())
        return int(batch.num_rows)

    def _refuse_other_schema(self, incoming: pa.Schema, stored: pa.Schema) -> None:
        if incoming.names != stored.names:
            raise SchemaError(
                f"the snapshot's columns ({', '.join(incoming.names)}) are not the table's "
                f"({', '.join(stored.names)}) and schema evolution is off",
                where=self.dataset_uri(),
            )

    def _commit_snapshot(self) -> None:
        overwrite, self._overwrite = self._overwrite, None
        if overwrite is not None:
            overwrite.finish()
            self._committed(overwrite.table)
            return
        table = self.open_table()
        if table is not None:  # an empty snapshot empties the table
            empty = pa.Table.from_batches([], schema=arrow_schema(table))
            write_deltalake(table, empty, mode="overwrite")
            self._committed(table)


class _Overwrite:
    """One ``write_deltalake(mode="overwrite")`` in a worker thread, fed the run's pages through a
    bounded queue (at most ``_QUEUE_DEPTH`` pages wait): one commit, at :meth:`finish`."""

    def __init__(self, table: DeltaTable, schema: pa.Schema, config: DeltaSinkConfig) -> None:
        self.table = table
        """Written through (its storage options included), so its version is the overwrite's once
        :meth:`finish` returned."""
        self.schema = schema
        self._pages: queue.Queue[object] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._failure: BaseException | None = None
        reader = pa.RecordBatchReader.from_batches(schema, self._batches())
        options: dict[str, Any] = {
            "mode": "overwrite",
            "schema_mode": "overwrite" if config.schema_evolution else None,
            "partition_by": list(config.partition_by) or None,
        }
        self._thread = threading.Thread(target=self._write, args=(reader, options), daemon=True)
        self._thread.start()

    def _batches(self) -> Iterator[pa.RecordBatch]:
        while True:
            page = self._pages.get()
            if page is _END:
                return
            if page is _ABORT:
                raise RuntimeError("the run ended before finish(): the snapshot is not committed")
            assert isinstance(page, pa.Table)
            yield from page.to_batches()

    def _write(self, reader: pa.RecordBatchReader, options: dict[str, Any]) -> None:
        try:
            write_deltalake(self.table, reader, **options)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by put or finish
            self._failure = exc

    def put(self, data: pa.Table, where: str) -> None:
        if data.schema != self.schema:
            try:
                data = data.select(self.schema.names).cast(self.schema)
            except (KeyError, pa.ArrowException) as exc:
                raise SchemaError(
                    f"a page's columns differ from the snapshot's first page ({exc})", where=where
                ) from exc
        while True:
            self._raise_failure()
            with contextlib.suppress(queue.Full):
                self._pages.put(data, timeout=0.1)
                return

    def finish(self) -> None:
        self._send(_END)
        self._raise_failure()

    def abort(self) -> None:
        self._send(_ABORT)

    def _send(self, marker: object) -> None:
        while self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._pages.put(marker, timeout=0.1)
                break
        self._thread.join()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


def arrow_schema(table: DeltaTable) -> pa.Schema:
    return pa.schema(table.schema().to_arrow())


_INTEGERS = (pa.int8(), pa.int16(), pa.int32(), pa.int64())
_STRINGS = (pa.string(), pa.large_string(), pa.string_view())


def _fits(incoming: pa.DataType, stored: pa.DataType) -> bool:
    """Whether values of type ``incoming`` land in a column of type ``stored`` unchanged."""
    if incoming == stored or pa.types.is_null(incoming):
        return True
    if incoming in _INTEGERS and stored in _INTEGERS:
        return _INTEGERS.index(incoming) <= _INTEGERS.index(stored)
    if incoming in _STRINGS and stored in _STRINGS:
        return True
    if pa.types.is_timestamp(incoming) and pa.types.is_timestamp(stored):
        return (incoming.tz is None) == (stored.tz is None)
    return bool(incoming == pa.float32() and stored == pa.float64())


def merge_by_key(
    table: DeltaTable,
    data: pa.Table,
    key: Sequence[str],
    *,
    evolve: bool,
    properties: CommitProperties | None,
) -> None:
    """UPSERT ``data`` into ``table`` in one commit (MERGE on ``key``: a matched row is replaced, a new
    one inserted), new columns merged when ``evolve``; ``properties`` go into that commit."""
    predicate = " AND ".join(f"t.{_quote(name)} = s.{_quote(name)}" for name in key)
    merger = table.merge(
        data, predicate, source_alias="s", target_alias="t", merge_schema=evolve, commit_properties=properties
    )
    merger.when_matched_update_all().when_not_matched_insert_all().execute()


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _error(exc: BaseException, *, where: str, doing: str, secrets: Sequence[str] = ()) -> FaucetError:
    """The FaucetError for a delta-rs, Arrow or OS error raised while ``doing`` something; a secret
    the message would echo is replaced by ``**********``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    store = _store_failure(str(exc))
    if store is not None:
        text = store[1]
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    message = f"{doing} failed: {text}"
    if store is not None:
        return store[0](message, where=where)
    if isinstance(exc, CommitFailedError):
        return CommitConflict(message, where=where)
    if isinstance(exc, SchemaMismatchError):
        return SchemaError(message, where=where)
    if "Invalid data found" in str(exc) or isinstance(exc, pa.ArrowInvalid):
        return DataError(message, where=where)
    if isinstance(exc, OSError):
        return ConfigError(message, where=where)
    return FaucetError(message, where=where)


_S3_AUTH_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
_UNREACHABLE = ("error sending request", "connection refused", "operation timed out", "dns error")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _store_failure(text: str) -> tuple[type[FaucetError], str] | None:
    """An object store's failure in a delta-rs message (``Generic S3 error`` and its chain of causes,
    ending in the store's XML error document): its error class and a one-line summary, or None when
    the message is not one. Unreachable endpoints are ConnectionFailed (retryable); credentials the
    store refuses, AuthError; a missing bucket, ConfigError."""
    if not text.startswith("Generic S3 error"):
        return None
    lines = [_ANSI.sub("", line).strip(" ↳") for line in text.splitlines()]
    code = re.search(r"<Code>([^<]*)</Code>", text)
    detail = re.search(r"<Message>([^<]*)</Message>", text)
    requests = [line for line in lines if line.startswith("Error performing")]  # the last names the URL
    request = requests[-1] if requests else lines[0]
    summary = request.split(" in ", 1)[0]  # "Error performing GET <url>", without timings and retries
    if code is not None:
        summary += f": {code.group(1)}" + (f" ({detail.group(1)})" if detail is not None else "")
        if code.group(1) in _S3_AUTH_CODES:
            return AuthError, f"the store refused the credentials: {summary}"
        if code.group(1) == "NoSuchBucket":
            return ConfigError, summary
        return FaucetError, summary
    if any(marker in text.lower() for marker in _UNREACHABLE):
        return ConnectionFailed, f"the S3 endpoint does not answer: {summary}"
    return FaucetError, " ".join(line for line in lines if line)


__all__ = ["DeltaSink"]
