"""The streaming-sink checks (shutdown and replay have modules of their own): failed writes, an
uncertain commit, misordered lifecycle calls; and the honest close that check 7
(:mod:`.shutdown`) shares.
"""

import asyncio
from collections.abc import Awaitable, Callable

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
from faucet_dagster.conformance.streaming.common import (
    FAILED_WRITE_RULE,
    LIFECYCLE_RULE,
    UNCERTAIN_RULE,
    commit_rows,
    succeeds,
)
from faucet_dagster.protocol import (
    Durability,
    EpochId,
    EpochMismatch,
    FaucetError,
    LifecycleError,
    StreamingSinkSession,
    UncertainOutcome,
)


async def failed_writes(subject: Subject) -> Outcome:
    """A batch the destination refuses fails its apply or its commit; abort works; the next epoch
    commits; the refused epoch leaves nothing a transactional destination would show."""
    refused = subject.sink_setup.refused_rows
    if refused is None:
        return Outcome.not_applicable("the setup names no rows this destination refuses")
    read_back = subject.sink_setup.read_back
    caps = subject.streaming_sink().capabilities()
    session = await open_sink_session(subject, FAILED_WRITE_RULE)
    try:
        good = make_rows(1, 10)
        await commit_rows(subject, session, EpochId(STREAM, 1, WORKER.fencing_token), good, FAILED_WRITE_RULE)
        baseline = pairs(await read_back())
        failing = EpochId(STREAM, 2, WORKER.fencing_token)
        await subject.within(session.begin_epoch(failing), FAILED_WRITE_RULE, "begin_epoch")
        try:
            await subject.within(
                session.apply(failing, sink_batch(failing, refused)), FAILED_WRITE_RULE, "apply"
            )
            receipts = await subject.within(
                session.commit_epoch(failing, covering(refused, 10)), FAILED_WRITE_RULE, "commit_epoch"
            )
        except FaucetError as exc:
            failure = exc
        else:
            raise ConformanceFailure(
                FAILED_WRITE_RULE,
                f"the destination refused rows of the epoch but commit_epoch returned receipts {receipts}",
            )
        await subject.within(session.abort_epoch(failing), FAILED_WRITE_RULE, "abort_epoch after the failure")
        after = pairs(await read_back())
        if caps.durability is Durability.TRANSACTIONAL and after != baseline:
            raise ConformanceFailure(
                FAILED_WRITE_RULE, "a transactional sink kept rows of a failed, aborted epoch"
            )
        if pairs(refused) and set(pairs(refused)) <= set(after):
            raise ConformanceFailure(FAILED_WRITE_RULE, "every refused row is in the destination")
        retry = make_rows(11, 10)
        await succeeds(
            FAILED_WRITE_RULE,
            "the next epoch",
            commit_rows(subject, session, failing, retry, FAILED_WRITE_RULE),
        )
        final = set(pairs(await read_back()))
        if not set(pairs(retry)) <= final or not set(baseline) <= final:
            raise ConformanceFailure(
                FAILED_WRITE_RULE, "the epoch after an aborted one did not land with the earlier rows"
            )
    finally:
        await quietly_close(session)
    return Outcome.passed(f"refused write raised {type(failure).__name__}; abort and the next epoch worked")


async def uncertain_commit(subject: Subject) -> Outcome:
    """The caller gives up on a commit at increasing delays (its answer is lost to it): whatever the
    outcome, a successful close means nothing lands later, the destination's rows and watermark agree,
    and the replay of the epoch matches the documented duplicate handling."""
    caps = subject.streaming_sink().capabilities()
    read_back = subject.sink_setup.read_back
    delay, points, landed = 0.0, 0, 0
    while True:
        points += 1
        base = points * 1_000
        rows = make_rows(base, 10)
        epoch = EpochId(STREAM, points, WORKER.fencing_token)
        session = await open_sink_session(subject, UNCERTAIN_RULE)
        try:
            await subject.within(session.begin_epoch(epoch), UNCERTAIN_RULE, "begin_epoch")
            await subject.within(session.apply(epoch, sink_batch(epoch, rows)), UNCERTAIN_RULE, "apply")
            commit = asyncio.ensure_future(session.commit_epoch(epoch, covering(rows, None)))
            await asyncio.sleep(delay)
            finished = commit.done()
            commit.cancel()
            await asyncio.wait([commit], timeout=subject.options.timeout)
        except BaseException:
            await quietly_close(session)
            raise
        closed, before, after = await close_and_watch(subject, session, UNCERTAIN_RULE)
        if closed and after != before:
            raise ConformanceFailure(
                UNCERTAIN_RULE,
                f"the commit given up after {delay * 1000:.1f} ms changed the destination after a successful "
                "close_session: its effects outlived the session",
            )
        present = set(pairs(rows)) <= set(after)
        landed += present
        fresh = await open_sink_session(subject, UNCERTAIN_RULE)
        try:
            state = await subject.within(fresh.last_committed(), UNCERTAIN_RULE, "last_committed")
            if caps.atomic_watermark and (state is not None and state.epoch == epoch) != present:
                raise ConformanceFailure(
                    UNCERTAIN_RULE,
                    f"after a commit given up at {delay * 1000:.1f} ms the rows are "
                    f"{'' if present else 'not '}in the destination but last_committed() says {state}: "
                    "records and watermark must commit atomically",
                )
            await succeeds(
                UNCERTAIN_RULE,
                "replaying the epoch",
                commit_rows(subject, fresh, epoch, rows, UNCERTAIN_RULE),
            )
        finally:
            await quietly_close(fresh)
        replayed = [pair for pair in pairs(await read_back()) if pair[0] >= base and pair[0] < base + 10]
        if subject.options.replay_duplicates != "at_least_once" and replayed != pairs(rows):
            raise ConformanceFailure(
                UNCERTAIN_RULE,
                f"after a commit given up at {delay * 1000:.1f} ms and replayed, the destination holds "
                f"{len(replayed)} rows of the epoch's {len(rows)}",
            )
        # A commit that finished is the last point, but never the first: a sink that answers
        # last_committed() from what it read once (a lagging replica) is wrong only after a
        # later commit, and a fast commit (a loaded machine's scheduling) can finish at 0 ms.
        if (finished and points >= 2) or points >= 12:
            break
        delay = 0.0005 if delay == 0 else delay * 2
    return Outcome.passed(
        f"{points} commits given up at 0..{delay * 1000:.1f} ms: {landed} had landed, all consistent"
    )


