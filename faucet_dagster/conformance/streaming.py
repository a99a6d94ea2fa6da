"""The streaming checks: the interruptions of seed 000, "Test interruptions at the boundaries".

Stream sources: a slow sink, cancellation during a read, a partial source transaction, loss of
ownership before the acknowledgement, a position whose rows were not written, and a replay after the
destination commit. Streaming sinks: failed writes, an uncertain commit, misordered lifecycle calls,
shutdown with outstanding work, and the replay of an epoch committed but never certified, which must
match the duplicate handling the connector documents (``ConformanceOptions.replay_duplicates``).

Each check is a coroutine taking a :class:`~faucet_dagster.conformance.harness.Subject`; it returns an
:class:`Outcome` or raises :class:`ConformanceFailure` naming the rule broken.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from faucet_dagster.conformance.harness import (
    OTHER_WORKER,
    STREAM,
    WORKER,
    StreamDriver,
    Subject,
    covering,
    open_sink_session,
    pairs,
    quietly_close,
    sink_batch,
)
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.protocol import (
    CancelToken,
    ConnectionFailed,
    Coverage,
    Durability,
    EpochId,
    EpochMismatch,
    FaucetError,
    IntegrityError,
    LifecycleError,
    Ordering,
    OwnershipLost,
    PositionUnavailable,
    ReadLimits,
    Role,
    StreamingSinkSession,
    UncertainOutcome,
)

T = TypeVar("T")

SLOW_RULE = "stream 2 backpressure: a slow sink loses and duplicates nothing"
CANCEL_RULE = "stream 3 cancellation is an interruption"
TRANSACTION_RULE = "stream 3 no coverage inside an open transaction"
OWNERSHIP_RULE = "stream 5 authority() before every acknowledgement"
SPECULATIVE_RULE = "stream 5 only certified work is acknowledged, and only in acknowledge()"
UNAVAILABLE_RULE = "stream 1 an unavailable resume position is refused, never replaced by the latest"
UNWRITTEN_RULE = "stream 3 a position whose rows were not written is never certified"
FAILED_WRITE_RULE = "stream 6 failed sink writes are never reported as committed"
UNCERTAIN_RULE = "stream 7 an uncertain commit is resolved or reported, never lost"
LIFECYCLE_RULE = "stream 6 epoch lifecycle order"
SHUTDOWN_RULE = "stream 7 honest shutdown"
REPLAY_RULE = "stream 8 replay after the destination commit, before the certificate"

QUIET = ReadLimits(records=None, bytes=None, idle=0.5, age=None)
ENDLESS = ReadLimits(records=None, bytes=None, idle=None, age=None)
"""A read that only cancellation (or the source's own end) stops."""


async def _succeeds(rule: str, what: str, step: Awaitable[T]) -> T:
    """Await a step that must work: any error from the connector breaks ``rule``."""
    try:
        return await step
    except ConformanceFailure:
        raise
    except Exception as exc:
        raise ConformanceFailure(rule, f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _once(rule: str, seen: list[int], expected: list[int], situation: str) -> None:
    if sorted(seen) != expected:
        duplicates = len(seen) - len(set(seen))
        missing = sorted(set(expected) - set(seen))
        raise ConformanceFailure(
            rule,
            f"{situation}: {len(seen)} rows certified for {len(expected)} added ({duplicates} duplicate(s), "
            f"missing ids {missing[:5]})",
        )


# -- stream sources -----------------------------------------------------------------------------------


async def slow_sink(subject: Subject) -> Outcome:
    """A sink that blocks one write for ``slow_sink_seconds``: every row certified once, none again."""
    rows = make_rows(1, 40)
    expected = [row["id"] for row in rows]
    await subject.source_setup.add_rows(rows)
    driver = StreamDriver(subject, SLOW_RULE)
    driver.probe.delay = subject.options.slow_sink_seconds
    redelivered = subject.source_setup.redelivered
    try:
        await driver.open()
        before = 0 if redelivered is None else await redelivered()
        seen = await _succeeds(
            SLOW_RULE, "reading while the sink is slow", driver.read_until(set(expected), QUIET)
        )
        _once(SLOW_RULE, seen, expected, f"with a sink blocked for {subject.options.slow_sink_seconds:g}s")
        # Suppressing the repeats is not enough: the deliveries must have been kept alive.
        repeated = 0 if redelivered is None else await redelivered() - before
        if repeated:
            raise ConformanceFailure(
                SLOW_RULE,
                f"the provider redelivered {repeated} message(s) while the sink blocked for "
                f"{subject.options.slow_sink_seconds:g}s: the source let its deliveries expire "
                "(keep protocol heartbeats and delivery renewals alive while a flush waits)",
            )
        await driver.open()
        _, again = await _succeeds(SLOW_RULE, "reading after the slow epoch", driver.epoch(QUIET))
        if again:
            raise ConformanceFailure(
                SLOW_RULE, f"{len(again)} acknowledged rows were delivered again after a slow sink"
            )
    finally:
        await driver.close()
    return Outcome.passed(
        f"{len(rows)} rows once each with a {subject.options.slow_sink_seconds:g}s sink stall"
    )


async def cancel_during_read(subject: Subject) -> Outcome:
    """A read cancelled after its first write returns promptly, covers only accepted boundaries, and
    the rewound session then delivers every row exactly once."""
    rows = make_rows(1, 200)
    expected = [row["id"] for row in rows]
    await subject.source_setup.add_rows(rows)
    driver = StreamDriver(subject, CANCEL_RULE)
    cancel = CancelToken()

    async def interrupt(_: int) -> None:
        cancel.cancel()

    try:
        try:
            coverage, _ = await driver.epoch(ENDLESS, cancel, on_write=interrupt)
        except FaucetError as exc:
            raise ConformanceFailure(
                CANCEL_RULE,
                f"a cancelled read failed with {type(exc).__name__}: {exc}; cancellation is an "
                "interruption: the read returns the coverage of its accepted boundaries (the pipeline "
                "refuses any other)",
            ) from exc
        seen = await _succeeds(
            CANCEL_RULE, "reading after the cancellation", driver.read_until(set(expected), QUIET)
        )
        _once(CANCEL_RULE, seen, expected, "after a read cancelled mid-way and rewound")
    finally:
        await driver.close()
    return Outcome.passed(
        f"cancelled read returned {'no' if coverage.empty else 'sealable'} coverage; no loss"
    )


async def partial_transaction(subject: Subject) -> Outcome:
    """A record limit inside a source transaction, and a cancellation inside one: never coverage
    inside the transaction (the pipeline refuses to seal an open transaction)."""
    if not subject.stream_source().capabilities().transaction_boundaries:
        return Outcome.not_applicable(
            "the source declares no transaction boundaries (transaction_boundaries=False)"
        )
    setup = subject.source_setup
    first, second = make_rows(1, 50), make_rows(51, 50)
    driver = StreamDriver(subject, TRANSACTION_RULE)
    try:
        await setup.add_rows(first)
        try:
            _, ids = await driver.epoch(ReadLimits(records=5, bytes=None, idle=0.5, age=None))
        except FaucetError as exc:
            raise ConformanceFailure(
                TRANSACTION_RULE,
                f"a read limited to 5 records inside a 50-row transaction was refused: {exc}",
            ) from exc
        if ids and sorted(ids) != [row["id"] for row in first]:
            raise ConformanceFailure(
                TRANSACTION_RULE,
                f"a read limited to 5 records certified {len(ids)} rows of a 50-row transaction",
            )
        await setup.add_rows(second)
        cancel = CancelToken()

        async def interrupt(_: int) -> None:
            cancel.cancel()

        try:
            await driver.epoch(ENDLESS, cancel, on_write=interrupt)
        except FaucetError as exc:
            raise ConformanceFailure(
                TRANSACTION_RULE,
                f"a read cancelled inside a transaction returned coverage the pipeline refuses: {exc}",
            ) from exc
        expected = [row["id"] for row in [*first, *second]]
        rest = await _succeeds(
            TRANSACTION_RULE, "reading on", driver.read_until(set(expected) - set(ids), QUIET)
        )
        _once(
            TRANSACTION_RULE, [*ids, *rest], expected, "around a limit and a cancellation inside transactions"
        )
    finally:
        await driver.close()
    return Outcome.passed("transactions certified whole despite a record limit and a cancellation")


async def speculative_acknowledgement(subject: Subject) -> Outcome:
    """The provider's acknowledgement state (a committed offset, an ack floor, a slot's confirmed
    position) does not move during a read, after the epoch is certified, when the session closes, or
    in a reopened session's reads: only ``acknowledge`` moves it."""
    setup = subject.source_setup
    if setup.acknowledged is None:
        return Outcome.not_applicable("the setup reads no provider acknowledgement state")
    acknowledged = setup.acknowledged
    await setup.add_rows(make_rows(1, 20))
    driver = StreamDriver(subject, SPECULATIVE_RULE, acknowledge=False)
    # Opening may reposition the provider at the certified positions (the admitted worker recreates
    # its consumer there): the baseline is taken after each open.
    await driver.open()
    before = await acknowledged()

    async def unmoved(when: str) -> None:
        now = await acknowledged()
        if now != before:
            raise ConformanceFailure(
                SPECULATIVE_RULE,
                f"the provider's acknowledgement moved from {before!r} to {now!r} {when}, before any "
                "acknowledge(): progress that is not certified was acknowledged (speculatively)",
            )

    try:
        coverage, _ = await _succeeds(SPECULATIVE_RULE, "reading", driver.epoch(QUIET))
        if coverage.empty:
            raise ConformanceFailure(SPECULATIVE_RULE, "20 rows were added but the read covered nothing")
        await unmoved("during a read whose epoch was then certified")
        await driver.close()
        await unmoved("when the session closed")
        more = make_rows(21, 10)
        await setup.add_rows(more)
        await driver.open()
        before = await acknowledged()
        await _succeeds(SPECULATIVE_RULE, "reading on", driver.read_until({row["id"] for row in more}, QUIET))
        await unmoved("during the reads of a reopened session")
    finally:
        await driver.close()
    return Outcome.passed("the provider's acknowledgement stayed put through reads, a close and a reopen")


class _Authorities:
    """The battery's authority callbacks, counting how often the session asked."""

    def __init__(self) -> None:
        self.asked = 0

    async def lost(self) -> None:
        self.asked += 1
        raise OwnershipLost("the conformance battery took the lease away", where="conformance")

    async def owner(self) -> None:
        self.asked += 1


async def ownership_lost_before_ack(subject: Subject) -> Outcome:
    """An authority that raises OwnershipLost stops the acknowledgement (it propagates, nothing moves
    at the provider), on the first acknowledgement of a session and on a later one; acknowledge asks
    the authority every time something moves at the provider, also for redeliveries of certified work
    it suppresses after a restart between the certificate and the acknowledgement."""
    setup = subject.source_setup
    await setup.add_rows(make_rows(1, 20))
    driver = StreamDriver(subject, OWNERSHIP_RULE, acknowledge=False)
    authority = _Authorities()
    try:
        coverage, _ = await _succeeds(OWNERSHIP_RULE, "reading", driver.epoch(QUIET))
        if coverage.empty:
            raise ConformanceFailure(OWNERSHIP_RULE, "20 rows were added but the read covered nothing")
        await _refused_without_ownership(subject, driver, coverage, authority, "the first acknowledgement")
        moved = await _acknowledged_with_ownership(subject, driver, coverage, authority, "certified coverage")
        # Repeated: whatever the session sends the provider again, it asks the authority first.
        authority.asked = 0
        session = driver.session
        assert session is not None
        await _succeeds(
            OWNERSHIP_RULE, "the repeated acknowledgement", session.acknowledge(coverage, authority.owner)
        )
        if setup.acknowledged is not None and authority.asked == 0 and await setup.acknowledged() != moved:
            raise ConformanceFailure(
                OWNERSHIP_RULE, "a repeated acknowledgement changed the provider without awaiting authority()"
            )
        # Ownership lost after an earlier acknowledgement succeeded: asking once is not enough.
        await setup.add_rows(make_rows(21, 10))
        later, _ = await _succeeds(OWNERSHIP_RULE, "reading on", driver.epoch(QUIET))
        if later.empty:
            raise ConformanceFailure(OWNERSHIP_RULE, "10 more rows were added but the read covered nothing")
        await _refused_without_ownership(subject, driver, later, authority, "a later acknowledgement")
        # The worker stops after the certificate of ``later``, before acknowledging it: the provider
        # redelivers it to the next session, which suppresses what is certified and acknowledges it
        # only through acknowledge(), after authority().
        await driver.close()
        if setup.acknowledged is not None and await setup.acknowledged() != moved:
            raise ConformanceFailure(
                OWNERSHIP_RULE, "closing the session moved the provider's acknowledgement"
            )
        rest = make_rows(31, 10)
        await setup.add_rows(rest)
        await driver.open()  # may reposition the provider at the certified positions
        reopened = await setup.acknowledged() if setup.acknowledged is not None else None
        coverages = await _certify_all(driver, {row["id"] for row in rest})
        if setup.acknowledged is not None and await setup.acknowledged() != reopened:
            raise ConformanceFailure(
                OWNERSHIP_RULE,
                "the provider's acknowledgement moved while a reopened session read (redeliveries of "
                "certified work are acknowledged only in acknowledge(), after authority())",
            )
        await _refused_without_ownership(
            subject, driver, coverages[0], authority, "the first acknowledgement after a redelivery"
        )
        for item in coverages:
            await _acknowledged_with_ownership(
                subject, driver, item, authority, "coverage after a redelivery"
            )
    finally:
        await driver.close()
    return Outcome.passed(
        "OwnershipLost stops every acknowledgement (first, later, after a redelivery); authority() asked"
    )


async def _certify_all(driver: StreamDriver, expected: set[int]) -> list[Coverage]:
    """Epochs (not acknowledged) until ``expected`` is certified; the non-empty coverages, in order."""
    coverages: list[Coverage] = []
    seen: set[int] = set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + driver.subject.options.timeout
    while not expected <= seen and loop.time() < deadline:
        coverage, ids = await _succeeds(driver.rule, "reading after a restart", driver.epoch(QUIET))
        seen.update(ids)
        if not coverage.empty:
            coverages.append(coverage)
    if not expected <= seen or not coverages:
        raise ConformanceFailure(
            driver.rule,
            f"a reopened session certified {sorted(seen)[:5]}..., not the {len(expected)} new rows",
        )
    return coverages


async def _refused_without_ownership(
    subject: Subject, driver: StreamDriver, coverage: Coverage, authority: _Authorities, what: str
) -> None:
    setup = subject.source_setup
    session = driver.session
    assert session is not None
    before = await setup.acknowledged() if setup.acknowledged else None
    authority.asked = 0
    try:
        await subject.within(session.acknowledge(coverage, authority.lost), OWNERSHIP_RULE, "acknowledge")
    except OwnershipLost:
        pass
    except FaucetError as exc:
        raise ConformanceFailure(
            OWNERSHIP_RULE, f"{what}: OwnershipLost became {type(exc).__name__}: {exc}"
        ) from exc
    else:
        raise ConformanceFailure(OWNERSHIP_RULE, f"{what} returned although authority() raised OwnershipLost")
    if authority.asked == 0:
        raise ConformanceFailure(OWNERSHIP_RULE, f"{what} never awaited authority() before acknowledging")
    if setup.acknowledged is not None and await setup.acknowledged() != before:
        raise ConformanceFailure(
            OWNERSHIP_RULE, f"{what} moved the provider's acknowledgement although authority() raised"
        )


async def _acknowledged_with_ownership(
    subject: Subject, driver: StreamDriver, coverage: Coverage, authority: _Authorities, what: str
) -> str | None:
    setup = subject.source_setup
    session = driver.session
    assert session is not None
    before = await setup.acknowledged() if setup.acknowledged else None
    authority.asked = 0
    await _succeeds(
        OWNERSHIP_RULE, f"the acknowledgement of {what}", session.acknowledge(coverage, authority.owner)
    )
    if authority.asked == 0:
        raise ConformanceFailure(OWNERSHIP_RULE, f"the acknowledgement of {what} never awaited authority()")
    if setup.acknowledged is None:
        return None
    moved = await setup.acknowledged()
    if moved == before:
        raise ConformanceFailure(
            OWNERSHIP_RULE, f"an acknowledgement of {what} with ownership left the provider unmoved"
        )
    return moved


async def unwritten_position(subject: Subject) -> Outcome:
    """Every row up to a certified position reached the sink; a read whose rows failed to write
    certifies nothing, and the rewound session delivers them."""
    setup = subject.source_setup
    rows = make_rows(1, 30)
    expected = [row["id"] for row in rows]
    await setup.add_rows(rows)
    driver = StreamDriver(subject, UNWRITTEN_RULE)
    try:
        try:
            seen = await driver.read_until(set(expected), QUIET)
        except IntegrityError as exc:
            raise ConformanceFailure(
                UNWRITTEN_RULE,
                f"the source vouched for a position whose row had not reached the sink (a coverage or "
                f"a boundary ahead of its rows, an ordering bug of the source; the pipeline refused it: "
                f"{exc})",
            ) from exc
        except Exception as exc:
            raise ConformanceFailure(UNWRITTEN_RULE, f"reading failed: {type(exc).__name__}: {exc}") from exc
        _once(
            UNWRITTEN_RULE, seen, expected, "the certified positions cover rows that never reached the sink"
        )
        more = make_rows(31, 30)
        await setup.add_rows(more)
        driver.probe.refuse = ConnectionFailed("the conformance sink refused the batch", where="conformance")
        try:
            coverage, ids = await driver.epoch(QUIET)
        except FaucetError:
            pass  # the read (or the seal) refused: nothing certified, the session was rewound
        else:
            if ids or not coverage.empty:
                raise ConformanceFailure(
                    UNWRITTEN_RULE,
                    f"a read whose rows failed to write was certified up to {coverage.domains}",
                )
        again = await _succeeds(
            UNWRITTEN_RULE,
            "reading after the failed write",
            driver.read_until({row["id"] for row in more}, QUIET),
        )
        _once(UNWRITTEN_RULE, again, [row["id"] for row in more], "after a failed write and a rewind")
    finally:
        await driver.close()
    return Outcome.passed("certified positions match written rows; a failed write certified nothing")


async def unavailable_position(subject: Subject) -> Outcome:
    """Rows after the certified position are removed before they were read (a purge, retention):
    resuming there raises PositionUnavailable; nothing after the gap is certified."""
    setup = subject.source_setup
    if setup.make_unavailable is None:
        return Outcome.not_applicable("the setup cannot remove data under a reader")
    first, gone, later = make_rows(1, 20), make_rows(21, 10), make_rows(31, 10)
    await setup.add_rows(first)
    driver = StreamDriver(subject, UNAVAILABLE_RULE)
    try:
        seen = await _succeeds(
            UNAVAILABLE_RULE, "reading", driver.read_until({row["id"] for row in first}, QUIET)
        )
        _once(UNAVAILABLE_RULE, seen, [row["id"] for row in first], "before the removal")
        await driver.close()
        await setup.add_rows(gone)
        await setup.make_unavailable()
        await setup.add_rows(later)
        try:
            await driver.open()
            after = await driver.read_until({row["id"] for row in later}, QUIET)
        except PositionUnavailable as exc:
            return Outcome.passed(f"resuming after removed rows raised PositionUnavailable: {exc.message}")
        except FaucetError as exc:
            raise ConformanceFailure(
                UNAVAILABLE_RULE,
                f"resuming after rows 21-30 were removed unread raised {type(exc).__name__}: {exc}; the "
                "source must refuse with PositionUnavailable, not leave the gap for others to find",
            ) from exc
    finally:
        await driver.close()
    raise ConformanceFailure(
        UNAVAILABLE_RULE,
        f"resuming at the certified position after rows 21-30 were removed unread certified "
        f"{len(after)} later row(s) without PositionUnavailable: the unavailable position was replaced "
        "by the latest available one (the removed rows are lost)",
    )


async def replay_after_commit(subject: Subject) -> Outcome:
    """Interrupted after the destination commit, before the certificate: the replay matches the
    documented duplicate handling (sinks) or re-delivers the same events with the same identities
    (sources)."""
    if subject.role is Role.STREAM_SOURCE:
        return await _source_replay(subject)
    return await _sink_replay(subject)


async def _source_replay(subject: Subject) -> Outcome:
    rows = make_rows(1, 40)
    expected = [row["id"] for row in rows]
    await subject.source_setup.add_rows(rows)
    first = StreamDriver(subject, REPLAY_RULE, acknowledge=False)
    try:
        seen = await _succeeds(REPLAY_RULE, "reading", first.read_until(set(expected), QUIET))
    finally:
        await first.close()
    # The replay is another worker's, after a takeover: another worker id, a higher fencing token.
    replay = StreamDriver(subject, REPLAY_RULE, acknowledge=False, worker=OTHER_WORKER)
    try:
        again = await _succeeds(REPLAY_RULE, "reading again", replay.read_until(set(expected), QUIET))
    finally:
        await replay.close()
    _once(REPLAY_RULE, seen, expected, "the first read")
    # A source promises order only within an ordering domain (a Kafka partition, one NATS stream),
    # so the replay is compared domain by domain unless the source claims one global order.
    strict = subject.stream_source().capabilities().ordering is Ordering.STRICT_GLOBAL
    before, after = _in_promised_order(first.events, strict), _in_promised_order(replay.events, strict)
    if before != after:
        changed = next(
            (
                f"{domain}: {a} then {b}"
                for domain in sorted(before.keys() | after.keys())
                for a, b in zip(before.get(domain, []), after.get(domain, []), strict=False)
                if a != b
            ),
            f"{len(first.events)} then {len(replay.events)} events",
        )
        raise ConformanceFailure(
            REPLAY_RULE,
            f"re-reading from the same certified positions as another worker (fencing token "
            f"{WORKER.fencing_token} then {OTHER_WORKER.fencing_token}) gave other events or identities "
            f"({changed}): an identity is built from the source position, never the worker, lease or "
            "attempt; a deduplicating sink would take the replay for new events",
        )
    return Outcome.passed(f"the replay re-delivered {len(again)} events with the same identities")


def _in_promised_order(
    events: list[tuple[str, str, int, int]], strict_global: bool
) -> dict[str, list[tuple[str, str, int, int]]]:
    """The certified events grouped by the scope whose order the source promises."""
    grouped: dict[str, list[tuple[str, str, int, int]]] = {}
    for event in events:
        grouped.setdefault("*" if strict_global else event[0], []).append(event)
    return grouped


async def _sink_replay(subject: Subject) -> Outcome:
    declared = subject.options.replay_duplicates
    caps = subject.streaming_sink().capabilities()
    backed = {
        "none": caps.atomic_watermark,
        "within_window": caps.dedup_by_event_identity and caps.dedup_window is not None,
        "at_least_once": True,
    }[declared]
    if not backed:
        raise ConformanceFailure(
            REPLAY_RULE,
            f"the connector documents replay_duplicates={declared!r} but its capabilities declare no such "
            f"mechanism (atomic_watermark={caps.atomic_watermark}, dedup_window={caps.dedup_window})",
        )
    rows = make_rows(1, 30)
    epoch = EpochId(STREAM, 1, WORKER.fencing_token)
    session = await open_sink_session(subject, REPLAY_RULE)
    try:
        await _commit(subject, session, epoch, rows, REPLAY_RULE)
    finally:
        await quietly_close(session)  # the worker stops before its certificate is persisted
    committed = pairs(await subject.sink_setup.read_back())
    # The replay is another worker's, after a takeover: another worker id, a higher fencing token.
    session = await open_sink_session(
        subject, REPLAY_RULE, token=OTHER_WORKER.fencing_token, worker=OTHER_WORKER.worker_id
    )
    try:
        replayed = EpochId(STREAM, epoch.sequence, OTHER_WORKER.fencing_token)
        receipts = await _commit(subject, session, replayed, rows, REPLAY_RULE)
    finally:
        await quietly_close(session)
    after = pairs(await subject.sink_setup.read_back())
    if declared == "at_least_once":
        if set(after) != set(pairs(rows)):
            raise ConformanceFailure(
                REPLAY_RULE, "the replay lost rows (at-least-once allows duplicates, not loss)"
            )
        return Outcome.passed(f"replay kept every row ({len(after) - len(rows)} duplicate(s), as documented)")
    written = sum(receipt.rows_written for receipt in receipts)
    if after != committed or committed != pairs(rows) or written:
        raise ConformanceFailure(
            REPLAY_RULE,
            f"the connector documents replay_duplicates={declared!r}, but replaying a committed epoch of "
            f"{len(rows)} rows took the destination from {len(committed)} to {len(after)} rows "
            f"(receipts: {written} written)",
        )
    return Outcome.passed(f"the replayed epoch added nothing ({declared})")


async def _commit(
    subject: Subject, session: StreamingSinkSession, epoch: EpochId, rows: list[dict[str, Any]], rule: str
) -> Any:
    await subject.within(session.begin_epoch(epoch), rule, "begin_epoch")
    await subject.within(session.apply(epoch, sink_batch(epoch, rows)), rule, "apply")
    return await subject.within(session.commit_epoch(epoch, covering(rows)), rule, "commit_epoch")


# -- streaming sinks ----------------------------------------------------------------------------------


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
        await _commit(subject, session, EpochId(STREAM, 1, WORKER.fencing_token), good, FAILED_WRITE_RULE)
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
        await _succeeds(
            FAILED_WRITE_RULE, "the next epoch", _commit(subject, session, failing, retry, FAILED_WRITE_RULE)
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
            await _succeeds(
                UNCERTAIN_RULE, "replaying the epoch", _commit(subject, fresh, epoch, rows, UNCERTAIN_RULE)
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
        if finished or points >= 12:
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
        await _succeeds(LIFECYCLE_RULE, "close_session", session.close_session())
        await refused("begin_epoch after close_session", lambda: session.begin_epoch(two))
    finally:
        await quietly_close(session)
    return Outcome.passed("11 misordered calls refused with LifecycleError or EpochMismatch")
