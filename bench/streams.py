"""Helpers for continuous-stream scenarios: run a stream's epochs until the dataset has landed."""

import time

from faucet_dagster.protocol import EpochCertificate
from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore

CALL_SECONDS = 60.0
"""The budget of each ``run_epochs`` call (a call ends earlier when the source has nothing new)."""


async def run_until(spec: StreamSpec, store: StateStore, rows: int) -> tuple[float, list[EpochCertificate]]:
    """Run ``spec``'s epochs, pipelined as under a sensor (``run_epochs``: the next epoch read while the
    last one commits), until certificates count ``rows`` rows; return (seconds, certificates).

    The timed part is everything from the first lease to the last acknowledgement; the runner is
    closed afterwards (untimed). Raises RuntimeError when the source has nothing new before ``rows``.
    """
    runner = StreamRunner(spec, store)
    certificates: list[EpochCertificate] = []
    finished: list[float] = []

    def certified(certificate: EpochCertificate) -> None:
        certificates.append(certificate)
        if not finished and sum(sum(c.row_counts.values()) for c in certificates) >= rows:
            # The clock stops at the last acknowledgement; the epoch read ahead meanwhile (waiting for
            # more, up to its idle limit) is interrupted, not timed.
            finished.append(time.perf_counter())
            runner.cancel()

    start = time.perf_counter()
    try:
        while not finished:
            if not await runner.run_epochs(CALL_SECONDS, on_certified=certified):
                done = sum(sum(c.row_counts.values()) for c in certificates)
                raise RuntimeError(f"the stream ended after {done} of {rows} rows")
        return finished[0] - start, certificates
    finally:
        await runner.close()


def seconds_per_step(certificates: list[EpochCertificate]) -> dict[str, float]:
    """The seconds each step of the epochs took, summed from the certificates' timings (overlapping
    steps of pipelined epochs add up to more than the run's seconds)."""
    steps: dict[str, float] = {}
    for certificate in certificates:
        for step, seconds in certificate.timings.items():
            steps[step] = round(steps.get(step, 0.0) + seconds, 3)
    return steps
