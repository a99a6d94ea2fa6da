"""The bounded contract of the Faucet Connector Protocol v0: ``Source`` and ``Sink``.

A bounded sync reads a finite set of records from a source page by page and writes them to a sink.
Memory stays bounded: a source that can page streams natively and never holds the whole dataset.
Progress is a *bookmark*, an opaque JSON value the source attaches to pages; the runner persists it
only after the sink has committed the page, and hands it back through ``apply_start_bookmark`` on the
next run, so a resumed run does not re-read committed records.

Every method either returns or raises a :class:`~faucet_dagster.protocol.errors.FaucetError`; no other
exception escapes, and no error is swallowed into an empty result. All I/O methods are coroutines;
a blocking client runs its calls in a worker thread (``asyncio.to_thread``) so the event loop never
blocks.
"""

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa

from faucet_dagster.protocol.capabilities import SinkCapabilities, SourceCapabilities, WritePolicy
from faucet_dagster.protocol.config import ConnectorConfig
from faucet_dagster.protocol.errors import ConfigError, PositionUnavailable, UnsupportedOperation
from faucet_dagster.protocol.positions import CommitToken
from faucet_dagster.protocol.records import JsonValue, Records, record_count, slice_records

FetchContext = Mapping[str, JsonValue]
"""Run context handed to ``fetch`` (the Dagster partition key, the run id for logging, ...)."""


@dataclass(frozen=True)
class Page:
    """One page of records and, when the source can resume, the bookmark reached after it.

    A bookmark on a page means: once this page and every earlier one are committed at the sink,
    resuming from this bookmark re-reads nothing committed and skips nothing uncommitted.
    """

    records: Records
    bookmark: JsonValue | None = None

    @property
    def num_rows(self) -> int:
        return record_count(self.records)


@dataclass(frozen=True)
class DiscoveredDataset:
    """A dataset a source can read (a table, a file, a topic), with its schema when known."""

    name: str
    schema: pa.Schema | None = None
    details: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RejectedRow:
    """A row the sink refused, by its index in the batch, with the reason (for the dead-letter route)."""

    index: int
    reason: str


@dataclass(frozen=True)
class PartialResult:
    """Per-row outcome of ``write_batch_partial``: how many rows landed, and which were refused."""

    written: int
    rejected: tuple[RejectedRow, ...] = ()


@dataclass(frozen=True)
class AddColumn:
    """An additive schema change: a nullable column the destination does not have yet."""

    name: str
    type: pa.DataType


class Connector(ABC):
    """What sources and sinks share: a name, a typed config, a preflight check and a dataset URI."""

    connector_name: ClassVar[str]
    """A short, non-empty, stable snake_case label (``postgres``, ``files``)."""
    config_model: ClassVar[type[ConnectorConfig]]

    @classmethod
    def config_schema(cls) -> dict[str, Any]:
        """A structurally valid JSON Schema of the config (FCP check 1). Never does I/O."""
        return cls.config_model.json_schema()

    async def check(self) -> None:
        """Preflight: connect and verify access. Returns when usable; raises a FaucetError naming why not."""

    @abstractmethod
    def dataset_uri(self) -> str:
        """A URI naming the dataset read or written (``postgresql://host/db/schema.table``); no secrets."""

    async def close(self) -> None:
        """Release clients. Idempotent; after it returns no call of this object is in flight."""


