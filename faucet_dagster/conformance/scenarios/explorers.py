"""One explorer per connector role, and the ``scenarios`` check that runs them.

Each explorer reads what the connector declares (offline), draws scenarios from a seed and runs them
through :func:`.engine.explore`; see the role's modules for what its scenarios do.
"""

import random
from collections.abc import Sequence
from typing import Any

from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import Outcome
from faucet_dagster.conformance.scenarios import bounded_sink, bounded_source, sink_steps, stream_source
from faucet_dagster.conformance.scenarios.engine import Explorer, Step, Trace, explore
from faucet_dagster.conformance.scenarios.sink_run import SinkRun
from faucet_dagster.conformance.scenarios.sink_steps import SinkDeclaration
from faucet_dagster.protocol import ConfigError, Role

SCENARIO_RULE = "the battery's generated scenarios (seed 004 section 7: the battery is the contract)"


class StreamingSinkExplorer(Explorer[SinkDeclaration]):
    def declaration(self, subject: Subject) -> SinkDeclaration:
        sink = subject.streaming_sink()
        return SinkDeclaration(
            sink.capabilities(),
            per_resource=subject.sink_setup.read_resource is not None,
            replay_duplicates=subject.options.replay_duplicates,
        )

    def generate(self, rng: random.Random, declared: SinkDeclaration) -> list[Step]:
        return sink_steps.generate(rng, declared)

    async def run(
        self, steps: Sequence[Step], subject: Any, setup: Any, declared: SinkDeclaration, trace: Trace
    ) -> None:
        await SinkRun(subject, setup, declared, trace).run(steps)


class BoundedSinkExplorer(Explorer[bounded_sink.BoundedSinkDeclaration]):
    def declaration(self, subject: Subject) -> bounded_sink.BoundedSinkDeclaration:
        return bounded_sink.declaration(subject)

    def generate(self, rng: random.Random, declared: bounded_sink.BoundedSinkDeclaration) -> list[Step]:
        return bounded_sink.generate(rng, declared)

    async def run(
        self,
        steps: Sequence[Step],
        subject: Any,
        setup: Any,
        declared: bounded_sink.BoundedSinkDeclaration,
        trace: Trace,
    ) -> None:
        await bounded_sink.BoundedSinkRun(subject, setup, declared, trace).run(steps)


class BoundedSourceExplorer(Explorer[bounded_source.BoundedSourceDeclaration]):
    def declaration(self, subject: Subject) -> bounded_source.BoundedSourceDeclaration:
        return bounded_source.declaration(subject)

    def generate(self, rng: random.Random, declared: bounded_source.BoundedSourceDeclaration) -> list[Step]:
        return bounded_source.generate(rng, declared)

    async def run(
        self,
        steps: Sequence[Step],
        subject: Any,
        setup: Any,
        declared: bounded_source.BoundedSourceDeclaration,
        trace: Trace,
    ) -> None:
        await bounded_source.BoundedSourceRun(subject, setup, declared, trace).run(steps)


class StreamSourceExplorer(Explorer[stream_source.StreamSourceDeclaration]):
    def declaration(self, subject: Subject) -> stream_source.StreamSourceDeclaration:
        return stream_source.declaration(subject)

    def generate(self, rng: random.Random, declared: stream_source.StreamSourceDeclaration) -> list[Step]:
        return stream_source.generate(rng, declared)

    async def run(
        self,
        steps: Sequence[Step],
        subject: Any,
        setup: Any,
        declared: stream_source.StreamSourceDeclaration,
        trace: Trace,
    ) -> None:
        await stream_source.StreamSourceRun(subject, setup, declared, trace).run(steps)


EXPLORERS: dict[Role, Explorer[Any]] = {
    Role.STREAM_SOURCE: StreamSourceExplorer(),
    Role.SOURCE: BoundedSourceExplorer(),
    Role.STREAMING_SINK: StreamingSinkExplorer(),
    Role.SINK: BoundedSinkExplorer(),
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


__all__ = ["EXPLORERS", "SCENARIO_RULE", "StreamingSinkExplorer", "scenarios"]
