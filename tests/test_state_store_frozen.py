"""The state store against a PostgreSQL server that hangs (its process group SIGSTOPped): every wait is
bounded by the store's timeout and ends in StateStoreUnavailable ("state store unreachable"), in this
process and from `faucet streams status` in another one; once the server answers again, the store
works again without being rebuilt."""

import time
from collections.abc import Callable

import pytest

from faucet_dagster import FaucetConnection, FaucetStream
from faucet_dagster.cli.main import main
from faucet_dagster.protocol import ConfigError
from faucet_dagster.state import StateStore, StateStoreUnavailable
from faucet_dagster.streams.health import health_check
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
            checked = health_check(stream_on(postgres_url))()
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
