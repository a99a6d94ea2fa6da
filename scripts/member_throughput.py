"""Throughput of a stream divided among 1, 2 and 3 member workers, interleaved in one run.

``.venv/bin/python scripts/member_throughput.py [--messages 300000] [--rounds 3] [--groups 6]``

Starts the test servers (PostgreSQL, the Kafka-protocol broker, from their wheels). Each round
measures 1, 2 and 3 workers once, in a rotating order (round r starts at ``r % 3``), so a drift of the
shared machine's load spreads over every count. One measurement: a fresh 12-partition topic holding
a fresh destination table, and N member worker processes
(``python -m faucet_dagster.testing.faults.worker``, each a
:class:`~faucet_dagster.runner.members.MemberWorker`) of one stream divided into ``--groups`` partition
groups, the state store in the same PostgreSQL server. Once every group's lease is held by the member
the assignment gives it (the workers joined and the groups moved: startup is not measured), the
workers are frozen (SIGSTOP; leases of 60 s outlive it), ``--messages`` JSON messages are produced,
and the workers are thawed (SIGCONT): the clock runs from the thaw until the certificates count every
message. Then the workers are stopped (SIGTERM, a clean stop) and the destination is checked to hold
every message once.

Prints one line per measurement (with the cores the whole machine was busy and the cores the workers
used, over the measured seconds) and, per worker count, the median messages/s and its ratio to one
worker's median.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.data import produce_all
from faucet_dagster.runner.members import group_stream
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import MemberRegistry
from faucet_dagster.testing import KafkaServer, PostgresServer, make_unique_name
from faucet_dagster.testing.faults.spec import Endpoint, WorkerSpec
from faucet_dagster.testing.faults.worker_process import WorkerProcess

PARTITIONS = 12
COLUMNS = {"i": "int64", "name": "string", "score": "float64"}
BOUND = 600.0


def measure(
    postgres_url: str, bootstrap: str, workers: int, args: argparse.Namespace, logs: Path
) -> "Figure":
    """One measurement (see the module); its messages per second."""
    topic, stream = make_unique_name("mt_topic"), make_unique_name("mt")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    values = [json.dumps({"i": i, "name": f"n{i}", "score": i / 7}).encode() for i in range(args.messages)]
    keys = [str(i).encode() for i in range(args.messages)]
    groups = [group_stream(stream, g, args.groups) for g in range(args.groups)]
    base = WorkerSpec(
        mode="continuous",
        stream=stream,
        worker_id="",
        source=Endpoint(
            "kafka",
            {
                "bootstrap_servers": bootstrap,
                "topics": [topic],
                "group_id": f"g_{stream}",
                "format": "json",
                "columns": COLUMNS,
            },
        ),
        sink=Endpoint("postgres", {"url": postgres_url, "table": stream}),
        resources=(topic,),
        state_url=postgres_url,
        epoch_records=args.epoch_records,
        epoch_idle=args.epoch_idle,
        epoch_age=10.0,
        batch_rows=16_384,
        lease_seconds=60.0,
        deadline_seconds=BOUND,
        groups=args.groups,
    )
    specs = [WorkerSpec(**{**base.__dict__, "worker_id": f"{stream}_m{n}"}) for n in range(workers)]
    processes = [WorkerProcess(spec, None, logs / f"{spec.worker_id}.log") for spec in specs]
    store = StateStore(postgres_url)
    registry = MemberRegistry(store)

    def certified() -> int:
        events = [event for process in processes for event in list(process.events)]
        return sum(int(event.data["rows"]) for event in events if event.event == "certified")

    try:
        ends = time.monotonic() + BOUND

        def settled() -> bool:
            """Every group's lease held by the member the assignment gives it (``g mod n``)."""
            live = [member.member for member in registry.live(stream)]
            if len(live) < workers:
                return False
            owners = {status.stream: status for status in store.status() if status.stream in groups}
            return all(
                name in owners and owners[name].lease_live and owners[name].owner == live[g % workers]
                for g, name in enumerate(groups)
            )

        while not settled():
            if time.monotonic() > ends or any(p.proc.poll() is not None for p in processes):
                raise RuntimeError(f"{workers} workers did not settle; logs in {logs}")
            time.sleep(0.1)
        # Frozen while the messages are produced (their leases outlive it), thawed at once: the clock
        # measures the workers only, not the producer sharing their cores.
        for process in processes:
            process.send(signal.SIGSTOP)
        produce_all(bootstrap, topic, keys, values)
        start, machine = time.perf_counter(), psutil.cpu_times()
        workers_cpu = [psutil.Process(p.proc.pid).cpu_times() for p in processes]
        for process in processes:
            process.send(signal.SIGCONT)
        while (done := certified()) < args.messages:
            if time.monotonic() > ends or any(p.proc.poll() is not None for p in processes):
                raise RuntimeError(f"{done} of {args.messages} certified; logs in {logs}")
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        busy = _busy(machine, psutil.cpu_times()) / seconds
        spent = sum(
            _cpu(psutil.Process(p.proc.pid).cpu_times()) - _cpu(before)
            for p, before in zip(processes, workers_cpu, strict=True)
        )
    finally:
        for process in processes:
            process.send(signal.SIGTERM)
        for process in processes:
            process.wait(120)
        store.close()
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(f'SELECT count(*), count(DISTINCT i) FROM "{stream}"').fetchone()
    if row is None or row[0] != args.messages or row[1] != args.messages:
        raise RuntimeError(f"{stream} holds {row}, expected {args.messages} distinct messages")
    admin.delete_topics([topic])[topic].result(30)
    return Figure(args.messages / seconds, busy, spent / seconds)


