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

Determinism. Re-reading from a bookmark yields the same rows in the same order as long as the files
read are not modified and files that appear later sort after them (date-stamped names do);
``capabilities().deterministic`` is True on that documented assumption.

Errors. A path that does not exist or a glob that matches no file raises ConfigError naming it; a file
that cannot be parsed (corrupt Parquet, malformed CSV or JSON, a value that does not fit its column
type) raises DataError naming the file and the row it was reading near.
"""

import asyncio
import glob
import inspect
import os
import re
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
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
    PageBuilder,
    Records,
    Replay,
    SchemaError,
    Source,
    SourceCapabilities,
)
from faucet_files.config import FileFormat, FilesSourceConfig

BOOKMARK_VERSION = 1

_GLOB_MAGIC = re.compile(r"[*?[]")
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4")
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


@dataclass(frozen=True)
class FileEntry:
    """One matched file, with the size and modification time that identify its content."""

    path: str
    size: int
    mtime_ns: int
    format: FileFormat

    def same_content(self, identity: Sequence[int]) -> bool:
        return [self.size, self.mtime_ns] == list(identity)


@dataclass(frozen=True)
class FilesBookmark:
    """The parsed bookmark (see the module docstring for its JSON shape)."""

    completed: Mapping[str, tuple[int, int]]
    current: tuple[str, int, int, int] | None = None
    """``(path, size, mtime_ns, row)`` of the file being read, or None between files."""

    def to_json(self) -> JsonValue:
        current: JsonValue = None
        if self.current is not None:
            path, size, mtime_ns, row = self.current
            current = {"path": path, "size": size, "mtime_ns": mtime_ns, "row": row}
        return {
            "version": BOOKMARK_VERSION,
            "completed": {path: [size, mtime] for path, (size, mtime) in sorted(self.completed.items())},
            "current": current,
        }

    @classmethod
    def from_json(cls, raw: JsonValue, where: str) -> "FilesBookmark":
        """Parse a bookmark this source emitted; anything else raises ConfigError."""
        try:
            if not isinstance(raw, dict) or raw.get("version") != BOOKMARK_VERSION:
                raise ValueError(f"expected a version {BOOKMARK_VERSION} files bookmark")
            completed_raw = raw["completed"]
            if not isinstance(completed_raw, dict):
                raise ValueError("'completed' must be an object")
            completed = {path: _identity(value) for path, value in completed_raw.items()}
            current_raw = raw.get("current")
            current = None
            if current_raw is not None:
                if not isinstance(current_raw, dict):
                    raise ValueError("'current' must be an object")
                path = current_raw["path"]
                if not isinstance(path, str):
                    raise ValueError("'current.path' must be a string")
                size, mtime = _identity([current_raw["size"], current_raw["mtime_ns"]])
                row = current_raw["row"]
                if not isinstance(row, int) or isinstance(row, bool) or row < 0:
                    raise ValueError("'current.row' must be a non-negative integer")
                current = (path, size, mtime, row)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a bookmark of the files source: {exc}", where=where) from None
        return cls(completed, current)


def _identity(value: JsonValue) -> tuple[int, int]:
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(item, int) and not isinstance(item, bool) for item in value)
    ):
        size, mtime = value
        assert isinstance(size, int) and isinstance(mtime, int)
        return size, mtime
    raise ValueError(f"a file identity is [size, mtime_ns], got {value!r}")


class FilesSource(Source):
    """A bounded source over local CSV, JSON Lines and Parquet files (see the module docstring)."""

    connector_name = "files"
    config_model = FilesSourceConfig

    def __init__(self, config: FilesSourceConfig) -> None:
        self.config = config
        self._types = config.arrow_types()
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
            deterministic=True,
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

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.connector_name)
        files = await asyncio.to_thread(self._files_to_read)
        completed = dict(self._start.completed)
        whole: list[pa.RecordBatch] = []
        for entry, start_row in files:
            row = start_row
            reader = self._file_pages(entry, start_row, batch_size)
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
            yield Page(_combine_files(whole, self.dataset_uri()), self._reached.to_json())

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
        found = _FORMAT_BY_SUFFIX.get(_suffix(path))
        if found is None:
            raise ConfigError(
                f"cannot tell the format of {path!r} from its extension; set format to csv, jsonl or parquet",
                where=path,
            )
        return found

    def _file_pages(
        self, entry: FileEntry, start_row: int, batch_size: int
    ) -> Generator[tuple[pa.RecordBatch, bool], None, None]:
        """Pages of one file after ``start_row``, each with whether it is the file's last page.

        A full page is held until a row after it is read (then it is not the last) or the file ends
        (then it is): the first page goes out one block after its last row, not a page later.
        ``batch_size == 0``: one page.
        """
        previous: pa.RecordBatch | None = None
        builder = PageBuilder(batch_size)
        for batch in self._file_batches(entry, start_row):
            for page in builder.add(batch):
                if previous is not None:
                    yield previous, False
                previous = page
            if previous is not None and builder.pending_rows:
                yield previous, False
                previous = None
        last = builder.finish()
        if last is not None:
            if previous is not None:
                yield previous, False
            previous = last
        if previous is not None:
            yield previous, True

    def _file_batches(self, entry: FileEntry, start_row: int) -> Iterator[pa.RecordBatch]:
        """The record batches of one file after its first ``start_row`` rows, converted and selected."""
        seen = 0
        last: pa.RecordBatch | None = None
        try:
            for batch in self._raw_batches(entry):
                rows = batch.num_rows
                if entry.format == "csv":
                    self._check_text(batch, entry, seen)
                    last = batch if rows else last
                elif entry.format == "jsonl":
                    _check_utf8(batch)
                if seen + rows <= start_row:
                    seen += rows
                    continue
                if seen < start_row:
                    batch = batch.slice(start_row - seen)
                seen += rows
                yield self._shape(batch, entry)
            if last is not None:
                # Checked before the file's last page is handed over (pages are read one ahead).
                self._check_closed_quote(last, entry, seen)
        except FileNotFoundError as exc:
            raise ConfigError(f"file not found: {entry.path!r}", where=entry.path) from exc
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
            raise DataError(
                f"cannot read {entry.format} file {entry.path!r} after row {seen}: {exc}",
                where=f"{entry.path} @ row {seen}",
                details={"file": entry.path, "row": str(seen)},
            ) from exc

    def _check_text(self, batch: pa.RecordBatch, entry: FileEntry, before: int) -> None:
        """DataError naming the first row of a CSV column whose bytes are not text in the configured
        encoding. pyarrow would silently read the whole column as binary instead (a latin-1 byte in a
        file read as UTF-8), unless the column is declared binary."""
        for index, field in enumerate(batch.schema):
            if not pa.types.is_binary(field.type) or field.name in self._types:
                continue
            for row, value in enumerate(batch.column(index).to_pylist()):
                try:
                    if value is not None:
                        value.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"{entry.path!r} row {before + row + 1}, column {field.name!r}: not "
                        f"{self.config.csv.encoding} text ({exc.reason} at byte {exc.start}); set "
                        "csv.encoding to the file's encoding",
                        where=f"{entry.path} @ row {before + row + 1}",
                        details={"file": entry.path, "row": str(before + row + 1)},
                    ) from None

    def _check_closed_quote(self, last: pa.RecordBatch, entry: FileEntry, rows: int) -> None:
        """DataError when the file's last row opened a quoted value that never closes.

        pyarrow then reads everything up to the end of the file into that one value, swallowing the
        rows after it without an error. Such a value is exactly the file's tail after the opening
        quote (its newlines included); a closed quoted value is followed by its closing quote (and the
        row's end), an unquoted one has no quote before it."""
        value = last.column(last.num_columns - 1)[last.num_rows - 1].as_py()
        if not isinstance(value, str | bytes) or not value:
            return
        quote = self.config.csv.quote_char
        text = value.replace(quote, quote * 2) if isinstance(value, str) else value
        encoded = text.encode(self.config.csv.encoding) if isinstance(text, str) else text
        mark = quote.encode(self.config.csv.encoding)
        tail = _tail(entry.path, len(encoded) + 4)
        opened = mark + encoded
        # The value may itself end like a closing quote and row end (``"\r\n"``): closed is closed.
        closed = any(tail.endswith(opened + mark + end) for end in (b"", b"\n", b"\r\n", b"\r"))
        if tail.endswith(opened) and not closed:
            raise DataError(
                f"{entry.path!r} row {rows}: a quoted value opens and never closes, so every row after "
                "it would be read into that one value; close the quote",
                where=f"{entry.path} @ row {rows}",
                details={"file": entry.path, "row": str(rows)},
            )

    def _raw_batches(self, entry: FileEntry) -> Iterator[pa.RecordBatch]:
        if entry.format == "parquet":
            parquet = pq.ParquetFile(entry.path)
            for batch in parquet.iter_batches(batch_size=64 * 1024, use_threads=True):
                yield batch
            return
        with pa.input_stream(entry.path, compression="detect") as stream:
            reader = self._open_text(entry, stream)
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    return
                yield batch

    def _open_text(self, entry: FileEntry, stream: Any) -> Any:
        """A pyarrow streaming reader (CSV or JSON Lines) over an open input stream."""
        if entry.format == "jsonl":
            schema = pa.schema(list(self._types.items())) if self._types else None
            _check_first_value(entry.path)
            return pa_json.open_json(
                stream,
                read_options=pa_json.ReadOptions(block_size=self.config.block_size),
                parse_options=pa_json.ParseOptions(explicit_schema=schema),
            )
        csv = self.config.csv
        # A .tsv file is tab-separated unless a delimiter was configured.
        delimiter = "\t" if _suffix(entry.path) == ".tsv" and csv.delimiter == "," else csv.delimiter
        return pa_csv.open_csv(
            stream,
            read_options=pa_csv.ReadOptions(
                block_size=self.config.block_size,
                encoding=csv.encoding,
                column_names=None if csv.has_header else csv.column_names,
                autogenerate_column_names=not csv.has_header and csv.column_names is None,
            ),
            parse_options=pa_csv.ParseOptions(
                delimiter=delimiter, quote_char=csv.quote_char, newlines_in_values=True
            ),
            convert_options=pa_csv.ConvertOptions(
                column_types=self._types,
                null_values=csv.null_values,
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
            ),
        )

    def _shape(self, batch: pa.RecordBatch, entry: FileEntry) -> pa.RecordBatch:
        """Select the configured columns and cast to the configured types."""
        if self.config.columns is not None:
            missing = [name for name in self.config.columns if name not in batch.schema.names]
            if missing:
                raise SchemaError(
                    f"{entry.path!r} has no column(s) {', '.join(missing)} "
                    f"(it has {', '.join(batch.schema.names)})",
                    where=entry.path,
                )
            batch = batch.select(self.config.columns)
        casts = {
            name: kind
            for name, kind in self._types.items()
            if name in batch.schema.names and batch.schema.field(name).type != kind
        }
        if casts:
            schema = pa.schema([pa.field(f.name, casts.get(f.name, f.type)) for f in batch.schema])
            batch = batch.cast(schema)
        return batch

    def _discover(self) -> list[DiscoveredDataset]:
        datasets = []
        for entry in self._list_files():
            try:
                if entry.format == "parquet":
                    schema = pq.read_schema(entry.path)
                    if self.config.columns is not None:
                        schema = pa.schema([schema.field(name) for name in self.config.columns])
                else:
                    first = next(self._file_batches(entry, 0), None)
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


def _combine_files(batches: list[pa.RecordBatch], where: str) -> pa.RecordBatch:
    """One batch of every file's rows (``batch_size == 0``), promoting compatible schemas."""
    if len(batches) == 1:
        return batches[0]
    try:
        table = pa.concat_tables(
            [pa.Table.from_batches([batch]) for batch in batches], promote_options="permissive"
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SchemaError(
            f"the files have schemas that do not combine into one page: {exc}", where=where
        ) from exc
    return table.combine_chunks().to_batches()[0]


_VALIDATED_DEPTH = 64
"""Columns nested deeper are not checked: Arrow's full validation recurses (and crashes near 10,000)."""


def _check_utf8(batch: pa.RecordBatch) -> None:
    """ArrowInvalid (a DataError naming the file and row, for the caller) when a string in ``batch``
    is not UTF-8: Arrow's JSON reader copies string bytes without checking them, so they would reach
    the sink."""
    for column in batch.columns:
        if _has_text(column.type, _VALIDATED_DEPTH):
            column.validate(full=True)


def _has_text(kind: pa.DataType, depth: int) -> bool:
    """True when ``kind`` holds strings at most ``depth`` levels down."""
    while depth > 0:
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            return True
        if pa.types.is_struct(kind):
            return any(_has_text(kind.field(i).type, depth - 1) for i in range(kind.num_fields))
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            return False
        kind, depth = kind.value_type, depth - 1
    return False


def _check_first_value(path: str) -> None:
    """DataError when the first value of a JSON Lines file starts with ``null`` (``null``, ``null,``,
    ``nullx``...): pyarrow's JSON reader crashes the process on one (pyarrow 26). (A later bare
    ``null`` line reads as an empty object.)"""
    text = b""
    with pa.input_stream(path, compression="detect") as stream:
        while True:
            chunk = stream.read(1 << 16)
            text += chunk
            start = len(text) - len(text.lstrip(_JSON_SPACE))
            if chunk and len(text) - start < 4:
                # Only whitespace so far (or too little to tell): read on, keeping its newlines.
                text = b"\n" * text.count(b"\n", 0, start) + text[start:]
                continue
            break
    if text[start : start + 4] == b"null":
        line = text.count(b"\n", 0, start) + 1
        raise DataError(
            f"{path!r} line {line} starts with null: not a JSON object",
            where=f"{path} @ line {line}",
            details={"file": path, "line": str(line)},
        )


_JSON_SPACE = b" \t\r\n"


def _tail(path: str, size: int) -> bytes:
    """The last ``size`` bytes of ``path``'s content (decompressed when it is compressed)."""
    if not path.lower().endswith(_COMPRESSION_SUFFIXES):
        with open(path, "rb") as raw:
            raw.seek(max(0, os.fstat(raw.fileno()).st_size - size))
            return raw.read()
    tail = b""
    with pa.input_stream(path, compression="detect") as stream:
        while chunk := stream.read(1 << 20):
            tail = (tail + chunk)[-size:]
    return tail


def _suffix(path: str) -> str:
    """The extension of ``path`` after stripping a compression suffix (``.csv`` for ``a.csv.gz``)."""
    name = path.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    return os.path.splitext(name)[1]
