"""The NATS JetStream source against the real NATS server (JetStream) of the test session.

The provider's own view (consumer info: acknowledgement floor, pending and redelivered counts) is
checked wherever the source claims something about acknowledgements or redelivery.
"""

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import nats
import pyarrow as pa
import pytest
from faucet_nats.bounded import NatsSource
from faucet_nats.chunks import REPLY, Chunk
from faucet_nats.config import RAW_SCHEMA, NatsSourceConfig
from faucet_nats.consumer import PushConsumer
from faucet_nats.jetstream import JetStreamApi, connect
from faucet_nats.source import NatsStreamSession, NatsStreamSource

from faucet_dagster.protocol import (
    CancelToken,
    ConfigError,
    Control,
    Coverage,
    DataError,
    DomainCoverage,
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
COLUMNS = {"id": "int64 not null", "name": "string"}
FAST = ReadLimits(records=None, bytes=None, idle=0.3, age=None)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def payload(i: int) -> bytes:
    return json.dumps({"id": i, "name": f"n{i}"}).encode()


async def api_call(url: str, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    client = await nats.connect(url)
    try:
        reply = await client.request(f"$JS.API.{subject}", json.dumps(body or {}).encode(), timeout=5)
        answer: dict[str, Any] = json.loads(reply.data)
        assert "error" not in answer, answer
        return answer
    finally:
        await client.close()


async def create_stream(url: str, name: str) -> None:
    await api_call(url, f"STREAM.CREATE.{name}", {"name": name, "subjects": [f"{name}.>"]})


async def publish(url: str, subject: str, payloads: Sequence[bytes]) -> None:
    client = await nats.connect(url)
    try:
        jsm = client.jetstream()
        await asyncio.gather(*(jsm.publish(subject, data) for data in payloads))
    finally:
        await client.close()


async def consumer_info(url: str, stream: str, name: str) -> dict[str, Any]:
    return await api_call(url, f"CONSUMER.INFO.{stream}.{name}")


class Recorder(StreamRecordSink):
    """A pipeline stand-in that records what a read hands over; ``stall`` seconds on the first write."""

    def __init__(self, stall: float = 0.0) -> None:
        self.stall = stall
        self.parts: list[Records] = []
        self.positions: list[str] = []
        self.controls: list[Control] = []
        self.rejected: list[RejectedRecord] = []
        self.writing = asyncio.Event()

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        assert record_count(rows) == len(identities)
        self.writing.set()
        if self.stall:
            stall, self.stall = self.stall, 0.0
            await asyncio.sleep(stall)
        self.parts.append(rows)
        self.positions.extend(identities.positions)

    async def control(self, control: Control) -> None:
        self.controls.append(control)

    async def reject(self, record: RejectedRecord) -> None:
        self.rejected.append(record)
        self.positions.append(record.identity.position)

    def ids(self) -> list[int]:
        found: list[int] = []
        for part in self.parts:
            found.extend(
                part.column("id").to_pylist() if isinstance(part, pa.RecordBatch) else [r["id"] for r in part]
            )
        return found


class Authority:
    def __init__(self, lost: bool = False) -> None:
        self.lost = lost
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.lost:
            raise OwnershipLost("another worker holds the lease", where="test")


@pytest.fixture
def stream(nats_url: str, unique_name: Callable[..., str]) -> str:
    name = unique_name("s")
    run(create_stream(nats_url, name))
    return name


def config(url: str, stream: str, **settings: Any) -> NatsSourceConfig:
    return NatsSourceConfig(servers=(url,), stream=stream, **{"columns": COLUMNS, **settings})


async def open_session(
    cfg: NatsSourceConfig, positions: Sequence[Position] = (), membership: Membership | None = None
) -> NatsStreamSession:
    return await NatsStreamSource(cfg).open([cfg.stream], positions, membership or Membership(), WORKER)


def test_registered_and_capabilities_are_read_offline() -> None:
    spec = get_connector("nats")
    built = spec.stream_source({"stream": "orders", "columns": COLUMNS})
    capabilities = built.capabilities()
    assert capabilities.continuous and capabilities.deterministic and capabilities.event_identity
    assert capabilities.columns == ("id", "name")
    assert [codec.name for codec in built.codecs()] == ["nats.stream_sequence"]
    with pytest.raises(ConfigError):
        spec.stream_source({"stream": "a.b"})
    with pytest.raises(ConfigError):
        spec.stream_source({"stream": "orders", "format": "bytes", "columns": COLUMNS})
    with pytest.raises(ConfigError, match="not an Arrow type name"):
        spec.stream_source({"stream": "orders", "columns": {"id": "int64", "at": "timestamp[us, tz=UTC"}})
    zoned = NatsSourceConfig(
        stream="orders", columns={"at": "timestamp[us, tz=UTC] not null", "n": "decimal128(9, 2)"}
    )
    assert zoned.declared_schema() == pa.schema(
        [pa.field("at", pa.timestamp("us", tz="UTC"), nullable=False), ("n", pa.decimal128(9, 2))]
    )


def test_read_and_acknowledge_round_trip(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 1001)])
        cfg = config(nats_url, stream)
        session = await open_session(cfg)
        authority = Authority()
        try:
            sink = Recorder()
            first = await session.read(sink, ReadLimits(records=600, idle=1.0), CancelToken())
            (covered,) = first.domains
            assert (covered.start, covered.end) == (None, "600")
            assert covered.domain.partition == "" and covered.domain.codec == "nats.stream_sequence"
            assert sink.ids() == list(range(1, 601))
            assert sink.positions == [str(i) for i in range(1, 601)]
            assert sink.controls == [ProgressBoundary(covered.domain, "600")]
            batch = sink.parts[0]
            assert isinstance(batch, pa.RecordBatch)
            assert batch.schema == pa.schema([pa.field("id", pa.int64(), False), ("name", pa.string())])
            await session.acknowledge(first, authority)
            assert authority.calls == 1
            info = await consumer_info(nats_url, stream, cfg.consumer_name)
            assert info["ack_floor"]["stream_seq"] == 600
            # Acknowledging the same coverage again changes nothing at the provider.
            await session.acknowledge(first, authority)
            assert authority.calls == 1
            second = await session.read(sink, FAST, CancelToken())
            assert [(d.start, d.end) for d in second.domains] == [("600", "1000")]
            await session.acknowledge(second, authority)
            nothing = await session.read(sink, FAST, CancelToken())
            assert nothing.empty
            info = await consumer_info(nats_url, stream, cfg.consumer_name)
            assert info["ack_floor"]["stream_seq"] == 1000 and info["num_ack_pending"] == 0
            assert info["num_redelivered"] == 0
        finally:
            await session.close()
        # A new session resumes after the certified position and reads only what is new.
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1001, 1011)])
        resumed = await open_session(cfg, second.end_positions())
        try:
            sink = Recorder()
            third = await resumed.read(sink, FAST, CancelToken())
            assert [(d.start, d.end) for d in third.domains] == [("1000", "1010")]
            assert sink.ids() == list(range(1001, 1011))
            with pytest.raises(IntegrityError):
                await resumed.acknowledge(
                    Coverage((DomainCoverage(third.domains[0].domain, None, "2000"),)), authority
                )
        finally:
            await resumed.close()

    run(scenario())


