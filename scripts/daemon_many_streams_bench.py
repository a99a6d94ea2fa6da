"""Measure many NATS -> PostgreSQL streams in one code location under a real ``dagster-daemon run``.

``.venv/bin/python scripts/daemon_many_streams_bench.py [--streams 10] [--seconds 180] [--rate 45]
[--interval 30] [--threads N] [--keep DIR]``

Starts the test servers (PostgreSQL, NATS from their wheels), a code location with ``--streams``
streams (each its own NATS stream and destination table, the sensors' default interval and budget:
``build_stream_defs`` shares the interval between them) and ``dagster-daemon run -f streams.py``
with the daemon's defaults (sensors evaluated one at a time, its own code servers; ``--threads N``
sets ``sensors: {use_threads: true, num_workers: N}`` in ``dagster.yaml``: N at a time). Publishes
``--rate`` numbered messages per second to each stream for ``--seconds``, then waits until every
stream certified everything and checks each destination table holds every message exactly once.
Meanwhile a poller reads each destination table's highest id every ``--poll`` seconds (ids land in
order: one NATS stream is one ordering domain): a message's latency runs from its publish
acknowledgement to the first poll that saw its row; the p50, p95, p99 and largest latency are printed,
over every message and per stream, with the moments of the largest (the daemon replaces its code
servers every 60 s: each replacement is a hand-over).
Prints, from the ticks the daemon recorded: the ticks' p50, p95 and longest duration (the first
ticks of a code server apart: they start its readers), per stream the longest gap between the starts
of two of its ticks (what "every stream still ticks about every interval" means), and where the time
beyond the interval went: the daemon busy with other sensors' ticks (it evaluates a code location's
sensors one at a time) or idle (its sensor loop looks for due sensors every 5 s at most). Then the
CPU the daemon and its code servers used. ``--keep`` keeps the daemon's log and its instance in
``DIR``.
"""

import argparse
import bisect
import itertools
import os
import statistics
import sys
import textwrap
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dagster as dg
import psutil
import psycopg
import test_daemon_streams as daemon_test
from daemon_streams_bench import with_test_servers

from faucet_dagster.state import StateStore
from faucet_dagster.testing import NatsServer, PostgresServer, make_unique_name

