"""What every role's scenario run shares: its steps run in order, each by the method named after it,
a call that never returns is a divergence, and every worker process it started is stopped at the end.

A role's run (:class:`.bounded_source.BoundedSourceRun`, :class:`.bounded_sink.BoundedSinkRun`,
:class:`.stream_source.StreamSourceRun`, :class:`.sink_run.SinkRun`) subclasses :class:`WorkerRun`,
names its role and the rule a hang breaks, and handles step ``Name`` in a method ``_name``.
"""

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

from faucet_dagster.conformance.scenarios.agent import AgentPlan
from faucet_dagster.conformance.scenarios.effects import EFFECTS
from faucet_dagster.conformance.scenarios.engine import Divergence, Step, Trace
from faucet_dagster.conformance.scenarios.workers import Hung, Worker, stop_all
from faucet_dagster.protocol import Role


class WorkerRun:
    """One scenario's run against the subject's connector, in worker processes of its role."""

    role: ClassVar[Role]
    works_rule: ClassVar[str]
    """The rule a call that does not return within the subject's timeout breaks."""
    hang: ClassVar[str] = "a call did not return"

    def __init__(self, subject: Any, setup: Any, trace: Trace) -> None:
        self.subject = subject
        self.setup = setup
        self.trace = trace
        self.timeout: float = subject.options.timeout
        self.workers: list[Worker] = []

    async def run(self, scenario: Sequence[Step]) -> None:
        """Run the steps in order (a line of the trace each, added before it runs); stop every
        worker started, whatever happens."""
        try:
            for step in scenario:
                self.trace.ran.append(step.describe())
                try:
                    await self._step(step)
                except Hung as hung:
                    raise Divergence(self.works_rule, f"{self.hang}: {hung}") from None
        finally:
            await stop_all(self.workers)

    async def _step(self, step: Step) -> None:
        """Run ``step`` by the method named after its type (``Drain`` -> ``_drain``)."""
        handler: Callable[[Any], Awaitable[None]] = getattr(self, f"_{type(step).__name__.lower()}")
        await handler(step)

    def _worker(self, name: str, *, crashable: bool = True) -> Worker:
        """A new worker process of the subject's role. A crashable one counts its effects, so a
        crash can be armed right before any of them (:mod:`.effects`)."""
        effects = (EFFECTS | self.subject.options.effects) if crashable else None
        worker = Worker(AgentPlan(self.subject.spec, self.role, effects), timeout=self.timeout, name=name)
        self.workers.append(worker)
        return worker


__all__ = ["WorkerRun"]
