"""The type lattice: every value kind crossed with every column type, by one rule on every path.

A reference oracle (:func:`expected`, written here from the rule's table in
docs/values-and-schemas.md, not from the code) says where each value lands or that it is refused.
Hypothesis (seeded, a bounded number of examples) draws values of every kind and column types, and
checks the paths against it:

* the pipeline's and the bounded runner's conversion of JSON objects (``conform_values``), into a
  declared schema and into the schema inferred from a first row;
* Arrow's JSON reader into declared columns (``JsonRows``: the Kafka and NATS sources with
  ``columns``), and JSON Lines files;
* Arrow values of another type conformed to a declared schema (``conform_batch``);

then end to end through the real servers: Kafka and NATS streams (declared at the source, declared in
the pipeline, inferred) into the PostgreSQL streaming sink, with every refused record dead-lettered
under its position; JSON Lines files and a SQLite table (the files and SQL sources) into the
PostgreSQL and SQL sinks, a refused value stopping the sync naming its file and line, or row.
"""

import asyncio
import datetime as dt
import json
import math
import re
import sqlite3
import struct
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import nats
import psycopg
import pyarrow as pa
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_topics import create_topic, produce

from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster.pipeline import ResourceSchema, RowConverter
from faucet_dagster.pipeline.schema import BadRowPolicy, row_payload
from faucet_dagster.protocol import DataError, ReadLimits, conform_batch, get_connector
from faucet_dagster.protocol.json_rows import JsonRows
from faucet_dagster.runner.bounded import run_bounded_sync
from faucet_dagster.runner.bounded_values import SyncSettings
from faucet_dagster.runner.continuous import StreamRunner
from faucet_dagster.state import StateStore
from faucet_dagster.streams.declaration import FaucetStream

REFUSED = object()
"""The oracle's answer for a value that does not fit its column type."""

COLUMN_TYPES: dict[str, pa.DataType] = {
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint8": pa.uint8(),
    "uint32": pa.uint32(),
    "uint64": pa.uint64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "decimal": pa.decimal128(12, 3),
    "bool": pa.bool_(),
    "string": pa.string(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us"),
    "timestamptz": pa.timestamp("us", tz="UTC"),
    "timestamp_s": pa.timestamp("s"),
    "struct": pa.struct([pa.field("a", pa.int64()), pa.field("b", pa.string())]),
    "list": pa.list_(pa.int64()),
}

INT_RANGES = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 2**8 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}

KINDS: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "integer of int8": st.integers(-(2**7), 2**7 - 1),
    "integer of int16": st.integers(-(2**15), 2**15 - 1),
    "integer of int32": st.integers(-(2**31), 2**31 - 1),
    "integer of int64": st.sampled_from([2**63 - 1, -(2**63), 2**53 + 1, -(2**40)]),
    "integer of uint64": st.sampled_from([2**63, 2**64 - 1]),
    "integer beyond uint64": st.sampled_from([2**64, -(2**63) - 1, 10**30]),
    "float without a fraction": st.sampled_from([2.0, -0.0, 1e16, -7.0]),
    "float with a fraction": st.one_of(
        st.floats(-1e6, 1e6).map(lambda f: f + 0.25 if f.is_integer() else f),
        st.floats(allow_nan=False, allow_infinity=False).map(
            lambda f: f / 3 if f.is_integer() and f else f + 0.5 if f == 0 else f
        ),
    ),
    "NaN and Infinity tokens": st.sampled_from([math.nan, math.inf, -math.inf]),
    "string": st.text(st.characters(blacklist_categories=("Cs",)), max_size=6),
    "numeric string": st.sampled_from(["12", "1.25", "-0.125", "1e3", "1.2345"]),
    "date string": st.sampled_from(["2024-01-02", "2024-02-30", "1999-12-31"]),
    "timestamp string": st.sampled_from(
        [
            "2024-01-02T03:04:05",
            "2024-01-02 03:04:05.123456",
            "2024-01-02T03:04:05Z",
            "2024-01-02T03:04:05+02:00",
            "2024-01-02T03:04:05.1234567",
            "2024-01-02T03:04:05.5",
        ]
    ),
    "lone surrogate": st.sampled_from(["\ud800", "a\udfffb"]),
    "object": st.fixed_dictionaries({"a": st.integers(-5, 5)}, optional={"b": st.sampled_from(["x", None])}),
    "object with an unknown field": st.just({"a": 1, "zz": 2}),
    "object with a value of another kind": st.just({"a": 1.5}),
    "array": st.lists(st.integers(-5, 5), max_size=3),
    "array with an item of another kind": st.just([1, 2.5]),
}
"""Every JSON value kind; ``bytes``, dates and timestamps (no JSON form) come from Arrow sources, below."""

