"""Self-tests of the conformance battery: every check catches a connector that breaks its rule.

Each broken connector (``broken.py``) wraps a real one and breaks exactly one thing; the check runs
against the real server with it and must fail with a :class:`ConformanceFailure` naming the check's
rule. The passing side of every check is the battery's own run on the real connectors
(``test_conformance_<connector>.py``).
"""

import asyncio
from typing import Any

import broken
import pytest

from faucet_dagster.conformance import (
    CHECKS_BY_ID,
    ConformanceFailure,
    ConformanceOptions,
    Subject,
    run_check,
)
from faucet_dagster.conformance.options import DEFAULT_OPTIONS
from faucet_dagster.conformance.setup import ConfigFactory, factory_fixtures
from faucet_dagster.conformance.targets import (
    files_source,
    kafka_source,
    nats_sink,
    nats_source,
    postgres_cdc_source,
    postgres_streaming_sink,
    sql_sink,
)
from faucet_dagster.protocol import ConnectorSpec, Role

WITHIN_WINDOW = ConformanceOptions(replay_duplicates="within_window")


def caught(
    request: pytest.FixtureRequest,
    check: str,
    spec: ConnectorSpec,
    role: Role,
    factory: ConfigFactory,
    *fragments: str,
    options: ConformanceOptions = DEFAULT_OPTIONS,
) -> ConformanceFailure:
    """Run ``check`` on the broken ``spec``; assert it fails naming the check's rule and ``fragments``."""
    setup = factory(**{name: request.getfixturevalue(name) for name in factory_fixtures(factory)})
    subject = Subject(spec, role, setup, options)
    with pytest.raises(ConformanceFailure) as failure:
        asyncio.run(run_check(CHECKS_BY_ID[check], subject))
    assert failure.value.rule == CHECKS_BY_ID[check].rule
    assert str(failure.value).startswith(f"[{CHECKS_BY_ID[check].rule}]")
    for fragment in fragments:
        assert fragment in failure.value.message, failure.value.message
    return failure.value


def files(source_type: type[Any], config_model: Any = None) -> ConnectorSpec:
    return broken.spec_with("files", Role.SOURCE, source_type, config_model)


def sql(sink_type: type[Any]) -> ConnectorSpec:
    return broken.spec_with("sql", Role.SINK, sink_type)


# -- the FCP checks -------------------------------------------------------------------------------------


def test_config_schema_catches_a_schema_that_is_not_json_schema(request: pytest.FixtureRequest) -> None:
    caught(
        request,
        "config_schema",
        files(broken.InvalidSchemaSource),
        Role.SOURCE,
        files_source,
        "not a valid JSON Schema",
    )


def test_bounded_memory_catches_pages_over_batch_size(request: pytest.FixtureRequest) -> None:
    caught(
        request,
        "bounded_memory",
        files(broken.OversizedPagesSource),
        Role.SOURCE,
        files_source,
        "more than batch_size",
    )


def test_bounded_memory_catches_a_source_that_buffers_the_dataset(request: pytest.FixtureRequest) -> None:
    caught(
        request, "bounded_memory", files(broken.BufferingSource), Role.SOURCE, files_source, "must not buffer"
    )


def test_bounded_memory_catches_a_source_that_buffers_the_dataset_natively(
    request: pytest.FixtureRequest,
) -> None:
    caught(
        request,
        "bounded_memory",
        files(broken.NativeBufferingSource),
        Role.SOURCE,
        files_source,
        "must not buffer",
        "natively",
    )


def test_resume_catches_a_source_that_ignores_its_bookmark(request: pytest.FixtureRequest) -> None:
    caught(request, "resume", files(broken.ForgetfulSource), Role.SOURCE, files_source, "replayed")


def test_idempotent_replay_catches_a_sink_that_ignores_the_token(request: pytest.FixtureRequest) -> None:
    caught(request, "idempotent_replay", sql(broken.TokenBlindSink), Role.SINK, sql_sink, "commit token")


def test_idempotent_replay_catches_an_upsert_that_appends(request: pytest.FixtureRequest) -> None:
    caught(
        request, "idempotent_replay", sql(broken.AppendingUpsertSink), Role.SINK, sql_sink, "must converge"
    )


def test_capabilities_catch_a_discovery_that_finds_nothing(request: pytest.FixtureRequest) -> None:
    caught(request, "capabilities", files(broken.EmptyDiscoverySource), Role.SOURCE, files_source, "discover")


