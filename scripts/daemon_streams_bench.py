"""Measure a NATS -> PostgreSQL stream under a real ``dagster-daemon run`` with its own code servers.

``.venv/bin/python scripts/daemon_streams_bench.py [--seconds 300] [--rate 450] [--interval 30]
[--kills 1] [--separate-server]``

Starts the test servers (PostgreSQL, NATS from their wheels), the stream project of
``tests/test_daemon_streams.py`` with ``minimum_interval_seconds=--interval`` and the default budget,
and ``dagster-daemon run -f streams.py`` (the daemon's own code servers, replaced every 60 s), or with
``--separate-server`` one ``dagster api grpc`` code server named by a ``workspace.yaml`` (restarted at
once after each kill, as a supervisor does). Publishes ``--rate`` numbered messages per second; after
``--seconds`` fault-free, ``--kills`` times: kills the live code server with SIGKILL, waits for the
next certificate and prints the sensor ticks from the kill to it; then stops publishing, waits until
everything is certified, and checks the destination holds every message exactly once. Prints: the longest gaps
between certificates and the publish -> certified latency (p50, p95, max) of the fault-free part, the
longest sensor tick the daemon logged, and the time from the kill to the next certificate.
"""

import argparse
import itertools
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dagster as dg
import psycopg
import test_daemon_streams as daemon_test
from dagster._core.scheduler.instigation import InstigatorTick

from faucet_dagster.testing import NatsServer, PostgresServer, make_unique_name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--rate", type=int, default=450)
    parser.add_argument("--interval", type=int, default=30)
    parser.add_argument("--kills", type=int, default=1)
    parser.add_argument("--separate-server", action="store_true", help="one `dagster api grpc` server")
    parser.add_argument("--keep", type=Path, default=None, help="a directory to keep the logs in")
    args = parser.parse_args()
    daemon_test.RATE = args.rate
    return with_test_servers(run, args, keep=args.keep)


def with_test_servers(
    run_in: Callable[[Path, PostgresServer, NatsServer, argparse.Namespace], int],
    args: argparse.Namespace,
    *,
    keep: Path | None = None,
) -> int:
    """``run_in(directory, postgres, nats, args)`` with the test servers started (stopped after it),
    in a temporary directory, or ``keep`` (created) to keep the logs."""
    postgres, nats_server = PostgresServer.from_env().start(), NatsServer.from_env().start()
    try:
        if keep is not None:
            keep.mkdir(parents=True)
            return run_in(keep, postgres, nats_server, args)
        with tempfile.TemporaryDirectory(prefix="faucet-daemon-bench-") as tmp:
            return run_in(Path(tmp), postgres, nats_server, args)
    finally:
        nats_server.close()
        postgres.close()


