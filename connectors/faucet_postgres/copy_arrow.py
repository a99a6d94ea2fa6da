"""COPY of Arrow record batches into PostgreSQL: binary where the destination types allow, else CSV.

:func:`copy_batch` COPYs one batch inside the connection's current transaction, in binary where every
column has a binary encoder for its destination type (about 1.4x faster on the server than CSV), else
in CSV written by pyarrow's C++ writer. No per-row Python on either path except for bytea and nested
values in CSV. A large batch is encoded in slices, the next one in a worker thread while the current
one is on the wire, so the server's parsing and the client's encoding overlap; the first slice is
small, so the server starts parsing within a fraction of a millisecond of the COPY's start.
"""

import array
import asyncio
import concurrent.futures
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, TypeVar

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
from psycopg import sql

from faucet_dagster.protocol.json_values import json_text
from faucet_postgres.common import PgColumn

T = TypeVar("T")

CopyFormat = Literal["binary", "csv"]

_BINARY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
_BINARY_TRAILER = b"\xff\xff"
_NO_BYTES = pa.scalar(b"", pa.large_binary())
_POSTGRES_EPOCH_US = 946_684_800_000_000
_POSTGRES_EPOCH_DAYS = 10_957
INFINITE = (-(2**63), 2**63 - 1)
"""``-infinity`` and ``infinity`` of a timestamp column in Arrow: the smallest and largest int64 (in
the column's unit), as PostgreSQL stores them; written back as infinities."""
INFINITE_DATES = (-(2**31), 2**31 - 1)
"""``-infinity`` and ``infinity`` of a date column in Arrow (date32): the smallest and largest int32."""


@dataclass(frozen=True)
class CopyPayload:
    """One batch encoded for ``COPY ... FROM STDIN``: its format and its bytes (header included)."""

    format: CopyFormat
    chunks: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(memoryview(chunk)) for chunk in self.chunks)


def encode_copy(batch: pa.RecordBatch, columns: Mapping[str, PgColumn] | None) -> CopyPayload:
    """Encode ``batch`` for COPY into columns of the given destination types.

    Binary when every column has a binary encoder for its destination type (integers, floats and
    booleans into the same or a wider-typed column, text into text/varchar/json/jsonb, bytes into bytea,
    timestamps and dates), else CSV. ``columns=None`` (types unknown) always means CSV. Blocks on CPU
    (pyarrow releases the GIL): run it in a worker thread for large batches.
    """
    rows = _binary_body(batch, columns)
    if rows is None:
        return CopyPayload("csv", (_csv(batch),))
    return CopyPayload("binary", (_BINARY_HEADER, rows, _BINARY_TRAILER))


def _binary_body(batch: pa.RecordBatch, columns: Mapping[str, PgColumn] | None) -> Any | None:
    """The binary COPY tuples of ``batch`` (no header or trailer), or None when a column has no binary
    encoder for its destination type or a value the exact cast refuses: the server then parses text and
    reports the bad rows itself."""
    if columns is None:
        return None
    try:
        fields = [_binary_field(batch.column(i), columns[field.name]) for i, field in enumerate(batch.schema)]
    except (
        KeyError,
        _NoBinary,
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        OverflowError,
    ):
        return None
    return _binary_rows(fields, batch.num_rows)


INLINE_ENCODE_ROWS = 256
"""Batches up to this many rows are encoded for COPY on the event loop (:func:`copy_batch`)."""

COPY_SLICE_ROWS = 8_192
"""A larger batch is encoded in slices of up to this many rows, the next slice in a worker thread while
the current one is sent (:func:`copy_batch`): the server parses the rows sent while the client encodes
the next ones, instead of waiting for the whole batch to be encoded."""

FIRST_SLICE_ROWS = 1_024
"""The first slice of a sliced COPY; each later one is twice the one before, up to ``COPY_SLICE_ROWS``.
Nothing reaches the server until the first slice is encoded (8,192 rows of the bench's CSV rows took
2.2-6.4 ms, once per page), while the client encodes about five times as fast as the server parses:
so the server waits a fraction of a millisecond for the first rows, and after that never for the
next slice."""


def copy_slices(num_rows: int) -> Iterator[tuple[int, int]]:
    """The ``(start, length)`` of each slice of a sliced COPY of ``num_rows`` rows, in order."""
    start, size = 0, FIRST_SLICE_ROWS
    while start < num_rows:
        yield start, min(size, num_rows - start)
        start += size
        size = min(2 * size, COPY_SLICE_ROWS)


_SLICE_ENCODER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="faucet-copy-encode")
"""The one thread that encodes every slice of a sliced COPY in this process. Arrow's memory pool is
mimalloc, which keeps a heap per thread: slices encoded on whichever thread of the default pool was
free left memory held in each thread's heap (peak RSS of a 10M-row CSV sync 266-298 MB, against 214 MB
with one thread and 226-244 MB before slicing)."""


