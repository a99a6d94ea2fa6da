"""The NATS JetStream sink against the real NATS server (JetStream) of the test session."""

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pyarrow as pa
import pytest
from faucet_nats.publisher import Published
from faucet_nats.sink import NatsSink, NatsSinkSession, NatsStreamingSink
from faucet_nats.sink_config import NatsSinkConfig
from stream_ticks import stored_messages

from faucet_dagster.protocol import (
    ConfigError,
    Coverage,
    DomainCoverage,
    EpochId,
    EpochMismatch,
    Identities,
    LifecycleError,
    OrderingDomain,
    SinkBatch,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
    get_connector,
)
from faucet_dagster.testing import NatsServer

WORKER = WorkerIdentity("worker-a", 1)
DOMAIN = OrderingDomain("kafka", "orders", "0", "cluster:topic-id", "kafka.offset")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def create_stream(url: str, name: str, subject: str, window: float) -> None:
    client = await nats.connect(url)
    try:
        await client.jetstream().add_stream(name=name, subjects=[subject], duplicate_window=window)
    finally:
        await client.close()


def batch(epoch: EpochId, start: int, count: int) -> SinkBatch:
    rows = pa.RecordBatch.from_pylist([{"id": i, "name": f"n{i}"} for i in range(start, start + count)])
    return SinkBatch(epoch, "orders", DOMAIN, rows, Identities([str(i) for i in range(start, start + count)]))


def coverage(start: int | None, end: int) -> Coverage:
    return Coverage((DomainCoverage(DOMAIN, None if start is None else str(start), str(end)),))


@pytest.fixture
def target(nats_url: str, unique_name: Callable[..., str]) -> tuple[str, str]:
    """A fresh stream name and subject (the stream is created by each test with its window)."""
    return unique_name("s"), f"{unique_name('subj')}.out"


def sink_config(url: str, stream: str, subject: str, window: float, **extra: Any) -> NatsSinkConfig:
    return NatsSinkConfig(
        servers=(url,),
        stream=stream,
        subject=subject,
        duplicate_window=window,
        watermark_bucket=f"w_{stream}",
        **extra,
    )


async def open_session(cfg: NatsSinkConfig, stream: str = "orders-stream") -> NatsSinkSession:
    return await NatsStreamingSink(cfg).open(stream, WritePolicy.APPEND, (), WORKER)


def test_registered_and_capabilities_declare_the_window() -> None:
    spec = get_connector("nats")
    sink = spec.streaming_sink({"stream": "S", "subject": "a.b", "duplicate_window": 2})
    caps = sink.capabilities()
    assert caps.continuous_policies == {WritePolicy.APPEND} and not caps.bounded_policies
    assert caps.dedup_by_event_identity and caps.dedup_window is not None
    assert caps.dedup_window.total_seconds() == 2
    assert not caps.atomic_watermark and not caps.owner_fencing
    bounded = spec.sink({"stream": "S", "subject": "a.b"}).capabilities()
    assert bounded.bounded_policies == {WritePolicy.APPEND} and not bounded.dedup_by_event_identity


