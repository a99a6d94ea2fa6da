"""The battery's self-test: every check against the deliberately broken connectors of :mod:`.broken`.

Each :class:`SelfTestCase` names a check, a broken connector (a shipped connector wrapped or
subclassed to break exactly one rule, the way a careless author would) and what the failure must
say. A case holds when the check fails with a :class:`ConformanceFailure` naming one of the case's
rules (so the fault is put where it belongs: a raw connector exception, or another rule, is a failed
case). The generated scenarios (check ``scenarios``) must catch their broken connectors under
*every* seed: a case of theirs runs under several seeds, each a different scenario.
``tests/conformance/test_battery_catches_broken.py`` runs every case; ``faucet conformance
--self-test`` prints the table of broken connector x seed -> the step that caught it.
"""

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from faucet_dagster.conformance import broken, targets
from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import DEFAULT_OPTIONS, ConformanceFailure, ConformanceOptions
from faucet_dagster.conformance.scenarios import (
    bounded_sink_steps,
    bounded_source,
    sink_model,
    stream_source_steps,
)
from faucet_dagster.conformance.setup import ConfigFactory, Setup
from faucet_dagster.conformance.suites import CHECKS_BY_ID, run_check
from faucet_dagster.protocol import ConnectorSpec, Role

WITHIN_WINDOW = ConformanceOptions(replay_duplicates="within_window")
SEEDS = 5
"""How many seeds ``faucet conformance --self-test`` runs each scenario case under."""


@dataclass(frozen=True)
class SelfTestCase:
    """``check`` must catch ``broken`` (built by ``spec()``) in ``role`` on ``factory``'s setup, with
    a failure whose message holds every one of ``fragments``."""

    check: str
    broken: str
    spec: Callable[[], ConnectorSpec]
    role: Role
    factory: ConfigFactory
    fragments: tuple[str, ...]
    options: ConformanceOptions = field(default=DEFAULT_OPTIONS)
    rules: tuple[str, ...] = ()
    """The rules a failure may name (default: the check's own)."""
    dimension: str | None = None
    """The dimension of the generated scenarios this broken connector breaks (issue 30's list)."""

    @property
    def id(self) -> str:
        return f"{self.check}-{self.broken}"

    @property
    def accepted(self) -> tuple[str, ...]:
        return self.rules or (CHECKS_BY_ID[self.check].rule,)

    @property
    def seeded(self) -> bool:
        return self.check == "scenarios"


def _files(source: type[Any], config_model: Any = None) -> Callable[[], ConnectorSpec]:
    return lambda: broken.spec_with("files", Role.SOURCE, source, config_model)


def _sql(sink: type[Any]) -> Callable[[], ConnectorSpec]:
    return lambda: broken.spec_with("sql", Role.SINK, sink)


def _stream(name: str, session: type[broken.WrappedSession]) -> Callable[[], ConnectorSpec]:
    return lambda: broken.stream_source(name, session)


def _sink(
    name: str, session: type[broken.WrappedSinkSession], claims: Mapping[str, Any] | None = None
) -> Callable[[], ConnectorSpec]:
    return lambda: broken.streaming_sink(name, session, dict(claims or {}))


def _case(
    check: str,
    broken_type: type[Any],
    spec: Callable[[], ConnectorSpec],
    role: Role,
    factory: ConfigFactory,
    *fragments: str,
    options: ConformanceOptions = DEFAULT_OPTIONS,
    label: str | None = None,
) -> SelfTestCase:
    return SelfTestCase(check, label or broken_type.__name__, spec, role, factory, fragments, options)


def _scenario(
    broken_type: type[Any],
    spec: Callable[[], ConnectorSpec],
    role: Role,
    factory: ConfigFactory,
    *rules: str,
    dimension: str | None = None,
    options: ConformanceOptions = DEFAULT_OPTIONS,
    label: str | None = None,
) -> SelfTestCase:
    """A broken connector the generated scenarios catch (under every seed), naming one of ``rules``."""
    return SelfTestCase(
        "scenarios", label or broken_type.__name__, spec, role, factory, (), options, rules, dimension
    )


