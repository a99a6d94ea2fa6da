"""What a continuous stream is (:class:`StreamSpec`), its defaults, what it is planned and piped as
(:func:`continuous_plan`, :func:`stream_pipeline`), and the small values the runner reports
(:class:`CutShort`) or routes through (:class:`StoreDeadLetterRoute`)."""

import asyncio
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from faucet_dagster.pipeline import DeadLetterRoute, Pipeline, PipelineOptions, ResourceSchema
from faucet_dagster.pipeline.schema import BadRowPolicy
from faucet_dagster.planner import Plan, plan
from faucet_dagster.protocol import (
    Delivery,
    EpochId,
    Membership,
    Mode,
    ReadLimits,
    RejectedRecord,
    StreamingSink,
    StreamSource,
    WritePolicy,
)
from faucet_dagster.state import StateStore

DEFAULT_EPOCH_LIMITS = ReadLimits(records=50_000, bytes=None, idle=1.0, age=1.0)
"""An epoch ends at the first safe boundary after 50,000 records or a second: what a row waits, at
most, before its epoch is committed and visible (a source transaction still ends it only at its end)."""
DEFAULT_LEASE_SECONDS = 15.0


@dataclass(frozen=True)
class StreamSpec:
    """One continuous stream: its source and sink, what is read, how it is written, how epochs end.

    ``schemas`` declares resources' schemas (others are inferred; every resource is keyed by
    ``key``). ``limits`` are the per-epoch read targets: an epoch run in one call
    (:meth:`~faucet_dagster.runner.continuous.StreamRunner.run_epoch`) ends at the first safe boundary
    after any of them; an epoch read under a sensor is sealed at the first safe boundary after it is
    ``limits.age`` seconds old (or has read something, when older), or holds ``limits.records`` rows
    or ``limits.bytes`` bytes (its memory bound: nothing is dropped). ``pipeline.read_ahead_bytes``
    bounds what the epoch read while the one before it commits holds. ``lease_seconds`` is how long a
    lease lives without renewal (the runner renews it in
    the background every third of that): how long a worker that died without releasing it holds the
    stream up.
    """

    name: str
    source: StreamSource
    sink: StreamingSink
    resources: tuple[str, ...]
    policy: WritePolicy = WritePolicy.APPEND
    key: tuple[str, ...] = ()
    schemas: Mapping[str, ResourceSchema] = field(default_factory=dict)
    default_schema: ResourceSchema | None = None
    delivery: Delivery | None = None
    limits: ReadLimits = DEFAULT_EPOCH_LIMITS
    membership: Membership = field(default_factory=Membership)
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)

    @property
    def dead_letter(self) -> bool:
        """True when some resource routes bad rows to the dead-letter route."""
        specs = [*self.schemas.values(), self.default_schema or ResourceSchema()]
        return any(spec.on_bad_row is BadRowPolicy.DEAD_LETTER for spec in specs)


def stream_pipeline(spec: StreamSpec, dead_letters: DeadLetterRoute) -> Pipeline:
    """The pipeline ``spec``'s epochs go through: its declared schemas, each keyed by the stream's key
    unless it names its own (the runner's, and what ``faucet verify`` replays a range through)."""
    schemas = {name: replace(schema, key=schema.key or spec.key) for name, schema in spec.schemas.items()}
    default = spec.default_schema or ResourceSchema()
    return Pipeline(
        schemas,
        default_schema=replace(default, key=default.key or spec.key),
        dead_letters=dead_letters,
        options=spec.pipeline,
    )


class StoreDeadLetterRoute(DeadLetterRoute):
    """Dead letters kept in the state store, keyed by event identity (a replay stores nothing twice)."""

    def __init__(self, store: StateStore, stream: str) -> None:
        self._store = store
        self._stream = stream

    async def route(self, epoch: EpochId, records: Sequence[RejectedRecord]) -> None:
        await asyncio.to_thread(
            self._store.record_dead_letters, self._stream, epoch.sequence, epoch.fencing_token, records
        )

    async def withdraw(self, epoch: EpochId, records: Sequence[RejectedRecord]) -> None:
        await asyncio.to_thread(self._store.withdraw_dead_letters, self._stream, epoch.fencing_token, records)


@dataclass(frozen=True)
class CutShort:
    """An epoch run in one call whose deadline interrupted it after it had read rows, before a safe
    boundary: nothing of it was certified, and the next read starts again at the certified positions.
    Repeated, it means the source cannot reach a boundary within one call's budget (a source
    transaction larger than that call reads). Epochs read between sensor ticks are never cut short:
    they span as many ticks as their transactions need."""

    epoch: EpochId
    rows: int
    seconds: float

    def describe(self) -> str:
        return (
            f"epoch {self.epoch.sequence} read {self.rows} rows in {self.seconds:.1f}s without reaching a "
            "safe source boundary (an open source transaction) before the budget ended; nothing was "
            "certified. If this repeats, one source transaction is larger than one call's budget reads: "
            "give the call a larger budget, or run the stream under a sensor, whose epochs span ticks"
        )


def continuous_plan(spec: StreamSpec) -> Plan:
    """The planner's verdict on ``spec`` run continuously (raises :class:`PlanError` when refused)."""
    return plan(
        spec.source.capabilities(),
        spec.sink.capabilities(),
        Mode.CONTINUOUS,
        spec.policy,
        spec.key,
        delivery=spec.delivery,
        durable_state=True,
        dead_letter=spec.dead_letter,
    )


def default_worker_id() -> str:
    """A worker id unique to this process instance (a restarted process is a new worker)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
