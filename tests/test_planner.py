"""The planner truth table: every rule with a pair it accepts and a pair it refuses."""

from dataclasses import replace
from datetime import timedelta

import pytest
from faucet_kafka import KafkaSourceConfig
from faucet_kafka.source import capabilities as kafka_capabilities

from faucet_dagster.planner import Code, Mechanism, plan
from faucet_dagster.protocol import (
    Delivery,
    Durability,
    Emits,
    Mode,
    Operation,
    Ordering,
    PlanError,
    Replay,
    SinkCapabilities,
    SourceCapabilities,
    WritePolicy,
)

LOG_SOURCE = SourceCapabilities(
    emits=Emits.MESSAGES,
    operations=frozenset({Operation.INSERT}),
    ordering=Ordering.PARTITION,
    replay=Replay.REPLAYABLE_AT_LEAST_ONCE,
    bounded=True,
    continuous=True,
    deterministic=True,
    event_identity=True,
    columns=("id", "payload"),
)
TABLE_SOURCE = replace(LOG_SOURCE, emits=Emits.ROWS, ordering=Ordering.STRICT_GLOBAL, continuous=False)
CDC_SOURCE = replace(
    LOG_SOURCE,
    emits=Emits.CHANGES,
    operations=frozenset({Operation.INSERT, Operation.UPDATE, Operation.DELETE}),
    ordering=Ordering.STRICT_GLOBAL,
    transaction_boundaries=True,
)
TABLE_SINK = SinkCapabilities(
    bounded_policies=frozenset(WritePolicy),
    continuous_policies=frozenset(
        {WritePolicy.APPEND, WritePolicy.UPSERT, WritePolicy.VERSIONED_UPSERT, WritePolicy.APPLY_CHANGES}
    ),
    durability=Durability.TRANSACTIONAL,
    atomic_watermark=True,
    owner_fencing=True,
)
PLAIN_SINK = SinkCapabilities(
    bounded_policies=frozenset({WritePolicy.APPEND}),
    continuous_policies=frozenset({WritePolicy.APPEND}),
    durability=Durability.ACKNOWLEDGED,
)


def refused(*args: object, **kwargs: object) -> tuple[str, ...]:
    with pytest.raises(PlanError) as caught:
        plan(*args, **kwargs)  # type: ignore[arg-type]
    assert all(isinstance(violation.rule, int) for violation in caught.value.violations)
    return caught.value.codes


# Rule 1: continuous needs a continuous, replayable source.
def test_rule1_accepts_replayable_continuous_source() -> None:
    assert plan(LOG_SOURCE, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPEND).mode is Mode.CONTINUOUS


def test_rule1_refuses_best_effort_and_non_continuous_sources() -> None:
    best_effort = replace(LOG_SOURCE, replay=Replay.BEST_EFFORT)
    assert refused(best_effort, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPEND) == (
        Code.SOURCE_NOT_REPLAYABLE,
    )
    batch_only = replace(LOG_SOURCE, continuous=False)
    assert refused(batch_only, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPEND) == (
        Code.SOURCE_NOT_CONTINUOUS,
    )
    stream_only = replace(LOG_SOURCE, bounded=False)
    assert refused(stream_only, TABLE_SINK, Mode.BOUNDED, WritePolicy.APPEND) == (Code.SOURCE_NOT_BOUNDED,)


# Rule 2: the policy must be supported in the mode asked for; bounded never implies continuous.
def test_rule2_accepts_supported_policy() -> None:
    assert plan(LOG_SOURCE, PLAIN_SINK, Mode.BOUNDED, WritePolicy.APPEND).policy is WritePolicy.APPEND


def test_rule2_bounded_support_does_not_imply_streaming() -> None:
    sink = replace(TABLE_SINK, continuous_policies=frozenset({WritePolicy.APPEND}))
    with pytest.raises(PlanError) as caught:
        plan(LOG_SOURCE, sink, Mode.CONTINUOUS, WritePolicy.VERSIONED_UPSERT, ("id",))
    assert caught.value.codes == (Code.POLICY_NOT_SUPPORTED,)
    assert "bounded support never implies streaming support" in caught.value.violations[0].message
    assert plan(LOG_SOURCE, sink, Mode.BOUNDED, WritePolicy.VERSIONED_UPSERT, ("id",)).mode is Mode.BOUNDED


