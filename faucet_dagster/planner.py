"""The planner: checks a source/sink pair before anything is written.

``plan(...)`` applies the seven rules of DESIGN.md section 2.3, and an eighth (the sink is durable),
to the capabilities both connectors declared from their live config. It returns a :class:`Plan`
stating the delivery guarantee it can honestly promise and why, or raises :class:`PlanError` listing
every violation (each with a stable code), never only the first. Pure: no I/O, no Dagster.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from faucet_dagster.protocol import (
    Delivery,
    Durability,
    Emits,
    Mode,
    Ordering,
    PlanError,
    Replay,
    SinkCapabilities,
    SourceCapabilities,
    Violation,
    WritePolicy,
)


class Code(StrEnum):
    """Stable violation codes; scripts and tests match on these, never on messages."""

    SOURCE_NOT_CONTINUOUS = "source-not-continuous"
    SOURCE_NOT_REPLAYABLE = "source-not-replayable"
    SOURCE_NOT_BOUNDED = "source-not-bounded"
    POLICY_NOT_SUPPORTED = "policy-not-supported"
    REPLACE_NOT_CONTINUOUS = "replace-not-continuous"
    ORDER_DEPENDENT_POLICY = "order-dependent-policy"
    OPERATION_NOT_ACCEPTED = "operation-not-accepted"
    CHANGES_REQUIRED = "changes-required"
    KEY_REQUIRED = "key-required"
    KEY_NOT_IN_SCHEMA = "key-not-in-schema"
    EFFECTIVELY_ONCE_UNREACHABLE = "effectively-once-unreachable"
    SINK_NOT_DURABLE = "sink-not-durable"


class Mechanism(StrEnum):
    """What makes a replay harmless at the destination."""

    ATOMIC_WATERMARK = "atomic_watermark"
    KEYED_UPSERT = "keyed_upsert"
    EVENT_IDENTITY_DEDUP = "event_identity_dedup"
    ATOMIC_REPLACE = "atomic_replace"


@dataclass(frozen=True)
class Plan:
    """An accepted pair: what will run and the delivery guarantee it can honestly promise.

    ``mechanisms`` lists every mechanism that holds (empty for at-least-once); ``reasons`` explains
    the guarantee in words a user reads in the Dagster UI and in ``faucet plan``. ``dead_letters`` is
    the delivery of the records routed to a dead-letter route (``None``: no route): a stream's route
    stores them by event identity, so a replayed epoch stores none twice (effectively-once); a
    bounded sync appends them to its dead-letter sink, so a replayed page appends them again
    (at-least-once), whatever ``delivery`` promises for the destination's rows.
    """

    mode: Mode
    policy: WritePolicy
    key: tuple[str, ...]
    delivery: Delivery
    mechanisms: tuple[Mechanism, ...]
    reasons: tuple[str, ...]
    dedup_window: timedelta | None = None
    dead_letters: Delivery | None = None

    def summary(self) -> str:
        head = f"{self.mode.value} {self.policy.value}"
        if self.key:
            head += f" by ({', '.join(self.key)})"
        lines = [f"{head}: {self.delivery.value.replace('_', '-')}"]
        lines.extend(f"  - {reason}" for reason in self.reasons)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode.value,
            "policy": self.policy.value,
            "key": list(self.key),
            "delivery": self.delivery.value,
            "mechanisms": [mechanism.value for mechanism in self.mechanisms],
            "reasons": list(self.reasons),
            "dedup_window_seconds": None if self.dedup_window is None else self.dedup_window.total_seconds(),
            "dead_letters": None if self.dead_letters is None else self.dead_letters.value,
        }


def plan(
    source: SourceCapabilities,
    sink: SinkCapabilities,
    mode: Mode,
    policy: WritePolicy,
    key: Sequence[str] = (),
    *,
    delivery: Delivery | None = None,
    durable_state: bool = True,
    dead_letter: bool = False,
) -> Plan:
    """Check the pair against every rule; return the plan or raise PlanError with every violation.

    ``delivery`` is the guarantee asked for (``None``: the best one reachable). ``durable_state``
    says whether bookmarks and certificates survive a crash; ``dead_letter`` whether a dead-letter
    route is configured for rows that do not fit (it rules out the atomic watermark, as the FCP says);
    a route the source declares (``source.dead_letters``) counts the same.
    """
    key = tuple(key)
    dead_letter = dead_letter or source.dead_letters
    violations = [
        *_check_source_mode(source, mode),
        *_check_policy_supported(sink, mode, policy),
        *_check_replace(mode, policy),
        *_check_ordering(source, policy),
        *_check_operations(source, sink, policy),
        *_check_key(source, sink, policy, key),
        *_check_durability(sink, mode),
    ]
    mechanisms, reasons = _mechanisms(source, sink, mode, policy, key, durable_state, dead_letter)
    if delivery is Delivery.EFFECTIVELY_ONCE and not mechanisms:
        violations.append(
            Violation(
                Code.EFFECTIVELY_ONCE_UNREACHABLE,
                7,
                "effectively-once needs a mechanism and none holds: " + "; ".join(reasons),
            )
        )
    if violations:
        raise PlanError(violations)
    if mechanisms:
        promised = Delivery.EFFECTIVELY_ONCE
        reasons = tuple(_MECHANISM_TEXT[mechanism](sink) for mechanism in mechanisms)
    else:
        promised = Delivery.AT_LEAST_ONCE
        reasons = (
            "no mechanism makes a replay harmless, so a retried page or epoch may duplicate "
            "records; none is lost",
            *reasons,
        )
    window = sink.dedup_window if Mechanism.EVENT_IDENTITY_DEDUP in mechanisms else None
    routed = None
    if dead_letter:
        routed = Delivery.EFFECTIVELY_ONCE if mode is Mode.CONTINUOUS else Delivery.AT_LEAST_ONCE
        reasons = (*reasons, _DEAD_LETTER_TEXT[mode])
    return Plan(mode, policy, key, promised, mechanisms, tuple(reasons), window, routed)


def _check_source_mode(source: SourceCapabilities, mode: Mode) -> list[Violation]:
    found = []
    if mode is Mode.CONTINUOUS:
        if not source.continuous:
            found.append(Violation(Code.SOURCE_NOT_CONTINUOUS, 1, "the source cannot run continuously"))
        if source.replay is not Replay.REPLAYABLE_AT_LEAST_ONCE:
            found.append(
                Violation(
                    Code.SOURCE_NOT_REPLAYABLE,
                    1,
                    f"continuous mode needs a replayable at-least-once source, this one is "
                    f"{source.replay.value}: it cannot recover what an interrupted worker lost",
                )
            )
    elif not source.bounded:
        found.append(Violation(Code.SOURCE_NOT_BOUNDED, 1, "the source cannot run a bounded read"))
    return found


def _check_policy_supported(sink: SinkCapabilities, mode: Mode, policy: WritePolicy) -> list[Violation]:
    supported = sink.policies(mode)
    if policy in supported:
        return []
    message = (
        f"the sink does not support {policy.value} in {mode.value} mode "
        f"(it supports: {', '.join(sorted(p.value for p in supported)) or 'nothing'})"
    )
    if mode is Mode.CONTINUOUS and policy in sink.bounded_policies:
        message += "; bounded support never implies streaming support"
    return [Violation(Code.POLICY_NOT_SUPPORTED, 2, message)]


def _check_replace(mode: Mode, policy: WritePolicy) -> list[Violation]:
    if mode is Mode.CONTINUOUS and policy is WritePolicy.REPLACE:
        return [
            Violation(
                Code.REPLACE_NOT_CONTINUOUS,
                3,
                "replace is never continuous: it needs a finite snapshot and a completion boundary",
            )
        ]
    return []


def _check_ordering(source: SourceCapabilities, policy: WritePolicy) -> list[Violation]:
    if policy.order_dependent and source.ordering is not Ordering.STRICT_GLOBAL:
        return [
            Violation(
                Code.ORDER_DEPENDENT_POLICY,
                4,
                f"{policy.value} gives another result in another order and needs a strict global "
                f"order; the source only guarantees {source.ordering.value} order"
                + (" (use versioned_upsert)" if policy is WritePolicy.UPSERT else ""),
            )
        ]
    return []


def _check_operations(
    source: SourceCapabilities, sink: SinkCapabilities, policy: WritePolicy
) -> list[Violation]:
    accepted = sink.operations_for(policy)
    found = [
        Violation(
            Code.OPERATION_NOT_ACCEPTED,
            5,
            f"the source emits {operation.value} but {policy.value} cannot apply it "
            f"(it applies: {', '.join(sorted(op.value for op in accepted)) or 'nothing'})",
        )
        for operation in sorted(source.operations - accepted)
    ]
    if policy is WritePolicy.APPLY_CHANGES and source.emits is not Emits.CHANGES:
        # Applying changes needs change events (each row with its operation, in commit order); a
        # message or row source has none to apply, whatever its order.
        found.append(
            Violation(
                Code.CHANGES_REQUIRED,
                5,
                f"apply_changes applies change events (insert, update, delete per row); the source emits "
                f"{source.emits.value}, not changes (use append, upsert or versioned_upsert)",
            )
        )
    return found


def _check_key(
    source: SourceCapabilities, sink: SinkCapabilities, policy: WritePolicy, key: tuple[str, ...]
) -> list[Violation]:
    if policy not in sink.requires_key:
        return []
    if not key or any(not column for column in key):
        return [Violation(Code.KEY_REQUIRED, 6, f"{policy.value} needs a non-empty key")]
    if source.columns is not None:
        missing = [column for column in key if column not in source.columns]
        if missing:
            return [
                Violation(
                    Code.KEY_NOT_IN_SCHEMA,
                    6,
                    f"key column(s) {', '.join(missing)} are not in the source schema "
                    f"({', '.join(source.columns)})",
                )
            ]
    return []


def _check_durability(sink: SinkCapabilities, mode: Mode) -> list[Violation]:
    """Rule 8: the sink is durable (seed 000: the planner checks durability).

    Both runners make progress permanent after the sink's commit returns: the continuous runner
    certifies the epoch and acknowledges the source, the bounded runner's caller persists the
    bookmark. A sink whose commit promises nothing (``Durability.NONE``) may lose writes after that,
    and then the source has already moved past them: that is loss, which no guarantee allows, not
    even at-least-once. So such a sink is refused in every mode, whatever delivery is asked for.
    """
    if sink.durability is not Durability.NONE:
        return []
    progress = (
        "certifying the epoch and acknowledging the source"
        if mode is Mode.CONTINUOUS
        else "persisting the bookmark"
    )
    return [
        Violation(
            Code.SINK_NOT_DURABLE,
            8,
            f"the sink declares durability none: its commit does not promise the writes survive, so "
            f"{progress} after it could lose records; declare acknowledged or transactional "
            "durability only if the destination keeps what a commit returned for",
        )
    ]


def _mechanisms(
    source: SourceCapabilities,
    sink: SinkCapabilities,
    mode: Mode,
    policy: WritePolicy,
    key: tuple[str, ...],
    durable_state: bool,
    dead_letter: bool,
) -> tuple[tuple[Mechanism, ...], tuple[str, ...]]:
    """The mechanisms that hold, and for those that do not, why not."""
    found: list[Mechanism] = []
    missing: list[str] = []
    watermark_gaps = [
        text
        for failed, text in (
            # Continuous mode never re-reads a non-deterministic source into an atomic watermark: the
            # runner certifies a commit the sink holds without a certificate from the sink's watermark.
            # A bounded rerun re-reads the source: it must give the same rows again, unless it resumes
            # from the bookmark the sink keeps with the token (every page carries one).
            (
                mode is Mode.BOUNDED
                and not source.deterministic
                and not (source.page_bookmarks and sink.watermark_bookmark),
                "the source is not deterministic",
            ),
            (not sink.atomic_watermark, "the sink has no atomic watermark"),
            (not durable_state, "the state is not durable"),
            (dead_letter, "a dead-letter route is configured"),
        )
        if failed
    ]
    if watermark_gaps:
        missing.append("atomic watermark: " + ", ".join(watermark_gaps))
    else:
        found.append(Mechanism.ATOMIC_WATERMARK)
    if policy in (WritePolicy.UPSERT, WritePolicy.VERSIONED_UPSERT) and key:
        found.append(Mechanism.KEYED_UPSERT)
    else:
        missing.append("keyed upsert: the policy is not a keyed upsert")
    if sink.dedup_by_event_identity and source.event_identity:
        found.append(Mechanism.EVENT_IDENTITY_DEDUP)
    else:
        missing.append(
            "event-identity dedup: "
            + (
                "the source has no stable event identity"
                if sink.dedup_by_event_identity
                else "the sink does not dedup"
            )
        )
    if mode is Mode.BOUNDED and policy is WritePolicy.REPLACE:
        found.append(Mechanism.ATOMIC_REPLACE)
    return tuple(found), tuple(missing)


def _window_text(sink: SinkCapabilities) -> str:
    if sink.dedup_window is None:
        return "the destination deduplicates by stable event identity with no time limit"
    return (
        f"the destination deduplicates by stable event identity within its duplicate window of "
        f"{sink.dedup_window.total_seconds():g}s; a replay older than the window duplicates: work "
        "published but not certified (a crashed or killed worker, an uncertain close or a halt) replayed "
        "more than the window after its first publish, when the stream resumes (an operator's release) "
        "that late, or a worker that lost its lease publishing that late"
    )


_DEAD_LETTER_TEXT: dict[Mode, str] = {
    Mode.CONTINUOUS: (
        "dead letters: effectively-once (the stream's route stores each by its event identity, so a "
        "replayed epoch stores none twice)"
    ),
    Mode.BOUNDED: (
        "dead letters: at-least-once (the dead-letter sink appends them, so a page read again after a "
        "failed run appends its refused rows again)"
    ),
}

_MECHANISM_TEXT: dict[Mechanism, Callable[[SinkCapabilities], str]] = {
    Mechanism.ATOMIC_WATERMARK: lambda sink: (
        "atomic watermark: records and a monotonic commit token commit in one destination "
        "transaction, so a replayed page or epoch at or below the watermark is skipped"
        + (
            " (the page's bookmark is kept with the token: a rerun resumes from what the destination holds)"
            if sink.watermark_bookmark
            else ""
        )
    ),
    Mechanism.KEYED_UPSERT: lambda sink: (
        "keyed upsert: re-applying a record converges on the same row instead of duplicating it"
    ),
    Mechanism.EVENT_IDENTITY_DEDUP: _window_text,
    Mechanism.ATOMIC_REPLACE: lambda sink: (
        "atomic replace: a complete snapshot replaces the table in one swap, so a rerun replaces "
        "rather than duplicates"
    ),
}
