"""What the state store costs at one epoch per second per stream, on SQLite and on PostgreSQL.

``python -m bench.state_store_cost [--streams 1 10 100] [--seconds 30] [--stores sqlite postgresql]``

Each simulated stream does, against a real :class:`~faucet_dagster.state.StateStore`, exactly the
store calls a stream under its sensor makes with the defaults (one epoch a second: ``limits.age``):

* per epoch, the certificate append (one transaction: the stream's row locked, the lease checked,
  the positions and the certificate written) and the acknowledgement's authority check
  (``check_lease``: one per provider acknowledgement; one per epoch for Kafka and NATS);
* the lease keeper's hand-over poll every ``LEASE_POLL_SECONDS`` (0.5 s) and its renewal every third
  of the lease (5 s);
* the sensor's tick every 30 s: the report mark moved, the new certificates read.

Certificates cover 4 partitions (a 4-partition Kafka topic: 4 coverage entries and positions). The
streams run concurrently, one thread each, in this one process (as the streams of a code server share
its process; a worker per stream would spread the client side, not the server's). Printed per store
and stream count: the epochs a second achieved (the target is the stream count), each call's p50 and
p99 latency, the client's CPU per epoch, the PostgreSQL server's CPU per epoch (its processes, from
psutil), and the bytes the store grew by per certificate.
"""

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psutil

from faucet_dagster.protocol import Delivery, DomainCoverage, EpochCertificate, OrderingDomain, Receipt
from faucet_dagster.runner.lease import LEASE_POLL_SECONDS
from faucet_dagster.runner.spec import DEFAULT_LEASE_SECONDS
from faucet_dagster.state import Lease, StateStore
from faucet_dagster.testing import PostgresServer, make_unique_name

T = TypeVar("T")
EPOCH_SECONDS = 1.0
TICK_SECONDS = 30.0
PARTITIONS = 4


@dataclass
class Calls:
    """Latencies of one kind of call, in seconds."""

    seconds: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def timed(self, call: Callable[..., T], *args: Any) -> T:
        began = time.perf_counter()
        result = call(*args)
        elapsed = time.perf_counter() - began
        with self.lock:
            self.seconds.append(elapsed)
        return result

    def describe(self) -> str:
        if not self.seconds:
            return "-"
        ordered = sorted(self.seconds)
        p99 = ordered[int(0.99 * (len(ordered) - 1))]
        return f"{statistics.median(ordered) * 1000:.2f}/{p99 * 1000:.1f}"


@dataclass
class Workload:
    appends: Calls = field(default_factory=Calls)
    checks: Calls = field(default_factory=Calls)
    polls: Calls = field(default_factory=Calls)
    renewals: Calls = field(default_factory=Calls)
    reports: Calls = field(default_factory=Calls)
    epochs: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _certificate(lease: Lease, sequence: int, rows: int = 1_000) -> EpochCertificate:
    coverage = tuple(
        DomainCoverage(
            OrderingDomain("kafka", "orders", str(p), "tansu_cluster:bench", "kafka.offset"),
            None if sequence == 1 else str((sequence - 1) * rows - 1),
            str(sequence * rows - 1),
        )
        for p in range(PARTITIONS)
    )
    return EpochCertificate(
        stream=lease.stream,
        sequence=sequence,
        fencing_token=lease.fencing_token,
        worker=lease.owner,
        coverage=coverage,
        receipts=(Receipt("orders", rows * PARTITIONS, 0, {"transaction": "123456"}),),
        row_counts={"orders": rows * PARTITIONS},
        digest="blake2b-256:" + "ab" * 32,
        delivery=Delivery.EFFECTIVELY_ONCE,
        timings={"lease": 0.001, "read_and_seal": 0.9, "commit": 0.02},
        created_at="2026-01-01T00:00:00.000000+00:00",
    )


