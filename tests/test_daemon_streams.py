"""A NATS -> PostgreSQL stream under a real ``dagster-daemon run``, through code-server kills and a
daemon kill: nothing lost, nothing duplicated, and certificates again within 30 s of each kill.

The code location is a small file (``streams.py`` below) with one stream whose sensor runs by default;
the daemon is started as a user starts it (``dagster-daemon run -f streams.py`` with its own code
servers, which it replaces every 60 s). A publisher thread sends a steady flow of numbered messages;
the state store (SQLite) holds the certificates, the destination table the rows. What the test
measured (the gaps between certificates, publish -> certified latency) is printed (``pytest -s``).

"Within 30 s" is counted from when a code server is there to tick again (it has loaded the
definitions: the project writes a marker then; a separate server listens then): after a kill -9 the
daemon gives its location a new code server only at its next workspace refresh (up to 60 s), a code
server's start-up takes what a loaded machine makes it take, and a new daemon takes its own time to
start; these delays are Dagster's and are printed beside ours.
"""

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import nats
import psutil
import psycopg
import pytest

from faucet_dagster.protocol import EpochCertificate
from faucet_dagster.state import StateStore

RATE = 50
"""Messages published per second."""
CERTIFIED_AGAIN = 30.0
"""Seconds within which a certificate follows each kill (once a code server is up to tick)."""
BOUND = 120.0
"""Generous bound for waiting on any condition (a loaded machine)."""

PROJECT = """
import os
import pathlib
import time

import dagster as dg

from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster import FaucetStream, build_stream_defs

stream = FaucetStream(
    name=os.environ["T_STREAM"],
    source=FaucetEndpoint(
        FaucetConnection(
            connector="nats",
            config={
                "servers": [os.environ["T_NATS"]],
                "stream": os.environ["T_STREAM"],
                "columns": {"id": "int64 not null", "name": "string"},
            },
        )
    ),
    sink=FaucetEndpoint(
        FaucetConnection(connector="postgres", config={"url": os.environ["T_POSTGRES"], "table": "events"})
    ),
    resources=(os.environ["T_STREAM"],),
    state_url=os.environ["T_STATE"],
)
defs = build_stream_defs(
    [stream], minimum_interval_seconds=5, default_status=dg.DefaultSensorStatus.RUNNING
)
if os.environ.get("T_LOADED"):  # when this process (a code server) has its definitions
    pathlib.Path(os.environ["T_LOADED"], str(os.getpid())).write_text(repr(time.time()))
"""


class Publisher(threading.Thread):
    """Publishes ``{"id": n}`` at ``RATE`` per second until stopped; records when each was stored."""

    def __init__(self, url: str, stream: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.sent: dict[int, float] = {}
        self.stopped = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._publish())
        except BaseException as exc:  # noqa: BLE001 - reported by the test (finish)
            self.error = exc

    async def _publish(self) -> None:
        client = await nats.connect(self.url)
        try:
            js = client.jetstream()
            await js.add_stream(name=self.stream, subjects=[f"{self.stream}.>"])
            n = 0
            started = time.monotonic()
            while not self.stopped.is_set():
                ack = await js.publish(f"{self.stream}.rows", json.dumps({"id": n, "name": f"r{n}"}).encode())
                assert ack.seq == n + 1  # the stream sequence is the id plus one
                self.sent[n] = time.time()
                n += 1
                await asyncio.sleep(max(0.0, started + n / RATE - time.monotonic()))
        finally:
            await client.close()


