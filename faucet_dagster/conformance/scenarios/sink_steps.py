"""The scenarios of a streaming sink: the steps, and how they are drawn from what the sink declares.

The battery plays the source and the runner. Its source is a set of ordering domains per resource
(positions 1, 2, ... in each), written by :class:`Produce` steps; its runner begins, applies,
commits and aborts epochs of several streams on one destination, certifies them (or dies between the
commit and the certificate), crashes at counted effects and recovers, lets a newer worker take a
stream over, reads what a stream committed from another process, and adds columns. Every scenario
has the same cast (:class:`Cast`): a stream per declared continuous policy (at least two), each with
two resources named with hostile identifiers, two domains per resource where the policy does not
depend on order; then a tour that exercises every dimension once, random steps, a crash sweep over
one epoch's every effect, and a final epoch per stream that commits everything produced.
"""

import random
from dataclasses import dataclass
from typing import Any

from faucet_dagster.conformance.scenarios import identifiers
from faucet_dagster.conformance.scenarios.engine import Step
from faucet_dagster.protocol import Durability, Operation, SinkCapabilities, WritePolicy


@dataclass(frozen=True)
class SinkDeclaration:
    """What a streaming sink and its setup declare, as the scenarios use it."""

    capabilities: SinkCapabilities
    per_resource: bool
    """The setup reads each resource on its own (``read_resource``); else one place holds them all."""
    replay_duplicates: str

    @property
    def policies(self) -> list[WritePolicy]:
        return sorted(self.capabilities.continuous_policies - {WritePolicy.REPLACE, WritePolicy.DELETE})

    @property
    def transactional(self) -> bool:
        return self.capabilities.durability is Durability.TRANSACTIONAL


@dataclass(frozen=True)
class StreamPlan:
    """One stream of the scenario: its name, policy, key, resources and domains per resource."""

    name: str
    policy: WritePolicy
    resources: tuple[str, ...]
    partitions: int

    @property
    def key(self) -> tuple[str, ...]:
        return ("id",) if self.policy.keyed else ()

    def describe(self) -> str:
        return (
            f"stream {self.name} ({self.policy.value}) writes resources "
            f"{', '.join(repr(r) for r in self.resources)}, {self.partitions} domain(s) each"
        )


@dataclass(frozen=True)
class Cast(Step):
    streams: tuple[StreamPlan, ...]
    fixed = True

    def describe(self) -> str:
        return "; ".join(plan.describe() for plan in self.streams)


@dataclass(frozen=True)
class Produce(Step):
    """The source writes events into one domain of one resource: ``insert``, ``update``, ``delete``,
    ``truncate``, or ``stale`` (an update of an older version), on keys chosen by number."""

    stream: int
    resource: int
    partition: int
    operations: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"source: {len(self.operations)} event(s) ({', '.join(self.operations)}) into stream "
            f"s{self.stream} resource #{self.resource} domain {self.partition}"
        )


@dataclass(frozen=True)
class Begin(Step):
    stream: int

    def describe(self) -> str:
        return f"s{self.stream}: begin_epoch"


@dataclass(frozen=True)
class Apply(Step):
    stream: int
    resource: int
    partition: int
    count: int

    def describe(self) -> str:
        where = f"resource #{self.resource} domain {self.partition}"
        return f"s{self.stream}: apply up to {self.count} event(s) of {where}"


@dataclass(frozen=True)
class Commit(Step):
    """Commit; ``certify`` False: the worker dies after the commit, before the certificate."""

    stream: int
    certify: bool = True

    def describe(self) -> str:
        tail = "" if self.certify else ", then the worker dies before the certificate is persisted"
        return f"s{self.stream}: commit_epoch{tail}"


@dataclass(frozen=True)
class Abort(Step):
    stream: int

    def describe(self) -> str:
        return f"s{self.stream}: abort_epoch"