@dataclass(frozen=True)
class Figure:
    """One measurement: messages/s, the cores the whole machine was busy (of 2) and the cores the
    workers themselves used, both averaged over the measured seconds."""

    rate: float
    machine_cores: float
    worker_cores: float


def _cpu(times: Any) -> float:
    return float(times.user + times.system)


def _busy(before: Any, after: Any) -> float:
    """CPU seconds the whole machine spent busy (all cores) between two ``psutil.cpu_times()``."""
    idle = (after.idle + getattr(after, "iowait", 0.0)) - (before.idle + getattr(before, "iowait", 0.0))
    total = sum(after) - sum(before)
    return float(total - idle)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=6, help="partition groups (6: 6, 3 and 2 per worker)")
    parser.add_argument("--epoch-records", type=int, default=50_000)
    parser.add_argument(
        "--epoch-idle", type=float, default=0.2, help="seconds without a message that end an epoch"
    )
    args = parser.parse_args()
    postgres, kafka = PostgresServer.from_env().start(), KafkaServer.from_env().start()
    figures: dict[int, list[Figure]] = {1: [], 2: [], 3: []}
    try:
        url = postgres.create_database(make_unique_name("mt_db"))
        with tempfile.TemporaryDirectory(prefix="faucet-members-") as tmp:
            for round_ in range(args.rounds):
                order = [1, 2, 3][round_ % 3 :] + [1, 2, 3][: round_ % 3]
                for workers in order:
                    figure = measure(url, kafka.bootstrap, workers, args, Path(tmp))
                    figures[workers].append(figure)
                    print(
                        f"round {round_ + 1} workers {workers}: {figure.rate:,.0f} messages/s, machine busy "
                        f"{figure.machine_cores:.2f} cores, workers {figure.worker_cores:.2f} cores",
                        flush=True,
                    )
    finally:
        kafka.close()
        postgres.close()
    one = statistics.median(f.rate for f in figures[1])
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for workers, values in figures.items():
        rates = [f.rate for f in values]
        median = statistics.median(rates)
        used = statistics.median(f.worker_cores for f in values)
        busy = statistics.median(f.machine_cores for f in values)
        print(
            f"workers {workers}: median {median:,.0f} messages/s ({min(rates):,.0f}-{max(rates):,.0f}), "
            f"{median / one:.2f}x one worker; workers used {used:.2f} cores, the machine {busy:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