def test_epoch_publishes_with_identities_and_replays_dedup_within_the_window(
    nats_url: str, target: tuple[str, str]
) -> None:
    name, subject = target
    run(create_stream(nats_url, name, subject, 2.0))
    cfg = sink_config(nats_url, name, subject, 2.0)

    async def scenario() -> None:
        session = await open_session(cfg)
        try:
            assert await session.last_committed() is None
            first = EpochId("orders-stream", 1, 1)
            await session.begin_epoch(first)
            await session.apply(first, batch(first, 0, 60))
            await session.apply(first, batch(first, 60, 40))
            [receipt] = await session.commit_epoch(first, coverage(None, 99))
            assert (receipt.resource, receipt.rows_written, receipt.rows_skipped) == ("orders", 100, 0)
            assert (receipt.details["first_sequence"], receipt.details["last_sequence"]) == ("1", "100")
            messages = await stored_messages(nats_url, name)
            assert [payload["id"] for _, payload, _ in messages] == list(range(100))
            ids = Identities([str(i) for i in range(100)])
            assert [msg_id for _, _, msg_id in messages] == [ids.at(DOMAIN, i).digest() for i in range(100)]
            state = await session.last_committed()
            assert state is not None and state.epoch == first
            assert [(p.domain, p.value) for p in state.watermarks] == [(DOMAIN, "99")]

            # The epoch replayed (a crash after the commit, before the certificate): nothing added.
            replay = EpochId("orders-stream", 1, 2)
            await session.begin_epoch(replay)
            await session.apply(replay, batch(replay, 0, 100))
            [receipt] = await session.commit_epoch(replay, coverage(None, 99))
            assert (receipt.rows_written, receipt.rows_skipped) == (0, 100)
            assert receipt.details["duplicates"] == "100" and "first_sequence" not in receipt.details
            assert len(await stored_messages(nats_url, name)) == 100

            # Outside the window the stream no longer remembers the ids: a replay duplicates.
            await asyncio.sleep(2.5)
            late = EpochId("orders-stream", 1, 3)
            await session.begin_epoch(late)
            await session.apply(late, batch(late, 0, 10))
            [receipt] = await session.commit_epoch(late, coverage(None, 9))
            assert (receipt.rows_written, receipt.rows_skipped) == (10, 0)
            assert [payload["id"] for _, payload, _ in await stored_messages(nats_url, name)] == [
                *range(100),
                *range(10),
            ]
        finally:
            await session.close_session()

        # A new session reads the watermark back: the last committed epoch and where it ended.
        again = await open_session(cfg)
        try:
            state = await again.last_committed()
            assert state is not None and state.epoch == EpochId("orders-stream", 1, 3)
            assert [(p.domain, p.value) for p in state.watermarks] == [(DOMAIN, "9")]
        finally:
            await again.close_session()

    run(scenario())


def test_lifecycle_calls_out_of_order_are_refused(nats_url: str, target: tuple[str, str]) -> None:
    name, subject = target
    run(create_stream(nats_url, name, subject, 1.0))
    cfg = sink_config(nats_url, name, subject, 1.0)

    async def scenario() -> None:
        session = await open_session(cfg)
        one, two = EpochId("orders-stream", 1, 1), EpochId("orders-stream", 2, 1)
        try:
            with pytest.raises(LifecycleError):
                await session.apply(one, batch(one, 0, 1))
            with pytest.raises(LifecycleError):
                await session.commit_epoch(one, coverage(None, 0))
            await session.begin_epoch(one)
            with pytest.raises(LifecycleError):
                await session.begin_epoch(two)
            with pytest.raises(EpochMismatch):
                await session.apply(two, batch(two, 0, 1))
            with pytest.raises(EpochMismatch):
                await session.apply(one, batch(two, 0, 1))
            with pytest.raises(EpochMismatch):
                await session.commit_epoch(two, coverage(None, 0))
            await session.apply(one, batch(one, 0, 5))
            await session.abort_epoch(one)
            with pytest.raises(LifecycleError):
                await session.abort_epoch(one)
        finally:
            await session.close_session()
        # Abort cannot unpublish: the stream accepted the messages during apply.
        assert [payload["id"] for _, payload, _ in await stored_messages(nats_url, name)] == list(range(5))
        with pytest.raises(LifecycleError):
            await session.begin_epoch(two)
        await session.close_session()  # idempotent

    run(scenario())


def test_open_refuses_a_stream_whose_window_differs_or_that_is_missing(
    nats_url: str, target: tuple[str, str]
) -> None:
    name, subject = target
    run(create_stream(nats_url, name, subject, 5.0))
    with pytest.raises(ConfigError) as raised:
        run(open_session(sink_config(nats_url, name, subject, 2.0)))
    assert "duplicate window is 5s" in str(raised.value)
    with pytest.raises(ConfigError) as missing:
        run(open_session(sink_config(nats_url, name + "x", subject, 5.0)))
    assert "does not exist" in str(missing.value)
    with pytest.raises(ConfigError) as uncaptured:
        run(open_session(sink_config(nats_url, name, "other.subject", 5.0)))
    assert "does not capture" in str(uncaptured.value)


