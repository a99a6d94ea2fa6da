"""A bounded sync whose destination refuses connections is retried by Dagster, as its ``retry_policy``
says, and succeeds once the destination accepts; an error that is not retryable fails at once.

The destination is a real PostgreSQL behind a TCP proxy on loopback that resets the first connections
made to it (a refusal at an exact point: the n-th connection), then forwards every later one.
"""

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from faucet_dagster.components import FaucetComponent

ROWS = 300


class RefusingProxy:
    """A TCP proxy on loopback to ``target`` that resets its first ``refusals`` connections."""

    def __init__(self, target: tuple[str, int], refusals: int) -> None:
        self.target = target
        self.refusals = refusals
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopping = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.connections <= self.refusals:
                # SO_LINGER 0: close with a reset, as a server that refuses the connection.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            for source, destination in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, destination), daemon=True).start()

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()


def _pipe(source: socket.socket, destination: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            destination.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, destination):
            end.close()


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[tuple[RefusingProxy, str]]:
    address = psycopg.conninfo.conninfo_to_dict(postgres_url)
    created = RefusingProxy(
        (str(address.get("host", "127.0.0.1")), int(address.get("port", 5432))), refusals=2
    )
    url = postgres_url.replace(f":{address['port']}/", f":{created.port}/")
    yield created, url
    created.close()


def component(data: Path, url: str, retry: str) -> FaucetComponent:
    return FaucetComponent.resolve_from_yaml(
        f"""
connections:
  files: {{connector: files}}
  warehouse: {{connector: postgres, config: {{url: "{url}"}}}}
syncs:
  - name: orders
    source: {{connection: files, config: {{paths: ["{data}/*.csv"]}}}}
    sink: {{connection: warehouse, config: {{table: orders, mode: append}}}}
    {retry}
    pool: warehouse
"""
    )


@pytest.fixture
def data(tmp_path: Path) -> Path:
    (tmp_path / "orders.csv").write_text("id,amount\n" + "".join(f"{n},{n * 0.5}\n" for n in range(ROWS)))
    return tmp_path


def test_a_sync_whose_destination_refuses_twice_succeeds_through_dagster_retries(
    proxy: tuple[RefusingProxy, str], data: Path, postgres_url: str
) -> None:
    refusing, url = proxy
    defs = component(
        data, url, "retry_policy: {max_retries: 3, delay: 0.2, backoff: exponential}"
    ).build_sync_defs()
    [asset] = list(defs.assets or [])
    assert isinstance(asset, dg.AssetsDefinition) and asset.op.pool == "warehouse"
    with dg.instance_for_test() as instance:
        result = dg.materialize([asset], instance=instance)
        assert result.success
        events = instance.all_logs(result.run_id)
    retries = [
        e
        for e in events
        if e.dagster_event is not None and e.dagster_event.event_type_value == "STEP_UP_FOR_RETRY"
    ]
    assert len(retries) == 2, "each refusal was one Dagster retry"
    assert refusing.connections >= 3
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (ROWS,)


def test_without_a_retry_policy_the_first_refusal_fails_the_run(
    proxy: tuple[RefusingProxy, str], data: Path
) -> None:
    _, url = proxy
    [asset] = list(component(data, url, "retry_policy: null").build_sync_defs().assets or [])
    with dg.instance_for_test() as instance:
        result = dg.materialize([asset], instance=instance, raise_on_error=False)
    assert not result.success


def test_an_error_that_is_not_retryable_fails_at_once(data: Path, postgres_url: str) -> None:
    defs = component(data, postgres_url, "retry_policy: {max_retries: 3, delay: 0.2}").build_sync_defs()
    [asset] = list(defs.assets or [])
    (data / "orders.csv").unlink()  # the files named exist no more: a configuration error
    with dg.instance_for_test() as instance:
        result = dg.materialize([asset], instance=instance, raise_on_error=False)
        assert not result.success
        assert retried(instance, result.run_id) == 0
        [failure] = [
            e for e in instance.all_logs(result.run_id) if e.dagster_event and e.dagster_event.is_step_failure
        ]
    assert "ConfigError" in str(failure.dagster_event)


def retried(instance: dg.DagsterInstance, run_id: str) -> int:
    """How many times the run's step was sent up for retry."""
    return sum(
        1
        for entry in instance.all_logs(run_id)
        if entry.dagster_event is not None and entry.dagster_event.event_type_value == "STEP_UP_FOR_RETRY"
    )
