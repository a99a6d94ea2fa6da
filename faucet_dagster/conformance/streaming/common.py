"""What the streaming checks share: the rule each check enforces, the read that only cancellation
stops, and the steps that must work (a step, rows certified once, an epoch committed).
"""

from collections.abc import Awaitable
from typing import Any, TypeVar

from faucet_dagster.conformance.harness import Subject, covering, sink_batch
from faucet_dagster.conformance.options import ConformanceFailure
from faucet_dagster.protocol import EpochId, ReadLimits, StreamingSinkSession

T = TypeVar("T")

SLOW_RULE = "stream 2 backpressure: a slow sink loses and duplicates nothing"
CANCEL_RULE = "stream 3 cancellation is an interruption"
FAILED_WRITE_RULE = "stream 6 failed sink writes are never reported as committed"
UNCERTAIN_RULE = "stream 7 an uncertain commit is resolved or reported, never lost"
LIFECYCLE_RULE = "stream 6 epoch lifecycle order"
SHUTDOWN_RULE = "stream 7 honest shutdown"

ENDLESS = ReadLimits(records=None, bytes=None, idle=None, age=None)
"""A read that only cancellation (or the source's own end) stops."""


async def succeeds(rule: str, what: str, step: Awaitable[T]) -> T:
    """Await a step that must work: any error from the connector breaks ``rule``."""
    try:
        return await step
    except ConformanceFailure:
        raise
    except Exception as exc:
        raise ConformanceFailure(rule, f"{what} failed: {type(exc).__name__}: {exc}") from exc


def certified_once(rule: str, seen: list[int], expected: list[int], situation: str) -> None:
    """``seen`` (the ids certified) is ``expected``, each once: anything else breaks ``rule``."""
    if sorted(seen) != expected:
        duplicates = len(seen) - len(set(seen))
        missing = sorted(set(expected) - set(seen))
        raise ConformanceFailure(
            rule,
            f"{situation}: {len(seen)} rows certified for {len(expected)} added ({duplicates} duplicate(s), "
            f"missing ids {missing[:5]})",
        )


async def commit_rows(
    subject: Subject, session: StreamingSinkSession, epoch: EpochId, rows: list[dict[str, Any]], rule: str
) -> Any:
    """One whole epoch of ``rows`` on ``session``: begin, apply, commit; the commit's receipts."""
    await subject.within(session.begin_epoch(epoch), rule, "begin_epoch")
    await subject.within(session.apply(epoch, sink_batch(epoch, rows)), rule, "apply")
    return await subject.within(session.commit_epoch(epoch, covering(rows)), rule, "commit_epoch")