@dataclass(frozen=True)
class Close(Step):
    stream: int

    def describe(self) -> str:
        return f"s{self.stream}: close_session"


@dataclass(frozen=True)
class Crash(Step):
    """The stream's worker process dies: now (``at_effect`` None), or at that effect of its next call."""

    stream: int
    at_effect: int | None

    def describe(self) -> str:
        if self.at_effect is None:
            return f"s{self.stream}: the worker process is killed"
        return f"s{self.stream}: the worker process is killed at effect {self.at_effect} of its next call"


@dataclass(frozen=True)
class Takeover(Step):
    """A newer worker (a higher fencing token) takes the stream; the old one lives on when the sink
    declares owner fencing (else it died first, as the lease requires)."""

    stream: int

    def describe(self) -> str:
        return f"s{self.stream}: a newer worker with a higher fencing token takes the stream over"


@dataclass(frozen=True)
class Zombie(Step):
    """The worker that lost the stream runs an epoch anyway."""

    stream: int

    def describe(self) -> str:
        return f"s{self.stream}: the old worker (lower fencing token) begins, applies and commits an epoch"


@dataclass(frozen=True)
class ReadState(Step):
    """Another process opens the stream and reads what it last committed."""

    stream: int

    def describe(self) -> str:
        return f"s{self.stream}: a second process reads last_committed()"


@dataclass(frozen=True)
class Evolve(Step):
    stream: int
    resource: int
    column: str

    def describe(self) -> str:
        return f"source: resource #{self.resource} of s{self.stream} gains column {self.column!r}"


@dataclass(frozen=True)
class Sweep(Step):
    """An epoch of every resource of the stream, once per effect it makes: the worker dies right
    before effect 0, then 1, 2, ... (each time recovered and replayed), until it completes."""

    stream: int

    def describe(self) -> str:
        return f"s{self.stream}: crash sweep over one epoch's every effect"


def declaration(subject: Any) -> SinkDeclaration:
    """What the streaming sink built from the setup's config declares (offline), and its setup."""
    return SinkDeclaration(
        subject.streaming_sink().capabilities(),
        per_resource=subject.sink_setup.read_resource is not None,
        replay_duplicates=subject.options.replay_duplicates,
    )


def generate(rng: random.Random, declared: SinkDeclaration) -> list[Step]:
    caps = declared.capabilities
    policies = declared.policies
    if len(policies) == 1:
        policies = policies * 2
    names = identifiers.resources(rng, 2 * len(policies))
    plans = tuple(
        StreamPlan(
            f"s{index}",
            policy,
            (names[2 * index], names[2 * index + 1]),
            1 if policy.order_dependent else 2,
        )
        for index, policy in enumerate(policies)
    )
    draw = _Draw(rng, declared, plans)
    steps: list[Step] = [Cast(plans)]
    for index in range(len(plans)):
        steps += draw.tour(index)
    columns = identifiers.columns(rng, len(plans))
    for index, column in enumerate(columns):
        steps += [Evolve(index, rng.randrange(2), column), *draw.epoch(index)]
    for index in range(len(plans)):
        steps += [*draw.produce_all(index), *draw.epoch(index, certify=False), *draw.epoch(index)]
        steps += [Begin(index), *draw.applies(index), Abort(index), ReadState(index)]
    for index in range(len(plans)):
        steps += [Takeover(index)]
        if caps.owner_fencing:
            steps += [*draw.produce_all(index), Zombie(index)]
        steps += draw.epoch(index)
    steps += [*draw.produce_all(sweep := rng.randrange(len(plans))), Sweep(sweep)]
    for _ in range(24):
        steps += draw.random_step()
    for index in range(len(plans)):
        steps += [Begin(index), *draw.applies(index, everything=True), Commit(index), ReadState(index)]
    return steps