class Source(Connector):
    """A bounded source (FCP section 2).

    Order of calls: ``apply_start_bookmark`` (and ``apply_shard``) before the first read, then one
    ``stream_pages`` (or ``fetch``), then ``close``.
    """

    @abstractmethod
    def capabilities(self) -> SourceCapabilities:
        """What this configured source emits and guarantees. Pure: no I/O."""

    @abstractmethod
    async def fetch(self, ctx: FetchContext) -> Records:
        """Read every record after the start bookmark, at once.

        Blocks until the read ends. An empty result is an empty list, never an error; an unreachable
        endpoint, bad config or a malformed response raises a FaucetError. Sources that can page
        override ``stream_pages`` so large datasets never come through here.
        """

    def bookmark(self) -> JsonValue | None:
        """The bookmark reached by the last ``fetch``; attached by the default ``stream_pages`` to the
        final page. ``None`` for a source without a natural cursor."""
        return None

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        """Yield the records after the start bookmark in pages, in source order.

        With ``batch_size > 0`` no page holds more than ``batch_size`` records and a source that can
        page never holds the whole dataset; ``batch_size == 0`` means exactly one page. The default
        chunks ``fetch``; the bookmark rides on the final page (a native implementation should put one
        on every page so a crash loses at most one page of progress). The consumer may stop iterating
        at any page; pages it did not take are not considered delivered.
        """
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.connector_name)
        records = await self.fetch(ctx)
        total = record_count(records)
        if batch_size == 0 or total <= batch_size:
            yield Page(records, self.bookmark())
            return
        for start in range(0, total, batch_size):
            stop = min(start + batch_size, total)
            yield Page(slice_records(records, start, stop), self.bookmark() if stop == total else None)

    def state_key(self) -> str | None:
        """The key under which this source's bookmark is stored; ``None`` if it cannot resume."""
        return None

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        """Resume after ``bookmark`` (one this source emitted before). Called before reading.

        A bookmark this source cannot interpret raises :class:`ConfigError`; it is never ignored.
        """
        raise UnsupportedOperation(
            f"{self.connector_name} cannot resume from a bookmark", where=self.dataset_uri()
        )

    async def discover(self) -> Sequence[DiscoveredDataset]:
        """List the datasets this source can read. Only when ``capabilities().discover``."""
        raise UnsupportedOperation(f"{self.connector_name} does not discover", where=self.dataset_uri())

    async def enumerate_shards(self) -> Sequence[str]:
        """Stable names of independent shards (files, partitions). Only when ``capabilities().shardable``."""
        raise UnsupportedOperation(f"{self.connector_name} is not shardable", where=self.dataset_uri())

    def apply_shard(self, shard: str) -> None:
        """Restrict the next read to ``shard`` (one returned by ``enumerate_shards``)."""
        raise UnsupportedOperation(f"{self.connector_name} is not shardable", where=self.dataset_uri())

    async def capture_resume_position(self) -> JsonValue | None:
        """A bookmark for "now" (CDC: the current log position) taken before a snapshot read."""
        return None

    async def replay_pages(
        self, ctx: FetchContext, start: JsonValue | None, end: JsonValue | None, batch_size: int
    ) -> AsyncIterator[Page]:
        """Re-read what one run read, for ``faucet verify``: the records after bookmark ``start``
        (``None``: the beginning) up to and including bookmark ``end`` (``None``: the end of what the
        source holds now), in pages as ``stream_pages`` yields them (a shard applied before applies).
        Replaces any start bookmark applied before; reads nothing past ``end``.

        Side-effect free (commits no consumer offset, acknowledges nothing). Raises
        :class:`PositionUnavailable` when the source no longer holds the range (retention, a file
        modified since, rows the re-read cannot reach again), :class:`IncarnationChanged` when the
        source was re-created since, and :class:`UnsupportedOperation` (this default) when the
        connector cannot re-read a range: the run is then not verifiable at its source.
        """
        raise UnsupportedOperation(
            f"the {self.connector_name} source cannot re-read a run's range", where=self.dataset_uri()
        )
        yield  # an async generator, for its callers

    watermark_by_position: ClassVar[bool] = False
    """True when this source's pages have positions the atomic watermark can use as commit tokens:
    every page carries a bookmark, :meth:`watermark_position` maps it to a non-negative integer that
    grows with every page and names the same records on every read (a stream sequence), and
    :meth:`resume_after_position` starts the next read right after such a position, raising
    :class:`~faucet_dagster.protocol.errors.PositionUnavailable` when what follows it is gone. A
    source with positions declares them: a watermark that counts rows skips the wrong ones as soon
    as the start of the source moves (retention) between a crash and the rerun."""

    def watermark_position(self, bookmark: JsonValue) -> int:
        """The position ``bookmark`` (one of this source's) names. Only when ``watermark_by_position``."""
        raise UnsupportedOperation(
            f"{self.connector_name} has no watermark positions", where=self.dataset_uri()
        )

    def resume_after_position(self, position: int) -> None:
        """Start the next read right after ``position`` (the sink's watermark), whatever bookmark was
        applied. Called before reading. Only when ``watermark_by_position``."""
        raise UnsupportedOperation(
            f"{self.connector_name} has no watermark positions", where=self.dataset_uri()
        )


