"""Broken bounded sources (wrapping the files source) and sinks (wrapping the SQL sink)."""

import asyncio
import ctypes
import glob
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import pyarrow as pa
from faucet_files import FilesSourceConfig
from faucet_files.source import FilesSource
from faucet_postgres.source import PostgresSource
from faucet_sql.sink import SqlSink
from pydantic import model_validator

from faucet_dagster.protocol import (
    AddColumn,
    CommitToken,
    ConfigError,
    DataError,
    DiscoveredDataset,
    FetchContext,
    JsonValue,
    Page,
    WritePolicy,
)

# -- bounded sources (files) --------------------------------------------------------------------------


class InvalidSchemaSource(FilesSource):
    """Check 1: its config schema is not a JSON Schema (an unknown type name)."""

    @classmethod
    def config_schema(cls) -> dict[str, Any]:
        return {"type": "objekt", "properties": {"paths": {"type": "array"}}}


class RenamedFieldSchemaSource(FilesSource):
    """Check 1: a valid JSON Schema that still names a field the config no longer has (``path``,
    renamed ``paths`` in the model), so a config the connector accepts does not validate."""

    @classmethod
    def config_schema(cls) -> dict[str, Any]:
        schema = super().config_schema()
        properties = dict(schema.get("properties", {}))
        properties["path"] = properties.pop("paths", {"type": "array"})
        return {**schema, "properties": properties, "required": ["path"]}


class OversizedPagesSource(FilesSource):
    """Check 2: pages twice as large as ``batch_size``."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        async for page in super().stream_pages(ctx, batch_size * 2):
            yield page


class BufferingSource(FilesSource):
    """Check 2: reads the whole dataset into memory, then hands it out in pages of ``batch_size``."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        whole = [page async for page in super().stream_pages(ctx, 0)]
        for page in whole:
            records = page.records
            assert isinstance(records, pa.RecordBatch)
            step = batch_size or records.num_rows
            for start in range(0, records.num_rows, step):
                yield Page(records.slice(start, step), page.bookmark)