def test_a_sink_blocking_longer_than_ack_wait_causes_no_redelivery(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 201)])
        cfg = config(nats_url, stream, ack_wait=1.0, idle_heartbeat=0.5, chunk_messages=50)
        session = await open_session(cfg)
        try:
            # The first write stalls 3.5 ack waits; every delivered message must stay alive meanwhile.
            sink = Recorder(stall=3.5)
            coverage = await session.read(sink, ReadLimits(records=200, idle=1.0), CancelToken())
            assert coverage.domains[0].end == "200"
            await asyncio.sleep(1.5)  # the commit is slow too
            await session.acknowledge(coverage, Authority())
            assert sink.ids() == list(range(1, 201))
            assert session.suppressed == 0
            info = await consumer_info(nats_url, stream, cfg.consumer_name)
            assert info["num_redelivered"] == 0
            assert info["delivered"]["consumer_seq"] == 200  # each message delivered exactly once
            assert info["ack_floor"]["stream_seq"] == 200
        finally:
            await session.close()

    run(scenario())


def test_no_acknowledgement_without_authority_and_the_next_session_gets_them(
    nats_url: str, stream: str
) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 51)])
        cfg = config(nats_url, stream)
        session = await open_session(cfg)
        try:
            coverage = await session.read(Recorder(), FAST, CancelToken())
            refused = Authority(lost=True)
            with pytest.raises(OwnershipLost):
                await session.acknowledge(coverage, refused)
            assert refused.calls == 1
            info = await consumer_info(nats_url, stream, cfg.consumer_name)
            assert info["ack_floor"]["stream_seq"] == 0 and info["num_ack_pending"] == 50
        finally:
            await session.close()
        # Nothing was certified: the next session reads the same messages again.
        successor = await open_session(cfg)
        try:
            sink = Recorder()
            again = await successor.read(sink, FAST, CancelToken())
            assert [(d.start, d.end) for d in again.domains] == [(None, "50")]
            assert sink.ids() == list(range(1, 51))
        finally:
            await successor.close()

    run(scenario())


