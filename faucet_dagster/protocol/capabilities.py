"""What a source and a sink can promise, declared from their live config before anything runs.

Capabilities are values, computed like Kafka Connect's ``exactlyOnceSupport(config)``: a connector
returns them from ``capabilities()`` for the config it was built with, and the planner
(:mod:`faucet_dagster.planner`) decides from them alone whether a pair can keep its promise. A
capability claimed true must genuinely work; the conformance battery checks that.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any, TypeVar

from faucet_dagster.protocol.errors import ConfigError


class Emits(StrEnum):
    """The shape of what a source produces."""

    ROWS = "rows"
    """Table-like rows: each one is the state of a record (files, SQL tables)."""
    CHANGES = "changes"
    """Change events carrying an operation (CDC): order matters for applying them."""
    MESSAGES = "messages"
    """Opaque messages from a log or a queue (Kafka, NATS)."""


class Operation(StrEnum):
    """A row-level operation a source emits and a sink policy may accept."""

    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"
    UPSERT = "upsert"
    TRUNCATE = "truncate"
    """Every row of a table removed at once (a change row with every data column null; see
    :data:`faucet_dagster.protocol.records.OPERATION_COLUMN`)."""


class Ordering(StrEnum):
    """The strongest order a source guarantees for what it emits."""

    NONE = "none"
    PARTITION = "partition"
    """Ordered within each partition (Kafka partition, one NATS stream) but not across them."""
    TRANSACTION = "transaction"
    """Transactions arrive whole, but not in a global commit order."""
    STRICT_GLOBAL = "strict_global"
    """One total order over everything emitted (a single ordered read, PostgreSQL commit order)."""


class Replay(StrEnum):
    """Whether a source can deliver again what it delivered before an interruption."""

    REPLAYABLE_AT_LEAST_ONCE = "replayable_at_least_once"
    BEST_EFFORT = "best_effort"


class WritePolicy(StrEnum):
    """How a sink applies records to its destination."""

    APPEND = "append"
    UPSERT = "upsert"
    REPLACE = "replace"
    DELETE = "delete"
    APPLY_CHANGES = "apply_changes"
    VERSIONED_UPSERT = "versioned_upsert"

    @property
    def order_dependent(self) -> bool:
        """True when applying the same records in another order can give another result.

        APPLY_CHANGES and plain UPSERT (last write wins) are order-dependent; VERSIONED_UPSERT applies
        a record only when its version is newer, so any order converges to the same table.
        """
        return self in (WritePolicy.APPLY_CHANGES, WritePolicy.UPSERT)

    @property
    def keyed(self) -> bool:
        """True for the policies that address existing rows by a key."""
        return self in (
            WritePolicy.UPSERT,
            WritePolicy.VERSIONED_UPSERT,
            WritePolicy.DELETE,
            WritePolicy.APPLY_CHANGES,
        )


class Durability(StrEnum):
    """What holds for written records when a sink's commit returns."""

    NONE = "none"
    ACKNOWLEDGED = "acknowledged"
    """Each record was acknowledged by the destination (NATS publish ack)."""
    TRANSACTIONAL = "transactional"
    """The records were committed in one destination transaction (PostgreSQL)."""


class Mode(StrEnum):
    """Bounded (a finite read, then stop) or continuous (epochs forever)."""

    BOUNDED = "bounded"
    CONTINUOUS = "continuous"


class Delivery(StrEnum):
    """The delivery guarantee a plan promises."""

    EFFECTIVELY_ONCE = "effectively_once"
    AT_LEAST_ONCE = "at_least_once"


DEFAULT_POLICY_OPERATIONS: Mapping[WritePolicy, frozenset[Operation]] = {
    WritePolicy.APPEND: frozenset({Operation.INSERT}),
    WritePolicy.REPLACE: frozenset({Operation.INSERT}),
    WritePolicy.UPSERT: frozenset({Operation.INSERT, Operation.UPDATE, Operation.UPSERT}),
    WritePolicy.VERSIONED_UPSERT: frozenset({Operation.INSERT, Operation.UPDATE, Operation.UPSERT}),
    WritePolicy.DELETE: frozenset({Operation.DELETE}),
    WritePolicy.APPLY_CHANGES: frozenset(Operation),
}
"""The operations each policy can apply when a sink does not declare its own."""


@dataclass(frozen=True)
class SourceCapabilities:
    """What a configured source emits and guarantees.

    ``deterministic`` means re-reading a range of positions yields the same records in the same
    pages, which the atomic-watermark mechanism needs to skip pages a sink already committed.
    ``columns`` names the source schema's columns when they are known before reading, so the
    planner can check a key against them. ``dead_letters`` means the source itself routes records it
    cannot turn into rows to the dead-letter route (``on_malformed: dead_letter``): the planner counts
    that route as it counts one for rows that do not fit (it rules out the atomic watermark).
    ``page_bookmarks`` means every page carries a bookmark naming what was read up to it: with a sink
    that keeps each page's bookmark with its commit token (``SinkCapabilities.watermark_bookmark``),
    a rerun resumes from the bookmark the sink holds, so the atomic watermark holds without the
    source being deterministic (a file that sorts before the ones read is read once).
    """

    emits: Emits
    operations: frozenset[Operation]
    ordering: Ordering
    replay: Replay
    bounded: bool
    continuous: bool
    deterministic: bool = False
    transaction_boundaries: bool = False
    event_identity: bool = False
    discover: bool = False
    shardable: bool = False
    columns: tuple[str, ...] | None = None
    dead_letters: bool = False
    page_bookmarks: bool = False