_ISO_DATE = re.compile(r"(\d{4})-(\d{2})-(\d{2})")
_ISO_TIMESTAMP = re.compile(
    r"(\d{4}-\d{2}-\d{2})(?:[T ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?)?(Z|[+-]\d{2}:\d{2})?"
)
_DECIMAL_TEXT = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
_FLOAT32_MAX = struct.unpack("f", b"\xff\xff\x7f\x7f")[0]


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def expected(value: Any, column: str) -> Any:
    """Where ``value`` lands in a column of type ``column`` (its Python value), or REFUSED: the rule."""
    kind = COLUMN_TYPES[column]
    if value is None:
        return None
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if column in INT_RANGES:
        low, high = INT_RANGES[column]
        return value if type(value) is int and low <= value <= high else REFUSED
    if pa.types.is_floating(kind):
        if not is_number:
            return REFUSED
        try:
            number = float(value)
        except OverflowError:
            return REFUSED
        if isinstance(value, int) and math.isinf(number):
            return REFUSED
        if column == "float32":
            if math.isfinite(number) and abs(number) > _FLOAT32_MAX:
                return REFUSED
            return _float32(number) if math.isfinite(number) else number
        return number
    if column == "decimal":
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            return REFUSED
        if isinstance(value, float) and not math.isfinite(value):
            return REFUSED
        if isinstance(value, str) and not _DECIMAL_TEXT.fullmatch(value):
            return REFUSED
        number = Decimal(repr(value) if isinstance(value, float) else str(value))
        scaled = number.quantize(Decimal("0.001")) if abs(number) < Decimal(10) ** 9 else None
        return REFUSED if scaled is None or scaled != number else scaled
    if column == "bool":
        return value if isinstance(value, bool) else REFUSED
    if column == "string":
        if isinstance(value, str):
            return REFUSED if re.search("[\ud800-\udfff]", value) else value
        return REFUSED
    if column == "binary":
        if isinstance(value, str):
            return REFUSED if re.search("[\ud800-\udfff]", value) else value.encode()
        return REFUSED
    if column == "date":
        if isinstance(value, str) and (match := _ISO_DATE.fullmatch(value)):
            try:
                return dt.date(*map(int, match.groups()))
            except ValueError:
                return REFUSED
        return REFUSED
    if column.startswith("timestamp"):
        if not isinstance(value, str) or not (match := _ISO_TIMESTAMP.fullmatch(value)):
            return REFUSED
        day, hour, minute, second, fraction, zone = match.groups()
        digits = fraction or ""
        if len(digits) > (0 if column == "timestamp_s" else 6):
            return REFUSED
        try:
            midnight = dt.datetime.fromisoformat(day)
        except ValueError:
            return REFUSED
        stamp = midnight.replace(
            hour=int(hour or 0),
            minute=int(minute or 0),
            second=int(second or 0),
            microsecond=int(digits.ljust(6, "0")),
        )
        if zone and zone != "Z":
            sign = 1 if zone[0] == "+" else -1
            stamp -= sign * dt.timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6]))
        return stamp.replace(tzinfo=dt.UTC) if column == "timestamptz" else stamp
    if column == "struct":
        if not isinstance(value, dict) or set(value) - {"a", "b"}:
            return REFUSED
        a = expected(value.get("a"), "int64")
        b = expected(value.get("b"), "string")
        return REFUSED if REFUSED in (a, b) else {"a": a, "b": b}
    if column == "list":
        if not isinstance(value, list):
            return REFUSED
        items = [expected(item, "int64") for item in value]
        return REFUSED if REFUSED in items else items
    raise AssertionError(column)


def same(left: Any, right: Any) -> bool:
    """Equal as values, NaN equal to NaN, a float's sign of zero and type kept."""
    if isinstance(left, float) and isinstance(right, float):
        return (math.isnan(left) and math.isnan(right)) or (
            left == right and math.copysign(1, left) == math.copysign(1, right)
        )
    if type(left) is not type(right) and not (
        isinstance(left, dt.datetime) and isinstance(right, dt.datetime)
    ):
        return False
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(same(left[key], right[key]) for key in left)
    if isinstance(left, list):
        return len(left) == len(right) and all(map(same, left, right))
    return bool(left == right)


TYPING: dict[str, Any] = {
    "int64": 1,
    "float64": 1.5,
    "bool": True,
    "string": "s",
    "struct": {"a": 1, "b": "x"},
    "list": [1],
}
"""A first value per column type an inferred schema can have: the type it infers."""


