"""What a PostgreSQL streaming sink session (:mod:`faucet_postgres.stream_sink`) knows between
calls: the destination tables it has seen (:class:`Target`), the stream's committed state as of its
last commit (:class:`Committed`), and the active epoch (:class:`Epoch`: the watermarks it began with,
which judge replayed rows and the watermarks its commit writes; a :class:`Tally` per resource; the
:class:`PendingChanges` APPLY_CHANGES staged per table).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from psycopg import sql

from faucet_dagster.protocol import (
    CommittedEpochs,
    Coverage,
    EpochId,
    Identities,
    OrderingDomain,
    Position,
    SinkBatch,
    SinkCommitState,
)
from faucet_postgres import change_apply, changes
from faucet_postgres.common import PgColumn, table_name


@dataclass
class Target:
    """A destination table as this session knows it."""

    schema: str
    table: str
    columns: dict[str, PgColumn]
    stage: sql.Identifier | None = None
    from_changes: bool = False
    """APPLY_CHANGES created the table (its column types follow the change rows' Arrow types)."""
    reconciled: pa.Schema | None = None
    """APPLY_CHANGES: the change rows' schema (with its metadata) the table was last reconciled with."""
    deferred: tuple[str, ...] = ()
    """Its DEFERRABLE unique, primary key and exclusion constraints (schema-qualified, quoted): checked
    at each batch instead of at COMMIT, so a row they refuse is found by bisection (see Tables)."""

    @property
    def identifier(self) -> sql.Identifier:
        return table_name(self.schema, self.table)

    @property
    def label(self) -> str:
        return f"{self.schema}.{self.table}"


@dataclass
class Tally:
    """What an epoch did to one resource so far."""

    table: str
    written: int = 0
    skipped: int = 0
    first: str | None = None
    last: str | None = None


@dataclass
class PendingChanges:
    """APPLY_CHANGES: one destination table's staged changes in the active epoch (``counts`` includes
    the stages applied before a schema change within the epoch)."""

    target: Target
    stage: changes.ChangeStage
    domain: tuple[str, str, str]
    schema: pa.Schema
    ordering: OrderingDomain
    """The domain the changes come from (its codec prints a position)."""
    counts: change_apply.ChangeCounts = change_apply.NO_CHANGES
    last_position: int = 0
    """The highest position staged."""


Lineage = tuple[str, str, str]


@dataclass(frozen=True)
class Committed:
    """The stream's committed state at the destination as a session knows it: the last committed
    epoch, the watermarks (by domain lineage) and the epochs row's ``commit_id`` (``last`` and
    ``commit_id`` None: no epoch committed yet).

    Read once (:meth:`from_rows`), then carried from commit to commit (:meth:`after`): only a commit
    changes the watermarks, always together with the ``commit_id``, and each commit writes only if
    the ``commit_id`` is still the one its watermarks came with, so a commit never judged its rows by
    watermarks that had moved (:mod:`faucet_postgres.stream_sink`).
    """

    watermarks: Mapping[Lineage, Position]
    commit_id: str | None
    last: EpochId | None

    @classmethod
    def from_rows(cls, stream: str, rows: Iterable[tuple[Any, ...]]) -> "Committed":
        """From ``(epoch_sequence, epoch_fencing_token, commit_id, source, resource, partition,
        incarnation, codec, position)`` rows: the stream's epochs row left-joined with its
        watermarks (no row: nothing committed)."""
        last: EpochId | None = None
        commit_id: str | None = None
        watermarks: dict[Lineage, Position] = {}
        for sequence, token, found, source, resource, partition, incarnation, codec, position in rows:
            last, commit_id = EpochId(stream, int(sequence), int(token)), str(found)
            if source is not None:
                domain = OrderingDomain(source, resource, partition, incarnation, codec)
                watermarks[domain.lineage] = Position(domain, position)
        return cls(watermarks, commit_id, last)

    def after(self, epoch: EpochId, marks: Iterable[Position], commit_id: str) -> "Committed":
        """The state once ``epoch``'s commit, which wrote ``marks`` under ``commit_id``, took effect."""
        return Committed(
            {**self.watermarks, **{mark.domain.lineage: mark for mark in marks}}, commit_id, epoch
        )

    def state(self) -> SinkCommitState | None:
        """As the protocol reports it (None: nothing committed)."""
        if self.last is None:
            return None
        return SinkCommitState(self.last, tuple(self.watermarks.values()))


@dataclass
class Epoch:
    """The active epoch: the committed state it began with (its watermarks, by domain lineage, and
    the ``commit_id`` its commit expects to replace), its tallies, its staged changes (by table)."""

    epoch: EpochId
    begun: Committed
    tallies: dict[str, Tally] = field(default_factory=dict)
    changes: dict[str, PendingChanges] = field(default_factory=dict)
    failed: bool = False

    @property
    def committed(self) -> CommittedEpochs:
        """The state the epoch began with, as the protocol's watermark rules read it."""
        return CommittedEpochs(self.begun.last, self.begun.watermarks)

    def above_watermark(
        self, batch: SinkBatch, where: str
    ) -> tuple[pa.RecordBatch, Identities, int, list[int] | None]:
        """The rows of ``batch`` after its domain's watermark, their identities, how many were dropped,
        and the kept rows' indices in ``batch`` (``None``: every row was kept)."""
        kept = self.committed.rows_above(batch, where)
        return kept.records, kept.identities, kept.skipped, kept.indices

    def next_watermarks(self, coverage: Coverage) -> list[Position]:
        """The watermark per covered domain after this epoch: never behind the one it replaces."""
        return self.committed.next_watermarks(coverage)