@dataclass(frozen=True)
class SinkCapabilities:
    """What a configured sink can apply and promise.

    Bounded and continuous policies are declared separately: supporting a bounded upsert never
    implies supporting a streaming one. ``accepted_operations`` maps each policy to the operations
    it applies (defaults: :data:`DEFAULT_POLICY_OPERATIONS`). ``atomic_watermark`` means the sink
    commits records and a monotonic commit token (or per-domain position) in one transaction.
    ``owner_fencing`` means the destination checks the writer's fencing token atomically with its
    effects; matching an epoch id in memory is not fencing. ``watermark_bookmark`` means the atomic
    watermark also keeps the bookmark of the page it committed (``Sink.last_committed_bookmark``).
    """

    bounded_policies: frozenset[WritePolicy]
    continuous_policies: frozenset[WritePolicy] = frozenset()
    accepted_operations: Mapping[WritePolicy, frozenset[Operation]] = field(
        default_factory=lambda: dict(DEFAULT_POLICY_OPERATIONS)
    )
    requires_key: frozenset[WritePolicy] = frozenset(
        {WritePolicy.UPSERT, WritePolicy.VERSIONED_UPSERT, WritePolicy.DELETE, WritePolicy.APPLY_CHANGES}
    )
    durability: Durability = Durability.NONE
    atomic_watermark: bool = False
    watermark_bookmark: bool = False
    dedup_by_event_identity: bool = False
    dedup_window: timedelta | None = None
    owner_fencing: bool = False
    schema_evolution: bool = False
    partial_results: bool = False

    def policies(self, mode: Mode) -> frozenset[WritePolicy]:
        """The policies this sink supports in ``mode``."""
        return self.bounded_policies if mode is Mode.BOUNDED else self.continuous_policies

    def operations_for(self, policy: WritePolicy) -> frozenset[Operation]:
        """The operations ``policy`` applies on this sink (nothing for an unknown policy)."""
        return self.accepted_operations.get(policy, frozenset())


def source_capabilities_from(data: Mapping[str, object]) -> SourceCapabilities:
    """Build source capabilities from plain data (YAML, JSON), naming any unknown field or value."""
    return _build(SourceCapabilities, data, _SOURCE_FIELD_TYPES)


def sink_capabilities_from(data: Mapping[str, object]) -> SinkCapabilities:
    """Build sink capabilities from plain data. ``accepted_operations`` maps policy to operations;
    ``dedup_window`` is in seconds."""
    return _build(SinkCapabilities, data, _SINK_FIELD_TYPES)


def _enum_set(enum: type[StrEnum]) -> Callable[[object], frozenset[Any]]:
    def convert(raw: object) -> frozenset[Any]:
        items = [raw] if isinstance(raw, str) else raw
        if not isinstance(items, list | tuple | set | frozenset):
            raise ValueError(f"expected a list of {enum.__name__} values")
        return frozenset(enum(str(item).lower()) for item in items)

    return convert


def _enum_value(enum: type[StrEnum]) -> Callable[[object], Any]:
    return lambda raw: enum(str(raw).lower())


def _boolean(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("true", "false", "yes", "no"):
        return raw.lower() in ("true", "yes")
    raise ValueError("expected true or false")


def _operations_by_policy(raw: object) -> dict[WritePolicy, frozenset[Operation]]:
    if not isinstance(raw, Mapping):
        raise ValueError("expected a mapping of policy to operations")
    return {WritePolicy(str(policy).lower()): _enum_set(Operation)(ops) for policy, ops in raw.items()}


def _seconds(raw: object) -> timedelta | None:
    if raw is None:
        return None
    if isinstance(raw, int | float | str) and not isinstance(raw, bool):
        return timedelta(seconds=float(raw))
    raise ValueError("expected a number of seconds")


def _columns(raw: object) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if isinstance(raw, list | tuple):
        return tuple(str(item) for item in raw)
    raise ValueError("expected a list of column names")


_SOURCE_FIELD_TYPES: Mapping[str, Callable[[object], Any]] = {
    "emits": _enum_value(Emits),
    "operations": _enum_set(Operation),
    "ordering": _enum_value(Ordering),
    "replay": _enum_value(Replay),
    "bounded": _boolean,
    "continuous": _boolean,
    "deterministic": _boolean,
    "transaction_boundaries": _boolean,
    "event_identity": _boolean,
    "discover": _boolean,
    "shardable": _boolean,
    "columns": _columns,
    "dead_letters": _boolean,
    "page_bookmarks": _boolean,
}

_SINK_FIELD_TYPES: Mapping[str, Callable[[object], Any]] = {
    "bounded_policies": _enum_set(WritePolicy),
    "continuous_policies": _enum_set(WritePolicy),
    "accepted_operations": _operations_by_policy,
    "requires_key": _enum_set(WritePolicy),
    "durability": _enum_value(Durability),
    "atomic_watermark": _boolean,
    "watermark_bookmark": _boolean,
    "dedup_by_event_identity": _boolean,
    "dedup_window": _seconds,
    "owner_fencing": _boolean,
    "schema_evolution": _boolean,
    "partial_results": _boolean,
}

CapabilitiesT = TypeVar("CapabilitiesT", SourceCapabilities, SinkCapabilities)


def _build(
    kind: type[CapabilitiesT], data: Mapping[str, object], fields: Mapping[str, Callable[[object], Any]]
) -> CapabilitiesT:
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown {kind.__name__} field(s): {', '.join(unknown)} (known: {', '.join(fields)})",
            where=kind.__name__,
        )
    values: dict[str, Any] = {}
    for name, raw in data.items():
        try:
            values[name] = fields[name](raw)
        except ValueError as exc:
            raise ConfigError(f"{kind.__name__}.{name}: {exc} (got {raw!r})", where=kind.__name__) from None
    try:
        return kind(**values)
    except TypeError as exc:
        raise ConfigError(f"incomplete {kind.__name__}: {exc}", where=kind.__name__) from None
