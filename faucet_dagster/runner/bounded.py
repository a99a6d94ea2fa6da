"""The bounded runner: one finite sync of a source into a sink, page by page, with bounded memory.

``run_bounded_sync`` does, in this order (the one place the bounded commit order is written down):

1. plan the pair (:func:`faucet_dagster.planner.plan`, bounded mode, with the write mode and key
   the sink's config applies, ``Sink.write_mode``): a refused pair raises :class:`PlanError` before
   anything is read or written;
2. preflight ``check()`` the source; restrict it to its shard and resume it after the start bookmark
   (REPLACE reads the whole snapshot and ignores it); start reading its first page (unless the sink's
   watermark says where it resumes); ``check()`` the sink and the dead-letter sink, and read the
   sink's watermark. A check that fails drops the page read meanwhile: nothing is written;
3. for every page of ``source.stream_pages(ctx, batch_size)`` (the next page is read while this one
   is written: the runner holds at most two pages): convert it to Arrow (rows that cannot convert
   go to the dead-letter route), evolve the destination for new columns or refuse them, write it,
   route the rows the sink rejects to the dead-letter route, and advance the bookmark;
4. ``flush()`` then ``finish()`` the sink (REPLACE swaps its table in here) and the dead-letter sink.

The bookmark and commit token in the result are what the caller persists (Dagster run storage) only
after ``run_bounded_sync`` returned: a run that raised persisted nothing, so the next run re-reads from
the previous bookmark.

Effectively-once through the atomic watermark. When the plan holds the atomic-watermark mechanism
(a deterministic source, a sink that commits records and a commit token in one transaction, durable
state and no dead-letter route), every page is written with ``write_batch_idempotent`` and a token
that identifies how far the source has been delivered, so a rerun after a crash (the sink committed
pages, the caller never persisted the result) neither duplicates nor skips:

* by position, when the source has positions (``Source.watermark_by_position``, e.g. a stream
  sequence): page ``n``'s token is the position its bookmark names. The rerun reads the sink's token
  first and has the source resume right after it (``Source.resume_after_position``), whatever the
  old bookmark said: what the sink holds is never re-read, and what follows it is read or is
  reported gone (:class:`PositionUnavailable`), even when retention moved the start of the source
  between the crash and the rerun.
* by bookmark, when every page carries a bookmark (``SourceCapabilities.page_bookmarks``) and the sink
  keeps each page's bookmark with its token (``SinkCapabilities.watermark_bookmark``): tokens count
  rows as below, and the rerun reads the sink's token and bookmark first and, when the sink holds
  more than the caller's token says, has the source resume from the bookmark the sink holds: what
  it holds is named by the bookmark (files by path, size and modification time; table rows by their
  position), never by a count, so a file that sorts before the ones read is read once.
* by count, otherwise: the caller passes the token of its last successful run, and page ``n`` carries
  that token plus the rows read up to the end of page ``n``. The next run starts again from the old
  bookmark and old token; the deterministic source re-reads the same rows in the same order, and
  every row whose token is at or below ``sink.last_committed_token()`` is skipped instead of
  written. Counting rows rather than pages keeps this exact even when the next run uses another
  ``batch_size``; it needs a source whose start does not move (a source with positions declares
  them, so it never relies on a count).

A run over one shard of a source uses the watermark only when the sink keeps one per shard
(``Sink.scope_watermark``): the shards write into one destination, each with its own token
sequence. Otherwise the plan for that run is made without the watermark and says so.
"""

import operator
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import pyarrow as pa

from faucet_dagster.planner import Mechanism, plan
from faucet_dagster.protocol import (
    AddColumn,
    CommitToken,
    ConfigError,
    DataError,
    FetchContext,
    IntegrityError,
    JsonValue,
    Mode,
    Page,
    PartialResult,
    Records,
    RejectedRow,
    SchemaError,
    Sink,
    Source,
    WritePolicy,
    as_record_batch,
    conform_rows,
    split_missing,
)
from faucet_dagster.protocol.json_values import json_record
from faucet_dagster.protocol.lattice import infer_type
from faucet_dagster.runner.bounded_values import BoundedSyncResult, PageReport, SyncSettings
from faucet_dagster.runner.read_ahead import reading_ahead

