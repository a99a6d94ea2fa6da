"""The type lattice: where every value kind lands in every column type, by one rule for every path.

A value reaches a column by one of three paths: a JSON payload parsed by Arrow's JSON reader into
declared columns (:class:`~faucet_dagster.protocol.json_rows.JsonRows`, the Kafka and NATS sources with
``columns``), a JSON object (a ``dict``) converted by the pipeline or the bounded runner into an
inferred or declared schema (:func:`conform_rows`), or an Arrow value of another type conformed to a
declared schema (:func:`conform_values` on its Python values). Each pair of value kind and column type
has one outcome on all three: the value lands exactly, or it does not fit and the caller refuses the
row by its position (a ``DataError`` under ``halt``, a dead letter under ``dead_letter``). Nothing is
coerced with loss. The rule, by column type:

========================  ===============================================================================
column type               lands                           (anything else does not fit)
========================  ===============================================================================
int8 ... uint64           an integer within the type's range (a float, even ``2.0``, is not an integer)
float32, float64          a number (integer or not), as the float nearest to it (IEEE 754, as every JSON
                          reader reads a number); ``NaN`` and ``Infinity`` tokens; not a number beyond
                          the type's range (``1e400``; ``1e39`` in float32)
decimal128(p, s)          an integer or a number, or a string of one, whose digits fit ``p`` and ``s``
                          without rounding
bool                      ``true`` or ``false``
string                    a string (Unicode: a lone surrogate does not fit), bytes that are UTF-8
binary                    bytes, a string (as its UTF-8 bytes)
date32                    a date, a string ``YYYY-MM-DD`` (not a number of days, not a timestamp)
timestamp[unit, tz]       a timestamp, an ISO 8601 string, exact at the unit (an offset is converted
                          to UTC; a naive value means UTC); not a number
struct<...>               an object whose fields are the struct's (a field it lacks is null; one the
                          struct lacks does not fit), each landing in its field's type
list<T>                   an array whose items each land in ``T``
null                      null
========================  ===============================================================================

``null`` lands in every nullable column. A row whose object lacks a field of the schema lands with
null there and is counted as missing that field (:attr:`Conformed.missing`): the pipeline reports the
count per field in the epoch's certificate, and refuses such rows when its schema is strict
(``on_missing_field: refuse``).

Inference (no declared schema) types a column by the first chunk's values: booleans ``bool``,
integers ``int64``, integers and other numbers ``float64``, strings ``string``, bytes ``binary``,
objects a ``struct`` of every field seen, arrays a ``list`` of their items' type, only nulls ``null``;
values of another kind in the chunk (a string among integers) are checked against the type the
first non-null value gave, like any later row.

How the rule is kept on every path: for the common case, a column whose values are all of a kind
Arrow's conversion lands exactly (integers into an integer column, floats into a float64 column,
strings into a string column, objects holding only a struct's fields with such values...) is
converted by one Arrow call; any other value is written as JSON text and parsed by the same
:class:`JsonRows` reader as a declared payload, so both paths share one parser; what Arrow's
conversions would coerce (a float truncated into an integer, a number read as days or microseconds
since 1970, a struct field dropped, a datetime truncated) never reaches them.
"""

import datetime as dt
import json
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from itertools import repeat
from typing import Any

import pyarrow as pa

from faucet_dagster.protocol.errors import DataError
from faucet_dagster.protocol.json_rows import ISO_DATE, JsonRows, unrepresentable
from faucet_dagster.protocol.records import Records, check_lattice_schema, lattice_type_problem, split_missing

_ARROW_ERRORS = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    pa.ArrowNotImplementedError,
    TypeError,
    ValueError,
    OverflowError,
    RecursionError,
)
_NONE = type(None)
_FLOAT32_MAX = 3.4028234663852886e38


# -- the safe kinds: Python types Arrow's own conversion lands exactly in a column type ------------


