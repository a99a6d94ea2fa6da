"""The scenarios of a bounded sink, as steps, and how they are drawn from what it declares.

See :mod:`.bounded_sink` for what a scenario does and how each step is judged.
"""

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from faucet_dagster.conformance.scenarios import identifiers
from faucet_dagster.conformance.scenarios.engine import Step
from faucet_dagster.protocol import (
    FaucetError,
    WritePolicy,
)

REPLAY_RULE = (
    "FCP 3.1 idempotent replay: records and commit token commit atomically; a replayed page writes nothing"
)
TOKEN_RULE = "FCP 3.1 last_committed_token() reads the token back durably, from any process"
POLICY_RULE = "FCP 3 the destination holds what the write mode makes of the committed pages"
NAME_RULE = "values: a name lands exactly as given (keyword, case, unicode, 63 bytes) or is refused"
WORKS_RULE = "FCP 3 a sink call works on a valid config, or fails with a typed FaucetError"


@dataclass(frozen=True)
class LanePlan:
    """One destination of the scenario: a config writing ``resource`` with ``policy``."""

    policy: WritePolicy
    resource: str
    key: tuple[str, ...]
    idempotent: bool
    dedups: bool
    evolves: bool

    def describe(self) -> str:
        how = "with the atomic watermark" if self.idempotent else "without a watermark"
        return f"{self.policy.value} into {self.resource!r} {how}"


@dataclass(frozen=True)
class BoundedSinkDeclaration:
    lanes: tuple[LanePlan, ...]
    per_resource: bool


@dataclass(frozen=True)
class Cast(Step):
    lanes: tuple[LanePlan, ...]
    fixed = True

    def describe(self) -> str:
        return "lanes: " + "; ".join(f"#{n} {lane.describe()}" for n, lane in enumerate(self.lanes))


@dataclass(frozen=True)
class Produce(Step):
    """The source gains pages (of these sizes) for a lane; keyed lanes update some held keys."""

    lane: int
    sizes: tuple[int, ...]

    def describe(self) -> str:
        return f"source: lane #{self.lane} gains {len(self.sizes)} page(s) of {list(self.sizes)} row(s)"


@dataclass(frozen=True)
class Run(Step):
    """A run of the sync into the lane, in a new process. It dies at ``crash_at`` (an effect number
    of its page writes), or, ``before_close``, after writing every page, before ``close``."""

    lane: int
    crash_at: int | None = None
    before_close: bool = False

    def describe(self) -> str:
        tail = (
            "" if self.crash_at is None else f", the process killed at effect {self.crash_at} of its writes"
        )
        if self.before_close:
            tail = ", the process killed after its last page, before close()"
        return f"lane #{self.lane}: a run writes the pages not yet committed{tail}"


@dataclass(frozen=True)
class Sweep(Step):
    """A page written by runs killed before effect 0, 1, 2... of the run, each time rerun."""

    lane: int

    def describe(self) -> str:
        return f"lane #{self.lane}: crash sweep over one page's every effect"


@dataclass(frozen=True)
class ReadToken(Step):
    lane: int

    def describe(self) -> str:
        return f"lane #{self.lane}: a second process reads last_committed_token()"


@dataclass(frozen=True)
class Replay(Step):
    """The last committed page written again, with its own token and with an older one."""

    lane: int

    def describe(self) -> str:
        return f"lane #{self.lane}: the last committed page is written again with tokens not newer"


@dataclass(frozen=True)
class Evolve(Step):
    lane: int
    column: str

    def describe(self) -> str:
        return f"lane #{self.lane}: evolve_schema adds column {self.column!r} (twice), pages carry it"


def declaration(subject: Any) -> BoundedSinkDeclaration:
    """A lane per policy the sink's configs declare (``write_to``), else the setup's config alone."""
    setup = subject.sink_setup
    names = list(identifiers.RESOURCES)
    lanes: list[LanePlan] = []
    candidates: list[tuple[WritePolicy, Mapping[str, Any], str]] = []
    if setup.write_to is not None:
        for number, policy in enumerate(sorted(WritePolicy)):
            key = ("id",) if policy.keyed else ()
            resource = names[number % len(names)]
            try:
                candidates.append((policy, setup.write_to(resource, policy, key), resource))
            except FaucetError:
                continue
    else:
        candidates.append((WritePolicy.APPEND, setup.config, "*"))
    for policy, config, resource in candidates:
        try:
            sink = subject.sink(dict(config))
        except FaucetError:
            continue
        written, key = sink.write_mode()
        if setup.write_to is not None and (
            written is not policy or policy not in sink.capabilities().bounded_policies
        ):
            continue
        lanes.append(
            LanePlan(
                written,
                resource,
                tuple(key),
                idempotent=sink.supports_idempotent_writes() and written is not WritePolicy.REPLACE,
                dedups=sink.dedups_by_key(),
                evolves=sink.supports_schema_evolution(),
            )
        )
    return BoundedSinkDeclaration(tuple(lanes), per_resource=setup.read_resource is not None)


def generate(rng: random.Random, declared: BoundedSinkDeclaration) -> list[Step]:
    lanes = declared.lanes
    steps: list[Step] = [Cast(lanes)]
    columns = iter(identifiers.columns(rng, len(identifiers.COLUMNS)))
    for number, lane in enumerate(lanes):
        steps += [Produce(number, (2 + rng.randrange(3), 1 + rng.randrange(3))), Run(number)]
        if lane.idempotent:
            steps += [ReadToken(number), Replay(number)]
        if lane.evolves:
            steps += [Evolve(number, next(columns)), Produce(number, (2,)), Run(number)]
        steps += [Produce(number, (2, 2, 1)), Run(number, crash_at=rng.randrange(8)), Run(number)]
        steps += [Produce(number, (1 + rng.randrange(3),)), Run(number, before_close=True)]
        steps += [ReadToken(number)] if lane.idempotent else []
        steps += [Run(number)]
    swept = [number for number, lane in enumerate(lanes) if lane.idempotent]
    if swept:
        steps += [Sweep(chosen := rng.choice(swept)), ReadToken(chosen)]
    for _ in range(6):
        number = rng.randrange(len(lanes))
        steps += [
            Produce(number, (1 + rng.randrange(4),)),
            Run(number, crash_at=rng.choice([None, rng.randrange(10)])),
        ]
    for number, lane in enumerate(lanes):
        steps += [Run(number)] + ([ReadToken(number)] if lane.idempotent else [])
    return steps


__all__ = [
    "NAME_RULE",
    "POLICY_RULE",
    "REPLAY_RULE",
    "TOKEN_RULE",
    "WORKS_RULE",
    "BoundedSinkDeclaration",
    "Cast",
    "Evolve",
    "LanePlan",
    "Produce",
    "ReadToken",
    "Replay",
    "Run",
    "Sweep",
    "declaration",
    "generate",
]