@pytest.mark.parametrize("sink", ["ModeBlindDedupSink", "FirstConfigDedupSink"])
def test_capabilities_catch_a_dedups_by_key_that_ignores_the_live_config(
    request: pytest.FixtureRequest, sink: str
) -> None:
    broken.FirstConfigDedupSink.answer = None
    caught(request, "capabilities", sql(getattr(broken, sink)), Role.SINK, sql_sink, "live config")


def test_capabilities_catch_a_schema_evolution_that_does_nothing(request: pytest.FixtureRequest) -> None:
    caught(
        request, "capabilities", sql(broken.NoEvolutionSink), Role.SINK, sql_sink, "did not add the column"
    )


def test_capabilities_catch_a_sink_claiming_owner_fencing_it_lacks(request: pytest.FixtureRequest) -> None:
    spec = broken.streaming_sink("nats", broken.WrappedSinkSession, {"owner_fencing": True})
    caught(request, "capabilities", spec, Role.STREAMING_SINK, nats_sink, "owner_fencing")


def test_no_panic_catches_a_key_error_on_bad_config(request: pytest.FixtureRequest) -> None:
    spec = files(broken.FilesSource, broken.StrictConfig)
    caught(request, "no_panic", spec, Role.SOURCE, files_source, "KeyError")


def test_no_panic_catches_a_hang_on_an_unreachable_endpoint(request: pytest.FixtureRequest) -> None:
    options = ConformanceOptions(timeout=2)
    caught(
        request, "no_panic", files(broken.HangingSource), Role.SOURCE, files_source, "a hang", options=options
    )


def test_no_panic_catches_a_malformed_record_escaping_as_value_error(request: pytest.FixtureRequest) -> None:
    caught(request, "no_panic", files(broken.LeakySource), Role.SOURCE, files_source, "ValueError")


@pytest.mark.parametrize(
    ("source", "call"),
    [
        ("RawCheckSource", "check()"),
        ("RawShardsSource", "enumerate_shards()"),
        ("RawCaptureSource", "capture_resume_position()"),
    ],
)
def test_no_panic_catches_a_raw_exception_from_a_declared_call(
    request: pytest.FixtureRequest, source: str, call: str
) -> None:
    caught(
        request,
        "no_panic",
        files(getattr(broken, source)),
        Role.SOURCE,
        files_source,
        f"{call} on an unreachable endpoint raised",
        "instead of a FaucetError",
    )


def test_no_panic_catches_an_error_on_an_empty_dataset(request: pytest.FixtureRequest) -> None:
    caught(
        request, "no_panic", files(broken.EmptyIsAnErrorSource), Role.SOURCE, files_source, "empty dataset"
    )


# -- stream sources ---------------------------------------------------------------------------------


def test_slow_sink_catches_a_source_that_gives_up_on_a_slow_pipeline(request: pytest.FixtureRequest) -> None:
    spec = broken.stream_source("nats", broken.ImpatientSession)
    caught(request, "slow_sink", spec, Role.STREAM_SOURCE, nats_source, "TimeoutError")


def test_slow_sink_catches_deliveries_left_to_expire_while_the_sink_blocks(
    request: pytest.FixtureRequest,
) -> None:
    spec = broken.stream_source("nats", broken.LoopBlockingSession)
    caught(request, "slow_sink", spec, Role.STREAM_SOURCE, nats_source, "redelivered")


def test_cancel_during_read_catches_a_session_deaf_to_cancellation(request: pytest.FixtureRequest) -> None:
    spec = broken.stream_source("nats", broken.DeafSession)
    options = ConformanceOptions(timeout=3)
    caught(request, "cancel_during_read", spec, Role.STREAM_SOURCE, nats_source, "a hang", options=options)


def test_partial_transaction_catches_coverage_inside_a_transaction(request: pytest.FixtureRequest) -> None:
    spec = broken.stream_source("postgres", broken.CutTransactionSession)
    caught(request, "partial_transaction", spec, Role.STREAM_SOURCE, postgres_cdc_source, "still open")


def test_ownership_catches_an_acknowledgement_without_authority(request: pytest.FixtureRequest) -> None:
    spec = broken.stream_source("nats", broken.UnaskingSession)
    caught(request, "ownership_lost_before_ack", spec, Role.STREAM_SOURCE, nats_source, "OwnershipLost")