class Deployment:
    """The daemon, its environment and what the test observes."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.dir = tmp_path
        self.env = env
        self.daemon: subprocess.Popen[bytes] | None = None
        self.servers: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.store = StateStore(env["T_STATE"])
        self.stream = env["T_STREAM"]

    def start_daemon(self, *target: str) -> None:
        """``dagster-daemon run`` on ``target`` (default: ``-f streams.py``, its own code servers)."""
        self.daemon = self._start("daemon", "dagster-daemon", "run", *(target or ("-f", "streams.py")))

    def start_daemon_on_code_server(
        self, location: str = "streams", *target: str
    ) -> tuple[subprocess.Popen[bytes], int]:
        """One separate code server on ``target`` (default: ``-f streams.py``) on a free port, named in a
        ``workspace.yaml`` as location ``location``, then ``dagster-daemon run -w workspace.yaml``: the
        daemon ticks on that server and never replaces it. Returns the server and its port."""
        with socket.socket() as probe:
            probe.bind(("localhost", 0))
            port = probe.getsockname()[1]
        (self.dir / "workspace.yaml").write_text(
            f"load_from:\n  - grpc_server: {{host: localhost, port: {port}, location_name: {location}}}\n"
        )
        server = self.start_code_server(port, *target)
        self.start_daemon("-w", "workspace.yaml")
        return server, port

    def start_code_server(self, port: int, *target: str) -> subprocess.Popen[bytes]:
        """One separate code server on ``target`` (default: ``-f streams.py``), as production deployments
        run it; returns once it accepts connections."""
        where = target or ("-f", "streams.py")
        server = self._start("server", "dagster", "api", "grpc", *where, "-p", str(port))
        self.servers.append(server)

        def listening() -> bool:
            assert server.poll() is None, f"the code server exited: {self.tail()}"
            try:
                socket.create_connection(("localhost", port), timeout=1).close()
            except OSError:
                return False
            return True

        self.wait_for("the code server listening", listening)
        return server

    def _start(self, name: str, command: str, *args: str) -> subprocess.Popen[bytes]:
        log = self.dir / f"{name}{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    DEFAULT_SIGNALS_THEN_EXEC,
                    str(Path(sys.executable).parent / command),
                    *args,
                ],
                cwd=self.dir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def code_servers(self) -> list[psutil.Process]:
        """The live code servers of the current daemon, oldest first."""
        assert self.daemon is not None
        children = psutil.Process(self.daemon.pid).children(recursive=True)
        servers = [p for p in children if _is_code_server(p)]
        return sorted(servers, key=lambda p: p.create_time())

    def loaded(self) -> dict[int, float]:
        """The processes that loaded the definitions so far (code servers), by pid: when."""
        folder = Path(self.env["T_LOADED"])
        return {int(marker.name): float(marker.read_text() or "0") for marker in folder.iterdir()}

    def definitions_loaded(self, known: set[int]) -> float:
        """When a code server not in ``known`` (pids) had loaded its definitions (waits for it): from
        then on it is there to tick, whatever a loaded machine made its start-up cost."""
        found: list[float] = []

        def new() -> bool:
            found[:] = [at for pid, at in self.loaded().items() if pid not in known and at]
            return bool(found)

        self.wait_for("a new code server with its definitions loaded", new)
        return min(found)

    def certificates(self) -> list[EpochCertificate]:
        return self.store.certificates(self.stream)

    def wait_for(self, what: str, condition: Callable[[], bool], bound: float = BOUND) -> float:
        """Wait until ``condition()``; returns when (time.time()); fails naming ``what`` after ``bound``."""
        ends = time.monotonic() + bound
        while not condition():
            assert self.daemon is None or self.daemon.poll() is None, f"the daemon exited: {self.tail()}"
            assert time.monotonic() < ends, f"{what}: not within {bound:.0f}s\n{self.tail()}"
            time.sleep(0.2)
        return time.time()

    def workers(self) -> set[str]:
        """The workers that certified epochs so far."""
        return {c.worker for c in self.certificates()}

    def certified_by_a_new_worker(self, before: set[str]) -> float:
        """When the first certificate of a worker not in ``before`` was persisted: the process that
        took the stream over (waits for it)."""
        found: list[float] = []

        def newer() -> bool:
            found[:] = [_created(c) for c in self.certificates() if c.worker not in before]
            return bool(found)

        self.wait_for("a certificate of the worker that took over", newer)
        return min(found)

    def tail(self) -> str:
        return "\n".join(f"{log.name}: {log.read_text(errors='replace')[-3000:]}" for log in self.logs[-2:])

    def stop(self) -> None:
        """SIGTERM to the daemon, then to the separate code servers (each given a minute). The daemon's
        own code servers stop after it, on their own: a wait after this one does not ask the daemon
        to be alive."""
        for process in [self.daemon, *self.servers]:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        self.daemon = None

    def finish(self, publisher: "Publisher", postgres_url: str, figures: str) -> None:
        """Stop publishing, wait until everything is certified, stop the deployment (SIGTERM), and
        check: the lease released, every published message in the destination exactly once. Prints
        ``figures`` with the gaps between certificates and the publish -> certified latency."""
        publisher.stopped.set()
        publisher.join(30)
        assert publisher.error is None, publisher.error
        last = max(publisher.sent)

        def all_certified() -> bool:
            certificates = self.certificates()
            return bool(certificates) and int(certificates[-1].coverage[-1].end) >= last + 1

        self.wait_for("every published message certified", all_certified)
        self.stop()
        self.wait_for("the lease released", lambda: self.store.status(self.stream)[0].owner is None, bound=60)

        with psycopg.connect(postgres_url) as conn:
            ids = [row[0] for row in conn.execute("SELECT id FROM events")]
        assert len(ids) == len(set(ids)), "duplicates in the destination"
        assert sorted(ids) == list(range(last + 1)), "messages lost"

        certificates = self.certificates()
        times = [_created(c) for c in certificates]
        gaps = sorted((b - a for a, b in itertools.pairwise(times)), reverse=True)
        ends = [(int(c.coverage[-1].end), _created(c)) for c in certificates]
        latencies = sorted(
            next(at for end, at in ends if end >= n + 1) - sent for n, sent in publisher.sent.items()
        )
        p50, p95 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.95)]
        print(
            f"\n{figures}; {len(ids)} messages, {len(certificates)} certificates; longest gaps "
            f"{[round(g, 1) for g in gaps[:5]]} s; latency p50 {p50:.1f} s, p95 {p95:.1f} s, "
            f"max {latencies[-1]:.1f} s"
        )


DEFAULT_SIGNALS_THEN_EXEC = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_SETMASK, [])
for number in (signal.SIGINT, signal.SIGTERM):
    signal.signal(number, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])
"""
"""Run ``argv[1:]`` with every signal unblocked and SIGINT/SIGTERM at their defaults, as a supervisor
starts a code server, whatever the test process inherited or set (a blocked or ignored SIGTERM would
make a redeploy's SIGTERM do nothing). A wrapper that execs, not ``preexec_fn``: that runs Python in
a child forked from a process with threads (the publisher), where it can deadlock before the exec."""


