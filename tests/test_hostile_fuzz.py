"""Fuzzing every source with hostile records: random bytes, random JSON shapes and depths, and random
values for declared column types, into Kafka, NATS JetStream and files.

Every record's outcome is a row (which the pipeline's converter then keeps or names as a bad row), a
dead letter with its reason, or a FaucetError naming the record's position; never an exception of
another type, never a record skipped without a trace. Bounded: few examples, small records, no deadline
per example (the servers are real and the machine shared), each read bounded by its idle limit.
"""

import asyncio
import csv
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
from faucet_kafka import KafkaSourceConfig
from faucet_nats.config import NatsSourceConfig
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_topics import create_topic, produce
from test_hostile_records import Recorder, publish_nats, read_kafka, read_nats

from faucet_dagster.pipeline import ResourceSchema, RowConverter
from faucet_dagster.protocol import DataError, FaucetError, get_connector

FUZZ = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
    derandomize=True,
)
COLUMNS = {"id": "int64 not null", "name": "string", "score": "double", "at": "timestamp[us, tz=UTC]"}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
deep = st.integers(min_value=1, max_value=12_000).map(
    lambda depth: '{"id": 1, "v": ' + "[" * depth + "]" * depth + "}"
)
column_values = st.fixed_dictionaries(
    {
        "id": st.one_of(
            st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=5), st.none(), st.floats()
        ),
        "name": st.one_of(
            st.text(max_size=10), st.integers(), st.none(), st.lists(st.integers(), max_size=2)
        ),
    },
    optional={
        "score": st.one_of(
            st.floats(), st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=4)
        ),
        "at": st.one_of(st.text(max_size=30), st.integers(), st.just("2026-12-01T10:00:00Z")),
        "extra": scalars,
    },
)
payloads = st.lists(
    st.one_of(
        st.binary(max_size=60),
        json_values.map(lambda value: json.dumps(value).encode()),
        deep.map(str.encode),
        column_values.map(lambda row: json.dumps(row).encode()),
        st.binary(min_size=1, max_size=8).map(lambda raw: b'{"id": 1, "name": "' + raw + b'"}'),
        # A value starting with null crashed Arrow's JSON reader (the process, not the read).
        st.sampled_from([b"null", b" null\n", b"nullx", b"null,", b"null]", b"nullnull"]),
    ),
    min_size=1,
    max_size=12,
)


def traced(sink: Recorder, count: int, first: int, columns: dict[str, str] | None) -> None:
    """Every position ``first .. first + count - 1`` is exactly one row (kept or named bad by the
    pipeline's converter) or one dead letter with a reason."""
    rejected = {record.identity.position: record.reason for record in sink.rejected}
    assert all(rejected.values()), "a dead letter without its reason"
    positions = [position for position, _ in sink.rows]
    assert sorted(int(p) for p in [*positions, *rejected]) == list(range(first, first + count))
    converter = RowConverter("fuzz", ResourceSchema.from_columns(columns))
    converted = converter.convert_rows([row for _, row in sink.rows])
    kept = len(sink.rows) if converted.kept is None else len(converted.kept)
    assert kept + len(converted.bad) == len(sink.rows)
    assert all(bad.reason for bad in converted.bad)


@FUZZ
@given(records=payloads, dead_letter=st.booleans())
def test_kafka_fuzz(
    kafka_bootstrap: str, unique_name: Callable[..., str], records: list[bytes], dead_letter: bool
) -> None:
    topic = unique_name("fuzz")
    create_topic(kafka_bootstrap, topic, 1)
    produce(kafka_bootstrap, topic, records, partitions=1)
    cfg = KafkaSourceConfig(
        bootstrap_servers=kafka_bootstrap,
        topics=(topic,),
        group_id=unique_name("g"),
        on_malformed="dead_letter" if dead_letter else "halt",
    )
    try:
        sink = asyncio.run(read_kafka(cfg))
    except DataError as exc:
        assert not dead_letter
        assert exc.where is not None and exc.where.startswith(f"topic {topic} partition 0 offset ")
        return
    traced(sink, len(records), 0, None)


@FUZZ
@given(records=payloads, declared=st.booleans())
def test_nats_fuzz(
    nats_url: str, unique_name: Callable[..., str], records: list[bytes], declared: bool
) -> None:
    stream = unique_name("F")
    asyncio.run(publish_nats(nats_url, stream, records))
    columns = COLUMNS if declared else None
    cfg = NatsSourceConfig(servers=(nats_url,), stream=stream, columns=columns, on_malformed="dead_letter")
    sink = asyncio.run(read_nats(cfg))
    traced(sink, len(records), 1, columns)
    halting = NatsSourceConfig(servers=(nats_url,), stream=stream, columns=columns, durable="halting")
    try:
        asyncio.run(read_nats(halting))
    except DataError as exc:
        assert exc.where is not None and exc.where.startswith(f"nats stream {stream} sequence ")
        assert sink.rejected, "halted on a record the dead-letter read accepted"


texts = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12
) | st.sampled_from(['"', '""', ",", "\n", "\r\n", "a\rb", '5 inch"', '"open', "NULL"])


def read_files(path: Path, **config: Any) -> list[dict[str, Any]]:
    source = get_connector("files").source({"paths": [str(path)], **config})

    async def collect() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        async for page in source.stream_pages({}, 3):
            assert isinstance(page.records, pa.RecordBatch)
            found.extend(page.records.to_pylist())
        return found

    return asyncio.run(collect())


@settings(FUZZ, max_examples=150)
@given(
    rows=st.lists(st.tuples(texts, texts), min_size=1, max_size=10),
    garbage=st.binary(max_size=80),
    values_json=st.lists(payloads.map(b"\n".join), max_size=3),
)
def test_files_fuzz(
    tmp_path_factory: Any, rows: list[tuple[str, str]], garbage: bytes, values_json: list[bytes]
) -> None:
    folder = tmp_path_factory.mktemp("fuzz")
    # A CSV written by a correct writer reads back exactly: every value, every row.
    written = folder / "valid.csv"
    buffer = io.StringIO()
    writer = csv.writer(buffer, quoting=csv.QUOTE_MINIMAL)
    writer.writerow(["a", "b"])
    writer.writerows(rows)
    written.write_bytes(buffer.getvalue().encode())
    strings = {"column_types": {"a": "string", "b": "string"}, "csv": {"null_values": []}}
    assert [(row["a"], row["b"]) for row in read_files(written, **strings)] == rows
    # Random bytes: rows, or a FaucetError naming the file; a row count never silently shrinks for a
    # file whose every line is one complete row.
    for suffix, content in ((".csv", b"a,b\n" + garbage), (".jsonl", garbage)):
        target = folder / f"garbage{suffix}"
        target.write_bytes(content)
        try:
            read_files(target)
        except FaucetError as exc:
            assert exc.where is not None and str(target) in exc.where
    for index, value in enumerate(values_json):
        shaped = folder / f"shaped{index}.jsonl"
        shaped.write_bytes(value)
        try:
            read_files(shaped)
        except FaucetError as exc:
            assert exc.where is not None and str(shaped) in exc.where
    lines = folder / "lines.jsonl"
    values = [json.dumps({"a": a, "b": b}) for a, b in rows]
    lines.write_text("\n".join(values) + "\n")
    assert [(row["a"], row["b"]) for row in read_files(lines)] == rows
