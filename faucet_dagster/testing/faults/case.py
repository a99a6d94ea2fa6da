"""One case of the fault harness: a pair under one fault, with its servers, files, workers, records,
and what a fault's run established (:class:`CaseOutcome`) for the oracle's verdict.

The fault runners that drive a case are in :mod:`.scenarios` (and :mod:`.lagging`, :mod:`.ddl`); the
kinds of fault are described in :mod:`.catalog`.
"""

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from faucet_dagster.planner import Mechanism, Plan
from faucet_dagster.protocol import EpochCertificate, Mode
from faucet_dagster.runner.faults import Action, Arming, Point
from faucet_dagster.state import StateStore
from faucet_dagster.testing.faults.catalog import ONCE_PER_RUN
from faucet_dagster.testing.faults.oracle import Verdict, covered, foreign_incarnations, judge, judge_state
from faucet_dagster.testing.faults.pairs import Key, Pair, Produced, Servers
from faucet_dagster.testing.faults.spec import EXIT_DONE, EXIT_HALTED, Endpoint, Event, WorkerSpec
from faucet_dagster.testing.faults.verification import CaseVerification
from faucet_dagster.testing.faults.worker_process import HarnessError, WorkerProcess
from faucet_dagster.testing.servers import make_unique_name


@dataclass(frozen=True)
class CaseParams:
    """The knobs of one case: records produced, epoch (or page) size, which hit of a point fires,
    when a random signal is sent (``random_delay`` seconds after ``random_after`` certified epochs or
    committed pages; 0: after the worker started), how long after the authority check the
    acknowledgement's kill lands, after how many epochs (pages) a server restarts, the
    lease a worker holds and how long a worker may run."""

    records: int = 2_000
    epoch_records: int = 400
    hit: int = 2
    random_after: int = 1
    random_delay: float = 0.0
    kill_delay: float = 0.0
    restart_after: int = 2
    lease_seconds: float = 2.0
    worker_deadline: float = 60.0


@dataclass(frozen=True)
class CaseResult:
    """The verdict on one case; ``passed`` when nothing was lost, nothing unexpected found, no
    duplicate beyond what the plan allows, the stream halted (or recovered) as it should, and its
    certificates verified with nothing the fault does not explain."""

    pair: str
    fault: str
    params: CaseParams
    delivery: str
    duplicates_allowed: bool
    verdict: Verdict
    fired: bool
    halted_correctly: bool
    seconds: float
    notes: tuple[str, ...] = ()
    verification: CaseVerification | None = None
    """``faucet verify`` over the case's certificates or synced range (None: not run); what it found
    that the fault does not explain is in ``notes`` too."""

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}

    @property
    def passed(self) -> bool:
        verdict = self.verdict
        return (
            verdict.lost == 0
            and verdict.unexpected == 0
            and (verdict.duplicated == 0 or self.duplicates_allowed)
            and self.halted_correctly
            and (self.verification is None or self.verification.clean)
        )


@dataclass
class CaseOutcome:
    """What a fault's run established, for the verdict."""

    fired: bool
    halted_correctly: bool
    must: set[Key]
    may: set[Key]
    notes: list[str] = field(default_factory=list)
    duplicates_allowed: bool | None = None
    """None: as the plan allows for the case's duration; False: none, whatever the plan says (a fault
    whose path must leave nothing to replay, although the case outlasts the duplicate window)."""