def _safe_kinds(kind: pa.DataType) -> frozenset[type]:
    """The Python types whose values ``pa.array(values, kind)`` lands exactly or refuses (never
    coerces): every other value goes through :func:`_land_one` or the JSON reader."""
    if pa.types.is_integer(kind):
        return frozenset({int, _NONE})
    if pa.types.is_float64(kind):
        return frozenset({float, _NONE})
    if pa.types.is_decimal(kind):
        return frozenset({int, Decimal, _NONE})
    if pa.types.is_boolean(kind):
        return frozenset({bool, _NONE})
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return frozenset({str, bytes, _NONE})
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return frozenset({bytes, str, _NONE})
    if pa.types.is_date32(kind):
        return frozenset({dt.date, _NONE})
    if pa.types.is_timestamp(kind) and kind.unit in ("us", "ns"):
        return frozenset({dt.datetime, _NONE})
    return frozenset({_NONE})


def lands_as_is(values: Sequence[Any], kind: pa.DataType) -> bool:
    """True when every one of ``values`` is of a Python type ``pa.array(values, kind)`` lands exactly
    or refuses, never coerces (an ``int`` into an integer column, a ``float`` into float64, an object
    with only the struct's fields whose values are so too...): then one Arrow call converts them by the
    lattice's rule. Otherwise use :func:`conform_values`."""
    if pa.types.is_struct(kind):
        return _objects_land_as_is(values, kind)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        items: list[Any] = []
        for value in values:
            if value is None:
                continue
            if type(value) is not list:
                return False
            items.extend(value)
        return lands_as_is(items, kind.value_type)
    return set(map(type, values)) <= _safe_kinds(kind)


def _objects_land_as_is(values: Sequence[Any], kind: pa.StructType) -> bool:
    objects = [value for value in values if value is not None]
    if set(map(type, objects)) - {dict}:
        return False
    fields = [kind.field(index) for index in range(kind.num_fields)]
    names = [item.name for item in fields]
    table = _whole_columns(objects, names)
    if table is None:
        if not all(map(frozenset(names).issuperset, objects)):
            return False  # Arrow would drop a field the struct lacks
        table = [list(map(operator.methodcaller("get", name), objects)) for name in names]
    return all(lands_as_is(column, item.type) for item, column in zip(fields, table, strict=True))


