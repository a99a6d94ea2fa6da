"""The Kafka source against the real Kafka-protocol broker (Tansu) of the test session.

``Collector`` below stands where the pipeline stands in production: it records, in call order, what a
read hands over (rows with their identities, boundaries, rejected records) and checks the ordering
rules a read must keep (rows after the resume position, strictly increasing per domain, a boundary
never before the rows it follows).
"""

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import faucet_kafka.client
import faucet_kafka.reader
import pyarrow as pa
import pytest
from confluent_kafka import Producer
from faucet_kafka import KafkaSourceConfig
from faucet_kafka.bounded import KafkaSource
from faucet_kafka.source import KafkaStreamSession, KafkaStreamSource
from kafka_topics import committed, create_topic, delete_topic, produce, produce_json

from faucet_dagster.protocol import (
    CancelToken,
    Control,
    Coverage,
    DataError,
    Identities,
    IncarnationChanged,
    IntegrityError,
    Membership,
    OrderingDomain,
    OwnershipLost,
    Position,
    PositionUnavailable,
    ProgressBoundary,
    ReadLimits,
    Records,
    RejectedRecord,
    StreamRecordSink,
    WorkerIdentity,
    get_connector,
    record_count,
)

WORKER = WorkerIdentity("worker-a", 1)
LIMITS = ReadLimits(idle=1.0)
ALL = Membership()


class Collector(StreamRecordSink):
    """Records what a read writes, and refuses what the pipeline would refuse."""

    def __init__(self) -> None:
        self.rows: dict[OrderingDomain, list[Any]] = {}
        self.offsets: dict[OrderingDomain, list[int]] = {}
        self.boundaries: list[ProgressBoundary] = []
        self.rejected: list[RejectedRecord] = []

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        assert record_count(rows) == len(identities)
        offsets = [int(position) for position in identities.positions]
        seen = self.offsets.setdefault(domain, [])
        assert not seen or offsets[0] > seen[-1], "rows went back"
        assert offsets == sorted(set(offsets)), "rows out of order"
        seen.extend(offsets)
        batch = rows if isinstance(rows, pa.RecordBatch) else pa.RecordBatch.from_pylist(list(rows))
        self.rows.setdefault(domain, []).extend(batch.to_pylist())

    async def control(self, control: Control) -> None:
        assert isinstance(control, ProgressBoundary)
        seen = self.offsets.get(control.domain, [])
        assert not seen or int(control.position) >= seen[-1], "boundary before its rows"
        self.boundaries.append(control)

    async def reject(self, record: RejectedRecord) -> None:
        self.rejected.append(record)

    def all_rows(self) -> list[Any]:
        return [row for rows in self.rows.values() for row in rows]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def topic(kafka_bootstrap: str, unique_name: Callable[..., str]) -> Iterator[str]:
    name = unique_name("topic")
    create_topic(kafka_bootstrap, name, 4)
    yield name


def config(bootstrap: str, topic: str, group: str, **extra: Any) -> KafkaSourceConfig:
    return KafkaSourceConfig(bootstrap_servers=bootstrap, topics=(topic,), group_id=group, **extra)


async def allow() -> None:
    """An authority that confirms ownership."""


async def open_session(
    cfg: KafkaSourceConfig, resume: Sequence[Position] = (), membership: Membership = ALL
) -> KafkaStreamSession:
    return await KafkaStreamSource(cfg).open(list(cfg.topics), resume, membership, WORKER)


async def read_closed(
    cfg: KafkaSourceConfig,
    resume: Sequence[Position] = (),
    membership: Membership = ALL,
    limits: ReadLimits = LIMITS,
) -> tuple[Collector, Coverage]:
    """Open a session, read once and close it (sessions close before a topic is deleted)."""
    session = await open_session(cfg, resume, membership)
    try:
        return await read_once(session, limits)
    finally:
        await session.close()


