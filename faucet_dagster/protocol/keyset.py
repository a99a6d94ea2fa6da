"""Keyset bookmarks: the resume position of a table read in ascending (cursor, key...) order.

A table source that reads incrementally by a cursor column, with ties broken by a key, reads rows in
ascending ``(cursor, key...)`` order and pages with ``WHERE (cursor, key...) > (last position)``. Rows
sharing a cursor value across a page boundary are then neither skipped nor read twice, because the
key orders them. Its bookmark is the position of the last row delivered::

    {"version": 1, "columns": ["updated_at", "id"], "values": [{"type": "datetime", "value": "..."}, 7]}

``columns`` names the ordering columns, so a bookmark taken with another cursor or key is refused
instead of misread. Values that JSON holds exactly (strings, integers, booleans, finite floats) are
stored as themselves; datetimes, dates, times, decimals, bytes, UUIDs and durations are tagged
``{"type": ..., "value": <text>}`` and decode back to the same Python value. Pure: no I/O.
"""

import datetime as dt
import math
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.protocol.bounded import FetchContext, Page, Source
from faucet_dagster.protocol.capabilities import Emits, Operation, Ordering, Replay, SourceCapabilities
from faucet_dagster.protocol.errors import ConfigError, DataError, UnsupportedOperation
from faucet_dagster.protocol.records import JsonValue, Records, record_count, slice_records

KEYSET_BOOKMARK_VERSION = 1


@dataclass(frozen=True)
class KeysetBookmark:
    """The ``(cursor, key...)`` position of the last row delivered, with the columns it orders by."""

    columns: tuple[str, ...]
    values: tuple[Any, ...]

    def to_json(self) -> JsonValue:
        return {
            "version": KEYSET_BOOKMARK_VERSION,
            "columns": list(self.columns),
            "values": [encode_scalar(value) for value in self.values],
        }

    @classmethod
    def from_json(cls, raw: JsonValue, columns: tuple[str, ...] | None, *, where: str) -> "KeysetBookmark":
        """Parse a bookmark for a read ordered by ``columns`` (``None``: any, check later with
        :meth:`check_columns`); a bookmark for other columns, or anything malformed, raises
        :class:`ConfigError` naming why."""
        if not isinstance(raw, dict) or raw.get("version") != KEYSET_BOOKMARK_VERSION:
            raise ConfigError(
                f"not a version {KEYSET_BOOKMARK_VERSION} keyset bookmark: {raw!r}", where=where
            )
        stored = raw.get("columns")
        values = raw.get("values")
        if not isinstance(stored, list) or not isinstance(values, list) or len(stored) != len(values):
            raise ConfigError("a keyset bookmark needs 'columns' and 'values' of one length", where=where)
        if not all(isinstance(column, str) for column in stored):
            raise ConfigError("a keyset bookmark's columns are names", where=where)
        try:
            decoded = tuple(decode_scalar(value) for value in values)
        except DataError as exc:
            raise ConfigError(f"a keyset bookmark value is malformed: {exc.message}", where=where) from None
        bookmark = cls(tuple(str(column) for column in stored), decoded)
        if columns is not None:
            bookmark.check_columns(columns, where=where)
        return bookmark

    def check_columns(self, columns: tuple[str, ...], *, where: str) -> None:
        """Raise ConfigError unless this bookmark was taken for a read ordered by ``columns``."""
        if self.columns != columns:
            raise ConfigError(
                f"the bookmark orders by ({', '.join(self.columns)}) but this read orders by "
                f"({', '.join(columns)}): the cursor or key changed since it was taken",
                where=where,
            )