PROJECT = """
import os

import dagster as dg

from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster import FaucetStream, build_stream_defs

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
    parser.add_argument("--threads", type=int, default=0, help="sensors evaluated at a time (0: serial)")
    parser.add_argument("--keep", type=Path, default=None, help="a directory to keep the logs in")
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between the latency poller's reads")
    args = parser.parse_args()
    daemon_test.RATE = args.rate
    return with_test_servers(run, args, keep=None if args.keep is None else args.keep.resolve())


def run(tmp: Path, postgres: PostgresServer, nats_server: NatsServer, args: argparse.Namespace) -> int:
    (tmp / "streams.py").write_text(textwrap.dedent(PROJECT.replace("INTERVAL", str(args.interval))))
    home = tmp / "dagster_home"
    home.mkdir()
    if args.threads:
        (home / "dagster.yaml").write_text(f"sensors:\n  use_threads: true\n  num_workers: {args.threads}\n")
    names = [make_unique_name(f"many{i}") for i in range(args.streams)]
    database = postgres.create_database(make_unique_name("many_db"))
    state = f"sqlite:///{tmp / 'state.db'}"
    env = {
        **os.environ,
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
    visibility = Visibility(database, names, args.poll)
    store = StateStore(state)
    try:
        visibility.start()
        for publisher in publishers:
            publisher.start()
        started = time.time()
        deployment.start_daemon()
        # Until every stream certified an epoch, the messages wait for the daemon, its first code
        # server and the first ticks: the start-up, reported apart from the running streams' latency.
        deployment.wait_for(
            "every stream's first certificate",
            lambda: all(store.last_certificate(name) is not None for name in names),
            bound=600,
        )
        live = time.time()
        print(f"every stream certified its first epoch {live - started:.1f}s after the daemon started")
        cpu = CpuMeter(deployment)
        cpu.start()
        time.sleep(args.seconds)
        cpu.stopped.set()
        cpu.join()
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
        visibility.stopped.set()
        visibility.join()
        print(visibility.describe(names, publishers, live))
        print_ticks(home, args.interval)
        print(cpu.describe(args.seconds))
        return 0
    finally:
        visibility.stopped.set()
        for publisher in publishers:
            publisher.stopped.set()
        deployment.stop()
        store.close()
        deployment.store.close()


class Visibility(threading.Thread):
    """Reads each destination table's highest id every ``poll`` seconds, noting when each grew."""

    def __init__(self, url: str, tables: list[str], poll: float) -> None:
        super().__init__(daemon=True)
        self.url, self.tables, self.poll = url, tables, poll
        self.stopped = threading.Event()
        self.seen: dict[str, list[tuple[float, int]]] = {table: [] for table in tables}
        """Per table, (when, highest id) each time the highest id grew."""

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            query: str | None = None
            while not self.stopped.wait(self.poll):
                if query is None:
                    made = {row[0] for row in conn.execute("SELECT tablename FROM pg_tables")}
                    if not all(table in made for table in self.tables):
                        continue  # each sink creates its table with its first epoch
                    query = "SELECT " + ", ".join(f'(SELECT max(id) FROM "{t}")' for t in self.tables)
                row = conn.execute(query).fetchone() or ()
                now = time.time()
                for table, highest in zip(self.tables, row, strict=True):
                    marks = self.seen[table]
                    if highest is not None and (not marks or highest > marks[-1][1]):
                        marks.append((now, highest))

    def latencies(self, table: str, sent: dict[int, float]) -> list[tuple[float, int]]:
        """(latency, id) of every message sent that was seen."""
        marks = self.seen[table]
        highs = [high for _, high in marks]
        found = []
        for n, at in sent.items():
            index = bisect.bisect_left(highs, n)
            if index < len(marks):
                found.append((marks[index][0] - at, n))
        return found

    def describe(self, tables: list[str], publishers: list[daemon_test.Publisher], since: float) -> str:
        """The latencies of the messages published once every stream ran (at ``since``), in all and
        per stream, and those of the messages published during the start-up."""
        every: list[float] = []
        with_start_up: list[float] = []
        lines = []
        for table, publisher in zip(tables, publishers, strict=True):
            seen = self.latencies(table, publisher.sent)
            with_start_up += [latency for latency, _ in seen]
            mine = sorted((latency, n) for latency, n in seen if publisher.sent[n] >= since)
            every += [latency for latency, _ in mine]
            _, n = mine[-1]
            at = time.strftime("%H:%M:%S", time.localtime(publisher.sent[n]))
            lines.append(
                f"  {table}: {_percentiles([latency for latency, _ in mine])}; the largest for id {n}, "
                f"published at {at}"
            )
        every.sort()
        with_start_up.sort()
        return "\n".join(
            [
                f"publish to visible once every stream ran, {len(every)} messages (poll {self.poll}s): "
                f"{_percentiles(every)}",
                *lines,
                f"every message, the start-up included ({len(with_start_up)}): {_percentiles(with_start_up)}",
            ]
        )


def _percentiles(ordered: list[float]) -> str:
    if not ordered:
        return "none"
    p50, p95, p99 = (ordered[int(q * (len(ordered) - 1))] for q in (0.5, 0.95, 0.99))
    return f"p50 {p50:.2f}s, p95 {p95:.2f}s, p99 {p99:.2f}s, largest {ordered[-1]:.2f}s"


class CpuMeter(threading.Thread):
    """Samples the CPU time of the daemon and of each of its code servers (they come and go) once a
    second while publishing; ``describe`` sums the last sample of each process."""

    def __init__(self, deployment: daemon_test.Deployment) -> None:
        super().__init__(daemon=True)
        self.deployment = deployment
        self.stopped = threading.Event()
        self.seconds: dict[tuple[int, float], tuple[bool, float]] = {}

    def run(self) -> None:
        assert self.deployment.daemon is not None
        daemon = psutil.Process(self.deployment.daemon.pid)
        while not self.stopped.wait(1.0):
            try:
                processes = [daemon, *daemon.children(recursive=True)]
            except psutil.Error:
                continue  # a child ended while listing them
            for process in processes:
                try:
                    times = process.cpu_times()
                    key = (process.pid, process.create_time())
                except psutil.Error:
                    continue  # it ended between the listing and the sample
                # Once seen as a code server, always one (an exited one's command line is gone).
                server = self.seconds.get(key, (False, 0.0))[0] or daemon_test._is_code_server(process)
                self.seconds[key] = (server, times.user + times.system)

    def describe(self, wall: float) -> str:
        servers = sum(seconds for server, seconds in self.seconds.values() if server)
        others = sum(seconds for server, seconds in self.seconds.values() if not server)
        count = sum(1 for server, _ in self.seconds.values() if server)
        return (
            f"CPU while publishing ({wall:.0f}s): {servers + others:.1f}s, code servers {servers:.1f}s "
            f"({count} processes, {servers / wall:.2f} of a core), the daemon {others:.1f}s "
            f"({others / wall:.2f} of a core)"
        )


