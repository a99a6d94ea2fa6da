"""How one case (a pair, a fault, its parameters) runs from setup to verdict.

Every case creates its own source and destination, produces records, runs a worker process with the
fault, then (unless the fault must halt the stream) a fresh recovery worker until every produced
record is certified, and finally asks the oracle about every key (a change source's replica: about
every row of the source table, :func:`~.oracle.judge_state`). The kinds of fault are
described in :mod:`.catalog`.
"""

import json
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from faucet_dagster.planner import Mechanism, Plan
from faucet_dagster.protocol import EpochCertificate, Mode
from faucet_dagster.runner.faults import Action, Arming, Point
from faucet_dagster.state import StateStore
from faucet_dagster.testing.faults.catalog import (
    ONCE_PER_RUN,
    Fault,
    FaultKind,
    point_for,
)
from faucet_dagster.testing.faults.cdc_variants import snapshot_crash
from faucet_dagster.testing.faults.ddl import run_source_ddl
from faucet_dagster.testing.faults.oracle import (
    Verdict,
    covered,
    duplicates_allowed,
    foreign_incarnations,
    judge,
    judge_state,
)
from faucet_dagster.testing.faults.pairs import (
    Key,
    Pair,
    Produced,
    Servers,
)
from faucet_dagster.testing.faults.spec import (
    EXIT_DONE,
    EXIT_HALTED,
    Endpoint,
    Event,
    WorkerSpec,
)
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
    duplicate beyond what the plan allows, and the stream halted (or recovered) as it should."""

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
        )


# -- one case -------------------------------------------------------------------------------------


@dataclass
class CaseOutcome:
    """What a fault's run established, for the verdict."""

    fired: bool
    halted_correctly: bool
    must: set[Key]
    may: set[Key]
    notes: list[str] = field(default_factory=list)


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


def _point(case: Case, fault: Fault) -> CaseOutcome:
    assert fault.moment is not None and fault.action is not None
    point = point_for(case.pair, fault.moment)
    assert point is not None
    action, spec = fault.action, case.spec("w1")
    if point is Point.DURING_ACK and action is Action.KILL:
        action = Action.KILL_SOON  # lands while the provider acknowledgement is in flight
    if point is Point.DURING_SINK_CLOSE and case.pair.mode is Mode.CONTINUOUS:
        # Stop part-way after some epochs: the close then follows an aborted epoch.
        spec = replace(spec, stop_after_epochs=case.params.hit)
    worker = case.start(spec, case.arming(point, action, delay=case.params.kill_delay))
    code = case.finish(worker)
    fired = case.fired()
    notes: list[str] = []
    if not fired:
        notes.append(f"the point {point} was not reached (exit {code})")
    expected = -signal.SIGKILL if action in (Action.KILL, Action.KILL_SOON) else EXIT_DONE
    if code != expected:
        notes.append(
            f"the faulted worker exited with {code}, expected {expected}: {describe_event(worker.error())}"
        )
    return recovered_outcome(case, fired, fired and code == expected, notes)


def _random(case: Case, fault: Fault) -> CaseOutcome:
    worker = case.start(case.spec("w1"))
    notes: list[str] = []
    after = case.params.random_after

    def progressed(event: Event) -> bool:
        return event.event == "started" if after == 0 else worker.count("certified", "page") >= after

    if worker.wait_for(progressed, case.params.worker_deadline) is None:
        notes.append(
            f"the worker did not make {after} steps: {describe_event(worker.error()) or worker.tail()}"
        )
    time.sleep(case.params.random_delay)
    sig = signal.SIGKILL if fault.action is Action.KILL else signal.SIGTERM
    fired = worker.send(sig)
    code = case.finish(worker)
    if code == EXIT_DONE and worker.count("done"):
        fired = False  # it was exiting when the signal was sent
    expected = (-signal.SIGKILL if sig is signal.SIGKILL else EXIT_DONE) if fired else EXIT_DONE
    if not fired:
        notes.append(f"the worker finished before the {sig.name}")
    if code != expected:
        notes.append(f"the worker exited with {code}, expected {expected}: {describe_event(worker.error())}")
    return recovered_outcome(case, fired, code == expected, notes)


def _zombie(case: Case, fault: Fault) -> CaseOutcome:
    assert fault.moment is not None
    point = point_for(case.pair, fault.moment)
    assert point is not None
    notes: list[str] = []
    owner = case.start(case.spec("zombie", retry_ownership=False), case.arming(point, Action.STOP))
    deadline = time.monotonic() + case.params.worker_deadline
    while not (case.fired() and owner.is_stopped()):
        if owner.proc.poll() is not None or time.monotonic() > deadline:
            notes.append(f"the owner never stopped at {point} (exit {owner.proc.poll()}): {owner.tail()}")
            return recovered_outcome(case, False, False, notes)
        time.sleep(0.02)
    time.sleep(case.params.lease_seconds + 0.3)  # past the owner's lease
    certified_before = owner.count("certified")  # every event it wrote before stopping is read by now
    successor = case.start(case.spec("successor", stop_after_epochs=2))
    successor_code = case.finish(successor)
    took_over = successor_code == EXIT_DONE and successor.count("certified") > 0
    if not took_over:
        notes.append(f"the successor exited with {successor_code}: {describe_event(successor.error())}")
    owner.send(signal.SIGCONT)
    owner_code = case.finish(owner)
    error = owner.error()
    refused = owner_code == EXIT_HALTED and error is not None and error.data.get("kind") == "ownership_lost"
    if not refused:
        notes.append(f"the resumed owner exited with {owner_code}: {describe_event(error) or owner.tail()}")
    if owner.count("certified") > certified_before:
        notes.append("the resumed owner certified an epoch after its lease expired")
        refused = False
    return recovered_outcome(case, True, took_over and refused, notes)