class KeysetSource(Source):
    """Base of the sources that read one table in ascending ``(cursor, key...)`` order.

    What such a source promises is the same whatever the database: rows (inserts) in one strict global
    order, replayable from a bookmark, bounded, discoverable. Not deterministic: a table changes
    between two reads (an updated row's cursor moves it past the others, a deleted row is gone), so
    re-reading from a bookmark does not give the same rows, and the atomic watermark, which counts
    rows re-read, would skip rows never written; a keyed upsert is what makes a rerun harmless. This
    base declares those capabilities and keeps the bookmarks; a subclass reads. Once it knows its
    ordering columns (the configured key, or the table's primary key) it calls :meth:`start_after`
    for the position to read after, and for every page :meth:`reached`, whose result is the page's
    bookmark.
    """

    def __init__(self, cursor: str | None, key: Sequence[str], columns: Sequence[str] | None) -> None:
        self._cursor = cursor
        self._key = tuple(key)
        self._columns = None if columns is None else tuple(columns)
        self._after: KeysetBookmark | None = None
        self._reached: KeysetBookmark | None = None

    def capabilities(self) -> SourceCapabilities:
        return SourceCapabilities(
            emits=Emits.ROWS,
            operations=frozenset({Operation.INSERT}),
            ordering=Ordering.STRICT_GLOBAL,
            replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
            bounded=True,
            continuous=False,
            deterministic=False,
            # Every page's bookmark is its last row's position: a sink keeping it with its watermark
            # lets a rerun resume exactly after what it committed.
            page_bookmarks=True,
            discover=True,
            shardable=False,
            columns=self._columns,
        )

    def order_of(self, key: Sequence[str]) -> tuple[str, ...]:
        """The ordering columns for ``key``: the cursor (when configured), then the key."""
        return (*([self._cursor] if self._cursor else []), *key)

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        # Without a configured key the ordering columns are known once the table is looked up.
        known = self.order_of(self._key) if self._key else None
        self._after = self._reached = KeysetBookmark.from_json(bookmark, known, where=self.dataset_uri())

    def bookmark(self) -> JsonValue | None:
        return None if self._reached is None else self._reached.to_json()

    def start_after(self, order: tuple[str, ...]) -> tuple[Any, ...] | None:
        """The position to read strictly after (None: from the start), checked against ``order``."""
        if self._after is None:
            return None
        self._after.check_columns(order, where=self.dataset_uri())
        return self._after.values

    def reached(self, order: tuple[str, ...], values: tuple[Any, ...]) -> JsonValue:
        """Record that the rows up to ``values`` were handed out; return that position's bookmark."""
        self._reached = KeysetBookmark(order, values)
        return self._reached.to_json()

    async def fetch(self, ctx: FetchContext) -> Records:
        pages = [page.records async for page in self.stream_pages(ctx, 0)]
        return pages[0] if pages else []

    async def replay_pages(
        self, ctx: FetchContext, start: JsonValue | None, end: JsonValue | None, batch_size: int
    ) -> AsyncIterator[Page]:
        """The rows after ``start`` up to ``end`` in ``(cursor, key...)`` order, as the table holds
        them now (a row updated or deleted since the run is another row, or none: the comparison
        with the destination says so). A page's rows past ``end`` are cut off and the read ends."""
        known = self.order_of(self._key) if self._key else None
        self._after = self._reached = None
        if start is not None:
            self.apply_start_bookmark(start)
        stop = None if end is None else KeysetBookmark.from_json(end, known, where=self.dataset_uri())
        async for page in self.stream_pages(ctx, batch_size):
            if stop is None:
                yield page
                continue
            kept = _rows_upto(page.records, stop, self.dataset_uri())
            if kept == record_count(page.records):
                yield page
                continue
            if kept:
                yield Page(slice_records(page.records, 0, kept), end)
            return


def tie_start(batch: pa.RecordBatch, order: Sequence[str]) -> int:
    """In ``batch`` (sorted by ``order``), the index of the first row whose ``order`` values equal the
    last row's: a page that ends before it ends between two positions, so its bookmark (the position
    of its last row, resumed with ``>``) skips no row sharing it, even when the key is not unique."""
    count: int = batch.num_rows
    if count == 0:
        return 0
    mask: Any = None
    for name in order:
        column = batch.column(name)
        same = pc.equal(column, column[count - 1])
        mask = same if mask is None else pc.and_(mask, same)
    same_count: int = pc.sum(mask).as_py() or 0
    return count - same_count