def test_ownership_catches_an_authority_asked_only_once(request: pytest.FixtureRequest) -> None:
    spec = broken.stream_source("nats", broken.AskOnceSession)
    caught(
        request, "ownership_lost_before_ack", spec, Role.STREAM_SOURCE, nats_source, "a later acknowledgement"
    )


@pytest.mark.parametrize("name", ["nats", "kafka"])
def test_speculative_ack_catches_an_acknowledgement_during_read(
    request: pytest.FixtureRequest, name: str
) -> None:
    spec = broken.stream_source(name, broken.SpeculativeSession)
    factory = {"nats": nats_source, "kafka": kafka_source}[name]
    caught(request, "speculative_ack", spec, Role.STREAM_SOURCE, factory, "during a read")


def test_speculative_ack_catches_an_acknowledgement_on_close(request: pytest.FixtureRequest) -> None:
    spec = broken.stream_source("nats", broken.AckOnCloseSession)
    caught(request, "speculative_ack", spec, Role.STREAM_SOURCE, nats_source, "when the session closed")


def test_unavailable_position_catches_a_source_falling_back_to_the_latest(
    request: pytest.FixtureRequest,
) -> None:
    spec = broken.wrapping(
        "nats",
        Role.STREAM_SOURCE,
        lambda inner: broken.LatestWhenUnavailableSource(inner, broken.WrappedSession),
    )
    caught(request, "unavailable_position", spec, Role.STREAM_SOURCE, nats_source, "PositionUnavailable")


def test_unwritten_position_catches_a_source_covering_rows_it_dropped(request: pytest.FixtureRequest) -> None:
    spec = broken.stream_source("nats", broken.DroppingSession)
    caught(request, "unwritten_position", spec, Role.STREAM_SOURCE, nats_source, "missing ids [5]")


def test_replay_catches_a_source_whose_identities_change_on_replay(request: pytest.FixtureRequest) -> None:
    spec = broken.stream_source("nats", broken.ReidentifyingSession)
    caught(request, "replay_after_commit", spec, Role.STREAM_SOURCE, nats_source, "identities")


@pytest.mark.parametrize("session", [broken.WorkerIdentitySession, broken.LeaseIdentitySession])
def test_replay_catches_a_source_whose_identities_come_from_the_worker(
    request: pytest.FixtureRequest, session: type[broken.WrappedSession]
) -> None:
    spec = broken.stream_source("nats", session)
    caught(request, "replay_after_commit", spec, Role.STREAM_SOURCE, nats_source, "another worker")


# -- streaming sinks --------------------------------------------------------------------------------


def test_failed_writes_catches_a_commit_that_swallows_a_refusal(request: pytest.FixtureRequest) -> None:
    spec = broken.streaming_sink("nats", broken.SwallowingSession)
    caught(
        request,
        "failed_writes",
        spec,
        Role.STREAMING_SINK,
        nats_sink,
        "commit_epoch returned",
        options=WITHIN_WINDOW,
    )


def test_uncertain_commit_catches_a_commit_that_outlives_the_close(request: pytest.FixtureRequest) -> None:
    spec = broken.streaming_sink("postgres", broken.LateCommitSession)
    caught(
        request,
        "uncertain_commit",
        spec,
        Role.STREAMING_SINK,
        postgres_streaming_sink,
        "outlived the session",
    )


def test_lifecycle_order_catches_a_session_accepting_apply_outside_an_epoch(
    request: pytest.FixtureRequest,
) -> None:
    spec = broken.streaming_sink("postgres", broken.LenientSession)
    caught(request, "lifecycle_order", spec, Role.STREAMING_SINK, postgres_streaming_sink, "was accepted")


def test_shutdown_catches_a_close_that_returns_before_its_work_lands(request: pytest.FixtureRequest) -> None:
    spec = broken.streaming_sink("postgres", broken.EagerCloseSession)
    caught(
        request,
        "shutdown_with_outstanding_work",
        spec,
        Role.STREAMING_SINK,
        postgres_streaming_sink,
        "changed",
    )


@pytest.mark.parametrize("session", [broken.AttemptIdentitySession, broken.TokenIdentitySession])
def test_replay_catches_a_sink_whose_identities_come_from_the_attempt_or_lease(
    request: pytest.FixtureRequest, session: type[broken.WrappedSinkSession]
) -> None:
    spec = broken.streaming_sink("nats", session)
    caught(
        request,
        "replay_after_commit",
        spec,
        Role.STREAMING_SINK,
        nats_sink,
        "within_window",
        options=WITHIN_WINDOW,
    )