async def copy_batch(
    conn: "psycopg.AsyncConnection[Any]",
    target: "sql.Composable",
    batch: pa.RecordBatch,
    columns: Mapping[str, PgColumn] | None,
) -> int:
    """COPY ``batch`` into ``target`` (a table identifier) inside the connection's current transaction.

    The batch's column names are the destination columns. Encoding runs in worker threads so the event
    loop stays free, except for a batch of at most ``INLINE_ENCODE_ROWS`` rows, encoded on the loop (in
    microseconds: the hand-off to a thread would cost more). A batch of more than ``COPY_SLICE_ROWS``
    rows is encoded slice by slice (:func:`copy_slices`) while the previous slice is sent, in the first
    slice's format; when a later slice cannot be binary (a value the exact cast refuses), the binary rows
    sent are undone (the COPY runs under a savepoint) and the whole batch is copied as CSV, as
    :func:`encode_copy` would have chosen. Returns the number of rows copied; psycopg errors propagate
    unchanged (the caller knows what it was doing: wrap them with :func:`pg_error`).
    """
    if batch.num_rows == 0:
        return 0
    if batch.num_rows <= INLINE_ENCODE_ROWS:
        await _copy(conn, target, batch, encode_copy(batch, columns))
    elif batch.num_rows <= COPY_SLICE_ROWS:
        await _copy(conn, target, batch, await asyncio.to_thread(encode_copy, batch, columns))
    else:
        head = batch.slice(0, FIRST_SLICE_ROWS)
        first = await _encoded(_binary_body, head, columns)
        if first is None:
            # Every slice as CSV (one that could be binary is not), so the COPY has one format.
            await _copy_sliced(conn, target, batch, "csv", await _encoded(_csv, head), _csv)
        else:
            try:
                # A savepoint: a later slice that needs CSV undoes the binary rows already sent.
                async with conn.transaction():
                    await _copy_sliced(
                        conn, target, batch, "binary", first, lambda part: _binary_body(part, columns)
                    )
            except _FormatChanged:
                await _copy(conn, target, batch, await asyncio.to_thread(encode_copy, batch, None))
    return int(batch.num_rows)


def _encoded(encode: Callable[..., T], *args: Any) -> "asyncio.Future[T]":
    """``encode(*args)`` run on the slice encoder thread."""
    return asyncio.get_running_loop().run_in_executor(_SLICE_ENCODER, encode, *args)


class _FormatChanged(Exception):
    """A slice of a binary COPY cannot be binary: the COPY is abandoned and redone as CSV."""


def _copy_statement(target: "sql.Composable", batch: pa.RecordBatch, format: CopyFormat) -> sql.Composed:
    names = sql.SQL(", ").join(map(sql.Identifier, batch.schema.names))
    options = sql.SQL("FORMAT binary" if format == "binary" else "FORMAT csv")
    return sql.SQL("COPY {} ({}) FROM STDIN ({})").format(target, names, options)


async def _copy(
    conn: "psycopg.AsyncConnection[Any]",
    target: "sql.Composable",
    batch: pa.RecordBatch,
    payload: CopyPayload,
) -> None:
    async with conn.cursor() as cursor, cursor.copy(_copy_statement(target, batch, payload.format)) as copy:
        for chunk in payload.chunks:
            await copy.write(chunk)


async def _copy_sliced(
    conn: "psycopg.AsyncConnection[Any]",
    target: "sql.Composable",
    batch: pa.RecordBatch,
    format: CopyFormat,
    first: Any,
    encode: Callable[[pa.RecordBatch], Any | None],
) -> None:
    """COPY ``batch`` in ``format``, slice by slice (:func:`copy_slices`): ``first`` is the first slice's
    body (already encoded), ``encode(slice)`` a later one's, run on the slice encoder thread while the
    slice before it is written. Raises _FormatChanged when ``encode`` returns None."""
    statement = _copy_statement(target, batch, format)
    async with conn.cursor() as cursor, cursor.copy(statement) as copy:
        if format == "binary":
            await copy.write(_BINARY_HEADER)
        body = first
        for start, length in itertools.islice(copy_slices(batch.num_rows), 1, None):
            task = _encoded(encode, batch.slice(start, length))
            try:
                await copy.write(body)
            except BaseException:
                # The write's error wins; the slice being encoded is let finish and dropped.
                await asyncio.wait([task])
                if not task.cancelled():
                    task.exception()
                raise
            body = await task
            if body is None:
                raise _FormatChanged
        await copy.write(body)
        if format == "binary":
            await copy.write(_BINARY_TRAILER)


class _NoBinary(Exception):
    """The column has no binary encoder for its destination type."""


