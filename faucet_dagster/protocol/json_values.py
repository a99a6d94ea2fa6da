"""Values as JSON text: what a sink writes into a JSON column for a nested value, and what a dead
letter holds for a row.

The values are those Arrow's ``to_pylist`` gives (dicts of a struct, lists, a map's ``(key, value)``
tuples, scalars). What JSON has no form for is written as PostgreSQL reads it back from text, never as
Python's ``str``: bytes as ``\\x`` hex (``str`` gives ``b'...'``, which no reader decodes), dates,
times and timestamps in ISO 8601, a decimal as its exact digits in a string (a float would round it),
a duration as ``<n> microseconds``.
"""

import datetime as dt
import json
import math
import re
from decimal import Decimal
from typing import Any

from faucet_dagster.protocol.errors import DataError

_MICROSECOND = dt.timedelta(microseconds=1)
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(value: Any, where: str) -> str:
    """``value`` as JSON text, for a JSON column. Raises :class:`DataError` naming ``where`` for what
    JSON cannot hold: NaN or an infinity (JSON has no such number; PostgreSQL's ``jsonb`` refuses the
    ``NaN`` Python would write), or a type with no JSON form."""
    try:
        return json.dumps(value, default=_json_form, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        reason = "a NaN or an infinite float" if str(exc).startswith("Out of range float") else str(exc)
        raise DataError(f"a value has no JSON form: {reason}", where=where) from exc


def json_record(record: Any) -> str:
    """A row for a dead letter, keys sorted: as :func:`json_text`, except that it never refuses (the
    dead letter must hold the row that failed): a non-finite float is written as ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"``, a value of no known type as its ``repr``, and a lone surrogate
    (``"\\ud800"``, which no UTF-8 text holds) as its JSON escape, so the text encodes and decodes
    back to the same value."""
    finite = _finite(record)
    text = json.dumps(finite, default=_lenient_form, sort_keys=True, ensure_ascii=False)
    if _SURROGATE.search(text):
        return json.dumps(finite, default=_lenient_form, sort_keys=True, ensure_ascii=True)
    return text


def _json_form(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return "\\x" + bytes(value).hex()
    if isinstance(value, dt.date | dt.time):  # a datetime is a date
        return value.isoformat()
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ValueError(f"decimal {value} is not a finite number")
        return str(value)
    if isinstance(value, dt.timedelta):
        return f"{value // _MICROSECOND} microseconds"
    raise TypeError(f"a {type(value).__name__} is not JSON serializable")


def _lenient_form(value: Any) -> Any:
    try:
        return _json_form(value)
    except (TypeError, ValueError):
        return repr(value) if not isinstance(value, Decimal) else str(value)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its name (json has no lenient mode for them
    but ``NaN`` tokens, which are not JSON), and every key a string (json refuses bytes keys, and
    sorting refuses keys of mixed types)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {_key(key): _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)  # as json itself writes such a key
    return str(_lenient_form(key))
