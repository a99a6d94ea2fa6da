"""What a stream's epochs published to NATS, read back for ``faucet verify`` (``StreamingSink.reader``).

Every row the sink published is a message on the target subject whose ``Nats-Msg-Id`` is the row's
event identity digest and whose payload is the row as JSON (:meth:`Publisher.publish`). The reader
reads the target stream's messages of the subject from the first one the compared epochs stored (their
receipts' first stream sequence; from just after the previous epoch's last, when a compared epoch's
receipt counts duplicates the stream suppressed: those were stored by an earlier, uncommitted attempt)
to the stream's last (a copy stored after the duplicate window is a duplicate too), through an
ephemeral consumer (the bounded source's session, reading raw messages), and matches them to the
expected rows by message id: an expected row with no message is *missing*, one whose message holds
another payload *changed*, one with several messages *duplicated* (stored again after the duplicate
window, which the sink documents). Messages of other ids (other publishers, other streams of the
subject) are not judged.

Cost: one read of the subject's messages from the compared epochs' first to the stream's last (those
of later epochs and other publishers included: verifying the newest certificates reads little), no
write; the watermark bucket is read, never created.
"""

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from faucet_dagster.protocol import (
    DEFAULT_DIFF_LIMIT,
    CancelToken,
    Control,
    DestinationDiff,
    DestinationReader,
    ExpectedRows,
    Identities,
    OrderingDomain,
    ReadLimits,
    Receipt,
    Records,
    SinkCommitState,
    StreamRecordSink,
)
from faucet_nats.config import NatsConnectionConfig, NatsSourceConfig
from faucet_nats.publisher import Publisher, json_default
from faucet_nats.sink_config import NatsSinkConfig
from faucet_nats.source import NatsStreamSession


class _Messages(StreamRecordSink):
    """Collects the raw messages a session reads: message id, payload, stream sequence."""

    def __init__(self) -> None:
        self.found: dict[str, list[tuple[bytes, int]]] = {}

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        assert isinstance(rows, pa.RecordBatch)  # the bytes format hands Arrow batches
        for headers, data, sequence in zip(
            rows.column("headers").to_pylist(),
            rows.column("data").to_pylist(),
            rows.column("sequence").to_pylist(),
            strict=True,
        ):
            ids = [item["value"] for item in headers or () if item["key"] == "Nats-Msg-Id"]
            if ids:
                self.found.setdefault(ids[0], []).append((data, sequence))

    async def control(self, control: Control) -> None:
        return None


async def _owner_always() -> None:
    """The reader's acknowledgements release its own ephemeral consumer's window only."""


class NatsDestinationReader(DestinationReader):
    """Reads back the messages a stream published; see the module docstring."""

    def __init__(
        self,
        config: NatsSinkConfig,
        stream: str,
        watermark: Callable[[], Awaitable[SinkCommitState | None]],
    ) -> None:
        self._config = config
        self._stream = stream
        self._watermark = watermark
        connection = {name: getattr(config, name) for name in NatsConnectionConfig.model_fields}
        self._source = NatsSourceConfig(
            **connection, stream=config.stream, subject=config.subject, format="bytes", bounded=True
        )

    async def committed(self) -> SinkCommitState | None:
        return await self._watermark()

    async def compare(self, expected: ExpectedRows, *, limit: int = DEFAULT_DIFF_LIMIT) -> DestinationDiff:
        rows = expected.rows.to_pylist()
        ids = [None if identity is None else identity.digest() for identity in expected.identities]
        span = await self._span(expected.receipts, expected.sequences)
        found = _Messages()
        if span is not None:
            await self._read(found, *span)
        missing: list[int] = []
        changed: list[tuple[int, dict[str, Any]]] = []
        duplicated: list[tuple[int, int]] = []
        unchecked: list[str] = []
        if any(msg_id is None for msg_id in ids):
            unchecked.append("rows without an event identity: a message is found by its Nats-Msg-Id")
        for index, (row, msg_id) in enumerate(zip(rows, ids, strict=True)):
            if msg_id is None:
                continue
            messages = found.found.get(msg_id, [])
            payload = json.dumps(row, default=json_default, separators=(",", ":")).encode()
            if not messages:
                missing.append(index)
                continue
            if len(messages) > 1:
                duplicated.append((index, len(messages) - 1))
            other = next((data for data, _ in messages if data != payload), None)
            if other is not None:
                changed.append((index, _payload(other, messages[0][1])))
        return DestinationDiff(
            compared=len(rows),
            missing=tuple(missing[:limit]),
            changed=tuple(changed[:limit]),
            duplicated=tuple(duplicated[:limit]),
            unchecked=tuple(unchecked),
            totals={"missing": len(missing), "changed": len(changed), "duplicated": len(duplicated)},
        )

    async def _span(
        self, receipts: Mapping[int, Receipt], sequences: Sequence[int]
    ) -> tuple[int, int] | None:
        """The stream sequences to read (first, last), or None when the epochs stored nothing here: from
        the first message the compared epochs stored (from just after the previous epoch's last, when
        one of them counts duplicates the stream suppressed) to the stream's last message (a copy
        stored later, past the duplicate window, is a duplicate too)."""
        stored = [receipt for sequence, receipt in receipts.items() if sequence in sequences]
        firsts = [int(r.details["first_sequence"]) for r in stored if "first_sequence" in r.details]
        earlier = [
            int(r.details["last_sequence"])
            for sequence, r in receipts.items()
            if sequence < sequences[0] and "last_sequence" in r.details
        ]
        suppressed = any(receipt.rows_skipped for receipt in stored)
        if not firsts and not suppressed:
            return None
        first = (max(earlier) + 1 if earlier else 1) if suppressed else min(firsts)
        return first, await self._last_sequence()

    async def _last_sequence(self) -> int:
        publisher = Publisher(self._config)
        try:
            await publisher.open()
            return await publisher.last_sequence()
        finally:
            await publisher.close()

    async def _read(self, sink: _Messages, first: int, last: int) -> None:
        session = await NatsStreamSession.open(
            self._source,
            (),
            owned=True,
            worker=None,
            durable=False,
            bounded=True,
            max_ack_pending=2 * self._source.chunk_messages,
            after=first - 1 if first > 1 else None,
            until=last,
        )
        limits = ReadLimits(records=2 * self._source.chunk_messages, bytes=None, idle=None, age=None)
        try:
            while not session.finished:
                coverage = await session.read(sink, limits, CancelToken())
                if coverage.empty:
                    break
                await session.acknowledge(coverage, _owner_always)
        finally:
            await session.close()


def _payload(data: bytes, sequence: int) -> dict[str, Any]:
    """A message's payload for a finding: the JSON object, else its text."""
    try:
        decoded = json.loads(data)
    except ValueError:
        return {"stream_sequence": sequence, "payload": data.decode("utf-8", "replace")}
    return decoded if isinstance(decoded, dict) else {"stream_sequence": sequence, "payload": decoded}


__all__ = ["NatsDestinationReader"]
