"""The battery's self-test: every check against the deliberately broken connectors of :mod:`.broken`.

Each :class:`SelfTestCase` names a check, a broken connector (a shipped connector wrapped or
subclassed to break exactly one rule, the way a careless author would) and what the failure must say.
A case holds when the check fails with a :class:`ConformanceFailure` naming the check's own rule (so
the fault is put where it belongs: a raw connector exception, or another rule, is a failed case).
``tests/conformance/test_battery_catches_broken.py`` runs every case; ``faucet conformance
--self-test`` prints the table of rule x broken connector -> the check that caught it.
"""

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from faucet_dagster.conformance import broken, targets
from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import DEFAULT_OPTIONS, ConformanceFailure, ConformanceOptions
from faucet_dagster.conformance.setup import ConfigFactory, Setup
from faucet_dagster.conformance.suites import CHECKS_BY_ID, run_check
from faucet_dagster.protocol import ConnectorSpec, Role

WITHIN_WINDOW = ConformanceOptions(replay_duplicates="within_window")


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

    @property
    def id(self) -> str:
        return f"{self.check}-{self.broken}"

    @property
    def rule(self) -> str:
        return CHECKS_BY_ID[self.check].rule


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


_SOURCE, _SINK = Role.SOURCE, Role.SINK
_STREAM, _STREAMING = Role.STREAM_SOURCE, Role.STREAMING_SINK
_FILES, _SQL = targets.files_source, targets.sql_sink
_NATS, _NATS_SINK = targets.nats_source, targets.nats_sink

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
    _case("resume", broken.ForgetfulSource, _files(broken.ForgetfulSource), _SOURCE, _FILES, "replayed"),
    _case(
        "resume", broken.LaggingBookmarkSource, _files(broken.LaggingBookmarkSource), _SOURCE, _FILES,
        "replayed",
    ),
    _case(
        "idempotent_replay", broken.TokenBlindSink, _sql(broken.TokenBlindSink), _SINK, _SQL, "commit token"
    ),
    _case(
        "idempotent_replay", broken.TwoTransactionSink, _sql(broken.TwoTransactionSink), _SINK, _SQL,
        "commit atomically",
    ),
    _case(
        "idempotent_replay", broken.AppendingUpsertSink, _sql(broken.AppendingUpsertSink), _SINK, _SQL,
        "must converge",
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
        "capabilities", broken.NoEvolutionSink, _sql(broken.NoEvolutionSink), _SINK, _SQL,
        "did not add the column",
    ),
    _case(
        "capabilities", broken.WrappedSinkSession,
        _sink("nats", broken.WrappedSinkSession, {"owner_fencing": True}), _STREAMING, _NATS_SINK,
        "owner_fencing", label="OwnerFencingClaim",
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
        "partial_transaction", broken.CutTransactionSession,
        _stream("postgres", broken.CutTransactionSession), _STREAM, targets.postgres_cdc_source, "still open",
    ),
    _case(
        "partial_transaction", broken.LimitCutSession, _stream("postgres", broken.LimitCutSession), _STREAM,
        targets.postgres_cdc_source, "limited to 5 records",
    ),
    _case(
        "ownership_lost_before_ack", broken.UnaskingSession, _stream("nats", broken.UnaskingSession),
        _STREAM, _NATS, "OwnershipLost",
    ),
    _case(
        "ownership_lost_before_ack", broken.AskOnceSession, _stream("nats", broken.AskOnceSession),
        _STREAM, _NATS, "a later acknowledgement",
    ),
    _case(
        "speculative_ack", broken.SpeculativeSession, _stream("nats", broken.SpeculativeSession), _STREAM,
        _NATS, "during a read",
    ),
    _case(
        "speculative_ack", broken.SpeculativeSession, _stream("kafka", broken.SpeculativeSession), _STREAM,
        targets.kafka_source, "during a read", label="SpeculativeSession(kafka)",
    ),
    _case(
        "speculative_ack", broken.AckOnCloseSession, _stream("nats", broken.AckOnCloseSession), _STREAM,
        _NATS, "when the session closed",
    ),
    _case(
        "unavailable_position", broken.LatestWhenUnavailableSource,
        lambda: broken.wrapping(
            "nats", Role.STREAM_SOURCE, broken.LatestWhenUnavailableSource, broken.WrappedSession
        ),
        _STREAM, _NATS, "PositionUnavailable",
    ),
    _case(
        "unavailable_position", broken.SlotPositionSource, broken.slot_position_source, _STREAM,
        targets.postgres_cdc_source, "PositionUnavailable",
    ),
    _case(
        "unwritten_position", broken.DroppingSession, _stream("nats", broken.DroppingSession), _STREAM, _NATS,
        "missing ids [5]",
    ),
    _case(
        "unwritten_position", broken.LateRowSession, _stream("nats", broken.LateRowSession), _STREAM, _NATS,
        "accepted boundary",
    ),
    _case(
        "unwritten_position", broken.OverreachingSession, _stream("nats", broken.OverreachingSession),
        _STREAM, _NATS, "had not reached the sink",
    ),
    *(
        _case(
            "replay_after_commit", session, _stream("nats", session), _STREAM, _NATS, fragment
        )
        for session, fragment in (
            (broken.ReidentifyingSession, "identities"),
            (broken.WorkerIdentitySession, "another worker"),
            (broken.LeaseIdentitySession, "another worker"),
        )
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
        targets.postgres_streaming_sink, "outlived the session",
    ),
    _case(
        "uncertain_commit", broken.StaleWatermarkSession, _sink("postgres", broken.StaleWatermarkSession),
        _STREAMING, targets.postgres_streaming_sink, "commit atomically",
    ),
    _case(
        "lifecycle_order", broken.LenientSession, _sink("postgres", broken.LenientSession), _STREAMING,
        targets.postgres_streaming_sink, "was accepted",
    ),
    _case(
        "lifecycle_order", broken.RebeginSession, _sink("postgres", broken.RebeginSession), _STREAMING,
        targets.postgres_streaming_sink, "begin_epoch twice was accepted",
    ),
    _case(
        "shutdown_with_outstanding_work", broken.EagerCloseSession,
        # Caught as "changed after close" or as "shows rows of an epoch that never committed",
        # depending on whether its late commit lands before the battery's first look.
        _sink("postgres", broken.EagerCloseSession), _STREAMING, targets.postgres_streaming_sink,
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
    *(
        _case(
            "replay_after_commit", session, _sink("nats", session), _STREAMING, _NATS_SINK, "within_window",
            options=WITHIN_WINDOW,
        )
        for session in (broken.AttemptIdentitySession, broken.TokenIdentitySession)
    ),
)  # fmt: skip
"""Every self-test case, in table order."""


