"""Running a streaming sink's scenario against the real destination, judged after every step.

The model (a :class:`_Stream` per stream, a :class:`~.tables.TableModel` per resource) holds what the
battery's source produced, what the runner certified, what the sink committed (its watermark per
domain, its last epoch) and so what each resource must hold. After each step the destination is read
back through the system's own client and compared; so are the receipts of every commit and what
``last_committed()`` reads back, in the sink's own worker and in other processes. A crash leaves one
epoch uncertain: the recovering worker reads ``last_committed()``, the model takes the outcome it
reports, and the destination must agree (all of the epoch or none of it at a transactional sink).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from faucet_dagster.conformance.scenarios import sink_steps as steps
from faucet_dagster.conformance.scenarios.agent import AgentPlan, Handle
from faucet_dagster.conformance.scenarios.effects import EFFECTS
from faucet_dagster.conformance.scenarios.engine import Divergence, Step, Trace
from faucet_dagster.conformance.scenarios.sink_steps import SinkDeclaration, StreamPlan
from faucet_dagster.conformance.scenarios.tables import (
    KEY,
    VERSION,
    Change,
    TableModel,
    absent_columns,
    difference,
)
from faucet_dagster.conformance.scenarios.workers import Crashed, Failed, Hung, Worker
from faucet_dagster.conformance.setup import ReadBlocked
from faucet_dagster.protocol import (
    OPERATION_COLUMN,
    Coverage,
    DataError,
    DomainCoverage,
    EpochId,
    Identities,
    LifecycleError,
    Operation,
    OrderingDomain,
    OwnershipLost,
    Receipt,
    Role,
    SchemaError,
    SinkBatch,
    SinkCommitState,
    UncertainOutcome,
    WorkerIdentity,
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
class _Event:
    lane: Lane
    position: int
    change: Change

    @property
    def identity(self) -> Identity:
        return (self.lane[0], self.lane[1], self.position)


@dataclass
class _Session:
    worker: Worker
    handle: Handle
    token: int


@dataclass
class _Active:
    epoch: EpochId
    session: _Session
    marks: dict[Lane, int]
    """The sink's watermark per lane when the epoch began (what its replayed rows are judged by)."""
    applied: list[tuple[Lane, int, int]] = field(default_factory=list)
    """Batches applied: lane and the log slice ``[start, stop)``."""
    repeated: set[Identity] = field(default_factory=set)
    """Events a deduplicating destination already held when this epoch applied them."""
    committing: bool = False


@dataclass
class _Stream:
    index: int
    plan: StreamPlan
    log: dict[Lane, list[_Event]] = field(default_factory=dict)
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
    columns: dict[int, list[str]] = field(default_factory=dict)
    last_epoch: EpochId | None = None
    certified_sequence: int = 0
    token: int = 0
    session: _Session | None = None
    zombie: _Session | None = None
    active: _Active | None = None
    uncertain: _Active | None = None
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


class _Refused(Exception):
    """A call failed in the worker: ``error`` is its exception, ``what`` the call."""

    def __init__(self, failed: Failed, what: str) -> None:
        super().__init__(what)
        self.error = failed.error
        self.what = what


