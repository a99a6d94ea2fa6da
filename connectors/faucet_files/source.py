"""The files source: CSV, JSON Lines and Parquet files read through pyarrow, page by page.

Order. The files matched by every configured path or glob are read one after the other in sorted
path order, each from its first row to its last; a page never spans two files. That order is total
and repeatable: ``capabilities().ordering`` is STRICT_GLOBAL, or PARTITION with ``shard_by_file``
(each file is then its own shard and a run reads one of them).

Memory. Files are streamed: CSV through ``pyarrow.csv.open_csv``, JSON Lines through
``pyarrow.json.open_json`` (both one block of ``block_size`` bytes at a time) and Parquet through
``ParquetFile.iter_batches`` (one row group at a time). With ``batch_size > 0`` a page holds at most
``batch_size`` rows and at most two pages plus one block are held at once (the next page is read ahead
to know whether the current one ends its file). ``batch_size == 0`` is one page holding everything.

Bookmark (attached to every page; it means "everything up to here is delivered")::

    {"version": 1,
     "completed": {"<path>": [<size>, <mtime_ns>], ...},
     "current": {"path": "<path>", "size": <size>, "mtime_ns": <mtime_ns>, "row": <rows read>} | null}

``completed`` holds the files read to their end, with the size and modification time they had then;
``current`` the file being read and how many of its rows were delivered. Resuming skips a completed
file while its size and mtime are unchanged, and continues the current file after ``row`` rows (it
re-parses and discards them, so type inference sees the same first block as before). A file whose
size or mtime changed since it was read, completed or not, is read again from its first row: its
content changed, so the run delivers it again (at-least-once for that file) rather than skipping
rows that may be new. Paths are stored as matched (as written in the config), so the same config
resumes from any working directory only when its paths are absolute.

Resumes by identity. The bookmark names what was read (each file's path, size and modification time),
never a count of rows: a file that appears before, between or after the files already read is read
once, by the next run. ``capabilities().deterministic`` is False (re-reading from a bookmark after a
file that sorts earlier appeared yields other rows first), and ``page_bookmarks`` True: with a sink
that keeps each page's bookmark with its commit token (the PostgreSQL and SQL sinks), a rerun after a
crash resumes from the bookmark the sink holds, so the atomic watermark holds (effectively-once);
with a sink that counts rows only, the pair is at-least-once.

Errors. A path that does not exist or a glob that matches no file raises ConfigError naming it; a file
that cannot be parsed (corrupt Parquet, malformed CSV or JSON, a value that does not fit its column
type) raises DataError naming the file and the row it was reading near.
"""

import asyncio
import glob
import inspect
import os
import re
from collections.abc import AsyncIterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from faucet_dagster.protocol import (
    ConfigError,
    DataError,
    DiscoveredDataset,
    Emits,
    FetchContext,
    JsonValue,
    Operation,
    Ordering,
    Page,
    Records,
    Replay,
    SchemaError,
    Source,
    SourceCapabilities,
    replay_to_bookmark,
)
from faucet_files.bookmark import FileEntry, FilesBookmark
from faucet_files.config import FileFormat, FilesSourceConfig
from faucet_files.reader import FileReader, combine_files, file_suffix

_GLOB_MAGIC = re.compile(r"[*?[]")
_FORMAT_BY_SUFFIX: Mapping[str, FileFormat] = {
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}