def through_objects(value: Any, column: str) -> Any:
    """The pipeline's path: a JSON object converted to a declared schema (``RowConverter``)."""
    converter = RowConverter("r", ResourceSchema(pa.schema([pa.field("v", COLUMN_TYPES[column])])))
    converted = converter.convert_rows([{"v": value}])
    return REFUSED if converted.bad else converted.batch.column(0)[0].as_py()


def through_arrow_json(value: Any, column: str) -> Any:
    """The declared-columns path of the Kafka and NATS sources: Arrow's JSON reader, then the lattice."""
    payload = json.dumps({"v": value}).encode()
    (run,) = JsonRows(pa.schema([pa.field("v", COLUMN_TYPES[column])])).decode([payload])
    if run.rows is None:
        return REFUSED
    assert isinstance(run.rows, pa.RecordBatch)
    return run.rows.column(0)[0].as_py()


def json_payload_value(value: Any) -> Any:
    """The value a JSON payload carries of ``value`` (what ``json.loads`` gives back)."""
    return json.loads(json.dumps(value))


PATHS = settings(
    max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PATHS
@given(kind=st.sampled_from(sorted(KINDS)), column=st.sampled_from(sorted(COLUMN_TYPES)), data=st.data())
def test_every_value_kind_lands_in_every_column_type_by_the_rule_on_every_path(
    kind: str, column: str, data: st.DataObject
) -> None:
    value = (
        json_payload_value(data.draw(KINDS[kind], label="value"))
        if kind != "lone surrogate"
        else data.draw(KINDS[kind])
    )
    rule = expected(value, column)
    objects = through_objects(value, column)
    arrow = through_arrow_json(value, column)
    for path, landed in (("JSON objects", objects), ("Arrow's JSON reader", arrow)):
        if rule is REFUSED:
            assert landed is REFUSED, f"{path}: {kind} {value!r} into {column} landed as {landed!r}"
        else:
            assert landed is not REFUSED, f"{path}: {kind} {value!r} into {column} was refused"
            assert same(landed, rule), (
                f"{path}: {kind} {value!r} into {column} landed as {landed!r}, not {rule!r}"
            )


ARROW_KINDS: dict[str, tuple[pa.DataType, st.SearchStrategy[Any]]] = {
    "int64": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "float64": (pa.float64(), st.floats(allow_nan=False)),
    "string": (pa.string(), st.text(st.characters(blacklist_categories=("Cs",)), max_size=4)),
    "bytes": (pa.binary(), st.binary(max_size=4)),
    "bool": (pa.bool_(), st.booleans()),
    "date": (pa.date32(), st.dates()),
    "timestamp": (
        pa.timestamp("us"),
        st.datetimes(min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2200, 1, 1)),
    ),
    "decimal": (
        pa.decimal128(20, 4),
        st.decimals(places=4, min_value=-(10**10), max_value=10**10, allow_nan=False),
    ),
}


def expected_arrow(value: Any, source: str, column: str) -> Any:
    """An Arrow value of another type conformed to a column: as the same value in a JSON object would
    land (timestamps and decimals by their ISO and digit texts; a date only into a date column; bytes
    only into binary, or into string when they are UTF-8)."""
    if value is None:
        return None
    if source == "bytes":
        if column == "binary":
            return value
        if column == "string":
            try:
                return value.decode()
            except UnicodeDecodeError:
                return REFUSED
        return REFUSED
    if source == "date":
        return value if column == "date" else REFUSED  # a date is not a timestamp: no time is invented
    if source == "timestamp":
        if column == "date":
            return REFUSED
        if column in ("timestamp", "timestamptz"):
            return value if column == "timestamp" else value.replace(tzinfo=dt.UTC)
        return expected(value.isoformat(), column) if column == "timestamp_s" else REFUSED
    if source == "decimal":
        if column == "decimal":
            return expected(str(value), column)
        if column in ("float32", "float64"):
            return expected(float(value), column)
        return REFUSED
    return expected(value, column)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    source=st.sampled_from(sorted(ARROW_KINDS)), column=st.sampled_from(sorted(COLUMN_TYPES)), data=st.data()
)
def test_arrow_values_of_another_type_land_by_the_same_rule(
    source: str, column: str, data: st.DataObject
) -> None:
    kind, values = ARROW_KINDS[source]
    value = data.draw(values)
    batch = pa.RecordBatch.from_pylist([{"v": value}], schema=pa.schema([pa.field("v", kind)]))
    conformed = conform_batch(batch, pa.schema([pa.field("v", COLUMN_TYPES[column])]))
    landed = REFUSED if conformed.bad else conformed.batch.column(0)[0].as_py()
    rule = expected_arrow(value, source, column)
    if rule is REFUSED:
        assert landed is REFUSED, f"{source} {value!r} into {column} landed as {landed!r}"
    else:
        assert landed is not REFUSED and same(landed, rule), (
            f"{source} {value!r} into {column}: {landed!r}, not {rule!r}"
        )


