"""The NATS sink against a server that hangs (its process SIGSTOPped) with megabytes in flight: every
wait of the session is bounded. ``close_session`` raises UncertainOutcome within ``ack_timeout`` (the
old close waited for nats-py to flush its buffer into the frozen server: for the whole freeze), and an
``apply`` whose bytes the server does not read fails within ``ack_timeout`` instead of filling
nats-py's 64 MiB buffer."""

import asyncio
import time
from collections.abc import Callable
from typing import Any

import nats
import pyarrow as pa
import pytest
from faucet_nats.sink import NatsSinkSession, NatsStreamingSink
from faucet_nats.sink_config import NatsSinkConfig

from faucet_dagster.protocol import (
    ConnectionFailed,
    EpochId,
    Identities,
    OrderingDomain,
    SinkBatch,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
)
from faucet_dagster.testing import NatsServer

WORKER = WorkerIdentity("worker-a", 1)
DOMAIN = OrderingDomain("kafka", "orders", "0", "cluster:topic-id", "kafka.offset")
ACK_TIMEOUT = 1.0
FREEZE = 40.0
"""The server thaws after this long at most: a close that waits for it takes at least this long."""
ACCEPTED = 12.0
"""What the tests accept for a call bounded by ACK_TIMEOUT (generous for a loaded machine)."""
PAYLOAD = "x" * 4000


def rows(epoch: EpochId, start: int, count: int) -> SinkBatch:
    """``count`` rows of about 4 KB each."""
    ids = range(start, start + count)
    records = pa.RecordBatch.from_pylist([{"id": i, "payload": PAYLOAD} for i in ids])
    return SinkBatch(epoch, "orders", DOMAIN, records, Identities([str(i) for i in ids]))


@pytest.fixture
def config(nats_url: str, unique_name: Callable[..., str]) -> NatsSinkConfig:
    stream = unique_name("s")
    subject = f"{stream}.out"

    async def create() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(name=stream, subjects=[subject], duplicate_window=120)
        finally:
            await client.close()

    asyncio.run(create())
    return NatsSinkConfig(
        servers=(nats_url,),
        stream=stream,
        subject=subject,
        duplicate_window=120,
        ack_timeout=ACK_TIMEOUT,
        watermark_bucket=f"w_{stream}",
    )


async def begun(config: NatsSinkConfig) -> tuple[NatsSinkSession, EpochId]:
    """A session with epoch 1 begun (while the server answers)."""
    session = await NatsStreamingSink(config).open("orders-stream", WritePolicy.APPEND, (), WORKER)
    epoch = EpochId("orders-stream", 1, 1)
    await session.begin_epoch(epoch)
    return session, epoch


async def timed(call: Any) -> tuple[float, BaseException | None]:
    began = time.monotonic()
    try:
        await call
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 (the test asserts on it)
        return time.monotonic() - began, exc
    return time.monotonic() - began, None


def test_close_against_a_frozen_server_with_megabytes_unsent_is_uncertain_within_ack_timeout(
    nats_server: NatsServer, config: NatsSinkConfig
) -> None:
    async def scenario() -> None:
        session, epoch = await begun(config)
        with nats_server.frozen(at_most=FREEZE):
            # About 6 MB: more than the kernel's socket buffers take, less than the sink's own limit.
            await session.apply(epoch, rows(epoch, 0, 1_500))
            took, raised = await timed(session.close_session())
        assert isinstance(raised, UncertainOutcome), raised
        assert took < ACCEPTED, f"close_session took {took:.1f}s against a frozen server"
        assert "were not acknowledged" in str(raised)

    asyncio.run(scenario())


def test_an_apply_the_frozen_server_does_not_read_fails_within_ack_timeout(
    nats_server: NatsServer, config: NatsSinkConfig
) -> None:
    async def scenario() -> None:
        session, epoch = await begun(config)
        with nats_server.frozen(at_most=FREEZE):
            # About 16 MB: the client would buffer up to 64 MiB; the sink waits for 8 MiB to leave.
            took, raised = await timed(session.apply(epoch, rows(epoch, 0, 4_000)))
            assert isinstance(raised, ConnectionFailed), raised
            assert "the server read none of" in str(raised)
            assert took < ACCEPTED, f"apply took {took:.1f}s against a frozen server"
            took, raised = await timed(session.close_session())
        assert isinstance(raised, UncertainOutcome), raised
        assert took < ACCEPTED, f"close_session took {took:.1f}s against a frozen server"

    asyncio.run(scenario())
