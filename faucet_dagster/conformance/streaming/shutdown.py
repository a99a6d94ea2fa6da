"""Stream check 7, honest shutdown: ``close_session`` with outstanding work, and against a stalled
destination (its server process SIGSTOPped) with a commit given up and with an apply cancelled
mid-batch. A successful close promises that nothing lands later; a cancelled call stops."""

import asyncio

from faucet_dagster.conformance.harness import (
    STREAM,
    WORKER,
    Subject,
    covering,
    open_sink_session,
    pairs,
    quietly_close,
    sink_batch,
)
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.conformance.streaming.common import SHUTDOWN_RULE
from faucet_dagster.conformance.streaming.sinks import close_and_watch, close_honestly
from faucet_dagster.protocol import Durability, EpochId


async def shutdown_with_outstanding_work(subject: Subject) -> Outcome:
    """close_session with an applied, uncommitted epoch: returns (nothing lands afterwards, a
    transactional sink shows nothing of it) or raises UncertainOutcome."""
    caps = subject.streaming_sink().capabilities()
    rows = make_rows(1, 200)
    epoch = EpochId(STREAM, 1, WORKER.fencing_token)
    session = await open_sink_session(subject, SHUTDOWN_RULE)
    try:
        await subject.within(session.begin_epoch(epoch), SHUTDOWN_RULE, "begin_epoch")
        await subject.within(session.apply(epoch, sink_batch(epoch, rows)), SHUTDOWN_RULE, "apply")
    except BaseException:
        await quietly_close(session)
        raise
    closed, before, after = await close_and_watch(subject, session, SHUTDOWN_RULE)
    if closed and after != before:
        raise ConformanceFailure(
            SHUTDOWN_RULE,
            f"close_session returned, then the destination changed ({len(before)} -> {len(after)} rows)",
        )
    if caps.durability is Durability.TRANSACTIONAL and after:
        raise ConformanceFailure(
            SHUTDOWN_RULE, "a transactional sink shows rows of an epoch that never committed"
        )
    fresh = await open_sink_session(subject, SHUTDOWN_RULE)
    try:
        state = await subject.within(fresh.last_committed(), SHUTDOWN_RULE, "last_committed")
    finally:
        await quietly_close(fresh)
    if state is not None:
        raise ConformanceFailure(
            SHUTDOWN_RULE, f"an epoch that never committed is reported committed: {state}"
        )
    stalled = await _close_against_a_stalled_destination(subject)
    return Outcome.passed(
        "close with outstanding work "
        + ("promised nothing more lands" if closed else "was uncertain")
        + (f"; {stalled}" if stalled else "")
    )


async def _close_against_a_stalled_destination(subject: Subject) -> str | None:
    """Against a destination that stopped answering (local servers store within milliseconds: only
    a stall shows a close that does not wait for, or fence, its remote requests): an epoch applied
    and committed, given up by the caller, then close_session; and an apply cancelled mid-batch,
    then close_session. Returning while the destination is stalled promises that none of it lands
    later; a cancelled apply must stop (raise), not finish the batch behind the caller's back."""
    if subject.sink_setup.stall is None:
        return None
    committed = await _stalled(subject, 2, make_rows(5_001, 20), cancel_early=False)
    cancelled = await _stalled(subject, 3, make_rows(7_001, 500), cancel_early=True)
    return (
        f"against a stalled destination: a given-up commit, then close {committed}; a cancelled "
        f"apply, then close {cancelled}"
    )


async def _stalled(
    subject: Subject, number: int, rows: list[dict[str, object]], *, cancel_early: bool
) -> str:
    """One call given up against the stalled destination, then close_session (see the caller).

    ``cancel_early``: only an apply of ``rows``, cancelled as soon as it started (a few loop turns:
    it has sent some of the batch, not all); otherwise apply and commit, given up after
    ``6 * settle_seconds`` (a sink may give up on its own first, with UncertainOutcome)."""
    stall = subject.sink_setup.stall
    assert stall is not None
    epoch = EpochId(STREAM, number, WORKER.fencing_token)
    session = await open_sink_session(subject, SHUTDOWN_RULE)
    settle = subject.options.settle_seconds
    try:
        await subject.within(session.begin_epoch(epoch), SHUTDOWN_RULE, "begin_epoch")
        baseline = set(pairs(await subject.sink_setup.read_back()))
    except BaseException:
        await quietly_close(session)
        raise

    async def apply_and_commit() -> None:
        await session.apply(epoch, sink_batch(epoch, rows))
        if not cancel_early:
            await session.commit_epoch(epoch, covering(rows))

    swallowed = False
    async with stall():
        work = asyncio.ensure_future(apply_and_commit())
        if cancel_early:
            for _ in range(3):
                await asyncio.sleep(0)
        else:
            await asyncio.wait([work], timeout=6 * settle)
        running = not work.done()
        work.cancel()
        await asyncio.wait([work], timeout=subject.options.timeout)
        if work.done() and not work.cancelled():
            # A failure is expected (the destination never answered): consumed. An apply cancelled
            # while it ran that returns normally swallowed the cancellation and sent the rest.
            swallowed = cancel_early and running and work.exception() is None
        closing = asyncio.ensure_future(close_honestly(subject, session, SHUTDOWN_RULE))
        await asyncio.wait([closing], timeout=6 * settle)
        returned_while_stalled = closing.done()
    closed = await closing
    if swallowed:
        raise ConformanceFailure(
            SHUTDOWN_RULE,
            f"an apply of {len(rows)} rows cancelled mid-batch against a stalled destination returned "
            "as if it had completed: it swallowed the cancellation and went on sending the batch, "
            "effects still in flight when its caller moved on to close_session (a cancelled call "
            "stops and raises CancelledError, or a FaucetError)",
        )
    if not (closed and returned_while_stalled):
        return "waited for it" if closed else "was uncertain"
    landed: set[tuple[int, str]] = set()
    # Only this call's rows count: what an earlier, uncertain close abandoned may land meanwhile.
    ours = set(pairs(rows))
    for _ in range(3):  # the destination works off what it held once it answers again
        await asyncio.sleep(settle)
        landed = (set(pairs(await subject.sink_setup.read_back())) - baseline) & ours
        if landed:
            break
    if landed:
        raise ConformanceFailure(
            SHUTDOWN_RULE,
            f"close_session returned while the destination was stalled with work in flight, then "
            f"{len(landed)} rows of it landed: a close that does not wait for (or fence) its remote "
            "requests must raise UncertainOutcome",
        )
    return "returned and nothing landed"
