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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from faucet_dagster.protocol import EpochCertificate, Mode
from faucet_dagster.runner.faults import Action, Point
from faucet_dagster.state import StateStore
from faucet_dagster.testing.faults.case import (
    Case,
    CaseOutcome,
    CaseParams,
    CaseResult,
    all_keys,
    describe_event,
    halted_outcome,
    recovered_outcome,
)
from faucet_dagster.testing.faults.catalog import (
    Fault,
    FaultKind,
    point_for,
)
from faucet_dagster.testing.faults.ddl import run_source_ddl
from faucet_dagster.testing.faults.lagging import page_crash, retention
from faucet_dagster.testing.faults.oracle import (
    duplicates_allowed,
)
from faucet_dagster.testing.faults.pairs import (
    Key,
    Pair,
    Servers,
)
from faucet_dagster.testing.faults.sink_sides import NatsSinkSide
from faucet_dagster.testing.faults.spec import (
    EXIT_DONE,
    EXIT_HALTED,
    Event,
)
from faucet_dagster.testing.faults.verification import verify_case
from faucet_dagster.testing.faults.worker_process import HarnessError, WorkerProcess

# -- one case -------------------------------------------------------------------------------------


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
    # What the owner certified before it stopped, from the store (its events of them may come after
    # SIGCONT: a pipelined worker reports an epoch once it is acknowledged).
    certified_before = _certified_by(case, owner)
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
    if _certified_by(case, owner) != certified_before:
        notes.append("the resumed owner certified an epoch after its lease expired")
        refused = False
    return recovered_outcome(case, True, took_over and refused, notes)


def _certified_by(case: Case, worker: WorkerProcess) -> list[int]:
    """The sequences of the certificates ``worker`` persisted."""
    return [c.sequence for c in case.certificates() if c.worker == worker.spec.worker_id]


def _part_way(case: Case, fault: str, notes: list[str]) -> tuple[WorkerProcess, bool]:
    """A worker with small epochs (pages), once it made ``restart_after`` of them, so a fault lands
    while many are still to come; and whether it is still running (else noted)."""
    small = max(50, case.params.records // 20)
    worker = case.start(case.spec("w1", epoch_records=small, batch_rows=small, batch_size=small))
    progress = "certified" if case.pair.mode is Mode.CONTINUOUS else "page"
    reached = worker.wait_for(
        lambda event: event.event == progress and worker.count(progress) >= case.params.restart_after,
        case.params.worker_deadline,
    )
    fired = reached is not None and worker.proc.poll() is None
    if not fired:
        notes.append(f"the worker finished before the {fault} ({worker.count(progress)} {progress} events)")
    return worker, fired


def _restart(case: Case, fault: Fault) -> CaseOutcome:
    assert fault.server is not None
    notes: list[str] = []
    worker, fired = _part_way(case, "restart", notes)
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


STOP_WINDOW = 3.0
"""The NATS duplicate window of a ``stop`` case (seconds): the successor starts after it passed."""


def _stop_resumed_after_window(case: Case, fault: Fault) -> CaseOutcome:
    """A clean stop part-way (a sensor stopped: the reader stops), then a successor started after the
    target stream's duplicate window passed. The stop must leave nothing published and uncertified
    (seal and certify, or stop publishing at the last tick): the successor's replay of it would be
    past the window and stored twice, so no duplicate is allowed, although the case outlasts the
    window."""
    notes: list[str] = []
    sink = case.sink
    assert isinstance(sink, NatsSinkSide)
    sink.use_window(STOP_WINDOW)
    worker = case.start(case.spec("w1", stop_after_epochs=case.params.hit))
    code = case.finish(worker)
    stopped = code == EXIT_DONE and worker.count("stopped") > 0
    if not stopped:
        notes.append(f"the worker did not stop cleanly (exit {code}): {describe_event(worker.error())}")
    time.sleep(STOP_WINDOW + 1.0)
    recovered = case.recover(notes)
    everything = all_keys(case.produced)
    return CaseOutcome(
        stopped, stopped and recovered, everything, everything, notes, duplicates_allowed=False
    )


def _delete(case: Case, fault: Fault) -> CaseOutcome:
    """Delete the source while a worker with small epochs (pages) reads it part-way: it must halt
    explicitly (no crash, no silent wait), keeping what it certified (a bounded sync: promising
    nothing)."""
    notes: list[str] = []
    worker, fired = _part_way(case, "deletion", notes)
    case.source.delete()
    code = case.finish(worker)
    if code == EXIT_DONE and not fired:
        return CaseOutcome(False, True, all_keys(case.produced), all_keys(case.produced), notes)
    must: set[Key] | None = set() if case.pair.mode is Mode.BOUNDED else None
    kinds = {"position_unavailable", "incarnation_changed"}
    return halted_outcome(
        case, worker, code, fired, kinds, notes, must=must, universe=all_keys(case.produced)
    )


EXIT_AFTER_FREEZE = 0.5
"""Seconds between freezing the destination and the worker's SIGTERM in an ``exit`` case."""


def _exit_with_frozen_sink(case: Case, fault: Fault) -> CaseOutcome:
    """Stop the worker cleanly (SIGTERM) while the NATS destination hangs: the close cannot settle.
    It must end within the sink's ``ack_timeout`` and leave the stream marked uncertain, so the next
    worker is refused until the operator releases it (:meth:`Case.recover` does, noting it)."""
    notes: list[str] = []
    worker = case.start(case.spec("w1"))
    reached = worker.wait_for(
        lambda event: event.event == "certified" and worker.count("certified") >= case.params.restart_after,
        case.params.worker_deadline,
    )
    fired = reached is not None and worker.proc.poll() is None
    if not fired:
        notes.append(f"the worker finished before the exit ({worker.count('certified')} certified)")
    nats = case.servers.nats
    with nats.frozen(at_most=case.params.worker_deadline):
        time.sleep(EXIT_AFTER_FREEZE)  # the next epoch publishes into the hung server
        worker.send(signal.SIGTERM)
        code = case.finish(worker)
    if not fired:
        return recovered_outcome(case, False, code == EXIT_DONE, notes)
    error = worker.error()
    with StateStore(case.state_url) as store:
        status = store.status(case.spec("check").stream)
    uncertain = bool(status) and status[0].uncertain
    marked = code == EXIT_HALTED and error is not None and error.data.get("kind") == "uncertain_outcome"
    if code == EXIT_DONE and not uncertain:
        notes.append("the close settled before the destination hung: nothing was in doubt")
    elif not (marked and uncertain):
        notes.append(
            f"the exit left the stream {'marked' if uncertain else 'not marked'} uncertain, exit {code}: "
            f"{describe_event(error)}"
        )
    return recovered_outcome(case, fired, code == EXIT_DONE or (marked and uncertain), notes)


def _first_run(case: Case, notes: list[str]) -> tuple[list[EpochCertificate], set[Key]]:
    """Run the stream over everything produced so far; return its certificates and the keys."""
    first = case.start(case.spec("w1"))
    if case.finish(first) != EXIT_DONE:
        notes.append(f"the first run did not finish: {describe_event(first.error())}")
    return case.certificates(), all_keys(case.produced)


def _failed_commit(case: Case, fault: Fault) -> CaseOutcome:
    """The ``hit``-th commit is refused while the next epoch is read ahead; the worker retries (a
    retryable failure) from the certified positions and finishes on its own."""
    notes: list[str] = []
    worker = case.start(case.spec("w1"), case.arming(Point.DURING_SINK_COMMIT, Action.FAIL))
    code = case.finish(worker)
    fired = case.fired() and worker.count("retry") > 0
    if not fired:
        notes.append(f"the commit was not refused as scheduled (exit {code}): {worker.tail()}")
    if code != EXIT_DONE:
        notes.append(f"the worker exited with {code}: {describe_event(worker.error())}")
    return recovered_outcome(case, fired, code == EXIT_DONE, notes)


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
    FaultKind.DELETE: _delete,
    FaultKind.EXIT: _exit_with_frozen_sink,
    FaultKind.STOP: _stop_resumed_after_window,
    FaultKind.PURGE: _purge,
    FaultKind.DDL: _ddl,
    FaultKind.SNAPSHOT_CRASH: _snapshot_crash,
    FaultKind.FAILED_COMMIT: _failed_commit,
    FaultKind.RETENTION: retention,
    FaultKind.PAGE_CRASH: page_crash,
}


