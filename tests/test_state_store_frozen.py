"""The state store against a PostgreSQL server that hangs (its process group SIGSTOPped): every wait is
bounded by the store's timeout and ends in StateStoreUnavailable ("state store unreachable"), in this
process and from `faucet streams status` in another one; once the server answers again, the store
works again without being rebuilt."""

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import dagster as dg
import nats
import pytest
from stream_ticks import SensorTicks

from faucet_dagster import FaucetConnection, FaucetStream
from faucet_dagster.cli.main import main
from faucet_dagster.protocol import ConfigError, ReadLimits
from faucet_dagster.state import StateStore, StateStoreUnavailable
from faucet_dagster.streams.health import health_check
from faucet_dagster.streams.runner_cache import close_cached_streams
from faucet_dagster.streams.sensor import faucet_stream_sensor
from faucet_dagster.testing import PostgresServer

TIMEOUT = 2.0
"""The store's timeout in these tests: every failing call must end well before the server thaws."""
FREEZE = 40.0
"""How long the server stays frozen at most: a store that waits for it (the old code did) is seen
taking at least this long, far past what these tests accept."""
ACCEPTED = 15.0
"""What these tests accept for a call that must give up after TIMEOUT (generous for a loaded machine)."""


def stream_on(state_url: str) -> FaucetStream:
    """A stream whose state lives at ``state_url`` (building it connects to nothing)."""
    return FaucetStream(
        name="orders",
        source=FaucetConnection(connector="nats", config={"stream": "ORDERS"}).using(),
        sink=FaucetConnection(connector="postgres", config={"url": "postgresql://x@127.0.0.1:1/x"}).using(
            table="orders"
        ),
        resources=("ORDERS",),
        state_url=state_url,
    )


def timed(call: Callable[[], object]) -> tuple[float, BaseException | None]:
    began = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 (returned to the test, which asserts on it)
        return time.monotonic() - began, exc
    return time.monotonic() - began, None


def test_a_frozen_postgresql_store_raises_unreachable_within_its_timeout_then_recovers(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    store = StateStore(postgres_url, timeout=TIMEOUT)
    try:
        store.mark_reported("orders", 1)  # a pooled connection, alive before the freeze
        with postgres_server.frozen(at_most=FREEZE):
            # A tick's sequence: every call gives up on its own, none waits for the server.
            for call in (
                lambda: store.reported_through("orders"),
                lambda: store.mark_reported("orders", 2),
                lambda: store.certificates("orders", after=0, limit=10),
            ):
                took, raised = timed(call)
                assert isinstance(raised, StateStoreUnavailable), raised
                assert took < ACCEPTED, f"the call waited {took:.1f}s for a frozen server"
                assert "state store unreachable" in str(raised)
                assert "no answer" in str(raised) or "timed out" in str(raised)
            took, raised = timed(lambda: StateStore(postgres_url, timeout=TIMEOUT))
            assert isinstance(raised, StateStoreUnavailable), raised
            assert took < ACCEPTED, f"opening a store waited {took:.1f}s for a frozen server"
            # The on-demand health check answers (failing) within the store's default timeout.
            began = time.monotonic()
            stream = stream_on(postgres_url)
            checked = health_check(stream.state_url, [stream.name], stream.asset_spec().key)()
            took = time.monotonic() - began
            assert not checked.passed and "state store unreachable" in str(checked.description)
            assert took < ACCEPTED, f"the health check waited {took:.1f}s for a frozen server"
        # Thawed: the same store answers again (the abandoned connections were discarded).
        deadline = time.monotonic() + 30
        while True:
            try:
                assert store.reported_through("orders") == 1
                break
            except StateStoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        store.close()


def test_streams_status_says_state_store_unreachable_when_postgresql_hangs(
    postgres_server: PostgresServer, postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    StateStore(postgres_url).close()  # the tables exist: only the freeze can fail the command
    with postgres_server.frozen(at_most=FREEZE):
        took, raised = timed(lambda: main(["streams", "status", "--state-url", postgres_url]))
        assert raised is None, raised
    out = capsys.readouterr()
    assert "state store unreachable" in out.err, out
    assert took < ACCEPTED, f"faucet streams status took {took:.1f}s against a frozen store"


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_a_store_timeout_must_be_positive(timeout: float, tmp_path: object) -> None:
    with pytest.raises(ConfigError, match="timeout must be positive"):
        StateStore(f"sqlite:///{tmp_path}/s.db", timeout=timeout)


def test_a_sensor_tick_against_a_frozen_state_store_fails_within_its_budget_saying_unreachable(
    postgres_server: PostgresServer, postgres_url: str, nats_url: str, unique_name: Callable[..., str]
) -> None:
    """A NATS to NATS stream whose state store is the PostgreSQL that hangs: the tick raises "state
    store unreachable" within its budget and the store's timeout, not after the freeze (the old tick
    waited for the whole freeze); once the server answers, the next ticks certify again."""
    source, target = unique_name("src"), unique_name("dst")

    async def setup() -> None:
        client = await nats.connect(nats_url)
        try:
            js = client.jetstream()
            await js.add_stream(name=source, subjects=[f"{source}.>"])
            await js.add_stream(name=target, subjects=[f"{target}.out"], duplicate_window=120)
        finally:
            await client.close()

    async def publish(first: int, count: int) -> None:
        client = await nats.connect(nats_url)
        try:
            for n in range(first, first + count):
                await client.jetstream().publish(f"{source}.rows", json.dumps({"id": n}).encode())
        finally:
            await client.close()

    asyncio.run(setup())
    stream = FaucetStream(
        name=unique_name("stream"),
        source=FaucetConnection(connector="nats", config={"servers": [nats_url], "stream": source}).using(),
        sink=FaucetConnection(
            connector="nats",
            config={"servers": [nats_url], "stream": target, "subject": f"{target}.out"},
        ).using(),
        resources=(source,),
        limits=ReadLimits(records=100, idle=0.3),
        state_url=postgres_url,
    )
    try:
        with dg.instance_for_test() as instance:
            ticks = SensorTicks(faucet_stream_sensor(stream, budget_seconds=3), instance)
            asyncio.run(publish(0, 200))
            ticks.until(lambda: bool(ticks.reported), "a certificate reported")
            with postgres_server.frozen(at_most=FREEZE):
                took, raised = timed(ticks.tick)
            assert isinstance(raised, StateStoreUnavailable), raised
            assert "state store unreachable" in str(raised)
            assert took < ACCEPTED, f"the tick took {took:.1f}s against a frozen state store"
            # Thawed: the stream goes on. A tick may first report what its runner met in the background
            # during the freeze (a certificate it could not store: retryable); the next ones certify.
            asyncio.run(publish(200, 100))
            certified = max(ticks.reported)
            deadline = time.monotonic() + 120
            while max(ticks.reported) <= certified:
                assert time.monotonic() < deadline, "no certificate after the freeze"
                with contextlib.suppress(StateStoreUnavailable):
                    ticks.tick()
    finally:
        close_cached_streams()
