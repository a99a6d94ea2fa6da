"""Message payloads that each carry one JSON object, to rows in bulk (the Kafka and NATS sources).

:class:`JsonRows` decodes a run of payloads into :class:`JsonRun` s: runs of rows, and the single
payloads that cannot become a row (not JSON, not an object, a missing value, not UTF-8, nested too
deeply, or not fitting the declared columns), each with the reason, never dropped: the source applies
its ``on_malformed`` policy to them.

Without declared columns each payload is decoded on its own (rows are JSON objects; the pipeline infers
or applies the schema). With declared columns (an Arrow schema) a whole run is parsed by Arrow's JSON
reader in one call; a run that fails is halved down to the single payloads that fail, so ``k`` bad
payloads among ``n`` cost ``O(k log n)`` calls.

Every row of an Arrow parse is one payload, proven rather than assumed: the payloads are joined one
per line, a blank payload (the only kind that yields no row) and a payload holding a newline (whose
lines Arrow could pair with another payload's) never join a run, so a run of ``n`` payloads parses to
exactly ``n`` rows only when each payload is exactly one object.

Both paths decode values by one rule (:mod:`faucet_dagster.protocol.lattice`): a payload holding what
no row can hold (a number beyond float64's range such as ``1e400``, which ``json.loads`` would turn
into an infinity; a lone surrogate such as ``"\ud800"``, which is not Unicode text) is not a row on
either path. With declared columns a payload lacking a declared field is a row whose field is null,
and the row is named in the :data:`~faucet_dagster.protocol.records.MISSING_COLUMN` of the batch, so
the pipeline counts it (and refuses it when the resource's schema says so), as it counts a JSON
object lacking a field.
"""

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from json.scanner import make_scanner
from typing import Any, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from faucet_dagster.protocol.records import MISSING_COLUMN, Records

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)
_JSON_SPACE = b" \t\r\n"
_BLOCK = 1 << 22


class BeyondFloat64(ValueError):
    """A JSON number beyond float64's range (``1e400``, ``2e308``, 309 digits): ``json.loads`` and
    Arrow's JSON reader would read it as an infinity, which the payload did not mean."""