def run_case(case: SelfTestCase, setup: Setup) -> ConformanceFailure:
    """Run ``case`` on ``setup``; return the failure that caught it, or raise AssertionError saying
    why the case does not hold (the check passed, or failed with another rule or a raw exception)."""
    broken.reset()
    subject = Subject(case.spec(), case.role, setup, case.options)
    try:
        outcome = asyncio.run(run_check(CHECKS_BY_ID[case.check], subject))
    except ConformanceFailure as failure:
        if failure.rule != case.rule:
            raise AssertionError(f"{case.id}: failed rule [{failure.rule}], not [{case.rule}]") from failure
        if failure.__cause__ is not None and "expected it to work" in failure.message:
            raise AssertionError(
                f"{case.id}: caught only as a raw {type(failure.__cause__).__name__} (the check does not "
                f"name what was broken): {failure.message}"
            ) from failure
        missing = [fragment for fragment in case.fragments if fragment not in failure.message]
        if missing:
            raise AssertionError(
                f"{case.id}: the failure does not say {missing}: {failure.message}"
            ) from failure
        return failure
    except Exception as exc:
        raise AssertionError(
            f"{case.id}: the check ended in a raw {type(exc).__name__}: {exc} (a verdict names its rule)"
        ) from exc
    raise AssertionError(f"{case.id}: not caught, the check {outcome.status}: {outcome.detail}")


__all__ = ["CASES", "SelfTestCase", "run_case"]
