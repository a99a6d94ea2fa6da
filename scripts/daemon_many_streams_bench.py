"""Measure many NATS -> PostgreSQL streams in one code location under a real ``dagster-daemon run``.

``.venv/bin/python scripts/daemon_many_streams_bench.py [--streams 10] [--seconds 180] [--rate 45]
[--interval 30] [--keep DIR]``

Starts the test servers (PostgreSQL, NATS from their wheels), a code location with ``--streams``
streams (each its own NATS stream and destination table, the sensors' default interval and budget:
``build_stream_defs`` shares the interval between them) and ``dagster-daemon run -f streams.py``
with the daemon's defaults (sensors evaluated one at a time, its own code servers). Publishes
``--rate`` numbered messages per second to each stream for ``--seconds``, then waits until every
stream certified everything and checks each destination table holds every message exactly once.
Prints, from the ticks the daemon recorded: the ticks' p50, p95 and longest duration, and per stream
the longest gap between the starts of two of its ticks (what "every stream still ticks about every
interval" means). ``--keep`` keeps the daemon's log and its instance in ``DIR``.
"""

import argparse
import itertools
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dagster as dg
import psycopg
import test_daemon_streams as daemon_test
from daemon_streams_bench import with_test_servers

from faucet_dagster.state import StateStore
from faucet_dagster.testing import NatsServer, PostgresServer, make_unique_name

PROJECT = """
import os

import dagster as dg

from faucet_dagster.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.sensors import FaucetStream, build_stream_defs

streams = [
    FaucetStream(
        name=name,
        source=FaucetEndpoint(
            FaucetConnection(
                connector="nats",
                config={
                    "servers": [os.environ["T_NATS"]],
                    "stream": name,
                    "columns": {"id": "int64 not null", "name": "string"},
                },
            )
        ),
        sink=FaucetEndpoint(
            FaucetConnection(connector="postgres", config={"url": os.environ["T_POSTGRES"], "table": name})
        ),
        resources=(name,),
        state_url=os.environ["T_STATE"],
    )
    for name in os.environ["T_STREAMS"].split(",")
]
defs = build_stream_defs(
    streams, minimum_interval_seconds=INTERVAL, default_status=dg.DefaultSensorStatus.RUNNING
)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--rate", type=int, default=45, help="messages per second and stream")
    parser.add_argument("--interval", type=int, default=30)
    parser.add_argument("--keep", type=Path, default=None, help="a directory to keep the logs in")
    args = parser.parse_args()
    daemon_test.RATE = args.rate
    return with_test_servers(run, args, keep=args.keep)


def run(tmp: Path, postgres: PostgresServer, nats_server: NatsServer, args: argparse.Namespace) -> int:
    (tmp / "streams.py").write_text(textwrap.dedent(PROJECT.replace("INTERVAL", str(args.interval))))
    home = tmp / "dagster_home"
    home.mkdir()
    names = [make_unique_name(f"many{i}") for i in range(args.streams)]
    database = postgres.create_database(make_unique_name("many_db"))
    state = f"sqlite:///{tmp / 'state.db'}"
    env = {
        **daemon_test.os.environ,
        "DAGSTER_HOME": str(home),
        "T_STREAM": names[0],
        "T_STREAMS": ",".join(names),
        "T_NATS": nats_server.url,
        "T_POSTGRES": database,
        "T_STATE": state,
        "PYTHONUNBUFFERED": "1",
    }
    deployment = daemon_test.Deployment(tmp, env)
    publishers = [daemon_test.Publisher(nats_server.url, name) for name in names]
    store = StateStore(state)
    try:
        for publisher in publishers:
            publisher.start()
        deployment.start_daemon()
        time.sleep(args.seconds)
        for publisher in publishers:
            publisher.stopped.set()
            publisher.join(30)
            assert publisher.error is None, publisher.error

        def all_certified() -> bool:
            for name, publisher in zip(names, publishers, strict=True):
                last = store.last_certificate(name)
                if last is None or int(last.coverage[-1].end) < max(publisher.sent) + 1:
                    return False
            return True

        deployment.wait_for("every stream certified everything", all_certified, bound=600)
        with psycopg.connect(database) as conn:
            for name, publisher in zip(names, publishers, strict=True):
                ids = [row[0] for row in conn.execute(f'SELECT id FROM "{name}"')]
                assert sorted(ids) == list(range(max(publisher.sent) + 1)), f"{name}: lost or duplicated"
        print(
            f"{args.streams} streams at {args.rate}/s each, interval {args.interval}s, {args.seconds:.0f}s: "
            "every message in its destination exactly once"
        )
        print_ticks(home)
        return 0
    finally:
        for publisher in publishers:
            publisher.stopped.set()
        deployment.stop()
        store.close()
        deployment.store.close()


def print_ticks(home: Path) -> None:
    """The longest tick of all, and per stream its longest tick and longest gap between tick starts."""
    longest_tick, longest_gap = 0.0, 0.0
    every: list[float] = []
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for state in instance.all_instigator_state():
            ticks = sorted(
                instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=100_000),
                key=lambda t: t.timestamp,
            )
            durations = [t.end_timestamp - t.timestamp for t in ticks if t.end_timestamp]
            gaps = [b.timestamp - a.timestamp for a, b in itertools.pairwise(ticks)]
            if not durations:
                continue
            every.extend(durations)
            longest_tick, longest_gap = max(longest_tick, *durations), max(longest_gap, *gaps, 0.0)
            certified = sum(1 for t in ticks if (t.skip_reason or "").startswith("certified "))
            print(
                f"  {state.instigator_name}: {len(ticks)} ticks, {certified} certified; longest tick "
                f"{max(durations):.1f}s, longest gap between ticks {max(gaps, default=0.0):.1f}s"
            )
    every.sort()
    p50, p95 = (every[int(q * (len(every) - 1))] if every else 0.0 for q in (0.5, 0.95))
    print(
        f"ticks: {len(every)}, p50 {p50:.2f}s, p95 {p95:.2f}s, longest {longest_tick:.1f}s; "
        f"longest gap between one stream's ticks {longest_gap:.1f}s"
    )


if __name__ == "__main__":
    sys.exit(main())
