"""Kafka messages of one partition to rows, in bulk: JSON objects, or Arrow columns of bytes or text.

A message that cannot become a row (not JSON, not an object, not UTF-8, a tombstone in JSON mode) is
returned as a :class:`Malformed` entry with its index, never dropped: the caller applies the
``on_malformed`` policy.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

from faucet_dagster.protocol import Records
from faucet_kafka.client import offsets_of

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


@dataclass(frozen=True)
class Malformed:
    """Message ``index`` of the decoded run cannot become a row, for ``reason``."""

    index: int
    reason: str


@dataclass(frozen=True)
class Decoded:
    """The rows of a run of messages of one partition, their offsets, and the messages that failed.

    ``rows`` holds the good messages in order; ``offsets[i]`` is the offset of ``rows`` row ``i``.
    """

    rows: Records
    offsets: list[int]
    malformed: list[Malformed]


def decode(messages: Sequence[Message], fmt: Literal["json", "bytes", "text"]) -> Decoded:
    """Decode ``messages`` (one partition, in offset order) in the configured format."""
    if fmt == "json":
        return _decode_json(messages)
    return _decode_raw(messages, text=fmt == "text")


def _decode_json(messages: Sequence[Message]) -> Decoded:
    rows: list[dict[str, Any]] = []
    kept: list[Message] = []
    malformed: list[Malformed] = []
    loads = json.loads
    for index, message in enumerate(messages):
        value = message.value()
        if value is None:
            malformed.append(Malformed(index, "the message has no value (a tombstone), not a JSON object"))
            continue
        try:
            row = loads(value)
        except (ValueError, UnicodeDecodeError) as exc:
            malformed.append(Malformed(index, f"the value is not JSON: {exc}"))
            continue
        except RecursionError:
            malformed.append(Malformed(index, "the value is JSON nested too deeply to decode"))
            continue
        if type(row) is not dict:
            malformed.append(Malformed(index, f"the value is JSON {type(row).__name__}, not an object"))
            continue
        rows.append(row)
        kept.append(message)
    return Decoded(rows, offsets_of(kept), malformed)


def _decode_raw(messages: Sequence[Message], *, text: bool) -> Decoded:
    keep: list[Message] = []
    keys: list[Any] = []
    values: list[Any] = []
    malformed: list[Malformed] = []
    for index, message in enumerate(messages):
        key: Any = message.key()
        value: Any = message.value()
        if text:
            try:
                key = None if key is None else key.decode()
                value = None if value is None else value.decode()
            except UnicodeDecodeError as exc:
                malformed.append(Malformed(index, f"the key or value is not UTF-8 text: {exc}"))
                continue
        keep.append(message)
        keys.append(key)
        values.append(value)
    schema = raw_schema(text)
    offsets = offsets_of(keep)
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
        pa.array(offsets, pa.int64()),
    ]
    return Decoded(pa.RecordBatch.from_arrays(columns, schema=schema), offsets, malformed)
