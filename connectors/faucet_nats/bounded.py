"""The bounded NATS source: one finite read, from the bookmark to the stream's last sequence at the start.

An ephemeral consumer reads through a :class:`~faucet_nats.source.NatsStreamSession`, in pages whose
bookmark is the last sequence they hold.
"""

from collections.abc import AsyncIterator
from typing import Any

import pyarrow as pa

from faucet_dagster.protocol import (
    CancelToken,
    ConfigError,
    Control,
    FetchContext,
    Identities,
    IntegrityError,
    JsonValue,
    OrderingDomain,
    Page,
    Position,
    ReadLimits,
    Records,
    Source,
    SourceCapabilities,
    StreamRecordSink,
)
from faucet_nats.config import NatsSourceConfig
from faucet_nats.jetstream import JetStreamApi, connect
from faucet_nats.replay import check_beginning, check_replayed
from faucet_nats.source import CODEC, NatsStreamSession, capabilities, close_client, stream_facts, where_of


class _PageCollector(StreamRecordSink):
    """Collects what one read of a bounded session writes, as one page's records."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._parts: list[Records] = []

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        self._parts.append(rows)

    async def control(self, control: Control) -> None:
        return None

    def take(self) -> Records:
        parts, self._parts = self._parts, []
        if parts and all(isinstance(part, pa.RecordBatch) for part in parts):
            return pa.concat_batches([part for part in parts if isinstance(part, pa.RecordBatch)])
        rows: list[Any] = []
        for part in parts:
            if isinstance(part, pa.RecordBatch):
                raise IntegrityError("a page mixes Arrow batches and JSON rows", where=self._where)
            rows.extend(part)
        return rows


async def _owner_always() -> None:
    """A bounded read's acknowledgements only release its own ephemeral consumer's window."""


class NatsSource(Source):
    """The bounded NATS source: from the bookmark to the stream's last sequence at the start.

    Bookmark: ``{"stream", "subject", "incarnation", "sequence"}`` (the last sequence read). A
    malformed payload raises DataError (a bounded read has no dead-letter route for source records).

    Watermark positions: a page's position is its bookmark's stream sequence, so a commit-token sink
    stores the last sequence it holds, and a rerun resumes right after it (or fails with
    :class:`PositionUnavailable` when retention removed what follows). The token carries no
    incarnation: after the stream is deleted and recreated, a destination holding the old stream's
    token must be reset, or a rerun without a bookmark would resume past the new stream's start.
    """

    connector_name = "nats"
    config_model = NatsSourceConfig
    watermark_by_position = True

    def __init__(self, config: NatsSourceConfig) -> None:
        self.config = config
        self._start: Position | None = None
        self._after: int | None = None
        self._until: int | None = None
        self._bookmark: JsonValue | None = None

    def capabilities(self) -> SourceCapabilities:
        return capabilities(self.config, continuous=False)

    def dataset_uri(self) -> str:
        server = self.config.servers[0].split("://", 1)[-1].split(",")[0]
        subject = f"/{self.config.subject}" if self.config.subject else ""
        return f"nats://{server}/{self.config.stream}{subject}"

    def state_key(self) -> str:
        return f"nats:{self.config.stream}:{self.config.subject or '>'}"

    def bookmark(self) -> JsonValue | None:
        return self._bookmark

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        config = self.config
        if not isinstance(bookmark, dict) or set(bookmark) != {
            "stream",
            "subject",
            "incarnation",
            "sequence",
        }:
            raise ConfigError(f"not a NATS bookmark: {bookmark!r}", where=where_of(config))
        if bookmark["stream"] != config.stream or (bookmark["subject"] or "") != config.partition:
            raise ConfigError(
                f"the bookmark belongs to stream {bookmark['stream']!r} subject {bookmark['subject']!r}",
                where=where_of(config),
            )
        incarnation = bookmark["incarnation"]
        if not isinstance(incarnation, str):
            raise ConfigError(f"not a NATS bookmark: {bookmark!r}", where=where_of(config))
        domain = OrderingDomain(config.source_name, config.stream, config.partition, incarnation, CODEC.name)
        self._start = Position(domain, CODEC.canonicalize(CODEC.validate(bookmark["sequence"])))
        self._bookmark = bookmark

    def watermark_position(self, bookmark: JsonValue) -> int:
        if not isinstance(bookmark, dict) or "sequence" not in bookmark:
            raise ConfigError(f"not a NATS bookmark: {bookmark!r}", where=where_of(self.config))
        return CODEC.validate(bookmark["sequence"])

    def resume_after_position(self, position: int) -> None:
        self._after = CODEC.validate(position)

    async def check(self) -> None:
        client = await connect(self.config, where=where_of(self.config))
        try:
            await stream_facts(JetStreamApi(client, self.config), self.config, known_incarnation=False)
        finally:
            await close_client(client, where_of(self.config))

    async def replay_pages(
        self, ctx: FetchContext, start: JsonValue | None, end: JsonValue | None, batch_size: int
    ) -> AsyncIterator[Page]:
        """Re-read one run's messages, after ``start``'s sequence up to ``end``'s (:mod:`faucet_nats.replay`
        says when they are no longer there), for ``faucet verify``."""
        self._start = self._after = None
        if start is not None:
            self.apply_start_bookmark(start)
        else:
            await check_beginning(self.config, where_of(self.config))
        self._until = None if end is None else self.watermark_position(end)
        last: JsonValue | None = None
        async for page in self.stream_pages(ctx, batch_size):
            last = page.bookmark
            yield page
        check_replayed(end, last, where_of(self.config))

    async def fetch(self, ctx: FetchContext) -> Records:
        pages = [page.records async for page in self.stream_pages(ctx, 0)]
        if not pages:
            return []
        return pages[0]

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        """Pages of at most ``batch_size`` messages (one page when 0), each with its bookmark.

        At most about two pages are held in memory: the consumer's acknowledgement window.
        """
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=where_of(self.config))
        config = self.config
        session = await NatsStreamSession.open(
            config,
            () if self._start is None else (self._start,),
            owned=True,
            worker=None,
            durable=False,
            bounded=True,
            max_ack_pending=-1 if batch_size == 0 else max(2 * batch_size, config.chunk_messages),
            after=self._after,
            until=self._until,
        )
        collector = _PageCollector(where_of(config))
        limits = ReadLimits(records=batch_size or None, bytes=None, idle=None, age=None)
        try:
            while True:
                coverage = await session.read(collector, limits, CancelToken())
                if coverage.empty:
                    if not session.finished:
                        raise IntegrityError(
                            "the bounded read stopped before its end", where=where_of(config)
                        )
                    return
                end = coverage.domains[0].end
                self._bookmark = {
                    "stream": config.stream,
                    "subject": config.subject,
                    "incarnation": session.domain.incarnation,
                    "sequence": int(end),
                }
                yield Page(collector.take(), self._bookmark)
                await session.acknowledge(coverage, _owner_always)
        finally:
            await session.close()