class FilesSource(Source):
    """A bounded source over local CSV, JSON Lines and Parquet files (see the module docstring)."""

    connector_name = "files"
    config_model = FilesSourceConfig

    def __init__(self, config: FilesSourceConfig) -> None:
        self.config = config
        self._reader = FileReader(config)
        self._start = FilesBookmark({})
        self._reached = self._start
        self._shard: str | None = None

    # -- identity and capabilities ----------------------------------------------------------------

    def dataset_uri(self) -> str:
        paths = ",".join(os.path.abspath(os.path.expanduser(path)) for path in self.config.paths)
        return f"file://{paths}"

    def state_key(self) -> str:
        key = "files:" + ",".join(self.config.paths)
        return key if self._shard is None else f"{key}#{self._shard}"

    def capabilities(self) -> SourceCapabilities:
        return SourceCapabilities(
            emits=Emits.ROWS,
            operations=frozenset({Operation.INSERT}),
            ordering=Ordering.PARTITION if self.config.shard_by_file else Ordering.STRICT_GLOBAL,
            replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
            bounded=True,
            continuous=False,
            # Not deterministic: a file that sorts before the files read changes what a re-read
            # yields first. Every page's bookmark names what was read (by identity), which is what
            # a sink keeping it with its watermark resumes from.
            deterministic=False,
            page_bookmarks=True,
            discover=True,
            shardable=self.config.shard_by_file,
            columns=None if self.config.columns is None else tuple(self.config.columns),
        )

    # -- lifecycle ----------------------------------------------------------------------------------

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        self._start = self._reached = FilesBookmark.from_json(bookmark, where=self.dataset_uri())

    async def enumerate_shards(self) -> Sequence[str]:
        if not self.config.shard_by_file:
            return await super().enumerate_shards()
        return [entry.path for entry in await asyncio.to_thread(self._list_files)]

    def apply_shard(self, shard: str) -> None:
        if not self.config.shard_by_file:
            super().apply_shard(shard)
        self._shard = shard

    async def check(self) -> None:
        await asyncio.to_thread(self._matched_files)

    async def discover(self) -> Sequence[DiscoveredDataset]:
        return await asyncio.to_thread(self._discover)

    # -- reading ------------------------------------------------------------------------------------

    async def fetch(self, ctx: FetchContext) -> Records:
        pages = [page.records async for page in self.stream_pages(ctx, 0)]
        if not pages:
            return []
        assert len(pages) == 1 and isinstance(pages[0], pa.RecordBatch)
        return pages[0]

    def bookmark(self) -> JsonValue | None:
        """The bookmark after the last page handed out (the start bookmark before any)."""
        return self._reached.to_json()

    async def replay_pages(
        self, ctx: FetchContext, start: JsonValue | None, end: JsonValue | None, batch_size: int
    ) -> AsyncIterator[Page]:
        """Re-read one run's files, ``start`` to ``end``, for ``faucet verify``: read again with the run's
        ``batch_size``, its pages come back with the same bookmarks while no file it read changed
        (:func:`~faucet_dagster.protocol.bounded.replay_to_bookmark`)."""
        async for page in replay_to_bookmark(self, ctx, start, end, batch_size):
            yield page

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.connector_name)
        files = await asyncio.to_thread(self._files_to_read)
        completed = dict(self._start.completed)
        whole: list[pa.RecordBatch] = []
        for number, (entry, start_row) in enumerate(files):
            row = start_row
            reader = self._reader.file_pages(entry, start_row, batch_size, first_block_alone=number == 0)
            try:
                while (item := await asyncio.to_thread(next, reader, None)) is not None:
                    page, last = item
                    row += page.num_rows
                    if last:
                        completed[entry.path] = (entry.size, entry.mtime_ns)
                        bookmark = FilesBookmark(dict(completed))
                    else:
                        bookmark = FilesBookmark(
                            dict(completed), (entry.path, entry.size, entry.mtime_ns, row)
                        )
                    self._reached = bookmark
                    if batch_size == 0:
                        whole.append(page)
                    else:
                        yield Page(page, bookmark.to_json())
            finally:
                # A cancelled read may leave the generator running in its worker thread; it ends
                # there on its own, and closing it then would raise.
                if inspect.getgeneratorstate(reader) != inspect.GEN_RUNNING:
                    reader.close()
            # An empty file has no page: it is completed for every later bookmark.
            completed[entry.path] = (entry.size, entry.mtime_ns)
        if batch_size == 0 and whole:
            yield Page(combine_files(whole, self.dataset_uri()), self._reached.to_json())

    # -- internals (blocking; run in a worker thread) ---------------------------------------------

    def _matched_files(self) -> list[FileEntry]:
        """Every file matched by the configured paths, sorted by path, without duplicates."""
        found: dict[str, FileEntry] = {}
        for pattern in self.config.paths:
            expanded = os.path.expanduser(pattern)
            if _GLOB_MAGIC.search(expanded):
                matches = sorted(path for path in glob.glob(expanded, recursive=True) if os.path.isfile(path))
                if not matches:
                    raise ConfigError(f"no file matches the pattern {pattern!r}", where=pattern)
            elif os.path.isfile(expanded):
                matches = [expanded]
            elif os.path.exists(expanded):
                raise ConfigError(f"{pattern!r} is not a file", where=pattern)
            else:
                raise ConfigError(f"file not found: {pattern!r}", where=pattern)
            for path in matches:
                if path not in found:
                    found[path] = self._entry(path)
        return [found[path] for path in sorted(found)]

    def _list_files(self) -> list[FileEntry]:
        """The matched files, restricted to the applied shard."""
        files = self._matched_files()
        if self._shard is None:
            return files
        chosen = [entry for entry in files if entry.path == self._shard]
        if not chosen:
            raise ConfigError(
                f"shard {self._shard!r} is not one of the matched files", where=self.dataset_uri()
            )
        return chosen

    def _files_to_read(self) -> list[tuple[FileEntry, int]]:
        """The files still to read and the row each starts at, from the start bookmark."""
        plan = []
        for entry in self._list_files():
            identity = self._start.completed.get(entry.path)
            if identity is not None and entry.same_content(identity):
                continue
            start_row = 0
            current = self._start.current
            if current is not None and current[0] == entry.path and entry.same_content(current[1:3]):
                start_row = current[3]
            plan.append((entry, start_row))
        return plan

    def _entry(self, path: str) -> FileEntry:
        try:
            stat = os.stat(path)
        except OSError as exc:
            raise ConfigError(f"cannot read {path!r}: {exc.strerror}", where=path) from exc
        return FileEntry(path, stat.st_size, stat.st_mtime_ns, self._format_of(path))

    def _format_of(self, path: str) -> FileFormat:
        if self.config.format is not None:
            return self.config.format
        found = _FORMAT_BY_SUFFIX.get(file_suffix(path))
        if found is None:
            raise ConfigError(
                f"cannot tell the format of {path!r} from its extension; set format to csv, jsonl or parquet",
                where=path,
            )
        return found

    def _discover(self) -> list[DiscoveredDataset]:
        datasets = []
        for entry in self._list_files():
            try:
                if entry.format == "parquet":
                    schema = pq.read_schema(entry.path)
                    if self.config.columns is not None:
                        schema = pa.schema([schema.field(name) for name in self.config.columns])
                else:
                    first = next(self._reader.file_batches(entry, 0), None)
                    schema = first.schema if first is not None else None
            except KeyError as exc:
                raise SchemaError(f"{entry.path!r} has no column {exc}", where=entry.path) from None
            except (pa.ArrowException, OSError) as exc:
                raise DataError(f"cannot read the schema of {entry.path!r}: {exc}", where=entry.path) from exc
            datasets.append(
                DiscoveredDataset(
                    name=entry.path,
                    schema=schema,
                    details={"format": entry.format, "size": str(entry.size)},
                )
            )
        return datasets
