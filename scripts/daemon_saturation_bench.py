"""The saturation rate of the example's streams under ``dagster-daemon run``, over the in-process runner's.

``.venv/bin/python scripts/daemon_saturation_bench.py [--only nats|kafka] [--daemon-step 120]
[--inprocess-step 20] [--start-rate 4000] [--bisections 2] [--keep DIR]``

Starts the test servers (PostgreSQL, NATS, Tansu from their wheels), copies ``example_project/``, and
for each of its two streams (``order_events_nats``: JetStream ``ORDER_EVENTS`` -> PostgreSQL,
``order_events_kafka``: the 4-partition topic ``order_events`` -> PostgreSQL) finds the highest offered
rate (events/s) the stream sustains, first *in-process*, then *under the daemon*, in one run:

- in-process: the example's own sensor definition (``example_project.definitions``, loaded in this
  process), its ticks evaluated back to back (``evaluate_tick``, no daemon, no code server, no
  interval): what faucet's runner and sensor sustain on their own;
- under the daemon: ``dagster-daemon run -m example_project.definitions`` with the daemon's defaults
  (its own code servers, replaced every 60 s; sensors evaluated one at a time) and the example's
  (interval 30 s, the default tick budget, epochs of at most 50,000 records); with ``--code-server
  separate``, the daemon on a ``workspace.yaml`` naming one ``dagster api grpc`` server started
  beforehand (as production deployments run user code: never replaced).

Both phases share one state store (SQLite, ``FAUCET_STATE_URL``) and one destination database, so the
daemon's streams go on from what the in-process ticks certified. A step publishes ``rate`` events/s
for the step's seconds from a publisher subprocess (core NATS publishes, counted as JetStream's last
sequence says they were stored; or a confluent-kafka producer, counted as acknowledged), then waits
until all is certified. *Lag* is published minus certified rows, taken when each certificate was
persisted; a step is *sustained* when the lag's low point (what is left after a tick) in the step's
second half exceeds the one in its first half by at most ``GROWTH_TOLERANCE`` of the offered rate
times the time between them. Rates double from ``--start-rate`` until a step is not sustained, then
``--bisections`` bisections. A step the publisher could not offer (below 95% of its rate) ends the
search: the rate is then a lower bound (printed with ``>=``). At the end, each destination table must
hold every published event exactly once. Prints every step, the ticks the daemon recorded, the
saturation rates, the ratio daemon / in-process per stream, and the load average.
"""

import argparse
import asyncio
import bisect
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import psycopg
import test_daemon_streams as daemon_test
from daemon_streams_bench import print_ticks

from faucet_dagster.state import StateStore
from faucet_dagster.testing import KafkaServer, NatsServer, PostgresServer

ROOT = Path(__file__).resolve().parent.parent
STREAMS = {"nats": "order_events_nats", "kafka": "order_events_kafka"}
"""The example's streams (``defs/streams/defs.yaml``), by source."""
TARGET = 0.8
GROWTH_TOLERANCE = 0.05
"""A sustained step's lag grows by at most this share of the offered rate."""
PUBLISHER_SHORTFALL = 0.95
DRAIN_BOUND = 600.0
SLOT = 0.01
"""Seconds between two rounds of publishes."""
STORED_EVERY = 0.1
"""Seconds between two questions to JetStream for how many events it stored."""
WARM_UP = (200, 5.0)
"""Events/s and seconds published (and certified) before a phase's steps: the stream is ticking."""


@dataclass(frozen=True)
class Step:
    rate: int
    offered: float
    """Events/s the publisher reached."""
    certified: float
    """Events/s certified during the step (from its first to its last certificate)."""
    growth: float | None
    """Events/s the lag's low point grew by (None: a half without a certificate)."""
    max_lag: int
    certificates: int

    @property
    def publisher_bound(self) -> bool:
        return self.offered < PUBLISHER_SHORTFALL * self.rate

    @property
    def sustained(self) -> bool:
        return self.growth is not None and self.growth <= GROWTH_TOLERANCE * self.rate

    def describe(self) -> str:
        growth = "no certificate in a half" if self.growth is None else f"lag growth {self.growth:,.0f}/s"
        verdict = "sustained" if self.sustained else "NOT sustained"
        bound = " (publisher-bound)" if self.publisher_bound else ""
        return (
            f"{self.rate:>7,}/s offered {self.offered:>8,.0f}/s{bound}: certified {self.certified:>8,.0f}/s, "
            f"{growth}, max lag {self.max_lag:,}, {self.certificates} certificates: {verdict}"
        )