def run(tmp: Path, postgres: PostgresServer, nats_server: NatsServer, args: argparse.Namespace) -> int:
    project = daemon_test.PROJECT.replace(
        "minimum_interval_seconds=5", f"minimum_interval_seconds={args.interval}"
    )
    (tmp / "streams.py").write_text(textwrap.dedent(project))
    home = tmp / "dagster_home"
    home.mkdir()
    stream = make_unique_name("bench")
    database = postgres.create_database(make_unique_name("bench_db"))
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "T_STREAM": stream,
        "T_NATS": nats_server.url,
        "T_POSTGRES": database,
        "T_STATE": f"sqlite:///{tmp / 'state.db'}",
        "PYTHONUNBUFFERED": "1",
    }
    deployment = daemon_test.Deployment(tmp, env)
    publisher = daemon_test.Publisher(nats_server.url, stream)
    try:
        publisher.start()
        began = time.time()
        port = 0
        if args.separate_server:
            server, port = deployment.start_daemon_on_code_server()
        else:
            deployment.start_daemon()
        deployment.wait_for("a first certificate", lambda: bool(deployment.certificates()), bound=180)
        first = time.time()
        print(f"first certificate {first - began:.1f}s after the daemon started", flush=True)
        time.sleep(args.seconds)
        window_end = time.time()

        # Fault-free figures: certificates from the first to the end of the window.
        certificates = [c for c in deployment.certificates() if daemon_test._created(c) <= window_end]
        times = [daemon_test._created(c) for c in certificates]
        gaps = sorted((b - a for a, b in itertools.pairwise(times)), reverse=True)
        ends = [(int(c.coverage[-1].end), daemon_test._created(c)) for c in certificates]
        sent = {n: at for n, at in dict(publisher.sent).items() if first <= at and n + 1 <= ends[-1][0]}
        latencies = sorted(next(at for end, at in ends if end >= n + 1) - stamp for n, stamp in sent.items())
        latencies = latencies or [float("nan")]  # a window too short for two certificates
        p50, p95 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.95)]
        servers = len({c.worker for c in certificates})
        print(
            f"fault-free {window_end - first:.0f}s at {args.rate}/s, interval {args.interval}s: "
            f"{len(certificates)} certificates by {servers} code servers; longest gaps "
            f"{[round(g, 1) for g in gaps[:5]]} s; latency p50 {p50:.1f} s, p95 {p95:.1f} s, "
            f"max {latencies[-1]:.1f} s",
            flush=True,
        )

        for _ in range(args.kills):
            before = deployment.workers()
            if args.separate_server:
                killed = time.time()
                server.kill()
                server.wait()
                server = deployment.start_code_server(port)
                back = time.time()
                where = "the new code server listened"
            else:
                victim = deployment.code_servers()[-1]
                existing = {p.pid for p in deployment.code_servers()}
                killed = time.time()
                victim.kill()

                def replaced(existing: set[int] = existing) -> bool:
                    return any(p.pid not in existing for p in deployment.code_servers())

                back = deployment.wait_for("a new code server", replaced, bound=180)
                where = "the daemon's new code server appeared"
            again = deployment.certified_by_a_new_worker(before)
            print(
                f"kill -9 code server: next certificate {again - killed:.1f} s after the kill "
                f"({again - back:.1f} s after {where}, {back - killed:.1f} s after the kill)",
                flush=True,
            )
            print_ticks(home, since=killed - 35, until=again + 1)
            time.sleep(20)
        deployment.finish(publisher, database, "whole run")
        print_ticks(home)
        with psycopg.connect(database) as conn:
            [(rows,)] = conn.execute("SELECT count(*) FROM events").fetchall()
        print(f"destination rows: {rows}, published: {len(publisher.sent)}")
        return 0
    finally:
        publisher.stopped.set()
        deployment.stop()
        deployment.store.close()


def print_ticks(home: Path, since: float | None = None, until: float | None = None) -> None:
    """The sensor ticks the daemon recorded: how long each took (start to end, as Dagster shows it),
    and a sample of their reasons; with ``since``, every tick from then to ``until`` (seconds since
    ``since``, duration, status, reason or error)."""
    for name, ticks in recorded_ticks(home).items():
        if since is not None:
            for tick in ticks:
                if since <= tick.timestamp <= (until or tick.timestamp):
                    took = (tick.end_timestamp or tick.timestamp) - tick.timestamp
                    at = tick.timestamp - since
                    print(f"  +{at:6.1f}s {took:5.1f}s {tick.status.value}: {said(tick)[:150]}")
            continue
        durations = sorted(t.end_timestamp - t.timestamp for t in ticks if t.end_timestamp)
        if not durations:
            continue
        certified = [t for t in ticks if (t.skip_reason or "").startswith("certified ")]
        print(
            f"{name}: {len(ticks)} ticks, {len(certified)} certified; tick seconds "
            f"p50 {durations[len(durations) // 2]:.1f}, max {durations[-1]:.1f}"
        )
        for tick in ticks[-3:]:
            print(f"  {tick.status.value}: {said(tick)}")


def recorded_ticks(home: Path) -> dict[str, list[InstigatorTick]]:
    """Every tick the daemon recorded in the instance at ``home``, per sensor (by name), oldest first."""
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return {
            state.instigator_name: sorted(
                instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=100_000),
                key=lambda tick: tick.timestamp,
            )
            for state in instance.all_instigator_state()
        }


def said(tick: InstigatorTick) -> str:
    """What a tick said: its skip reason, or the first line of its error."""
    return tick.skip_reason or (tick.error.message.splitlines()[0] if tick.error else "")


if __name__ == "__main__":
    sys.exit(main())
