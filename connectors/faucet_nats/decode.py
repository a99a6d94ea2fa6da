"""NATS messages to rows, in bulk: JSON objects (parsed by Arrow when columns are declared) or bytes.

A message that cannot become a row (not JSON, not an object, or, with declared columns, not fitting
them) is returned as a :class:`JsonRun` without rows, with the reason, never dropped: the caller applies
the ``on_malformed`` policy. JSON payloads are decoded by the protocol's :class:`JsonRows`, as the
Kafka source's are.
"""

from collections.abc import Mapping, Sequence

import pyarrow as pa

from faucet_dagster.protocol.json_rows import JsonRows, JsonRun
from faucet_nats.chunks import DATA, HEADERS, SUBJECT, Delivery
from faucet_nats.config import HEADER_TYPE, RAW_SCHEMA, NatsSourceConfig

_NANOS = pa.timestamp("ns", tz="UTC")
_STAMP = pa.timestamp("us", tz="UTC")


class Decoder:
    """Decodes runs of messages of one stream in the configured format."""

    def __init__(self, config: NatsSourceConfig) -> None:
        self._format = config.format
        self._stream = config.stream
        self._json = JsonRows(config.declared_schema() if config.format == "json" else None)

    @property
    def needs_stamps(self) -> bool:
        """True when rows carry the server timestamp (parsed from the acknowledgement subjects)."""
        return self._format == "bytes"

    def decode(
        self, msgs: Sequence[Delivery], seqs: pa.Int64Array, stamps: pa.Int64Array | None
    ) -> list[JsonRun]:
        """Decode ``msgs`` (stream sequences ``seqs``) into runs of rows and malformed messages."""
        if self._format == "bytes":
            assert stamps is not None  # needs_stamps
            return [JsonRun(0, len(msgs), self._raw(msgs, seqs, stamps))]
        return self._json.decode([msg[DATA] for msg in msgs])

    def _raw(self, msgs: Sequence[Delivery], seqs: pa.Int64Array, stamps: pa.Int64Array) -> pa.RecordBatch:
        count = len(msgs)
        headers = [None if msg[HEADERS] is None else _header_items(msg[HEADERS]) for msg in msgs]
        columns = [
            pa.array([msg[SUBJECT] for msg in msgs], pa.string()),
            pa.array([msg[DATA] for msg in msgs], pa.binary()),
            pa.array(headers, HEADER_TYPE),
            # Microseconds: what PostgreSQL and Python datetimes hold.
            stamps.cast(_NANOS).cast(_STAMP, safe=False),
            pa.repeat(pa.scalar(self._stream, pa.string()), count),
            seqs,
        ]
        return pa.RecordBatch.from_arrays(columns, schema=RAW_SCHEMA)


def _header_items(headers: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"key": key, "value": value} for key, value in headers.items()]
