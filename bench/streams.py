"""Helpers for continuous-stream scenarios: run a stream's epochs until the dataset has landed."""

import time

from faucet_dagster.runner.continuous import StreamRunner, StreamSpec
from faucet_dagster.state import StateStore


async def run_until(spec: StreamSpec, store: StateStore, rows: int) -> tuple[float, int]:
    """Run ``spec``'s epochs until certificates count ``rows`` rows; return (seconds, epochs).

    The timed part is everything from the first lease to the last acknowledgement; the runner is
    closed afterwards (untimed). Raises RuntimeError when an epoch finds nothing before ``rows``.
    """
    runner = StreamRunner(spec, store)
    epochs = done = 0
    start = time.perf_counter()
    try:
        while done < rows:
            certificate = await runner.run_epoch()
            if certificate is None:
                raise RuntimeError(f"the stream ended after {done} of {rows} rows")
            epochs += 1
            done += sum(certificate.row_counts.values())
        return time.perf_counter() - start, epochs
    finally:
        await runner.close()