class SinkRun:
    """One scenario's run: the model, the worker processes, and the oracle."""

    def __init__(self, subject: Any, setup: Any, declared: SinkDeclaration, trace: Trace) -> None:
        self.subject = subject
        self.setup = setup
        self.declared = declared
        self.caps = declared.capabilities
        self.trace = trace
        self.timeout: float = subject.options.timeout
        self.streams: list[_Stream] = []
        self.workers: list[Worker] = []
        self.keys = 0

    async def run(self, scenario: Sequence[Step]) -> None:
        try:
            import os
            import time

            for step in scenario:
                self.trace.ran.append(step.describe())
                t0 = time.perf_counter()
                try:
                    await self._step(step)
                    if os.environ.get("BATTERY_TIMING"):
                        print(f"{time.perf_counter() - t0:7.3f} {self.trace.ran[-1][:150]}", flush=True)
                except _Refused as refused:
                    raise Divergence(WORKS_RULE, f"{refused.what} raised {refused.error}") from None
                except Hung as hung:
                    raise Divergence(WORKS_RULE, f"a call did not return: {hung}") from None
        finally:
            for worker in self.workers:
                await worker.stop()

    async def _step(self, step: Step) -> None:
        handler: Callable[[Any], Any] = getattr(self, f"_{type(step).__name__.lower()}")
        await handler(step)

    # -- workers ----------------------------------------------------------------------------------

    def _worker(self, name: str, *, crashable: bool = True) -> Worker:
        effects = (EFFECTS | self.subject.options.effects) if crashable else None
        plan = AgentPlan(self.subject.spec, Role.STREAMING_SINK, effects)
        worker = Worker(plan, timeout=self.timeout, name=name)
        self.workers.append(worker)
        return worker

    async def _open(self, stream: _Stream, worker: Worker, token: int) -> _Session:
        identity = WorkerIdentity(f"battery-{stream.plan.name}-{token}", token)
        plan = stream.plan
        try:
            sink = await worker.build(self.setup.config)
            handle = await worker.call(sink, "open", plan.name, plan.policy, plan.key, identity)
        except Failed as failed:
            raise _Refused(
                failed, f"open({plan.name!r}, {plan.policy.value}, key {list(plan.key)})"
            ) from None
        return _Session(worker, handle, token)

    async def _call(
        self, session: _Session, method: str, *args: Any, what: str, crash_at: int | None = None
    ) -> Any:
        try:
            return await session.worker.call(session.handle, method, *args, crash_at=crash_at)
        except Failed as failed:
            raise _Refused(failed, what) from None

    # -- the cast and the source ------------------------------------------------------------------

    async def _cast(self, cast: steps.Cast) -> None:
        for index, plan in enumerate(cast.streams):
            stream = _Stream(index, plan)
            for lane in stream.lanes():
                stream.log[lane], stream.cursor[lane], stream.certified[lane], stream.marks[lane] = (
                    [],
                    0,
                    0,
                    0,
                )
            for resource in range(len(plan.resources)):
                stream.tables[resource] = TableModel(plan.policy)
                stream.columns[resource] = [KEY, "name", *([VERSION] * (stream.base_columns() - 2))]
            self.streams.append(stream)
            self.trace.exercised.add(f"continuous policy {plan.policy.value}")
        if len(cast.streams) > 1:
            self.trace.exercised.add("several streams on one destination")

    async def _produce(self, step: steps.Produce) -> None:
        self._produce_events(self.streams[step.stream], (step.resource, step.partition), step.operations)

    def _produce_events(self, stream: _Stream, lane: Lane, operations: Sequence[str]) -> None:
        """Append events to the lane's log; an operation on a key the source does not hold (a step
        dropped while shrinking) becomes an insert."""
        keys = _held_keys(stream, lane[0])
        log = stream.log[lane]
        for number, kind in enumerate(operations):
            operation, version = Operation.INSERT, 1
            if kind == "truncate":
                key, operation = 0, Operation.TRUNCATE
                keys.clear()
            elif kind != "insert" and keys:
                key = keys[-1] if kind.endswith(":-1") else keys[(number * 7 + len(log)) % len(keys)]
                current = stream.versions.get(key, 1)
                if kind == "stale":
                    operation, version = Operation.UPDATE, max(1, current - 1)
                else:
                    operation = Operation.DELETE if kind == "delete" else Operation.UPDATE
                    version = stream.versions[key] = current + 1
                if operation is Operation.DELETE:
                    keys.remove(key)
            else:
                self.keys += 1
                key = (stream.index + 1) * 1_000_000 + self.keys
                stream.versions[key] = 1
                keys.append(key)
            log.append(
                _Event(
                    lane, len(log) + 1, Change(operation, self._row(stream, lane[0], key, version, operation))
                )
            )

    def _row(
        self, stream: _Stream, resource: int, key: int, version: int, operation: Operation
    ) -> dict[str, Any]:
        if operation is Operation.TRUNCATE:
            return {column: None for column in stream.columns[resource]} | {KEY: 0}
        row: dict[str, Any] = {KEY: key, "name": f"n{key}v{version}"}
        if stream.plan.policy is WritePolicy.VERSIONED_UPSERT:
            row[VERSION] = version
        for column in stream.columns[resource][stream.base_columns() :]:
            row[column] = f"{len(column)}:{key}v{version}"
        return row

    async def _evolve(self, step: steps.Evolve) -> None:
        stream = self.streams[step.stream]
        if step.column not in stream.columns[step.resource]:
            stream.columns[step.resource].append(step.column)
            self.trace.exercised.add("new columns with hostile names")

    # -- the epoch lifecycle ----------------------------------------------------------------------

    async def _begin(self, step: steps.Begin) -> None:
        stream = self.streams[step.stream]
        if stream.active is not None:
            self.trace.note("skipped: an epoch is active")
            return
        session = await self._session(stream)
        epoch = EpochId(stream.plan.name, stream.certified_sequence + 1, session.token)
        active = _Active(epoch, session, dict(stream.marks))
        stream.active = active
        if not await self._lifecycle(stream, "begin_epoch", epoch, what=f"begin_epoch({epoch})"):
            return

    async def _lifecycle(self, stream: _Stream, method: str, *args: Any, what: str) -> bool:
        """A lifecycle call of the active epoch; False when the worker died in it (a crash armed)."""
        active = stream.active
        assert active is not None
        crash_at, stream.crash_at = stream.crash_at, None
        try:
            await self._call(active.session, method, *args, what=what, crash_at=crash_at)
        except Crashed:
            await self._crashed(stream)
            return False
        return True

    async def _apply(self, step: steps.Apply, *, look: bool = True) -> None:
        stream = self.streams[step.stream]
        active = stream.active
        lane = (step.resource, step.partition)
        start = stream.cursor[lane]
        events = stream.log[lane][start : start + step.count]
        if active is None or not events:
            self.trace.note("skipped: " + ("no active epoch" if active is None else "nothing produced"))
            return
        batch = self._batch(stream, active.epoch, lane, events)
        self._applying(stream, active, events)
        active.applied.append((lane, start, start + len(events)))
        stream.cursor[lane] = start + len(events)
        try:
            if not await self._lifecycle(stream, "apply", active.epoch, batch, what=f"apply({active.epoch})"):
                return
            self._applied(stream, events)
        except _Refused as refused:
            if await self._new_columns_refused(stream, lane, refused):
                return
            raise
        if self.declared.transactional and look:
            try:
                await self._compare(
                    stream, VISIBILITY_RULE, f"after apply({active.epoch}), before its commit"
                )
            except ReadBlocked:
                self.trace.note("a reader waits for the epoch's lock: it sees nothing of it")

    def _applying(self, stream: _Stream, active: _Active, events: Sequence[_Event]) -> None:
        active.repeated |= {event.identity for event in events if event.identity in stream.stored}
        for event in events:
            stream.applied.setdefault(event.identity, event.change.row)

    def _applied(self, stream: _Stream, events: Sequence[_Event]) -> None:
        if not self.declared.transactional:
            stream.stored |= {event.identity for event in events}

    async def _new_columns_refused(self, stream: _Stream, lane: Lane, refused: _Refused) -> bool:
        """A batch bringing columns the sink does not evolve to may be refused (SchemaError, or a
        DataError naming the column), never dropped: the epoch is aborted and the columns leave the
        model, as if the source dropped them."""
        added = stream.columns[lane[0]][stream.base_columns() :]
        if not added or not refused.error.is_a(SchemaError, DataError):
            return False
        if self.caps.schema_evolution:
            raise Divergence(
                NAME_RULE,
                f"schema evolution is declared, but a batch of resource {stream.plan.resources[lane[0]]!r} "
                f"with new columns {added} was refused: {refused.error}",
            )
        self.trace.note("refused as the sink declares no schema evolution: the columns are dropped")
        del stream.columns[lane[0]][stream.base_columns() :]
        for log_lane, events in stream.log.items():
            if log_lane[0] == lane[0]:
                for number, event in enumerate(events):
                    row = {k: v for k, v in event.change.row.items() if k not in added}
                    events[number] = _Event(event.lane, event.position, Change(event.change.operation, row))
        await self._abort_active(stream)
        return True

    async def _commit(self, step: steps.Commit) -> None:
        stream = self.streams[step.stream]
        active = stream.active
        if active is None:
            self.trace.note("skipped: no active epoch")
            return
        active.committing = True
        crash_at, stream.crash_at = stream.crash_at, None
        what = f"commit_epoch({active.epoch})"
        try:
            receipts = await self._call(
                active.session,
                "commit_epoch",
                active.epoch,
                self._coverage(stream, active),
                what=what,
                crash_at=crash_at,
            )
        except Crashed:
            await self._crashed(stream)
            return
        stream.active = None
        self._check_receipts(stream, active, receipts, self._committed(stream, active))
        if step.certify:
            self._certify(stream, active)
            await self._check_state(stream, active.session, "read by the session that committed")
        else:
            self.trace.exercised.add("recovery of an epoch committed before its certificate")
            self._lost(stream)
        await self._compare(stream, POLICY_RULE, f"after {what}")

    async def _abort(self, step: steps.Abort) -> None:
        stream = self.streams[step.stream]
        if stream.active is None:
            self.trace.note("skipped: no active epoch")
            return
        await self._abort_active(stream)
        await self._compare(stream, POLICY_RULE, "after abort_epoch")

    async def _abort_active(self, stream: _Stream) -> None:
        active = stream.active
        assert active is not None
        stream.active = None
        stream.cursor = dict(stream.certified)
        try:
            await self._call(active.session, "abort_epoch", active.epoch, what=f"abort_epoch({active.epoch})")
        except Crashed:
            self._lost(stream)

    async def _close(self, step: steps.Close) -> None:
        stream = self.streams[step.stream]
        session = stream.session
        if session is None:
            self.trace.note("skipped: no session")
            return
        stream.session, stream.active = None, None
        stream.cursor = dict(stream.certified)
        try:
            await self._call(session, "close_session", what="close_session()")
        except _Refused as refused:
            if not refused.error.is_a(UncertainOutcome):
                raise
            self.trace.note("close_session was uncertain")
        await self._compare(stream, POLICY_RULE, "after close_session")

    async def _crash(self, step: steps.Crash) -> None:
        stream = self.streams[step.stream]
        self.trace.exercised.add("crashes in a worker process")
        if step.at_effect is not None:
            stream.crash_at = step.at_effect
            return
        if stream.session is None:
            self.trace.note("skipped: no worker")
            return
        stream.session.worker.kill()
        await self._crashed(stream)

    async def _crashed(self, stream: _Stream, *, recover: bool = True) -> None:
        """The stream's worker died: an epoch it was committing is uncertain until the next worker
        asks the sink; that recovery runs at once (a restart), or with the next session."""
        self.trace.note("the worker died")
        active = stream.active
        if active is not None and active.committing:
            stream.uncertain = active
        if active is not None and not self.declared.transactional:
            stream.unsure |= {
                event.identity
                for lane, start, stop in active.applied
                for event in stream.log[lane][start:stop]
            }
        self._lost(stream)
        await self._session(stream)

    def _lost(self, stream: _Stream) -> None:
        if stream.session is not None:
            stream.session.worker.kill()
        stream.session, stream.active, stream.crash_at = None, None, None
        stream.cursor = dict(stream.certified)

    async def _takeover(self, step: steps.Takeover) -> None:
        stream = self.streams[step.stream]
        if stream.active is not None:
            await self._abort_active(stream)  # the old worker ends its epoch as it loses the lease
        old = stream.session
        stream.session, stream.active = None, None
        stream.cursor = dict(stream.certified)
        if old is not None:
            if self.caps.owner_fencing:
                if stream.zombie is not None:
                    stream.zombie.worker.kill()
                stream.zombie = old
            else:
                old.worker.kill()
        self.trace.exercised.add("takeover by a newer fencing token")
        await self._session(stream)

    async def _zombie(self, step: steps.Zombie) -> None:
        stream = self.streams[step.stream]
        zombie, stream.zombie = stream.zombie, None
        if zombie is None:
            self.trace.note("skipped: no older worker alive")
            return
        self.trace.exercised.add("owner_fencing")
        epoch = EpochId(stream.plan.name, stream.certified_sequence + 1, zombie.token)
        before = await self._read_all(stream)
        ends: dict[Lane, int] = {}
        try:
            await zombie.worker.call(zombie.handle, "begin_epoch", epoch)
            for lane in stream.lanes():
                events = stream.log[lane][stream.certified[lane] :]
                if events:
                    await zombie.worker.call(
                        zombie.handle, "apply", epoch, self._batch(stream, epoch, lane, events)
                    )
                    ends[lane] = events[-1].position
            coverage = Coverage(
                tuple(
                    DomainCoverage(stream.domain(lane), None, str(end)) for lane, end in sorted(ends.items())
                )
            )
            await zombie.worker.call(zombie.handle, "commit_epoch", epoch, coverage)
        except Failed as failed:
            if not failed.error.is_a(OwnershipLost, LifecycleError):
                raise Divergence(
                    FENCING_RULE, f"the stale worker's epoch {epoch} raised {failed.error}, not OwnershipLost"
                ) from None
            self.trace.note(f"refused: {failed.error.kind}")
        else:
            raise Divergence(
                FENCING_RULE,
                f"owner fencing is declared, but epoch {epoch} of a worker whose fencing token {zombie.token} "
                f"was superseded by {stream.token} committed",
            )
        finally:
            zombie.worker.kill()
        if await self._read_all(stream) != before:
            raise Divergence(FENCING_RULE, f"the refused stale epoch {epoch} changed the destination")
        await self._check_state(stream, None, "after a stale worker's epoch was refused")

    async def _readstate(self, step: steps.ReadState) -> None:
        stream = self.streams[step.stream]
        if stream.active is not None:
            self.trace.note("skipped: an epoch is active")
            return
        self.trace.exercised.add("last_committed() read by another process")
        await self._check_state(stream, None, "read by another process")

    async def _sweep(self, step: steps.Sweep) -> None:
        """Epochs of every resource, the worker killed before effect 0, 1, 2... of the commit (and of
        the applies, where the destination accepts writes before the commit): each time the next
        worker recovers (the destination holds all of the epoch or none of it, as last_committed()
        says) and its epoch replays what was not committed, with the next crash point armed."""
        stream = self.streams[step.stream]
        self.trace.exercised.add("a crash at every effect of an epoch")
        self._lost(stream)
        for point in range(256):
            if all(stream.certified[lane] == len(stream.log[lane]) for lane in stream.lanes()):
                for resource in range(len(stream.plan.resources)):
                    operations = ("insert", "update:-1") if stream.plan.policy.keyed else ("insert",)
                    self._produce_events(stream, (resource, 0), operations)
            session = await self._session(stream)
            active = stream.active = _Active(
                EpochId(stream.plan.name, stream.certified_sequence + 1, session.token),
                session,
                dict(stream.marks),
            )
            calls: list[tuple[str, tuple[Any, ...]]] = [("begin_epoch", (active.epoch,))]
            for lane in stream.lanes():
                start, stop = stream.cursor[lane], len(stream.log[lane])
                if stop > start:
                    events = stream.log[lane][start:stop]
                    calls.append(("apply", (active.epoch, self._batch(stream, active.epoch, lane, events))))
                    active.applied.append((lane, start, stop))
                    stream.cursor[lane] = stop
                    self._applying(stream, active, events)
            calls.append(("commit_epoch", (active.epoch, self._coverage(stream, active))))
            made, receipts = 0, None
            try:
                for method, args in calls:
                    active.committing = method == "commit_epoch"
                    # A transactional sink's applies are tentative (a crash there loses them all,
                    # as the visibility check after each apply shows): only its commit is swept.
                    swept = method == "commit_epoch" or (
                        method == "apply" and not self.declared.transactional
                    )
                    receipts = await self._call(
                        session,
                        method,
                        *args,
                        what=f"{method} in the sweep",
                        crash_at=point - made if swept else None,
                    )
                    made += len(session.worker.effects) if swept else 0
            except Crashed:
                self.trace.note(f"died at effect {point}")
                await self._crashed(stream, recover=False)
                continue
            stream.active = None
            for lane, start, stop in active.applied:
                self._applied(stream, stream.log[lane][start:stop])
            self._check_receipts(stream, active, receipts or (), self._committed(stream, active))
            self._certify(stream, active)
            await self._compare(stream, POLICY_RULE, f"after the sweep's epoch completed ({made} effects)")
            self.trace.note(f"{point} crash points, then it completed")
            return
        raise Divergence(WORKS_RULE, "an epoch of a few rows made more than 256 effects")

    # -- the model --------------------------------------------------------------------------------

    def _coverage(self, stream: _Stream, active: _Active) -> Coverage:
        ends: dict[Lane, int] = {}
        for lane, _, stop in active.applied:
            ends[lane] = max(ends.get(lane, 0), stop)
        return Coverage(
            tuple(
                DomainCoverage(
                    stream.domain(lane),
                    str(stream.certified[lane]) if stream.certified[lane] else None,
                    str(end),
                )
                for lane, end in sorted(ends.items())
            )
        )

    def _committed(self, stream: _Stream, active: _Active) -> dict[int, tuple[int, int]]:
        """The epoch committed: apply it to the model; per resource, rows written and skipped."""
        exact = self.caps.atomic_watermark or self.caps.dedup_by_event_identity
        tally: dict[int, list[int]] = {}
        for lane, start, stop in active.applied:
            counts = tally.setdefault(lane[0], [0, 0])
            for event in stream.log[lane][start:stop]:
                skipped = (self.caps.atomic_watermark and event.position <= active.marks[lane]) or (
                    self.caps.dedup_by_event_identity and event.identity in active.repeated
                )
                counts[1 if skipped else 0] += 1
                if exact and event.identity in stream.committed:
                    continue
                stream.committed.add(event.identity)
                stream.tables[lane[0]].apply(event.change)
            stream.marks[lane] = max(stream.marks[lane], stop)
        stream.last_epoch = active.epoch
        return {resource: (written, skipped) for resource, (written, skipped) in tally.items()}

    def _certify(self, stream: _Stream, active: _Active) -> None:
        for lane, _, stop in active.applied:
            stream.certified[lane] = max(stream.certified[lane], stop)
        stream.certified_sequence = active.epoch.sequence

    # -- recovery and the oracle ------------------------------------------------------------------

    async def _session(self, stream: _Stream) -> _Session:
        """The stream's session; after a crash, a close or a takeover a new worker with a higher
        fencing token opens it and reconciles what the sink committed with the certificates."""
        if stream.session is not None:
            return stream.session
        stream.token += 1
        session = await self._open(
            stream, self._worker(f"{stream.plan.name}-worker-{stream.token}"), stream.token
        )
        stream.session = session
        stream.cursor = dict(stream.certified)
        state = await self._read_state(stream, session)
        uncertain, stream.uncertain = stream.uncertain, None
        if uncertain is not None:
            landed = state is not None and state.epoch == uncertain.epoch
            self.trace.note(f"the recovery finds epoch {uncertain.epoch} {'' if landed else 'not '}committed")
            if landed:
                self._committed(stream, uncertain)
        self._judge_state(stream, state, "read by the recovering worker")
        await self._settle_unsure(stream)
        await self._compare(stream, ATOMIC_RULE, "after the recovery")
        return session

    async def _settle_unsure(self, stream: _Stream) -> None:
        """Which events of an apply a crash interrupted did land: the destination says (each event
        of the battery's source has a key of its own)."""
        if not stream.unsure:
            return
        held = {row.get(KEY) for rows in (await self._places(stream)).values() for row in rows}
        stream.stored |= {identity for identity in stream.unsure if stream.applied[identity].get(KEY) in held}
        stream.unsure.clear()

    async def _read_state(self, stream: _Stream, session: _Session | None) -> SinkCommitState | None:
        """last_committed(), in ``session``'s worker or (None) in a new process of its own."""
        reader = None if session is not None else self._worker(f"{stream.plan.name}-reader", crashable=False)
        try:
            if reader is not None:
                session = await self._open(stream, reader, max(1, stream.token))
            assert session is not None
            try:
                state = await self._call(session, "last_committed", what="last_committed()")
            except _Refused as refused:
                raise Divergence(STATE_RULE, f"last_committed() raised {refused.error}") from None
        finally:
            if reader is not None:
                await reader.stop()
        assert state is None or isinstance(state, SinkCommitState)
        return state

    async def _check_state(self, stream: _Stream, session: _Session | None, how: str) -> None:
        self._judge_state(stream, await self._read_state(stream, session), how)

    def _judge_state(self, stream: _Stream, state: SinkCommitState | None, how: str) -> None:
        expected = stream.last_epoch
        if state is None or expected is None or state.epoch != expected:
            if state is None and expected is None:
                return
            if state is None and not self.caps.atomic_watermark:
                return  # a sink without a watermark may remember nothing
            raise Divergence(
                STATE_RULE,
                f"last_committed() ({how}) says {None if state is None else state.epoch}; the stream's last "
                f"committed epoch is {expected}",
            )
        found = {(p.domain.resource, p.domain.partition): p.value for p in state.watermarks}
        for lane in stream.lanes():
            name = (stream.plan.resources[lane[0]], str(lane[1]))
            mark = stream.marks[lane]
            stated = found.get(name)
            if mark and self.caps.atomic_watermark and stated != str(mark):
                raise Divergence(
                    STATE_RULE,
                    f"last_committed() ({how}) puts domain {name[0]!r}/{name[1]} at {stated}; the stream "
                    f"committed it up to position {mark}",
                )
            if stated is not None and int(stated) > mark:
                raise Divergence(
                    STATE_RULE,
                    f"last_committed() ({how}) puts domain {name[0]!r}/{name[1]} at {stated}, past what "
                    f"the stream committed there ({mark})",
                )
        self.trace.exercised.add("atomic_watermark" if self.caps.atomic_watermark else "last_committed()")

    def _check_receipts(
        self,
        stream: _Stream,
        active: _Active,
        receipts: Sequence[Receipt],
        expected: Mapping[int, tuple[int, int]],
    ) -> None:
        wanted = {stream.plan.resources[resource]: counts for resource, counts in expected.items()}
        seen: dict[str, Receipt] = {}
        for receipt in receipts:
            if receipt.resource in seen or receipt.resource not in wanted:
                raise Divergence(
                    RECEIPT_RULE,
                    f"commit_epoch({active.epoch}) returned a receipt for {receipt.resource!r} "
                    f"{'twice' if receipt.resource in seen else 'though the epoch wrote nothing there'}; it "
                    f"wrote {sorted(wanted)}",
                )
            seen[receipt.resource] = receipt
        for name, (written, skipped) in wanted.items():
            receipt = seen.get(name)
            if receipt is None:
                raise Divergence(
                    RECEIPT_RULE,
                    f"commit_epoch({active.epoch}) returned no receipt for resource {name!r}, where it applied "
                    f"{written + skipped} row(s)",
                )
            exact = (
                self.caps.atomic_watermark or self.caps.dedup_by_event_identity
            ) and receipt.rows_skipped != skipped
            counted = receipt.rows_written + receipt.rows_skipped
            if (
                exact
                or counted > written + skipped
                or (not stream.plan.policy.keyed and counted != written + skipped)
            ):
                raise Divergence(
                    RECEIPT_RULE,
                    f"the receipt of resource {name!r} for epoch {active.epoch} says {receipt.rows_written} "
                    f"written and {receipt.rows_skipped} skipped; the epoch applied {written + skipped} row(s) "
                    f"there, of which {skipped} were replays the destination held already",
                )
        self.trace.exercised.add("receipts per resource")

    async def _places(self, stream: _Stream) -> dict[str, list[dict[str, Any]]]:
        """What the destination holds now. A read blocked by a lock while no epoch of the stream is
        open is tried again a few times; a lock still held then outlives its epoch."""
        for attempt in range(5):
            try:
                if self.declared.per_resource:
                    return {name: await self.setup.read_resource(name) for name in stream.plan.resources}
                return {"*": await self.setup.read_back()}
            except ReadBlocked:
                if stream.active is not None or attempt == 4:
                    raise
        raise AssertionError("unreachable")

    async def _read_all(self, stream: _Stream) -> dict[str, list[str]]:
        return {place: sorted(map(repr, rows)) for place, rows in (await self._places(stream)).items()}

    async def _compare(self, stream: _Stream, rule: str, when: str) -> None:
        """The destination against the model: each resource of ``stream`` (or the one place where
        every resource of every stream lands)."""
        held = await self._places(stream)
        duplicates = self.declared.replay_duplicates == "at_least_once"
        transactional = self.declared.transactional
        if self.declared.per_resource:
            for resource, name in enumerate(stream.plan.resources):
                may = [] if transactional else _uncommitted(stream, resource)
                renamed = absent_columns(
                    name, held[name], stream.tables[resource].rows(), stream.columns[resource]
                )
                if renamed:
                    raise Divergence(NAME_RULE, f"{when}: {renamed}")
                problem = difference(
                    name,
                    held[name],
                    stream.tables[resource].rows(),
                    stream.columns[resource],
                    may=may,
                    duplicates_allowed=duplicates,
                )
                if problem:
                    raise Divergence(rule, f"{when}: {problem}")
            return
        must = [row for other in self.streams for table in other.tables.values() for row in table.rows()]
        may = (
            []
            if transactional
            else [row for other in self.streams for r in other.tables for row in _uncommitted(other, r)]
        )
        columns = sorted(
            {c for other in self.streams for cs in other.columns.values() for c in cs}, key=_column_order
        )
        renamed = absent_columns("(all resources)", held["*"], must, columns)
        if renamed:
            raise Divergence(NAME_RULE, f"{when}: {renamed}")
        problem = difference(
            "(all resources)", held["*"], must, columns, may=may, duplicates_allowed=duplicates
        )
        if problem:
            raise Divergence(rule, f"{when}: {problem}")

    def _batch(self, stream: _Stream, epoch: EpochId, lane: Lane, events: Sequence[_Event]) -> SinkBatch:
        resource = lane[0]
        fields = [pa.field(KEY, pa.int64(), nullable=False), pa.field("name", pa.string())]
        if stream.plan.policy is WritePolicy.VERSIONED_UPSERT:
            fields.append(pa.field(VERSION, pa.int64()))
        fields += [pa.field(column, pa.string()) for column in stream.columns[resource][len(fields) :]]
        rows = [dict(event.change.row) for event in events]
        if stream.plan.policy is WritePolicy.APPLY_CHANGES:
            fields.append(pa.field(OPERATION_COLUMN, pa.string()))
            for row, event in zip(rows, events, strict=True):
                row[OPERATION_COLUMN] = event.change.operation.value
        records = pa.RecordBatch.from_pylist(rows, schema=pa.schema(fields))
        identities = Identities([str(event.position) for event in events])
        return SinkBatch(epoch, stream.plan.resources[resource], stream.domain(lane), records, identities)


def _uncommitted(stream: _Stream, resource: int) -> list[Mapping[str, Any]]:
    """Rows of events applied and not committed (a destination without transactions may hold them)."""
    return [
        row
        for identity, row in stream.applied.items()
        if identity[0] == resource and identity not in stream.committed
    ]


def _column_order(column: str) -> tuple[int, str]:
    return ({KEY: 0, "name": 1, VERSION: 2}.get(column, 3), column)


def _held_keys(stream: _Stream, resource: int) -> list[int]:
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


__all__ = ["SinkRun"]