def _float(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise BeyondFloat64(f"the number {text[:40]} is beyond float64's range")
    return number


# ``NaN`` and ``Infinity`` tokens (what ``json.dumps`` writes, what Arrow's JSON reader reads) decode
# as floats; a number beyond float64's range is refused as it is read (a call per number with a
# fraction or an exponent, cheaper than searching every payload's bytes for one).
_DECODER = json.JSONDecoder(parse_float=_float)
# What json.loads ends in (the C scanner of the decoder); typeshed types it wrongly.
_SCAN = cast(Callable[[str, int], tuple[Any, int]], make_scanner(cast(Any, _DECODER)))
_SURROGATE = re.compile("[\ud800-\udfff]")
_BEYOND = "it holds a number beyond float64's range (such as 1e400), which no column holds"


def unrepresentable(value: Any) -> str:
    """Why a decoded JSON value holds what no row can hold (``""``: nothing): a lone surrogate in a
    string or key (``json.loads`` decodes the escape ``"\\ud800"`` to one)."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:
            if _SURROGATE.search(item):
                return f"it holds a lone surrogate ({_surrogate(item)}), which is not Unicode text"
        elif kind is dict:
            for key, child in item.items():
                if _SURROGATE.search(key):
                    return f"a key holds a lone surrogate ({_surrogate(key)}), which is not Unicode text"
                stack.append(child)
        elif kind is list:
            stack.extend(item)
    return ""


def _surrogate(text: str) -> str:
    found = _SURROGATE.search(text)
    return "" if found is None else f"\\u{ord(found.group()):04x}"


def decode_json(payload: bytes | str) -> Any:
    """``json.loads`` by the one rule: a number beyond float64's range raises :class:`BeyondFloat64`
    (a ``ValueError``) rather than becoming an infinity. Raises ``ValueError`` (or
    ``UnicodeDecodeError``, ``RecursionError``) as ``json.loads`` does."""
    text = payload.decode() if isinstance(payload, bytes) else payload
    return _DECODER.decode(text)


@dataclass(frozen=True)
class JsonRun:
    """Payloads ``start`` to ``stop`` (exclusive) of a decoded run as ``rows``; or, when ``rows`` is
    None, the one payload ``start`` that cannot become a row, and why."""

    start: int
    stop: int
    rows: Records | None
    reason: str = ""


class JsonRows:
    """Decodes runs of JSON payloads, to ``schema`` when columns are declared.

    ``noun`` names the payload in reasons (``the value is not JSON``); a ``None`` payload is a message
    without one (a Kafka tombstone).
    """

    def __init__(self, schema: pa.Schema | None, noun: str = "payload") -> None:
        self.schema = schema
        self._noun = noun
        if schema is not None:
            # One block is parsed by one thread: Arrow's thread pool only adds a hand-off (milliseconds
            # on a loaded machine, which a one-message epoch pays in full), so it parses multi-block
            # runs only.
            self._read_options = pa_json.ReadOptions(block_size=_BLOCK, use_threads=False)
            self._threaded = pa_json.ReadOptions(block_size=_BLOCK, use_threads=True)
            read = reading_schema(schema)
            self._one_line = pa_json.ParseOptions(explicit_schema=read, unexpected_field_behavior="error")
            self._many_lines = pa_json.ParseOptions(
                explicit_schema=read, unexpected_field_behavior="error", newlines_in_values=True
            )
            self._finishes = not read.equals(schema)

    def decode(self, payloads: Sequence[bytes | None]) -> list[JsonRun]:
        """The runs of ``payloads``, in order, covering every payload exactly once."""
        if self.schema is None:
            return self._objects(payloads)
        runs: list[JsonRun] = []
        count = len(payloads)
        if count and None not in payloads:
            joined = b"\n".join(cast(Sequence[bytes], payloads))
            # The common case, proven by counting (C speed, no loop): no payload holds a newline, and
            # each line starts with "{" (so none is blank or starts with null): one run.
            if joined.count(b"\n") == count - 1 and joined[:1] == b"{" and joined.count(b"\n{") == count - 1:
                self._parse(payloads, 0, count, runs, joined=joined)
                return runs
        start = 0
        for index, alone in self._apart(payloads):
            if start < index:
                self._parse(payloads, start, index, runs)
            payload = payloads[index]
            if alone and payload is not None:
                self._parse(payloads, index, index + 1, runs, lines=True)
            else:
                runs.append(JsonRun(index, index + 1, None, self.reason(payload, "not an object")))
            start = index + 1
        if start < len(payloads):
            self._parse(payloads, start, len(payloads), runs)
        return runs

    def reason(self, payload: bytes | None, arrow_error: str) -> str:
        """Why one payload is not a row (of the declared columns), in the words a user acts on."""
        _, reason = self._load(payload)
        return reason or f"the {self._noun} does not fit the declared columns: {arrow_error}"

    def _load(self, payload: bytes | None) -> tuple[dict[str, Any] | None, str]:
        """``json.loads`` of one payload: the object, or None and why the payload is not one."""
        noun = self._noun
        if payload is None:
            return None, f"the message has no {noun} (a tombstone), not a JSON object"
        try:
            value = decode_json(payload)
        except UnicodeDecodeError as exc:
            return None, f"the {noun} is not UTF-8: {exc.reason} at byte {exc.start}"
        except BeyondFloat64:
            return None, f"the {noun} cannot be a row: {_BEYOND}"
        except ValueError as exc:
            return None, f"the {noun} is not JSON: {exc}"
        except RecursionError:
            return None, f"the {noun} is JSON nested too deeply to decode"
        if type(value) is not dict:
            return None, f"the {noun} is JSON {type(value).__name__}, not an object"
        if b"\\u" in payload:
            problem = unrepresentable(value)
            if problem:
                return None, f"the {noun} cannot be a row: {problem}"
        return value, ""

    def _apart(self, payloads: Sequence[bytes | None]) -> list[tuple[int, bool]]:
        """The payloads that never join a run of the Arrow reader, in order: ``(index, True)`` to be
        parsed alone (holding a newline), ``(index, False)`` malformed already.

        Malformed already: a missing payload, a blank one (it would yield no row), one whose value
        starts with ``null`` (``null``, ``null,``, ``nullx``...: Arrow's JSON reader crashes the
        process on a leading one (pyarrow 26) and reads a later bare ``null`` as a row of nulls)."""
        apart: list[tuple[int, bool]] = []
        joined = b"\n".join(b"" if payload is None else payload for payload in payloads)
        newlines = joined.count(b"\n") > len(payloads) - 1  # some payload holds one
        for index, payload in enumerate(payloads):
            if payload is None:
                apart.append((index, False))
                continue
            if not payload.startswith(b"{"):
                text = payload.lstrip(_JSON_SPACE)
                if not text or text.startswith(b"null"):
                    apart.append((index, False))
                    continue
            if newlines and b"\n" in payload:
                apart.append((index, True))
        return apart

    def _parse(
        self,
        payloads: Sequence[bytes | None],
        start: int,
        stop: int,
        runs: list[JsonRun],
        *,
        lines: bool = False,
        joined: bytes | None = None,
    ) -> None:
        """Parse ``payloads[start:stop]`` (``joined``: already joined by newlines) in one Arrow call; on
        failure halve, down to single payloads."""
        parsed = self._arrow(payloads[start:stop], lines=lines, joined=joined)
        if isinstance(parsed, pa.RecordBatch):
            runs.append(JsonRun(start, stop, parsed))
        elif stop - start == 1:
            runs.append(JsonRun(start, stop, None, self.reason(payloads[start], parsed)))
        else:
            middle = (start + stop) // 2
            self._parse(payloads, start, middle, runs)
            self._parse(payloads, middle, stop, runs)

    def _arrow(
        self, payloads: Sequence[bytes | None], *, lines: bool, joined: bytes | None
    ) -> pa.RecordBatch | str:
        """The payloads as one batch of the declared schema, or why they are not (one row each)."""
        assert self.schema is not None
        data = b"\n".join(payload or b"" for payload in payloads) if joined is None else joined
        # One payload alone may exceed a block (Arrow refuses a line straddling two): its own size.
        if len(data) < _BLOCK:
            read_options = self._read_options
        elif len(payloads) > 1:
            read_options = self._threaded
        else:
            read_options = pa_json.ReadOptions(block_size=len(data) + 1, use_threads=False)
        try:
            # Arrow's JSON reader copies string bytes without checking them: invalid UTF-8 would reach
            # the sink inside a string column. One C-speed pass over the run refuses it here.
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"the {self._noun} is not UTF-8: {exc.reason}"
        options = self._many_lines if lines else self._one_line
        try:
            table = pa_json.read_json(pa.BufferReader(data), read_options, options)
        except _ARROW_ERRORS as exc:
            return str(exc)
        if table.num_rows != len(payloads):
            return f"{table.num_rows} JSON objects in {len(payloads)} {self._noun}(s): one object per message"
        columns = [column.combine_chunks() for column in table.columns]
        if any(map(_holds_infinity, columns)):
            # Arrow refuses a lone surrogate escape and 1e400, but reads 2e308 (or 309 digits) as an
            # infinity: an infinity is kept only where the payload wrote the token.
            for payload in payloads:
                _, reason = self._load(payload)
                if reason:
                    return reason
        if self._finishes:
            finished = finish_read(columns, self.schema)
            if isinstance(finished, str):
                return finished
            columns = finished
        batch = pa.RecordBatch.from_arrays(columns, schema=self.schema)
        return self._name_missing(batch, payloads)

    def _name_missing(self, batch: pa.RecordBatch, payloads: Sequence[bytes | None]) -> pa.RecordBatch:
        """``batch`` with a :data:`MISSING_COLUMN` naming, per row, the declared fields its payload
        lacked (Arrow reads a lacking field as null): only rows holding a null are looked at."""
        nulls = [index for index, column in enumerate(batch.columns) if column.null_count]
        if not nulls:
            return batch
        names = self.schema.names if self.schema is not None else []
        lacking: dict[int, list[str]] = {}
        for index in nulls:
            name = names[index]
            key = json.dumps(name).encode()
            for row in pc.indices_nonzero(pc.is_null(batch.column(index))).to_pylist():
                if _lacks(cast(bytes, payloads[row]), name, key):
                    lacking.setdefault(row, []).append(name)
        if not lacking:
            return batch
        column = pa.array([lacking.get(row) for row in range(batch.num_rows)], pa.list_(pa.string()))
        return batch.append_column(MISSING_COLUMN, column)

    def _objects(self, payloads: Sequence[bytes | None]) -> list[JsonRun]:
        """Each payload decoded on its own; runs of objects become rows, anything else a malformed run.

        The fast path hands a UTF-8 payload that starts with ``{`` to the JSON scanner directly (what
        ``json.loads`` ends in, without its encoding detection and whitespace matching); a payload it
        does not consume exactly, whole, goes through ``json.loads`` for its exact outcome."""
        runs: list[JsonRun] = []
        rows: list[dict[str, Any]] = []
        start = 0
        scan = _SCAN
        # A lone surrogate is written as an escape (its raw bytes are not UTF-8): only payloads that
        # hold an escape go through _load, which looks for one.
        escapes = b"\\u" in b"".join(payload for payload in payloads if payload is not None)
        for index, payload in enumerate(payloads):
            if payload is not None and payload[:1] == b"{" and not (escapes and b"\\u" in payload):
                try:
                    text = payload.decode()
                    value, end = scan(text, 0)
                    if end == len(text):
                        rows.append(value)
                        continue
                except (ValueError, StopIteration, RecursionError):
                    pass  # json.loads below gives the exact outcome and reason
            value, reason = self._load(payload)
            if value is not None:
                rows.append(value)
                continue
            if rows:
                runs.append(JsonRun(start, index, rows))
                rows = []
            runs.append(JsonRun(index, index + 1, None, reason))
            start = index + 1
        if rows:
            runs.append(JsonRun(start, len(payloads), rows))
        return runs


def _holds_infinity(column: pa.Array) -> bool:
    """True when a floating leaf of ``column`` (as Arrow's JSON reader read it) holds an infinity."""
    kind = column.type
    if pa.types.is_floating(kind):
        return bool(pc.any(pc.is_inf(column)).as_py())
    if pa.types.is_struct(kind):
        return any(_holds_infinity(column.field(index)) for index in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _holds_infinity(column.flatten())
    return False


def _lacks(payload: bytes, name: str, key: bytes) -> bool:
    """True when the JSON object ``payload`` has no top-level field ``name``. A payload whose bytes do
    not hold the key lacks it (unless it escapes characters, then it is decoded); one that holds them
    is decoded, since the key may be a nested object's or inside a string."""
    if key not in payload and b"\\" not in payload:
        return True
    try:
        return name not in decode_json(payload)
    except (ValueError, RecursionError):
        return False  # Arrow parsed it: not reached


def reading_schema(schema: pa.Schema) -> pa.Schema:
    """The schema Arrow's JSON reader parses a declared schema's payloads with: a ``date32`` field as a
    string (Arrow would read a number as days; :func:`finish_read` parses ISO dates), a ``float32`` or
    ``float16`` one as float64 (Arrow would round an out-of-range number to an infinity; the cast in
    :func:`finish_read` refuses it)."""
    return pa.schema([item.with_type(_reading_type(item.type)) for item in schema], metadata=schema.metadata)


def _reading_type(kind: pa.DataType) -> pa.DataType:
    if pa.types.is_date32(kind):
        return pa.string()
    if pa.types.is_float32(kind) or pa.types.is_float16(kind):
        return pa.float64()
    if pa.types.is_struct(kind):
        return pa.struct(
            [kind.field(i).with_type(_reading_type(kind.field(i).type)) for i in range(kind.num_fields)]
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        value = kind.value_field.with_type(_reading_type(kind.value_type))
        return pa.list_(value) if pa.types.is_list(kind) else pa.large_list(value)
    return kind


ISO_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
"""The one text form a ``date32`` column takes: ``YYYY-MM-DD``."""


def finish_read(columns: Sequence[pa.Array], schema: pa.Schema) -> list[pa.Array] | str:
    """Columns read with :func:`reading_schema` as ``schema``'s types, or why one does not fit."""
    finished = []
    for column, item in zip(columns, schema, strict=True):
        if column.type.equals(item.type):
            finished.append(column)
            continue
        problem = _cast_problem(column, item.type)
        if problem:
            return f"field {item.name!r} does not fit {item.type}: {problem}"
        finished.append(column.cast(item.type))
    return finished


def _cast_problem(column: pa.Array, target: pa.DataType) -> str:
    """Why ``column`` (as read) does not cast exactly to ``target`` ("" when it does)."""
    for read, wanted in _leaves(column, target):
        if pa.types.is_date32(wanted):
            texts = read.drop_null().to_pylist()
            wrong = [text for text in texts if not ISO_DATE.fullmatch(text)]
            if wrong:
                return f"{wrong[0]!r} is not a date (YYYY-MM-DD)"
            try:
                read.cast(pa.date32())
            except _ARROW_ERRORS:
                return "a value is not a date of the calendar"
        elif pa.types.is_floating(wanted):
            narrowed = read.cast(wanted)
            if pc.sum(pc.is_inf(narrowed)).as_py() != pc.sum(pc.is_inf(read)).as_py():
                return f"a number is beyond {wanted}'s range"
    return ""


def _leaves(column: pa.Array, target: pa.DataType) -> Iterator[tuple[pa.Array, pa.DataType]]:
    """The leaf arrays of ``column`` whose type differs from ``target``'s, each with its target type."""
    if pa.types.is_struct(target):
        for index in range(target.num_fields):
            yield from _leaves(column.field(index), target.field(index).type)
    elif pa.types.is_list(target) or pa.types.is_large_list(target):
        yield from _leaves(column.flatten(), target.value_type)
    elif not column.type.equals(target):
        yield column, target
