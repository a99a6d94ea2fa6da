"""NATS messages to rows, in bulk: JSON objects (parsed by Arrow when columns are declared) or bytes.

A message that cannot become a row (not JSON, not an object, or, with declared columns, not fitting
them) is returned as a :class:`Run` without rows, with the reason, never dropped: the caller applies
the ``on_malformed`` policy.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
from nats.aio.msg import Msg

from faucet_dagster.protocol import Records
from faucet_nats.config import HEADER_TYPE, RAW_SCHEMA, NatsSourceConfig

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)
_NANOS = pa.timestamp("ns", tz="UTC")
_STAMP = pa.timestamp("us", tz="UTC")
_JSON_SPACE = b" \t\r\n"
_TOO_DEEP = "the payload is JSON nested too deeply to decode"


@dataclass(frozen=True)
class Run:
    """Messages ``start`` to ``stop`` (exclusive) of a chunk as ``rows``; or, when ``rows`` is None,
    the one message ``start`` that cannot become a row, and why."""

    start: int
    stop: int
    rows: Records | None
    reason: str = ""


class Decoder:
    """Decodes runs of messages of one stream in the configured format."""

    def __init__(self, config: NatsSourceConfig) -> None:
        self._format = config.format
        self._stream = config.stream
        self._schema = config.declared_schema() if config.format == "json" else None
        if self._schema is not None:
            self._read_options = pa_json.ReadOptions(block_size=1 << 22)
            self._one_line = pa_json.ParseOptions(
                explicit_schema=self._schema, unexpected_field_behavior="error"
            )
            self._many_lines = pa_json.ParseOptions(
                explicit_schema=self._schema, unexpected_field_behavior="error", newlines_in_values=True
            )

    @property
    def needs_stamps(self) -> bool:
        """True when rows carry the server timestamp (parsed from the acknowledgement subjects)."""
        return self._format == "bytes"

    def decode(self, msgs: Sequence[Msg], seqs: pa.Int64Array, stamps: pa.Int64Array | None) -> list[Run]:
        """Decode ``msgs`` (stream sequences ``seqs``) into runs of rows and malformed messages."""
        if self._format == "bytes":
            assert stamps is not None  # needs_stamps
            return [Run(0, len(msgs), self._raw(msgs, seqs, stamps))]
        payloads = [msg.data for msg in msgs]
        if self._schema is None:
            return _json_objects(payloads)
        runs: list[Run] = []
        start = 0
        for index in _null_payloads(payloads):
            if start < index:
                self._parse(payloads, start, index, runs)
            runs.append(Run(index, index + 1, None, _malformed_reason(payloads[index], "not an object")))
            start = index + 1
        if start < len(payloads):
            self._parse(payloads, start, len(payloads), runs)
        return runs

    def _parse(self, payloads: list[bytes], start: int, stop: int, runs: list[Run]) -> None:
        """Parse ``payloads[start:stop]`` in one Arrow call; on failure halve, down to single messages,
        so ``k`` bad messages among ``n`` cost ``O(k log n)`` calls."""
        parsed = self._arrow(payloads[start:stop])
        if isinstance(parsed, pa.RecordBatch):
            runs.append(Run(start, stop, parsed))
        elif stop - start == 1:
            runs.append(Run(start, stop, None, _malformed_reason(payloads[start], parsed)))
        else:
            middle = (start + stop) // 2
            self._parse(payloads, start, middle, runs)
            self._parse(payloads, middle, stop, runs)

    def _arrow(self, payloads: list[bytes]) -> pa.RecordBatch | str:
        """The payloads as one batch of the declared schema, or why they are not (one row each)."""
        assert self._schema is not None
        data = b"\n".join(payloads)
        try:
            # Arrow's JSON reader copies string bytes without checking them: invalid UTF-8 would reach
            # the sink inside a string column. One C-speed pass over the run refuses it here.
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"the payload is not UTF-8: {exc.reason}"
        options = self._one_line if data.count(b"\n") == len(payloads) - 1 else self._many_lines
        try:
            table = pa_json.read_json(pa.BufferReader(data), self._read_options, options)
        except _ARROW_ERRORS as exc:
            return str(exc)
        if table.num_rows != len(payloads):
            return f"{table.num_rows} JSON objects in {len(payloads)} payload(s): one object per message"
        columns = [column.combine_chunks() for column in table.columns]
        return pa.RecordBatch.from_arrays(columns, schema=self._schema)

    def _raw(self, msgs: Sequence[Msg], seqs: pa.Int64Array, stamps: pa.Int64Array) -> pa.RecordBatch:
        count = len(msgs)
        headers = [None if msg.headers is None else _header_items(msg.headers) for msg in msgs]
        columns = [
            pa.array([msg.subject for msg in msgs], pa.string()),
            pa.array([msg.data for msg in msgs], pa.binary()),
            pa.array(headers, HEADER_TYPE),
            # Microseconds: what PostgreSQL and Python datetimes hold.
            stamps.cast(_NANOS).cast(_STAMP, safe=False),
            pa.repeat(pa.scalar(self._stream, pa.string()), count),
            seqs,
        ]
        return pa.RecordBatch.from_arrays(columns, schema=RAW_SCHEMA)


def _header_items(headers: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"key": key, "value": value} for key, value in headers.items()]


def _null_payloads(payloads: list[bytes]) -> list[int]:
    """The indices of payloads whose value starts with ``null`` (``null``, ``null,``, ``nullx``...).
    Arrow's JSON reader must never see one: it crashes the process on a leading one (pyarrow 26) and
    reads a later bare ``null`` as a row of nulls."""
    return [
        index
        for index, payload in enumerate(payloads)
        if not payload.startswith(b"{") and payload.lstrip(_JSON_SPACE).startswith(b"null")
    ]


def _malformed_reason(payload: bytes, arrow_error: str) -> str:
    """Why one payload is not a row of the declared columns, in the words a user acts on."""
    try:
        value = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"the payload is not JSON: {exc}"
    except RecursionError:
        return _TOO_DEEP
    if type(value) is not dict:
        return f"the payload is JSON {type(value).__name__}, not an object"
    return f"the payload does not fit the declared columns: {arrow_error}"


def _json_objects(payloads: list[bytes]) -> list[Run]:
    """``json.loads`` each payload; runs of objects become rows, anything else a malformed run."""
    runs: list[Run] = []
    rows: list[dict[str, Any]] = []
    start = 0
    loads = json.loads
    for index, payload in enumerate(payloads):
        try:
            value = loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            reason = f"the payload is not JSON: {exc}"
        except RecursionError:
            reason = _TOO_DEEP
        else:
            if type(value) is dict:
                rows.append(value)
                continue
            reason = f"the payload is JSON {type(value).__name__}, not an object"
        if rows:
            runs.append(Run(start, index, rows))
            rows = []
        runs.append(Run(index, index + 1, None, reason))
        start = index + 1
    if rows:
        runs.append(Run(start, len(payloads), rows))
    return runs