def _restart(case: Case, fault: Fault) -> CaseOutcome:
    assert fault.server is not None
    notes: list[str] = []
    # Small epochs (pages), so the restart lands while many are still to come.
    small = max(50, case.params.records // 20)
    worker = case.start(case.spec("w1", epoch_records=small, batch_rows=small, batch_size=small))
    progress = "certified" if case.pair.mode is Mode.CONTINUOUS else "page"
    reached = worker.wait_for(
        lambda event: event.event == progress and worker.count(progress) >= case.params.restart_after,
        case.params.worker_deadline,
    )
    fired = reached is not None and worker.proc.poll() is None
    if not fired:
        notes.append(f"the worker finished before the restart ({worker.count(progress)} {progress} events)")
    server = case.servers.server(fault.server)
    if fault.server == "kafka":
        server.kill()  # its storage is in memory: a graceful stop would lose the same
    server.restart()
    code = case.finish(worker)
    if fault.server != "kafka":
        if code != EXIT_DONE:
            error = worker.error()
            notes.append(f"the worker ended with {code} after the restart: {describe_event(error)}")
        return recovered_outcome(case, fired, True, notes)
    if code == EXIT_DONE:
        # Everything was read before the broker went away (the client fetches ahead): nothing was
        # left to skip, and every record must have arrived.
        notes.append("the worker finished from what it had fetched before the broker restarted")
        return CaseOutcome(fired, True, all_keys(case.produced), all_keys(case.produced), notes)
    # The in-memory broker lost the topic: the stream must halt explicitly. A bounded sync that did
    # not finish promised nothing; a continuous stream promised what its certificates cover.
    must: set[Key] | None = set() if case.pair.mode is Mode.BOUNDED else None
    kinds = {"position_unavailable", "incarnation_changed", "config"}
    return halted_outcome(
        case, worker, code, fired, kinds, notes, must=must, universe=all_keys(case.produced)
    )


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


def _first_run(case: Case, notes: list[str]) -> tuple[list[EpochCertificate], set[Key]]:
    """Run the stream over everything produced so far; return its certificates and the keys."""
    first = case.start(case.spec("w1"))
    if case.finish(first) != EXIT_DONE:
        notes.append(f"the first run did not finish: {describe_event(first.error())}")
    return case.certificates(), all_keys(case.produced)


def _recreate(case: Case, fault: Fault) -> CaseOutcome:
    notes: list[str] = []
    before, stored = _first_run(case, notes)
    case.source.recreate()
    case.produce("p2", max(100, case.params.records // 4))
    worker = case.start(case.spec("w2"))
    code = case.finish(worker)
    # The first run certified (or synced) everything of the old incarnation; nothing new may land.
    return halted_outcome(
        case, worker, code, True, {"incarnation_changed"}, notes, must=stored, universe=stored, before=before
    )


def _purge(case: Case, fault: Fault) -> CaseOutcome:
    notes: list[str] = []
    before, stored = _first_run(case, notes)
    later = case.produce("p2", max(100, case.params.records // 4))
    case.source.purge(later[0].position + 1)  # the first position after the certified one is gone
    worker = case.start(case.spec("w2"))
    code = case.finish(worker)
    return halted_outcome(
        case, worker, code, True, {"position_unavailable"}, notes, must=stored, universe=stored, before=before
    )


def _ddl(case: Case, fault: Fault) -> CaseOutcome:
    result = run_source_ddl(case)
    return CaseOutcome(
        True, result.halted_correctly, all_keys(case.produced), all_keys(case.produced), result.notes
    )


def _snapshot_crash(case: Case, fault: Fault) -> CaseOutcome:
    crashed = snapshot_crash(case)
    return CaseOutcome(
        crashed.fired, crashed.recovered, all_keys(case.produced), all_keys(case.produced), [*crashed.notes]
    )


_RUNNERS: dict[FaultKind, Callable[[Case, Fault], CaseOutcome]] = {
    FaultKind.POINT: _point,
    FaultKind.RANDOM: _random,
    FaultKind.ZOMBIE: _zombie,
    FaultKind.RESTART: _restart,
    FaultKind.RECREATE: _recreate,
    FaultKind.PURGE: _purge,
    FaultKind.DDL: _ddl,
    FaultKind.SNAPSHOT_CRASH: _snapshot_crash,
}


def _runner(kind: FaultKind) -> Callable[[Case, Fault], CaseOutcome]:
    from faucet_dagster.testing.faults import lagging  # builds on this module

    return _RUNNERS.get(kind) or lagging.RUNNERS[kind]


def run_case(servers: Servers, root: Path, pair: Pair, fault: Fault, params: CaseParams) -> CaseResult:
    """Run ``fault`` on a fresh instance of ``pair`` under ``root`` and judge every record."""
    started = time.monotonic()
    case = Case(servers, root, pair, params)
    plan = case.plan()
    try:
        case.prepare()
        case.produce("p1", params.records)
        try:
            outcome = _runner(fault.kind)(case, fault)
        except HarnessError as exc:
            outcome = CaseOutcome(False, False, all_keys(case.produced), all_keys(case.produced), [str(exc)])
        verdict = case.judge(outcome)
    finally:
        case.close()
    seconds = time.monotonic() - started
    result = CaseResult(
        pair=pair.name,
        fault=fault.name,
        params=params,
        delivery=plan.delivery.value,
        duplicates_allowed=duplicates_allowed(plan, seconds),
        verdict=verdict,
        fired=outcome.fired,
        halted_correctly=outcome.halted_correctly,
        seconds=seconds,
        notes=tuple(outcome.notes),
    )
    (case.dir / "result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


__all__ = ["Case", "CaseParams", "CaseResult", "run_case"]