_SOURCE, _SINK = Role.SOURCE, Role.SINK
_STREAM, _STREAMING = Role.STREAM_SOURCE, Role.STREAMING_SINK
_FILES, _SQL = targets.files_source, targets.sql_sink
_NATS, _NATS_SINK = targets.nats_source, targets.nats_sink

_PG_SINK, _CDC = targets.postgres_streaming_sink, targets.postgres_cdc_source
_SR, _SK = stream_source_steps, sink_model


def _pg_sink(session: type[broken.WrappedSinkSession], sink: Any = None) -> Callable[[], ConnectorSpec]:
    if sink is None:
        return _sink("postgres", session)
    return lambda: broken.wrapping("postgres", Role.STREAMING_SINK, sink, session, None)


CASES: tuple[SelfTestCase, ...] = (
    _case(
        "config_schema", broken.InvalidSchemaSource, _files(broken.InvalidSchemaSource), _SOURCE, _FILES,
        "not a valid JSON Schema",
    ),
    _case(
        "config_schema", broken.RenamedFieldSchemaSource, _files(broken.RenamedFieldSchemaSource), _SOURCE,
        _FILES, "does not validate against its schema",
    ),
    _case(
        "bounded_memory", broken.OversizedPagesSource, _files(broken.OversizedPagesSource), _SOURCE, _FILES,
        "more than batch_size",
    ),
    _case(
        "bounded_memory", broken.BufferingSource, _files(broken.BufferingSource), _SOURCE, _FILES,
        "must not buffer",
    ),
    _case(
        "bounded_memory", broken.NativeBufferingSource, _files(broken.NativeBufferingSource), _SOURCE, _FILES,
        "must not buffer", "natively",
    ),
    _case(
        "bounded_memory", broken.ChildBufferingSource, _files(broken.ChildBufferingSource), _SOURCE, _FILES,
        "must not buffer", "helper process",
    ),
    _case(
        "capabilities", broken.EmptyDiscoverySource, _files(broken.EmptyDiscoverySource), _SOURCE, _FILES,
        "discover",
    ),
    _case(
        "capabilities", broken.ModeBlindDedupSink, _sql(broken.ModeBlindDedupSink), _SINK, _SQL, "live config"
    ),
    _case(
        "capabilities", broken.FirstConfigDedupSink, _sql(broken.FirstConfigDedupSink), _SINK, _SQL,
        "live config",
    ),
    _case(
        "capabilities", broken.AppendingUpsertSink, _sql(broken.AppendingUpsertSink), _SINK, _SQL,
        "dedups_by_key()",
    ),
    _case(
        "capabilities", broken.NoEvolutionSink, _sql(broken.NoEvolutionSink), _SINK, _SQL,
        "did not add the column",
    ),
    _case(
        "no_panic", broken.StrictConfig, _files(broken.FilesSource, broken.StrictConfig), _SOURCE, _FILES,
        "KeyError",
    ),
    _case(
        "no_panic", broken.HangingSource, _files(broken.HangingSource), _SOURCE, _FILES, "a hang",
        options=ConformanceOptions(timeout=2),
    ),
    _case("no_panic", broken.LeakySource, _files(broken.LeakySource), _SOURCE, _FILES, "ValueError"),
    *(
        _case(
            "no_panic", source, _files(source), _SOURCE, _FILES,
            f"{call} on an unreachable endpoint raised", "instead of a FaucetError",
        )
        for source, call in (
            (broken.RawCheckSource, "check()"),
            (broken.RawShardsSource, "enumerate_shards()"),
            (broken.RawCaptureSource, "capture_resume_position()"),
        )
    ),
    _case(
        "no_panic", broken.EmptyIsAnErrorSource, _files(broken.EmptyIsAnErrorSource), _SOURCE, _FILES,
        "empty dataset",
    ),
    _case(
        "slow_sink", broken.ImpatientSession, _stream("nats", broken.ImpatientSession), _STREAM, _NATS,
        "TimeoutError",
    ),
    _case(
        "slow_sink", broken.LoopBlockingSession, _stream("nats", broken.LoopBlockingSession), _STREAM, _NATS,
        "redelivered",
    ),
    _case(
        "cancel_during_read", broken.DeafSession, _stream("nats", broken.DeafSession), _STREAM, _NATS,
        "a hang", options=ConformanceOptions(timeout=3),
    ),
    _case(
        "cancel_during_read", broken.CancelIsAnErrorSession, _stream("nats", broken.CancelIsAnErrorSession),
        _STREAM, _NATS, "cancellation is an interruption",
    ),
    _case(
        "failed_writes", broken.SwallowingSession, _sink("nats", broken.SwallowingSession), _STREAMING,
        _NATS_SINK, "commit_epoch returned", options=WITHIN_WINDOW,
    ),
    _case(
        "failed_writes", broken.DroppingRefusedSession, _sink("nats", broken.DroppingRefusedSession),
        _STREAMING, _NATS_SINK, "commit_epoch returned", options=WITHIN_WINDOW,
    ),
    _case(
        "uncertain_commit", broken.LateCommitSession, _sink("postgres", broken.LateCommitSession), _STREAMING,
        _PG_SINK, "outlived the session",
    ),
    _case(
        "uncertain_commit", broken.StaleWatermarkSession, _sink("postgres", broken.StaleWatermarkSession),
        _STREAMING, _PG_SINK, "commit atomically",
    ),
    _case(
        "lifecycle_order", broken.LenientSession, _sink("postgres", broken.LenientSession), _STREAMING,
        _PG_SINK, "was accepted",
    ),
    _case(
        "lifecycle_order", broken.RebeginSession, _sink("postgres", broken.RebeginSession), _STREAMING,
        _PG_SINK, "begin_epoch twice was accepted",
    ),
    _case(
        "shutdown_with_outstanding_work", broken.EagerCloseSession,
        # Caught as "changed after close" or as "shows rows of an epoch that never committed",
        # depending on whether its late commit lands before the battery's first look.
        _sink("postgres", broken.EagerCloseSession), _STREAMING, _PG_SINK,
    ),
    _case(
        "shutdown_with_outstanding_work", broken.ConfidentCloseSession,
        _sink("nats", broken.ConfidentCloseSession), _STREAMING, _NATS_SINK, "stalled",
        options=WITHIN_WINDOW,
    ),
    _case(
        "shutdown_with_outstanding_work", broken.FinishTheBatchSession,
        _sink("nats", broken.FinishTheBatchSession), _STREAMING, _NATS_SINK, "swallowed the cancellation",
        options=WITHIN_WINDOW,
    ),
    # -- the generated scenarios: one broken connector per dimension, then the old per-case checks'
    _scenario(
        broken.StreamBlindSink, _pg_sink(broken.StreamBlindSession, broken.StreamBlindSink), _STREAMING,
        _PG_SINK, _SK.STATE_RULE, _SK.WORKS_RULE, _SK.POLICY_RULE, _SK.ATOMIC_RULE,
        dimension="several streams",
    ),
    _scenario(
        broken.OneWatermarkSession, _pg_sink(broken.OneWatermarkSession), _STREAMING, _PG_SINK,
        _SK.STATE_RULE, _SK.POLICY_RULE, _SK.ATOMIC_RULE, _SK.RECEIPT_RULE, dimension="several domains",
    ),
    _scenario(
        broken.MisroutedResourceSession, _pg_sink(broken.MisroutedResourceSession), _STREAMING, _PG_SINK,
        _SK.RECEIPT_RULE, _SK.POLICY_RULE, dimension="several resources",
    ),
    _scenario(
        broken.FirstWinsUpsertSession, _pg_sink(broken.FirstWinsUpsertSession), _STREAMING, _PG_SINK,
        _SK.POLICY_RULE, _SK.RECEIPT_RULE, dimension="continuous upsert",
    ),
    _scenario(
        broken.FoldedNamesSession, _pg_sink(broken.FoldedNamesSession), _STREAMING, _PG_SINK,
        _SK.RECEIPT_RULE, _SK.POLICY_RULE, _SK.NAME_RULE, dimension="hostile identifiers",
    ),
    _scenario(
        broken.IncarnationBlindSource,
        lambda: broken.wrapping(
            "nats", Role.STREAM_SOURCE, broken.IncarnationBlindSource, broken.WrappedSession
        ),
        _STREAM, _NATS, _SR.INCARNATION_RULE, dimension="re-creation",
    ),
    _scenario(
        broken.ProcessTokenSink, _sql(broken.ProcessTokenSink), _SINK, _SQL,
        bounded_sink_steps.TOKEN_RULE, bounded_sink_steps.REPLAY_RULE, dimension="tokens across processes",
    ),
    _scenario(
        broken.OneCallTwoCommitsSink, _sql(broken.OneCallTwoCommitsSink), _SINK, _SQL,
        bounded_sink_steps.REPLAY_RULE, dimension="a double commit inside one synchronous call",
    ),
    _scenario(
        broken.CursorOnlyResumeSource,
        lambda: broken.spec_with("postgres", Role.SOURCE, broken.CursorOnlyResumeSource),
        _SOURCE, targets.postgres_source, bounded_source.RESUME_RULE, dimension="cursor resumes",
    ),
    _scenario(
        broken.NameOrderFilesSource, _files(broken.NameOrderFilesSource), _SOURCE, _FILES,
        bounded_source.RESUME_RULE, dimension="file-order resumes",
    ),
    _scenario(
        broken.ForgetfulSource, _files(broken.ForgetfulSource), _SOURCE, _FILES, bounded_source.RESUME_RULE
    ),
    _scenario(
        broken.LaggingBookmarkSource, _files(broken.LaggingBookmarkSource), _SOURCE, _FILES,
        bounded_source.RESUME_RULE,
    ),
    _scenario(
        broken.TokenBlindSink, _sql(broken.TokenBlindSink), _SINK, _SQL, bounded_sink_steps.REPLAY_RULE
    ),
    _scenario(
        broken.TwoTransactionSink, _sql(broken.TwoTransactionSink), _SINK, _SQL,
        bounded_sink_steps.REPLAY_RULE,
    ),
    _scenario(
        broken.StaleWatermarkSession, _pg_sink(broken.StaleWatermarkSession), _STREAMING, _PG_SINK,
        _SK.STATE_RULE,
    ),
    _scenario(
        broken.WrappedSinkSession, _sink("nats", broken.WrappedSinkSession, {"owner_fencing": True}),
        _STREAMING, _NATS_SINK, _SK.FENCING_RULE, options=WITHIN_WINDOW, label="OwnerFencingClaim",
    ),
    *(
        _scenario(
            session, _sink("nats", session), _STREAMING, _NATS_SINK, _SK.RECEIPT_RULE, _SK.POLICY_RULE,
            _SK.ATOMIC_RULE, options=WITHIN_WINDOW,
        )
        for session in (broken.AttemptIdentitySession, broken.TokenIdentitySession)
    ),
    *(
        _scenario(session, _stream("nats", session), _STREAM, _NATS, *rules)
        for session, rules in (
            (broken.DroppingSession, (_SR.ORDER_RULE,)),
            (broken.LateRowSession, (_SR.UNWRITTEN_RULE,)),
            (broken.OverreachingSession, (_SR.UNWRITTEN_RULE,)),
            (broken.SpeculativeSession, (_SR.SPECULATIVE_RULE,)),
            (broken.AckOnCloseSession, (_SR.SPECULATIVE_RULE,)),
            (broken.UnaskingSession, (_SR.OWNERSHIP_RULE,)),
            (broken.AskOnceSession, (_SR.OWNERSHIP_RULE,)),
            (broken.ReidentifyingSession, (_SR.IDENTITY_RULE,)),
            (broken.WorkerIdentitySession, (_SR.IDENTITY_RULE,)),
            (broken.LeaseIdentitySession, (_SR.IDENTITY_RULE,)),
        )
    ),
    _scenario(
        broken.SpeculativeSession, _stream("kafka", broken.SpeculativeSession), _STREAM, targets.kafka_source,
        _SR.SPECULATIVE_RULE, label="SpeculativeSession(kafka)",
    ),
    _scenario(
        broken.LatestWhenUnavailableSource,
        lambda: broken.wrapping(
            "nats", Role.STREAM_SOURCE, broken.LatestWhenUnavailableSource, broken.WrappedSession
        ),
        _STREAM, _NATS, _SR.UNAVAILABLE_RULE,
    ),
    *(
        _scenario(
            session, _stream("postgres", session), _STREAM, _CDC, _SR.UNWRITTEN_RULE, _SR.TRANSACTION_RULE
        )
        for session in (broken.CutTransactionSession, broken.LimitCutSession)
    ),
    _scenario(broken.SlotPositionSource, broken.slot_position_source, _STREAM, _CDC, _SR.UNAVAILABLE_RULE),
)  # fmt: skip
"""Every self-test case, in table order."""