class Case:
    """One pair under one fault: its names, servers, files, workers and records."""

    def __init__(self, servers: Servers, root: Path, pair: Pair, params: CaseParams) -> None:
        self.servers = servers
        self.pair = pair
        self.params = params
        self.name = make_unique_name("f", pair.name)
        self.dir = root / self.name
        self.dir.mkdir(parents=True)
        self.source = pair.source(servers, self.name, self.dir)
        self.sink = pair.sink(servers, self.name)
        self.state_url = f"sqlite:///{self.dir / 'state.db'}"
        self.report = self.dir / "fault-report.jsonl"
        self.produced: list[Produced] = []
        self._workers: list[WorkerProcess] = []
        self._next_id = 0

    # -- setup and reading back -----------------------------------------------------------------

    def prepare(self) -> None:
        self.source.create()
        self.sink.create()

    def produce(self, producer: str, count: int) -> list[Produced]:
        produced = self.source.produce(producer, count, self._next_id)
        self._next_id += count
        self.produced += produced
        return produced

    def endpoints(self) -> tuple[Endpoint, Endpoint]:
        return (
            Endpoint(self.source.connector, self.source.config()),
            Endpoint(self.sink.connector, self.sink.config()),
        )

    def plan(self) -> Plan:
        return self.pair.plan(*self.endpoints())

    def certificates(self) -> list[EpochCertificate]:
        if self.pair.mode is Mode.BOUNDED:
            return []
        with StateStore(self.state_url) as store:
            return store.certificates(self.name)

    def release(self) -> None:
        """The operator's ``faucet streams release``: after checking the destination, clear the
        uncertain flag (the oracle checks the destination at the end)."""
        with StateStore(self.state_url) as store:
            store.release(self.name)

    # -- workers --------------------------------------------------------------------------------

    def spec(self, worker: str, **overrides: Any) -> WorkerSpec:
        source, sink = self.endpoints()
        params = self.params
        spec = WorkerSpec(
            mode="continuous" if self.pair.mode is Mode.CONTINUOUS else "bounded",
            stream=self.name,
            worker_id=f"{worker}-{self.name}",
            source=source,
            sink=sink,
            resources=self.source.resources(),
            policy=self.pair.policy.value,
            state_url=self.state_url,
            epoch_records=params.epoch_records,
            batch_rows=params.epoch_records,
            lease_seconds=params.lease_seconds,
            targets=self.source.targets(self.produced),
            deadline_seconds=params.worker_deadline,
            bookmark_file=str(self.dir / "run-storage.json"),
            batch_size=params.epoch_records,
        )
        return replace(spec, **overrides)

    def start(self, spec: WorkerSpec, arming: Arming | None = None) -> WorkerProcess:
        worker = WorkerProcess(spec, arming, self.dir / f"{spec.worker_id}.stderr")
        self._workers.append(worker)
        return worker

    def arming(self, point: Point, action: Action, hit: int | None = None, delay: float = 0.0) -> Arming:
        if hit is None:
            hit = 1 if point in ONCE_PER_RUN else self.params.hit
        return Arming(point, hit, action, delay, str(self.report))

    def fired(self) -> bool:
        return self.report.exists() and bool(self.report.read_text().strip())

    def finish(self, worker: WorkerProcess) -> int:
        return worker.wait(self.params.worker_deadline + 30)

    def recover(self, notes: list[str]) -> bool:
        """A fresh worker, without faults, until every produced record is certified (or synced).

        A stream left uncertain is released by the operator (noted) and the recovery run again.
        """
        for attempt in range(3):
            worker = self.start(self.spec(f"recovery{attempt}"))
            code = self.finish(worker)
            if code == EXIT_DONE:
                return True
            error = worker.error()
            if code == EXIT_HALTED and error is not None and error.data.get("kind") == "uncertain_outcome":
                notes.append(f"operator released an uncertain stream: {error.data.get('message')}")
                self.release()
                continue
            notes.append(f"recovery ended with {code}: {describe_event(error) or worker.tail()}")
            return False
        return False

    def judge(self, outcome: "CaseOutcome") -> Verdict:
        """The oracle's verdict on the destination: record by record against ``outcome``, or (a
        change source) row by row against the source table, which needs a recovered stream."""
        expected = self.source.state()
        if expected is None:
            return judge(outcome.must, outcome.may, self.sink.read())
        if outcome.must != all_keys(self.produced):
            raise HarnessError(f"a {self.pair.name} case is judged by state and must end recovered")
        return judge_state(expected, self.sink.rows(), self.certificates())

    def close(self) -> None:
        """Kill the workers still running, then drop what the source holds on the servers."""
        for worker in self._workers:
            worker.close()
        self.source.drop()


def describe_event(error: Event | None) -> str:
    """A worker's error event in one line, for a verdict's notes ("" when there is none)."""
    if error is None:
        return ""
    return f"{error.data.get('type')}: {error.data.get('message')}"


def all_keys(produced: Iterable[Produced]) -> set[Key]:
    """The keys of every record produced: what a recovered run must and may deliver."""
    return {item.key for item in produced}


def recovered_outcome(case: Case, fired: bool, halted: bool, notes: list[str]) -> CaseOutcome:
    """The outcome of a fault after which a fresh run recovers and must deliver every record."""
    recovered = case.recover(notes)
    everything = all_keys(case.produced)
    return CaseOutcome(fired, halted and recovered, everything, everything, notes)


def halted_outcome(
    case: Case,
    worker: WorkerProcess,
    code: int,
    fired: bool,
    kinds: set[str],
    notes: list[str],
    *,
    must: set[Key] | None,
    universe: set[Key],
    before: list[EpochCertificate] | None = None,
) -> CaseOutcome:
    """The outcome of a fault that must halt the stream with an error of one of ``kinds``, adding no
    certificate (when ``before`` is given).

    ``must`` is what the destination must hold (``None``: what the certificates cover). A sink with
    an atomic watermark must hold exactly that; one that cannot take back what it accepted (NATS)
    may also hold records of ``universe`` (read before the halt, never certified).
    """
    error = worker.error()
    halted = code == EXIT_HALTED and error is not None and error.data.get("kind") in kinds
    if not halted:
        notes.append(f"expected a halt with {sorted(kinds)}, got exit {code}: {describe_event(error)}")
    certificates = case.certificates()
    if before is not None and len(certificates) != len(before):
        notes.append(f"{len(certificates) - len(before)} certificate(s) were added after the fault")
        halted = False
    foreign = foreign_incarnations(certificates)
    if foreign:
        notes.append(f"certified in two incarnations: {', '.join(foreign)}")
        halted = False
    if must is None:
        must = covered(certificates, case.produced)
    exact = Mechanism.ATOMIC_WATERMARK in case.plan().mechanisms
    return CaseOutcome(fired, halted, must, must if exact else must | universe, notes)


__all__ = [
    "Case",
    "CaseOutcome",
    "CaseParams",
    "CaseResult",
    "all_keys",
    "describe_event",
    "halted_outcome",
    "recovered_outcome",
]