def _is_code_server(process: psutil.Process) -> bool:
    try:
        line = process.cmdline()
    except psutil.Error:
        return False
    return "api" in line and "grpc" in line


def _created(certificate: EpochCertificate) -> float:
    return datetime.fromisoformat(certificate.created_at).timestamp()


@pytest.fixture
def deployment(
    tmp_path: Path, nats_url: str, postgres_url: str, unique_name: Callable[..., str]
) -> Iterator[Deployment]:
    (tmp_path / "streams.py").write_text(textwrap.dedent(PROJECT))
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "T_STREAM": unique_name("d"),
        "T_NATS": nats_url,
        "T_POSTGRES": postgres_url,
        "T_STATE": f"sqlite:///{tmp_path / 'state.db'}",
        "T_LOADED": str(tmp_path / "loaded"),
        "PYTHONUNBUFFERED": "1",
    }
    (tmp_path / "loaded").mkdir()
    made = Deployment(tmp_path, env)
    try:
        yield made
    finally:
        made.stop()
        for server in psutil.process_iter():
            if _is_code_server(server) and str(tmp_path) in " ".join(server.cmdline()):
                server.kill()
        made.store.close()


def test_a_stream_under_the_daemon_survives_code_server_replacements_and_kills(
    deployment: Deployment, nats_url: str, postgres_url: str
) -> None:
    publisher = Publisher(nats_url, deployment.stream)
    publisher.start()
    deployment.start_daemon()
    deployment.wait_for("a first certificate", lambda: bool(deployment.certificates()))

    # No fault: the daemon replaces its live code server (every 60 s); the old one lives on for its
    # heartbeat TTL (20 s) and hands the stream over when the new one asks.
    known, before = set(deployment.loaded()), deployment.workers()
    replaced = deployment.definitions_loaded(known)
    handover_gap = deployment.certified_by_a_new_worker(before) - replaced
    assert handover_gap <= CERTIFIED_AGAIN, f"certified {handover_gap:.1f}s after the replacement"

    # kill -9 of the code server: the daemon gives the location a new one at its next workspace
    # refresh (up to 60 s later, Dagster's own delay); that one takes the stream over once the dead
    # holder's lease (15 s) has expired.
    victim, before, known = deployment.code_servers()[-1], deployment.workers(), set(deployment.loaded())
    killed = time.time()
    victim.kill()
    back = deployment.definitions_loaded(known)
    again = deployment.certified_by_a_new_worker(before)
    assert again - back <= CERTIFIED_AGAIN, f"certified {again - back:.1f}s after the new code server"
    server_kill = (
        f"certified {again - killed:.1f} s after the kill ({again - back:.1f} s after the new server)"
    )

    # kill -9 of the daemon: its code server lives on for its heartbeat TTL and is asked to hand the
    # stream over by the new daemon's code server (or releases the lease when it exits).
    assert deployment.daemon is not None
    before, known = deployment.workers(), set(deployment.loaded())
    killed = time.time()
    os.kill(deployment.daemon.pid, signal.SIGKILL)
    deployment.daemon.wait()
    deployment.start_daemon()
    up = deployment.definitions_loaded(known)
    again = deployment.certified_by_a_new_worker(before)
    assert again - up <= CERTIFIED_AGAIN, f"certified {again - up:.1f}s after the new daemon's code server"
    daemon_kill = (
        f"certified {again - killed:.1f} s after the kill ({again - up:.1f} s after its code server)"
    )

    deployment.finish(
        publisher,
        postgres_url,
        f"daemon with its own code servers: replacement -> certified by the new server "
        f"{handover_gap:.1f} s after it; kill -9 code server -> {server_kill}; "
        f"kill -9 daemon -> {daemon_kill}",
    )


