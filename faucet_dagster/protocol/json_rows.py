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
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.scanner import make_scanner
from typing import Any, cast

import pyarrow as pa
import pyarrow.json as pa_json

from faucet_dagster.protocol.records import Records

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)
_JSON_SPACE = b" \t\r\n"
_BLOCK = 1 << 22
# What json.loads ends in (the C scanner of the default decoder); typeshed types it wrongly.
_SCAN = cast(Callable[[str, int], tuple[Any, int]], make_scanner(cast(Any, json.JSONDecoder())))


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
            self._one_line = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
            self._many_lines = pa_json.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="error", newlines_in_values=True
            )

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
            value = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            return None, f"the {noun} is not JSON: {exc}"
        except RecursionError:
            return None, f"the {noun} is JSON nested too deeply to decode"
        if type(value) is not dict:
            return None, f"the {noun} is JSON {type(value).__name__}, not an object"
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
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)

    def _objects(self, payloads: Sequence[bytes | None]) -> list[JsonRun]:
        """Each payload decoded on its own; runs of objects become rows, anything else a malformed run.

        The fast path hands a UTF-8 payload that starts with ``{`` to the JSON scanner directly (what
        ``json.loads`` ends in, without its encoding detection and whitespace matching); a payload it
        does not consume exactly, whole, goes through ``json.loads`` for its exact outcome."""
        runs: list[JsonRun] = []
        rows: list[dict[str, Any]] = []
        start = 0
        scan = _SCAN
        for index, payload in enumerate(payloads):
            if payload is not None and payload[:1] == b"{":
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