DIMENSIONS = (
    "several streams",
    "several domains",
    "several resources",
    "continuous upsert",
    "re-creation",
    "tokens across processes",
    "a double commit inside one synchronous call",
    "hostile identifiers",
    "cursor resumes",
    "file-order resumes",
)
"""The dimensions of issue 30: each has a broken connector the scenarios catch (and no check of its own)."""


def run_case(
    case: SelfTestCase, setup: Setup, *, seed: int = 0, fresh: Callable[[], Setup] | None = None
) -> ConformanceFailure:
    """Run ``case`` on ``setup`` (scenarios: under ``seed``, with ``fresh`` setups for shrinking);
    return the failure that caught it, or raise AssertionError saying why the case does not hold (the
    check passed, or failed with another rule or a raw exception)."""
    broken.reset()
    options = dataclasses.replace(case.options, seed=seed, shrink_runs=0) if case.seeded else case.options
    subject = Subject(case.spec(), case.role, setup, options, fresh=fresh)
    label = case.id + (f" (seed {seed})" if case.seeded else "")
    try:
        outcome = asyncio.run(run_check(CHECKS_BY_ID[case.check], subject))
    except ConformanceFailure as failure:
        if failure.rule not in case.accepted:
            raise AssertionError(
                f"{label}: failed rule [{failure.rule}], not {list(case.accepted)}"
            ) from failure
        if failure.__cause__ is not None and "expected it to work" in failure.message:
            raise AssertionError(
                f"{label}: caught only as a raw {type(failure.__cause__).__name__} (the check does not "
                f"name what was broken): {failure.message}"
            ) from failure
        missing = [fragment for fragment in case.fragments if fragment not in failure.message]
        if missing:
            raise AssertionError(
                f"{label}: the failure does not say {missing}: {failure.message}"
            ) from failure
        return failure
    except Exception as exc:
        raise AssertionError(
            f"{label}: the check ended in a raw {type(exc).__name__}: {exc} (a verdict names its rule)"
        ) from exc
    raise AssertionError(f"{label}: not caught, the check {outcome.status}: {outcome.detail}")


def caught_at(failure: ConformanceFailure) -> str:
    """The step of the scenario that diverged, as the failure names it."""
    for line in failure.message.splitlines():
        if "<- diverged here" in line:
            return line.replace("<- diverged here", "").strip()
    return failure.message.splitlines()[0][:100]


__all__ = ["CASES", "DIMENSIONS", "SEEDS", "SelfTestCase", "caught_at", "run_case"]