def kind_name(value: Any) -> str:
    """The value kind of ``value`` as the lattice names it (in reasons and in the documentation)."""
    if value is None:
        return "null"
    kind = type(value)
    if kind is bool:
        return "boolean"
    if kind is int:
        return "integer"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "NaN" if math.isnan(value) else "infinity"
        return "float without a fraction" if value.is_integer() else "float"
    if kind is str:
        return "string"
    if isinstance(value, bytes | bytearray):
        return "bytes"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Decimal):
        return "decimal"
    if isinstance(value, dt.datetime):
        return "timestamp"
    if isinstance(value, dt.date):
        return "date"
    return kind.__name__


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Unfit(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _land_one(value: Any, kind: pa.DataType) -> Any:
    """``value`` as ``pa.array`` lands it exactly in ``kind``, or :class:`_Unfit`; None when it goes
    through the JSON reader (:func:`_json_literal`)."""
    vtype = type(value)
    if pa.types.is_floating(kind):
        if vtype is bool or not isinstance(value, int | float | Decimal):
            raise _Unfit("not a number")
        try:
            number = float(value)
        except OverflowError:
            raise _Unfit(f"beyond {kind}'s range") from None
        if math.isinf(number) and not (isinstance(value, float) and math.isinf(value)):
            raise _Unfit(f"beyond {kind}'s range")
        if pa.types.is_float32(kind) and math.isfinite(number) and abs(number) > _FLOAT32_MAX:
            raise _Unfit(f"beyond {kind}'s range")
        return number
    if pa.types.is_integer(kind):
        raise _Unfit("not an integer")
    if pa.types.is_boolean(kind):
        raise _Unfit("not a boolean")
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        raise _Unfit("not a string")
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        raise _Unfit("not bytes or a string")
    if pa.types.is_date32(kind):
        if vtype is str:
            return _iso_date(value)
        raise _Unfit("not a date (YYYY-MM-DD)")
    if pa.types.is_timestamp(kind):
        if vtype is str or isinstance(value, dt.datetime):
            return None  # the JSON reader parses it, exact at the unit
        raise _Unfit("not a timestamp (ISO 8601)")
    if pa.types.is_decimal(kind):
        if isinstance(value, float | str) and vtype is not bool:
            return None
        raise _Unfit("not a number")
    if pa.types.is_struct(kind):
        if isinstance(value, dict):
            return None
        raise _Unfit("not an object")
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        if isinstance(value, list | tuple):
            return None
        raise _Unfit("not an array")
    raise _Unfit("not null")


def _iso_date(text: str) -> dt.date:
    if not ISO_DATE.fullmatch(text):
        raise _Unfit("not a date (YYYY-MM-DD)")
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise _Unfit("not a date of the calendar") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    if isinstance(value, Decimal) and value.is_finite():
        return str(value)
    raise TypeError(f"{kind_name(value)} has no JSON form")


def _json_literal(value: Any) -> bytes | None:
    """``{"v": value}`` as JSON text for the JSON reader, or None when ``value`` has no JSON form."""
    if isinstance(value, dt.datetime | dt.date):
        text = json.dumps(value.isoformat())
    elif isinstance(value, float) and not math.isfinite(value):
        text = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    else:
        try:
            text = json.dumps(value, default=_json_default, allow_nan=True)
        except (TypeError, ValueError, RecursionError):
            return None
    return b'{"v":' + text.encode("utf-8", "surrogatepass") + b"}"


# -- conforming ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conformed:
    """Rows conformed to a schema: the ones that landed as ``batch``, the ones that did not fit.

    ``kept`` lists the input indices of ``batch``'s rows (``None``: every row, in order); ``bad`` maps
    the index of each row that did not fit to why; ``missing`` maps each field of the schema to the
    indices of the rows that lacked it (whether they landed or not).
    """

    batch: pa.RecordBatch
    kept: list[int] | None = None
    bad: Mapping[int, str] = field(default_factory=dict)
    missing: Mapping[str, list[int]] = field(default_factory=dict)


def conform_values(values: Sequence[Any], kind: pa.DataType, label: str) -> tuple[pa.Array, dict[int, str]]:
    """``values`` as one array of ``kind`` (length ``len(values)``), and the index of each value that
    does not fit with why (null in the array). ``label`` names the column in reasons."""
    if lands_as_is(values, kind):
        try:
            return pa.array(values, kind), {}
        except _ARROW_ERRORS:
            pass  # one by one below, to name the values that do not fit
    landed = list(values)
    bad: dict[int, str] = {}
    through_json: list[int] = []
    safe = _safe_kinds(kind)
    nested = pa.types.is_nested(kind)
    for index, value in enumerate(values):
        if value is None:
            continue
        if type(value) in safe or (nested and lands_as_is([value], kind)):
            try:
                pa.array([value], kind)
            except _ARROW_ERRORS as exc:
                bad[index] = _reason(label, value, kind, _arrow_reason(value, exc))
                landed[index] = None
            continue
        try:
            one = _land_one(value, kind)
        except _Unfit as exc:
            bad[index] = _reason(label, value, kind, exc.reason)
            landed[index] = None
            continue
        if one is None:
            through_json.append(index)
        else:
            landed[index] = one
    if through_json:
        _read_as_json(values, through_json, kind, label, landed, bad)
    return pa.array(landed, kind), bad


def _read_as_json(
    values: Sequence[Any],
    indices: Sequence[int],
    kind: pa.DataType,
    label: str,
    landed: list[Any],
    bad: dict[int, str],
) -> None:
    """Land ``values[indices]`` through the JSON reader, as a declared payload's values land."""
    literals: list[bytes | None] = []
    for index in indices:
        literal = _json_literal(values[index])
        if literal is None:
            bad[index] = _reason(label, values[index], kind, "it has no JSON form")
        literals.append(literal)
    reader = JsonRows(pa.schema([pa.field("v", kind)]), noun="value")
    for run in reader.decode(literals):
        for offset in range(run.start, run.stop):
            index = indices[offset]
            if index in bad:
                continue
            if run.rows is None:
                bad[index] = _reason(label, values[index], kind, _json_reason(run.reason))
                landed[index] = None
            else:
                assert isinstance(run.rows, pa.RecordBatch)
                landed[index] = run.rows.column(0)[offset - run.start].as_py()
    for index in indices:
        if index in bad:
            landed[index] = None


def _json_reason(reason: str) -> str:
    for prefix in ("the value does not fit the declared columns: ", "the value cannot be a row: "):
        if reason.startswith(prefix):
            return reason[len(prefix) :]
    return reason


def _arrow_reason(value: Any, exc: BaseException) -> str:
    if isinstance(exc, UnicodeEncodeError):
        problem = unrepresentable(value)
        return problem or "not Unicode text"
    if isinstance(exc, OverflowError):
        return "out of the type's range"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _reason(label: str, value: Any, kind: pa.DataType, why: str) -> str:
    return f"column {label!r}: {kind_name(value)} {_preview(value)} does not fit {kind}: {why}"


def conform_rows(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> Conformed:
    """JSON objects conformed to ``schema`` by the lattice's rule (see the module docstring).

    A row with a field outside the schema does not fit (it is never silently trimmed); a row lacking
    a field lands with null there and is named in ``missing``.
    """
    count = len(rows)
    names = schema.names
    bad: dict[int, str] = {}
    missing: dict[str, list[int]] = {}
    table = _whole_columns(rows, names)
    if table is None:
        allowed = frozenset(names)
        for index, row in enumerate(rows):
            extra = set(row) - allowed
            if extra:
                bad[index] = f"field(s) {', '.join(sorted(extra))} are not in the schema"
        table = []
        for name in names:
            present = list(map(operator.contains, rows, repeat(name)))
            if not all(present):
                missing[name] = [index for index, here in enumerate(present) if not here]
            table.append(list(map(operator.methodcaller("get", name), rows)))
    columns: list[pa.Array] = []
    for item, values in zip(schema, table, strict=True):
        column, unfit = conform_values(values, item.type, item.name)
        for index, reason in unfit.items():
            bad.setdefault(index, reason)
        columns.append(column)
    batch = pa.RecordBatch.from_arrays(columns, schema=schema) if count else _empty(schema)
    if not bad:
        return Conformed(batch, None, {}, missing)
    kept = [index for index in range(count) if index not in bad]
    return Conformed(batch.take(pa.array(kept, pa.int64())), kept, bad, missing)


def _whole_columns(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[list[Any]] | None:
    """Each field's values, when every row has exactly the fields ``names`` (the common case: as many
    fields as the schema, each found); None otherwise."""
    if set(map(len, rows)) - {len(names)}:
        return None
    try:
        return [list(map(operator.itemgetter(name), rows)) for name in names]
    except KeyError:
        return None


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=schema)


def conform_batch(batch: pa.RecordBatch, schema: pa.Schema) -> Conformed:
    """An Arrow batch conformed to ``schema`` by the same rule as JSON objects (its values as Python
    values, column by column, where its type is not the schema's). A column the batch lacks is a
    field every row lacks (null, named in ``missing``); a column the schema lacks makes every row not
    fit. The batch's :data:`~faucet_dagster.protocol.records.MISSING_COLUMN`, when it has one, names
    more rows lacking fields (a declared JSON payload's)."""
    batch, missing = split_missing(batch)
    if batch.schema.equals(schema):
        return Conformed(batch, None, {}, missing)  # as it is, with its metadata
    count = batch.num_rows
    bad: dict[int, str] = {}
    extra = [name for name in batch.schema.names if schema.get_field_index(name) < 0]
    if extra:
        reason = f"field(s) {', '.join(sorted(extra))} are not in the schema"
        bad.update(zip(range(count), repeat(reason)))
    columns: list[pa.Array] = []
    for item in schema:
        index = batch.schema.get_field_index(item.name)
        if index < 0:
            missing[item.name] = list(range(count))
            columns.append(pa.nulls(count, item.type))
            continue
        column = batch.column(index)
        if column.type.equals(item.type):
            columns.append(column)
            continue
        landed, unfit = conform_values(column.to_pylist(), item.type, item.name)
        for row, reason in unfit.items():
            bad.setdefault(row, reason)
        columns.append(landed)
    # The schema's types, with the metadata the batch's fields and schema carry (a source's own).
    carried = pa.schema(
        [
            item.with_metadata(batch.schema.field(item.name).metadata)
            if batch.schema.get_field_index(item.name) >= 0 and batch.schema.field(item.name).metadata
            else item
            for item in schema
        ],
        metadata=batch.schema.metadata or schema.metadata,
    )
    conformed = pa.RecordBatch.from_arrays(columns, schema=carried)
    if not bad:
        return Conformed(conformed, None, {}, missing)
    kept = [index for index in range(count) if index not in bad]
    return Conformed(conformed.take(pa.array(kept, pa.int64())), kept, bad, missing)


def as_record_batch(records: Records, schema: pa.Schema | None = None) -> pa.RecordBatch:
    """``records`` as one Arrow batch, conformed to ``schema`` (inferred from JSON objects when it is
    None; an Arrow batch without ``schema`` passes as it is), by the lattice's rule.

    Raises :class:`DataError` naming the first row that does not fit.
    """
    if isinstance(records, pa.RecordBatch):
        if schema is None:
            return split_missing(records)[0]
        conformed = conform_batch(records, schema)
    else:
        target = schema if schema is not None else infer_schema(records)
        if target is None:
            raise DataError("records do not form an Arrow batch: no column type can be inferred from them")
        conformed = conform_rows(records, target)
    if conformed.bad:
        index = min(conformed.bad)
        raise DataError(f"records do not form an Arrow batch: row {index}: {conformed.bad[index]}")
    return conformed.batch


# -- inference -------------------------------------------------------------------------------------


def infer_type(values: Sequence[Any]) -> pa.DataType | None:
    """The column type the lattice infers from ``values`` (see the module docstring), or None when no
    value has a type (a kind no column holds: the first non-null value decides, so None only when
    that value has no type)."""
    first = next((value for value in values if value is not None), None)
    if first is None:
        return pa.null()
    kind = type(first)
    if kind is bool:
        return pa.bool_()
    if kind is int or isinstance(first, float):
        numbers = [value for value in values if type(value) is int or isinstance(value, float)]
        if kind is int and all(type(value) is int for value in numbers):
            return pa.int64()
        return pa.float64()
    if kind is str:
        return pa.string()
    if isinstance(first, bytes | bytearray):
        return pa.binary()
    if isinstance(first, Mapping):
        objects = [value for value in values if isinstance(value, Mapping)]
        names = list(dict.fromkeys(name for value in objects for name in value))
        fields = []
        for name in names:
            child = infer_type([value.get(name) for value in objects])
            if child is None:
                return None
            fields.append(pa.field(name, child))
        return pa.struct(fields)
    if isinstance(first, list | tuple):
        items = [item for value in values if isinstance(value, list | tuple) for item in value]
        child = infer_type(items)
        return None if child is None else pa.list_(child)
    if isinstance(first, dt.datetime):
        return pa.timestamp("us", tz=None if first.tzinfo is None else "UTC")
    if isinstance(first, dt.date):
        return pa.date32()
    if isinstance(first, Decimal):
        try:
            return pa.array([value for value in values if isinstance(value, Decimal)]).type
        except _ARROW_ERRORS:
            return None
    return None


def infer_schema(rows: Sequence[Mapping[str, Any]]) -> pa.Schema | None:
    """The schema the lattice infers from ``rows``: every field seen, in order of first appearance,
    nullable (the fields of the struct :func:`infer_type` gives the rows); None when a field's first
    value has no column type."""
    if not rows:
        return pa.schema([])
    inferred = infer_type(rows)
    return None if inferred is None else pa.schema(list(inferred))


__all__ = [
    "Conformed",
    "as_record_batch",
    "check_lattice_schema",
    "conform_batch",
    "conform_rows",
    "conform_values",
    "infer_schema",
    "infer_type",
    "kind_name",
    "lands_as_is",
    "lattice_type_problem",
]
