"""Kafka messages of one partition to rows, in bulk: JSON objects (parsed by Arrow when columns are
declared), or Arrow columns of bytes or text.

A message that cannot become a row (not JSON, not an object, not UTF-8, a tombstone in JSON mode, not
fitting the declared columns) is returned as a :class:`JsonRun` without rows, with the reason, never
dropped: the caller applies the ``on_malformed`` policy. JSON values are decoded by the protocol's
:class:`JsonRows`, as the NATS source's payloads are.
"""

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

from faucet_dagster.protocol.json_rows import JsonRows, JsonRun
from faucet_kafka.client import offsets_of
from faucet_kafka.config import KafkaSourceConfig

HEADER_TYPE = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))


def raw_schema(text: bool) -> pa.Schema:
    """The columns of the ``bytes`` (``text`` False) and ``text`` formats."""
    payload = pa.string() if text else pa.binary()
    return pa.schema(
        [
            pa.field("key", payload),
            pa.field("value", payload),
            pa.field("headers", HEADER_TYPE),
            pa.field("timestamp", pa.timestamp("ms", tz="UTC")),
            pa.field("topic", pa.string(), nullable=False),
            pa.field("partition", pa.int32(), nullable=False),
            pa.field("offset", pa.int64(), nullable=False),
        ]
    )


RAW_COLUMNS: tuple[str, ...] = tuple(raw_schema(False).names)


def row_columns(config: KafkaSourceConfig) -> tuple[str, ...] | None:
    """The columns of the rows ``config`` produces, when they are known before reading."""
    if config.format != "json":
        return RAW_COLUMNS
    schema = config.declared_schema()
    return None if schema is None else tuple(schema.names)


class Decoder:
    """Decodes runs of one partition's messages in the configured format."""

    def __init__(self, config: KafkaSourceConfig) -> None:
        self._format = config.format
        self._json = JsonRows(config.declared_schema(), noun="value")
        self.parses_columns = config.format == "json" and self._json.schema is not None
        """True when whole runs are parsed by Arrow into the declared columns (rows are batches)."""

    def decode(self, messages: Sequence[Message]) -> list[JsonRun]:
        """Decode ``messages`` (one partition, in offset order) into runs of rows and malformed ones."""
        if self._format == "json":
            return self._json.decode(list(map(Message.value, messages)))
        return _decode_raw(messages, text=self._format == "text")


def _decode_raw(messages: Sequence[Message], *, text: bool) -> list[JsonRun]:
    keep: list[Message] = []
    keys: list[Any] = []
    values: list[Any] = []
    malformed: list[JsonRun] = []
    for index, message in enumerate(messages):
        key: Any = message.key()
        value: Any = message.value()
        if text:
            try:
                key = None if key is None else key.decode()
                value = None if value is None else value.decode()
            except UnicodeDecodeError as exc:
                reason = f"the key or value is not UTF-8 text: {exc}"
                malformed.append(JsonRun(index, index + 1, None, reason))
                continue
        keep.append(message)
        keys.append(key)
        values.append(value)
    schema = raw_schema(text)
    stamps = [message.timestamp() for message in keep]
    headers: list[Any] = [message.headers() for message in keep]
    columns = [
        pa.array(keys, schema.field("key").type),
        pa.array(values, schema.field("value").type),
        pa.array(
            [None if items is None else [{"key": k, "value": v} for k, v in items] for items in headers],
            HEADER_TYPE,
        ),
        pa.array(
            [None if kind == TIMESTAMP_NOT_AVAILABLE else millis for kind, millis in stamps],
            schema.field("timestamp").type,
        ),
        pa.array([message.topic() for message in keep], pa.string()),
        pa.array([message.partition() for message in keep], pa.int32()),
        pa.array(offsets_of(keep), pa.int64()),
    ]
    rows = pa.RecordBatch.from_arrays(columns, schema=schema)
    if not malformed:
        return [JsonRun(0, len(messages), rows)]
    runs: list[JsonRun] = []
    start = kept = 0
    for bad in malformed:
        if start < bad.start:
            runs.append(JsonRun(start, bad.start, rows.slice(kept, bad.start - start)))
            kept += bad.start - start
        runs.append(bad)
        start = bad.stop
    if start < len(messages):
        runs.append(JsonRun(start, len(messages), rows.slice(kept)))
    return runs