def test_a_session_whose_consumer_was_taken_over_stops(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 11)])
        cfg = config(nats_url, stream, idle_heartbeat=0.3)
        old = await open_session(cfg)
        new = None
        try:
            await old.read(Recorder(), FAST, CancelToken())
            # Another worker opens the stream: the consumer is recreated at its certified position.
            new = await open_session(cfg)
            with pytest.raises(OwnershipLost, match="another session"):
                await old.read(Recorder(), ReadLimits(records=None, idle=5.0), CancelToken())
            sink = Recorder()
            await new.read(sink, FAST, CancelToken())
            assert sink.ids() == list(range(1, 11))
        finally:
            await old.close()
            if new is not None:
                await new.close()

    run(scenario())


def test_a_purged_resume_position_is_unavailable(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 101)])
        cfg = config(nats_url, stream)
        session = await open_session(cfg)
        domain = session.domain
        await session.close()
        await api_call(nats_url, f"STREAM.PURGE.{stream}", {"seq": 51})  # removes 1 to 50
        with pytest.raises(PositionUnavailable, match="11 to 50"):
            await open_session(cfg, [Position(domain, "10")])
        with pytest.raises(PositionUnavailable, match="past the stream's last sequence"):
            await open_session(cfg, [Position(domain, "500")])
        # Exactly at the purge boundary nothing is missing.
        resumed = await open_session(cfg, [Position(domain, "50")])
        try:
            sink = Recorder()
            coverage = await resumed.read(sink, FAST, CancelToken())
            assert [(d.start, d.end) for d in coverage.domains] == [("50", "100")]
            assert sink.ids() == list(range(51, 101))
        finally:
            await resumed.close()

    run(scenario())


def test_a_recreated_stream_is_another_incarnation(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 11)])
        cfg = config(nats_url, stream, idle_heartbeat=0.5)
        session = await open_session(cfg)
        try:
            coverage = await session.read(Recorder(), FAST, CancelToken())
            await session.acknowledge(coverage, Authority())
            # Deleted and recreated under the session: its next read fails, it does not read on.
            await api_call(nats_url, f"STREAM.DELETE.{stream}")
            await create_stream(nats_url, stream)
            await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 21)])
            sink = Recorder()
            with pytest.raises(IncarnationChanged):
                await session.read(sink, ReadLimits(records=None, idle=5.0), CancelToken())
            assert sink.parts == []
        finally:
            await session.close()
        with pytest.raises(IncarnationChanged):
            await open_session(cfg, coverage.end_positions())
        await api_call(nats_url, f"STREAM.DELETE.{stream}")
        with pytest.raises(IncarnationChanged):
            await open_session(cfg, coverage.end_positions())
        with pytest.raises(ConfigError, match="does not exist"):
            await open_session(cfg)

    run(scenario())


def test_cancellation_covers_nothing_past_the_last_boundary(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 101)])
        cfg = config(nats_url, stream, chunk_messages=10)
        session = await open_session(cfg)
        try:
            first = await session.read(Recorder(), ReadLimits(records=30, idle=1.0), CancelToken())
            assert first.domains[0].end == "30"
            # The next read is cancelled while its first write is blocked on the sink.
            cancel = CancelToken()
            stalled = Recorder(stall=60.0)
            reading = asyncio.ensure_future(session.read(stalled, FAST, cancel))
            await stalled.writing.wait()
            cancel.cancel()
            cancelled = await asyncio.wait_for(reading, 5)
            assert cancelled.empty and stalled.controls == []
            # Nothing was lost: the next read starts right after the last boundary.
            sink = Recorder()
            after = await session.read(sink, FAST, CancelToken())
            assert [(d.start, d.end) for d in after.domains] == [("30", "100")]
            assert sink.ids() == list(range(31, 101))
            info = await consumer_info(nats_url, stream, cfg.consumer_name)
            assert info["ack_floor"]["stream_seq"] == 0
        finally:
            await session.close()

    run(scenario())


