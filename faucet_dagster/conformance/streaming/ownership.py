"""Stream check 5, ownership: ``acknowledge()`` awaits ``authority()`` before anything moves at the
provider, and OwnershipLost from it stops the acknowledgement (first, later, after a redelivery).
"""

import asyncio

from faucet_dagster.conformance.harness import QUIET, StreamDriver, Subject
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.conformance.streaming.common import OWNERSHIP_RULE, succeeds
from faucet_dagster.protocol import Coverage, FaucetError, OwnershipLost


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
        coverage, _ = await succeeds(OWNERSHIP_RULE, "reading", driver.epoch(QUIET))
        if coverage.empty:
            raise ConformanceFailure(OWNERSHIP_RULE, "20 rows were added but the read covered nothing")
        await _refused_without_ownership(subject, driver, coverage, authority, "the first acknowledgement")
        moved = await _acknowledged_with_ownership(subject, driver, coverage, authority, "certified coverage")
        # Repeated: whatever the session sends the provider again, it asks the authority first.
        authority.asked = 0
        session = driver.session
        assert session is not None
        await succeeds(
            OWNERSHIP_RULE, "the repeated acknowledgement", session.acknowledge(coverage, authority.owner)
        )
        if setup.acknowledged is not None and authority.asked == 0 and await setup.acknowledged() != moved:
            raise ConformanceFailure(
                OWNERSHIP_RULE, "a repeated acknowledgement changed the provider without awaiting authority()"
            )
        # Ownership lost after an earlier acknowledgement succeeded: asking once is not enough.
        await setup.add_rows(make_rows(21, 10))
        later, _ = await succeeds(OWNERSHIP_RULE, "reading on", driver.epoch(QUIET))
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
        coverage, ids = await succeeds(driver.rule, "reading after a restart", driver.epoch(QUIET))
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
    await succeeds(
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
