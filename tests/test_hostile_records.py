"""Malformed records into every source: a typed error naming the record's position, or a dead letter
with its reason; never another exception, never a record lost without a trace.

Against the real Kafka-protocol broker and NATS JetStream, and real files.
"""

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import pyarrow as pa
import pytest
from faucet_kafka import KafkaSourceConfig
from faucet_kafka.source import KafkaStreamSource
from faucet_nats.config import NatsSourceConfig
from faucet_nats.source import NatsStreamSource
from kafka_topics import create_topic, produce

from faucet_dagster.pipeline import ResourceSchema, RowConverter
from faucet_dagster.protocol import (
    CancelToken,
    Control,
    DataError,
    Identities,
    Membership,
    OrderingDomain,
    ReadLimits,
    Records,
    RejectedRecord,
    StreamRecordSink,
    StreamSource,
    WorkerIdentity,
    get_connector,
    record_count,
)

WORKER = WorkerIdentity("worker-hostile", 1)
DEEP = b'{"id": 0, "v": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
FAST = ReadLimits(idle=1.0)


class Recorder(StreamRecordSink):
    """What a read hands over: rows with their positions, and rejected records."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict[str, Any]]] = []
        self.rejected: list[RejectedRecord] = []

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        assert record_count(rows) == len(identities)
        listed = rows.to_pylist() if isinstance(rows, pa.RecordBatch) else list(rows)
        self.rows.extend(zip(identities.positions, listed, strict=True))

    async def control(self, control: Control) -> None:
        return None

    async def reject(self, record: RejectedRecord) -> None:
        self.rejected.append(record)


async def read_once(source: StreamSource, resources: list[str]) -> Recorder:
    """Open a session from the start, read until idle, close it: what the read handed over."""
    session = await source.open(resources, [], Membership(), WORKER)
    try:
        sink = Recorder()
        await session.read(sink, FAST, CancelToken())
        return sink
    finally:
        await session.close()


async def read_kafka(cfg: KafkaSourceConfig) -> Recorder:
    return await read_once(KafkaStreamSource(cfg), list(cfg.topics))


def test_kafka_json_nested_too_deeply_is_malformed_at_its_offset(
    kafka_bootstrap: str, unique_name: Callable[..., str]
) -> None:
    topic = unique_name("deep")
    create_topic(kafka_bootstrap, topic, 1)
    produce(kafka_bootstrap, topic, [b'{"id": 1}', DEEP, b'{"id": 3}'], partitions=1)
    base = {"bootstrap_servers": kafka_bootstrap, "topics": (topic,)}
    with pytest.raises(DataError, match="nested too deeply") as caught:
        asyncio.run(read_kafka(KafkaSourceConfig(**base, group_id=unique_name("g"))))
    assert caught.value.where == f"topic {topic} partition 0 offset 1"
    # Dead-lettered, the stream reads on past it (it is not stuck on the record).
    sink = asyncio.run(
        read_kafka(KafkaSourceConfig(**base, group_id=unique_name("g"), on_malformed="dead_letter"))
    )
    assert [row["id"] for _, row in sink.rows] == [1, 3]
    [rejected] = sink.rejected
    assert rejected.payload == DEEP and "nested too deeply" in rejected.reason
    assert rejected.identity.position == "1"


async def publish_nats(url: str, stream: str, payloads: list[bytes]) -> None:
    client = await nats.connect(url)
    try:
        jsm = client.jetstream()
        await jsm.add_stream(name=stream, subjects=[f"{stream}.>"])
        for data in payloads:
            await jsm.publish(f"{stream}.a", data)
    finally:
        await client.close()


async def read_nats(cfg: NatsSourceConfig) -> Recorder:
    return await read_once(NatsStreamSource(cfg), [cfg.stream])


@pytest.mark.parametrize("columns", [None, {"id": "int64 not null", "name": "string"}])
def test_nats_deep_json_and_invalid_utf8_are_dead_letters_with_their_sequence(
    nats_url: str, unique_name: Callable[..., str], columns: dict[str, str] | None
) -> None:
    stream = unique_name("S")
    bad_utf8 = b'{"id": 3, "name": "caf\xe9"}'
    payloads = [b'{"id": 1, "name": "a"}', DEEP, bad_utf8, b'{"id": 4, "name": "b"}', b"nullx", b" null"]
    asyncio.run(publish_nats(nats_url, stream, payloads))
    cfg = NatsSourceConfig(servers=(nats_url,), stream=stream, columns=columns, on_malformed="dead_letter")
    sink = asyncio.run(read_nats(cfg))
    assert [(position, row["id"]) for position, row in sink.rows] == [("1", 1), ("4", 4)]
    reasons = {record.identity.position: record.reason for record in sink.rejected}
    assert set(reasons) == {"2", "3", "5", "6"}
    assert "not JSON" in reasons["5"] and "not an object" in reasons["6"]
    assert "nested too deeply" in reasons["2"]
    assert "UTF-8" in reasons["3"] or "utf-8" in reasons["3"]
    halting = NatsSourceConfig(servers=(nats_url,), stream=stream, columns=columns, durable="halting")
    with pytest.raises(DataError) as caught:
        asyncio.run(read_nats(halting))
    assert caught.value.where == f"nats stream {stream} sequence 2"


# Payloads whose lines, joined, pair up into as many objects as there are payloads: two objects in one
# payload beside a blank one, and an object split over two payloads beside one holding a newline (which
# made the reader parse values across lines). Each of them is malformed; a count of rows cannot tell.
MISALIGNED = [
    b'{"id": 1}',
    b'{"id": 2}{"id": 3}',
    b"",
    b'{"id":',
    b"5}",
    b'{"id": 6}\n{"id": 7}',
    b'{"id": 8}',
    b'{"id":\n9}',
]


def _misaligned_outcome(
    rows: list[tuple[str, dict[str, Any]]], rejected: list[RejectedRecord], first: int
) -> tuple[dict[int, Any], dict[int, str]]:
    by_offset = {int(position) - first: row["id"] for position, row in rows}
    reasons = {int(record.identity.position) - first: record.reason for record in rejected}
    return by_offset, reasons


@pytest.mark.parametrize("source", ["kafka", "nats"])
def test_declared_columns_never_pair_lines_of_different_payloads(
    kafka_bootstrap: str, nats_url: str, unique_name: Callable[..., str], source: str
) -> None:
    columns = {"id": "int64"}
    if source == "kafka":
        topic = unique_name("misaligned")
        create_topic(kafka_bootstrap, topic, 1)
        produce(kafka_bootstrap, topic, MISALIGNED, partitions=1)
        cfg = KafkaSourceConfig(
            bootstrap_servers=kafka_bootstrap,
            topics=(topic,),
            group_id=unique_name("g"),
            columns=columns,
            on_malformed="dead_letter",
        )
        sink, first = asyncio.run(read_kafka(cfg)), 0
    else:
        stream = unique_name("M")
        asyncio.run(publish_nats(nats_url, stream, MISALIGNED))
        nats_cfg = NatsSourceConfig(
            servers=(nats_url,), stream=stream, columns=columns, on_malformed="dead_letter"
        )
        sink, first = asyncio.run(read_nats(nats_cfg)), 1
    by_offset, reasons = _misaligned_outcome(sink.rows, sink.rejected, first)
    assert by_offset == {0: 1, 6: 8, 7: 9}
    assert set(reasons) == {1, 2, 3, 4, 5}
    assert all("not JSON" in reason for reason in reasons.values())


@pytest.mark.parametrize("declared", [None, {"id": "int64", "n": "int64"}])
def test_an_integer_beyond_int64_is_a_bad_row_not_an_overflow(declared: dict[str, str] | None) -> None:
    converter = RowConverter("orders", ResourceSchema.from_columns(declared))
    rows = [{"id": 1, "n": 2**70}, {"id": 2, "n": 5}, {"id": 3, "n": -(2**63) - 1}]
    converted = converter.convert_rows(rows)
    assert converted.batch.column("id").to_pylist() == [2]
    assert [bad.index for bad in converted.bad] == [0, 2]
    assert all("does not fit" in bad.reason for bad in converted.bad)
    alone = RowConverter("orders", ResourceSchema.from_columns(None)).convert_rows([{"n": 2**64}])
    assert [bad.index for bad in alone.bad] == [0] and alone.batch.num_rows == 0


def read_files(path: Path, **config: Any) -> list[dict[str, Any]]:
    source = get_connector("files").source({"paths": [str(path)], **config})

    async def collect() -> list[dict[str, Any]]:
        return [row async for page in source.stream_pages({}, 2) for row in page.records.to_pylist()]

    return asyncio.run(collect())


def test_csv_unterminated_quote_is_a_data_error_naming_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "orders.csv"
    lines = (
        ["id,name"]
        + [f"{i},n{i}" for i in range(1, 5)]
        + ['5,"never closed']
        + [f"{i},n{i}" for i in range(6, 10)]
    )
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="never closes") as caught:
        read_files(path)
    assert caught.value.where == f"{path} @ row 5"
    # Valid quoting around it is read as written: a stray quote inside a value, a closed multi-line
    # value as the last one of the file, an escaped quote at its end.
    path.write_text('id,name\n1,5 inch"\n2,"two\nlines"\n3,"ends ""quoted"""\n')
    assert [row["name"] for row in read_files(path)] == ['5 inch"', "two\nlines", 'ends "quoted"']
    path.write_text('id,name\n1,a\n2,"open ""escaped"" \nrest\n')
    with pytest.raises(DataError, match="never closes"):
        read_files(path)


def test_csv_bytes_not_in_its_encoding_are_a_data_error_naming_file_row_and_column(tmp_path: Path) -> None:
    path = tmp_path / "latin.csv"
    path.write_bytes(b"id,name\n1,ok\n2,fine\n3,caf\xe9\n4,more\n")
    with pytest.raises(DataError, match="column 'name'") as caught:
        read_files(path)
    assert caught.value.where == f"{path} @ row 3"
    assert [row["name"] for row in read_files(path, csv={"encoding": "latin-1"})][2] == "café"
    # A column declared binary keeps its bytes.
    assert read_files(path, column_types={"name": "binary"})[2]["name"] == b"caf\xe9"
    assert json.dumps(read_files(path, csv={"encoding": "latin-1"}))  # plain text after decoding


@pytest.mark.parametrize("first", [b"null", b"  null,", b"nullx"])
def test_a_jsonl_file_starting_with_null_is_a_data_error_not_a_crash(tmp_path: Path, first: bytes) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"\n\n" + first + b'\n{"id": 1}\n')
    with pytest.raises(
        DataError, match=r"line 3: the line is (JSON NoneType, )?not (an object|JSON)"
    ) as caught:
        read_files(path)
    assert caught.value.where == f"{path} @ line 3"
