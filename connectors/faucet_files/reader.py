"""Reading one matched file: pyarrow's streaming CSV, JSON Lines and Parquet readers, the checks
pyarrow does not make itself (text encoding, an unclosed quote, UTF-8 in JSON, a leading ``null``),
the configured column selection and types, and the pages cut from the batches.

Everything here blocks; the source runs it in a worker thread.
"""

import os
from collections.abc import Generator, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from faucet_dagster.protocol import ConfigError, DataError, PageBuilder, SchemaError
from faucet_files.bookmark import FileEntry
from faucet_files.config import FilesSourceConfig

_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4")


class FileReader:
    """Reads the pages of one file with the configured format options, columns and types."""

    def __init__(self, config: FilesSourceConfig) -> None:
        self.config = config
        self._types = config.arrow_types()

    def file_pages(
        self, entry: FileEntry, start_row: int, batch_size: int, *, first_block_alone: bool = False
    ) -> Generator[tuple[pa.RecordBatch, bool], None, None]:
        """Pages of one file after ``start_row``, each with whether it is the file's last page.

        A full page is held until a row after it is read (then it is not the last) or the file ends
        (then it is): the first page goes out one block after its last row, not a page later.
        ``batch_size == 0``: one page. With ``first_block_alone`` (a sync's first page) the first page
        is the first block's rows when they are fewer than a page: the destination starts writing it
        while the rest is parsed, instead of waiting for a whole page.
        """
        previous: pa.RecordBatch | None = None
        builder = PageBuilder(batch_size)
        for batch in self.file_batches(entry, start_row):
            if first_block_alone and 0 < batch.num_rows < batch_size:
                first_block_alone = False
                previous = batch
                continue
            first_block_alone = False
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

    def file_batches(self, entry: FileEntry, start_row: int) -> Iterator[pa.RecordBatch]:
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
        delimiter = "\t" if file_suffix(entry.path) == ".tsv" and csv.delimiter == "," else csv.delimiter
        return pa_csv.open_csv(
            stream,
            read_options=pa_csv.ReadOptions(
                # One thread parses faster than a destination writes (200,000 rows of the bench's file
                # in 37-40 ms either way), and its first block comes sooner (7-9 ms against 12-25 ms with
                # the pool, whose read-ahead of later blocks competes with it for the cores).
                use_threads=False,
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


def combine_files(batches: list[pa.RecordBatch], where: str) -> pa.RecordBatch:
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


def file_suffix(path: str) -> str:
    """The extension of ``path`` after stripping a compression suffix (``.csv`` for ``a.csv.gz``)."""
    name = path.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    return os.path.splitext(name)[1]
