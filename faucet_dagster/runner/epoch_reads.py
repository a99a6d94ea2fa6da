"""The read of an epoch run in one call (``run_epoch``, ``run_epochs``): to the first safe boundary
after its limits, in slices while the epoch before it is in flight.

The source session takes one call at a time, and the epoch before this one (pipelined: still
committing) needs it for its lag and its acknowledgement: while that epoch is in flight this one reads
in slices of ``PIPELINED_SLICE_SECONDS`` (each ending at a safe boundary, the pipeline accepting each
boundary), so those calls get the session between two slices; then it reads the rest of its limits in
one call. Either way the epoch ends at the first safe boundary after a limit, as one read would.
"""

import asyncio
import logging

from faucet_dagster.pipeline import EpochPipeline
from faucet_dagster.protocol import CancelToken, Coverage, ReadLimits, StreamSession
from faucet_dagster.runner.pipelined import Flight
from faucet_dagster.runner.recovery import merge, reaches
from faucet_dagster.runner.sessions import StreamSessions

logger = logging.getLogger(__name__)

PIPELINED_SLICE_SECONDS = 0.1
"""The longest read slice of an epoch read while the epoch before it is in flight."""
EMPTY_SLICE_PAUSE = 0.01
"""Seconds between a slice that returned nothing and the next (a source that returns at once when it
cannot deliver more, such as a full acknowledgement window, waits for the acknowledgement between)."""


async def read_to_limits(
    sessions: StreamSessions,
    session: StreamSession,
    pipeline: EpochPipeline,
    limits: ReadLimits,
    cancel: CancelToken,
    flight: Flight,
    stream: str,
) -> Coverage | None:
    """Read into ``pipeline`` to the first safe boundary after ``limits`` (while recovering, on to the
    sink's watermark); the coverage, or None when the recovery found the source short of the
    watermark. Returns early, with what it covered, when ``cancel`` is set (the caller discards it).
    Each read of a recovery past the first is one of ``limits``, as the recovery needs."""
    loop = asyncio.get_running_loop()
    began = last_new = loop.time()
    coverage = Coverage()
    recover_to = sessions.recover_to
    while not cancel.cancelled:
        now = loop.time()
        before = flight.previous
        sliced = before is not None and before.in_flight
        recovering = bool(recover_to) and not coverage.empty
        this = limits if recovering else _left(limits, pipeline, now - began, sliced)
        more = await sessions.read(session, pipeline, this, cancel)
        coverage = merge(coverage, more)
        now = loop.time()
        if not more.empty:
            last_new = now
        if recover_to and not reaches(coverage, recover_to):
            if more.empty:
                logger.warning(
                    "stream %s: the source has nothing more, short of the destination's watermark; "
                    "the recovery is tried again on the next run",
                    stream,
                )
                return None
            continue
        if not sliced or _reached(limits, pipeline, now - began, now - last_new):
            break
        if more.empty:
            await asyncio.sleep(EMPTY_SLICE_PAUSE)
    return coverage


def _left(limits: ReadLimits, pipeline: EpochPipeline, elapsed: float, sliced: bool) -> ReadLimits:
    """What is left of ``limits`` after ``elapsed`` seconds of the epoch's reads; a slice's age at most
    ``PIPELINED_SLICE_SECONDS`` when ``sliced``."""
    records = None if limits.records is None else max(1, limits.records - pipeline.rows_read)
    size = None if limits.bytes is None else max(1, limits.bytes - pipeline.bytes_written)
    age = None if limits.age is None else max(0.0, limits.age - elapsed)
    if sliced:
        age = PIPELINED_SLICE_SECONDS if age is None else min(age, PIPELINED_SLICE_SECONDS)
    return ReadLimits(records=records, bytes=size, idle=limits.idle, age=age)


def _reached(limits: ReadLimits, pipeline: EpochPipeline, elapsed: float, quiet: float) -> bool:
    """Whether the epoch's reads so far met a limit: it ends at the boundary the last one ended at."""
    return (
        (limits.records is not None and pipeline.rows_read >= limits.records)
        or (limits.bytes is not None and pipeline.bytes_written >= limits.bytes)
        or (limits.age is not None and elapsed >= limits.age)
        or (limits.idle is not None and quiet >= limits.idle)
    )


__all__ = ["PIPELINED_SLICE_SECONDS", "read_to_limits"]
