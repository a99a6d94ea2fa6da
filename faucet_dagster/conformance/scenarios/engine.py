"""Scenarios drawn from a seed, run against the real connector, judged after every step, shrunk.

An :class:`Explorer` per connector role knows three things: what the connector declares (its
capabilities, and the hooks its setup offers), how to draw a scenario from a seed (a list of
:class:`Step` values, the operations the connector meets in production), and how to run one against
a fresh setup while a reference model says, after every step, what the connector's observable state
must be. A step whose state leaves the model raises :class:`Divergence` with the rule it breaks and
the difference in words.

:func:`explore` runs ``examples`` scenarios of a seed. A scenario is a pure function of the seed,
the example number and the declaration: never of the machine's speed (crashes fall at counted
effects, reads wait for rows rather than for time). The first divergence is shrunk (delta
debugging: drop chunks of steps, keep a smaller scenario while it still breaks the same rule, each
try on a fresh setup) to a minimal sequence, and reported as a :class:`ConformanceFailure` with the
seed, the steps, what diverged, and the commands that replay it.
"""

import asyncio
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from faucet_dagster.conformance.options import ConformanceFailure, Outcome

D = TypeVar("D")


@dataclass(frozen=True)
class Step:
    """One operation of a scenario. Subclasses are frozen dataclasses that say what they do.

    A ``fixed`` step (the scenario's cast: its streams, its resources) is never dropped by shrinking.
    """

    fixed: ClassVar[bool] = False

    def describe(self) -> str:
        return type(self).__name__


class Divergence(Exception):
    """The connector's observable state left the model: ``rule`` is the seed rule broken, ``words``
    says what differs (what the connector did or holds, and what the model holds)."""

    def __init__(self, rule: str, words: str) -> None:
        super().__init__(f"[{rule}] {words}")
        self.rule = rule
        self.words = words
        self.trace: Trace | None = None
        """The run's trace, attached by :func:`explore` (which step diverged is its last line)."""


@dataclass
class Trace:
    """What a run did: the steps it ran (with what each observed), the step it diverged at, and the
    declared capabilities it exercised."""

    ran: list[str] = field(default_factory=list)
    exercised: set[str] = field(default_factory=set)
    diverged_at: int | None = None

    def note(self, text: str) -> None:
        """Add what the current step observed to its line."""
        if self.ran:
            self.ran[-1] += f" [{text}]"


async def run_traced(
    explorer: "Explorer[Any]", steps: Sequence[Step], subject: Any, setup: Any, declared: Any
) -> Trace:
    """Run ``steps``; a Divergence leaves with the run's trace, its last line the step that diverged."""
    trace = Trace()
    try:
        await explorer.run(steps, subject, setup, declared, trace)
    except Divergence as divergence:
        trace.diverged_at = max(0, len(trace.ran) - 1)
        divergence.trace = trace
        raise
    return trace


class Explorer(ABC, Generic[D]):
    """The scenarios of one connector role."""

    @abstractmethod
    def declaration(self, subject: Any) -> D:
        """What the connector and its setup declare (built offline: no I/O)."""

    @abstractmethod
    def generate(self, rng: random.Random, declared: D) -> list[Step]:
        """A scenario: every declared capability exercised, in an order and with data from ``rng``."""

    @abstractmethod
    async def run(self, steps: Sequence[Step], subject: Any, setup: Any, declared: D, trace: Trace) -> None:
        """Run ``steps`` on ``setup``, judging the state after each; raise Divergence at the first
        step whose state leaves the model. Adds one line per step to ``trace.ran`` before running
        it. Stops every worker it started, whatever happens."""


@dataclass(frozen=True)
class Replay:
    """How to run the same scenarios again: the seed and the number of examples."""

    seed: int
    examples: int
    connector: str
    role: str

    def commands(self) -> str:
        return (
            f"faucet conformance {self.connector} --role {self.role} --check scenarios --seed {self.seed} "
            f"--examples {self.examples}\n"
            f"    pytest <your conformance test module> -k scenarios --conformance-seed {self.seed} "
            f"--conformance-examples {self.examples}"
        )


