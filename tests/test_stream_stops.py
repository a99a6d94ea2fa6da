"""Stops and exits of a process running a stream into NATS, whose writes cannot be taken back.

A NATS sink publishes during ``apply``: an epoch rolled back after it published is published again
when it is replayed, and the stream stores it twice when that replay comes after its duplicate window.
The process here is a code server's stand-in (``stream_process.py``: the stream's sensor, ticked while
the test says so, its runners closed by the interpreter's exit), with its clocks shortened; the
servers are real (Kafka-protocol broker, NATS JetStream), the state store a SQLite file.

* A sensor stopped for longer than the duplicate window (10 s here, a stop of 15 s; the default window
  is 120 s) and started again stores every record once: the reader that no tick reaches seals and
  certifies its open epoch before it stops, it does not roll it back.
* A process that exits while the NATS server is frozen (SIGSTOP), its close unfinished, marks the
  stream uncertain before it exits; a new process does not take the stream over (its ticks fail,
  naming the remedy) until ``faucet streams release``, and then every record is stored once.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from kafka_topics import create_topic, produce_json
from stream_ticks import stored_ids

from faucet_dagster.cli.main import main as faucet
from faucet_dagster.state import StateStore
from faucet_dagster.testing import NatsServer

CHILD = Path(__file__).with_name("stream_process.py")
WAIT = 120.0
"""The bound of every wait here (generous: a loaded machine)."""
EXIT_ATTEMPTS = 5
"""Exits tried until one finds publishes in flight when the destination freezes."""


class Producer:
    """Produces ``{"id": i}`` into the topic at about ``rate`` messages a second until stopped."""

    def __init__(self, bootstrap: str, topic: str, rate: int = 200) -> None:
        self.bootstrap, self.topic, self.rate = bootstrap, topic, rate
        self.produced = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Producer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        batch = max(1, self.rate // 10)
        while not self._stop.is_set():
            produce_json(self.bootstrap, self.topic, self.produced, batch)
            self.produced += batch
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Process:
    """The stream's process: started, ticking or not, asked to exit."""

    def __init__(self, config: dict[str, Any], directory: Path, name: str) -> None:
        self.control = directory / f"control-{name}"
        self.control.mkdir()
        config_file = directory / f"{name}.json"
        config_file.write_text(json.dumps({**config, "control_dir": str(self.control)}))
        self.output = directory / f"{name}.out"
        self.errors = directory / f"{name}.err"
        with self.output.open("w") as out, self.errors.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), str(config_file)], stdout=out, stderr=err
            )

    def ticking(self, on: bool) -> None:
        (self.control / "tick").touch() if on else (self.control / "tick").unlink(missing_ok=True)

    def exit(self) -> int:
        (self.control / "quit").touch()
        return self.proc.wait(WAIT)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.output.read_text().splitlines() if line.startswith("{")]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def setup(
    kafka_bootstrap: str, nats_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> Iterator[dict[str, Any]]:
    topic, target = unique_name("topic"), unique_name("out")
    create_topic(kafka_bootstrap, topic, 4)
    yield {
        "name": unique_name("stream"),
        "state_url": f"sqlite:///{tmp_path / 'state.db'}",
        "kafka_bootstrap": kafka_bootstrap,
        "topic": topic,
        "group": unique_name("group"),
        "nats_url": nats_url,
        "target": target,
        "lease_seconds": 4.0,
        "reader_stop_seconds": 2.0,
        "exit_close_seconds": 3.0,
        "exit_linger_seconds": 1.0,
    }


def create_target(nats_url: str, target: str, window: float) -> None:
    async def create() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().add_stream(
                name=target, subjects=[f"{target}.rows"], duplicate_window=window
            )
        finally:
            await client.close()

    asyncio.run(create())


def wait_for(what: str, condition: Callable[[], bool], process: Process | None = None) -> None:
    ends = time.monotonic() + WAIT
    while not condition():
        if process is not None and process.proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited: {process.errors.read_text()[-2000:]}")
        assert time.monotonic() < ends, f"{what}: not within {WAIT:.0f}s"
        time.sleep(0.2)


def certified(store: StateStore, name: str) -> int:
    return sum(sum(c.row_counts.values()) for c in store.certificates(name))


def assert_each_once(nats_url: str, target: str, total: int) -> None:
    """The target stream holds ids ``0 .. total - 1``, each once."""
    counts = Counter(asyncio.run(stored_ids(nats_url, target)))
    assert sorted(counts) == list(range(total)), "a record was lost"
    twice = sum(count - 1 for count in counts.values())
    assert twice == 0, f"{twice} messages stored twice"


def stop_all(processes: list["Process | None"]) -> None:
    for process in processes:
        if process is not None:
            process.ticking(False)
            if process.proc.poll() is None:
                process.exit()
            process.close()


def test_a_sensor_stopped_longer_than_the_duplicate_window_stores_nothing_twice(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    window = 10.0
    create_target(setup["nats_url"], setup["target"], window)
    store = StateStore(setup["state_url"])
    # Epochs of three seconds: the open epoch has published rows of earlier reads when the reader
    # stops (a rollback would leave them to be published again).
    process = Process({**setup, "duplicate_window": window, "epoch_age": 3.0}, tmp_path, "server")
    try:
        with Producer(setup["kafka_bootstrap"], setup["topic"]) as producer:
            process.ticking(True)
            wait_for("a few epochs certified", lambda: certified(store, setup["name"]) >= 400, process)
            process.ticking(False)  # the sensor is stopped; the producer goes on
            # The reader stops after its idle time, releasing the lease; then the stop outlasts the
            # duplicate window, so a replay of anything published and not certified would duplicate.
            wait_for("the reader stopped", lambda: store.status(setup["name"])[0].owner is None, process)
            stopped = time.monotonic()
            time.sleep(window + 5.0)
            process.ticking(True)  # started again
            wait_for("reading again", lambda: store.status(setup["name"])[0].owner is not None, process)
            time.sleep(1.0)
        total = producer.produced
        wait_for("everything certified", lambda: certified(store, setup["name"]) >= total, process)
        print(f"\nstopped {time.monotonic() - stopped:.0f}s; {total} records produced")
    finally:
        stop_all([process])
        store.close()
    assert_each_once(setup["nats_url"], setup["target"], total)


def test_an_exit_with_nats_frozen_marks_the_stream_uncertain_and_blocks_takeover_until_released(
    setup: dict[str, Any], tmp_path: Path, nats_server: NatsServer
) -> None:
    # A window the replay after the release stays within: the check is that nothing is lost and
    # nothing taken over behind the operator's back, not the window.
    window = 120.0
    create_target(setup["nats_url"], setup["target"], window)
    store = StateStore(setup["state_url"])
    name = setup["name"]
    exiting = [Process({**setup, "duplicate_window": window, "epoch_age": 0.5}, tmp_path, "first")]
    second: Process | None = None
    pid = nats_server.pid
    assert pid is not None
    frozen = False
    try:
        with Producer(setup["kafka_bootstrap"], setup["topic"]) as producer:
            for attempt in range(EXIT_ATTEMPTS):
                first = exiting[-1]
                first.ticking(True)

                def a_few_more(enough: int = certified(store, name) + 400) -> bool:
                    return certified(store, name) >= enough

                wait_for("a few epochs certified", a_few_more, first)
                os.kill(pid, signal.SIGSTOP)  # the destination freezes, with publishes in flight or not
                frozen = True
                time.sleep(1.5)
                first.ticking(False)
                assert first.exit() == 0, first.errors.read_text()[-2000:]
                status = store.status(name)[0]
                if status.uncertain:
                    break
                # An epoch publishes in a burst at its seal: a freeze between bursts finds nothing in
                # flight, and the exit is rightly clean (not uncertain). Again, with a new process.
                os.kill(pid, signal.SIGCONT)
                frozen = False
                exiting.append(
                    Process({**setup, "duplicate_window": window, "epoch_age": 0.5}, tmp_path, f"p{attempt}")
                )
            assert status.uncertain, f"{EXIT_ATTEMPTS} exits, none left the stream uncertain: {status}"
            os.kill(pid, signal.SIGCONT)
            frozen = False
            second = Process({**setup, "duplicate_window": window, "epoch_age": 0.5}, tmp_path, "second")
            second.ticking(True)
            # Past the first process's lease: nothing takes the stream over while it is uncertain.
            before = len(store.certificates(name))
            time.sleep(setup["lease_seconds"] + 4.0)

            def halted() -> list[dict[str, Any]]:
                return [e for e in second.events() if str(e.get("skip", "")).startswith("halted since ")]

            # Its ticks say the stream is halted, with the remedy (a halt is not a failing tick); on a
            # loaded machine the new process's first tick may come after the lease's end.
            wait_for("a tick saying the stream is halted", lambda: bool(halted()), second)
            assert len(store.certificates(name)) == before, "taken over while uncertain"
            assert "faucet streams release" in halted()[-1]["skip"], second.events()[-3:]
            assert faucet(["streams", "release", name, "--state-url", setup["state_url"]]) == 0
            wait_for("taken over once released", lambda: len(store.certificates(name)) > before, second)
        total = producer.produced
        wait_for("everything certified", lambda: certified(store, name) >= total, second)
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        stop_all([*exiting, second])
        store.close()
    assert_each_once(setup["nats_url"], setup["target"], total)
