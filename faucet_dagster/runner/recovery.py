"""Positions bookkeeping of the continuous runner: what a sink committed against the certificates
(:func:`reconcile`), certified positions after an epoch (:func:`advance`), and coverage arithmetic.

Pure functions: no I/O, no Dagster, no session.
"""

import logging
import time
from collections.abc import Sequence

from faucet_dagster.protocol import (
    Coverage,
    DomainCoverage,
    IntegrityError,
    Position,
    SinkCommitState,
    compare_positions,
)

logger = logging.getLogger(__name__)


def reconcile(
    stream: str, committed: SinkCommitState | None, certified: Sequence[Position], last: int
) -> tuple[Position, ...]:
    """Compare the sink's last commit with the certificates (``last`` is the last certified sequence,
    ``certified`` its positions); return the watermark to recover to.

    Empty when the sink is not ahead (or cannot say). Raises :class:`IntegrityError` when the sink
    and the certificates disagree in a way no crash explains.
    """
    if committed is None:
        return ()
    sequence = committed.epoch.sequence
    if sequence > last + 1 or sequence < last:
        raise IntegrityError(
            f"the destination last committed epoch {committed.epoch}, the last certificate is {last}: "
            "certificates or destination data were lost or restored",
            where=stream,
        )
    by_lineage = {position.domain.lineage: position for position in certified}
    # Only the domains the uncertified epoch moved past their certified position are recovered: a
    # sink may report every domain it holds, and an epoch may cover some of them only.
    ahead: list[Position] = []
    for watermark in committed.watermarks:
        position = by_lineage.get(watermark.domain.lineage)
        order = 1 if position is None else compare_positions(watermark, position)
        if order > 0:
            ahead.append(watermark)
        if sequence == last and order != 0:
            raise IntegrityError(
                f"the destination's watermark {watermark.value} in {watermark.domain} differs from "
                f"the certified position {position.value if position else None}",
                where=stream,
            )
        if sequence == last + 1 and order < 0:
            raise IntegrityError(
                f"the destination committed epoch {committed.epoch} behind the certified position "
                f"in {watermark.domain}",
                where=stream,
            )
    if sequence == last:
        return ()
    logger.warning(
        "stream %s: the destination committed epoch %s but no certificate was persisted; recovering it",
        stream,
        committed.epoch,
    )
    return tuple(ahead) or committed.watermarks


def adopted_coverage(certified: Sequence[Position], recover_to: Sequence[Position]) -> Coverage:
    """The coverage of an epoch the sink committed before its certificate, as the sink holds it: from
    each certified position to the sink's watermark."""
    starts = {position.domain.lineage: position.value for position in certified}
    return Coverage(
        tuple(
            DomainCoverage(position.domain, starts.get(position.domain.lineage), position.value)
            for position in recover_to
        )
    )


def advance(certified: tuple[Position, ...], coverage: Coverage) -> tuple[Position, ...]:
    """The certified positions after ``coverage`` was certified."""
    positions = {position.domain.lineage: position for position in certified}
    for position in coverage.end_positions():
        positions[position.domain.lineage] = position
    return tuple(positions.values())


def reaches(coverage: Coverage, targets: Sequence[Position]) -> bool:
    """True when ``coverage`` ends at or past every target position."""
    ends = {position.domain.lineage: position for position in coverage.end_positions()}
    for target in targets:
        end = ends.get(target.domain.lineage)
        if end is None or compare_positions(end, target) < 0:
            return False
    return True


def merge(first: Coverage, then: Coverage) -> Coverage:
    """Two reads of one epoch as one coverage: each domain from its first start to its last end."""
    merged = {item.domain: item for item in first.domains}
    for item in then.domains:
        earlier = merged.get(item.domain)
        merged[item.domain] = (
            item if earlier is None else DomainCoverage(item.domain, earlier.start, item.end)
        )
    return Coverage(tuple(merged.values()))


class Stopwatch:
    """Seconds spent in each step of an epoch, for its certificate."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 6)
        self._last = now