def _runner(kind: FaultKind) -> Callable[[Case, Fault], CaseOutcome]:
    return _RUNNERS[kind]


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
        verification = verify_case(case, fault)
    finally:
        case.close()
    seconds = time.monotonic() - started
    result = CaseResult(
        pair=pair.name,
        fault=fault.name,
        params=params,
        delivery=plan.delivery.value,
        duplicates_allowed=duplicates_allowed(plan, seconds)
        if outcome.duplicates_allowed is None
        else outcome.duplicates_allowed,
        verdict=verdict,
        fired=outcome.fired,
        halted_correctly=outcome.halted_correctly,
        seconds=seconds,
        notes=(*outcome.notes, *verification.unexplained),
        verification=verification,
    )
    (case.dir / "result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


__all__ = ["Case", "CaseParams", "CaseResult", "run_case"]


@dataclass(frozen=True)
class CrashOutcome:
    """What :func:`snapshot_crash` established: whether the kill landed where scheduled, whether the
    stream recovered, and notes for the verdict."""

    fired: bool
    recovered: bool
    notes: tuple[str, ...]


def snapshot_crash(case: "Case") -> CrashOutcome:
    """Kill the first worker after the sink committed its first epoch (the snapshot's), change rows
    the snapshot read and write new ones, then recover with a fresh worker."""
    notes: list[str] = []
    worker = case.start(case.spec("w1"), case.arming(Point.AFTER_SINK_COMMIT, Action.KILL, hit=1))
    code = case.finish(worker)
    fired = case.fired() and code == -signal.SIGKILL
    if not fired:
        notes.append(f"the worker was not killed after its first commit (exit {code}): {worker.tail()}")
    if case.certificates():
        notes.append("the snapshot's epoch was certified before the kill")
        fired = False
    case.produced += case.source.change_existing("p1")
    case.produce("p2", max(50, case.params.records // 10))
    recovered = case.recover(notes)
    return CrashOutcome(fired, recovered, tuple(notes))
