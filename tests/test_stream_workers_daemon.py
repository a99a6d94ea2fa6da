"""``workers: 3`` lowered to 2 under a real ``dagster-daemon run`` with the default run launcher: the
sensor requests three long-running worker runs, their members split a 12-partition Kafka topic's three
partition groups. The code location is then changed to ``workers: 2`` (the daemon reloads it within a
minute): the run of the slot that is gone is retired (it closes at certified positions, releases its
leases and succeeds) and its group moves to the others, the stream keeping its three groups. Meanwhile a
kill -9 of one run's process makes the sensor mark that run failed and request a replacement, and the
stream goes on: every message in PostgreSQL once, each partition owned by one fenced worker at a time.
Stopping the sensor (``dagster sensor stop``) then stops both workers: each closes at certified
positions, releases its leases, its run succeeds, and every certificate the workers made is reported
to Dagster (the last ones by the workers themselves, as no tick will come).
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import dagster as dg
import psutil
import psycopg
import pytest
from kafka_topics import create_topic, produce

from faucet_dagster.protocol import EpochCertificate
from faucet_dagster.runner.members import group_stream
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import MemberRegistry
from faucet_dagster.streams.worker_runs import SLOT_TAG
from faucet_dagster.streams.workers import STREAM_TAG
from faucet_dagster.testing.faults.members import check_ownership

PARTITIONS = 12
BOUND = 180.0

PROJECT = """
import os

import dagster as dg

from faucet_dagster.protocol import ReadLimits
from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster import FaucetStream, build_stream_defs