_Piece: TypeAlias = "pa.Array | pa.Scalar"
"""A part of every row's field (an array of large_binary, or one value for every row), joined with the
other columns' pieces in one pass (:func:`_binary_rows`): a copy per column per step cost 10.4 ms per
50,000 rows of the bench's three columns, one join at the end 6.5 ms."""


def _binary_field(values: pa.Array, column: PgColumn) -> list[_Piece]:
    """The pieces of each value's binary COPY field: its 4-byte big-endian length (-1 for NULL), then
    the value's bytes (none for NULL).

    Raises _NoBinary when the destination type has no encoder for this Arrow type, and ArrowInvalid
    when a value does not fit the destination exactly (the caller falls back to CSV).
    """
    if values.null_count == len(values):
        # A NULL is its length alone, whatever the types: a column with no values (Kafka's headers,
        # mostly) does not send the whole batch down the CSV path (2.3 us a row against 0.5 for binary).
        return [pa.repeat(_NULL_FIELD, len(values))]
    source = values.type
    target = column.type_name
    text = pa.types.is_string(source) or pa.types.is_large_string(source)
    if pa.types.is_dictionary(source):
        return _binary_field(values.dictionary_decode(), column)
    if target in _NUMBER_TYPES:
        kind, code = _NUMBER_TYPES[target]
        if not (pa.types.is_integer(source) or (pa.types.is_floating(source) and pa.types.is_floating(kind))):
            raise _NoBinary
        return _fixed(values, values.cast(kind), code, kind.byte_width)
    if target == "bool" and pa.types.is_boolean(source):
        one, zero = pa.scalar(b"\x01", pa.large_binary()), pa.scalar(b"\x00", pa.large_binary())
        return _prefixed(values, pc.if_else(values, one, zero), 1)
    if target in ("text", "varchar", "bpchar", "json") and text:
        return _variable(values, values.cast(pa.large_string()).cast(pa.large_binary()))
    if target == "jsonb" and text:
        return _variable(values, values.cast(pa.large_string()).cast(pa.large_binary()), version=b"\x01")
    if target == "bytea" and (pa.types.is_binary(source) or pa.types.is_large_binary(source)):
        return _variable(values, values.cast(pa.large_binary()))
    if target in ("timestamp", "timestamptz") and pa.types.is_timestamp(source):
        # Arrow keeps UTC instants; a naive timestamp is taken as UTC, as the session's TimeZone does.
        micros = values.cast(pa.timestamp("us", tz=source.tz), safe=False).cast(pa.int64())
        shifted = pc.subtract(micros, pa.scalar(_POSTGRES_EPOCH_US, pa.int64()))
        return _fixed(values, _infinities_kept(micros, shifted, INFINITE, pa.int64()), "q", 8)
    if target == "date" and pa.types.is_date(source):
        days = values.cast(pa.date32()).cast(pa.int32())
        shifted = pc.subtract(days, pa.scalar(_POSTGRES_EPOCH_DAYS, pa.int32()))
        return _fixed(values, _infinities_kept(days, shifted, INFINITE_DATES, pa.int32()), "i", 4)
    raise _NoBinary


def _infinities_kept(
    values: pa.Array, shifted: pa.Array, extremes: tuple[int, int], kind: pa.DataType
) -> pa.Array:
    """``shifted``, except where ``values`` is an infinity (an extreme), which stays as it is: the
    binary form of PostgreSQL's infinities is the same extreme."""
    low, high = (pa.scalar(value, kind) for value in extremes)
    infinite = pc.or_(pc.equal(values, low), pc.equal(values, high))
    if not pc.any(infinite).as_py():
        return shifted
    return pc.if_else(infinite, values, shifted)


_NUMBER_TYPES: Mapping[str, tuple[pa.DataType, str]] = {
    "int2": (pa.int16(), "h"),
    "int4": (pa.int32(), "i"),
    "int8": (pa.int64(), "q"),
    "float4": (pa.float32(), "f"),
    "float8": (pa.float64(), "d"),
}

_NULL_FIELD = pa.scalar(b"\xff\xff\xff\xff", pa.large_binary())
"""The length of a NULL field, -1, with no bytes after it."""


def _network_order(values: pa.Array, code: str, width: int) -> pa.Array:
    """Fixed-width numbers as ``binary(width)`` values in network (big-endian) byte order."""
    assert values.type.byte_width == width, (values.type, width)
    data = array.array(code)
    data.frombytes(
        memoryview(values.buffers()[1])[values.offset * width : (values.offset + len(values)) * width]
    )
    if sys.byteorder == "little":
        data.byteswap()
    return pa.Array.from_buffers(pa.binary(width), len(values), [None, pa.py_buffer(data)])


def _fixed(original: pa.Array, values: pa.Array, code: str, width: int) -> list[_Piece]:
    """Fixed-width fields: the constant length, then the value in network order."""
    return _prefixed(original, _network_order(values, code, width).cast(pa.large_binary()), width)