@PATHS
@given(
    kind=st.sampled_from(sorted(KINDS)),
    typed=st.sampled_from(["int64", "float64", "bool", "string", "struct", "list"]),
    data=st.data(),
)
def test_the_inferred_path_gives_the_declared_paths_answer(
    kind: str, typed: str, data: st.DataObject
) -> None:
    """A schema inferred from a first row types a column as a declared schema would: a later value then
    lands, or is refused, alike."""
    first = TYPING[typed]
    value = data.draw(KINDS[kind])
    inferred = RowConverter("r", ResourceSchema(on_bad_row=BadRowPolicy.DEAD_LETTER))
    inferred.convert_rows([{"v": first}])
    declared = RowConverter("r", ResourceSchema(pa.schema([pa.field("v", inferred.schema.field("v").type)])))
    left, right = inferred.convert_rows([{"v": value}]), declared.convert_rows([{"v": value}])
    assert bool(left.bad) == bool(right.bad), (kind, value, typed)
    if not left.bad:
        assert same(left.batch.to_pylist()[0]["v"], right.batch.to_pylist()[0]["v"])
    rule = expected(value, typed)
    assert bool(left.bad) == (rule is REFUSED), (kind, value, typed, rule)


def test_a_missing_field_is_counted_and_refused_by_a_strict_schema() -> None:
    loose = RowConverter("r", ResourceSchema.from_columns({"id": "int64", "name": "string"}))
    strict = RowConverter(
        "r", ResourceSchema.from_columns({"id": "int64", "name": "string"}, on_missing_field="refuse")
    )
    rows = [{"id": 1, "name": "a"}, {"id": 2}, {"id": 3, "name": None}]
    converted = loose.convert_rows(rows)
    assert (converted.batch.num_rows, dict(converted.missing)) == (3, {"name": 1})
    refused = strict.convert_rows(rows)
    assert [row.index for row in refused.bad] == [1] and "lacks field(s) name" in refused.bad[0].reason
    # A declared payload lacking the field names it in the batch (MISSING_COLUMN): the same count.
    (run,) = JsonRows(pa.schema([("id", pa.int64()), ("name", pa.string())])).decode(
        [json.dumps(row).encode() for row in rows]
    )
    assert isinstance(run.rows, pa.RecordBatch)
    assert dict(loose.convert_batch(run.rows).missing) == {"name": 1}
    assert [row.index for row in strict.convert_batch(run.rows).bad] == [1]


BEYOND_FLOAT64 = [b'{"v": 1e400}', b'{"v": 2e308}', b'{"v": -1' + b"0" * 309 + b".5}", b'{"v": [1.0, 2e308]}']
"""Numbers beyond float64's range, which ``json.loads`` reads as an infinity and Arrow's JSON reader
refuses (``1e400``) or also reads as one (``2e308``, 309 digits, inside a list)."""


@pytest.mark.parametrize("payload", BEYOND_FLOAT64, ids=["1e400", "2e308", "309 digits", "in a list"])
@pytest.mark.parametrize("declared", [False, True], ids=["objects", "declared"])
def test_a_number_beyond_float64s_range_is_not_a_row_and_an_infinity_token_is(
    payload: bytes, declared: bool
) -> None:
    kind = pa.list_(pa.float64()) if b"[" in payload else pa.float64()
    reader = JsonRows(pa.schema([pa.field("v", kind)]) if declared else None)
    infinity = b'{"v": [Infinity]}' if b"[" in payload else b'{"v": -Infinity}'
    runs = reader.decode([b'{"v": null}', payload, infinity])
    refused = [(run.start, run.reason) for run in runs if run.rows is None]
    assert [start for start, _ in refused] == [1], runs
    assert "beyond float64's range" in refused[0][1], refused[0][1]
    (last,) = [run for run in runs if run.rows is not None and run.stop == 3]
    rows = last.rows.to_pylist() if isinstance(last.rows, pa.RecordBatch) else list(last.rows or [])
    assert rows[-1] in ({"v": [math.inf]}, {"v": -math.inf}), rows