kafka = FaucetConnection(
    connector="kafka",
    config={"bootstrap_servers": os.environ["T_KAFKA"], "group_id": os.environ["T_GROUP"]},
)
postgres = FaucetConnection(connector="postgres", config={"url": os.environ["T_POSTGRES"]})
stream = FaucetStream(
    name=os.environ["T_STREAM"],
    source=kafka.using(topics=[os.environ["T_TOPIC"]]),
    sink=postgres.using(table="events"),
    resources=(os.environ["T_TOPIC"],),
    state_url=os.environ["T_POSTGRES"],
    limits=ReadLimits(records=2_000, idle=0.3, age=2.0),
    lease_seconds=3.0,
    workers=int(os.environ.get("T_WORKERS", "3")),
)
defs = build_stream_defs([stream], minimum_interval_seconds=5, default_status=dg.DefaultSensorStatus.RUNNING)
"""


def _created(certificate: EpochCertificate) -> float:
    return datetime.fromisoformat(certificate.created_at).timestamp()


def wait_for(what: str, condition: Callable[[], bool], daemon: subprocess.Popen[bytes], log: Path) -> None:
    ends = time.monotonic() + BOUND
    while not condition():
        assert daemon.poll() is None, f"the daemon exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < ends, f"{what}: not within {BOUND:.0f}s\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


@pytest.mark.timeout(900)  # a deployment: a daemon, its code server, three runs in their own processes
def test_two_worker_runs_split_the_partitions_and_a_killed_one_is_replaced(
    tmp_path: Path, kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str]
) -> None:
    topic, stream = unique_name("topic"), unique_name("w")
    create_topic(kafka_bootstrap, topic, PARTITIONS)
    (tmp_path / "streams.py").write_text(textwrap.dedent(PROJECT))
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "T_STREAM": stream,
        "T_TOPIC": topic,
        "T_GROUP": unique_name("group"),
        "T_KAFKA": kafka_bootstrap,
        "T_POSTGRES": postgres_url,
        "PYTHONUNBUFFERED": "1",
    }
    sent = [0]
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            values = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(sent[0], sent[0] + 200)]
            produce(kafka_bootstrap, topic, values, partitions=PARTITIONS, start=sent[0])
            sent[0] += 200
            time.sleep(0.2)

    instance = dg.DagsterInstance.from_config(str(home))  # its storage created before the daemon's
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-f", "streams.py"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    store = StateStore(postgres_url)
    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    groups = [group_stream(stream, g, 3) for g in range(3)]

    def runs(*statuses: dg.DagsterRunStatus) -> list[dg.DagsterRun]:
        wanted = list(statuses) or list(dg.DagsterRunStatus)
        return list(instance.get_runs(filters=dg.RunsFilter(tags={STREAM_TAG: stream}, statuses=wanted)))

    def certifying_workers() -> set[str]:
        return {c.worker for name in groups for c in store.certificates(name)}

    def pid_of(run_id: str) -> int | None:
        for entry in instance.all_logs(run_id):
            found = re.search(r"\(pid (\d+)\) joins", entry.user_message or "")
            if found:
                return int(found.group(1))
        return None

    victim = ""
    alive: list[psutil.Process] = []
    try:
        wait_for(
            "three worker runs certify, one group each",
            lambda: len(certifying_workers()) == 3 and all(store.certificates(name) for name in groups),
            daemon,
            log,
        )
        first = certifying_workers()
        assert first <= {run.run_id for run in runs(dg.DagsterRunStatus.STARTED)}
        assert len(runs()) == 3, "exactly three worker runs were requested"
        # The operator lowers the workers to 2; the daemon reloads the code location within a minute.
        (tmp_path / "streams.py").write_text(
            textwrap.dedent(PROJECT).replace('os.environ.get("T_WORKERS", "3")', '"2"')
        )
        [retired] = [run.run_id for run in runs() if run.tags.get(SLOT_TAG) == "2"]
        victim = sorted(first - {retired})[0]
        pid = pid_of(victim)
        assert pid is not None, "the worker run logs its process id"
        os.kill(pid, signal.SIGKILL)
        wait_for(
            "the sensor marks the killed run failed and a replacement certifies",
            lambda: (
                instance.get_run_by_id(victim) is not None
                and instance.get_run_by_id(victim).status is dg.DagsterRunStatus.FAILURE  # type: ignore[union-attr]
                and bool(certifying_workers() - first)
            ),
            daemon,
            log,
        )
        wait_for(
            "the worker of the slot that is gone leaves and succeeds",
            lambda: instance.get_run_by_id(retired).status is dg.DagsterRunStatus.SUCCESS,  # type: ignore[union-attr]
            daemon,
            log,
        )
        said = " ".join(e.user_message or "" for e in instance.all_logs(retired))
        assert f"member {retired} left (it was retired: stream {stream} now has 2 workers" in said, said[
            -2000:
        ]
        left = time.time()
        # Its group moved: every group certifies again, by the remaining workers.
        wait_for(
            "every group certified after the retirement by another worker",
            lambda: all(
                any(c.worker != retired and _created(c) > left for c in store.certificates(name))
                for name in groups
            ),
            daemon,
            log,
        )
        stop.set()
        publisher.join(60)
        total = sent[0]

        def all_in() -> bool:
            with psycopg.connect(postgres_url) as conn:
                row = conn.execute("SELECT count(*) FROM events").fetchone()
            return row is not None and row[0] >= total

        wait_for(f"all {total} messages in the destination", all_in, daemon, log)
        # The operator stops the sensor: each worker run notices, closes at certified positions, leaves
        # and succeeds; the sensor requests nothing more.
        stopped_by = subprocess.run(
            [
                str(Path(sys.executable).parent / "dagster"),
                "sensor",
                "stop",
                f"{stream}_stream",
                "-f",
                "streams.py",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            timeout=BOUND,
        )
        assert stopped_by.returncode == 0, stopped_by.stderr.decode()[-3000:]
        wait_for(
            "both worker runs succeed after the sensor stopped (the retired one succeeded before)",
            lambda: len(runs(dg.DagsterRunStatus.SUCCESS)) == 3,
            daemon,
            log,
        )
    finally:
        stop.set()
        # The sensor first (no replacement requested while the workers stop), then the workers' processes:
        # a clean stop, each closing its groups at certified positions and releasing its leases.
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        pids = [pid_of(run.run_id) for run in runs() if run.run_id != victim]
        workers = [psutil.Process(pid) for pid in pids if pid is not None and psutil.pid_exists(pid)]
        for process in workers:
            process.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(workers, timeout=60)
        for process in alive:
            process.kill()
    assert not alive, "every worker stopped when its sensor stopped (or, after a failure, on SIGTERM)"
    assert len(runs()) == 4, "three runs, and the killed one's replacement: no run once the sensor stopped"
    stopped = [
        run for run in runs() if run.run_id not in (victim, retired) and pid_of(run.run_id) is not None
    ]
    assert len(stopped) == 2
    for run in stopped:
        said = " ".join(e.user_message or "" for e in instance.all_logs(run.run_id))
        assert f"member {run.run_id} left (its sensor {stream}_stream is stopped)" in said, said[-2000:]
        assert run.status is dg.DagsterRunStatus.SUCCESS
    with psycopg.connect(postgres_url) as conn:
        ids = [row[0] for row in conn.execute("SELECT id FROM events ORDER BY id")]
    assert ids == list(range(total)), "every message exactly once"
    ownership = check_ownership({name: store.certificates(name) for name in groups})
    assert sorted(int(domain.partition) for domain in ownership) == list(range(PARTITIONS))
    assert len({worker for item in ownership.values() for _, worker in item.owners}) >= 4
    # Every certificate the workers made was reported to Dagster once, the last ones after the stop.
    made = sorted((c.stream, c.sequence) for name in groups for c in store.certificates(name))
    reported = sorted(
        (str(row.data["stream"]), int(str(row.data["sequence"])))
        for record in instance.fetch_materializations(dg.AssetKey([stream]), limit=10_000).records
        if record.asset_materialization is not None
        for row in record.asset_materialization.metadata["faucet/certificates"].value.records  # type: ignore[attr-defined]
    )
    assert reported == made, f"{len(reported)} of {len(made)} certificates reported"
    lapsed = MemberRegistry(store).lapsed(stream)
    assert all(lapsed.get(run.run_id, 0.0) is None for run in stopped), "each left the membership"
    store.close()
