"""A certified offset range of one partition, re-read for ``faucet verify`` (``StreamSource.replay``).

The range is read with the reader the stream uses (:class:`~faucet_kafka.reader.KafkaReader`: its own
consumer, manually assigned, in no consumer group, committing nothing), decoded and handed over by the
same :class:`~faucet_kafka.deliver.Deliverer` as a session's reads, so rows, rejected records and
event identities are the ones the epoch had. Records at or past the range's end are dropped, and the
offsets skipped inside it are proven empty as a session's are (:meth:`KafkaReader.finish`).

Not replayable (:class:`PositionUnavailable`): the range starts below the partition's low watermark
(retention or a deletion removed its first records; for a range from the partition's beginning, any
low watermark above 0), or ends at or past its high watermark (the log was truncated). The topic
deleted and recreated (another topic id) raises :class:`IncarnationChanged`.
"""

import asyncio
from collections.abc import Mapping

from faucet_dagster.protocol import (
    CancelToken,
    ConfigError,
    ConnectionFailed,
    DomainCoverage,
    FaucetError,
    IncarnationChanged,
    IntegrityError,
    JsonValue,
    Position,
    PositionUnavailable,
    StreamRecordSink,
)
from faucet_kafka.client import TopicPartitionKey, offsets_of, where_of
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.deliver import Deliverer
from faucet_kafka.reader import CODEC, KafkaReader


async def replay_range(
    config: KafkaSourceConfig, coverage: DomainCoverage, sink: StreamRecordSink, cancel: CancelToken
) -> None:
    """Write the records of ``coverage`` (one partition, after ``start`` up to ``end``) into ``sink``."""
    domain = coverage.domain
    try:
        key = (domain.resource, int(domain.partition))
    except ValueError:
        raise IntegrityError(f"partition {domain.partition!r} is not a number", where=str(domain)) from None
    where = where_of(*key)
    stop = CODEC.validate(coverage.end) + 1
    resume = [] if coverage.start is None else [Position(domain, coverage.start)]
    reader = KafkaReader(config, "replay")
    try:
        await reader.open([key[0]], lambda topic, partition: (topic, partition) == key, resume, "beginning")
        state = reader.parts.get(key)
        if state is None:
            raise PositionUnavailable("the partition of the certified range no longer exists", where=where)
        if state.domain.incarnation != domain.incarnation:
            raise IncarnationChanged(
                f"the topic is incarnation {state.domain.incarnation} now, the certified range belongs to "
                f"{domain.incarnation} (deleted and re-created): its offsets are another log",
                where=where,
            )
        if coverage.start is None and state.next_offset > 0:
            raise PositionUnavailable(
                f"the range starts at the partition's beginning, whose first records were deleted: the "
                f"partition starts at offset {state.next_offset} now",
                where=where,
            )
        high = reader.high_watermarks[key]
        if high < stop:
            raise PositionUnavailable(
                f"the certified range ends at offset {stop - 1}, the partition at {high - 1}: the log was "
                "truncated",
                where=where,
            )
        await _read(reader, config, key, stop, sink, cancel)
    finally:
        await reader.close()


async def _read(
    reader: KafkaReader,
    config: KafkaSourceConfig,
    key: tuple[str, int],
    stop: int,
    sink: StreamRecordSink,
    cancel: CancelToken,
) -> None:
    state = reader.parts[key]
    deliverer = Deliverer(config)
    tracker = reader.tracker()
    loop = asyncio.get_running_loop()
    progressed = loop.time()
    next_offset = state.next_offset
    while next_offset < stop and not cancel.cancelled:
        messages = await reader.poll(config.batch_size, config.poll_timeout)
        for part, batch in reader.group(messages).items():
            offsets = offsets_of(batch)
            kept = sum(1 for offset in offsets if offset < stop)
            batch, offsets = batch[:kept], offsets[:kept]
            if not batch:
                continue
            tracker.observe(part, offsets)
            await deliverer.write(sink, state, batch, offsets, deliverer.decode(state, batch))
        position = (await reader.positions([key]))[key]
        if position > next_offset:
            next_offset, progressed = position, loop.time()
        elif loop.time() - progressed > config.request_timeout:
            raise ConnectionFailed(
                f"the re-read stopped at offset {next_offset} for {config.request_timeout:g}s, short of the "
                f"range's end {stop - 1}",
                where=where_of(*key),
            )
    if key in tracker.last and not cancel.cancelled:
        await reader.finish(tracker, [key], {key: stop})


def end_offsets(end: JsonValue, where: str) -> dict[TopicPartitionKey, int]:
    """A bounded run's end bookmark as the offsets its re-read stops before, per partition."""
    try:
        assert isinstance(end, dict) and isinstance(end["positions"], list)
        return {
            (str(item["topic"]), int(str(item["partition"]))): CODEC.validate(item["offset"]) + 1
            for item in end["positions"]
            if isinstance(item, dict)
        }
    except (AssertionError, KeyError, TypeError, ValueError, FaucetError):
        raise ConfigError("the end bookmark is not one the bounded Kafka source wrote", where=where) from None


def replay_stops(
    reader: KafkaReader, stops: Mapping[TopicPartitionKey, int] | None
) -> dict[TopicPartitionKey, int]:
    """Where a bounded read stops per partition: the high watermarks captured at its start, or, for a
    re-read (``stops``), the run's end offsets (a partition the run did not reach: where it starts)."""
    highs = dict(reader.high_watermarks)
    if stops is None:
        return highs
    return {key: min(high, stops.get(key, reader.parts[key].next_offset)) for key, high in highs.items()}


def check_reached(end: JsonValue | None, reached: JsonValue | None, where: str) -> None:
    """After a re-read up to ``end``: every partition reached its end offset in the same topic
    incarnation, or the topic no longer holds the run's records."""
    wanted = _positions(end)
    found = {(item["topic"], item["partition"]): item for item in _positions(reached)}
    for item in wanted:
        got = found.get((item["topic"], item["partition"]))
        if got is not None and got.get("incarnation") != item.get("incarnation"):
            raise IncarnationChanged(
                f"topic {item['topic']} is incarnation {got.get('incarnation')} now, the run read "
                f"{item.get('incarnation')} (deleted and re-created)",
                where=where,
            )
        if got is None or got.get("offset") != item.get("offset"):
            raise PositionUnavailable(
                f"the re-read of {item['topic']}/{item['partition']} ended at offset "
                f"{None if got is None else got.get('offset')}, the run at {item.get('offset')}: the log "
                "was truncated or the topic re-created",
                where=where,
            )


def _positions(bookmark: JsonValue | None) -> list[dict[str, JsonValue]]:
    """The ``positions`` items of a bounded Kafka bookmark (none for anything else)."""
    items = bookmark.get("positions") if isinstance(bookmark, dict) else None
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


__all__ = ["check_reached", "end_offsets", "replay_range", "replay_stops"]
