"""Reproduce issue 32's stop and exit cases as the issue describes them, under a real ``dagster-daemon run``.

``.venv/bin/python scripts/stops_under_daemon.py [--cases stop,exit,exit-10s] [--stop-seconds 200]
[--freeze-seconds 30] [--rate 100] [--run-seconds 60] [--keep DIR]``

Starts the test servers (a Kafka-protocol broker and NATS JetStream, from their wheels) and, per case,
a Kafka -> NATS stream in its own code location: one ``dagster api grpc`` code server named by a
``workspace.yaml`` and ``dagster-daemon run -w workspace.yaml``, the stream's defaults everywhere
(sensor interval, budget, epochs, lease, the process's exit and idle clocks; the NATS sink's duplicate
window unless the case names one). A producer writes numbered records (``{"id": n}``) to the topic
throughout; the fault comes after ``--run-seconds`` of certificates, and ``--run-seconds`` of
production follow the recovery. Then the producer stops, the script waits until everything is
certified and counts every id at the NATS destination: lost = produced ids missing, duplicated =
copies beyond the first.

* ``stop``: ``dagster sensor stop`` (the CLI, against the daemon's instance) for ``--stop-seconds``
  with the default 120 s window, then ``dagster sensor start``. Nothing may be duplicated: a stopped
  sensor is none of the paths ``faucet plan`` says can duplicate. ``stop-own-servers``: the same with
  ``dagster-daemon run -f streams.py`` (the daemon's own code servers, replaced every 60 s).
* ``exit`` (default window) and ``exit-10s`` (a 10 s window): the NATS server is frozen (SIGSTOP) the
  moment the destination grows (an epoch's publishes arriving), the code server stopped (SIGTERM, as a
  redeploy does) and a new one started (as a supervisor does), the server continued (SIGCONT)
  ``--freeze-seconds`` after the freeze. An exit that found nothing in flight is rightly clean (the new
  server takes over by itself); the case tries again, up to ``EXIT_ATTEMPTS`` exits. The uncertain
  exit must leave the stream uncertain; the new code server must certify nothing until ``faucet streams
  release`` and its ticks must say the stream is halted, naming that remedy; then the stream resumes.
  The plan allows duplicates here only for the work the exit left published and uncertified, replayed
  later than the window after its first publish (``faucet plan``: "an uncertain close ... replayed more
  than the window after its first publish, when the stream resumes (an operator's release) that
  late"): a second copy under the same ``Nats-Msg-Id`` of such a message is counted as "planned"
  (the destination drops one within the window); the case fails on any other duplicate.

Prints one table row per case and exits 1 if any case lost a record, duplicated beyond the plan or
missed what it checks (the uncertain mark, the blocked takeover, the halted ticks).
"""

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import nats
import test_daemon_streams as daemon_test
import test_stream_stops as stops_test
from confluent_kafka import Consumer, TopicPartition
from daemon_streams_bench import recorded_ticks, said
from dagster._core.scheduler.instigation import InstigatorTick
from kafka_topics import create_topic
from stream_ticks import stored_messages

from faucet_dagster.testing import KafkaServer, NatsServer, make_unique_name
from faucet_dagster.testing.faults.oracle import covered
from faucet_dagster.testing.faults.sides import Produced

PARTITIONS = 4
EXIT_ATTEMPTS = 5
"""Exits an ``exit`` case tries until one finds publishes in flight (the others are clean exits)."""
BOUND = 600.0
"""The bound of every wait on the deployment (generous: a loaded machine, the default 30 s interval)."""

PROJECT = """
import os

import dagster as dg

from faucet_dagster import FaucetStream, build_stream_defs
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint

target = os.environ["T_TARGET"]
sink = {"servers": [os.environ["T_NATS"]], "stream": target, "subject": f"{target}.rows"}
if os.environ.get("T_WINDOW"):
    sink["duplicate_window"] = float(os.environ["T_WINDOW"])
stream = FaucetStream(
    name=os.environ["T_STREAM"],
    source=FaucetEndpoint(
        FaucetConnection(
            connector="kafka",
            config={
                "bootstrap_servers": os.environ["T_KAFKA"],
                "topics": [os.environ["T_TOPIC"]],
                "group_id": os.environ["T_GROUP"],
            },
        )
    ),
    sink=FaucetEndpoint(FaucetConnection(connector="nats", config=sink)),
    resources=(os.environ["T_TOPIC"],),
    state_url=os.environ["T_STATE"],
)
defs = build_stream_defs([stream], default_status=dg.DefaultSensorStatus.RUNNING)
"""