def test_close_waits_for_outstanding_acknowledgements(nats_url: str, target: tuple[str, str]) -> None:
    name, subject = target
    run(create_stream(nats_url, name, subject, 1.0))
    cfg = sink_config(nats_url, name, subject, 1.0)

    async def scenario() -> None:
        session = await open_session(cfg)
        epoch = EpochId("orders-stream", 1, 1)
        await session.begin_epoch(epoch)
        await session.apply(epoch, batch(epoch, 0, 2000))
        await session.close_session()  # no commit: close still waits until every publish landed
        assert len(await stored_messages(nats_url, name)) == 2000

    run(scenario())


@contextlib.contextmanager
def unresponsive(server: NatsServer) -> Iterator[None]:
    """The server process stays alive but answers nothing (SIGSTOP) until the block ends."""
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def short_acks(nats_url: str, target: tuple[str, str]) -> NatsSinkConfig:
    """A sink config on a fresh stream that waits one second for acknowledgements."""
    name, subject = target
    run(create_stream(nats_url, name, subject, 1.0))
    return sink_config(nats_url, name, subject, 1.0, ack_timeout=1.0)


def test_close_with_acknowledgements_that_do_not_arrive_is_uncertain(
    nats_server: NatsServer, nats_url: str, short_acks: NatsSinkConfig
) -> None:
    async def scenario() -> None:
        session = await open_session(short_acks)
        epoch = EpochId("orders-stream", 1, 1)
        await session.begin_epoch(epoch)
        with unresponsive(nats_server):
            await session.apply(epoch, batch(epoch, 0, 50))
            with pytest.raises(UncertainOutcome):
                await session.close_session()
        # The promise was right to be uncertain: the publishes still land after the close.
        for _ in range(50):
            if len(await stored_messages(nats_url, short_acks.stream)) == 50:
                break
            await asyncio.sleep(0.1)
        assert len(await stored_messages(nats_url, short_acks.stream)) == 50

    run(scenario())


def test_a_cancelled_apply_against_a_stalled_server_stops_and_close_names_what_is_in_doubt(
    nats_server: NatsServer, nats_url: str, short_acks: NatsSinkConfig
) -> None:
    """nats-py swallows a cancellation that lands while ``publish_async`` waits: without the
    sink's own watch the cancelled apply went on to send the whole batch and returned normally."""

    async def scenario() -> None:
        session = await open_session(short_acks)
        epoch = EpochId("orders-stream", 1, 1)
        await session.begin_epoch(epoch)
        with unresponsive(nats_server):
            apply = asyncio.ensure_future(session.apply(epoch, batch(epoch, 0, 500)))
            for _ in range(3):  # each publish waits at least one loop turn: the apply is mid-batch
                await asyncio.sleep(0)
            assert not apply.done()
            apply.cancel()
            await asyncio.wait([apply], timeout=30)
            assert apply.cancelled(), "a cancelled apply raises CancelledError"
            with pytest.raises(UncertainOutcome) as uncertain:
                await session.close_session()
        assert "of the session were not acknowledged" in str(uncertain.value)
        assert "orders " in str(uncertain.value), "it names the unanswered messages"
        # What the apply sent before it stopped may land once the server answers; nothing more.
        sent = int(str(uncertain.value).split(" of ")[1].split(" ")[0])
        assert sent < 500
        for _ in range(50):
            if len(await stored_messages(nats_url, short_acks.stream)) == sent:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        assert len(await stored_messages(nats_url, short_acks.stream)) == sent

    run(scenario())


