"""Options of a conformance run and the outcome of one check.

Only the standard library is imported here: the pytest plugin and the CLI read these types without
loading connectors, pyarrow or a client library.
"""

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

ReplayDuplicates = Literal["none", "within_window", "at_least_once"]
"""What a replayed epoch (an interruption after the destination commit, before the certificate) leaves
at the destination, as the connector documents it: ``none`` (no duplicate, ever: a watermark or a
keyed apply), ``within_window`` (no duplicate while the replay is within the destination's duplicate
window, which the battery's replay always is), ``at_least_once`` (duplicates possible, never loss)."""


@dataclass(frozen=True, slots=True)
class ConformanceOptions:
    """How the battery exercises one connector role; every field has a default that suits our servers.

    ``timeout`` bounds every protocol call: a call still running then is a hang (check 6). The
    bounded-memory check reads ``dataset_rows`` rows in pages of ``batch_size`` (keep the ratio large:
    it is what tells paging from buffering). ``replay_duplicates`` is the connector's documented
    duplicate handling of a replayed epoch (streaming sinks). ``slow_sink_seconds`` is how long the
    slow sink blocks one write: longer than the source's redelivery timeout shows that the source
    keeps its deliveries alive. ``settle_seconds`` is how long the battery waits to see whether
    anything still lands after a call promised that nothing would. ``checks`` restricts the run to
    those check ids (``None``: every check of the role).

    The generated scenarios (check ``scenarios``): ``examples`` scenarios drawn from ``seed`` (the same
    seed and number replay the same scenarios on any machine); a failure is shrunk in at most
    ``shrink_runs`` runs. ``effects`` names, as ``module:qualified name``, the calls of a client
    library the battery does not know that change something outside the process (a crash is armed
    right before each: see :mod:`faucet_dagster.conformance.scenarios.effects`).
    """

    timeout: float = 30.0
    dataset_rows: int = 3_000
    batch_size: int = 100
    replay_duplicates: ReplayDuplicates = "none"
    slow_sink_seconds: float = 1.5
    settle_seconds: float = 0.5
    checks: frozenset[str] | None = None
    seed: int = 0
    examples: int = 1
    shrink_runs: int = 40
    effects: frozenset[str] = frozenset()


DEFAULT_OPTIONS = ConformanceOptions()
"""The options a check runs with unless the connector's test class says otherwise."""


class Status(StrEnum):
    """How a check ended. A failure is an exception (:class:`ConformanceFailure`), never a status."""

    PASS = "pass"
    NOT_APPLICABLE = "n/a"
    """The check does not apply, and the connector declares so honestly (the battery asserted the
    declaration, e.g. ``transaction_boundaries`` is False, before returning this)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """A check that did not fail: passed, or not applicable with the reason."""

    status: Status
    detail: str
    exercised: tuple[str, ...] = ()
    """The declared capabilities and policies the check exercised (for the results table)."""

    @classmethod
    def passed(cls, detail: str, exercised: tuple[str, ...] = ()) -> "Outcome":
        return cls(Status.PASS, detail, exercised)

    @classmethod
    def not_applicable(cls, reason: str) -> "Outcome":
        return cls(Status.NOT_APPLICABLE, reason)


class ConformanceFailure(AssertionError):
    """A connector broke a rule of the contract. ``rule`` names it (``FCP 2.2 bounded memory``).

    An ``AssertionError``, so pytest reports it as a failed assertion with the message
    ``[<rule>] <what happened>``.
    """

    def __init__(self, rule: str, message: str) -> None:
        self.rule = rule
        self.message = message
        super().__init__(f"[{rule}] {message}")