def scenario_random(seed: int, example: int, role: str) -> random.Random:
    """The random source of one scenario: seeded from text, so the same on every machine and run."""
    return random.Random(f"faucet-conformance/{role}/{seed}/{example}")


RunOnce = Callable[[Sequence[Step]], Awaitable[Trace]]


async def explore(
    explorer: Explorer[Any],
    subject: Any,
    fresh_setup: Callable[[], Any],
    cleanup: Callable[[Any], Awaitable[None]],
    *,
    seed: int,
    examples: int,
    shrink_runs: int,
) -> Outcome:
    """Run ``examples`` scenarios of ``seed``; the first divergence is shrunk and raised as a
    ConformanceFailure. ``fresh_setup()`` gives a new setup for every run; ``cleanup`` releases it."""
    declared = explorer.declaration(subject)
    exercised: set[str] = set()
    steps_run = 0

    async def run_once(steps: Sequence[Step]) -> Trace:
        setup = await asyncio.to_thread(fresh_setup)
        try:
            return await run_traced(explorer, steps, subject, setup, declared)
        finally:
            await cleanup(setup)

    for example in range(examples):
        steps = explorer.generate(scenario_random(seed, example, subject.role.value), declared)
        try:
            trace = await run_once(steps)
        except Divergence as divergence:
            replay = Replay(seed, example + 1, subject.spec.name, subject.role.value)
            raise await _report(divergence, steps, run_once, shrink_runs, replay, example) from None
        exercised |= trace.exercised
        steps_run += len(steps)
    return Outcome.passed(
        f"{examples} scenario(s) of seed {seed}, {steps_run} steps, no divergence",
        exercised=tuple(sorted(exercised)),
    )


async def _report(
    divergence: Divergence,
    steps: Sequence[Step],
    run_once: RunOnce,
    shrink_runs: int,
    replay: Replay,
    example: int,
) -> ConformanceFailure:
    minimal, final, runs = await shrink(steps, divergence, run_once, shrink_runs)
    minimal_trace = final.trace or Trace()
    lines = [
        final.words,
        f"seed {replay.seed}, example {example + 1}: a scenario of {len(steps)} steps, shrunk to "
        f"{len(minimal)} in {runs} run(s):",
    ]
    for number, line in enumerate(minimal_trace.ran, 1):
        marker = "   <- diverged here" if number - 1 == minimal_trace.diverged_at else ""
        lines.append(f"  {number:>3}. {line}{marker}")
    lines.append("replay it with:")
    lines.append("    " + replay.commands())
    return ConformanceFailure(final.rule, "\n".join(lines))


async def shrink(
    steps: Sequence[Step], divergence: Divergence, run_once: RunOnce, budget: int
) -> tuple[list[Step], Divergence, int]:
    """Delta debugging: the smallest scenario found within ``budget`` runs that still breaks the same
    rule. The steps after the divergence go first (they never ran), then chunks of ever smaller size.
    Returns the steps, the divergence of their run (with its trace) and the runs it took."""
    assert divergence.trace is not None and divergence.trace.diverged_at is not None
    current = list(steps[: divergence.trace.diverged_at + 1])
    best = divergence
    runs = 0

    async def still_fails(candidate: list[Step]) -> Divergence | None:
        nonlocal runs
        runs += 1
        try:
            await run_once(candidate)
        except Divergence as again:
            return again if again.rule == divergence.rule else None
        return None

    chunks = 2
    while runs < budget and len(current) > 1:
        size = max(1, len(current) // chunks)
        reduced = False
        for start in range(0, len(current), size):
            if runs >= budget:
                break
            if any(step.fixed for step in current[start : start + size]):
                continue
            candidate = current[:start] + current[start + size :]
            if not candidate:
                continue
            result = await still_fails(candidate)
            if result is not None and result.trace is not None and result.trace.diverged_at is not None:
                best = result
                current = candidate[: result.trace.diverged_at + 1]
                chunks = max(chunks - 1, 2)
                reduced = True
                break
        if not reduced:
            if size == 1:
                break
            chunks = min(len(current), chunks * 2)
    return current, best, runs


__all__ = [
    "Divergence",
    "Explorer",
    "Replay",
    "Step",
    "Trace",
    "explore",
    "run_traced",
    "scenario_random",
    "shrink",
]
