"""The faults a case can inject, by kind and moment, and which faults apply to which pair.

Every case injects one fault (:mod:`.scenarios` runs it). Kinds of fault:

``point``     SIGKILL (``kill``) or a clean stop (``term``: SIGTERM) at a named moment of the commit
              order (see :data:`MOMENT_POINTS`); the acknowledgement's kill is timed to land while the
              provider acknowledgement is in flight, the close's while the sink's close waits; a
              transactional source's ``during_transaction`` lands after the sink applied a batch of a
              source transaction whose end is not read yet (in the open destination transaction).
``random``    SIGKILL or SIGTERM sent by the controller ``random_delay`` seconds after the worker's
              ``random_after``-th step (a certified epoch, a committed page; 0: after it started).
``zombie``    the owner SIGSTOPs itself at a named moment and stays stopped past its lease; a successor
              takes the lease and certifies epochs; SIGCONT: the owner's commit must be fenced or
              its certificate refused, and its acknowledgement refused (OwnershipLost, no retry).
``restart``   the controller restarts a server while the pipeline runs. NATS and PostgreSQL keep their
              data; the Tansu broker keeps its in memory, so its restart leaves the topic gone and the
              stream must halt explicitly (PositionUnavailable, IncarnationChanged or ConfigError),
              never wait or skip silently.
``recreate``  the source is deleted and created again (new records) after the stream certified
              everything: IncarnationChanged, no new certificate, nothing of the new records written.
``stop``      a clean stop part-way (a stopped sensor stops its reader), the successor started only
              after the NATS destination's duplicate window (shortened to seconds) passed: the stop
              must leave nothing published and uncertified, so no duplicate is allowed.
``exit``      the destination (the NATS server) hangs (SIGSTOP) while the worker stops cleanly
              (SIGTERM): its close cannot settle, returns UncertainOutcome within ``ack_timeout``, and
              the stream must be marked uncertain before the process exits; the successor is refused
              until the operator releases it; then nothing is lost and nothing duplicated.
``delete``    the source (a Kafka topic) is deleted under a live reader, part-way through: the worker
              lives (no crash: see :mod:`faucet_dagster.testing.servers.kafka_shim`) and halts with
              PositionUnavailable or IncarnationChanged naming topic and partition; what it certified
              before stays, nothing after.
``purge``     positions after the certified one are removed (NATS purge): PositionUnavailable, no
              new certificate, nothing written.
``ddl``       a change source's table gets a column with a default, a type change and a dropped
              column between runs (:mod:`.ddl`): the replica equals the source, or the stream halts
              with a SchemaError naming the column until the operator's documented way out.
``retention``, ``page_crash``  the source changes under a lagging consumer or between a bounded
              run's crash and its rerun: see :mod:`faucet_dagster.testing.faults.lagging`.
``snapshot_crash``  a change source with ``snapshot`` killed after the sink committed the snapshot's
              epoch, rows it read changed at the source, then recovered (:mod:`.cdc_variants`).
``failed_commit``  the sink refuses an epoch's commit (``fail`` at ``during_sink_commit``) while the
              next epoch is read ahead: both are rolled back and read again from the certified
              positions by the same worker, which goes on (a retryable failure).
"""

from dataclasses import dataclass
from enum import StrEnum

from faucet_dagster.protocol import Mode
from faucet_dagster.runner.faults import Action, Point
from faucet_dagster.testing.faults.pairs import (
    KAFKA_PURGE,
    FilesSource,
    KafkaSource,
    NatsSource,
    Pair,
    PostgresChangesSource,
    PostgresSnapshotChangesSource,
    PostgresUnkeyedChangesSource,
)


class FaultKind(StrEnum):
    POINT = "point"
    RANDOM = "random"
    ZOMBIE = "zombie"
    RESTART = "restart"
    RECREATE = "recreate"
    DELETE = "delete"
    EXIT = "exit"
    STOP = "stop"
    PURGE = "purge"
    DDL = "ddl"
    RETENTION = "retention"
    PAGE_CRASH = "page_crash"
    SNAPSHOT_CRASH = "snapshot_crash"
    FAILED_COMMIT = "failed_commit"


class Moment(StrEnum):
    """The named moments of the commit order a point fault or a zombie stops at."""

    BEFORE_COMMIT = "before_commit"
    AFTER_COMMIT = "after_commit"
    AFTER_CERTIFICATE = "after_certificate"
    DURING_ACK = "during_ack"
    DURING_COPY = "during_copy"
    DURING_PUBLISH = "during_publish"
    DURING_TRANSACTION = "during_transaction"
    DURING_CLOSE = "during_close"


MOMENT_POINTS: dict[tuple[Mode, str, Moment], Point] = {
    **{
        (Mode.CONTINUOUS, sink, moment): point
        for sink in ("postgres", "nats")
        for moment, point in (
            (Moment.BEFORE_COMMIT, Point.BEFORE_SINK_COMMIT),
            (Moment.AFTER_COMMIT, Point.AFTER_SINK_COMMIT),
            (Moment.AFTER_CERTIFICATE, Point.AFTER_CERTIFICATE),
            (Moment.DURING_ACK, Point.DURING_ACK),
            (Moment.DURING_CLOSE, Point.DURING_SINK_CLOSE),
        )
    },
    (Mode.CONTINUOUS, "postgres", Moment.DURING_COPY): Point.DURING_COPY,
    (Mode.CONTINUOUS, "nats", Moment.DURING_PUBLISH): Point.AFTER_APPLY,
    # Only for transactional sources (see point_for): a batch of a source transaction is applied.
    (Mode.CONTINUOUS, "postgres", Moment.DURING_TRANSACTION): Point.AFTER_APPLY,
    # Bounded: a page's COPY is the last statement of its transaction; the bookmark persisted by the
    # caller (Dagster's run storage) plays the certificate; there is no acknowledgement.
    (Mode.BOUNDED, "postgres", Moment.BEFORE_COMMIT): Point.AFTER_COPY,
    (Mode.BOUNDED, "postgres", Moment.DURING_COPY): Point.DURING_COPY,
    (Mode.BOUNDED, "postgres", Moment.AFTER_COMMIT): Point.AFTER_PAGE,
    (Mode.BOUNDED, "postgres", Moment.AFTER_CERTIFICATE): Point.AFTER_BOOKMARK,
    (Mode.BOUNDED, "postgres", Moment.DURING_CLOSE): Point.DURING_SINK_CLOSE,
}
"""The fault point each moment arms, per mode and sink connector (absent: not applicable)."""