def test_close_waits_for_an_apply_still_sending(nats_url: str, short_acks: NatsSinkConfig) -> None:
    """A caller that gave up on an apply without waiting for it, then closes: close_session
    returns only after that apply ended and its publishes were acknowledged. (The close's budget is
    generous: on a loaded machine sending 300 messages takes longer than ``short_acks``' second.)"""
    patient = short_acks.model_copy(update={"ack_timeout": 60.0})

    async def scenario() -> None:
        session = await open_session(patient)
        epoch = EpochId("orders-stream", 1, 1)
        await session.begin_epoch(epoch)
        apply = asyncio.ensure_future(session.apply(epoch, batch(epoch, 0, 300)))
        await asyncio.sleep(0)
        await session.close_session()
        assert apply.done()
        stored = len(await stored_messages(nats_url, short_acks.stream))
        await asyncio.sleep(0.5)
        assert len(await stored_messages(nats_url, short_acks.stream)) == stored == 300

    run(scenario())


def test_commit_with_missing_acknowledgements_is_uncertain(
    nats_server: NatsServer, short_acks: NatsSinkConfig
) -> None:
    async def scenario() -> None:
        session = await open_session(short_acks)
        epoch = EpochId("orders-stream", 1, 1)
        try:
            await session.begin_epoch(epoch)
            with unresponsive(nats_server):
                await session.apply(epoch, batch(epoch, 0, 20))
                with pytest.raises(UncertainOutcome):
                    await session.commit_epoch(epoch, coverage(None, 19))
            assert await session.last_committed() is None, "no watermark for an uncertain epoch"
            await session.abort_epoch(epoch)
        finally:
            await session.close_session()

    run(scenario())


def test_bounded_sink_appends_and_counts(nats_url: str, target: tuple[str, str]) -> None:
    name, subject = target
    run(create_stream(nats_url, name, subject, 1.0))
    sink = NatsSink(sink_config(nats_url, name, subject, 1.0))

    async def scenario() -> None:
        try:
            await sink.check()
            rows = pa.RecordBatch.from_pylist([{"id": i, "at": None} for i in range(30)])
            assert await sink.write_batch(rows) == 30
        finally:
            await sink.close()
        assert [payload["id"] for _, payload, _ in await stored_messages(nats_url, name)] == list(range(30))

    run(scenario())


@contextlib.contextmanager
def acknowledgements_lost(session: NatsSinkSession) -> Iterator[None]:
    """Fault at one exact point: what ``apply`` publishes inside the block reaches the real stream,
    which answers it (stored or duplicate), but the sink never sees those answers, as when the
    connection drops between the server storing a message and its acknowledgement arriving."""
    publisher = session._publisher
    real = publisher.publish

    async def publish(records: pa.RecordBatch, sent: Published) -> None:
        await real(records, sent)
        await asyncio.gather(*sent.futures)  # the stream stored them (or named their duplicate)
        loop = asyncio.get_running_loop()
        sent.futures[:] = [loop.create_future() for _ in sent.futures]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(publisher, "publish", publish)
        yield


async def epoch_with_lost_acknowledgements(cfg: NatsSinkConfig, rows: int) -> tuple[NatsSinkSession, EpochId]:
    """A new session whose active epoch published ``rows`` rows: stored, their acknowledgements lost."""
    session = await open_session(cfg)
    epoch = EpochId("orders-stream", 1, 1)
    await session.begin_epoch(epoch)
    with acknowledgements_lost(session):
        await session.apply(epoch, batch(epoch, 0, rows))
    return session, epoch


