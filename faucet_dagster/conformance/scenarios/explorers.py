"""One explorer per connector role, and the ``scenarios`` check that runs them.

Each explorer reads what the connector declares (offline), draws scenarios from a seed and runs them
through :func:`.engine.explore`; the role's modules say what its scenarios do: streaming sinks
(:mod:`.sink_steps`, :mod:`.sink_run`), bounded sinks (:mod:`.bounded_sink`), bounded sources
(:mod:`.bounded_source`), stream sources (:mod:`.stream_source`).
"""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import Outcome
from faucet_dagster.conformance.scenarios import (
    bounded_sink,
    bounded_sink_steps,
    bounded_source,
    sink_run,
    sink_steps,
    stream_source,
    stream_source_steps,
)
from faucet_dagster.conformance.scenarios.engine import Explorer, Step, Trace, explore
from faucet_dagster.protocol import ConfigError, Role

SCENARIO_RULE = "the battery's generated scenarios (seed 004 section 7: the battery is the contract)"


class Runner(Protocol):
    """What runs one scenario (built from the subject, its setup, the declaration and the trace)."""

    async def run(self, steps: Sequence[Step]) -> None: ...


@dataclass(frozen=True)
class RoleExplorer(Explorer[Any]):
    """The scenarios of one role: how its declaration is read, how scenarios are drawn, what runs them."""

    declare: Callable[[Subject], Any]
    draw: Callable[[random.Random, Any], list[Step]]
    runner: Callable[[Any, Any, Any, Trace], Runner]

    def declaration(self, subject: Subject) -> Any:
        return self.declare(subject)

    def generate(self, rng: random.Random, declared: Any) -> list[Step]:
        return self.draw(rng, declared)

    async def run(self, steps: Sequence[Step], subject: Any, setup: Any, declared: Any, trace: Trace) -> None:
        await self.runner(subject, setup, declared, trace).run(steps)


EXPLORERS: dict[Role, Explorer[Any]] = {
    Role.SOURCE: RoleExplorer(
        bounded_source.declaration, bounded_source.generate, bounded_source.BoundedSourceRun
    ),
    Role.SINK: RoleExplorer(
        bounded_sink_steps.declaration, bounded_sink_steps.generate, bounded_sink.BoundedSinkRun
    ),
    Role.STREAM_SOURCE: RoleExplorer(
        stream_source_steps.declaration, stream_source_steps.generate, stream_source.StreamSourceRun
    ),
    Role.STREAMING_SINK: RoleExplorer(sink_steps.declaration, sink_steps.generate, sink_run.SinkRun),
}


async def scenarios(subject: Subject) -> Outcome:
    """The generated scenarios of the subject's role: ``options.examples`` of ``options.seed``. The
    first run uses the subject's setup (cleaned up by the caller), every later one a fresh setup."""
    explorer = EXPLORERS[subject.role]
    options = subject.options
    unused = [subject.setup]

    def fresh_setup() -> Any:
        if unused:
            return unused.pop()
        if subject.fresh is None:
            raise ConfigError(
                f"{subject.label}: one setup was given and a second run needs another "
                "(build the Subject with fresh=...)",
                where="faucet conformance",
            )
        return subject.fresh()

    async def cleanup(setup: Any) -> None:
        if setup is not subject.setup and setup.cleanup is not None:
            await setup.cleanup()

    examples = options.examples if subject.fresh is not None else 1
    shrink = options.shrink_runs if subject.fresh is not None else 0
    return await explore(
        explorer, subject, fresh_setup, cleanup, seed=options.seed, examples=examples, shrink_runs=shrink
    )


__all__ = ["EXPLORERS", "SCENARIO_RULE", "RoleExplorer", "scenarios"]