class Ledger:
    """One stream's published and certified counts over time (unix seconds)."""

    def __init__(self, store: StateStore, name: str) -> None:
        self.store, self.name = store, name
        self.published = 0
        self.sent = 0
        """Events sent so far: the next one's number (unique over the run, whatever was stored)."""
        self.certified: list[tuple[float, int]] = []  # (persisted at, cumulative rows)
        self._sequence = 0

    def refresh(self) -> int:
        """Read the new certificates; return the rows certified so far."""
        for certificate in self.store.certificates(self.name, after=self._sequence):
            total = (self.certified[-1][1] if self.certified else 0) + sum(certificate.row_counts.values())
            self.certified.append((daemon_test._created(certificate), total))
            self._sequence = certificate.sequence
        return self.certified[-1][1] if self.certified else 0

    def drained(self) -> bool:
        return self.refresh() >= self.published


Advance = Callable[[str, Callable[[], bool], float], object]
"""``advance(what, condition, bound)``: let the stream run until ``condition()`` (fails after ``bound`` s)."""


def run_step(
    ledger: Ledger, source: str, address: str, rate: int, seconds: float, advance: Advance, tmp: Path
) -> Step:
    """Publish ``rate`` events/s for ``seconds`` while ``advance`` runs the stream, then drain it."""
    advance("the stream drained before the step", ledger.drained, DRAIN_BOUND)
    timeline_file = tmp / f"timeline-{source}-{rate}-{time.monotonic_ns()}.txt"
    base, first = ledger.published, ledger.sent
    ledger.sent += int(seconds * rate)
    publisher = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--publish",
            source,
            "--address",
            address,
            "--rate",
            str(rate),
            "--seconds",
            str(seconds),
            "--first",
            str(first),
            "--timeline",
            str(timeline_file),
        ]
    )
    advance("the publisher done", lambda: publisher.poll() is not None, seconds + 120)
    if publisher.returncode != 0:
        raise RuntimeError(f"the {source} publisher failed ({publisher.returncode})")
    timeline = [
        (float(t), base + int(n))
        for t, n in (line.split() for line in timeline_file.read_text().splitlines())
    ]
    ledger.published = timeline[-1][1]
    advance("the step's events certified", ledger.drained, DRAIN_BOUND)
    return measure(ledger, rate, seconds, timeline)


def measure(ledger: Ledger, rate: int, seconds: float, timeline: list[tuple[float, int]]) -> Step:
    """The step's figures from the publisher's timeline and the certificates persisted during it."""
    began, ended = timeline[0][0], timeline[-1][0]
    times = [t for t, _ in timeline]

    def published_at(at: float) -> int:
        index = bisect.bisect_right(times, at) - 1
        return timeline[index][1] if index >= 0 else timeline[0][1]

    samples = [
        (at, published_at(at) - total, total) for at, total in ledger.certified if began <= at <= ended
    ]
    middle = (began + ended) / 2
    first = [s for s in samples if s[0] < middle]
    second = [s for s in samples if s[0] >= middle]
    growth = None
    if first and second:
        low_first, low_second = min(first, key=lambda s: s[1]), min(second, key=lambda s: s[1])
        growth = max(0.0, (low_second[1] - low_first[1]) / max(1.0, low_second[0] - low_first[0]))
    certified = 0.0
    if len(samples) >= 2:
        certified = (samples[-1][2] - samples[0][2]) / max(1e-6, samples[-1][0] - samples[0][0])
    offered = (published_at(began + seconds) - timeline[0][1]) / seconds
    return Step(rate, offered, certified, growth, max((s[1] for s in samples), default=0), len(samples))


def search(step: Callable[[int], Step], start: int, bisections: int) -> tuple[int, bool]:
    """The highest sustained rate: doubling from ``start`` until a step fails, then ``bisections``
    bisections between the last sustained rate (or 0) and the failed one. Returns it and whether it is
    exact (False: the publisher could not offer more, so the rate it offered is a lower bound).
    Doubling up, not halving down: a step far above the saturation leaves a backlog that takes long
    to drain at the saturation rate (minutes under the daemon)."""
    good, bad, rate = 0, 0, start
    while not bad:
        result = step(rate)
        print(f"  {result.describe()}", flush=True)
        if result.publisher_bound:
            return (int(result.offered) if result.sustained else good), False
        if result.sustained:
            good, rate = rate, rate * 2
        else:
            bad = rate
    for _ in range(bisections):
        rate = (good + bad) // 2
        result = step(rate)
        print(f"  {result.describe()}", flush=True)
        if result.sustained and not result.publisher_bound:
            good = rate
        else:
            bad = rate
    return good, True


# -- the publisher (a subprocess: it must not share the in-process runner's interpreter) ----------


def payload(n: int) -> bytes:
    """Event ``n`` as the example publishes them (``event_id`` unique over the run)."""
    return b'{"event_id":"%032x","order_id":%d,"status":"shipped","amount":%d.5}' % (n, n % 7200 + 1, n % 400)


