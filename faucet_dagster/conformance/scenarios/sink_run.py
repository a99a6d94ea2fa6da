"""Running a streaming sink's scenario against the real destination, judged after every step.

The model (:mod:`.sink_model`) holds what the battery's source produced, what the runner certified,
what the sink committed (its watermark per domain, its last epoch) and so what each resource must
hold; the oracle (:mod:`.sink_oracle`) reads the destination back after each step and compares it, and
so the receipts of every commit and what ``last_committed()`` reads back, in the sink's own worker and
in other processes. A crash leaves one epoch uncertain: the recovering worker reads
``last_committed()``, the model takes the outcome it reports, and the destination must agree (all of
the epoch or none of it at a transactional sink).
"""

import time
from collections.abc import Sequence
from typing import Any

from faucet_dagster.conformance.scenarios import identifiers
from faucet_dagster.conformance.scenarios import sink_steps as steps
from faucet_dagster.conformance.scenarios.engine import Divergence, Step, Trace
from faucet_dagster.conformance.scenarios.sink_model import (
    ATOMIC_RULE,
    FENCING_RULE,
    NAME_RULE,
    POLICY_RULE,
    STATE_RULE,
    VISIBILITY_RULE,
    WORKS_RULE,
    Active,
    Event,
    Lane,
    Session,
    Stream,
    held_keys,
)
from faucet_dagster.conformance.scenarios.sink_oracle import SinkOracle
from faucet_dagster.conformance.scenarios.sink_steps import SinkDeclaration
from faucet_dagster.conformance.scenarios.tables import KEY, VERSION, Change, TableModel
from faucet_dagster.conformance.scenarios.workers import Crashed, Failed, Worker
from faucet_dagster.conformance.setup import ReadBlocked
from faucet_dagster.protocol import (
    ConfigError,
    Coverage,
    DataError,
    DomainCoverage,
    EpochId,
    LifecycleError,
    Operation,
    OwnershipLost,
    Role,
    SchemaError,
    SinkCommitState,
    UncertainOutcome,
    WorkerIdentity,
    WritePolicy,
)


class _Refused(Exception):
    """A call failed in the worker: ``error`` is its exception, ``what`` the call."""

    def __init__(self, failed: Failed, what: str) -> None:
        super().__init__(what)
        self.error = failed.error
        self.what = what