class NativeBufferingSource(FilesSource):
    """Check 2: copies every matched file into native memory (malloc'd, as a client library's result
    buffer would be: neither the Python heap nor the Arrow pool) before paging through them."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        names = sorted(name for pattern in self.config.paths for name in glob.glob(pattern))
        data = b"".join(open(name, "rb").read() for name in names)  # noqa: SIM115 - a test double
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        buffer = libc.malloc(max(1, len(data)))
        ctypes.memmove(buffer, data, len(data))
        del data
        try:
            async for page in super().stream_pages(ctx, batch_size):
                yield page
        finally:
            libc.free(ctypes.c_void_p(buffer))


_HOLD_FILES = """
import sys
held = [open(name, "rb").read() for name in sys.argv[1:]]
print(sum(map(len, held)), flush=True)
sys.stdin.read()
"""


class ChildBufferingSource(FilesSource):
    """Check 2: its "driver" runs in a helper process that loads every matched file into its own
    memory before the pages are handed out (a client-side cursor in a driver's process): neither
    this process's heaps nor its C allocator see it, the helper's resident memory does."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        import sys

        names = sorted(name for pattern in self.config.paths for name in glob.glob(pattern))
        helper = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _HOLD_FILES, *names,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert helper.stdout is not None
            await helper.stdout.readline()  # the helper holds every file now
            async for page in super().stream_pages(ctx, batch_size):
                yield page
        finally:
            helper.kill()
            await helper.wait()


class ForgetfulSource(FilesSource):
    """Check 3: ignores the bookmark it is handed (a resumed run starts from the beginning)."""

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        return None


class LaggingBookmarkSource(FilesSource):
    """Check 3: each page carries the bookmark of the page before it (the bookmark is taken before
    the page is read, not after), so a resumed run reads the last page again."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        previous: JsonValue = None
        async for page in super().stream_pages(ctx, batch_size):
            yield Page(page.records, previous if previous is not None else page.bookmark)
            previous = page.bookmark


class NameOrderFilesSource(FilesSource):
    """File-order resumes: resumes after the last file it completed *by name* (files sort by date,
    the author assumed): on resume, every matched file whose name sorts before the greatest completed
    one counts as completed too, so a file that appears later with such a name is never read."""

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        completed = bookmark.get("completed") if isinstance(bookmark, dict) else None
        if isinstance(bookmark, dict) and isinstance(completed, dict) and completed:
            done = max(completed)
            assumed: dict[str, JsonValue] = dict(completed)
            for pattern in self.config.paths:
                for name in glob.glob(os.path.expanduser(pattern), recursive=True):
                    if name < done and name not in assumed and os.path.isfile(name):
                        stat = os.stat(name)
                        assumed[name] = [stat.st_size, stat.st_mtime_ns]
            bookmark = {**bookmark, "completed": assumed}
        super().apply_start_bookmark(bookmark)


class CursorOnlyResumeSource(PostgresSource):
    """Cursor resumes: resumes after the last *cursor value* read (``WHERE cursor > last``), not
    after the last ``(cursor, key)`` position: rows sharing that cursor value that a page boundary
    left for the next page are skipped."""

    def start_after(self, order: tuple[str, ...]) -> tuple[Any, ...] | None:
        values = super().start_after(order)
        if values is None or not self.order_of(()):  # order_of(()) is (cursor,) when one is configured
            return values
        return (values[0], *(2**62 for _ in values[1:]))


class EmptyDiscoverySource(FilesSource):
    """Check 5: claims ``discover`` but finds nothing."""

    async def discover(self) -> Sequence[DiscoveredDataset]:
        return []


class StrictConfig(FilesSourceConfig):
    """Check 6: a config whose validator indexes the raw data, raising KeyError for a missing key."""

    @model_validator(mode="before")
    @classmethod
    def _paths_first(cls, data: Any) -> Any:
        data["paths"] = list(data["paths"])
        return data


class HangingSource(FilesSource):
    """Check 6: when its files cannot be reached it retries forever instead of failing."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        try:
            async for page in super().stream_pages(ctx, batch_size):
                yield page
        except ConfigError:
            await asyncio.Event().wait()


class LeakySource(FilesSource):
    """Check 6: a malformed record escapes as a ValueError instead of a DataError."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        try:
            async for page in super().stream_pages(ctx, batch_size):
                yield page
        except DataError as exc:
            raise ValueError(exc.message) from None


class RawCheckSource(FilesSource):
    """Check 6: its preflight ``check()`` lets the file system's OSError escape."""

    async def check(self) -> None:
        for pattern in self.config.paths:
            folder = os.path.dirname(pattern)
            await asyncio.to_thread(os.listdir, folder)  # FileNotFoundError when it is missing


class RawShardsSource(FilesSource):
    """Check 6: ``enumerate_shards()`` lists the folder itself and leaks its FileNotFoundError."""

    async def enumerate_shards(self) -> Sequence[str]:
        found: list[str] = []
        for pattern in self.config.paths:
            folder = os.path.dirname(pattern)
            names = sorted(await asyncio.to_thread(os.listdir, folder))
            found.extend(os.path.join(folder, name) for name in names if name.endswith(".csv"))
        return found


class RawCaptureSource(FilesSource):
    """Check 6: declares ``capture_resume_position()`` and leaks an OSError from it."""

    async def capture_resume_position(self) -> JsonValue | None:
        newest = 0.0
        for pattern in self.config.paths:
            folder = os.path.dirname(pattern)
            newest = max(newest, await asyncio.to_thread(os.path.getmtime, folder))
        return {"newest": newest}


class EmptyIsAnErrorSource(FilesSource):
    """Check 6: an empty dataset raises instead of giving an empty result."""

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        rows = 0
        async for page in super().stream_pages(ctx, batch_size):
            rows += page.num_rows
            yield page
        if not rows:
            raise DataError("no rows", where=self.dataset_uri())


# -- bounded sinks (sql) ------------------------------------------------------------------------------


class TokenBlindSink(SqlSink):
    """Check 4: its idempotent write ignores the commit token (a replayed page is written again)."""

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        written = await self.write_batch(records)
        await super().write_batch_idempotent(records.slice(0, 0), token, bookmark)  # the token still moves
        return written


class TwoTransactionSink(SqlSink):
    """Check 4: honours the token, but commits the records, then the token in a second transaction
    (an interruption between the two leaves records a replay writes again)."""

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        stored = await self.last_committed_token()
        if stored is not None and token.sequence <= stored.sequence:
            return 0
        written = await self.write_batch(records)
        await super().write_batch_idempotent(records.slice(0, 0), token, bookmark)
        return written


class OneCallTwoCommitsSink(SqlSink):
    """Two commits inside one synchronous call: its idempotent write is one blocking call run in a
    worker thread (a client library's "write with token" helper: its caller's event loop never waits
    between its statements), committing the rows in one transaction and the token in a second, so
    only a crash between two synchronous calls (not at an await of the caller) splits them."""

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        return await asyncio.to_thread(asyncio.run, self._rows_then_token(records, token, bookmark))

    async def _rows_then_token(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None
    ) -> int:
        stored = await self.last_committed_token()
        if stored is not None and token.sequence <= stored.sequence:
            return 0
        written = await self.write_batch(records)  # the rows, committed
        await super().write_batch_idempotent(records.slice(0, 0), token, bookmark)  # the token, after them
        return written


class ProcessTokenSink(SqlSink):
    """Tokens across processes: keeps the commit token in a process-wide table and writes it to the
    destination only when the sink closes ("state is saved at shutdown"); in one process, and across
    sinks of one process, the token looks durable."""

    tokens: ClassVar[dict[str, tuple[CommitToken, JsonValue | None]]] = {}

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        stored = await self.last_committed_token()
        if stored is not None and token.sequence <= stored.sequence:
            return 0
        written = await self.write_batch(records)
        ProcessTokenSink.tokens[self.config.watermark_scope()] = (token, bookmark)
        self._schema = records.schema
        return written

    async def last_committed_token(self) -> CommitToken | None:
        remembered = ProcessTokenSink.tokens.get(self.config.watermark_scope())
        return remembered[0] if remembered is not None else await super().last_committed_token()

    async def last_committed_bookmark(self) -> tuple[CommitToken, JsonValue | None] | None:
        remembered = ProcessTokenSink.tokens.get(self.config.watermark_scope())
        return remembered if remembered is not None else await super().last_committed_bookmark()

    async def close(self) -> None:
        remembered = ProcessTokenSink.tokens.get(self.config.watermark_scope())
        schema = getattr(self, "_schema", None)
        if remembered is not None and schema is not None:
            token, bookmark = remembered
            await super().write_batch_idempotent(
                pa.RecordBatch.from_pylist([], schema=schema), token, bookmark
            )
        await super().close()


class AppendingUpsertSink(SqlSink):
    """Check 4: configured to upsert by key, it appends (and still says it dedups by key)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.mode = WritePolicy.APPEND

    def dedups_by_key(self) -> bool:
        return bool(self.config.key)


class ModeBlindDedupSink(SqlSink):
    """Check 5: ``dedups_by_key()`` looks at the key only (an append with a key configured claims it)."""

    def dedups_by_key(self) -> bool:
        return bool(self.config.key)


class FirstConfigDedupSink(SqlSink):
    """Check 5: ``dedups_by_key()`` answers what the first sink built said (cached on the class), not
    what this sink's live config says."""

    answer: bool | None = None

    def dedups_by_key(self) -> bool:
        if FirstConfigDedupSink.answer is None:
            FirstConfigDedupSink.answer = super().dedups_by_key()
        return FirstConfigDedupSink.answer


class NoEvolutionSink(SqlSink):
    """Check 5: claims schema evolution but ``evolve_schema`` does nothing."""

    async def evolve_schema(self, changes: Sequence[AddColumn]) -> None:
        return None
