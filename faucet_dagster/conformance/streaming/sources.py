"""The stream-source checks (ownership and replay have modules of their own): a slow sink, cancellation
during a read, a partial source transaction, acknowledgement only in ``acknowledge()``, a
position whose rows were not written, and an unavailable resume position.
"""

from faucet_dagster.conformance.harness import QUIET, StreamDriver, Subject
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.conformance.streaming.common import (
    CANCEL_RULE,
    ENDLESS,
    SLOW_RULE,
    SPECULATIVE_RULE,
    TRANSACTION_RULE,
    UNAVAILABLE_RULE,
    UNWRITTEN_RULE,
    certified_once,
    succeeds,
)
from faucet_dagster.protocol import (
    CancelToken,
    ConnectionFailed,
    FaucetError,
    IntegrityError,
    PositionUnavailable,
    ReadLimits,
)


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
        seen = await succeeds(
            SLOW_RULE, "reading while the sink is slow", driver.read_until(set(expected), QUIET)
        )
        certified_once(
            SLOW_RULE, seen, expected, f"with a sink blocked for {subject.options.slow_sink_seconds:g}s"
        )
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
        _, again = await succeeds(SLOW_RULE, "reading after the slow epoch", driver.epoch(QUIET))
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
        seen = await succeeds(
            CANCEL_RULE, "reading after the cancellation", driver.read_until(set(expected), QUIET)
        )
        certified_once(CANCEL_RULE, seen, expected, "after a read cancelled mid-way and rewound")
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
        rest = await succeeds(
            TRANSACTION_RULE, "reading on", driver.read_until(set(expected) - set(ids), QUIET)
        )
        certified_once(
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
        coverage, _ = await succeeds(SPECULATIVE_RULE, "reading", driver.epoch(QUIET))
        if coverage.empty:
            raise ConformanceFailure(SPECULATIVE_RULE, "20 rows were added but the read covered nothing")
        await unmoved("during a read whose epoch was then certified")
        await driver.close()
        await unmoved("when the session closed")
        more = make_rows(21, 10)
        await setup.add_rows(more)
        await driver.open()
        before = await acknowledged()
        await succeeds(SPECULATIVE_RULE, "reading on", driver.read_until({row["id"] for row in more}, QUIET))
        await unmoved("during the reads of a reopened session")
    finally:
        await driver.close()
    return Outcome.passed("the provider's acknowledgement stayed put through reads, a close and a reopen")


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
        certified_once(
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
        again = await succeeds(
            UNWRITTEN_RULE,
            "reading after the failed write",
            driver.read_until({row["id"] for row in more}, QUIET),
        )
        certified_once(
            UNWRITTEN_RULE, again, [row["id"] for row in more], "after a failed write and a rewind"
        )
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
        seen = await succeeds(
            UNAVAILABLE_RULE, "reading", driver.read_until({row["id"] for row in first}, QUIET)
        )
        certified_once(UNAVAILABLE_RULE, seen, [row["id"] for row in first], "before the removal")
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
