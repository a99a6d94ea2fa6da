"""The reference model of a streaming sink's scenario: the source's log, the runner's certificates,
what the sink committed, and so what each resource must hold.

A :class:`Stream` holds, per lane (a resource and one of its domains), the events produced (positions
1, 2, ...), the runner's cursor and certified position, and the sink's watermark as the model knows it;
per resource, the :class:`~.tables.TableModel` of what the policy makes of the committed events;
which events a destination without transactions already holds; the last committed epoch. An epoch
(:class:`Active`) records the batches applied and the watermarks it began with, by which a sink with
an atomic watermark skips its replayed rows.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from faucet_dagster.conformance.scenarios.agent import Handle
from faucet_dagster.conformance.scenarios.sink_steps import StreamPlan
from faucet_dagster.conformance.scenarios.tables import KEY, VERSION, Change, TableModel
from faucet_dagster.conformance.scenarios.workers import Worker
from faucet_dagster.protocol import (
    OPERATION_COLUMN,
    Coverage,
    DomainCoverage,
    EpochId,
    Identities,
    Operation,
    OrderingDomain,
    SinkBatch,
    SinkCapabilities,
    WritePolicy,
)

STATE_RULE = "stream 8 last_committed() reads back, durably and from any process, what the stream committed"
ATOMIC_RULE = "stream 8 an epoch's rows and its watermark commit together: a replay writes nothing twice"
POLICY_RULE = "stream 6 the destination holds what the policy makes of the committed epochs"
RECEIPT_RULE = "stream 6 receipts describe the completed work, per resource"
VISIBILITY_RULE = "stream 6 a transactional sink shows nothing of an epoch before its commit"
FENCING_RULE = "stream 7 owner fencing: a stale worker's epoch changes nothing"
NAME_RULE = "values: a name lands exactly as given (keyword, case, unicode, 63 bytes) or is refused"
WORKS_RULE = "stream 6 a call in lifecycle order works, or fails with the typed error the contract names"

Lane = tuple[int, int]
"""A resource and one of its domains, by number."""
Identity = tuple[int, int, int]
"""An event: resource, domain and position."""


@dataclass(frozen=True)
class Event:
    lane: Lane
    position: int
    change: Change

    @property
    def identity(self) -> Identity:
        return (self.lane[0], self.lane[1], self.position)


@dataclass
class Session:
    worker: Worker
    handle: Handle
    token: int


@dataclass
class Active:
    epoch: EpochId
    session: Session
    marks: dict[Lane, int]
    """The sink's watermark per lane when the epoch began (what its replayed rows are judged by)."""
    applied: list[tuple[Lane, int, int]] = field(default_factory=list)
    """Batches applied: lane and the log slice ``[start, stop)``."""
    repeated: set[Identity] = field(default_factory=set)
    """Events a deduplicating destination already held when this epoch applied them."""
    committing: bool = False