def _prefixed(original: pa.Array, raw: pa.Array, width: int) -> list[_Piece]:
    """Fields of ``width`` bytes each (``raw``): the constant length, then the bytes."""
    return [
        _length_or_null(original, pa.scalar(width.to_bytes(4, "big"), pa.large_binary())),
        _unless_null(original, raw),
    ]


def _variable(original: pa.Array, data: pa.Array, version: bytes = b"") -> list[_Piece]:
    """Variable-length fields: the big-endian int32 length, then ``version`` (jsonb's format byte) and
    the bytes of ``data`` (large_binary)."""
    lengths = pc.fill_null(pc.binary_length(data).cast(pa.int32()), 0)
    if version:
        lengths = pc.add(lengths, pa.scalar(len(version), pa.int32()))
    prefix = _network_order(lengths, "i", 4).cast(pa.large_binary())
    format_byte = [_unless_null(original, pa.scalar(version, pa.large_binary()))] if version else []
    return [_length_or_null(original, prefix), *format_byte, _unless_null(original, data)]


def _length_or_null(original: pa.Array, length: _Piece) -> _Piece:
    """``length``, or the NULL field's where ``original`` is null."""
    if not original.null_count:
        return length
    return pc.if_else(pc.is_null(original), _NULL_FIELD, length)


def _unless_null(original: pa.Array, piece: _Piece) -> _Piece:
    """``piece``, or no bytes where ``original`` is null (a NULL field is its length alone)."""
    if not original.null_count:
        return piece
    return pc.if_else(pc.is_null(original), _NO_BYTES, piece)


def _binary_rows(fields: Sequence[Sequence[_Piece]], num_rows: int) -> Any:
    """The tuples of a binary COPY: per row a 2-byte field count, then its fields; one contiguous buffer."""
    count = pa.scalar(len(fields).to_bytes(2, "big"), pa.large_binary())
    rows = pc.binary_join_element_wise(count, *(piece for field in fields for piece in field), _NO_BYTES)
    offsets = memoryview(rows.buffers()[1]).cast("q")
    start, end = offsets[rows.offset], offsets[rows.offset + num_rows]
    return memoryview(rows.buffers()[2])[start:end]


def _csv(batch: pa.RecordBatch) -> pa.Buffer:
    """``batch`` as CSV for ``COPY ... (FORMAT csv)``: NULL unquoted-empty, text always quoted (so an
    empty string stays one), bytea as ``\\x`` hex, nested values as JSON, durations as intervals."""
    columns = [
        _csv_ready(column, name) for column, name in zip(batch.columns, batch.schema.names, strict=True)
    ]
    ready = pa.RecordBatch.from_arrays(columns, names=batch.schema.names)
    sink = pa.BufferOutputStream()
    pa_csv.write_csv(ready, sink, pa_csv.WriteOptions(include_header=False))
    return sink.getvalue()


def _csv_ready(values: pa.Array, name: str) -> pa.Array:
    kind = values.type
    if pa.types.is_dictionary(kind):
        return _csv_ready(values.dictionary_decode(), name)
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        return pa.array(
            [None if value is None else "\\x" + value.hex() for value in values.to_pylist()], pa.string()
        )
    if pa.types.is_nested(kind):
        return pa.array(
            [
                None if value is None else json_text(value, f"column {name!r}, row {row} of the batch")
                for row, value in enumerate(values.to_pylist())
            ],
            pa.string(),
        )
    if pa.types.is_duration(kind):
        micros = values.cast(pa.duration("us"), safe=False).cast(pa.int64()).cast(pa.string())
        return pc.binary_join_element_wise(micros, " microseconds", "")
    if pa.types.is_timestamp(kind) or pa.types.is_date32(kind):
        storage, extremes = (
            (pa.int32(), INFINITE_DATES) if pa.types.is_date32(kind) else (pa.int64(), INFINITE)
        )
        raw = values.cast(storage)
        later, earlier = (pc.equal(raw, pa.scalar(value, storage)) for value in reversed(extremes))
        if pc.any(later).as_py() or pc.any(earlier).as_py():
            finite = pc.if_else(pc.or_(later, earlier), pa.scalar(None, kind), values)
            text = _csv_ready(finite, name).cast(pa.string())
            return pc.if_else(later, "infinity", pc.if_else(earlier, "-infinity", text))
        if pa.types.is_timestamp(kind) and kind.unit == "ns":
            return values.cast(pa.timestamp("us", tz=kind.tz), safe=False)
    if pa.types.is_float16(kind):
        return values.cast(pa.float32())
    if pa.types.is_string_view(kind):
        return values.cast(pa.string())
    return values


__all__ = ["INFINITE", "INFINITE_DATES", "CopyFormat", "CopyPayload", "copy_batch", "encode_copy"]