# Rule 3: REPLACE is never continuous.
def test_rule3_replace_is_bounded_only() -> None:
    assert plan(LOG_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.REPLACE).policy is WritePolicy.REPLACE
    sink = replace(TABLE_SINK, continuous_policies=frozenset(WritePolicy))
    assert refused(LOG_SOURCE, sink, Mode.CONTINUOUS, WritePolicy.REPLACE) == (Code.REPLACE_NOT_CONTINUOUS,)


# Rule 4: an order-dependent policy needs strict global order.
def test_rule4_order_dependent_policy_needs_strict_global_order() -> None:
    accepted = plan(CDC_SOURCE, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPLY_CHANGES, ("id",))
    assert accepted.policy is WritePolicy.APPLY_CHANGES
    for ordering in (Ordering.PARTITION, Ordering.TRANSACTION, Ordering.NONE):
        source = replace(CDC_SOURCE, ordering=ordering)
        assert refused(source, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPLY_CHANGES, ("id",)) == (
            Code.ORDER_DEPENDENT_POLICY,
        )


def test_rule4_versioned_upsert_is_order_independent() -> None:
    assert refused(LOG_SOURCE, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.UPSERT, ("id",)) == (
        Code.ORDER_DEPENDENT_POLICY,
    )
    accepted = plan(LOG_SOURCE, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.VERSIONED_UPSERT, ("id",))
    assert Mechanism.KEYED_UPSERT in accepted.mechanisms


# Rule 5: every emitted operation must be accepted by the policy.
def test_rule5_operations_must_be_accepted() -> None:
    plan(CDC_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.APPLY_CHANGES, ("id",))
    codes = refused(CDC_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.APPEND)
    assert codes == (Code.OPERATION_NOT_ACCEPTED, Code.OPERATION_NOT_ACCEPTED)


def test_rule5_apply_changes_needs_change_events_whatever_the_order() -> None:
    plan(CDC_SOURCE, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPLY_CHANGES, ("id",))
    ordered_messages = replace(LOG_SOURCE, ordering=Ordering.STRICT_GLOBAL)
    with pytest.raises(PlanError) as caught:
        plan(ordered_messages, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPLY_CHANGES, ("id",))
    assert caught.value.codes == (Code.CHANGES_REQUIRED,)
    assert "emits messages, not changes" in caught.value.violations[0].message


def test_rule5_uses_the_sinks_declared_operations() -> None:
    sink = replace(TABLE_SINK, accepted_operations={WritePolicy.APPEND: frozenset()})
    assert refused(LOG_SOURCE, sink, Mode.BOUNDED, WritePolicy.APPEND) == (Code.OPERATION_NOT_ACCEPTED,)


# Rule 6: a keyed policy needs a non-empty key that exists in the source schema.
def test_rule6_key_required_and_known() -> None:
    assert plan(TABLE_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.UPSERT, ("id",)).key == ("id",)
    assert refused(TABLE_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.UPSERT) == (Code.KEY_REQUIRED,)
    assert refused(TABLE_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.UPSERT, ("",)) == (Code.KEY_REQUIRED,)
    assert refused(TABLE_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.UPSERT, ("nope",)) == (
        Code.KEY_NOT_IN_SCHEMA,
    )
    unknown_schema = replace(TABLE_SOURCE, columns=None)
    assert plan(unknown_schema, TABLE_SINK, Mode.BOUNDED, WritePolicy.UPSERT, ("anything",)).key == (
        "anything",
    )


# Rule 7: effectively-once only where a mechanism proves it.
def test_rule7_atomic_watermark() -> None:
    accepted = plan(
        LOG_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.APPEND, delivery=Delivery.EFFECTIVELY_ONCE
    )
    assert accepted.delivery is Delivery.EFFECTIVELY_ONCE
    assert accepted.mechanisms == (Mechanism.ATOMIC_WATERMARK,)
    for kwargs in ({"dead_letter": True}, {"durable_state": False}):
        assert refused(
            LOG_SOURCE,
            TABLE_SINK,
            Mode.BOUNDED,
            WritePolicy.APPEND,
            delivery=Delivery.EFFECTIVELY_ONCE,
            **kwargs,
        ) == (Code.EFFECTIVELY_ONCE_UNREACHABLE,)
    nondeterministic = replace(LOG_SOURCE, deterministic=False)
    with pytest.raises(PlanError) as caught:
        plan(
            nondeterministic, TABLE_SINK, Mode.BOUNDED, WritePolicy.APPEND, delivery=Delivery.EFFECTIVELY_ONCE
        )
    assert "the source is not deterministic" in caught.value.violations[0].message