async def publish_nats(args: argparse.Namespace, out: TextIO) -> None:
    """Core publishes to the stream's subject, flushed every ``SLOT`` (nats-py's acknowledged
    publishes top out far below what the stream reads); what counts is what JetStream stored: its
    last sequence, asked every ``STORED_EVERY`` seconds and at the end until it stops moving."""
    import nats
    from example_project.publish import NATS_STREAM, NATS_SUBJECT

    client = await nats.connect([args.address])
    try:
        js = client.jetstream()

        initial = (await js.stream_info(NATS_STREAM)).state.last_seq

        async def stored() -> int:
            count = (await js.stream_info(NATS_STREAM)).state.last_seq - initial
            out.write(f"{time.time()} {count}\n")
            return count

        started, sent, total, asked = time.monotonic(), 0, int(args.seconds * args.rate), 0.0
        await stored()
        while sent < total:
            due = min(total, int((time.monotonic() - started) * args.rate))
            for n in range(sent, due):
                await client.publish(NATS_SUBJECT, payload(args.first + n))
            sent = due
            await client.flush()
            if time.monotonic() - asked >= STORED_EVERY:
                asked = time.monotonic()
                await stored()
            await asyncio.sleep(SLOT)
        last, count = -1, await stored()
        while count != last:
            await asyncio.sleep(0.5)
            last, count = count, await stored()
    finally:
        await client.close()


def publish_kafka(args: argparse.Namespace, out: TextIO) -> None:
    """Produces to the topic (keyed by order, ``linger.ms`` 5); counts what the broker acknowledged."""
    from confluent_kafka import KafkaError, Message, Producer
    from example_project.publish import KAFKA_TOPIC

    delivered, failed = [0], []

    def on_delivery(error: KafkaError | None, _message: Message) -> None:
        if error is None:
            delivered[0] += 1
        else:
            failed.append(error)

    producer = Producer({"bootstrap.servers": args.address, "linger.ms": 5, "on_delivery": on_delivery})
    started, sent, total = time.monotonic(), 0, int(args.seconds * args.rate)
    out.write(f"{time.time()} 0\n")
    while delivered[0] < total:
        due = min(total, int((time.monotonic() - started) * args.rate))
        while sent < due:
            n = args.first + sent
            try:
                producer.produce(KAFKA_TOPIC, key=str(n % 7200 + 1).encode(), value=payload(n))
                sent += 1
            except BufferError:  # the local queue is full: let deliveries drain
                producer.poll(SLOT)
        producer.poll(0)
        out.write(f"{time.time()} {delivered[0]}\n")
        if sent == total:
            producer.flush(SLOT)
        else:
            time.sleep(SLOT)
        if failed or time.monotonic() - started > args.seconds + 60:
            raise SystemExit(f"{len(failed)} events refused, {total - delivered[0]} undelivered")
    out.write(f"{time.time()} {delivered[0]}\n")


def publish(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "example_project"))
    with open(args.timeline, "w") as out:
        if args.publish == "nats":
            asyncio.run(publish_nats(args, out))
        else:
            publish_kafka(args, out)
    return 0


# -- the two phases ----------------------------------------------------------------------------


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def phase(
    name: str,
    ledgers: dict[str, Ledger],
    addresses: dict[str, str],
    tmp: Path,
    advance_for: Callable[[str], Advance],
    args: argparse.Namespace,
    seconds: float,
) -> dict[str, tuple[int, bool]]:
    """Each stream's saturation rate in this phase, in steps of ``seconds``, after a warm-up."""
    found = {}
    for source, ledger in ledgers.items():
        advance = advance_for(source)
        run_step(ledger, source, addresses[source], *WARM_UP, advance, tmp)
        print(f"{name}, {ledger.name} ({seconds:.0f}s steps; {load()}):", flush=True)

        def step(
            rate: int, source: str = source, ledger: Ledger = ledger, advance: Advance = advance
        ) -> Step:
            return run_step(ledger, source, addresses[source], rate, seconds, advance, tmp)

        found[source] = search(step, args.start_rate, args.bisections)
    return found


def in_process_advance(defs: Any, instance: Any) -> Callable[[str], Advance]:
    """Each stream's sensor ticked back to back in this process while a condition waits."""
    import dagster as dg

    cursors: dict[str, str | None] = {}

    def advance_for(source: str) -> Advance:
        sensor = defs.resolve_sensor_def(f"{STREAMS[source]}_stream")

        def advance(what: str, condition: Callable[[], bool], bound: float) -> None:
            ends = time.monotonic() + bound
            while not condition():
                if time.monotonic() > ends:
                    raise RuntimeError(f"{what}: not within {bound:.0f}s")
                context = dg.build_sensor_context(instance=instance, cursor=cursors.get(source))
                cursors[source] = sensor.evaluate_tick(context).cursor

        return advance

    return advance_for


