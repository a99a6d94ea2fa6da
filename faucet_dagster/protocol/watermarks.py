"""Per-domain watermarks of a streaming sink with an atomic watermark: what the last committed epoch
reached in each ordering domain, which rows of a replayed batch to drop, and the watermarks an epoch
commits.

A sink that commits an epoch's rows together with, per ordering domain, the last position the epoch
covered (in one destination transaction, one table-format commit) can tell a replay from new rows: a
row at or below its domain's watermark is already at the destination. :class:`CommittedEpochs` is that
state as a session knows it between calls, read once from the destination (whatever way the connector
stores it) and carried from commit to commit. Pure: no I/O.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.protocol.errors import IntegrityError
from faucet_dagster.protocol.positions import IntegerPositionCodec, Position, default_codec_registry
from faucet_dagster.protocol.streaming import Coverage, EpochId, Identities, SinkBatch, SinkCommitState

Lineage = tuple[str, str, str]
"""A domain without its incarnation (source, resource, partition): what a watermark is kept by."""


@dataclass(frozen=True)
class KeptRows:
    """The rows of a batch after its domain's watermark.

    ``records`` and ``identities`` are the kept rows; ``skipped`` counts the dropped ones; ``indices``
    are the kept rows' indices in the batch (``None``: every row was kept).
    """

    records: pa.RecordBatch
    identities: Identities
    skipped: int
    indices: list[int] | None


@dataclass(frozen=True)
class CommittedEpochs:
    """A stream's committed state at a destination: its last committed epoch (``None``: none yet) and
    the watermark of each domain it covered, by lineage."""

    last: EpochId | None = None
    watermarks: Mapping[Lineage, Position] = field(default_factory=dict)

    @classmethod
    def of(cls, last: EpochId | None, watermarks: Iterable[Position]) -> "CommittedEpochs":
        return cls(last, {position.domain.lineage: position for position in watermarks})

    def state(self) -> SinkCommitState | None:
        """As ``StreamingSinkSession.last_committed`` reports it (``None``: nothing committed)."""
        if self.last is None:
            return None
        return SinkCommitState(self.last, tuple(self.watermarks.values()))

    def after(self, epoch: EpochId, marks: Iterable[Position]) -> "CommittedEpochs":
        """The state once ``epoch``, which wrote ``marks``, committed."""
        return CommittedEpochs(epoch, {**self.watermarks, **{mark.domain.lineage: mark for mark in marks}})

    def rows_above(self, batch: SinkBatch, where: str) -> KeptRows:
        """The rows of ``batch`` after its domain's watermark (all of them for another incarnation:
        the source was recreated, its positions start again)."""
        records = batch.records
        positions = list(batch.identities.positions)
        mark = self.watermarks.get(batch.domain.lineage)
        if mark is None or mark.domain.incarnation != batch.domain.incarnation or not positions:
            return KeptRows(records, batch.identities, 0, None)
        codec = default_codec_registry().get(batch.domain.codec)
        limit = codec.validate(mark.value)
        if isinstance(codec, IntegerPositionCodec):
            try:
                values = pa.array(positions, pa.string()).cast(pa.int64())
            except pa.ArrowInvalid as exc:
                raise IntegrityError(
                    f"a batch carries positions that are not {codec.name} positions", where=where
                ) from exc
            keep = pc.greater(values, limit)
        else:
            verdicts = {text: codec.compare(codec.validate(text), limit) > 0 for text in set(positions)}
            keep = pa.array([verdicts[text] for text in positions], pa.bool_())
        kept = int(pc.sum(keep).as_py() or 0)
        if kept == len(positions):
            return KeptRows(records, batch.identities, 0, None)
        indices = pc.indices_nonzero(keep).to_pylist()
        ordinals = batch.identities.ordinals
        identities = Identities(
            [positions[index] for index in indices],
            None if ordinals is None else [ordinals[index] for index in indices],
        )
        return KeptRows(records.filter(keep), identities, len(positions) - kept, indices)

    def next_watermarks(self, coverage: Coverage) -> list[Position]:
        """The watermark of each domain ``coverage`` covers after the epoch: never behind the one it
        replaces (a replayed epoch covering less than the destination holds keeps the higher one)."""
        marks: list[Position] = []
        for item in coverage.domains:
            new = Position(item.domain, item.end)
            old = self.watermarks.get(item.domain.lineage)
            if old is not None and old.domain == item.domain:
                codec = default_codec_registry().get(item.domain.codec)
                if codec.compare(codec.validate(old.value), codec.validate(item.end)) >= 0:
                    new = old
            marks.append(new)
        return marks


__all__ = ["CommittedEpochs", "KeptRows", "Lineage"]