# -- end to end -----------------------------------------------------------------------------------

E2E_COLUMNS = [
    "int8",
    "int64",
    "uint64",
    "float32",
    "float64",
    "decimal",
    "bool",
    "string",
    "date",
    "timestamptz",
    "struct",
    "list",
]
"""The declared columns of the end-to-end streams (one value per record, each in its own column)."""


def e2e_records() -> list[tuple[str, Any]]:
    """(column, value): values of every kind into every end-to-end column, fixed by a seed."""
    records: list[tuple[str, Any]] = []

    @settings(max_examples=1, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        for kind in sorted(KINDS):
            if kind in ("lone surrogate", "NaN and Infinity tokens"):
                continue  # lone surrogates: refused at decode (test_hostile_records); NaN: not ordered
            for column in E2E_COLUMNS:
                records.append((column, json_payload_value(data.draw(KINDS[kind]))))

    draw()
    return records


def arrow_column(column: str) -> str:
    """The Arrow type name of an end-to-end column (what ``columns`` declares)."""
    return {
        "float32": "float32",
        "float64": "float64",
        "decimal": "decimal128(12, 3)",
        "date": "date32",
        "timestamptz": "timestamp[us, tz=UTC]",
    }.get(column, column)


def declared() -> dict[str, str]:
    return {
        "id": "int64 not null",
        **{f"c_{column}": arrow_column(column) for column in E2E_COLUMNS if column not in ("struct", "list")},
    }


def read_back(url: str, table: str) -> dict[int, dict[str, Any]]:
    with psycopg.connect(url) as conn:
        cursor = conn.execute(f'SELECT * FROM "{table}"')
        names = [column.name for column in cursor.description or ()]
        return {row[0]: dict(zip(names, row, strict=True)) for row in cursor.fetchall()}


def check_landed(rows: dict[int, dict[str, Any]], records: list[tuple[str, Any]], refused: set[int]) -> None:
    """Every record the rule lands is in ``rows`` with its value; every other one is in ``refused``."""
    for index, (column, value) in enumerate(records):
        if expected(value, column) is REFUSED:
            assert index in refused and index not in rows, (
                f"record {index}: {value!r} into {column} was not refused"
            )
        else:
            assert index in rows, f"record {index}: {value!r} into {column} did not land"
    check_values(rows, {index: record for index, record in enumerate(records) if index in rows})


def check_values(rows: dict[int, dict[str, Any]], records: dict[int, tuple[str, Any]]) -> None:
    """Each of ``records`` holds, in its row, the value the rule lands."""
    for index, (column, value) in records.items():
        got, want = rows[index][f"c_{column}"], expected(value, column)
        if column == "float32":
            got = _float32(got) if got is not None and math.isfinite(got) else got
        if column == "uint64" and got is not None:
            got = int(got)
        if isinstance(want, dt.datetime) and isinstance(got, dt.datetime):
            assert got == want, (index, column, value, got)
            continue
        assert same(got, want) or (isinstance(got, Decimal) and got == want), (
            index,
            column,
            value,
            got,
            want,
        )


def stream_of(
    name: str,
    source: FaucetConnection,
    source_config: dict[str, Any],
    url: str,
    table: str,
    tmp_path: Path,
    schema: ResourceSchema | None,
    resource: str,
) -> FaucetStream:
    return FaucetStream(
        name=name,
        source=source.using(**source_config),
        sink=FaucetConnection(connector="postgres", config={"url": url}).using(table=table),
        resources=(resource,),
        schemas={} if schema is None else {resource: schema},
        limits=ReadLimits(records=100_000, idle=0.5),
        state_url=f"sqlite:///{tmp_path / f'{name}.db'}",
    )


def run_stream(stream: FaucetStream, *steps: Callable[[], None]) -> tuple[list[Any], list[dict[str, Any]]]:
    """Run ``stream`` once after each of ``steps`` (or once), on one runner: its inferred schemas live
    as long as it does. Returns every certificate and the dead letters."""
    assert stream.state_url is not None
    store = StateStore(stream.state_url)
    runner = StreamRunner(stream.build_spec(), store, worker_id="w1")

    async def go() -> list[Any]:
        certificates = []
        try:
            for step in steps or (lambda: None,):
                await asyncio.to_thread(step)
                certificates += await runner.run_epochs(20.0)
            return certificates
        finally:
            await runner.close()

    try:
        return asyncio.run(go()), store.dead_letters(stream.name)
    finally:
        store.close()


def refused_offsets(letters: list[dict[str, Any]]) -> set[int]:
    found = set()
    for letter in letters:
        match = re.search(r"@(\d+)#", letter["event"])
        assert match, letter["event"]
        found.add(int(match.group(1)))
    return found


def test_kafka_streams_declared_at_the_source_or_in_the_pipeline_land_each_value_by_the_rule(
    kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    records = e2e_records()
    payloads = [
        json.dumps({"id": index, f"c_{column}": value}).encode()
        for index, (column, value) in enumerate(records)
    ]
    kafka = FaucetConnection(
        connector="kafka", config={"bootstrap_servers": kafka_bootstrap, "group_id": unique_name("g")}
    )
    columns = {**declared(), "c_struct": "string", "c_list": "string"}
    del columns["c_struct"], columns["c_list"]
    # Struct and list columns cannot be declared by name: the pipeline's schema declares them.
    pipeline = pa.schema(
        [pa.field("id", pa.int64(), nullable=False)]
        + [pa.field(f"c_{column}", COLUMN_TYPES[column]) for column in E2E_COLUMNS]
    )
    for name, source, schema in (
        ("at_source", {"columns": columns, "on_malformed": "dead_letter"}, None),
        (
            "in_pipeline",
            {"on_malformed": "dead_letter"},
            ResourceSchema(pipeline, ("id",), BadRowPolicy.DEAD_LETTER),
        ),
    ):
        if name == "at_source":
            kept = [(column, value) for column, value in records if column not in ("struct", "list")]
            batch = [
                json.dumps({"id": index, f"c_{column}": value}).encode()
                for index, (column, value) in enumerate(kept)
            ]
        else:
            kept, batch = records, payloads
        topic = unique_name("t")
        create_topic(kafka_bootstrap, topic, 1)
        produce(kafka_bootstrap, topic, batch, partitions=1)
        stream = stream_of(
            unique_name("s"),
            kafka,
            {"topics": [topic], **source},
            postgres_url,
            topic,
            tmp_path,
            schema,
            topic,
        )
        certificates, letters = run_stream(stream)
        assert certificates, name
        check_landed(read_back(postgres_url, topic), kept, refused_offsets(letters))
        # Each record holds one of the columns: it lacks the others, which the certificates count.
        lacking = {
            field for certificate in certificates for field in certificate.missing_fields.get(topic, {})
        }
        assert {f"c_{column}" for column, _ in kept} <= lacking, f"{name}: {lacking}"


def test_a_nats_stream_with_an_inferred_schema_lands_each_value_by_the_rule(
    nats_url: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    """Inferred: the first payload types each column (int64, float64, bool, string, struct, list); the
    later values land in those types, or are dead-lettered under their stream sequence."""
    typed = TYPING
    records = [(column, value) for column, value in e2e_records() if column in typed]
    stream_name = unique_name("S")

    async def publish(*, first: bool) -> None:
        client = await nats.connect(nats_url)
        try:
            jetstream = client.jetstream()
            if first:
                await jetstream.add_stream(name=stream_name, subjects=[stream_name])
                typing = {"id": -1, **{f"c_{c}": v for c, v in typed.items()}}
                await jetstream.publish(stream_name, json.dumps(typing).encode())
                return
            for index, (column, value) in enumerate(records):
                await jetstream.publish(stream_name, json.dumps({"id": index, f"c_{column}": value}).encode())
        finally:
            await client.close()

    nats_connection = FaucetConnection(connector="nats", config={"servers": [nats_url]})
    table = unique_name("tbl")
    schema = ResourceSchema(on_bad_row=BadRowPolicy.DEAD_LETTER)
    stream = stream_of(
        unique_name("s"),
        nats_connection,
        {"stream": stream_name},
        postgres_url,
        table,
        tmp_path,
        schema,
        stream_name,
    )
    # The typing payload alone first (its epoch types the columns), then every record.
    certificates, letters = run_stream(
        stream, lambda: asyncio.run(publish(first=True)), lambda: asyncio.run(publish(first=False))
    )
    assert certificates
    # Sequence n + 2 holds record n (sequence 1 is the typing payload).
    refused = {sequence - 2 for sequence in refused_offsets(letters)}
    rows = read_back(postgres_url, table)
    rows.pop(-1)
    check_landed(rows, records, refused)


def test_files_and_sql_sources_land_each_value_by_the_rule_in_the_postgres_and_sql_sinks(
    postgres_url: str, tmp_path: Path
) -> None:
    """Bounded sources have no dead-letter route for what they cannot read: a value that does not land
    stops the sync naming its file and line (files) or row (SQL); those are checked one by one, and
    every value that lands goes through one sync into each sink."""
    records = [(column, value) for column, value in e2e_records() if column not in ("struct", "list")]
    types = {
        f"c_{column}": arrow_column(column) for column in E2E_COLUMNS if column not in ("struct", "list")
    }
    landing = [
        (index, column, value)
        for index, (column, value) in enumerate(records)
        if expected(value, column) is not REFUSED
    ]
    for index, (column, value) in enumerate(records):
        if expected(value, column) is REFUSED:
            path = tmp_path / f"refused_{index}.jsonl"
            path.write_text(
                json.dumps({"id": 0}) + "\n" + json.dumps({"id": index, f"c_{column}": value}) + "\n"
            )
            with pytest.raises(DataError) as refused:
                read_files(path, types)
            assert refused.value.where == f"{path} @ line 2", (column, value, refused.value)
    lines = tmp_path / "landing.jsonl"
    lines.write_text(
        "".join(json.dumps({"id": index, f"c_{column}": value}) + "\n" for index, column, value in landing)
    )
    kept = {index: (column, value) for index, column, value in landing}
    for sink in ("postgres", "sql"):
        url = postgres_url if sink == "postgres" else f"sqlite:///{tmp_path / 'sink.db'}"
        result = sync(
            get_connector("files").source({"paths": [str(lines)], "column_types": types}),
            sink,
            url,
            "from_files",
        )
        assert result.rows_written == len(landing)
        if sink == "postgres":
            check_values(read_back(postgres_url, "from_files"), kept)
    # The SQL source (SQLite keeps any value in any column): integers, floats and texts into typed columns.
    database = f"sqlite:///{tmp_path / 'source.db'}"
    engine = sa.create_engine(database)
    sqlite_columns = {"int64": "INTEGER", "float64": "REAL", "string": "TEXT"}
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE src (id INTEGER PRIMARY KEY, "
            + ", ".join(f"c_{c} {t}" for c, t in sqlite_columns.items())
            + ")"
        )
    sql_records = [
        (column, value)
        for column, value in records
        if column in sqlite_columns
        and (isinstance(value, float | str) or (type(value) is int and -(2**63) <= value < 2**63))
    ]
    with engine.begin() as conn:
        for index, (column, value) in enumerate(sql_records):
            conn.exec_driver_sql(f"INSERT INTO src (id, c_{column}) VALUES (?, ?)", (index, value))
    engine.dispose()
    outcomes = {}
    for index, (column, _value) in enumerate(sql_records):
        source = get_connector("sql").source({"url": database, "table": "src", "cursor": "id"})
        source.apply_start_bookmark({"version": 1, "columns": ["id", "id"], "values": [index - 1, index - 1]})
        try:
            pages = asyncio.run(first_page(source))
            outcomes[index] = pages.column(f"c_{column}")[0].as_py()
        except DataError as exc:
            assert f"id={index}" in exc.message, exc.message
            outcomes[index] = REFUSED
    # SQLite converts a value to its column's affinity when it can (2.0 into INTEGER is 2, 0.25 into
    # TEXT is '0.25'): the kind the source holds is the stored one.
    with sqlite3.connect(tmp_path / "source.db") as stored:
        held = {
            index: stored.execute(f"SELECT c_{column} FROM src WHERE id = ?", (index,)).fetchone()[0]
            for index, (column, _) in enumerate(sql_records)
        }
    for index, (column, _) in enumerate(sql_records):
        rule = expected(held[index], column)
        assert (outcomes[index] is REFUSED) == (rule is REFUSED), (column, held[index], outcomes[index])
        if rule is not REFUSED:
            assert same(outcomes[index], rule), (column, held[index], outcomes[index])
    assert REFUSED in outcomes.values() and any(value is not REFUSED for value in outcomes.values())


def read_files(path: Path, types: dict[str, str]) -> list[dict[str, Any]]:
    source = get_connector("files").source({"paths": [str(path)], "column_types": types})

    async def read() -> list[dict[str, Any]]:
        return [row async for page in source.stream_pages({}, 100) for row in page.records.to_pylist()]

    return asyncio.run(read())


async def first_page(source: Any) -> pa.RecordBatch:
    try:
        async for page in source.stream_pages({}, 1):
            return page.records
        raise AssertionError("no page")
    finally:
        await source.close()


def sync(source: Any, sink: str, url: str, table: str) -> Any:
    target = get_connector(sink).sink({"url": url, "table": table})

    async def go() -> Any:
        try:
            return await run_bounded_sync(source, target, SyncSettings(batch_size=1000))
        finally:
            await source.close()
            await target.close()

    return asyncio.run(go())


@pytest.mark.parametrize("source", ["kafka", "nats"])
def test_a_float_in_a_column_inferred_int64_stops_the_stream_naming_its_position_never_truncated(
    source: str,
    kafka_bootstrap: str,
    nats_url: str,
    postgres_url: str,
    unique_name: Callable[..., str],
    tmp_path: Path,
) -> None:
    """The issue's case: a column inferred int64 from a first epoch, then 1.5 and -0.9 (which Arrow's
    conversion truncated to 1 and 0, certified): under the default policy (halt) the stream stops at
    the first of them, naming its position, with nothing of that epoch certified."""
    name, table = unique_name("src"), unique_name("tbl")
    if source == "kafka":
        create_topic(kafka_bootstrap, name, 1)
        connection = FaucetConnection(
            connector="kafka", config={"bootstrap_servers": kafka_bootstrap, "group_id": name}
        )
        config: dict[str, Any] = {"topics": [name]}

        def send(values: list[dict[str, Any]]) -> None:
            produce(kafka_bootstrap, name, [json.dumps(value).encode() for value in values], partitions=1)

    else:
        connection = FaucetConnection(connector="nats", config={"servers": [nats_url]})
        config = {"stream": name}

        async def publish(values: list[dict[str, Any]]) -> None:
            client = await nats.connect(nats_url)
            try:
                jetstream = client.jetstream()
                await jetstream.add_stream(name=name, subjects=[name])
                for value in values:
                    await jetstream.publish(name, json.dumps(value).encode())
            finally:
                await client.close()

        def send(values: list[dict[str, Any]]) -> None:
            asyncio.run(publish(values))

    stream = stream_of(unique_name("s"), connection, config, postgres_url, table, tmp_path, None, name)
    with pytest.raises(DataError) as stopped:
        run_stream(
            stream,
            lambda: send([{"id": 0, "v": 1}]),
            lambda: send([{"id": 1, "v": 1.5}, {"id": 2, "v": -0.9}]),
        )
    where = stopped.value.where or ""
    assert ("@1#" if source == "kafka" else "@2#") in where, where  # offset 1, sequence 2
    assert "float 1.5 does not fit int64" in stopped.value.message, stopped.value.message
    assert read_back(postgres_url, table) == {0: {"id": 0, "v": 1}}, "nothing past the first epoch"


@pytest.mark.parametrize("columns", [None, {"id": "int64", "v": "string"}], ids=["inferred", "declared"])
def test_a_lone_surrogate_is_dead_lettered_under_its_offset_and_the_stream_goes_on(
    kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path, columns: Any
) -> None:
    """``"\\ud800"`` (a JSON escape) and the bytes ED A0 80 are no Unicode text: on both paths the record
    cannot be a row, is dead-lettered under its offset (a raw UnicodeEncodeError escaped before and
    the stream stayed stuck), and the records after it land."""
    topic, table = unique_name("t"), unique_name("tbl")
    create_topic(kafka_bootstrap, topic, 1)
    payloads = [
        b'{"id": 1, "v": "a"}',
        b'{"id": 2, "v": "\\ud800"}',
        b'{"id": 3, "v": "\xed\xa0\x80"}',
        b'{"id": 4, "v": "b"}',
    ]
    produce(kafka_bootstrap, topic, payloads, partitions=1)
    kafka = FaucetConnection(
        connector="kafka", config={"bootstrap_servers": kafka_bootstrap, "group_id": topic}
    )
    source = {"topics": [topic], "on_malformed": "dead_letter", **({"columns": columns} if columns else {})}
    schema = ResourceSchema(on_bad_row=BadRowPolicy.DEAD_LETTER)
    stream = stream_of(unique_name("s"), kafka, source, postgres_url, table, tmp_path, schema, topic)
    certificates, letters = run_stream(stream)
    assert certificates
    assert sorted(read_back(postgres_url, table)) == [1, 4]
    by_offset = {int(re.search(r"@(\d+)#", letter["event"]).group(1)): letter for letter in letters}  # type: ignore[union-attr]
    assert sorted(by_offset) == [1, 2]
    assert "surrogate" in by_offset[1]["reason"], by_offset[1]["reason"]
    assert "UTF-8" in by_offset[2]["reason"], by_offset[2]["reason"]
    assert bytes(by_offset[2]["payload"]) == payloads[2], "the dead letter holds the record's own bytes"
    # A row holding one (from a source of Python objects) is dead-lettered as JSON that reads it back.
    assert json.loads(row_payload({"v": "\ud800"})) == {"v": "\ud800"}