async def read_once(session: KafkaStreamSession, limits: ReadLimits = LIMITS) -> tuple[Collector, Coverage]:
    sink = Collector()
    coverage = await session.read(sink, limits, CancelToken())
    return sink, coverage


def test_registered_with_both_roles() -> None:
    spec = get_connector("kafka")
    cfg = {"bootstrap_servers": "127.0.0.1:1", "topics": ["t"], "group_id": "g"}
    stream = spec.stream_source(cfg)
    bounded = spec.source(cfg)
    assert stream.capabilities().continuous and not stream.capabilities().bounded
    assert stream.capabilities().deterministic and stream.capabilities().event_identity
    assert bounded.capabilities().bounded and not bounded.capabilities().deterministic
    assert [codec.name for codec in stream.codecs()] == ["kafka.offset"]


def test_consumers_fetch_again_soon_after_a_full_prefetch_queue_unless_the_user_says_otherwise() -> None:
    # librdkafka's default (1,000 ms) made a fast reader wait out most of each second (bench/README).
    cfg = {"bootstrap_servers": "127.0.0.1:1", "topics": ["t"], "group_id": "g"}
    default = faucet_kafka.client.consumer_settings(KafkaSourceConfig(**cfg), print)
    assert default["fetch.queue.backoff.ms"] == 10
    chosen = KafkaSourceConfig(**cfg, client_properties={"fetch.queue.backoff.ms": "500"})
    assert faucet_kafka.client.consumer_settings(chosen, print)["fetch.queue.backoff.ms"] == "500"