class KeysetPages:
    """Pages of at most ``size`` rows (``0``: one page) cut from batches sorted by ``order``, never
    between two rows of one position (see :func:`tie_start`), for a key that may not be unique: a
    page's trailing rows that share its last position wait for the next page. A position held by
    more rows than a page is one longer page: cutting it would make a resume skip the rest."""

    def __init__(self, size: int, order: Sequence[str]) -> None:
        self._size = size
        self._order = tuple(order)
        self._pending: list[pa.RecordBatch] = []
        self._rows = 0

    def add(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        """Add ``batch``; return the pages it completed."""
        if batch.num_rows:
            self._pending.append(batch)
            self._rows += batch.num_rows
        pages = []
        while self._size and self._rows >= self._size:
            rows = pa.concat_batches(self._pending) if len(self._pending) > 1 else self._pending[0]
            cut = tie_start(rows.slice(0, self._size), self._order)
            if cut == 0:
                # The whole page is one position: the page ends where the position does.
                cut = _position_end(rows, self._order, self._size)
                if cut == rows.num_rows:
                    self._pending = [rows]
                    break  # the position may go on in the next batch
            pages.append(rows.slice(0, cut))
            rest = rows.slice(cut)
            self._pending = [rest] if rest.num_rows else []
            self._rows = rest.num_rows
        return pages

    def finish(self) -> pa.RecordBatch | None:
        """The last page (every pending row: nothing follows it); None when none is pending."""
        if not self._rows:
            return None
        pending, self._pending, self._rows = self._pending, [], 0
        return pending[0] if len(pending) == 1 else pa.concat_batches(pending)


def _position_end(rows: pa.RecordBatch, order: Sequence[str], start: int) -> int:
    """The index after the last row sharing the position of row ``start - 1`` (rows sorted)."""
    anchor = rows.slice(start - 1, 1)
    mask: Any = None
    for name in order:
        same = pc.equal(rows.column(name), anchor.column(name)[0])
        mask = same if mask is None else pc.and_(mask, same)
    last: int = pc.indices_nonzero(mask)[-1].as_py()
    return last + 1


def encode_scalar(value: Any) -> JsonValue:
    """One ordering value as JSON (see the module docstring); raises DataError for other types."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"type": "float", "value": repr(value)}
    if isinstance(value, dt.datetime):
        return {"type": "datetime", "value": value.isoformat()}
    if isinstance(value, dt.date):
        return {"type": "date", "value": value.isoformat()}
    if isinstance(value, dt.time):
        return {"type": "time", "value": value.isoformat()}
    if isinstance(value, Decimal):
        return {"type": "decimal", "value": str(value)}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"type": "bytes", "value": bytes(value).hex()}
    if isinstance(value, uuid.UUID):
        return {"type": "uuid", "value": str(value)}
    if isinstance(value, dt.timedelta):
        return {"type": "timedelta_us", "value": str(value // dt.timedelta(microseconds=1))}
    raise DataError(f"cannot keep a {type(value).__name__} value in a bookmark: {value!r}")


_DECODERS: dict[str, Any] = {
    "float": float,
    "datetime": dt.datetime.fromisoformat,
    "date": dt.date.fromisoformat,
    "time": dt.time.fromisoformat,
    "decimal": Decimal,
    "bytes": bytes.fromhex,
    "uuid": uuid.UUID,
    "timedelta_us": lambda text: dt.timedelta(microseconds=int(text)),
}


def decode_scalar(raw: JsonValue) -> Any:
    """The Python value ``encode_scalar`` stored; raises DataError for anything it did not write."""
    if raw is None or isinstance(raw, bool | int | float | str):
        return raw
    if isinstance(raw, dict) and isinstance(raw.get("value"), str) and raw.get("type") in _DECODERS:
        try:
            return _DECODERS[str(raw["type"])](raw["value"])
        except (ValueError, InvalidOperation) as exc:
            raise DataError(f"malformed {raw['type']} value {raw['value']!r}: {exc}") from None
    raise DataError(f"not an encoded bookmark value: {raw!r}")


def _rows_upto(records: Records, stop: KeysetBookmark, where: str) -> int:
    """How many leading rows of ``records`` (ascending) are at or before ``stop``'s position."""
    columns = stop.columns
    if isinstance(records, pa.RecordBatch):
        missing = [name for name in columns if name not in records.schema.names]
        values = (
            list(zip(*(records.column(name).to_pylist() for name in columns), strict=True))
            if not missing
            else []
        )
    else:
        missing = [name for name in columns if records and name not in records[0]]
        values = [tuple(row[name] for name in columns) for row in records] if not missing else []
    if missing:
        raise UnsupportedOperation(
            f"the pages do not carry the ordering column(s) {', '.join(missing)}: a range cannot be cut",
            where=where,
        )
    try:
        return next((index for index, row in enumerate(values) if row > stop.values), len(values))
    except TypeError as exc:
        raise DataError(
            f"a row's ordering values do not compare with the bookmark's: {exc}", where=where
        ) from exc
