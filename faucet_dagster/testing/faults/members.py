"""Members joining and leaving a stream divided into partition groups, in worker processes.

A case starts three member workers of one stream (``WorkerSpec.groups``: each a
:class:`~faucet_dagster.runner.members.MemberWorker` in its own process), produces records in waves,
and between waves does one membership change chosen by the case's seed: ``kill`` (SIGKILL a
member), ``add`` (start one), ``stop`` (SIGTERM a member: a clean stop) or ``freeze`` (SIGSTOP a
member past its lease, then SIGCONT: a zombie that wakes up after its groups were taken over). When
every record is certified, the members are stopped and the destination is judged record by record
(:func:`~.oracle.judge`), and the certificates by :func:`check_ownership`: every ordering domain in
one group chain only, its coverage chained across owners, its fencing tokens never going back, each
token one worker's.
"""

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from faucet_dagster.protocol import EpochCertificate, OrderingDomain
from faucet_dagster.runner.members import group_stream
from faucet_dagster.state import StateStore
from faucet_dagster.testing.faults.case import Case, CaseParams
from faucet_dagster.testing.faults.harness import managed_servers
from faucet_dagster.testing.faults.oracle import Verdict, judge
from faucet_dagster.testing.faults.pairs import KafkaSource, Pair, Servers, pair_named
from faucet_dagster.testing.faults.worker_process import HarnessError, WorkerProcess

MEMBER_GROUPS = 3
MEMBER_PARTITIONS = 12
ACTIONS = ("kill", "add", "stop", "freeze")


class KafkaTwelve(KafkaSource):
    """The Kafka source side with a 12-partition topic."""

    partitions = MEMBER_PARTITIONS


@dataclass(frozen=True)
class Ownership:
    """What the certificates say about one ordering domain: its group, its owners in order
    ((fencing token, worker), repeats collapsed), where it ended."""

    group: str
    owners: tuple[tuple[int, str], ...]
    end: str | None


def check_ownership(chains: dict[str, list[EpochCertificate]]) -> dict[OrderingDomain, Ownership]:
    """Check every domain of every group chain; return its ownership by domain.

    Raises AssertionError when a domain appears in two groups, a group's sequences have a gap, a
    domain's coverage does not start where its previous certificate ended (a loss or a duplicate), a
    fencing token goes back (two owners at a time), or one token was used by two workers.
    """
    found: dict[OrderingDomain, Ownership] = {}
    for group, certificates in chains.items():
        if [c.sequence for c in certificates] != list(range(1, len(certificates) + 1)):
            raise AssertionError(f"{group}: the certificate sequence has a gap")
        token_worker: dict[int, str] = {}
        for certificate in certificates:
            worker = token_worker.setdefault(certificate.fencing_token, certificate.worker)
            if worker != certificate.worker:
                raise AssertionError(
                    f"{group}: token {certificate.fencing_token} used by {worker} and {certificate.worker}"
                )
            for item in certificate.coverage:
                earlier = found.get(item.domain)
                owners: tuple[tuple[int, str], ...] = ()
                if earlier is None:
                    if item.start is not None:
                        raise AssertionError(f"{item.domain} first certified from {item.start}")
                else:
                    if earlier.group != group:
                        raise AssertionError(f"{item.domain} is certified in {earlier.group} and {group}")
                    if item.start != earlier.end:
                        raise AssertionError(
                            f"{item.domain}: {certificate.certificate_id} starts at {item.start}, the "
                            f"previous certificate ended at {earlier.end}"
                        )
                    if certificate.fencing_token < earlier.owners[-1][0]:
                        raise AssertionError(
                            f"{item.domain}: token {certificate.fencing_token} after {earlier.owners[-1][0]}"
                        )
                    owners = earlier.owners
                owner = (certificate.fencing_token, certificate.worker)
                if not owners or owners[-1] != owner:
                    owners = (*owners, owner)
                found[item.domain] = Ownership(group, owners, item.end)
    return found


@dataclass(frozen=True)
class MemberCaseResult:
    """One seed's schedule of membership changes and what the oracle found."""

    seed: int
    schedule: tuple[str, ...]
    verdict: Verdict
    domains: int
    owner_changes: int
    seconds: float
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return (
            not self.notes
            and self.verdict.lost == 0
            and self.verdict.duplicated == 0
            and self.verdict.unexpected == 0
        )


def member_schedule(seed: int, steps: int) -> tuple[str, ...]:
    """``steps`` membership changes in the seed's random order (every kind once per four steps)."""
    rng = random.Random(seed)
    schedule: list[str] = []
    while len(schedule) < steps:
        schedule.extend(rng.sample(ACTIONS, len(ACTIONS)))
    return tuple(schedule[:steps])