def test_absent_sequences_are_proven_filtered(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 11)])
        await publish(nats_url, f"{stream}.b", [payload(i) for i in range(11, 21)])
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(21, 31)])
        filtered = await open_session(config(nats_url, stream, subject=f"{stream}.a", durable="only_a"))
        try:
            sink = Recorder()
            coverage = await filtered.read(sink, FAST, CancelToken())
            assert coverage.domains[0].domain.partition == f"{stream}.a"
            assert coverage.domains[0].end == "30"
            assert sink.ids() == [*range(1, 11), *range(21, 31)]
        finally:
            await filtered.close()

    run(scenario())


def test_deleted_sequences_are_never_proven_absent(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 11)])
        await publish(nats_url, f"{stream}.b", [payload(i) for i in range(11, 21)])
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(21, 31)])
        for seq in (4, 5, 15):
            await api_call(nats_url, f"STREAM.MSG.DELETE.{stream}", {"seq": seq})
        # A deleted message's subject is unknown: with or without a filter, nothing past it is read.
        for settings in ({}, {"subject": f"{stream}.a", "durable": "only_a"}):
            session = await open_session(config(nats_url, stream, **settings))
            try:
                sink = Recorder()
                with pytest.raises(
                    PositionUnavailable,
                    match=f"stream {stream}: 2 of the undelivered sequences 4 to 5 were removed",
                ):
                    await session.read(sink, FAST, CancelToken())
                assert set(sink.ids()) <= {1, 2, 3}
            finally:
                await session.close()
        # Past the deletions, the filtered proof covers sequence 15 too: it is in a gap of .a.
        cfg = config(nats_url, stream, subject=f"{stream}.a", durable="only_a")
        probe = await open_session(cfg)
        domain = probe.domain
        await probe.close()
        session = await open_session(cfg, [Position(domain, "10")])
        try:
            with pytest.raises(
                PositionUnavailable, match="1 of the undelivered sequences 11 to 20 was removed"
            ):
                await session.read(Recorder(), FAST, CancelToken())
        finally:
            await session.close()

    run(scenario())


async def wait_held(url: str, stream: str, name: str, count: int) -> None:
    """Wait (generously) until the consumer ``name`` has ``count`` deliveries unacknowledged."""
    for _ in range(600):
        if (await consumer_info(url, stream, name))["num_ack_pending"] >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the consumer never held {count} deliveries")


async def wait_stream(url: str, stream: str, done: Callable[[dict[str, Any]], bool]) -> None:
    for _ in range(1200):
        if done((await api_call(url, f"STREAM.INFO.{stream}"))["state"]):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the stream never reached the expected state")


async def lagging_session(
    url: str, stream: str, count: int, **settings: Any
) -> tuple[NatsStreamSession, NatsSourceConfig]:
    """``count`` messages published, a session whose consumer holds the first five, read nothing yet."""
    await publish(url, f"{stream}.a", [payload(i) for i in range(1, count + 1)])
    cfg = config(url, stream, max_ack_pending=5, **settings)
    session = await open_session(cfg)
    await wait_held(url, stream, cfg.consumer_name, 5)
    return session, cfg


@pytest.mark.parametrize("subject", [None, "a"])
def test_a_purge_while_the_consumer_lags_is_loss(nats_url: str, stream: str, subject: str | None) -> None:
    async def scenario() -> None:
        settings = {} if subject is None else {"subject": f"{stream}.{subject}"}
        session, _ = await lagging_session(nats_url, stream, 30, **settings)
        try:
            # 6 to 20 were never delivered; the purge removes them (and the held 1 to 5).
            await api_call(nats_url, f"STREAM.PURGE.{stream}", {"seq": 21})
            sink = Recorder()
            covered: list[Coverage] = []
            with pytest.raises(
                PositionUnavailable,
                match=f"stream {stream}: 15 of the undelivered sequences 6 to 20 were removed",
            ):
                for _ in range(20):  # bounded: a read that never fails is the defect
                    coverage = await session.read(sink, FAST, CancelToken())
                    covered.append(coverage)
                    await session.acknowledge(coverage, Authority())
            # Nothing past the gap was handed on, let alone covered.
            assert set(sink.ids()) <= {1, 2, 3, 4, 5}
            assert all(int(d.end) <= 5 for c in covered for d in c.domains)
        finally:
            await session.close()

    run(scenario())