@dataclass(frozen=True)
class Result:
    """One case's row of the table."""

    case: str
    window: float
    fault_seconds: float
    sent: int
    stored: int
    lost: int
    duplicated: int
    planned: int
    ticks: str
    checks_failed: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.lost and self.duplicated <= self.planned and not self.checks_failed

    def row(self) -> str:
        verdict = "yes" if self.passed else "NO: " + "; ".join(self.checks_failed or ("lost or duplicated",))
        return (
            f"| {self.case} | {self.window:g}s | {self.fault_seconds:.0f}s | {self.sent} | {self.stored} | "
            f"{self.lost} | {self.duplicated} | {self.planned} | {self.ticks} | {verdict} |"
        )


HEADER = (
    "| case | window | stop/freeze | sent | stored | lost | duplicated | planned | ticks | passed |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"
)


@dataclass
class Case:
    """One case's deployment: its names, its directory, its daemon and code server."""

    name: str
    window: float | None
    dir: Path
    kafka: KafkaServer
    nats: NatsServer
    args: argparse.Namespace
    own_servers: bool

    def __post_init__(self) -> None:
        self.stream = make_unique_name(self.name.replace("-", "_"))
        self.topic, self.target = f"{self.stream}_in", f"{self.stream}_out"
        self.state_url = f"sqlite:///{self.dir / 'state.db'}"
        create_topic(self.kafka.bootstrap, self.topic, PARTITIONS)
        stops_test.create_target(self.nats.url, self.target, self.window or 120.0)  # NATS's default: 2 min
        (self.dir / "streams.py").write_text(textwrap.dedent(PROJECT))
        (self.dir / "dagster_home").mkdir()
        env = {
            **os.environ,
            "DAGSTER_HOME": str(self.dir / "dagster_home"),
            "T_STREAM": self.stream,
            "T_KAFKA": self.kafka.bootstrap,
            "T_TOPIC": self.topic,
            "T_GROUP": f"{self.stream}_group",
            "T_NATS": self.nats.url,
            "T_TARGET": self.target,
            "T_STATE": self.state_url,
            "PYTHONUNBUFFERED": "1",
        }
        if self.window is not None:
            env["T_WINDOW"] = str(self.window)
        self.deployment = daemon_test.Deployment(self.dir, env)
        self.store = self.deployment.store
        self.failed: list[str] = []

    @property
    def sensor(self) -> str:
        return f"{self.stream}_stream"

    def plan(self) -> dict[str, Any]:
        """What ``faucet plan`` states for this pair, with the configs the code location uses."""
        source = {"bootstrap_servers": self.kafka.bootstrap, "topics": [self.topic], "group_id": "g"}
        sink: dict[str, Any] = {
            "servers": [self.nats.url],
            "stream": self.target,
            "subject": f"{self.target}.rows",
        }
        if self.window is not None:
            sink["duplicate_window"] = self.window
        (self.dir / "source.json").write_text(json.dumps(source))
        (self.dir / "sink.json").write_text(json.dumps(sink))
        answer = self.cli(
            "faucet", "plan", "--source", "kafka", "--sink", "nats", "--mode", "continuous",
            "--policy", "append", "--source-config", "source.json", "--sink-config", "sink.json", "--json",
        )  # fmt: skip
        plan: dict[str, Any] = json.loads(answer)["plan"]
        return plan

    def cli(self, command: str, *args: str) -> str:
        """Run an installed command (``dagster``, ``faucet``) in the deployment's directory and
        environment (its instance); its output. Fails naming the command if it fails."""
        done = subprocess.run(
            [str(Path(sys.executable).parent / command), *args],
            cwd=self.dir,
            env=self.deployment.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, (
            f"{command} {' '.join(args)}: exit {done.returncode}: {done.stderr[-2000:]}"
        )
        return done.stdout

    @property
    def location(self) -> tuple[str, ...]:
        """Where the ``dagster`` CLI finds the code location: where the daemon finds it."""
        return ("-f", "streams.py") if self.own_servers else ("-w", "workspace.yaml")

    def start(self) -> tuple["subprocess.Popen[bytes] | None", int]:
        """The code server (none: the daemon's own) and the daemon; returns once the stream certified
        for ``--run-seconds``."""
        server: subprocess.Popen[bytes] | None = None
        port = 0
        if self.own_servers:
            self.deployment.start_daemon()
        else:
            server, port = self.deployment.start_daemon_on_code_server()
        self.deployment.wait_for("a first certificate", lambda: bool(self.deployment.certificates()), BOUND)
        time.sleep(self.args.run_seconds)
        return server, port

    def certified_after(self, moment: float) -> list[Any]:
        return [c for c in self.deployment.certificates() if daemon_test._created(c) > moment]

    def ticks(self, since: float, until: float | None = None) -> list[InstigatorTick]:
        found = recorded_ticks(self.deployment.dir / "dagster_home").get(self.sensor, [])
        return [t for t in found if since <= t.timestamp <= (until or float("inf"))]

    def check(self, holds: bool, what: str) -> None:
        if not holds:
            self.failed.append(what)

    def finish(self, producer: stops_test.Producer) -> tuple[int, list[tuple[int, dict[str, Any], str]]]:
        """Stop producing, wait until everything is certified; what was produced and the destination's
        messages."""
        producer.stop()
        self.deployment.wait_for(
            "everything certified",
            lambda: stops_test.certified(self.store, self.stream) >= producer.produced,
            BOUND,
        )
        return producer.produced, asyncio.run(stored_messages(self.nats.url, self.target))

    def result(
        self,
        fault_seconds: float,
        sent: int,
        messages: list[tuple[int, dict[str, Any], str]],
        planned: int,
        ticks: str,
    ) -> Result:
        counts = Counter(int(payload["id"]) for _, payload, _ in messages)
        return Result(
            case=self.name,
            window=self.window or 120.0,
            fault_seconds=fault_seconds,
            sent=sent,
            stored=len(messages),
            lost=len(set(range(sent)) - counts.keys()),
            duplicated=sum(n - 1 for n in counts.values()),
            planned=planned,
            ticks=ticks,
            checks_failed=tuple(self.failed),
        )


def stop_case(case: Case) -> Result:
    """The sensor stopped with ``dagster sensor stop`` for ``--stop-seconds``, then started again."""
    with stops_test.Producer(case.kafka.bootstrap, case.topic, case.args.rate) as producer:
        case.start()
        stopping = time.time()
        case.cli("dagster", "sensor", "stop", case.sensor, *case.location)
        stopped = time.time()  # the command returned: the daemon ticks the sensor no more
        # The reader stops on its own (no tick for its idle time), sealing what it holds.
        idle = case.deployment.wait_for(
            "the reader stopped",
            lambda: case.store.status(case.stream)[0].owner is None,
            case.args.stop_seconds,
        )
        sealed = case.certified_after(stopped)
        time.sleep(max(0.0, stopping + case.args.stop_seconds - time.time()))
        started = time.time()  # the daemon may tick before the command returns
        case.cli("dagster", "sensor", "start", case.sensor, *case.location)
        case.deployment.wait_for("certified again", lambda: bool(case.certified_after(started)), BOUND)
        time.sleep(case.args.run_seconds)
    sent, messages = case.finish(producer)
    while_stopped = case.ticks(stopped, started)
    case.check(not while_stopped, f"{len(while_stopped)} ticks while the sensor was stopped")
    after = case.ticks(started)
    ticks = (
        f"{len(while_stopped)} ticks while stopped; the reader stopped {idle - stopped:.0f}s after the stop, "
        f"sealing {len(sealed)} epochs ({sum(sum(c.row_counts.values()) for c in sealed)} records); "
        f"first tick after the start: {said(after[0])[:80] if after else 'none'}"
    )
    return case.result(started - stopping, sent, messages, 0, ticks)


def exit_case(case: Case) -> Result:
    """An exit of the code server with the NATS server frozen, a new code server, the release."""
    with stops_test.Producer(case.kafka.bootstrap, case.topic, case.args.rate) as producer:
        server, port = case.start()
        assert server is not None
        most = case.args.freeze_seconds + BOUND
        attempt = 0
        while attempt < EXIT_ATTEMPTS:
            attempt += 1
            with contextlib.ExitStack() as freeze:
                # The server stops the moment an epoch's publishes arrive, so some may be in flight:
                # at the default batch size an epoch publishes at its seal, in a burst, and a freeze
                # at a random moment almost always finds nothing in flight.
                asyncio.run(
                    freeze_on_growth(
                        case.nats.url,
                        case.target,
                        lambda: freeze.enter_context(case.nats.frozen(at_most=most)),
                    )
                )
                frozen = time.time()
                time.sleep(2.0)  # the exiting process's commit waits for acknowledgements that do not come
                server.send_signal(signal.SIGTERM)
                code = server.wait(BOUND)
                exited = time.time()
                status = case.store.status(case.stream)[0]
                server = case.deployment.start_code_server(port)
                if status.uncertain:
                    time.sleep(max(0.0, frozen + case.args.freeze_seconds - time.time()))
            if status.uncertain:
                break

            # Nothing was in flight: the exit was rightly clean, and the new code server takes the
            # stream over by itself. Again, until a freeze finds publishes in flight.
            def taken_over(since: float = exited) -> bool:
                return bool(case.certified_after(since))

            case.deployment.wait_for("taken over", taken_over, BOUND)
        case.check(status.uncertain, f"{EXIT_ATTEMPTS} exits (the last: code {code}) found nothing in flight")
        thawed = time.time()
        halted: list[InstigatorTick] = []
        if status.uncertain:

            def says_halted() -> bool:
                halted[:] = [t for t in case.ticks(thawed) if said(t).startswith("halted since ")]
                return bool(halted)

            case.deployment.wait_for("a tick saying halted", says_halted, BOUND)
            case.check("faucet streams release" in said(halted[-1]), f"no remedy named: {said(halted[-1])}")
        blocked = case.certified_after(exited)
        before_release = asyncio.run(last_sequence(case.nats.url, case.target))
        certified_at_release = case.deployment.certificates()
        if status.uncertain:  # an operator's release; a stream not uncertain is taken over freely
            case.check(not blocked, f"{len(blocked)} epochs certified by a takeover before the release")
            case.cli("faucet", "streams", "release", case.stream, "--state-url", case.state_url)
        released = time.time()
        case.deployment.wait_for(
            "certified after the release", lambda: bool(case.certified_after(released)), BOUND
        )
        time.sleep(case.args.run_seconds)
    sent, messages = case.finish(producer)
    # What the plan allows: the work the uncertain exit left published and uncertified, stored again
    # by the replay after the release. The destination drops a copy whose Nats-Msg-Id it stored within
    # the window, so a second copy under the same id is a replay later than the window (the plan's
    # "when the stream resumes that late"); one under another id never is.
    planned = 0
    if status.uncertain:
        certified = {
            n for _, n in covered(certified_at_release, kafka_records(case.kafka.bootstrap, case.topic))
        }
        uncertified = {
            int(payload["id"]) for seq, payload, _ in messages if seq <= before_release
        } - certified
        counts = Counter(int(payload["id"]) for _, payload, _ in messages)
        identities: dict[int, set[str]] = {}
        for _, payload, identity in messages:
            identities.setdefault(int(payload["id"]), set()).add(identity)
        planned = sum(counts[n] - 1 for n in uncertified if len(identities[n]) == 1)
    blocked_ticks = case.ticks(exited, released)
    halted_ticks = [t for t in blocked_ticks if said(t).startswith("halted since ")]
    # The first tick that did not say halted: one begun before the release returned may say it still.
    after = [t for t in case.ticks(released) if not said(t).startswith("halted since ")]
    ticks = (
        f"uncertain at exit: {'yes' if status.uncertain else 'NO'} (exit {attempt}); {len(halted_ticks)} of "
        f"{len(blocked_ticks)} ticks before the release said halted "
        f"({said(halted[-1])[:60] + '...' if halted else '-'}); {len(blocked)} certified before the release; "
        f"released {released - thawed:.0f}s after the thaw; first tick after not halted: "
        f"{said(after[0])[:60] if after else 'none'}"
    )
    return case.result(thawed - frozen, sent, messages, planned, ticks)


async def freeze_on_growth(url: str, stream: str, freeze: Callable[[], object]) -> None:
    """Call ``freeze`` as soon as JetStream ``stream`` stores a new message."""
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        first = (await js.stream_info(stream)).state.last_seq
        ends = time.monotonic() + BOUND
        while (await js.stream_info(stream)).state.last_seq == first:
            assert time.monotonic() < ends, f"nothing published to {stream} within {BOUND:.0f}s"
        freeze()
    finally:  # the server may be frozen now: the client's goodbye is not waited for
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 1.0)