DEAD_LETTER_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string(), nullable=False),
        pa.field("shard", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("page", pa.int64(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("record", pa.string(), nullable=False),
    ]
)
"""What the dead-letter sink receives, appended: where a row came from (the source dataset URI, the
shard, the run id from the fetch context, the 1-based page number of the run and the row's index in
that page), the stage that refused it (``convert``: it did not fit an Arrow batch; ``write``: the
sink rejected it), the reason, and the row itself as a JSON object."""


DEFAULT_SETTINGS = SyncSettings()


async def run_bounded_sync(
    source: Source,
    sink: Sink,
    settings: SyncSettings = DEFAULT_SETTINGS,
    *,
    start_bookmark: JsonValue | None = None,
    last_token: CommitToken | None = None,
    dead_letter: Sink | None = None,
    shard: str | None = None,
    context: FetchContext | None = None,
    on_page: Callable[[PageReport], None] | None = None,
) -> BoundedSyncResult:
    """Sync ``source`` into ``sink`` once; see the module docstring for the order and the guarantee.

    ``start_bookmark`` and ``last_token`` are the ``bookmark`` and ``commit_token`` of the last run
    that returned (``None`` for a first run). ``dead_letter`` is a sink configured to APPEND; it gets
    the rows that cannot be converted or that the sink rejects (see :data:`DEAD_LETTER_SCHEMA`).
    ``shard`` restricts a shardable source to one shard (not with REPLACE, which would drop the other
    shards' rows: :class:`ConfigError`). ``on_page`` is called after each page's rows
    are committed or routed; an exception it raises ends the run there, with those rows committed.

    Blocks (asynchronously) until the last page is finished. Raises :class:`PlanError` when the pair
    is refused, :class:`SchemaError` when a batch has columns the destination lacks and evolution is
    off, :class:`DataError` when rows cannot be converted and there is no dead-letter route,
    :class:`IntegrityError` when the sink's watermark does not line up with what the source re-read,
    and whatever :class:`FaucetError` a connector raises. The caller owns and closes the connectors.
    """
    started = time.perf_counter()
    policy, key = sink.write_mode()
    sink_capabilities = sink.capabilities()
    if shard is not None and sink_capabilities.atomic_watermark and not sink.scope_watermark(shard):
        # Shards share the destination; one watermark cannot hold several token sequences.
        sink_capabilities = replace(sink_capabilities, atomic_watermark=False)
    accepted = plan(
        source.capabilities(),
        sink_capabilities,
        Mode.BOUNDED,
        policy,
        key,
        delivery=settings.delivery,
        durable_state=settings.durable_state,
        dead_letter=dead_letter is not None,
    )
    if settings.batch_size < 0:
        raise ConfigError(f"batch_size must be >= 0, got {settings.batch_size}", where=source.dataset_uri())
    if shard is not None and policy is WritePolicy.REPLACE:
        raise ConfigError(
            f"replace swaps in the whole table, so a run over shard {shard!r} would drop every other "
            "shard's rows: replace reads the whole source, unsharded",
            where=sink.dataset_uri(),
        )
    if dead_letter is not None and WritePolicy.APPEND not in dead_letter.supported_write_modes():
        raise ConfigError("the dead-letter sink cannot append", where=dead_letter.dataset_uri())
    await source.check()
    if shard is not None:
        source.apply_shard(shard)
    replacing = policy is WritePolicy.REPLACE
    if start_bookmark is not None and not replacing:
        source.apply_start_bookmark(start_bookmark)

    run = _Run(source, sink, settings, replacing, dead_letter, shard, dict(context or {}))
    watermark = Mechanism.ATOMIC_WATERMARK in accepted.mechanisms and not replacing
    # The first page is read while the sinks are checked and the watermark is read, unless the sink's
    # watermark says where the source resumes (by position).
    by_bookmark = (
        watermark
        and not source.watermark_by_position
        and sink_capabilities.watermark_bookmark
        and source.capabilities().page_bookmarks
    )
    resumes_at_sink = watermark and (source.watermark_by_position or by_bookmark)
    bookmark = start_bookmark
    pages = 0
    async with AsyncExitStack() as reading:

        def read_ahead() -> Awaitable[AsyncIterator[Page]]:
            return reading.enter_async_context(
                reading_ahead(source.stream_pages(run.context, settings.batch_size))
            )

        stream = None if resumes_at_sink else await read_ahead()
        for connector in (sink, dead_letter):
            if connector is not None:
                await connector.check()
        if watermark:
            await run.use_watermark(last_token, start_bookmark, by_bookmark=by_bookmark)
        if not replacing:
            await run.read_destination()
        if stream is None:
            stream = await read_ahead()
        async for page in stream:
            pages += 1
            report = await run.deliver(page, pages)
            if page.bookmark is not None:
                bookmark = page.bookmark
            if on_page is not None:
                on_page(report)
    run.check_watermark_reached()
    await sink.flush()
    if dead_letter is not None:
        await dead_letter.flush()
    await sink.finish()
    if dead_letter is not None:
        await dead_letter.finish()
    schema = await sink.current_schema() or run.last_schema
    return BoundedSyncResult(
        plan=accepted,
        rows_read=run.rows_read,
        rows_written=run.rows_written,
        rows_dead_lettered=run.rows_dead_lettered,
        rows_skipped=run.rows_skipped,
        pages=pages,
        bookmark=bookmark,
        commit_token=run.token if watermark else last_token,
        schema=schema,
        seconds=time.perf_counter() - started,
        evolved_columns=tuple(run.evolved),
        missing_fields=dict(run.missing),
    )


@dataclass
class _Rejected:
    """A row refused at a stage, with its reason, on its way to the dead-letter sink."""

    row: int
    stage: str
    reason: str
    record: Mapping[str, Any]


@dataclass
class _Run:
    """The mutable state of one run: counters, the destination's known columns, the watermark."""

    source: Source
    sink: Sink
    settings: SyncSettings
    replacing: bool
    dead_letter: Sink | None
    shard: str | None
    context: dict[str, JsonValue]
    rows_read: int = 0
    rows_written: int = 0
    rows_dead_lettered: int = 0
    rows_skipped: int = 0
    missing: Counter[str] = field(default_factory=Counter)
    """Per field, the rows read whose record lacked it (a JSON page's objects, a batch's
    ``MISSING_COLUMN``)."""
    fields: set[str] = field(default_factory=set)
    """The fields of every JSON object read so far: a later object lacking one lacks a field."""
    evolved: list[str] = field(default_factory=list)
    last_schema: pa.Schema | None = None
    watermark: bool = False
    by_position: bool = False
    """Watermark mode: tokens are the source's positions (else they count rows)."""
    bookmarked: bool = False
    """Watermark mode: each page's bookmark is committed with its token (and resumed from)."""
    position: int = 0
    """Watermark mode: the token after the rows read so far (by count: the last run's token plus this
    run's rows; by position: the last position at the sink or read)."""
    committed: int = 0
    """Watermark mode: the sink's token at the start; rows at or below it are already at the sink."""
    _checked_schema: pa.Schema | None = None
    _destination: dict[str, pa.DataType] | None = None
    """The destination's columns and types, once known (``None`` before the table exists)."""

    @property
    def token(self) -> CommitToken | None:
        return CommitToken(self.position) if self.position else None

    async def use_watermark(
        self, last_token: CommitToken | None, start_bookmark: JsonValue | None, *, by_bookmark: bool = False
    ) -> None:
        """Switch to idempotent writes, continuing from ``last_token`` and lining up with the sink."""
        self.watermark = True
        self.position = last_token.sequence if last_token is not None else 0
        if by_bookmark:
            self.bookmarked = True
            held = await self.sink.last_committed_bookmark()
            self.committed = 0 if held is None else held[0].sequence
            if held is not None and held[1] is not None and self.committed > self.position:
                # The sink holds pages the caller never recorded (a run died after their commit):
                # resume from the bookmark it holds, which names what was read, not from a count.
                self.source.apply_start_bookmark(held[1])
                self.position = self.committed
            return
        sink_token = await self.sink.last_committed_token()
        self.committed = sink_token.sequence if sink_token is not None else 0
        if not self.source.watermark_by_position:
            return
        self.by_position = True
        start = 0
        if start_bookmark is not None:
            start = self.source.watermark_position(start_bookmark)
        if self.committed > start:
            # The sink holds pages past the bookmark (a run died before its result was persisted):
            # read on from what the sink holds, not from a count that retention may have shifted.
            self.source.resume_after_position(self.committed)
        self.position = max(self.position, start, self.committed)

    def check_watermark_reached(self) -> None:
        """After the last page: the sink must not hold rows beyond everything the source re-read."""
        if self.watermark and self.committed > self.position:
            raise IntegrityError(
                f"the sink's commit token {CommitToken(self.committed)} is ahead of the "
                f"{self.position} rows this source delivered in total: the source did not re-read the "
                "same rows (it is not deterministic) or another sync writes under the same watermark",
                where=self.sink.dataset_uri(),
            )

    async def deliver(self, page: Page, number: int) -> PageReport:
        """Convert, evolve, write and route one page; return what happened to its rows."""
        batch, rejected, origin = self._convert(page.records, number)
        rows = batch.num_rows + len(rejected)
        self.rows_read += rows
        written = skipped = 0
        if batch.num_rows:
            if not self.replacing:
                await self._fit_destination(batch)
            if self.by_position:
                written, skipped = await self._write_at_position(batch, page.bookmark, number)
            elif self.watermark:
                written, skipped = await self._write_idempotent(batch, page.bookmark, number)
            elif self.dead_letter is not None:
                written, refused = await self._write_partial(batch, origin)
                rejected.extend(refused)
            else:
                written = await self.sink.write_batch(batch)
            self.last_schema = batch.schema
        if rejected:
            await self._dead_letter(rejected, number)
        self.rows_written += written
        self.rows_skipped += skipped
        return PageReport(
            number=number,
            rows_read=rows,
            rows_written=written,
            rows_dead_lettered=len(rejected),
            rows_skipped=skipped,
            bookmark=page.bookmark,
            commit_token=self.token if self.watermark else None,
        )

    # -- conversion --------------------------------------------------------------------------------

    def _convert(
        self, records: Records, number: int
    ) -> tuple[pa.RecordBatch, list[_Rejected], Sequence[int] | None]:
        """Arrow pages pass through; JSON pages convert whole, or row by row when some rows cannot.

        Returns the batch, the rows rejected on the way, and for each batch row its index in the
        page (``None`` when they are the same).
        """
        if isinstance(records, pa.RecordBatch):
            batch, missing = split_missing(records)
            self.missing.update({name: len(rows) for name, rows in missing.items()})
            return batch, [], None
        self.fields.update(name for row in records for name in row)
        self.missing.update({name: count for name in self.fields if (count := _lacking(records, name))})
        try:
            return as_record_batch(records), [], None
        except DataError as exc:
            if self.dead_letter is None:
                raise DataError(
                    f"page {number} does not convert to Arrow and there is no dead-letter route: "
                    f"{exc.message}",
                    where=self._where(number),
                ) from exc
        return self._convert_rows(records)

    def _convert_rows(
        self, records: Sequence[Mapping[str, Any]]
    ) -> tuple[pa.RecordBatch, list[_Rejected], Sequence[int]]:
        """Convert rows against one schema by the type lattice's rule; the rows that do not fit are
        rejected.

        A column's type is the destination's when it has the column, else the one the lattice infers
        from the page's values (the first non-null value's kind): deterministic, so a replayed page
        rejects the same rows.
        """
        known = self._destination or {}
        names = list(dict.fromkeys(name for row in records for name in row))
        schema = pa.schema(
            [
                pa.field(
                    name, known[name] if name in known else infer_type([row.get(name) for row in records])
                )
                for name in names
            ]
        )
        conformed = conform_rows(records, schema)
        rejected = [
            _Rejected(index, "convert", f"does not convert to Arrow: {reason}", records[index])
            for index, reason in sorted(conformed.bad.items())
        ]
        origin = range(len(records)) if conformed.kept is None else conformed.kept
        return conformed.batch, rejected, origin

    # -- schema ------------------------------------------------------------------------------------

    async def read_destination(self) -> None:
        """Read the destination's columns now (while the first page is read), if it exists."""
        current = await self.sink.current_schema()
        if current is not None:
            self._destination = _columns(current)

    async def _fit_destination(self, batch: pa.RecordBatch) -> None:
        """Make sure the destination has every column of ``batch``: evolve, or raise SchemaError.

        The destination's columns are read once, again after the write that creates the table, and
        compared only when a batch's schema differs from the last one compared.
        """
        if self._checked_schema is not None and batch.schema.equals(self._checked_schema):
            return
        if self._destination is None:
            current = await self.sink.current_schema()
            if current is None:
                # The first write creates the destination from this batch; read it back after.
                self._checked_schema = None
                return
            self._destination = _columns(current)
        new = [batch.schema.field(name) for name in batch.schema.names if name not in self._destination]
        if new:
            names = ", ".join(f.name for f in new)
            if not self.settings.evolve_schema:
                raise SchemaError(
                    f"the records have column(s) the destination lacks: {names} (schema evolution is off)",
                    where=self.sink.dataset_uri(),
                )
            if not self.sink.supports_schema_evolution():
                raise SchemaError(
                    f"the records have column(s) the destination lacks: {names}, and this sink cannot "
                    "evolve its schema",
                    where=self.sink.dataset_uri(),
                )
            await self.sink.evolve_schema([AddColumn(f.name, f.type) for f in new])
            self._destination.update((f.name, f.type) for f in new)
            self.evolved.extend(f.name for f in new)
        self._checked_schema = batch.schema

    # -- writing -----------------------------------------------------------------------------------

    async def _write_idempotent(
        self, batch: pa.RecordBatch, bookmark: JsonValue | None, number: int
    ) -> tuple[int, int]:
        """Write with the row-counting token (and the page's bookmark); skip the rows the sink
        already committed."""
        if self.bookmarked and bookmark is None:
            raise IntegrityError(
                "a source whose pages carry bookmarks sent a page without one", where=self._where(number)
            )
        start = self.position
        self.position += batch.num_rows
        if self.position <= self.committed:
            return 0, batch.num_rows
        skipped = max(0, self.committed - start)
        if skipped:
            batch = batch.slice(skipped)
        return await self._commit(batch, CommitToken(self.position), bookmark), skipped

    async def _commit(
        self, batch: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        """Write ``batch`` and ``token`` (with the page's bookmark when the sink keeps it) in one sink
        transaction; return the rows written."""
        if self.bookmarked:
            written = await self.sink.write_batch_idempotent(batch, token, bookmark)
        else:
            written = await self.sink.write_batch_idempotent(batch, token)
        if written == 0:
            raise IntegrityError(
                f"the sink refused token {token} as not newer than its watermark: another writer "
                "advanced the same watermark during this run",
                where=self.sink.dataset_uri(),
            )
        await self._after_first_write()
        return written

    async def _write_at_position(
        self, batch: pa.RecordBatch, bookmark: JsonValue | None, number: int
    ) -> tuple[int, int]:
        """Write with the page's position as its token; a page at or below the sink's is skipped."""
        if bookmark is None:
            raise IntegrityError(
                "a source with watermark positions sent a page without a bookmark", where=self._where(number)
            )
        at = self.source.watermark_position(bookmark)
        if at <= self.committed:
            return 0, batch.num_rows
        if at <= self.position:
            raise IntegrityError(
                f"page position {at} does not follow the last one, {self.position}: the source's "
                "positions must grow with every page",
                where=self._where(number),
            )
        self.position = at
        return await self._commit(batch, CommitToken(at)), 0

    async def _write_partial(
        self, batch: pa.RecordBatch, origin: Sequence[int] | None
    ) -> tuple[int, list[_Rejected]]:
        """Write the rows the sink accepts; return the others for the dead-letter route.

        A sink without per-row results writes all or nothing: when it refuses the batch with a
        DataError, the whole page goes to the dead-letter route with that reason.
        """
        try:
            result = await self.sink.write_batch_partial(batch)
        except DataError as exc:
            result = PartialResult(0, tuple(RejectedRow(i, exc.message) for i in range(batch.num_rows)))
        else:
            await self._after_first_write()
        if not result.rejected:
            return result.written, []
        rows = batch.take(pa.array([r.index for r in result.rejected], pa.int64())).to_pylist()
        return result.written, [
            _Rejected(r.index if origin is None else origin[r.index], "write", r.reason, row)
            for r, row in zip(result.rejected, rows, strict=True)
        ]

    async def _after_first_write(self) -> None:
        if self._destination is None and not self.replacing:
            current = await self.sink.current_schema()
            if current is not None:
                self._destination = _columns(current)

    async def _dead_letter(self, rejected: Sequence[_Rejected], number: int) -> None:
        assert self.dead_letter is not None  # rows are only rejected when a route exists
        run_id = self.context.get("run_id")
        count = len(rejected)
        batch = pa.RecordBatch.from_pydict(
            {
                "source": [self.source.dataset_uri()] * count,
                "shard": [self.shard] * count,
                "run_id": [None if run_id is None else str(run_id)] * count,
                "page": [number] * count,
                "row": [r.row for r in rejected],
                "stage": [r.stage for r in rejected],
                "reason": [r.reason for r in rejected],
                "record": [json_record(dict(r.record)) for r in rejected],
            },
            schema=DEAD_LETTER_SCHEMA,
        )
        await self.dead_letter.write_batch(batch)
        self.rows_dead_lettered += count

    def _where(self, number: int) -> str:
        shard = f" shard {self.shard}" if self.shard is not None else ""
        return f"{self.source.dataset_uri()}{shard} page {number}"


def _lacking(records: Sequence[Mapping[str, Any]], name: str) -> int:
    """How many of ``records`` lack field ``name``."""
    return len(records) - sum(map(operator.contains, records, repeat(name)))


def _columns(schema: pa.Schema) -> dict[str, pa.DataType]:
    return {f.name: f.type for f in schema}


__all__ = ["DEAD_LETTER_SCHEMA", "run_bounded_sync"]