def test_other_subjects_removed_after_an_idle_consumer_passed_them_are_no_loss(
    nats_url: str, stream: str
) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(1)])
        await publish(nats_url, f"{stream}.b", [payload(i) for i in range(2, 22)])
        session = await open_session(config(nats_url, stream, subject=f"{stream}.a", idle_heartbeat=0.2))
        try:
            first = await session.read(Recorder(), FAST, CancelToken())
            assert first.domains[0].end == "1"
            await session.acknowledge(first, Authority())
            # The other subject's messages, seen while the consumer was idle, are removed later.
            await api_call(nats_url, f"STREAM.PURGE.{stream}", {"filter": f"{stream}.b"})
            await publish(nats_url, f"{stream}.a", [payload(22)])
            sink = Recorder()
            coverage = await session.read(sink, FAST, CancelToken())
            assert coverage.domains[0].end == "22" and sink.ids() == [22]
        finally:
            await session.close()

    run(scenario())


def test_max_msgs_retention_while_the_consumer_lags_is_loss(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        session, _ = await lagging_session(nats_url, stream, 5)
        try:
            await api_call(
                nats_url,
                f"STREAM.UPDATE.{stream}",
                {"name": stream, "subjects": [f"{stream}.>"], "max_msgs": 10},
            )
            await publish(nats_url, f"{stream}.a", [payload(i) for i in range(6, 31)])
            await wait_stream(nats_url, stream, lambda state: state["first_seq"] == 21)
            sink = Recorder()
            # Which of 6 to 20 the retention removed before the server could deliver them (it sends
            # more as soon as it drops one of the held 1 to 5) depends on timing; that some were is certain.
            with pytest.raises(
                PositionUnavailable, match=r"undelivered sequences? \d+( to \d+)? (was|were) removed"
            ):
                await session.read(sink, FAST, CancelToken())
            assert max(sink.ids(), default=0) <= 20  # nothing past the gap
        finally:
            await session.close()

    run(scenario())


def test_max_age_expiry_while_the_consumer_lags_is_loss(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        session, _ = await lagging_session(nats_url, stream, 30)
        try:
            await api_call(
                nats_url,
                f"STREAM.UPDATE.{stream}",
                {"name": stream, "subjects": [f"{stream}.>"], "max_age": 500_000_000},
            )
            await wait_stream(nats_url, stream, lambda state: state["messages"] == 0)
            # Expiry off again, so the messages after the gap stay until the session reaches them
            # however slow the machine: the loss under test is 6 to 30, nothing later.
            unlimited = {"name": stream, "subjects": [f"{stream}.>"], "max_age": 0}
            await api_call(nats_url, f"STREAM.UPDATE.{stream}", unlimited)
            await publish(nats_url, f"{stream}.a", [payload(i) for i in range(31, 36)])
            sink = Recorder()
            with pytest.raises(
                PositionUnavailable, match=r"undelivered sequences? \d+( to \d+)? (was|were) removed"
            ):
                for _ in range(20):  # bounded: a read that never fails is the defect
                    coverage = await session.read(sink, FAST, CancelToken())
                    await session.acknowledge(coverage, Authority())
            assert max(sink.ids(), default=0) <= 30  # nothing past the gap
        finally:
            await session.close()

    run(scenario())


def test_a_bounded_read_whose_end_was_purged_is_loss(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 31)])
        cfg = config(nats_url, stream)
        session = await NatsStreamSession.open(
            cfg, (), owned=True, worker=None, durable=False, bounded=True, max_ack_pending=5
        )
        try:
            await api_call(nats_url, f"STREAM.PURGE.{stream}")
            sink = Recorder()
            with pytest.raises(PositionUnavailable, match="sequences 6 to 30"):
                for _ in range(20):  # bounded: a read that never fails is the defect
                    coverage = await session.read(sink, FAST, CancelToken())
                    assert not session.finished
                    await session.acknowledge(coverage, Authority())
            assert set(sink.ids()) <= {1, 2, 3, 4, 5}
        finally:
            await session.close()

    run(scenario())