def run(tmp: Path, servers: tuple[PostgresServer, NatsServer, KafkaServer], args: argparse.Namespace) -> int:
    postgres, nats_server, kafka = servers
    copy = tmp / "example_project"
    shutil.copytree(
        ROOT / "example_project",
        copy,
        ignore=shutil.ignore_patterns(".faucet_data", ".dagster_home", "__pycache__", ".mypy_cache"),
    )
    home = tmp / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    database = postgres.create_database("saturation")
    state = f"sqlite:///{tmp / 'state.db'}"
    env = {
        "DAGSTER_HOME": str(home),
        "FAUCET_STATE_URL": state,
        "FAUCET_EXAMPLE_POSTGRES_URL": database,
        "FAUCET_EXAMPLE_NATS_URL": nats_server.url,
        "FAUCET_EXAMPLE_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update(env)
    sys.path.insert(0, str(copy))  # the copy's definitions (its sample data is generated there)
    import dagster as dg
    from example_project.definitions import defs
    from example_project.publish import ensure_kafka_topic
    from example_project.servers import _create_stream

    from faucet_dagster.streams.runner_cache import close_cached_streams

    asyncio.run(_create_stream(nats_server.url))
    ensure_kafka_topic(kafka.bootstrap)
    addresses = {"nats": nats_server.url, "kafka": kafka.bootstrap}
    store = StateStore(state)
    ledgers = {source: Ledger(store, STREAMS[source]) for source in args.only or STREAMS}
    try:
        with dg.instance_for_test() as instance:
            try:
                inside = phase(
                    "in-process",
                    ledgers,
                    addresses,
                    tmp,
                    in_process_advance(defs, instance),
                    args,
                    args.inprocess_step,
                )
            finally:
                close_cached_streams()  # releases the leases: the daemon's code servers take over
        deployment = daemon_test.Deployment(
            copy, {**os.environ, "T_STATE": state, "T_STREAM": STREAMS["nats"]}
        )
        try:
            target = ("-m", "example_project.definitions", "-d", str(copy))
            if args.code_server == "separate":
                deployment.start_daemon_on_code_server("example", *target)
            else:
                deployment.start_daemon(*target)
            daemon = phase(
                f"dagster-daemon run ({args.code_server} code server)",
                ledgers,
                addresses,
                tmp,
                lambda _source: deployment.wait_for,
                args,
                args.daemon_step,
            )
        finally:
            deployment.stop()
            deployment.store.close()
        print_ticks(home)
        with psycopg.connect(database) as conn:
            for ledger in ledgers.values():
                [(rows, distinct)] = conn.execute(
                    f"SELECT count(*), count(DISTINCT event_id) FROM {ledger.name}"
                ).fetchall()
                if not rows == distinct == ledger.published:
                    raise RuntimeError(
                        f"{ledger.name}: {rows} rows ({distinct} distinct), {ledger.published} published"
                    )
                print(f"{ledger.name}: {rows:,} events, each exactly once")
        for source, ledger in ledgers.items():
            (a, a_exact), (b, b_exact) = inside[source], daemon[source]
            print(
                f"saturation {ledger.name}: in-process {'' if a_exact else '>='}{a:,}/s, dagster-daemon "
                f"{'' if b_exact else '>='}{b:,}/s: {b / max(1, a):.2f}x (target {TARGET}x); {load()}"
            )
        return 0
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(STREAMS), action="append", help="one stream (repeatable)")
    parser.add_argument("--daemon-step", type=float, default=120, help="seconds a step under the daemon")
    parser.add_argument("--inprocess-step", type=float, default=20, help="seconds an in-process step")
    parser.add_argument("--start-rate", type=int, default=4000, help="events/s of the first in-process step")
    parser.add_argument("--bisections", type=int, default=2)
    parser.add_argument(
        "--code-server",
        choices=("daemon", "separate"),
        default="daemon",
        help="daemon: the daemon's own code servers (replaced every 60 s); separate: one `dagster api "
        "grpc` server named in workspace.yaml, as production deployments run it",
    )
    parser.add_argument("--keep", type=Path, default=None, help="a directory to keep the logs in")
    for hidden in ("--publish", "--address", "--timeline"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publish:
        return publish(args)
    servers = (
        PostgresServer.from_env().start(),
        NatsServer.from_env().start(),
        KafkaServer.from_env().start(),
    )
    try:
        if args.keep is not None:
            args.keep.mkdir(parents=True)
            return run(args.keep.resolve(), servers, args)
        with tempfile.TemporaryDirectory(prefix="faucet-saturation-") as tmp:
            return run(Path(tmp), servers, args)
    finally:
        for server in reversed(servers):
            server.close()


if __name__ == "__main__":
    sys.exit(main())