def run_member_case(
    servers: Servers, root: Path, seed: int, *, steps: int = 4, params: CaseParams | None = None
) -> MemberCaseResult:
    """Run one seed's schedule on Kafka (12 partitions) to PostgreSQL with three members at the start."""
    params = params or CaseParams(records=1_200, epoch_records=200, lease_seconds=2.0, worker_deadline=240.0)
    pair: Pair = replace(pair_named("kafka-postgres"), source=KafkaTwelve)
    schedule = member_schedule(seed, steps)
    rng = random.Random(seed + 1)
    case = Case(servers, root, pair, params)
    started = time.monotonic()
    notes: list[str] = []
    live: list[WorkerProcess] = []
    count = 0
    verdict = Verdict(0, 0, 0, 0, 0)

    def start() -> None:
        nonlocal count
        count += 1
        live.append(case.start(case.spec(f"m{count}", groups=MEMBER_GROUPS, targets=())))

    try:
        case.prepare()
        for _ in range(3):
            start()
        wave = max(1, params.records // (len(schedule) + 1))
        for action in schedule:
            before = sum(worker.count("certified") for worker in live)
            case.produce(f"p{len(case.produced)}", wave)
            _wait(_certified_more(live, before), 60, "progress")
            if action == "add" or not live:
                start()
                continue
            victim = live.pop(rng.randrange(len(live)))
            if action == "kill":
                victim.send(signal.SIGKILL)
                victim.wait(30)
            elif action == "stop":
                _terminate(victim)
                _stopped(victim, notes)
            else:
                victim.send(signal.SIGSTOP)
                time.sleep(params.lease_seconds * 2 + 0.5)  # past its member and group leases
                victim.send(signal.SIGCONT)
                live.append(victim)
            if not live:
                start()
        case.produce("last", wave)
        chains_of = _ChainReader(case.state_url, case.name)
        _wait(lambda: _certified_rows(chains_of()) >= len(case.produced), 120, "every record certified")
        for worker in live:
            _terminate(worker)
        for worker in live:
            _stopped(worker, notes)
        keys = {item.key for item in case.produced}
        verdict = judge(keys, keys, case.sink.read())
        try:
            ownership = check_ownership(chains_of())
        except AssertionError as exc:
            notes.append(f"certificates: {exc}")
            ownership = {}
        if len(ownership) != MEMBER_PARTITIONS:
            notes.append(f"{len(ownership)} partitions certified, not {MEMBER_PARTITIONS}")
        changes = sum(len(item.owners) - 1 for item in ownership.values())
    except HarnessError as exc:
        notes.append(f"{type(exc).__name__}: {exc}")
        ownership, changes = {}, 0
    finally:
        case.close()
    return MemberCaseResult(
        seed, schedule, verdict, len(ownership), changes, time.monotonic() - started, tuple(notes)
    )


class _ChainReader:
    """Reads every group's certificate chain from the case's state store."""

    def __init__(self, url: str, stream: str) -> None:
        self._url = url
        self._stream = stream

    def __call__(self) -> dict[str, list[EpochCertificate]]:
        with StateStore(self._url) as store:
            names = [group_stream(self._stream, g, MEMBER_GROUPS) for g in range(MEMBER_GROUPS)]
            return {name: store.certificates(name) for name in names}


def _terminate(worker: WorkerProcess) -> None:
    """SIGTERM, once the worker said it started (its handler for a clean stop is installed then)."""
    if worker.wait_for(lambda event: event.event == "started", 60) is None:
        raise HarnessError(f"{worker.spec.worker_id} never started: {worker.tail()}")
    worker.send(signal.SIGTERM)


def _stopped(worker: WorkerProcess, notes: list[str]) -> None:
    """Wait for a worker sent SIGTERM; note it unless it stopped cleanly."""
    code = worker.wait(60)
    if code != 0:
        error = worker.error()
        notes.append(
            f"{worker.spec.worker_id} exited with {code} after SIGTERM: "
            f"{error.data if error is not None else worker.tail()}"
        )


def _certified_more(workers: list[WorkerProcess], before: int) -> Callable[[], bool]:
    """True once ``workers`` wrote more ``certified`` events than ``before``."""
    return lambda: sum(worker.count("certified") for worker in workers) > before


def _certified_rows(chains: dict[str, list[EpochCertificate]]) -> int:
    return sum(sum(c.row_counts.values()) for chain in chains.values() for c in chain)


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m faucet_dagster.testing.faults.members --iterations N --seed S``: N seeds' schedules
    (8 changes each), one line per case and a table at the end; exit 1 if a case failed."""
    parser = argparse.ArgumentParser(prog="python -m faucet_dagster.testing.faults.members")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="faucet-members-"))
    results: list[MemberCaseResult] = []
    with managed_servers([pair_named("kafka-postgres")]) as servers:
        for iteration in range(args.iterations):
            result = run_member_case(servers, root, args.seed + iteration, steps=args.steps)
            results.append(result)
            print(json.dumps({**asdict(result), "passed": result.passed}, default=str), flush=True)
    kinds = Counter(action for result in results for action in result.schedule)
    lost = sum(result.verdict.lost for result in results)
    duplicated = sum(result.verdict.duplicated for result in results)
    records = sum(result.verdict.records for result in results)
    moves = sum(result.owner_changes for result in results)
    print(
        f"cases {len(results)}, passed {sum(result.passed for result in results)}, records {records}, "
        f"lost {lost}, duplicated {duplicated}, owner changes {moves}, "
        f"membership changes {dict(sorted(kinds.items()))}"
    )
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
