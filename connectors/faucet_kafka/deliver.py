"""A partition's Kafka messages to the pipeline: decoded in bulk (:mod:`faucet_kafka.decode`), the
``on_malformed`` policy applied (``halt``: a DataError naming topic, partition and offset;
``dead_letter``: a rejected record with the raw value), rows written in offset order with their
offsets as positions. Shared by the continuous and the bounded source.
"""

import asyncio
from collections.abc import Sequence

import pyarrow as pa
from confluent_kafka import Message

from faucet_dagster.protocol import (
    DataError,
    EventIdentity,
    Identities,
    RejectedRecord,
    StreamRecordSink,
)
from faucet_dagster.protocol.json_rows import JsonRun
from faucet_kafka.client import (
    where_of,
)
from faucet_kafka.config import KafkaSourceConfig
from faucet_kafka.decode import Decoder
from faucet_kafka.reader import PartitionState

INLINE_DECODE_MESSAGES = 512
"""Consume batches up to this many messages are decoded on the event loop (the hand-off to a worker
thread would cost more than parsing them)."""


class Deliverer:
    """Decodes one partition's messages and hands rows (and malformed records) to their destination."""

    def __init__(self, config: KafkaSourceConfig) -> None:
        self.config = config
        self._decoder = Decoder(config)

    def decode(self, state: PartitionState, messages: Sequence[Message]) -> list[JsonRun]:
        """Decode ``messages``; with the ``halt`` policy a malformed one raises DataError naming it."""
        runs = self._decoder.decode(messages)
        if self.config.on_malformed == "halt":
            self._halt_on_malformed(state, messages, runs)
        return runs

    async def decode_all(
        self, batches: Sequence[tuple[PartitionState, Sequence[Message]]]
    ) -> list[list[JsonRun]]:
        """:meth:`decode` each partition's batch, in a worker thread when they hold more than
        ``INLINE_DECODE_MESSAGES`` messages: Arrow parses without the GIL, so the event loop meanwhile
        drives the sink's write in flight (the COPY of the batch before) instead of waiting for it.

        With declared columns the partitions' batches are parsed in one Arrow call (one fixed cost
        per consume batch, not per partition) and its runs cut back at the partitions' boundaries:
        the same rows, reasons and errors as each batch decoded alone."""

        def decode() -> list[list[JsonRun]]:
            if len(batches) > 1 and self._decoder.parses_columns:
                return self._decode_joined(batches)
            return [self.decode(state, messages) for state, messages in batches]

        if sum(len(messages) for _, messages in batches) <= INLINE_DECODE_MESSAGES:
            return decode()
        return await asyncio.to_thread(decode)

    def _decode_joined(
        self, batches: Sequence[tuple[PartitionState, Sequence[Message]]]
    ) -> list[list[JsonRun]]:
        joined = [message for _, messages in batches for message in messages]
        runs = self._decoder.decode(joined)
        decoded: list[list[JsonRun]] = []
        index = base = 0
        for state, messages in batches:
            stop = base + len(messages)
            mine: list[JsonRun] = []
            while index < len(runs) and runs[index].start < stop:
                run = runs[index]
                first, last = max(run.start, base), min(run.stop, stop)
                rows = run.rows
                if isinstance(rows, pa.RecordBatch):
                    rows = rows.slice(first - run.start, last - first)
                mine.append(JsonRun(first - base, last - base, rows, run.reason))
                if run.stop > stop:
                    break  # the run goes on into the next partition's batch
                index += 1
            if self.config.on_malformed == "halt":
                self._halt_on_malformed(state, messages, mine)
            decoded.append(mine)
            base = stop
        return decoded

    def _halt_on_malformed(
        self, state: PartitionState, messages: Sequence[Message], runs: list[JsonRun]
    ) -> None:
        for run in runs:
            if run.rows is None:
                where = where_of(state.topic, state.partition, messages[run.start].offset())
                raise DataError(run.reason, where=where)

    async def write(
        self,
        sink: StreamRecordSink,
        state: PartitionState,
        messages: Sequence[Message],
        offsets: list[int],
        runs: Sequence[JsonRun],
    ) -> None:
        """Write the decoded ``runs`` of ``messages`` (at ``offsets``) to ``sink``, rejecting malformed
        ones, in offset order."""
        positions = list(map(str, offsets))
        for run in runs:
            if run.rows is not None:
                if run.start or run.stop != len(positions):
                    ids = Identities(positions[run.start : run.stop])
                else:
                    ids = Identities(positions)
                await sink.write(state.domain, run.rows, ids)
                continue
            offset = offsets[run.start]
            await sink.reject(
                RejectedRecord(
                    EventIdentity(state.domain, positions[run.start]),
                    run.reason,
                    messages[run.start].value() or b"",
                    where_of(state.topic, state.partition, offset),
                )
            )