class Sink(Connector):
    """A bounded sink (FCP section 3).

    Records arrive as Arrow record batches (the pipeline converts JSON records). The write mode and
    key come from the sink's config; ``supported_write_modes`` lists only the modes really applied.
    """

    @abstractmethod
    def capabilities(self) -> SinkCapabilities:
        """What this configured sink can apply and promise. Pure: no I/O."""

    @abstractmethod
    async def write_batch(self, records: pa.RecordBatch) -> int:
        """Write ``records`` with the configured mode; return how many were written.

        When it returns, the records are visible to readers or will be after ``flush``. A failure
        raises a FaucetError and leaves no half-written batch reported as written.
        """

    async def flush(self) -> None:
        """Make every returned ``write_batch`` durable. Blocks until it is."""

    async def finish(self) -> None:
        """Complete the run after its last page was written and flushed.

        REPLACE swaps its fully loaded staging table in here, atomically, so readers see the old
        table or the new one, never an empty or half-loaded one. Not called when the run failed.
        """

    async def write_batch_partial(self, records: pa.RecordBatch) -> PartialResult:
        """Write the rows that can be written and report the others with their reasons.

        The default is all-or-nothing through ``write_batch``: a sink whose API has per-row results
        overrides it (and declares ``partial_results``) so a dead-letter route gets only failed rows.
        """
        return PartialResult(written=await self.write_batch(records))

    def supported_write_modes(self) -> frozenset[WritePolicy]:
        """The write modes this sink really applies; the CLI refuses a configured mode outside it."""
        return self.capabilities().bounded_policies

    def supports_idempotent_writes(self) -> bool:
        """True only if ``write_batch_idempotent`` commits records and token atomically."""
        return self.capabilities().atomic_watermark

    async def write_batch_idempotent(
        self, records: pa.RecordBatch, token: CommitToken, bookmark: JsonValue | None = None
    ) -> int:
        """Write ``records`` and store ``token`` in the same destination transaction.

        After it returns, ``last_committed_token()`` returns ``token`` durably. If the token is not
        newer than the stored one the records are not written and 0 is returned (a replayed page).
        A sink that declares ``watermark_bookmark`` stores ``bookmark`` (the page's) with the token, in
        the same transaction (the runner passes it only to such a sink).
        """
        raise UnsupportedOperation(f"{self.connector_name} has no atomic watermark", where=self.dataset_uri())

    async def last_committed_token(self) -> CommitToken | None:
        """The token stored by the last committed ``write_batch_idempotent``, read durably."""
        raise UnsupportedOperation(f"{self.connector_name} has no atomic watermark", where=self.dataset_uri())

    async def last_committed_bookmark(self) -> tuple[CommitToken, JsonValue | None] | None:
        """The token and bookmark stored by the last committed ``write_batch_idempotent`` (None:
        nothing committed yet), read durably. Only when ``capabilities().watermark_bookmark``."""
        raise UnsupportedOperation(
            f"{self.connector_name} keeps no bookmark with its watermark", where=self.dataset_uri()
        )

    def dedups_by_key(self) -> bool:
        """True when the live config upserts or deletes by a non-empty key."""
        return False

    def write_mode(self) -> tuple[WritePolicy, tuple[str, ...]]:
        """The write policy and key the live config applies; the bounded runner plans with them.

        Pure: no I/O. The default is the one bounded policy the capabilities declare when there is
        exactly one (else APPEND), without a key: a sink whose config chooses a keyed mode overrides
        it to return its key.
        """
        policies = self.capabilities().bounded_policies
        return (next(iter(policies)) if len(policies) == 1 else WritePolicy.APPEND), ()

    def scope_watermark(self, scope: str) -> bool:
        """Keep the commit tokens of the coming writes under ``scope``, apart from other scopes'.

        The bounded runner calls it before ``last_committed_token`` when a run covers one shard of a
        source (``scope`` is the shard), so every shard writing into the same destination has its own
        monotonic token sequence. Returns True when ``last_committed_token`` and
        ``write_batch_idempotent`` now use the watermark of ``scope``; False (the default) when the
        sink keeps one watermark only, and the runner then does not use the watermark for that run.
        Pure: no I/O.
        """
        return False

    async def current_schema(self) -> pa.Schema | None:
        """The destination's schema, or ``None`` when the destination does not exist yet."""
        return None

    async def row_count(self) -> int | None:
        """The destination's rows now (Dagster's ``dagster/row_count``), after ``finish``; ``None``
        when this sink cannot count them or the destination does not exist. Optional."""
        return None

    def commit_details(self) -> Mapping[str, int | str]:
        """Destination facts of the commits this sink made in the run, for the run's materialization
        metadata (a Delta table's ``{"delta/table_version": 7}``), after ``finish``.

        Pure: no I/O. Each value comes from what a commit of this sink returned, never read back from
        the destination (another writer may have committed since); a run that committed nothing has
        none. Keys are namespaced by the destination (``delta/...``); never a secret. Optional: the
        default has none.
        """
        return {}

    def supports_schema_evolution(self) -> bool:
        """True only if ``evolve_schema`` applies idempotent additive DDL."""
        return self.capabilities().schema_evolution

    async def evolve_schema(self, changes: Sequence[AddColumn]) -> None:
        """Apply additive changes with ADD COLUMN IF NOT EXISTS semantics (safe to repeat)."""
        raise UnsupportedOperation(f"{self.connector_name} does not evolve schemas", where=self.dataset_uri())


async def replay_to_bookmark(
    source: Source, ctx: FetchContext, start: JsonValue | None, end: JsonValue | None, batch_size: int
) -> AsyncIterator[Page]:
    """``Source.replay_pages`` for a source whose re-reads page exactly as its runs did: from
    ``start``, with the run's ``batch_size``, its pages carry the same bookmarks, the last one
    ``end`` (a deterministic source that pages by count, such as files read in a fixed order). The
    pages are yielded up to the one whose bookmark is ``end``; a source that ends without yielding
    it no longer holds what the run read (:class:`PositionUnavailable`)."""
    if start is not None:
        source.apply_start_bookmark(start)
    async for page in source.stream_pages(ctx, batch_size):
        yield page
        if end is not None and page.bookmark == end:
            return
    if end is not None:
        raise PositionUnavailable(
            "re-reading from the run's start bookmark did not reach its end bookmark: the source no "
            "longer holds what the run read (rows or files changed since)",
            where=source.dataset_uri(),
        )