async def last_sequence(url: str, stream: str) -> int:
    client = await nats.connect(url)
    try:
        return int((await client.jetstream().stream_info(stream)).state.last_seq)
    finally:
        await client.close()


def kafka_records(bootstrap: str, topic: str) -> list[Produced]:
    """Every record of ``topic``, keyed by its id, with its partition and offset."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": make_unique_name("readback")})
    try:
        parts = [TopicPartition(topic, p, 0) for p in range(PARTITIONS)]
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=30)[1] for tp in parts}
        consumer.assign(parts)
        found: dict[tuple[int, int], Produced] = {}  # a record fetched twice counts once
        deadline = time.monotonic() + BOUND
        while len(found) < sum(ends.values()) and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=1):
                assert message.error() is None, message.error()
                partition, offset = message.partition(), message.offset()
                assert partition is not None and offset is not None
                if offset < ends[partition]:
                    number = int(json.loads(message.value() or b"")["id"])
                    found[partition, offset] = Produced("p", number, topic, str(partition), offset)
        assert len(found) == sum(ends.values()), f"read {len(found)} of {sum(ends.values())} records back"
        return list(found.values())
    finally:
        consumer.close()


CASES: dict[str, tuple[float | None, bool, Callable[[Case], Result]]] = {
    "stop": (None, False, stop_case),
    "stop-own-servers": (None, True, stop_case),
    "exit": (None, False, exit_case),
    "exit-10s": (10.0, False, exit_case),
}


@contextlib.contextmanager
def directory(keep: Path | None, name: str) -> Iterator[Path]:
    if keep is not None:
        (keep / name).mkdir(parents=True)
        yield keep / name
        return
    with tempfile.TemporaryDirectory(prefix=f"faucet-{name}-") as tmp:
        yield Path(tmp)


def run_case(name: str, kafka: KafkaServer, nats_server: NatsServer, args: argparse.Namespace) -> Result:
    window, own_servers, run = CASES[name]
    with directory(args.keep, name) as tmp:
        case = Case(name, window, tmp, kafka, nats_server, args, own_servers)
        plan = case.plan()
        print(f"{name}: faucet plan: {plan['delivery']}; {'; '.join(plan['reasons'])}", flush=True)
        try:
            return run(case)
        except AssertionError as exc:  # a wait that timed out, a command that failed: the case fails
            print(f"{name}: {exc}", flush=True)
            return Result(name, window or 120.0, 0, 0, 0, 0, 0, 0, "-", (str(exc).splitlines()[0],))
        finally:
            case.deployment.stop()
            case.store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--stop-seconds", type=float, default=200.0, help="how long the sensor is stopped")
    parser.add_argument("--freeze-seconds", type=float, default=30.0, help="how long NATS is frozen")
    parser.add_argument("--rate", type=int, default=100, help="records produced per second")
    parser.add_argument("--run-seconds", type=float, default=60.0, help="running before and after the fault")
    parser.add_argument("--keep", type=Path, default=None, help="a directory to keep the logs in")
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = set(names) - CASES.keys()
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    with contextlib.ExitStack() as servers:
        kafka = KafkaServer.from_env().start()
        servers.callback(kafka.close)
        nats_server = NatsServer.from_env().start()
        servers.callback(nats_server.close)
        results = []
        for name in names:
            results.append(run_case(name, kafka, nats_server, args))
            print(results[-1].row(), flush=True)
    print(f"\n{HEADER}")
    for result in results:
        print(result.row())
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
