"""The bounded Kafka source: one finite read of a topic's partitions, from a bookmark up to the high
watermarks captured when the read starts (positions and identity as in :mod:`faucet_kafka.source`).
"""

import bisect
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import cast

import pyarrow as pa
from confluent_kafka.admin import AdminClient

from faucet_dagster.protocol import (
    ConfigError,
    DataError,
    DiscoveredDataset,
    FetchContext,
    IntegrityError,
    JsonValue,
    OrderingDomain,
    Page,
    Position,
    Records,
    Source,
    SourceCapabilities,
)
from faucet_kafka.client import (
    ClientThread,
    TopicPartitionKey,
    client_settings,
    dataset_uri,
    describe,
    list_topics,
    offsets_of,
    partitions_of,
)
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.decode import raw_schema
from faucet_kafka.deliver import Deliverer
from faucet_kafka.reader import CODEC, Fallback, KafkaReader, ReadTracker
from faucet_kafka.replay import check_reached, end_offsets, replay_stops
from faucet_kafka.source import capabilities


class KafkaSource(Source):
    """The bounded Kafka source: from the bookmark (else the group's committed offsets, else the
    beginning) up to the high watermarks captured when the read starts.

    Bookmark: ``{"positions": [{"topic", "partition", "incarnation", "offset"}]}`` with the last
    offset read per partition; a bookmark of another topic incarnation raises IncarnationChanged.
    Shards are partitions (``topic/partition``). Pages hold at most ``batch_size`` records and carry
    a bookmark each. The bounded contract has no channel for records that cannot become rows, so
    ``on_malformed: dead_letter`` is refused here (a malformed record halts with DataError).
    """

    connector_name = "kafka"
    config_model = KafkaSourceConfig

    def __init__(self, config: KafkaSourceConfig) -> None:
        self.config = config
        self._start: list[Position] = []
        self._shard: TopicPartitionKey | None = None
        self._reached: JsonValue | None = None
        self._fallback: Fallback = "committed"
        self._stops: dict[TopicPartitionKey, int] | None = None
        """A replay's end offsets (exclusive): ``faucet verify`` re-reads a run's range."""

    def capabilities(self) -> SourceCapabilities:
        return capabilities(self.config, continuous=False)

    def dataset_uri(self) -> str:
        return dataset_uri(self.config)

    def state_key(self) -> str:
        key = f"kafka/{self.config.group_id}/{'+'.join(self.config.topics)}"
        return key if self._shard is None else f"{key}/{self._shard[0]}/{self._shard[1]}"

    def apply_start_bookmark(self, bookmark: JsonValue) -> None:
        # Checked with if, never assert: a bookmark is runtime input, and ``python -O`` drops asserts.
        wrong = ConfigError(
            "the bookmark is not one this source wrote ({'positions': [{topic, partition, "
            "incarnation, offset}]})",
            where=self.dataset_uri(),
        )
        items = bookmark.get("positions") if isinstance(bookmark, dict) else None
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise wrong
        try:
            self._start = [
                Position(
                    OrderingDomain(
                        self.config.source_name,
                        str(item["topic"]),
                        str(int(str(item["partition"]))),
                        str(item["incarnation"]),
                        CODEC.name,
                    ),
                    CODEC.canonicalize(CODEC.validate(item["offset"])),
                )
                for item in cast(list[dict[str, JsonValue]], items)
            ]
        except (KeyError, TypeError, ValueError, DataError):
            raise wrong from None

    def bookmark(self) -> JsonValue | None:
        return self._reached

    async def enumerate_shards(self) -> Sequence[str]:
        described = await partitions_of(self.config, self.config.topics)
        return [f"{topic}/{partition}" for topic in self.config.topics for partition in described[topic]]

    def apply_shard(self, shard: str) -> None:
        topic, _, partition = shard.rpartition("/")
        if topic not in self.config.topics or not partition.isdigit():
            raise ConfigError(
                f"{shard!r} is not a shard of this source (topic/partition)", where=self.dataset_uri()
            )
        self._shard = (topic, int(partition))

    async def discover(self) -> Sequence[DiscoveredDataset]:
        thread = ClientThread("faucet-kafka-discover")
        try:
            admin = AdminClient(client_settings(self.config))
            names = await thread.call(list_topics, admin, self.config.request_timeout, self.dataset_uri())
            _, described = await thread.call(
                describe, admin, names, self.config.request_timeout, self.dataset_uri()
            )
        finally:
            await thread.close()
        schema = (
            self.config.declared_schema()
            if self.config.format == "json"
            else raw_schema(self.config.format == "text")
        )
        return [
            DiscoveredDataset(
                name, schema, {"partitions": str(len(info.partitions)), "topic_id": info.topic_id}
            )
            for name, info in described.items()
            if info is not None
        ]

    async def check(self) -> None:
        await partitions_of(self.config, self.config.topics)

    async def fetch(self, ctx: FetchContext) -> Records:
        pages = [page.records async for page in self.stream_pages(ctx, 0)]
        return pages[0] if pages else []

    async def replay_pages(
        self, ctx: FetchContext, start: JsonValue | None, end: JsonValue | None, batch_size: int
    ) -> AsyncIterator[Page]:
        """Re-read one run's records, after ``start``'s offsets (the partitions' beginnings when None)
        up to ``end``'s, for ``faucet verify`` (:mod:`faucet_kafka.replay`)."""
        self._start, self._fallback, self._stops = [], "beginning", None
        if start is not None:
            self.apply_start_bookmark(start)
        if end is not None:
            self._stops = end_offsets(end, self.dataset_uri())
        async for page in self.stream_pages(ctx, batch_size):
            yield page
        check_reached(end, self._reached, self.dataset_uri())

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        """Read every partition (or the shard) from its start to the high watermark captured at start.

        The records after that watermark are left for the next run. Each page ends with every
        partition it read proven gap-free and carries the bookmark reached after it.
        """
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.dataset_uri())
        if self.config.on_malformed == "dead_letter":
            raise ConfigError(
                "a bounded Kafka read cannot route unparseable records to a dead-letter route; "
                "use on_malformed: halt",
                where=self.dataset_uri(),
            )
        shard = self._shard
        reader = KafkaReader(self.config, "bounded")
        try:
            await reader.open(
                self.config.topics,
                lambda topic, partition: shard is None or (topic, partition) == shard,
                self._start,
                self._fallback,
            )
            stops = replay_stops(reader, self._stops)
            deliverer = Deliverer(self.config)
            remaining = {key for key, state in reader.parts.items() if state.next_offset < stops[key]}
            self._reached = self._bookmark(reader)
            yielded = False
            while remaining:
                page, tracker = await self._read_page(reader, deliverer, stops, remaining, batch_size)
                ends = await reader.finish(tracker, list(tracker.last), stops)
                reader.advance(ends)
                self._reached = self._bookmark(reader)
                if page:
                    yielded = True
                    yield Page(_concat(page), self._reached)
            if not yielded:
                yield Page([], self._reached)
        finally:
            await reader.close()

    async def _read_page(
        self,
        reader: KafkaReader,
        deliverer: Deliverer,
        stops: Mapping[TopicPartitionKey, int],
        remaining: set[TopicPartitionKey],
        batch_size: int,
    ) -> tuple[list[Records], ReadTracker]:
        """Records up to ``batch_size`` (0: all), dropping anything at or past a partition's stop."""
        tracker = reader.tracker()
        page: list[Records] = []
        rows = 0
        while remaining and (batch_size == 0 or rows < batch_size):
            want = (
                self.config.batch_size if batch_size == 0 else min(self.config.batch_size, batch_size - rows)
            )
            messages = await reader.poll(want, self.config.poll_timeout)
            for key, batch in reader.group(messages).items():
                stop = stops[key]
                offsets = offsets_of(batch)
                if offsets[-1] >= stop:
                    cut = bisect.bisect_left(offsets, stop)
                    batch, offsets = batch[:cut], offsets[:cut]
                if not batch:
                    continue
                tracker.observe(key, offsets)
                for run in deliverer.decode(reader.parts[key], batch):
                    if (
                        run.rows is None
                    ):  # dead_letter is refused above: under halt, a run without rows raised
                        raise IntegrityError("a malformed record reached the page", where=self.dataset_uri())
                    page.append(run.rows)
                    rows += run.stop - run.start
            positions = await reader.positions(remaining)
            done = [key for key, position in positions.items() if position >= stops[key]]
            if done:
                await reader.pause(done)
                remaining.difference_update(done)
        return page, tracker

    @staticmethod
    def _bookmark(reader: KafkaReader) -> JsonValue:
        return {
            "positions": [
                {
                    "topic": state.topic,
                    "partition": state.partition,
                    "incarnation": state.domain.incarnation,
                    "offset": state.boundary,
                }
                for state in reader.parts.values()
                if state.boundary is not None
            ]
        }


def _concat(parts: list[Records]) -> Records:
    """One page's records: JSON objects joined in one list, or Arrow batches in one batch."""
    if isinstance(parts[0], pa.RecordBatch):
        return pa.concat_batches([part for part in parts if isinstance(part, pa.RecordBatch)])
    return [row for part in parts for row in part]