def test_commit_after_a_server_restart_republishes_what_was_lost_once(
    tmp_path: Path, unique_name: Callable[..., str]
) -> None:
    server = NatsServer(base_dir=tmp_path).start()  # its own: the restart disturbs no other test
    try:
        name, subject = unique_name("s"), f"{unique_name('subj')}.out"
        run(create_stream(server.url, name, subject, 30.0))
        cfg = sink_config(server.url, name, subject, 30.0, ack_timeout=20.0, republish_after=0.3)
        ids = Identities([str(i) for i in range(4000)])

        async def scenario() -> None:
            session = await open_session(cfg)
            try:
                epoch = EpochId("orders-stream", 1, 1)
                await session.begin_epoch(epoch)
                # 3000 messages the stream stores, whose acknowledgements the restart loses.
                with acknowledgements_lost(session):
                    await session.apply(epoch, batch(epoch, 0, 3000))
                # 1000 more sent to a frozen server that then crashes: lost with its socket.
                pid = server.pid
                assert pid is not None
                os.kill(pid, signal.SIGSTOP)
                await session.apply(epoch, batch(epoch, 3000, 1000))
                await asyncio.sleep(0.3)  # the client writes them out to the socket
                await asyncio.to_thread(server.kill)
                await asyncio.to_thread(server.start)  # same port, same (file) store

                [receipt] = await session.commit_epoch(epoch, coverage(None, 3999))
                # Each message counted once as stored by this epoch, the 3000 whose first publish was
                # stored included (their re-publish answered "duplicate" of a sequence of this epoch).
                assert (receipt.rows_written, receipt.rows_skipped) == (4000, 0)
                assert (receipt.details["first_sequence"], receipt.details["last_sequence"]) == ("1", "4000")
                assert receipt.details["duplicates"] == "0"
                # The re-publish path ran: for the 3000, and for at least one message the crash lost.
                assert 3000 < int(receipt.details["republished"]) <= 4000
                messages = await stored_messages(server.url, name)
                assert [seq for seq, _, _ in messages] == list(range(1, 4001))
                assert sorted(payload["id"] for _, payload, _ in messages) == list(range(4000))
                assert sorted(msg_id for _, _, msg_id in messages) == sorted(
                    ids.at(DOMAIN, i).digest() for i in range(4000)
                )
                state = await session.last_committed()
                assert state is not None and state.epoch == epoch

                # A replay whose acknowledgements are lost: the re-publish names sequences stored
                # before this epoch began, so the receipt counts duplicates, not stored messages.
                replay = EpochId("orders-stream", 2, 1)
                await session.begin_epoch(replay)
                with acknowledgements_lost(session):
                    await session.apply(replay, batch(replay, 0, 100))
                [receipt] = await session.commit_epoch(replay, coverage(None, 99))
                assert (receipt.rows_written, receipt.rows_skipped) == (0, 100)
                assert receipt.details["republished"] == "100" and "first_sequence" not in receipt.details
                assert len(await stored_messages(server.url, name)) == 4000
            finally:
                await session.close_session()

        run(scenario())
    finally:
        server.close()


def test_no_republish_past_the_duplicate_window(nats_url: str, target: tuple[str, str]) -> None:
    name, subject = target
    run(create_stream(nats_url, name, subject, 1.0))
    # The first re-publish would come 1.5 s after the publish: past the 1 s window, it could store
    # every message a second time.
    cfg = sink_config(nats_url, name, subject, 1.0, ack_timeout=2.0, republish_after=1.5)

    async def scenario() -> None:
        session, epoch = await epoch_with_lost_acknowledgements(cfg, 50)
        with pytest.raises(UncertainOutcome) as raised:
            await session.commit_epoch(epoch, coverage(None, 49))
        assert "50 of 50 publishes" in str(raised.value)
        assert "of the 1s duplicate window" in str(raised.value)
        assert await session.last_committed() is None
        await session.abort_epoch(epoch)
        with pytest.raises(UncertainOutcome):
            await session.close_session()
        # Nothing was re-published: each message is stored once.
        assert [payload["id"] for _, payload, _ in await stored_messages(nats_url, name)] == list(range(50))

    run(scenario())


def test_close_settles_an_aborted_epoch_by_republishing_within_the_window(
    nats_url: str, target: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    name, subject = target
    run(create_stream(nats_url, name, subject, 5.0))
    cfg = sink_config(nats_url, name, subject, 5.0, ack_timeout=3.0, republish_after=0.2)

    async def scenario() -> None:
        session, epoch = await epoch_with_lost_acknowledgements(cfg, 50)
        await session.abort_epoch(epoch)
        with caplog.at_level(logging.WARNING, logger="faucet_nats"):
            await session.close_session()  # certain: every re-publish answered "duplicate"
        assert any("re-published 50 unacknowledged messages" in r.getMessage() for r in caplog.records)
        assert [payload["id"] for _, payload, _ in await stored_messages(nats_url, name)] == list(range(50))

    run(scenario())