async def close_and_watch(
    subject: Subject, session: StreamingSinkSession, rule: str
) -> tuple[bool, list[tuple[int, str]], list[tuple[int, str]]]:
    """Close the session honestly, then read the destination at once and ``settle_seconds`` later."""
    closed = await close_honestly(subject, session, rule)
    before = pairs(await subject.sink_setup.read_back())
    await asyncio.sleep(subject.options.settle_seconds)
    return closed, before, pairs(await subject.sink_setup.read_back())


async def close_honestly(subject: Subject, session: StreamingSinkSession, rule: str) -> bool:
    """close_session: True when it promised nothing more lands, False when it said it is uncertain."""
    try:
        await subject.within(session.close_session(), rule, "close_session")
    except UncertainOutcome:
        return False
    except FaucetError as exc:
        raise ConformanceFailure(
            rule,
            f"close_session raised {type(exc).__name__}: {exc}; an uncertain close raises UncertainOutcome",
        ) from exc
    return True


async def lifecycle_order(subject: Subject) -> Outcome:
    """Begin twice, commit or apply without begin, apply after commit, another epoch's batch, calls
    after close: each raises LifecycleError or EpochMismatch and changes nothing."""
    read_back = subject.sink_setup.read_back
    one, two = EpochId(STREAM, 1, WORKER.fencing_token), EpochId(STREAM, 2, WORKER.fencing_token)
    rows, late = make_rows(1, 5), make_rows(6, 5)
    session = await open_sink_session(subject, LIFECYCLE_RULE)

    async def refused(what: str, call: Callable[[], Awaitable[object]]) -> None:
        try:
            await subject.within(call(), LIFECYCLE_RULE, what)
        except (LifecycleError, EpochMismatch):
            return
        except FaucetError as exc:
            raise ConformanceFailure(
                LIFECYCLE_RULE,
                f"{what} raised {type(exc).__name__}; a misordered call raises LifecycleError or "
                "EpochMismatch",
            ) from exc
        raise ConformanceFailure(LIFECYCLE_RULE, f"{what} was accepted")

    try:
        await refused("commit_epoch without begin_epoch", lambda: session.commit_epoch(one, covering(rows)))
        await refused("apply without begin_epoch", lambda: session.apply(one, sink_batch(one, rows)))
        await subject.within(session.begin_epoch(one), LIFECYCLE_RULE, "begin_epoch")
        await refused("begin_epoch twice", lambda: session.begin_epoch(one))
        await refused("begin_epoch of another epoch while one is active", lambda: session.begin_epoch(two))
        await refused("apply of another epoch's batch", lambda: session.apply(one, sink_batch(two, rows)))
        await refused(
            "apply to an epoch that is not active", lambda: session.apply(two, sink_batch(two, rows))
        )
        await subject.within(session.apply(one, sink_batch(one, rows)), LIFECYCLE_RULE, "apply")
        await subject.within(session.commit_epoch(one, covering(rows)), LIFECYCLE_RULE, "commit_epoch")
        await refused("apply after commit", lambda: session.apply(one, sink_batch(one, late)))
        await refused("commit_epoch twice", lambda: session.commit_epoch(one, covering(rows)))
        await refused("abort_epoch after commit", lambda: session.abort_epoch(one))
        if pairs(await read_back()) != pairs(rows):
            raise ConformanceFailure(LIFECYCLE_RULE, "refused lifecycle calls changed the destination")
        await succeeds(LIFECYCLE_RULE, "close_session", session.close_session())
        await refused("begin_epoch after close_session", lambda: session.begin_epoch(two))
    finally:
        await quietly_close(session)
    return Outcome.passed("11 misordered calls refused with LifecycleError or EpochMismatch")