def test_a_gap_holding_a_matching_message_fails_the_proof(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 11)])
        cfg = config(nats_url, stream)
        client = await connect(cfg, where="test")
        try:
            api = JetStreamApi(client, cfg)
            consumer = PushConsumer(
                client,
                api,
                cfg,
                await api.stream(stream),
                start_after=0,
                durable=False,
                worker=None,
                where="test",
            )
            seqs = pa.array([1, 6], pa.int64())
            # As if sequences 2 to 5 had not been delivered: they are stored and match, so not proven.
            with pytest.raises(IntegrityError, match="sequence 2 matches"):
                await consumer.prove(Chunk([], seqs, ["1", "6"], None, 0.0, [(1, 6)]))
            await api_call(nats_url, f"STREAM.PURGE.{stream}", {"seq": 6})
            chunk = Chunk([], pa.array([6], pa.int64()), ["6"], None, 0.0, [(0, 6)])
            with pytest.raises(PositionUnavailable, match="sequences 1 to 5"):
                await consumer.prove(chunk)  # purged: held messages once, so never proven absent
        finally:
            await client.close()

    run(scenario())


def test_a_delivery_lost_in_transit_fails_the_read(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 21)])
        session = await open_session(config(nats_url, stream))
        try:
            consumer = session._consumer
            assert consumer is not None
            while len(consumer._incoming) < 20:
                await consumer.wait(1.0)
            del consumer._incoming[7]  # as if the client had dropped one delivery
            sink = Recorder()
            with pytest.raises(IntegrityError, match="lost in transit") as caught:
                await session.read(sink, FAST, CancelToken())
            assert caught.value.retryable
            assert sink.parts == [] and sink.controls == []
        finally:
            await session.close()

    run(scenario())


def test_malformed_payloads_halt_or_go_to_the_dead_letter_route(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        bad = [b"not json", b'{"id": "seven"}', b"[1, 2]", b'{"id": 9, "extra": true}']
        await publish(nats_url, f"{stream}.a", [payload(1), payload(2)])
        await publish(nats_url, f"{stream}.a", [bad[0]])
        await publish(nats_url, f"{stream}.a", [payload(4), bad[1], bad[2], bad[3], payload(8)])
        halting = await open_session(config(nats_url, stream))
        try:
            sink = Recorder()
            with pytest.raises(DataError, match="not JSON") as caught:
                await halting.read(sink, FAST, CancelToken())
            assert caught.value.where == f"nats stream {stream} sequence 3"
            assert sink.controls == []
        finally:
            await halting.close()
        routing = await open_session(config(nats_url, stream, on_malformed="dead_letter"))
        try:
            sink = Recorder()
            coverage = await routing.read(sink, FAST, CancelToken())
            assert coverage.domains[0].end == "8"
            assert sink.ids() == [1, 2, 4, 8]
            assert [r.identity.position for r in sink.rejected] == ["3", "5", "6", "7"]
            assert [r.payload for r in sink.rejected] == bad
            assert "does not fit the declared columns" in sink.rejected[1].reason
            assert "not an object" in sink.rejected[2].reason
            assert sink.positions == [str(i) for i in range(1, 9)]  # in stream order
        finally:
            await routing.close()
        schemaless = await open_session(config(nats_url, stream, columns=None, durable="schemaless"))
        try:
            sink = Recorder()
            with pytest.raises(DataError, match="not JSON"):
                await schemaless.read(sink, FAST, CancelToken())
            assert sink.parts == [[{"id": 1, "name": "n1"}, {"id": 2, "name": "n2"}]]
        finally:
            await schemaless.close()

    run(scenario())


def test_bytes_format_carries_the_message(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().publish(f"{stream}.x", b"\x00\x01", headers={"h": "v"})
        finally:
            await client.close()
        session = await open_session(config(nats_url, stream, format="bytes", columns=None))
        try:
            sink = Recorder()
            await session.read(sink, FAST, CancelToken())
            (batch,) = sink.parts
            assert isinstance(batch, pa.RecordBatch) and batch.schema == RAW_SCHEMA
            row = batch.to_pylist()[0]
            assert (row["subject"], row["data"], row["stream"], row["sequence"]) == (
                f"{stream}.x",
                b"\x00\x01",
                stream,
                1,
            )
            assert row["headers"] == [{"key": "h", "value": "v"}] and row["timestamp"] is not None
        finally:
            await session.close()

    run(scenario())


def test_a_worker_not_owning_the_domain_reads_nothing(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(1)])
        cfg = config(nats_url, stream)
        owner = next(member for member in range(2) if Membership(member, 2).owns(stream, ""))
        idle = await open_session(cfg, membership=Membership(1 - owner, 2))
        try:
            assert (await idle.read(Recorder(), FAST, CancelToken())).empty
            await idle.acknowledge(Coverage(), Authority())
        finally:
            await idle.close()
        with pytest.raises(ConfigError):
            await NatsStreamSource(cfg).open(["other"], (), Membership(), WORKER)

    run(scenario())


def test_bounded_source_reads_to_the_last_sequence_at_the_start(nats_url: str, stream: str) -> None:
    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(i) for i in range(1, 701)])
        cfg = config(nats_url, stream)
        source = NatsSource(cfg)
        pages = []
        async for page in source.stream_pages({}, 300):
            pages.append(page)
            if len(pages) == 1:
                # Published after the start: not part of this bounded read.
                await publish(nats_url, f"{stream}.a", [payload(i) for i in range(701, 721)])
        assert [page.num_rows for page in pages] == [300, 300, 100]
        assert [page.bookmark["sequence"] for page in pages if isinstance(page.bookmark, dict)] == [
            300,
            600,
            700,
        ]
        # Resuming from the second page's bookmark reads the rest, up to the new last sequence.
        resumed = NatsSource(cfg)
        resumed.apply_start_bookmark(pages[1].bookmark)
        records = await resumed.fetch({})
        assert isinstance(records, pa.RecordBatch)
        assert records.column("id").to_pylist() == list(range(601, 721))
        # The continuous source in bounded mode stops the same way.
        session = await open_session(config(nats_url, stream, bounded=True))
        try:
            sink = Recorder()
            coverage = await session.read(sink, ReadLimits(records=None, idle=None), CancelToken())
            assert coverage.domains[0].end == "720" and session.finished
            assert (await session.read(sink, FAST, CancelToken())).empty
        finally:
            await session.close()
        with pytest.raises(ConfigError):
            source.apply_start_bookmark({"sequence": 1})

    run(scenario())


