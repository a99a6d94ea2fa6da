"""Reading one matched file: pyarrow's streaming CSV and Parquet readers, JSON Lines through the
protocol's :class:`~faucet_dagster.protocol.json_rows.JsonRows` (the decoder of the Kafka and NATS
sources, so a JSON value lands in a column by the same rule whatever its source), the checks pyarrow
does not make itself (text encoding, an unclosed quote), the configured column selection and types
(values of another type conformed by the type lattice's rule), and the pages cut from the batches.

Everything here blocks; the source runs it in a worker thread.
"""

import os
from collections.abc import Generator, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from faucet_dagster.protocol import (
    MISSING_COLUMN,
    ConfigError,
    DataError,
    PageBuilder,
    SchemaError,
    conform_batch,
    conform_rows,
    infer_schema,
)
from faucet_dagster.protocol.json_rows import JsonRows
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
                if seen + rows <= start_row:
                    seen += rows
                    continue
                if seen < start_row:
                    batch = batch.slice(start_row - seen)
                seen += rows
                yield self._shape(batch, entry, seen - rows)
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
        if entry.format == "jsonl":
            yield from self._json_lines(entry)
            return
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

    def _json_lines(self, entry: FileEntry) -> Iterator[pa.RecordBatch]:
        """The rows of a JSON Lines file, one batch per block of whole lines. Each non-blank line is a
        payload of :class:`JsonRows` (a JSON object, or a DataError naming the file and the line);
        its columns are typed by ``column_types``, the others by the first block's values (the type
        lattice's inference), and a value that does not land in its column is a DataError naming the
        file and the line."""
        declared = pa.schema(list(self._types.items())) if self._types else None
        schema: pa.Schema | None = None
        lines_before = 0
        with pa.input_stream(entry.path, compression="detect") as stream:
            tail = b""
            while True:
                chunk = stream.read(self.config.block_size)
                data = tail + chunk
                cut = data.rfind(b"\n") if chunk else len(data)
                if cut < 0:
                    tail = data
                    continue
                block, tail = data[:cut], data[cut + 1 :]
                lines = block.split(b"\n") if block or chunk else []
                numbers = [lines_before + index + 1 for index, line in enumerate(lines) if line.strip()]
                payloads = [line for line in lines if line.strip()]
                lines_before += len(lines)
                if payloads:
                    batch, schema = self._objects(payloads, numbers, schema, declared, entry)
                    yield batch
                if not chunk:
                    return

    def _objects(
        self,
        payloads: list[bytes],
        numbers: list[int],
        schema: pa.Schema | None,
        declared: pa.Schema | None,
        entry: FileEntry,
    ) -> tuple[pa.RecordBatch, pa.Schema]:
        """Lines decoded as JSON objects, typed by ``schema`` (the first block's, inferred now when
        None, the declared ``column_types`` taking precedence), conformed by the lattice's rule."""
        rows: list[Any] = []
        for run in JsonRows(None, noun="line").decode(payloads):
            if run.rows is None:
                raise _line_error(entry, numbers[run.start], run.reason)
            rows.extend(run.rows)
        if schema is None:
            inferred = infer_schema(rows)
            if inferred is None:
                raise _line_error(entry, numbers[0], "no column type can be inferred from its values")
            kinds = dict(zip(inferred.names, inferred.types, strict=True))
            kinds.update(self._types)
            names = list(dict.fromkeys([*inferred.names, *(declared.names if declared is not None else [])]))
            schema = pa.schema([pa.field(name, kinds[name]) for name in names])
        conformed = conform_rows(rows, schema)
        if conformed.bad:
            index = min(conformed.bad)
            raise _line_error(entry, numbers[index], conformed.bad[index])
        batch = conformed.batch
        if conformed.missing:
            lacking: dict[int, list[str]] = {}
            for name, indices in conformed.missing.items():
                for index in indices:
                    lacking.setdefault(index, []).append(name)
            column = pa.array([lacking.get(index) for index in range(len(rows))], pa.list_(pa.string()))
            batch = batch.append_column(MISSING_COLUMN, column)
        return batch, schema

    def _open_text(self, entry: FileEntry, stream: Any) -> Any:
        """A pyarrow streaming CSV reader over an open input stream."""
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

    def _shape(self, batch: pa.RecordBatch, entry: FileEntry, before: int) -> pa.RecordBatch:
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
        fields = [item for item in batch.schema if item.name != MISSING_COLUMN]
        if not any(item.name in self._types and item.type != self._types[item.name] for item in fields):
            return batch
        target = pa.schema([pa.field(item.name, self._types.get(item.name, item.type)) for item in fields])
        conformed = conform_batch(batch, target)
        if conformed.bad:
            index = min(conformed.bad)
            row = before + index + 1
            raise DataError(
                f"{entry.path!r} row {row}: a value does not land in its column: {conformed.bad[index]}",
                where=f"{entry.path} @ row {row}",
                details={"file": entry.path, "row": str(row)},
            )
        return conformed.batch


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


def _line_error(entry: FileEntry, line: int, reason: str) -> DataError:
    return DataError(
        f"{entry.path!r} line {line}: {reason}",
        where=f"{entry.path} @ line {line}",
        details={"file": entry.path, "line": str(line)},
    )