Tick = tuple[float, float, str, bool]
"""A tick the daemon recorded: start, end, sensor, whether it started its stream's reader."""


def print_ticks(home: Path, interval: float) -> None:
    """The ticks' durations, per stream its longest tick and longest gap between tick starts, and the
    time beyond the interval, split into the daemon busy with other ticks and the daemon idle."""
    longest_gap = 0.0
    ticks: list[Tick] = []
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for state in instance.all_instigator_state():
            mine = sorted(
                instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=100_000),
                key=lambda t: t.timestamp,
            )
            durations = [t.end_timestamp - t.timestamp for t in mine if t.end_timestamp]
            gaps = [b.timestamp - a.timestamp for a, b in itertools.pairwise(mine)]
            if not durations:
                continue
            ticks.extend(
                (t.timestamp, t.end_timestamp, state.instigator_name, _starts_reader(t.skip_reason))
                for t in mine
                if t.end_timestamp
            )
            longest_gap = max(longest_gap, *gaps, 0.0)
            certified = sum(1 for t in mine if (t.skip_reason or "").startswith("certified "))
            print(
                f"  {state.instigator_name}: {len(mine)} ticks, {certified} certified; longest tick "
                f"{max(durations):.1f}s, longest gap between ticks {max(gaps, default=0.0):.1f}s"
            )
    every = sorted(end - start for start, end, _, _ in ticks)
    others = sorted(end - start for start, end, _, starting in ticks if not starting)
    print(
        f"ticks: {len(every)}, {_spread(every)}; those that did not start a reader: {_spread(others)}; "
        f"longest gap between one stream's ticks {longest_gap:.1f}s"
    )
    print(_lateness(sorted(ticks), interval))


def _starts_reader(reason: str | None) -> bool:
    return (reason or "").startswith("started reading")


def _spread(durations: list[float]) -> str:
    if not durations:
        return "none"
    p50, p95 = (durations[int(q * (len(durations) - 1))] for q in (0.5, 0.95))
    return f"p50 {p50:.2f}s, p95 {p95:.2f}s, longest {durations[-1]:.2f}s"


def _lateness(ticks: list[Tick], interval: float) -> str:
    """Where each gap's time beyond ``interval`` went: the daemon running other sensors' ticks, or idle
    (between its sensor loop's passes); the mean over all gaps and the split of the longest one."""
    rows: list[tuple[float, float, float]] = []
    for name in {tick[2] for tick in ticks}:
        mine = [tick for tick in ticks if tick[2] == name]
        for before, after in itertools.pairwise(mine):
            due, late = before[0] + interval, after[0] - before[0] - interval
            busy = sum(
                max(0.0, min(end, after[0]) - max(start, due))
                for start, end, other, _ in ticks
                if other != name
            )
            rows.append((after[0] - before[0], late, busy))
    if not rows:
        return "beyond the interval: no gaps"
    gap, late, busy = max(rows)
    return (
        f"beyond the interval, mean over {len(rows)} gaps: {statistics.mean(r[1] for r in rows):.1f}s "
        f"({statistics.mean(r[2] for r in rows):.1f}s other ticks, "
        f"{statistics.mean(r[1] - r[2] for r in rows):.1f}s daemon idle); longest gap {gap:.1f}s: "
        f"{late:.1f}s late, {busy:.1f}s other ticks, {late - busy:.1f}s daemon idle"
    )


if __name__ == "__main__":
    sys.exit(main())