class SinkRun(SinkOracle):
    """One scenario's run: the model, the worker processes, and the oracle."""

    role = Role.STREAMING_SINK
    works_rule = WORKS_RULE

    def __init__(self, subject: Any, setup: Any, declared: SinkDeclaration, trace: Trace) -> None:
        super().__init__(subject, setup, declared, trace)
        self.keys = 0

    async def _step(self, step: Step) -> None:
        try:
            await super()._step(step)
        except _Refused as refused:
            raise Divergence(WORKS_RULE, f"{refused.what} raised {refused.error}") from None

    # -- workers ----------------------------------------------------------------------------------

    async def _open(self, stream: Stream, worker: Worker, token: int) -> Session:
        identity = WorkerIdentity(f"battery-{stream.plan.name}-{token}", token)
        plan = stream.plan
        try:
            sink = await worker.build(self.setup.config)
            handle = await worker.call(sink, "open", plan.name, plan.policy, plan.key, identity)
        except Failed as failed:
            raise _Refused(
                failed, f"open({plan.name!r}, {plan.policy.value}, key {list(plan.key)})"
            ) from None
        return Session(worker, handle, token)

    async def _call(
        self, session: Session, method: str, *args: Any, what: str, crash_at: int | None = None
    ) -> Any:
        try:
            return await session.worker.call(session.handle, method, *args, crash_at=crash_at)
        except Failed as failed:
            raise _Refused(failed, what) from None

    # -- the cast and the source ------------------------------------------------------------------

    async def _cast(self, cast: steps.Cast) -> None:
        for index, plan in enumerate(cast.streams):
            stream = Stream(index, plan)
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

    def _produce_events(self, stream: Stream, lane: Lane, operations: Sequence[str]) -> None:
        """Append events to the lane's log; an operation on a key the source does not hold (a step
        dropped while shrinking) becomes an insert."""
        keys = held_keys(stream, lane[0])
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
                Event(
                    lane, len(log) + 1, Change(operation, self._row(stream, lane[0], key, version, operation))
                )
            )

    def _row(
        self, stream: Stream, resource: int, key: int, version: int, operation: Operation
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
        active = Active(epoch, session, dict(stream.marks))
        stream.active = active
        if not await self._lifecycle(stream, "begin_epoch", epoch, what=f"begin_epoch({epoch})"):
            return

    async def _lifecycle(self, stream: Stream, method: str, *args: Any, what: str) -> bool:
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
        batch = stream.batch(active.epoch, lane, events)
        self._applying(stream, active, events)
        active.applied.append((lane, start, start + len(events)))
        stream.cursor[lane] = start + len(events)
        try:
            if not await self._lifecycle(stream, "apply", active.epoch, batch, what=f"apply({active.epoch})"):
                return
            self._applied(stream, events)
        except _Refused as refused:
            if await self._new_columns_refused(stream, refused):
                return
            raise
        if self.declared.transactional and look:
            try:
                await self._compare(
                    stream, VISIBILITY_RULE, f"after apply({active.epoch}), before its commit"
                )
            except ReadBlocked:
                self.trace.note("a reader waits for the epoch's lock: it sees nothing of it")

    def _applying(self, stream: Stream, active: Active, events: Sequence[Event]) -> None:
        """Before ``events`` are applied: which a deduplicating destination holds already (and so
        suppresses), except those first applied longer ago than its window, which it stores again."""
        now = time.monotonic()
        window = self.caps.dedup_window.total_seconds() if self.caps.dedup_window else None
        for event in events:
            first = stream.first_applied.setdefault(event.identity, now)
            if window is not None and now - first > 0.9 * window:
                stream.late.append((event.identity, event.change.row))
            elif event.identity in stream.stored:
                active.repeated.add(event.identity)
            stream.applied.setdefault(event.identity, event.change.row)

    def _applied(self, stream: Stream, events: Sequence[Event]) -> None:
        if not self.declared.transactional:
            stream.stored |= {event.identity for event in events}

    async def _new_columns_refused(self, stream: Stream, refused: _Refused) -> bool:
        """A batch bringing a column the sink does not take may be refused (SchemaError, a
        DataError or ConfigError naming it), never dropped or renamed: a sink without schema
        evolution may refuse every new column, one with it only a name past its limit
        (:data:`~.identifiers.TOO_LONG`). The epoch is aborted and those columns leave the model, as
        if the source dropped them."""
        if not refused.error.is_a(SchemaError, DataError, ConfigError):
            return False
        base = stream.base_columns()
        dropped = {
            resource: [
                c for c in columns[base:] if not self.caps.schema_evolution or c == identifiers.TOO_LONG
            ]
            for resource, columns in stream.columns.items()
        }
        dropped = {resource: names for resource, names in dropped.items() if names}
        if not dropped:
            added = {stream.plan.resources[r]: c[base:] for r, c in stream.columns.items() if c[base:]}
            if added:
                raise Divergence(
                    NAME_RULE,
                    f"schema evolution is declared, but a batch with the new columns {added} was refused "
                    f"(names within the destination's limits land as given): {refused.error}",
                )
            return False
        self.trace.note(f"refused ({refused.error.kind}): the columns {list(dropped.values())} are dropped")
        for resource, names in dropped.items():
            stream.columns[resource] = [c for c in stream.columns[resource] if c not in names]
            for lane, events in stream.log.items():
                if lane[0] == resource:
                    for number, event in enumerate(events):
                        row = {k: v for k, v in event.change.row.items() if k not in names}
                        events[number] = Event(
                            event.lane, event.position, Change(event.change.operation, row)
                        )
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
                stream.coverage(active),
                what=what,
                crash_at=crash_at,
            )
        except Crashed:
            await self._crashed(stream)
            return
        except _Refused as refused:
            if await self._new_columns_refused(stream, refused):
                return
            raise
        stream.active = None
        self._check_receipts(stream, active, receipts, stream.commit(active, self.caps))
        if step.certify:
            stream.certify(active)
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

    async def _abort_active(self, stream: Stream) -> None:
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

    async def _crashed(self, stream: Stream, *, recover: bool = True) -> None:
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

    def _lost(self, stream: Stream) -> None:
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
                    await zombie.worker.call(zombie.handle, "apply", epoch, stream.batch(epoch, lane, events))
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
                f"owner fencing is declared, but epoch {epoch} of a worker whose fencing token "
                f"{zombie.token} was superseded by {stream.token} committed",
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
            active = stream.active = Active(
                EpochId(stream.plan.name, stream.certified_sequence + 1, session.token),
                session,
                dict(stream.marks),
            )
            calls: list[tuple[str, tuple[Any, ...]]] = [("begin_epoch", (active.epoch,))]
            for lane in stream.lanes():
                start, stop = stream.cursor[lane], len(stream.log[lane])
                if stop > start:
                    events = stream.log[lane][start:stop]
                    calls.append(("apply", (active.epoch, stream.batch(active.epoch, lane, events))))
                    active.applied.append((lane, start, stop))
                    stream.cursor[lane] = stop
                    self._applying(stream, active, events)
            calls.append(("commit_epoch", (active.epoch, stream.coverage(active))))
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
            self._check_receipts(stream, active, receipts or (), stream.commit(active, self.caps))
            stream.certify(active)
            await self._compare(stream, POLICY_RULE, f"after the sweep's epoch completed ({made} effects)")
            self.trace.note(f"{point} crash points, then it completed")
            return
        raise Divergence(WORKS_RULE, "an epoch of a few rows made more than 256 effects")

    # -- the model --------------------------------------------------------------------------------

    # -- recovery and the oracle ------------------------------------------------------------------

    async def _session(self, stream: Stream) -> Session:
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
                stream.commit(uncertain, self.caps)
        self._judge_state(stream, state, "read by the recovering worker")
        await self._settle_unsure(stream)
        await self._compare(stream, ATOMIC_RULE, "after the recovery")
        return session

    async def _read_state(self, stream: Stream, session: Session | None) -> SinkCommitState | None:
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

    async def _check_state(self, stream: Stream, session: Session | None, how: str) -> None:
        self._judge_state(stream, await self._read_state(stream, session), how)


__all__ = ["SinkRun"]
