"""The battery as data: every check once, and per connector role the suite of checks that apply.

A :class:`Check` names its function, the rule it enforces and the roles it applies to; a
:class:`Suite` is a role's ordered checks (singer-sdk's ``TestSuite(kind, tests)``). :func:`run_check`
runs one check against a fresh setup and cleans the setup up afterwards, whatever happened.
"""

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from faucet_dagster.conformance import bounded, streaming
from faucet_dagster.conformance.harness import Subject
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.scenarios.explorers import SCENARIO_RULE, scenarios
from faucet_dagster.protocol import Role

CheckFunction = Callable[[Subject], Awaitable[Outcome]]


@dataclass(frozen=True)
class Check:
    """One check: a stable id (``bounded_memory``), its label in tables (``2 memory``), the rule it
    enforces, the roles it applies to and the coroutine that runs it."""

    id: str
    label: str
    rule: str
    roles: frozenset[Role]
    run: CheckFunction
    exercises: tuple[str, ...] = ()
    """What the check exercises when its outcome does not say (the results table shows it)."""


@dataclass(frozen=True)
class Suite:
    """The checks of one role, in the order they run."""

    role: Role
    checks: tuple[Check, ...]


_BOUNDED = frozenset({Role.SOURCE, Role.SINK})
_ALL = frozenset(Role)

CHECKS: tuple[Check, ...] = (
    Check(
        "config_schema", "1 schema", bounded.SCHEMA_RULE, _ALL, bounded.config_schema, ("config_schema()",)
    ),
    Check(
        "bounded_memory",
        "2 memory",
        bounded.MEMORY_RULE,
        frozenset({Role.SOURCE}),
        bounded.bounded_memory,
        ("bounded: paging by batch_size",),
    ),
    Check("capabilities", "5 capabilities", bounded.CAPABILITY_RULE, _ALL, bounded.capabilities),
    Check("no_panic", "6 no panic", bounded.PANIC_RULE, _ALL, bounded.no_panic),
    Check("scenarios", "G scenarios", SCENARIO_RULE, _ALL, scenarios),
    Check(
        "slow_sink",
        "slow sink",
        streaming.SLOW_RULE,
        frozenset({Role.STREAM_SOURCE}),
        streaming.slow_sink,
        ("replay: deliveries kept alive under backpressure",),
    ),
    Check(
        "cancel_during_read",
        "cancel read",
        streaming.CANCEL_RULE,
        frozenset({Role.STREAM_SOURCE}),
        streaming.cancel_during_read,
        ("cancellation of a read",),
    ),
    Check(
        "failed_writes",
        "failed write",
        streaming.FAILED_WRITE_RULE,
        frozenset({Role.STREAMING_SINK}),
        streaming.failed_writes,
        ("refused rows, abort_epoch",),
    ),
    Check(
        "uncertain_commit",
        "uncertain commit",
        streaming.UNCERTAIN_RULE,
        frozenset({Role.STREAMING_SINK}),
        streaming.uncertain_commit,
        ("a commit given up by its caller, last_committed()",),
    ),
    Check(
        "lifecycle_order",
        "lifecycle",
        streaming.LIFECYCLE_RULE,
        frozenset({Role.STREAMING_SINK}),
        streaming.lifecycle_order,
        ("the epoch lifecycle",),
    ),
    Check(
        "shutdown_with_outstanding_work",
        "shutdown",
        streaming.SHUTDOWN_RULE,
        frozenset({Role.STREAMING_SINK}),
        streaming.shutdown_with_outstanding_work,
        ("close_session with outstanding work, a stalled destination",),
    ),
)
"""Every check, in table order: the FCP's checks that are not scenarios (1, 2, 5, 6), the generated
scenarios (which hold the FCP's resume and idempotent replay, and the streaming contract's replays,
acknowledgements, ownership, positions and transactions), then the interruptions a scenario does not
draw (a slow sink, a cancelled read, refused writes, an uncertain commit, misordered calls, a stalled
shutdown)."""

CHECKS_BY_ID: Mapping[str, Check] = {check.id: check for check in CHECKS}

SUITES: Mapping[Role, Suite] = {
    role: Suite(role, tuple(check for check in CHECKS if role in check.roles)) for role in Role
}
"""The suite of each role."""


async def run_check(check: Check, subject: Subject) -> Outcome:
    """Run ``check`` on ``subject`` and clean its setup up (also when the check failed).

    A verdict is always a :class:`ConformanceFailure` naming the check's rule: an exception the
    connector raised where the check expected none becomes one (its cause kept), never the verdict.
    """
    try:
        outcome = await check.run(subject)
        return outcome if outcome.exercised else dataclasses.replace(outcome, exercised=check.exercises)
    except ConformanceFailure:
        raise
    except Exception as exc:
        raise ConformanceFailure(
            check.rule,
            f"{subject.label} raised {type(exc).__name__} where {check.id} expected it to work: {exc}",
        ) from exc
    finally:
        if subject.setup.cleanup is not None:
            await subject.setup.cleanup()


__all__ = ["CHECKS", "CHECKS_BY_ID", "SUITES", "Check", "CheckFunction", "Suite", "run_check"]