@dataclass
class Stream:
    index: int
    plan: StreamPlan
    log: dict[Lane, list[Event]] = field(default_factory=dict)
    cursor: dict[Lane, int] = field(default_factory=dict)
    certified: dict[Lane, int] = field(default_factory=dict)
    marks: dict[Lane, int] = field(default_factory=dict)
    """The model's sink watermark per lane (at or ahead of ``certified``)."""
    tables: dict[int, TableModel] = field(default_factory=dict)
    committed: set[Identity] = field(default_factory=set)
    applied: dict[Identity, Mapping[str, Any]] = field(default_factory=dict)
    """Every event handed to ``apply`` in any epoch (what a destination without transactions may
    hold before a commit, and keeps after an abort)."""
    stored: set[Identity] = field(default_factory=set)
    """Events a destination without transactions is known to hold (their apply returned)."""
    unsure: set[Identity] = field(default_factory=set)
    """Events whose apply a crash interrupted: the recovery looks whether they landed."""
    first_applied: dict[Identity, float] = field(default_factory=dict)
    """When each event was first applied (the battery's clock): how old a replay is."""
    late: list[tuple[Identity, Mapping[str, Any]]] = field(default_factory=list)
    """Events applied again after the destination's duplicate window: it may store them twice, as the
    sink documents (only a machine slow enough to outlast the window makes these)."""
    columns: dict[int, list[str]] = field(default_factory=dict)
    last_epoch: EpochId | None = None
    certified_sequence: int = 0
    token: int = 0
    session: Session | None = None
    zombie: Session | None = None
    active: Active | None = None
    uncertain: Active | None = None
    crash_at: int | None = None
    versions: dict[int, int] = field(default_factory=dict)

    def lanes(self) -> list[Lane]:
        return [(r, p) for r in range(len(self.plan.resources)) for p in range(self.plan.partitions)]

    def domain(self, lane: Lane) -> OrderingDomain:
        return OrderingDomain(
            "conformance", self.plan.resources[lane[0]], str(lane[1]), "incarnation-1", "kafka.offset"
        )

    def base_columns(self) -> int:
        return 3 if self.plan.policy is WritePolicy.VERSIONED_UPSERT else 2

    def coverage(self, active: Active) -> Coverage:
        ends: dict[Lane, int] = {}
        for lane, _, stop in active.applied:
            ends[lane] = max(ends.get(lane, 0), stop)
        return Coverage(
            tuple(
                DomainCoverage(
                    self.domain(lane),
                    str(self.certified[lane]) if self.certified[lane] else None,
                    str(end),
                )
                for lane, end in sorted(ends.items())
            )
        )

    def commit(self, active: Active, caps: SinkCapabilities) -> dict[int, tuple[int, int]]:
        """The epoch committed: apply it to the model; per resource, rows written and skipped."""
        exact = caps.atomic_watermark or caps.dedup_by_event_identity
        tally: dict[int, list[int]] = {}
        for lane, start, stop in active.applied:
            counts = tally.setdefault(lane[0], [0, 0])
            for event in self.log[lane][start:stop]:
                skipped = (caps.atomic_watermark and event.position <= active.marks[lane]) or (
                    caps.dedup_by_event_identity and event.identity in active.repeated
                )
                counts[1 if skipped else 0] += 1
                if exact and event.identity in self.committed:
                    continue
                self.committed.add(event.identity)
                self.tables[lane[0]].apply(event.change)
            self.marks[lane] = max(self.marks[lane], stop)
        self.last_epoch = active.epoch
        return {resource: (written, skipped) for resource, (written, skipped) in tally.items()}

    def certify(self, active: Active) -> None:
        for lane, _, stop in active.applied:
            self.certified[lane] = max(self.certified[lane], stop)
        self.certified_sequence = active.epoch.sequence

    def batch(self, epoch: EpochId, lane: Lane, events: Sequence[Event]) -> SinkBatch:
        resource = lane[0]
        fields = [pa.field(KEY, pa.int64(), nullable=False), pa.field("name", pa.string())]
        if self.plan.policy is WritePolicy.VERSIONED_UPSERT:
            fields.append(pa.field(VERSION, pa.int64()))
        fields += [pa.field(column, pa.string()) for column in self.columns[resource][len(fields) :]]
        rows = [dict(event.change.row) for event in events]
        if self.plan.policy is WritePolicy.APPLY_CHANGES:
            fields.append(pa.field(OPERATION_COLUMN, pa.string()))
            for row, event in zip(rows, events, strict=True):
                row[OPERATION_COLUMN] = event.change.operation.value
        records = pa.RecordBatch.from_pylist(rows, schema=pa.schema(fields))
        identities = Identities([str(event.position) for event in events])
        return SinkBatch(epoch, self.plan.resources[resource], self.domain(lane), records, identities)


def uncommitted(stream: Stream, resource: int) -> list[Mapping[str, Any]]:
    """Rows a destination without transactions may hold beyond what was committed: events applied
    and not committed, and replays older than its duplicate window (which it stores again)."""
    return [
        row
        for identity, row in stream.applied.items()
        if identity[0] == resource and identity not in stream.committed
    ] + [row for identity, row in stream.late if identity[0] == resource]


def column_order(column: str) -> tuple[int, str]:
    return ({KEY: 0, "name": 1, VERSION: 2}.get(column, 3), column)


def held_keys(stream: Stream, resource: int) -> list[int]:
    """The keys the source holds in ``resource`` now (inserted, not deleted), oldest first."""
    keys: list[int] = []
    events = sorted(
        (event for lane, log in stream.log.items() if lane[0] == resource for event in log),
        key=lambda event: (event.position, event.lane),
    )
    for event in events:
        change = event.change
        if change.operation is Operation.TRUNCATE:
            keys.clear()
        elif change.operation is Operation.DELETE:
            if change.key in keys:
                keys.remove(change.key)
        elif change.key not in keys:
            keys.append(change.key)
    return keys


__all__ = [
    "Active",
    "Event",
    "Identity",
    "Lane",
    "Session",
    "Stream",
    "column_order",
    "held_keys",
    "uncommitted",
]