class _Draw:
    def __init__(self, rng: random.Random, declared: SinkDeclaration, plans: tuple[StreamPlan, ...]) -> None:
        self.rng = rng
        self.declared = declared
        self.plans = plans

    def operations(self, plan: StreamPlan, count: int, *, mixed: bool) -> tuple[str, ...]:
        """Operations the policy accepts; ``mixed`` puts an insert and an update of one key first
        (two rows of one key in one batch)."""
        accepted = self.declared.capabilities.operations_for(plan.policy)
        kinds = ["insert"]
        if plan.policy.keyed and {Operation.UPDATE, Operation.UPSERT} & accepted:
            kinds += ["update", "update"]
        if plan.policy is WritePolicy.VERSIONED_UPSERT:
            kinds.append("stale")
        if Operation.DELETE in accepted and plan.policy.keyed:
            kinds.append("delete")
        chosen = [self.rng.choice(kinds) for _ in range(count)]
        if (
            Operation.TRUNCATE in accepted
            and plan.policy is WritePolicy.APPLY_CHANGES
            and self.rng.random() < 0.1
        ):
            chosen.append("truncate")
        if mixed and "update" in kinds:
            chosen = ["insert", "update:-1", *chosen]
        return tuple(chosen)

    def produce_all(self, index: int, *, mixed: bool = False) -> list[Step]:
        plan = self.plans[index]
        steps: list[Step] = []
        for resource in range(len(plan.resources)):
            for partition in range(plan.partitions):
                # The first domain gets more events than the second: their positions differ.
                count = (3 if partition == 0 else 1) + self.rng.randrange(2)
                steps.append(Produce(index, resource, partition, self.operations(plan, count, mixed=mixed)))
        return steps

    def applies(self, index: int, *, everything: bool = False) -> list[Step]:
        plan = self.plans[index]
        return [
            Apply(index, resource, partition, 1_000 if everything else 2 + self.rng.randrange(4))
            for resource in range(len(plan.resources))
            for partition in range(plan.partitions)
        ]

    def epoch(self, index: int, *, certify: bool = True) -> list[Step]:
        return [Begin(index), *self.applies(index, everything=True), Commit(index, certify)]

    def tour(self, index: int) -> list[Step]:
        return [*self.produce_all(index, mixed=True), *self.epoch(index)]

    def random_step(self) -> list[Step]:
        rng = self.rng
        index = rng.randrange(len(self.plans))
        plan = self.plans[index]
        choice = rng.choices(
            ["produce", "begin", "apply", "commit", "abort", "close", "crash", "read", "takeover"],
            weights=[6, 3, 5, 3, 1, 1, 2, 1, 1],
        )[0]
        if choice == "produce":
            return [
                Produce(
                    index,
                    rng.randrange(len(plan.resources)),
                    rng.randrange(plan.partitions),
                    self.operations(plan, 1 + rng.randrange(4), mixed=False),
                )
            ]
        if choice == "begin":
            return [Begin(index)]
        if choice == "apply":
            return [
                Apply(
                    index,
                    rng.randrange(len(plan.resources)),
                    rng.randrange(plan.partitions),
                    1 + rng.randrange(4),
                )
            ]
        if choice == "commit":
            return [Commit(index, certify=rng.random() < 0.8)]
        if choice == "abort":
            return [Abort(index)]
        if choice == "close":
            return [Close(index)]
        if choice == "crash":
            return [Crash(index, None if rng.random() < 0.3 else rng.randrange(12))]
        if choice == "read":
            return [ReadState(index)]
        steps: list[Step] = [Takeover(index)]
        if self.declared.capabilities.owner_fencing:
            steps += [*self.produce_all(index), Zombie(index)]
        return steps


__all__ = [
    "Abort",
    "Apply",
    "Begin",
    "Cast",
    "Close",
    "Commit",
    "Crash",
    "Evolve",
    "Produce",
    "ReadState",
    "SinkDeclaration",
    "StreamPlan",
    "Sweep",
    "Takeover",
    "Zombie",
    "declaration",
    "generate",
]