def test_arrivals_parsed_in_a_thread_still_count_as_received(nats_url: str, stream: str) -> None:
    """While an intake parses a large arrival on a worker thread, a heartbeat naming its last delivery
    is no loss; a cancelled intake puts the arrivals back, in order, before what arrived since."""
    import threading

    from faucet_nats.consumer import INLINE_PARSE_MESSAGES
    from nats.aio.msg import Msg

    async def scenario() -> None:
        await publish(nats_url, f"{stream}.a", [payload(1)])
        cfg = config(nats_url, stream)
        client = await connect(cfg, where="test")
        try:
            api = JetStreamApi(client, cfg)
            consumer = PushConsumer(
                client,
                api,
                cfg,
                await api.stream(stream),
                start_after=0,
                durable=False,
                worker=None,
                where="t",
            )
            count = INLINE_PARSE_MESSAGES + 100

            def data(n: int) -> Msg:
                return Msg(client, subject="x", reply=f"$JS.ACK.{stream}.c.1.{n}.{n}.1700000000000000000.0")

            release = threading.Event()
            parse = consumer._parse

            def slow_parse(msgs: list[Any], *, with_stamps: bool) -> Any:
                assert release.wait(60)
                return parse(msgs, with_stamps=with_stamps)

            consumer._parse = slow_parse  # type: ignore[method-assign]
            heartbeat = Msg(
                client, subject="x", reply="", headers={"Status": "100", "Nats-Last-Consumer": str(count)}
            )

            for message in [data(n) for n in range(1, count + 1)]:
                await consumer._on_message(message)
            cancelled = asyncio.create_task(consumer.intake(with_stamps=False))
            while not consumer._parsing:
                await asyncio.sleep(0.01)
            await consumer._on_message(data(count + 1))  # arrives while the others are parsed
            cancelled.cancel()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert [m[REPLY].split(".")[5] for m in consumer._incoming] == [
                str(n) for n in range(1, count + 2)
            ]
            assert consumer.held == count + 1

            release.clear()
            consumer._incoming.pop()
            intake = asyncio.create_task(consumer.intake(with_stamps=False))
            while not consumer._parsing:
                await asyncio.sleep(0.01)
            assert consumer.held == count
            await consumer._on_message(heartbeat)
            assert consumer.failure is None
            release.set()
            await intake
            chunk = consumer.take(count + 1)
            assert chunk is not None and chunk.positions == [str(n) for n in range(1, count + 1)]
        finally:
            await client.close()

    run(scenario())