CDC_SLOT_FAULTS = (
    "a slot dropped and set up again, and one advanced past the certified position, halt the stream "
    "before anything is written (IncarnationChanged, PositionUnavailable): tests/test_stream_postgres_cdc.py "
    "checks both"
)
"""Why the harness neither recreates nor purges a change source."""

ONCE_PER_RUN = frozenset({Point.AFTER_BOOKMARK, Point.DURING_SINK_CLOSE})
"""Points a worker reaches once: they are always armed for their first hit."""


@dataclass(frozen=True)
class Fault:
    """One fault: its kind, and the action, moment or server it needs."""

    kind: FaultKind
    action: Action | None = None
    moment: Moment | None = None
    server: str | None = None

    @property
    def name(self) -> str:
        if self.kind is FaultKind.POINT:
            return f"{self.action}@{self.moment}"
        if self.kind is FaultKind.RANDOM:
            return f"{self.action}@random"
        if self.kind is FaultKind.ZOMBIE:
            return f"zombie@{self.moment}"
        if self.kind is FaultKind.RESTART:
            return f"restart {self.server}"
        if self.kind is FaultKind.DDL:
            return "source ddl"
        if self.kind is FaultKind.SNAPSHOT_CRASH:
            return "kill@snapshot_commit, source changed"
        if self.kind is FaultKind.DELETE:
            return "delete source under reader"
        if self.kind is FaultKind.EXIT:
            return "exit, sink frozen"
        if self.kind is FaultKind.STOP:
            return "stop, resumed after the window"
        if self.kind is FaultKind.FAILED_COMMIT:
            return "fail@commit, read ahead"
        return f"{self.kind} source"


def point_for(pair: Pair, moment: Moment) -> Point | None:
    if moment is Moment.DURING_TRANSACTION and not pair.source.transactions:
        return None
    return MOMENT_POINTS.get((pair.mode, pair.sink.connector, moment))


def named_faults(pair: Pair) -> list[Fault]:
    """Every fault that applies to ``pair``, each once: the suite's battery."""
    if pair.source is PostgresSnapshotChangesSource:  # its class: see .cdc_variants
        return [
            Fault(FaultKind.SNAPSHOT_CRASH),
            Fault(FaultKind.POINT, Action.KILL, Moment.DURING_TRANSACTION),
        ]
    if pair.source is PostgresUnkeyedChangesSource:
        moments = (Moment.AFTER_COMMIT, Moment.DURING_TRANSACTION)
        return [Fault(FaultKind.POINT, Action.KILL, moment) for moment in moments]
    faults = [
        Fault(FaultKind.POINT, action, moment)
        for moment in Moment
        if point_for(pair, moment) is not None
        for action in (Action.KILL, Action.TERM)
    ]
    faults += [Fault(FaultKind.RANDOM, action) for action in (Action.KILL, Action.TERM)]
    if pair.mode is Mode.CONTINUOUS:
        faults += [
            Fault(FaultKind.ZOMBIE, Action.STOP, moment)
            for moment in (Moment.BEFORE_COMMIT, Moment.AFTER_CERTIFICATE)
        ]
    faults += [Fault(FaultKind.RESTART, server=server) for server in pair.servers_used]
    if pair.source not in (FilesSource, PostgresChangesSource):
        faults.append(Fault(FaultKind.RECREATE))
    if pair.source is NatsSource:
        faults.append(Fault(FaultKind.PURGE))
    if pair.source is KafkaSource:
        faults.append(Fault(FaultKind.DELETE))
    if (
        pair.mode is Mode.CONTINUOUS
        and pair.sink.connector == "nats"
        and "nats" not in pair.source.servers_used
    ):
        faults.append(Fault(FaultKind.EXIT))  # a frozen NATS source would hang the source's close too
    if pair.mode is Mode.CONTINUOUS and pair.sink.connector == "nats":
        faults.append(Fault(FaultKind.STOP))
    if pair.source is PostgresChangesSource:
        faults.append(Fault(FaultKind.DDL))
    if pair.mode is Mode.CONTINUOUS and pair.source is NatsSource:
        faults.append(Fault(FaultKind.RETENTION))
    if pair.mode is Mode.BOUNDED:
        faults.append(Fault(FaultKind.PAGE_CRASH))
    if pair.mode is Mode.CONTINUOUS:
        faults.append(Fault(FaultKind.FAILED_COMMIT))
    return faults


def not_applicable(pair: Pair) -> list[tuple[str, str]]:
    """Faults left out for ``pair`` and why (the harness's table notes)."""
    if pair.source is KafkaSource:
        return [("purge source", KAFKA_PURGE)]
    if pair.source is PostgresChangesSource:
        return [("recreate or purge source", CDC_SLOT_FAULTS)]
    return []


__all__ = [
    "CDC_SLOT_FAULTS",
    "MOMENT_POINTS",
    "ONCE_PER_RUN",
    "Fault",
    "FaultKind",
    "Moment",
    "named_faults",
    "not_applicable",
    "point_for",
]