def test_rule7_continuous_atomic_watermark_does_not_rest_on_a_deterministic_source() -> None:
    """The continuous runner never re-reads a non-deterministic source into an atomic watermark (an
    epoch the sink committed before its certificate is certified from the sink's watermark), so the
    watermark holds there; a bounded rerun does re-read, and needs determinism."""
    snapshotting = replace(CDC_SOURCE, deterministic=False)
    continuous = plan(snapshotting, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPLY_CHANGES, ("id",))
    assert continuous.delivery is Delivery.EFFECTIVELY_ONCE
    assert Mechanism.ATOMIC_WATERMARK in continuous.mechanisms
    bounded = plan(replace(LOG_SOURCE, deterministic=False), TABLE_SINK, Mode.BOUNDED, WritePolicy.APPEND)
    assert bounded.delivery is Delivery.AT_LEAST_ONCE


def test_rule7_keyed_upsert_holds_with_a_dead_letter_route() -> None:
    accepted = plan(
        TABLE_SOURCE,
        TABLE_SINK,
        Mode.BOUNDED,
        WritePolicy.UPSERT,
        ("id",),
        delivery=Delivery.EFFECTIVELY_ONCE,
        dead_letter=True,
    )
    assert accepted.mechanisms == (Mechanism.KEYED_UPSERT,)


def test_rule7_a_dead_letter_route_the_source_declares_rules_out_the_watermark_too() -> None:
    """FCP 3.1: the atomic watermark needs no dead-letter route. A source that dead-letters records it
    cannot decode (Kafka's ``on_malformed: dead_letter``) has one, as a resource whose bad rows do:
    both are planned alike, never certified effectively-once by the watermark."""
    config = KafkaSourceConfig(
        bootstrap_servers="k:9092", topics=("t",), group_id="g", on_malformed="dead_letter"
    )
    routing = kafka_capabilities(config, continuous=True)
    assert routing.dead_letters
    assert not kafka_capabilities(replace_config(config, on_malformed="halt"), continuous=True).dead_letters
    for source, kwargs in ((routing, {}), (replace(routing, dead_letters=False), {"dead_letter": True})):
        assert refused(
            source,
            TABLE_SINK,
            Mode.CONTINUOUS,
            WritePolicy.APPEND,
            delivery=Delivery.EFFECTIVELY_ONCE,
            **kwargs,
        ) == (Code.EFFECTIVELY_ONCE_UNREACHABLE,)
        accepted = plan(source, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.APPEND, **kwargs)
        assert accepted.delivery is Delivery.AT_LEAST_ONCE
        assert "a dead-letter route is configured" in accepted.summary()


def test_rule7_the_plan_says_how_dead_letters_are_delivered() -> None:
    """A bounded sync's dead-letter sink appends, so a keyed upsert, effectively-once for its rows,
    says its dead letters are at-least-once; a stream's route stores them by event identity."""
    bounded = plan(TABLE_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.UPSERT, ("id",), dead_letter=True)
    assert (bounded.delivery, bounded.dead_letters) == (Delivery.EFFECTIVELY_ONCE, Delivery.AT_LEAST_ONCE)
    assert "dead letters: at-least-once" in bounded.summary()
    assert bounded.to_dict()["dead_letters"] == "at_least_once"
    stream = plan(
        LOG_SOURCE, TABLE_SINK, Mode.CONTINUOUS, WritePolicy.VERSIONED_UPSERT, ("id",), dead_letter=True
    )
    assert stream.dead_letters is Delivery.EFFECTIVELY_ONCE
    assert plan(TABLE_SOURCE, TABLE_SINK, Mode.BOUNDED, WritePolicy.UPSERT, ("id",)).dead_letters is None