def test_read_and_acknowledge_over_four_partitions(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    group = unique_name("group")
    cfg = config(kafka_bootstrap, topic, group)
    produce_json(kafka_bootstrap, topic, 0, 200)

    async def scenario() -> None:
        session = await open_session(cfg)
        try:
            sink, coverage = await read_once(session)
            assert sorted(row["id"] for row in sink.all_rows()) == list(range(200))
            assert len(coverage.domains) == 4
            for item in coverage.domains:
                assert item.start is None
                assert item.end == "49"  # 50 records per partition, offsets 0..49
                assert item.domain.incarnation.startswith("tansu_cluster:")
            assert {(b.domain, b.position) for b in sink.boundaries} == {
                (item.domain, item.end) for item in coverage.domains
            }
            assert committed(kafka_bootstrap, topic, group) == {p: -1001 for p in range(4)}, "read never acks"
            await session.acknowledge(coverage, allow)
            assert committed(kafka_bootstrap, topic, group) == {p: 50 for p in range(4)}

            produce_json(kafka_bootstrap, topic, 200, 40)
            sink, second = await read_once(session)
            assert sorted(row["id"] for row in sink.all_rows()) == list(range(200, 240))
            assert {item.start for item in second.domains} == {"49"}
            assert {item.end for item in second.domains} == {"59"}
            await session.acknowledge(second, allow)
            await session.acknowledge(second, allow)  # idempotent
            assert committed(kafka_bootstrap, topic, group) == {p: 60 for p in range(4)}
        finally:
            await session.close()

        # A new session resumes after the certified positions: nothing is read twice.
        produce_json(kafka_bootstrap, topic, 240, 8)
        sink, third = await read_closed(cfg, second.end_positions())
        assert sorted(row["id"] for row in sink.all_rows()) == list(range(240, 248))
        assert {item.start for item in third.domains} == {"59"}

    run(scenario())


def test_membership_splits_partitions_between_workers(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"))
    produce_json(kafka_bootstrap, topic, 0, 40)

    async def scenario() -> None:
        seen: list[set[str]] = []
        ids: list[int] = []
        for member in range(2):
            sink, coverage = await read_closed(cfg, membership=Membership(member, 2))
            seen.append({item.domain.partition for item in coverage.domains})
            ids.extend(row["id"] for row in sink.all_rows())
        assert not seen[0] & seen[1]
        assert seen[0] | seen[1] == {"0", "1", "2", "3"}
        assert sorted(ids) == list(range(40))

    run(scenario())


def test_recreated_topic_raises_incarnation_changed_and_reads_nothing(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"))
    produce_json(kafka_bootstrap, topic, 0, 20)

    _, coverage = run(read_closed(cfg))  # closed before the topic is deleted (DESIGN.md section 8)
    delete_topic(kafka_bootstrap, topic)
    create_topic(kafka_bootstrap, topic, 4)
    produce_json(kafka_bootstrap, topic, 100, 20)
    with pytest.raises(IncarnationChanged) as raised:
        run(open_session(cfg, coverage.end_positions()))
    assert f"topic {topic} partition" in str(raised.value)


def test_resume_below_the_low_watermark_raises_position_unavailable(
    kafka_bootstrap: str, topic: str, unique_name: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"))
    produce_json(kafka_bootstrap, topic, 0, 40)

    _, coverage = run(read_closed(cfg, limits=ReadLimits(records=8, idle=1.0)))
    # Tansu cannot delete records (DeleteRecords is unimplemented in its memory engine and it has no
    # retention there), so retention is injected at the exact point the source reads the low
    # watermark: the broker now reports the first 30 offsets of every partition as deleted.
    real = faucet_kafka.client.low_watermarks

    def after_retention(*args: Any) -> dict[tuple[str, int], int]:
        return {key: low + 30 for key, low in real(*args).items()}

    monkeypatch.setattr(faucet_kafka.reader, "low_watermarks", after_retention)
    with pytest.raises(PositionUnavailable) as raised:
        run(open_session(cfg, coverage.end_positions()))
    assert "below the low watermark 30" in str(raised.value)
    assert f"topic {topic} partition" in str(raised.value)


def test_resume_beyond_the_end_of_the_log_raises_position_unavailable(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"))
    produce_json(kafka_bootstrap, topic, 0, 40)  # 10 per partition, several per record batch

    async def domains() -> list[OrderingDomain]:
        session = await open_session(cfg)
        try:
            return list(session.domains)
        finally:
            await session.close()

    found = run(domains())
    # Certified offset 9 is the real last record: resuming after it is fine (Tansu's ListOffsets
    # reports less here; the source trusts the fetch response).
    ok = run(open_session(cfg, [Position(domain, "9") for domain in found]))
    run(ok.close())
    truncated = [Position(domain, "9" if domain.partition != "2" else "25") for domain in found]
    with pytest.raises(PositionUnavailable) as raised:
        run(open_session(cfg, truncated))
    assert "beyond the end of the log" in str(raised.value)
    assert f"topic {topic} partition 2" in str(raised.value)


def test_an_old_worker_cannot_commit_after_losing_its_lease(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    group = unique_name("group")
    cfg = config(kafka_bootstrap, topic, group)
    produce_json(kafka_bootstrap, topic, 0, 20)
    lease = {"token": 1}

    def authority_for(worker: WorkerIdentity) -> Any:
        async def authority() -> None:
            if lease["token"] != worker.fencing_token:
                raise OwnershipLost(f"lease is held by token {lease['token']}", where=worker.worker_id)

        return authority

    async def scenario() -> None:
        old = await KafkaStreamSource(cfg).open([topic], (), Membership(), WorkerIdentity("old", 1))
        try:
            _, coverage = await read_once(old)
            lease["token"] = 2  # a second worker took the lease while the old one was busy
            with pytest.raises(OwnershipLost):
                await old.acknowledge(coverage, authority_for(WorkerIdentity("old", 1)))
            assert committed(kafka_bootstrap, topic, group) == {p: -1001 for p in range(4)}
        finally:
            await old.close()
        new = await KafkaStreamSource(cfg).open([topic], (), Membership(), WorkerIdentity("new", 2))
        try:
            _, coverage = await read_once(new)
            await new.acknowledge(coverage, authority_for(WorkerIdentity("new", 2)))
            assert committed(kafka_bootstrap, topic, group) == {p: 5 for p in range(4)}
        finally:
            await new.close()

    run(scenario())


@pytest.mark.parametrize(
    ("payload", "reason"),
    [(b"{not json", "is not JSON"), (b"[1, 2]", "JSON list, not an object"), (b"\xff\xfe", "is not UTF-8")],
)
def test_malformed_payload_halts_naming_topic_partition_offset(
    kafka_bootstrap: str, topic: str, unique_name: Any, payload: bytes, reason: str
) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"))
    values = [json.dumps({"id": i}).encode() for i in range(8)]
    values[6] = payload  # partition 2, offset 1
    produce(kafka_bootstrap, topic, values)

    async def scenario() -> None:
        session = await open_session(cfg)
        try:
            with pytest.raises(DataError) as raised:
                await read_once(session)
            assert raised.value.where == f"topic {topic} partition 2 offset 1"
            assert reason in raised.value.message
        finally:
            await session.close()

    run(scenario())


def test_malformed_payload_goes_to_the_dead_letter_route(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"), on_malformed="dead_letter")
    values = [json.dumps({"id": i}).encode() for i in range(12)]
    values[5] = b"oops"  # partition 1, offset 1
    produce(kafka_bootstrap, topic, values)

    async def scenario() -> None:
        sink, coverage = await read_closed(cfg)
        assert sorted(row["id"] for row in sink.all_rows()) == [i for i in range(12) if i != 5]
        [rejected] = sink.rejected
        assert rejected.payload == b"oops"
        assert rejected.where == f"topic {topic} partition 1 offset 1"
        assert (rejected.identity.domain.partition, rejected.identity.position) == ("1", "1")
        assert {item.end for item in coverage.domains} == {"2"}  # the rejected offset is covered

    run(scenario())


@pytest.mark.parametrize("on_malformed", ["halt", "dead_letter"])
def test_text_whose_key_or_value_is_not_utf8_is_malformed_at_its_offset(
    kafka_bootstrap: str, topic: str, unique_name: Any, on_malformed: str
) -> None:
    """Format ``text``: a key or a value that is not UTF-8 halts naming its offset, or becomes a dead
    letter there; it never lands with replacement characters, and the text around it lands."""
    cfg = config(kafka_bootstrap, topic, unique_name("group"), format="text", on_malformed=on_malformed)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    sent = [(b"k0", b"v0"), (b"\xffk1", b"v1"), (b"k2", b"v\xfe2"), (b"k3", "v3 \u00fcn\u00efcode".encode())]
    for key, value in sent:
        producer.produce(topic, value, key=key, partition=0)
    assert producer.flush(30) == 0

    async def scenario() -> None:
        if on_malformed == "halt":
            session = await open_session(cfg)
            try:
                with pytest.raises(DataError, match="not UTF-8") as raised:
                    await read_once(session)
                assert raised.value.where == f"topic {topic} partition 0 offset 1"
            finally:
                await session.close()
            return
        sink, _ = await read_closed(cfg)
        assert [(row["key"], row["value"]) for row in sink.all_rows()] == [
            ("k0", "v0"),
            ("k3", "v3 \u00fcn\u00efcode"),
        ]
        assert [(r.where, r.payload) for r in sink.rejected] == [
            (f"topic {topic} partition 0 offset 1", b"v1"),
            (f"topic {topic} partition 0 offset 2", b"v\xfe2"),
        ]
        assert all("not UTF-8" in r.reason for r in sink.rejected)

    run(scenario())


def test_transaction_markers_leave_verified_gaps(kafka_bootstrap: str, unique_name: Any) -> None:
    topic = unique_name("topic")
    create_topic(kafka_bootstrap, topic, 1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": unique_name("tx")})
    producer.init_transactions(30)
    for n, outcome in enumerate(("commit", "abort", "commit")):
        producer.begin_transaction()
        for i in range(3):
            producer.produce(topic, json.dumps({"tx": n, "i": i}).encode(), partition=0)
        if outcome == "commit":
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    cfg = config(kafka_bootstrap, topic, unique_name("group"))

    async def scenario() -> None:
        sink, coverage = await read_closed(cfg)
        assert [(row["tx"], row["i"]) for row in sink.all_rows()] == [
            (0, 0),
            (0, 1),
            (0, 2),
            (2, 0),
            (2, 1),
            (2, 2),
        ]
        [domain] = sink.offsets
        offsets = sink.offsets[domain]
        assert offsets != list(range(offsets[0], offsets[0] + len(offsets))), "the markers leave gaps"
        [item] = coverage.domains
        assert int(item.end) > offsets[-1], "the end passes the final commit marker"

    run(scenario())


def test_skipped_record_is_found_by_the_gap_reread(kafka_bootstrap: str, unique_name: Any) -> None:
    """A read whose client passed a record without delivering it must not return coverage over it.

    The client loss is injected at the exact point messages leave the client: one record is dropped.
    """
    topic = unique_name("topic")
    create_topic(kafka_bootstrap, topic, 1)
    produce(kafka_bootstrap, topic, [json.dumps({"id": i}).encode() for i in range(6)], partitions=1)
    cfg = config(kafka_bootstrap, topic, unique_name("group"))

    async def scenario() -> None:
        session = await open_session(cfg)
        reader = session._reader
        real_poll = reader.poll

        async def lossy_poll(max_messages: int, timeout: float) -> list[Any]:
            return [m for m in await real_poll(max_messages, timeout) if m.offset() != 3]

        reader.poll = lossy_poll  # type: ignore[method-assign]
        try:
            with pytest.raises(IntegrityError) as raised:
                await read_once(session)
            assert raised.value.where == f"topic {topic} partition 0 offset 3"
        finally:
            await session.close()

    run(scenario())


def test_cancelled_read_returns_without_coverage(kafka_bootstrap: str, topic: str, unique_name: Any) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"))

    async def scenario() -> None:
        session = await open_session(cfg)
        try:
            cancel = CancelToken()
            sink = Collector()
            task = asyncio.create_task(session.read(sink, ReadLimits(idle=None), cancel))
            await asyncio.sleep(0.3)
            cancel.cancel()
            coverage = await asyncio.wait_for(task, 5)
            assert coverage.empty and not sink.boundaries
        finally:
            await session.close()

    run(scenario())


def test_raw_bytes_format_columns(kafka_bootstrap: str, topic: str, unique_name: Any) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"), format="bytes")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(
        topic, b"\x00\x01", key=b"k", partition=3, headers=[("h", b"v")], timestamp=1_700_000_000_000
    )
    producer.flush(30)

    async def scenario() -> None:
        sink, _ = await read_closed(cfg)
        [row] = sink.all_rows()
        assert row["key"] == b"k" and row["value"] == b"\x00\x01"
        assert row["headers"] == [{"key": "h", "value": b"v"}]
        assert row["timestamp"].timestamp() == 1_700_000_000
        assert (row["topic"], row["partition"], row["offset"]) == (topic, 3, 0)

    run(scenario())


def test_bounded_source_reads_to_the_captured_high_watermark(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"))
    produce_json(kafka_bootstrap, topic, 0, 100)

    async def pages(source: KafkaSource, batch_size: int) -> list[Any]:
        return [page async for page in source.stream_pages({}, batch_size)]

    source = KafkaSource(cfg)
    first = run(pages(source, 30))
    assert all(page.num_rows <= 30 for page in first)
    assert sorted(row["id"] for page in first for row in page.records) == list(range(100))
    bookmark = first[-1].bookmark
    assert sorted((item["partition"], item["offset"]) for item in bookmark["positions"]) == [
        (p, 24) for p in range(4)
    ]

    produce_json(kafka_bootstrap, topic, 100, 20)
    resumed = KafkaSource(cfg)
    resumed.apply_start_bookmark(bookmark)
    second = run(pages(resumed, 0))
    assert len(second) == 1
    assert sorted(row["id"] for row in second[0].records) == list(range(100, 120))

    shards = run(source.enumerate_shards())
    assert shards == [f"{topic}/{p}" for p in range(4)]
    shard = KafkaSource(cfg)
    shard.apply_shard(f"{topic}/1")
    only = run(shard.fetch({}))
    assert sorted(row["id"] for row in only) == [i for i in range(120) if i % 4 == 1]
    names = [dataset.name for dataset in run(source.discover())]
    assert topic in names


def test_bounded_source_refuses_a_bookmark_of_another_incarnation(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    cfg = config(kafka_bootstrap, topic, unique_name("group"))
    source = KafkaSource(cfg)
    source.apply_start_bookmark(
        {"positions": [{"topic": topic, "partition": 0, "incarnation": "x:y", "offset": 3}]}
    )

    async def pages() -> list[Any]:
        return [page async for page in source.stream_pages({}, 10)]

    with pytest.raises(IncarnationChanged):
        run(pages())


MALFORMED_BOOKMARKS = (
    "None",
    "{'positions': 'abc'}",
    "{'positions': [1, 2]}",
    "{'positions': [{'topic': 't', 'partition': 0, 'incarnation': 'i'}]}",
    "{'positions': [{'topic': 't', 'partition': 'x', 'incarnation': 'i', 'offset': 1}]}",
    "[]",
)


def test_bounded_source_refuses_a_malformed_bookmark_even_under_python_O() -> None:
    """A bookmark is runtime input: checked with if, not assert, so ``python -O`` (which drops every
    assert) refuses the same bookmarks with the same ConfigError."""
    script = (
        "from faucet_kafka import KafkaSourceConfig\n"
        "from faucet_kafka.bounded import KafkaSource\n"
        "from faucet_dagster.protocol import ConfigError\n"
        "source = KafkaSource(KafkaSourceConfig(bootstrap_servers='k:9092', topics=('t',), group_id='g'))\n"
        f"for raw in ({', '.join(MALFORMED_BOOKMARKS)},):\n"
        "    try:\n"
        "        source.apply_start_bookmark(raw)\n"
        "    except ConfigError:\n"
        "        continue\n"
        "    raise SystemExit(f'accepted {raw!r}')\n"
    )
    for flags in ((), ("-O",)):
        done = subprocess.run(
            [sys.executable, *flags, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (flags, done.stdout, done.stderr)


def test_declared_columns_parse_batches_and_name_values_that_do_not_fit(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    columns = {"id": "int64", "name": "string"}
    values = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(40)]
    values[9] = b'{"id": "nine", "name": "n9"}'  # partition 1, offset 2: an object of the wrong type
    produce(kafka_bootstrap, topic, values)
    with pytest.raises(ValueError, match="format json"):
        config(kafka_bootstrap, topic, "g", format="text", columns=columns)
    cfg = config(kafka_bootstrap, topic, unique_name("group"), columns=columns, on_malformed="dead_letter")
    assert KafkaStreamSource(cfg).capabilities().columns == ("id", "name")

    async def scenario() -> None:
        sink, _ = await read_closed(cfg)
        assert sorted(row["id"] for row in sink.all_rows()) == [i for i in range(40) if i != 9]
        [rejected] = sink.rejected
        assert "does not fit the declared columns" in rejected.reason
        assert rejected.where == f"topic {topic} partition 1 offset 2"
        halting = config(kafka_bootstrap, topic, unique_name("group"), columns=columns)
        session = await open_session(halting)
        try:
            with pytest.raises(DataError) as raised:
                await read_once(session)
            assert raised.value.where == f"topic {topic} partition 1 offset 2"
        finally:
            await session.close()

    run(scenario())


def test_consumes_ahead_only_what_the_read_delivers(
    kafka_bootstrap: str, topic: str, unique_name: Any
) -> None:
    """Small consume batches, each overlapping the next: a records limit still ends the read exactly,
    and the next read goes on from there without a gap or a repeat."""
    produce(kafka_bootstrap, topic, [json.dumps({"id": i}).encode() for i in range(60)])
    cfg = config(kafka_bootstrap, topic, unique_name("group"), batch_size=4)

    async def scenario() -> None:
        session = await open_session(cfg)
        try:
            first, _ = await read_once(session, ReadLimits(records=23, idle=1.0))
            second, _ = await read_once(session, ReadLimits(idle=1.0))
        finally:
            await session.close()
        ids = [row["id"] for row in first.all_rows()]
        assert len(ids) == 23
        assert sorted(ids + [row["id"] for row in second.all_rows()]) == list(range(60))

    run(scenario())


@pytest.mark.parametrize("policy", ["dead_letter", "halt"])
@pytest.mark.parametrize("case", ["edges", "middle", "clean"])
def test_one_arrow_parse_per_consume_batch_decodes_as_each_partition_alone(policy: str, case: str) -> None:
    """With declared columns a consume batch's partitions are parsed in one Arrow call and cut back
    at their boundaries: every row, malformed run, reason and halt error is the one each partition's
    batch decoded alone gives, also with bad values at a partition's first and last offsets."""
    from confluent_kafka import Message
    from faucet_kafka.deliver import Deliverer
    from faucet_kafka.reader import PartitionState

    cfg = config("127.0.0.1:1", "t", "g", columns={"id": "int64", "name": "string"}, on_malformed=policy)
    # edges: first and last offsets of partitions, a tombstone, a value holding a newline (parsed
    # alone); middle: runs of good values across partition boundaries; clean: one run over all.
    bad: dict[int, bytes | None] = {}
    if case == "edges":
        bad = {0: b"[1]", 7: b'{"id": "x"}', 8: None, 13: b"nope", 14: b'{"id": 3,\n"name": "a"}'}
    elif case == "middle":
        bad = {3: b"[1]", 10: b'{"id": "x"}'}
    batches: list[tuple[PartitionState, list[Message]]] = []
    index = 0
    for partition, size in ((0, 8), (1, 5), (2, 1), (3, 6)):
        domain = OrderingDomain("kafka", "t", str(partition), "c:t", "kafka.offset")
        state = PartitionState("t", partition, domain, 0, None)
        messages = []
        for offset in range(size):
            value = bad.get(index, json.dumps({"id": index, "name": f"n{index}"}).encode())
            messages.append(Message(topic="t", partition=partition, offset=offset, value=value))
            index += 1
        batches.append((state, messages))
    deliverer = Deliverer(cfg)

    def outcome(decode: Callable[[], Any]) -> Any:
        try:
            decoded = decode()
        except DataError as exc:
            return ("halt", str(exc), exc.where)
        # Per partition, each offset's row or reason (halving may cut rows into other runs).
        outcomes = []
        for runs in decoded:
            mine: list[Any] = []
            for r in runs:
                mine.extend([r.reason] if r.rows is None else r.rows.to_pylist())
                assert len(mine) == r.stop
            outcomes.append(mine)
        return outcomes

    joined = outcome(lambda: run(deliverer.decode_all(batches)))
    alone = outcome(lambda: [deliverer.decode(state, messages) for state, messages in batches])
    assert joined == alone
    malformed = {"edges": [2, 1, 1, 0], "middle": [1, 1, 0, 0], "clean": [0, 0, 0, 0]}[case]
    if policy == "halt" and case != "clean":
        assert joined[2] == f"topic t partition 0 offset {3 if case == 'middle' else 0}"
    else:
        assert [sum(isinstance(item, str) for item in runs) for runs in joined] == malformed
