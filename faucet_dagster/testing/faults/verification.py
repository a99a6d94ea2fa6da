"""Every case of the fault harness verified: after the oracle's verdict, ``faucet verify`` checks every
certificate the case's workers wrote (:func:`faucet_dagster.verify.verify_stream`), with the case's
own connectors and no fault points.

An untouched run after crashes, zombies and hand-overs must verify clean: every certificate verified.
Where the fault itself took the certified ranges away (a purge, retention, a recreated source, a
broker that lost its topic) or the source can never re-read them (a change source: its slot confirmed
them), the verification must say so and nothing else: the findings the fault explains
(:func:`expected_kinds`) are allowed, any other is a failure of the case. Bounded syncs are verified
from the beginning to the bookmark their last run left (:func:`faucet_dagster.verify.verify_sync`):
the destination table must then hold exactly what the source holds up to there.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from faucet_dagster.pipeline import PipelineOptions
from faucet_dagster.planner import Plan
from faucet_dagster.protocol import Mode, ReadLimits, WritePolicy, get_connector
from faucet_dagster.runner.spec import StreamSpec
from faucet_dagster.runner.sync import run_sync
from faucet_dagster.state import StateStore
from faucet_dagster.testing.faults.catalog import Fault, FaultKind
from faucet_dagster.testing.faults.pairs import Pair
from faucet_dagster.testing.faults.source_sides import NatsSource, PostgresChangesSource
from faucet_dagster.testing.faults.spec import Endpoint, WorkerSpec
from faucet_dagster.testing.faults.worker import RunStorage
from faucet_dagster.verify import Outcome, Report, SyncRun, VerifyOptions, verify_stream, verify_sync

EVERYTHING = 1_000_000
"""A limit no case reaches: every certificate of a case is verified."""
GONE = frozenset({"not replayable", "not re-read", "not compared"})
"""What a verification says of ranges the source no longer holds."""


@dataclass(frozen=True)
class CaseVerification:
    """How a case's certificates verified: counts by outcome, the kinds of problem found, and the
    ones the fault does not explain (``unexplained``: the case fails)."""

    verified: int
    diverged: int
    not_verifiable: int
    kinds: tuple[str, ...]
    unexplained: tuple[str, ...]
    seconds: float

    @property
    def clean(self) -> bool:
        return not self.unexplained


class VerifiedCase(Protocol):
    """What the verification reads of a case (:class:`~faucet_dagster.testing.faults.case.Case`)."""

    name: str
    state_url: str
    pair: Pair

    def endpoints(self) -> tuple[Endpoint, Endpoint]: ...
    def plan(self) -> Plan: ...
    def spec(self, worker: str, **overrides: Any) -> WorkerSpec: ...


def verified_cell(results: Sequence["HasVerification"]) -> str:
    """The harness table's cell for the runs of one fault: certificates verified, diverged (d) and not
    verifiable (n/v) in all, with the kinds found (each explained by the fault, or the run failed);
    ``-`` for runs not verified (bounded pairs)."""
    verifications = [result.verification for result in results if result.verification is not None]
    if not verifications:
        return "-"
    verified = sum(item.verified for item in verifications)
    diverged = sum(item.diverged for item in verifications)
    unknown = sum(item.not_verifiable for item in verifications)
    kinds = sorted({kind for item in verifications for kind in item.kinds})
    counts = (
        f"{verified} ok" + (f", {diverged} d" if diverged else "") + (f", {unknown} n/v" if unknown else "")
    )
    return counts + (f" ({', '.join(kinds)})" if kinds else "")


class HasVerification(Protocol):
    """A case's result (:class:`~faucet_dagster.testing.faults.case.CaseResult`), as the table reads it."""

    @property
    def verification(self) -> CaseVerification | None: ...


def expected_kinds(case: VerifiedCase, fault: Fault) -> frozenset[str]:
    """The findings ``fault`` explains on ``case``'s pair (anything else must not be found)."""
    kinds: set[str] = set()
    if issubclass(case.pair.source, PostgresChangesSource):
        kinds |= GONE | {"claims no rows"}  # a slot never re-delivers what it confirmed
    if fault.kind is FaultKind.RECREATE:
        kinds |= {"source re-created", "not compared"}
    if fault.kind in (FaultKind.PURGE, FaultKind.RETENTION):
        kinds |= GONE
    if fault.kind is FaultKind.DELETE:
        kinds |= GONE  # the topic is gone: no range of it can be re-read
    if fault.kind is FaultKind.PAGE_CRASH and issubclass(case.pair.source, NatsSource):
        kinds |= GONE  # the stream is purged between the crash and the rerun
    if fault.kind is FaultKind.RESTART and fault.server == "kafka":
        kinds |= GONE | {"source re-created"}  # the in-memory broker lost the topic
    return frozenset(kinds)


def verify_case(case: VerifiedCase, fault: Fault) -> CaseVerification:
    """Verify every certificate of ``case`` (a bounded pair: everything its runs synced, from the
    beginning to the bookmark its last run left, against the whole destination table)."""
    if case.pair.mode is Mode.CONTINUOUS:
        report = run_sync(_verify_stream(case))
    else:
        report = run_sync(_verify_runs(case))
    tally = Counter(item.outcome for item in report.verifications)
    kinds = sorted({problem.kind for item in report.verifications for problem in item.problems})
    allowed = expected_kinds(case, fault)
    unexplained = [
        f"#{item.sequence} {problem.describe()}"
        for item in report.verifications
        for problem in item.problems
        if problem.kind not in allowed
    ]
    return CaseVerification(
        tally[Outcome.VERIFIED],
        tally[Outcome.DIVERGED],
        tally[Outcome.NOT_VERIFIABLE],
        tuple(kinds),
        tuple(unexplained),
        report.seconds,
    )


async def _verify_stream(case: VerifiedCase) -> Report:
    source, sink = case.endpoints()
    spec = case.spec("verifier")
    stream = StreamSpec(
        name=case.name,
        source=get_connector(source.connector).stream_source(source.config),
        sink=get_connector(sink.connector).streaming_sink(sink.config),
        resources=spec.resources,
        policy=WritePolicy(spec.policy),
        limits=ReadLimits(records=spec.epoch_records),
        pipeline=PipelineOptions(batch_rows=spec.batch_rows),
    )
    with StateStore(case.state_url) as store:
        return await verify_stream(stream, store, VerifyOptions(first=1, limit=EVERYTHING, record=False))


async def _verify_runs(case: VerifiedCase) -> Report:
    source, sink_endpoint = case.endpoints()
    spec = case.spec("verifier")
    stored = RunStorage.read(spec.bookmark_file)
    sink = get_connector(sink_endpoint.connector).sink(sink_endpoint.config)
    try:
        return await verify_sync(
            case.name,
            lambda: get_connector(source.connector).source(source.config),
            sink,
            [SyncRun(1, None, stored.bookmark, "every run")],
            total=1,
            batch_size=spec.batch_size,
            delivery=case.plan().delivery,
        )
    finally:
        await sink.close()


__all__ = ["CaseVerification", "VerifiedCase", "expected_kinds", "verified_cell", "verify_case"]
