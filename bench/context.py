"""What a scenario gets: the row count, the dataset, the servers, and a cache shared across scenarios."""

import json
import time
from collections.abc import Callable
from typing import TypeVar, cast

from faucet_dagster.testing import KafkaServer, NatsServer, PostgresServer, make_unique_name

T = TypeVar("T")

#: One dataset row: ``(id, key, payload)`` with a small JSON object as payload.
Row = tuple[int, str, str]


def make_row(i: int) -> Row:
    """Row ``i`` of the dataset: ``(i, "k<i % 1000>", '{"i": i, "name": "user-i", "score": i * 0.5}')``."""
    return (i, f"k{i % 1000}", json.dumps({"i": i, "name": f"user-{i}", "score": i * 0.5}))


class BenchContext:
    """Shared by every scenario of one run: same data, same servers.

    Servers start on first use (``from_env``: the ``FAUCET_TEST_*`` variables select external ones) and
    are closed by :meth:`close`, together with whatever scenarios registered through :meth:`on_close`.
    Server startup therefore happens outside the scenarios' timed sections.
    """

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.round = 1
        """The round being run (set by the runner): what :meth:`per_round` keys on."""
        self._cache: dict[str, object] = {}
        self._cleanups: list[Callable[[], None]] = []
        self._postgres: PostgresServer | None = None
        self._nats: NatsServer | None = None
        self._kafka: KafkaServer | None = None

    # -- data -------------------------------------------------------------------------------------

    def dataset(self) -> list[Row]:
        """The ``rows`` rows of the run (built once)."""
        return self.shared("dataset", lambda: [make_row(i) for i in range(self.rows)])

    def payloads(self) -> list[bytes]:
        """The dataset's JSON payloads as bytes (built once): the message values."""
        return self.shared("payloads", lambda: [r[2].encode() for r in self.dataset()])

    def shared(self, key: str, factory: Callable[[], T]) -> T:
        """``factory()``, computed once per run under ``key`` (prepared data scenarios share)."""
        if key not in self._cache:
            self._cache[key] = factory()
        return cast(T, self._cache[key])

    def per_round(
        self, key: str, factory: Callable[[], T], release: Callable[[T], None] = lambda value: None
    ) -> T:
        """``factory()``, computed once per round under ``key``: data a scenario and its baseline must
        share within a round but that must not carry over into the next one. A CDC slot made in round 1
        would make round 5's copies decode, and skip, everything the scenarios of rounds 1 to 4 wrote.
        The value of an earlier round is passed to ``release`` (dropping its slot) before the new one
        is made."""
        current = f"{key}@round{self.round}"
        if current not in self._cache:
            for earlier in [name for name in self._cache if name.startswith(f"{key}@round")]:
                release(cast(T, self._cache.pop(earlier)))
            self._cache[current] = factory()
        return cast(T, self._cache[current])

    def unique(self, prefix: str) -> str:
        """A fresh ``[a-z0-9_]`` name for a table, topic, stream or consumer group."""
        return make_unique_name(prefix, "bench")

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at :meth:`close` (last registered, first run); e.g. deleting a topic."""
        self._cleanups.append(fn)

    # -- servers ----------------------------------------------------------------------------------

    @property
    def postgres_url(self) -> str:
        """URL of a database created for this run (the server and database start on first use)."""
        return self.shared("postgres_url", self._create_database)

    @property
    def replica_url(self) -> str:
        """URL of a second database of the same server, created for this run: where a replicator
        writes, so that its writes are not in the source database's logical decoding (a slot skips
        another database's records before decoding them), as a production replica lives elsewhere."""
        return self.shared("replica_url", self._create_database)

    @property
    def kafka_bootstrap(self) -> str:
        """``bootstrap.servers`` of the Kafka-protocol broker (started on first use)."""
        if self._kafka is None:
            self._kafka = KafkaServer.from_env()
            self._start(self._kafka)
        return self._kafka.bootstrap

    @property
    def nats_url(self) -> str:
        """URL of the NATS server (started on first use)."""
        if self._nats is None:
            self._nats = NatsServer.from_env()
            self._start(self._nats)
        return self._nats.url

    def servers(self) -> dict[str, str]:
        """Which servers this run used: name -> ``managed <address>`` or ``external <address>``."""
        out: dict[str, str] = {}
        for name, server in (("postgres", self._postgres), ("nats", self._nats), ("kafka", self._kafka)):
            if server is not None:
                out[name] = f"{'external' if server.is_external else 'managed'} {server!r}"
        return out

    def _create_database(self) -> str:
        if self._postgres is None:
            self._postgres = PostgresServer.from_env()
            self._start(self._postgres)
        server = self._postgres
        name = self.unique("bench")
        url = server.create_database(name)
        self.on_close(lambda: server.drop_database(name))
        return url

    def _start(self, server: PostgresServer | NatsServer | KafkaServer) -> None:
        began = time.perf_counter()
        server.start()
        print(f"# {server!r} ready in {time.perf_counter() - began:.1f} s", flush=True)

    def close(self) -> None:
        """Run the cleanups (newest first), then close the servers. Errors propagate after all ran."""
        errors: list[Exception] = []
        while self._cleanups:
            try:
                self._cleanups.pop()()
            except Exception as exc:  # noqa: BLE001 - re-raised below as an ExceptionGroup
                errors.append(exc)
        for server in (self._postgres, self._nats, self._kafka):
            if server is not None:
                server.close()
        if errors:
            raise ExceptionGroup("benchmark cleanup failed", errors)