def _stream(store: StateStore, name: str, work: Workload, ends: float) -> None:
    """One stream's store calls until ``ends`` (``time.monotonic()``)."""
    lease = store.acquire_lease(name, f"bench:{name}", DEFAULT_LEASE_SECONDS, started=1.0)
    now = time.monotonic()
    next_epoch, next_poll, next_renewal, next_tick = (
        now,
        now,
        now + DEFAULT_LEASE_SECONDS / 3,
        now + TICK_SECONDS,
    )
    sequence = 0
    while True:
        now = time.monotonic()
        if now >= ends:
            return
        if now >= next_epoch:
            sequence += 1
            work.appends.timed(store.append_certificate, _certificate(lease, sequence), lease)
            work.checks.timed(store.check_lease, lease)
            with work.lock:
                work.epochs += 1
            next_epoch += EPOCH_SECONDS
        if now >= next_poll:
            work.polls.timed(store.handover_requested, lease)
            next_poll += LEASE_POLL_SECONDS
        if now >= next_renewal:
            lease = work.renewals.timed(store.renew_lease, lease, DEFAULT_LEASE_SECONDS)
            next_renewal += DEFAULT_LEASE_SECONDS / 3
        if now >= next_tick:
            reported = store.reported_through(name)
            work.reports.timed(partial(store.certificates, after=reported), name)
            store.mark_reported(name, sequence)
            next_tick += TICK_SECONDS
        time.sleep(max(0.0, min(next_epoch, next_poll, next_renewal, next_tick) - time.monotonic()))


def _server_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for each in [process, *process.children(recursive=True)]:
                times = each.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            continue
    return total


def measure(url: str, streams: int, seconds: float, server_pids: list[int], size: Callable[[], int]) -> str:
    store = StateStore(url)
    work = Workload()
    prefix = make_unique_name("cost")
    me = psutil.Process()
    try:
        before_size, cpu_before = size(), me.cpu_times()
        server_before = _server_cpu(server_pids)
        ends = time.monotonic() + seconds
        threads = [
            threading.Thread(target=_stream, args=(store, f"{prefix}_{i}", work, ends), daemon=True)
            for i in range(streams)
        ]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.monotonic() - began
        cpu_after = me.cpu_times()
        client = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
        server = _server_cpu(server_pids) - server_before
        grown = size() - before_size
    finally:
        store.close()
    epochs = max(1, work.epochs)
    server_text = f"{server / epochs * 1000:.2f} ms" if server_pids else "(in the client)"
    return (
        f"| {streams} | {work.epochs / wall:.1f}/s of {streams} | {work.appends.describe()} | "
        f"{work.checks.describe()} | {work.polls.describe()} | {work.renewals.describe()} | "
        f"{client / epochs * 1000:.2f} ms | {server_text} | {grown / epochs / 1024:.1f} KiB |"
    )


@contextmanager
def _sqlite() -> Iterator[tuple[str, list[int], Callable[[], int]]]:
    folder = Path(tempfile.mkdtemp(prefix="faucet-store-cost-"))
    database = folder / "state.db"

    def size() -> int:
        return sum(path.stat().st_size for path in folder.iterdir())

    yield f"sqlite:///{database}", [], size


@contextmanager
def _postgresql() -> Iterator[tuple[str, list[int], Callable[[], int]]]:
    with PostgresServer.from_env() as server:
        server.start()
        name = make_unique_name("store_cost")
        url = server.create_database(name)
        pid = server.pid
        import psycopg

        def size() -> int:
            with psycopg.connect(url) as conn:
                row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
            return int(row[0]) if row else 0

        try:
            yield url, [] if pid is None else [pid], size
        finally:
            server.drop_database(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--stores", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"]
    )
    args = parser.parse_args()
    print(f"# load average {os.getloadavg()[0]:.2f} at the start; {args.seconds:.0f}s per row")
    for kind in args.stores:
        print(f"\n{kind}: latencies p50/p99 in ms")
        print(
            "| streams | epochs | append | lease check | hand-over poll | renewal | client CPU per epoch | "
            "server CPU per epoch | growth per certificate |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for streams in args.streams:
            with _sqlite() if kind == "sqlite" else _postgresql() as (url, pids, size):
                print(measure(url, streams, args.seconds, pids, size), flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
