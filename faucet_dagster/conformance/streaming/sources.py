"""The stream-source checks the generated scenarios do not draw: a slow sink (backpressure past the
provider's redelivery timeout) and a cancellation during a read.
"""

from faucet_dagster.conformance.harness import QUIET, StreamDriver, Subject
from faucet_dagster.conformance.options import ConformanceFailure, Outcome
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.conformance.streaming.common import (
    CANCEL_RULE,
    ENDLESS,
    SLOW_RULE,
    certified_once,
    succeeds,
)
from faucet_dagster.protocol import CancelToken, FaucetError


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
