"""Fault classes where the source changes under a consumer that lags or a bounded run that died.

``retention``   (continuous NATS pairs) a worker whose consumer window is small (``max_ack_pending``)
                is SIGSTOPped right after a certificate, while the server holds back every message
                past the window; the controller purges the stream from the start to half of what was
                produced (retention, expiry and a purge remove messages from the start alike), so
                undelivered messages are removed mid-session; SIGCONT. The session must stop with
                ``PositionUnavailable`` (the gap is loss, never proven absent), no certificate may
                cover anything past the gap, and the destination holds what the certificates cover
                (a NATS sink may also hold what was read and not certified before the halt), nothing
                of the records after the gap. Kafka retention is not modelled: see
                :data:`~faucet_dagster.testing.faults.pairs.KAFKA_PURGE` (the Tansu broker deletes no
                records).
``page_crash``  (bounded pairs) the sync is SIGKILLed right after its second page committed at the
                sink, before its bookmark and token are persisted; before the rerun the source
                changes: a source with retention (NATS) loses its ten oldest records (already at the
                sink), and new records arrive. The rerun (a fresh worker) must bring the destination
                to the source's true state: every record the source ever held, once (or at least once
                where the plan promises only that), none skipped by a watermark that counted rows.
"""

import signal
import time
from dataclasses import replace

from faucet_dagster.runner.faults import Action, Point
from faucet_dagster.testing.faults.case import (
    Case,
    CaseOutcome,
    all_keys,
    describe_event,
    halted_outcome,
    recovered_outcome,
)
from faucet_dagster.testing.faults.catalog import Fault
from faucet_dagster.testing.faults.pairs import NatsSource
from faucet_dagster.testing.faults.spec import Endpoint
from faucet_dagster.testing.faults.worker_process import HarnessError

LAG_WINDOW = 50
"""``max_ack_pending`` of the lagging consumer: far below what is produced, so most is held back."""
RETAINED_AFTER_CRASH = 10
"""How many of the oldest records retention removes between a bounded crash and its rerun."""


def retention(case: Case, fault: Fault) -> CaseOutcome:
    notes: list[str] = []
    source = Endpoint(case.source.connector, {**case.source.config(), "max_ack_pending": LAG_WINDOW})
    # A lease long enough to outlast the stop: the worker resumes as the owner and meets the gap.
    spec = replace(case.spec("w1", lease_seconds=60.0), source=source)
    worker = case.start(spec, case.arming(Point.AFTER_CERTIFICATE, Action.STOP, hit=1))
    deadline = time.monotonic() + case.params.worker_deadline
    while not (case.fired() and worker.is_stopped()):
        if worker.proc.poll() is not None or time.monotonic() > deadline:
            raise HarnessError(f"the worker never stopped after a certificate: {worker.tail()}")
        time.sleep(0.02)
    before = case.certificates()
    keep_from = case.produced[len(case.produced) // 2].position
    case.source.purge(keep_from)
    worker.send(signal.SIGCONT)
    code = case.finish(worker)
    gone = {item.key for item in case.produced if item.position < keep_from}
    outcome = halted_outcome(
        case,
        worker,
        code,
        True,
        {"position_unavailable"},
        notes,
        must=None,
        universe=gone,
    )
    # Certificates may be added before the gap (the window's messages), never past it.
    past = [
        item.end
        for certificate in case.certificates()[len(before) :]
        for item in certificate.coverage
        if int(item.end) >= keep_from
    ]
    if past:
        outcome.notes.append(f"certified past the gap: {', '.join(past)}")
        outcome.halted_correctly = False
    return outcome


def page_crash(case: Case, fault: Fault) -> CaseOutcome:
    notes: list[str] = []
    worker = case.start(case.spec("w1"), case.arming(Point.AFTER_PAGE, Action.KILL, hit=2))
    code = case.finish(worker)
    fired = case.fired() and code == -signal.SIGKILL
    if not fired:
        notes.append(
            f"the sync did not die after its second page (exit {code}): {describe_event(worker.error())}"
        )
    if isinstance(case.source, NatsSource):
        case.source.purge(case.produced[RETAINED_AFTER_CRASH].position)
    case.produce("p2", max(50, case.params.records // 10))
    outcome = recovered_outcome(case, fired, fired, notes)
    # Everything the source ever held: what retention removed had reached the sink before.
    outcome.must = outcome.may = all_keys(case.produced)
    return outcome


__all__ = ["page_crash", "retention"]