def replace_config(config: KafkaSourceConfig, **changes: object) -> KafkaSourceConfig:
    return KafkaSourceConfig(**{**config.model_dump(), **changes})


def test_rule7_event_identity_dedup_states_its_window() -> None:
    sink = replace(PLAIN_SINK, dedup_by_event_identity=True, dedup_window=timedelta(minutes=2))
    accepted = plan(LOG_SOURCE, sink, Mode.CONTINUOUS, WritePolicy.APPEND, delivery=Delivery.EFFECTIVELY_ONCE)
    assert accepted.mechanisms == (Mechanism.EVENT_IDENTITY_DEDUP,)
    assert accepted.dedup_window == timedelta(minutes=2)
    assert "120s" in accepted.summary()
    no_identity = replace(LOG_SOURCE, event_identity=False)
    assert refused(
        no_identity, sink, Mode.CONTINUOUS, WritePolicy.APPEND, delivery=Delivery.EFFECTIVELY_ONCE
    ) == (Code.EFFECTIVELY_ONCE_UNREACHABLE,)


def test_rule7_at_least_once_is_promised_honestly() -> None:
    accepted = plan(LOG_SOURCE, PLAIN_SINK, Mode.CONTINUOUS, WritePolicy.APPEND)
    assert accepted.delivery is Delivery.AT_LEAST_ONCE
    assert accepted.mechanisms == ()
    assert any("duplicate" in reason for reason in accepted.reasons)


# Rule 8: the sink is durable, in every mode and for every delivery asked for.
@pytest.mark.parametrize("mode", list(Mode))
def test_rule8_refuses_a_sink_without_durability(mode: Mode) -> None:
    forgetful = replace(TABLE_SINK, durability=Durability.NONE)
    for delivery in (None, Delivery.AT_LEAST_ONCE, Delivery.EFFECTIVELY_ONCE):
        # An atomic watermark does not help: the commit that carries it may be lost with the rows.
        assert refused(LOG_SOURCE, forgetful, mode, WritePolicy.APPEND, delivery=delivery) == (
            Code.SINK_NOT_DURABLE,
        )
    with pytest.raises(PlanError) as caught:
        plan(LOG_SOURCE, forgetful, mode, WritePolicy.APPEND)
    assert caught.value.violations[0].rule == 8
    assert ("acknowledging the source" if mode is Mode.CONTINUOUS else "bookmark") in str(caught.value)


@pytest.mark.parametrize("durability", [Durability.ACKNOWLEDGED, Durability.TRANSACTIONAL])
def test_rule8_accepts_acknowledged_and_transactional_sinks(durability: Durability) -> None:
    sink = replace(TABLE_SINK, durability=durability)
    assert plan(LOG_SOURCE, sink, Mode.CONTINUOUS, WritePolicy.APPEND).delivery is Delivery.EFFECTIVELY_ONCE


def test_every_violation_is_reported_not_only_the_first() -> None:
    source = SourceCapabilities(
        emits=Emits.CHANGES,
        operations=frozenset({Operation.INSERT, Operation.DELETE}),
        ordering=Ordering.PARTITION,
        replay=Replay.BEST_EFFORT,
        bounded=False,
        continuous=False,
    )
    sink = replace(
        PLAIN_SINK,
        accepted_operations={WritePolicy.APPLY_CHANGES: frozenset({Operation.INSERT})},
        durability=Durability.NONE,
    )
    with pytest.raises(PlanError) as caught:
        plan(source, sink, Mode.CONTINUOUS, WritePolicy.APPLY_CHANGES, delivery=Delivery.EFFECTIVELY_ONCE)
    assert set(caught.value.codes) == {
        Code.SOURCE_NOT_CONTINUOUS,
        Code.SOURCE_NOT_REPLAYABLE,
        Code.POLICY_NOT_SUPPORTED,
        Code.ORDER_DEPENDENT_POLICY,
        Code.OPERATION_NOT_ACCEPTED,
        Code.KEY_REQUIRED,
        Code.EFFECTIVELY_ONCE_UNREACHABLE,
        Code.SINK_NOT_DURABLE,
    }
    assert {violation.rule for violation in caught.value.violations} == {1, 2, 4, 5, 6, 7, 8}
    message = str(caught.value)
    for code in caught.value.codes:
        assert f"[{code}]" in message