def test_a_stream_under_the_daemon_with_one_code_server_survives_a_redeploy_and_a_kill(
    deployment: Deployment, nats_url: str, postgres_url: str
) -> None:
    publisher = Publisher(nats_url, deployment.stream)
    publisher.start()
    server, port = deployment.start_daemon_on_code_server()
    deployment.wait_for("a first certificate", lambda: bool(deployment.certificates()))

    # A redeploy: the code server is stopped (SIGTERM: it closes the stream and releases the lease)
    # and a new one started in its place.
    before = deployment.workers()
    stopped = time.time()
    server.send_signal(signal.SIGTERM)
    server.wait(60)
    released = deployment.store.status(deployment.stream)[0].owner is None
    server = deployment.start_code_server(port)
    listening = time.time()
    again = deployment.certified_by_a_new_worker(before)
    assert released, "the stopped code server did not release the lease"
    assert again - listening <= CERTIFIED_AGAIN, f"certified {again - listening:.1f}s after the new server"
    redeploy = f"{again - stopped:.1f} s ({again - listening:.1f} s after the new server listened)"

    # kill -9 of the code server, restarted at once (a supervisor): the dead holder's lease expires
    # within seconds.
    before = deployment.workers()
    killed = time.time()
    server.kill()
    server.wait()
    server = deployment.start_code_server(port)
    listening = time.time()
    again = deployment.certified_by_a_new_worker(before)
    assert again - listening <= CERTIFIED_AGAIN, f"certified {again - listening:.1f}s after the new server"
    kill = f"{again - killed:.1f} s ({again - listening:.1f} s after the new server listened)"

    deployment.finish(
        publisher,
        postgres_url,
        f"daemon with one code server: SIGTERM + new server -> certified after {redeploy}; "
        f"kill -9 + new server -> certified after {kill}",
    )


TICK_THEN_EXIT = (
    PROJECT
    + """
import sys

from faucet_dagster.state import StateStore

with dg.instance_for_test() as instance:
    sensor = defs.resolve_sensor_def(f"{stream.name}_stream")
    # The first tick starts the reader and returns; a later one reports the first certificates.
    cursor, ends = None, time.monotonic() + 120
    while True:
        context = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs)
        result = sensor.evaluate_tick(context)  # the definitions: its target, the sink asset
        cursor = result.cursor
        if result.asset_events:
            break
        assert time.monotonic() < ends, result.skip_message
        time.sleep(0.5)
with StateStore(stream.state_url) as store:
    assert store.status(stream.name)[0].owner is not None  # the cached runner holds the lease
if sys.argv[1] == "sigterm":  # as `dagster api grpc` treats SIGTERM: an interrupt of the main thread
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""
)


@pytest.mark.parametrize("ending", ["exit", "sigterm"])
def test_a_process_that_ends_releases_its_leases(deployment: Deployment, nats_url: str, ending: str) -> None:
    publisher = Publisher(nats_url, deployment.stream)
    publisher.start()
    deployment.wait_for("published", lambda: len(publisher.sent) > 10, bound=30)
    script = deployment.dir / "tick_then_exit.py"
    script.write_text(textwrap.dedent(TICK_THEN_EXIT))
    done = subprocess.run(
        [sys.executable, str(script), ending], env=deployment.env, capture_output=True, timeout=BOUND
    )
    publisher.stopped.set()
    publisher.join(30)
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert "cannot schedule new futures" not in output, output
    assert "Traceback" not in output or ending == "sigterm", output
    status = deployment.store.status(deployment.stream)[0]
    assert status.owner is None, f"the lease of the ended process is held: {status}\n{output}"
