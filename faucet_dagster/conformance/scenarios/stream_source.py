"""The scenarios of a stream source: epochs read, certified, acknowledged, crashed and resumed.

The battery plays the provider's writers (rows added in source transactions, changed and deleted
where the source emits changes), the runner (epochs read with record limits drawn from the seed,
sealed by the real pipeline, certified or not: a crash between the commit and the certificate;
acknowledged with the authority of the owner, or of a worker that lost the stream) and the operator
(retention purging rows nobody read, the stream or topic deleted and created again).

The model is the provider's log, per ordering domain (``SourceSetup.domain_of`` says which domain a
row lands in): every epoch must certify exactly the next changes of each domain, in order, whole
source transactions only; a change delivered again (after a crash, by another worker with another
fencing token) keeps its event identity; the provider's acknowledgement state (``acknowledged()``)
moves only inside ``acknowledge``, after the authority was asked, and never when the authority says
the stream was lost; a resume position that retention removed, or that belongs to a previous
incarnation, is refused at open (PositionUnavailable, IncarnationChanged), never replaced by the
latest position.
"""

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from faucet_dagster.conformance.harness import advance
from faucet_dagster.conformance.scenarios.agent import Acknowledged, EpochRead, Event, Handle
from faucet_dagster.conformance.scenarios.engine import Divergence, Trace
from faucet_dagster.conformance.scenarios.runs import WorkerRun
from faucet_dagster.conformance.scenarios.stream_source_steps import (
    IDENTITY_RULE,
    INCARNATION_RULE,
    ORDER_RULE,
    OWNERSHIP_RULE,
    SPECULATIVE_RULE,
    TRANSACTION_RULE,
    UNAVAILABLE_RULE,
    UNWRITTEN_RULE,
    WORKS_RULE,
    Acknowledge,
    Add,
    Cast,
    Change,
    Close,
    Crash,
    Drain,
    Purge,
    Read,
    Recreate,
    StreamSourceDeclaration,
    Takeover,
    declaration,
    generate,
)
from faucet_dagster.conformance.scenarios.workers import Crashed, Failed, Worker
from faucet_dagster.conformance.setup import make_rows
from faucet_dagster.protocol import (
    OPERATION_COLUMN,
    Coverage,
    EpochId,
    IncarnationChanged,
    IntegrityError,
    Membership,
    OwnershipLost,
    Position,
    PositionUnavailable,
    ReadLimits,
    Role,
    WorkerIdentity,
)


@dataclass(frozen=True)
class _Change:
    """One change of the provider's log: its row, its operation, its transaction."""

    key: tuple[int, str, str]
    """id, operation, name: what identifies the change across deliveries."""
    transaction: int
    lane: str


@dataclass
class _Session:
    worker: Worker
    handle: Handle
    token: int


@dataclass
class _Model:
    log: dict[str, list[_Change]] = field(default_factory=dict)
    """Per lane (a ``domain_of`` label, or ``*``), the changes in provider order."""
    certified_count: dict[str, int] = field(default_factory=dict)
    lane_of_domain: dict[tuple[str, str, str], str] = field(default_factory=dict)
    identities: dict[tuple[int, str, str], tuple[tuple[str, str, str], str, int]] = field(
        default_factory=dict
    )
    transactions: dict[int, int] = field(default_factory=dict)
    """Transaction number -> its number of changes."""


class StreamSourceRun(WorkerRun):
    role = Role.STREAM_SOURCE
    works_rule = WORKS_RULE

    def __init__(self, subject: Any, setup: Any, declared: StreamSourceDeclaration, trace: Trace) -> None:
        super().__init__(subject, setup, trace)
        self.declared = declared
        self.model = _Model()
        self.rows: dict[int, str] = {}
        """The provider's rows now: id -> name."""
        self.next_id = 1
        self.transactions = 0
        self.session: _Session | None = None
        self.token = 0
        self.sequence = 0
        self.certified: tuple[Position, ...] = ()
        self.pending: list[Coverage] = []
        """Certified coverages not yet acknowledged."""
        self.crash_at: int | None = None
        self.domain_of: Callable[[dict[str, Any]], str] | None = setup.domain_of

    # -- the provider -----------------------------------------------------------------------------

    async def _cast(self, step: Cast) -> None:
        self.trace.exercised.add("epochs certified and acknowledged")
        if self.declared.transactions:
            self.trace.exercised.add("transaction_boundaries")

    def _log(self, rows: Sequence[dict[str, Any]], operation: str) -> None:
        self.transactions += 1
        self.model.transactions[self.transactions] = len(rows)
        for row in rows:
            lane = self.domain_of(dict(row)) if self.domain_of is not None else "*"
            name = "" if operation == "delete" else str(row["name"])  # a delete may carry only its key
            change = _Change((int(row["id"]), operation, name), self.transactions, lane)
            self.model.log.setdefault(lane, []).append(change)
            self.model.certified_count.setdefault(lane, 0)

    async def _add(self, step: Add) -> None:
        rows = make_rows(self.next_id, step.count)
        self.next_id += step.count
        for row in rows:
            self.rows[int(row["id"])] = str(row["name"])
        self._log(rows, "insert")
        await self.setup.add_rows(rows)

    async def _change(self, step: Change) -> None:
        ids = sorted(self.rows)
        if not ids:
            self.trace.note("skipped: no rows")
            return
        chosen = sorted({ids[pick % len(ids)] for pick in step.picks})
        self.trace.exercised.add("updates and deletes")
        if step.delete:
            rows = [{"id": i, "name": self.rows.pop(i)} for i in chosen]
            self._log(rows, "delete")
            await self.setup.delete_rows(rows)
        else:
            rows = [{"id": i, "name": f"row-{i}-v{self.transactions}"} for i in chosen]
            for i, row in zip(chosen, rows, strict=True):
                self.rows[i] = str(row["name"])
            self._log(rows, "update")
            await self.setup.update_rows(rows)

    # -- sessions ---------------------------------------------------------------------------------

    async def _open(self, positions: tuple[Position, ...] | None = None) -> _Session:
        if self.session is not None:
            return self.session
        self.token += 1
        worker = self._worker("stream-source")
        identity = WorkerIdentity(f"battery-worker-{self.token}", self.token)
        resume = self.certified if positions is None else positions
        try:
            source = await worker.build(self.setup.config)
            handle = await worker.call(source, "open", self.setup.resources, resume, Membership(), identity)
        except Failed as failed:
            await worker.stop()
            if failed.error.is_a(PositionUnavailable, IncarnationChanged):
                raise _Refused(failed) from None
            raise Divergence(WORKS_RULE, f"open at {_positions(resume)} raised {failed.error}") from None
        self.session = _Session(worker, handle, self.token)
        # What the old session certified and did not acknowledge is the new session's to suppress.
        self.pending.clear()
        return self.session

    def _drop(self) -> None:
        if self.session is not None:
            self.session.worker.kill()
        self.session = None

    async def _acked(self) -> str | None:
        return await self.setup.acknowledged() if self.declared.acknowledged else None

    # -- epochs -----------------------------------------------------------------------------------

    async def _read(self, step: Read) -> None:
        await self._epoch(step.records, certify=step.certify, acknowledge=step.acknowledge)

    async def _epoch(self, records: int | None, *, certify: bool = True, acknowledge: bool = True) -> int:
        """One epoch; the number of changes it certified."""
        try:
            session = await self._open()
        except _Refused as refused:
            raise Divergence(
                WORKS_RULE,
                f"open at the certified positions {_positions(self.certified)}, where nothing was removed, "
                f"raised {refused.error}",
            ) from None
        before = await self._acked()
        self.sequence += 1
        epoch = EpochId("conformance", self.sequence, session.token)
        limits = ReadLimits(records=records, bytes=None, idle=0.3, age=None)
        crash_at, self.crash_at = self.crash_at, None
        try:
            read = await session.worker.request(
                "read_epoch", session.handle, epoch, self.certified, limits, None, crash_at=crash_at
            )
        except Crashed:
            self.trace.note("the worker died")
            self._drop()
            return 0
        except Failed as failed:
            if failed.error.is_a(IntegrityError):
                raise Divergence(
                    UNWRITTEN_RULE,
                    f"the source vouched for a position whose row had not reached the pipeline, or gave "
                    f"a boundary ahead of its rows (the pipeline refused to seal: {failed.error})",
                ) from None
            raise Divergence(WORKS_RULE, f"read() raised {failed.error}") from None
        assert isinstance(read, EpochRead)
        if self.declared.acknowledged and await self._acked() != before:
            raise Divergence(
                SPECULATIVE_RULE,
                f"the provider's acknowledgement moved from {before!r} to {await self._acked()!r} during a "
                "read, before any acknowledge(): progress not certified was acknowledged",
            )
        self._judge(read)
        if not certify:
            self._drop()
            self.trace.exercised.add("replay by another worker after a crash before the certificate")
            return 0
        self.certified = advance(self.certified, read.coverage)
        for event in read.events:
            self.model.certified_count[self._lane(event)] += 1
        if not read.coverage.empty:
            self.pending.append(read.coverage)
        self.trace.note(f"{len(read.events)} change(s)")
        if acknowledge:
            await self._acknowledge(Acknowledge())
        return len(read.events)

    def _lane(self, event: Event) -> str:
        return self.model.lane_of_domain[_lineage(event)]

    def _judge(self, read: EpochRead) -> None:
        """The epoch's events against the log: per lane the next changes, in order, whole
        transactions, identities as before."""
        model = self.model
        by_lane: dict[str, list[tuple[Event, tuple[int, str, str]]]] = {}
        for event in read.events:
            key = _change_key(event)
            lane = self.domain_of(dict(event.row)) if self.domain_of is not None else "*"
            known = model.lane_of_domain.setdefault(_lineage(event), lane)
            if known != lane:
                raise Divergence(
                    ORDER_RULE, f"domain {event.domain} holds rows of two lanes ({known}, {lane})"
                )
            by_lane.setdefault(lane, []).append((event, key))
            identity = (_lineage(event), event.position, event.ordinal)
            seen = model.identities.setdefault(key, identity)
            if seen != identity:
                raise Divergence(
                    IDENTITY_RULE,
                    f"the change {key} was delivered as {identity[1]}#{identity[2]} in {event.domain}, "
                    f"before as {seen[1]}#{seen[2]}: an identity is built from the source position, never "
                    "the worker, lease or attempt, or a deduplicating sink takes a replay for new events",
                )
        counts: dict[int, int] = {}
        for lane, events in by_lane.items():
            start = model.certified_count.get(lane, 0)
            log = model.log.get(lane, [])
            expected = log[start : start + len(events)]
            got = [key for _, key in events]
            if [change.key for change in expected] != got:
                twice = [key for key in got if key in {c.key for c in log[:start]}]
                skipped = [c.key[0] for c in log[start:] if c.key not in got][: len(got)]
                raise Divergence(
                    ORDER_RULE,
                    f"an epoch certified {len(got)} change(s) of lane {lane} starting with {got[:3]}; the "
                    f"next changes of the log are {[c.key for c in expected][:3]}"
                    + (f" (certified again: {twice[:3]})" if twice else "")
                    + (f" (ids skipped: {skipped[:5]})" if skipped and not twice else ""),
                )
            for change in expected:
                counts[change.transaction] = counts.get(change.transaction, 0) + 1
        if self.declared.transactions:
            for transaction, count in counts.items():
                done = sum(
                    1
                    for lane, log in model.log.items()
                    for change in log[: model.certified_count.get(lane, 0)]
                    if change.transaction == transaction
                )
                if done + count != model.transactions[transaction]:
                    raise Divergence(
                        TRANSACTION_RULE,
                        f"an epoch certified {count} of the {model.transactions[transaction]} changes of one "
                        f"source transaction (with {done} certified before): its coverage ends inside it",
                    )

    async def _acknowledge(self, step: Acknowledge) -> None:
        session = self.session
        if session is None or not self.pending:
            self.trace.note("skipped: nothing certified to acknowledge")
            return
        self.trace.exercised.add("acknowledge after authority()")
        for coverage in list(self.pending):
            before = await self._acked()
            result = await self._ack(session, coverage, lost=False)
            if result is None:
                return
            if result.error is not None:
                raise Divergence(WORKS_RULE, f"acknowledge() with the stream owned raised {result.error}")
            if result.asked == 0:
                raise Divergence(
                    OWNERSHIP_RULE, "acknowledge() never awaited authority() before acknowledging"
                )
            self.pending.remove(coverage)
            del before

    async def _ack(self, session: _Session, coverage: Coverage, *, lost: bool) -> Acknowledged | None:
        crash_at, self.crash_at = self.crash_at, None
        try:
            result = await session.worker.request(
                "acknowledge", session.handle, coverage, lost, crash_at=crash_at
            )
        except Crashed:
            self.trace.note("the worker died")
            self._drop()
            return None
        except Failed as failed:
            raise Divergence(WORKS_RULE, f"acknowledge() raised {failed.error}") from None
        assert isinstance(result, Acknowledged)
        return result

    async def _close(self, step: Close) -> None:
        session = self.session
        if session is None:
            self.trace.note("skipped: no session")
            return
        before = await self._acked()
        try:
            await session.worker.call(session.handle, "close")
        except Failed as failed:
            raise Divergence(WORKS_RULE, f"close() raised {failed.error}") from None
        finally:
            self._drop()
        if self.declared.acknowledged and await self._acked() != before:
            raise Divergence(
                SPECULATIVE_RULE,
                f"closing the session moved the provider's acknowledgement from {before!r} to "
                f"{await self._acked()!r}: only acknowledge() acknowledges",
            )

    async def _crash(self, step: Crash) -> None:
        self.trace.exercised.add("crashes in a worker process")
        if step.at_effect is not None:
            self.crash_at = step.at_effect
            return
        self._drop()

    async def _takeover(self, step: Takeover) -> None:
        old = self.session
        pending = list(self.pending)
        self.session = None
        await self._open()
        self.trace.exercised.add("takeover by a newer fencing token")
        if old is None or not pending:
            if old is not None:
                old.worker.kill()
            return
        before = await self._acked()
        result = await self._ack(old, pending[0], lost=True)
        old.worker.kill()
        if result is None:
            return
        if result.error is None or not result.error.is_a(OwnershipLost):
            outcome = "returned" if result.error is None else f"raised {result.error}"
            raise Divergence(
                OWNERSHIP_RULE,
                f"the old worker's acknowledge() {outcome} "
                "although authority() raised OwnershipLost: it must stop and propagate it",
            )
        if result.asked == 0:
            raise Divergence(OWNERSHIP_RULE, "acknowledge() never awaited authority() before acknowledging")
        if self.declared.acknowledged and await self._acked() != before:
            raise Divergence(
                OWNERSHIP_RULE,
                "an acknowledge() whose authority() raised OwnershipLost moved the provider's "
                "acknowledgement",
            )

    async def _drain(self, step: Drain) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while any(len(log) > self.model.certified_count.get(lane, 0) for lane, log in self.model.log.items()):
            if loop.time() > deadline:
                missing = {
                    lane: [c.key[0] for c in log[self.model.certified_count.get(lane, 0) :]][:6]
                    for lane, log in self.model.log.items()
                    if len(log) > self.model.certified_count.get(lane, 0)
                }
                raise Divergence(
                    ORDER_RULE, f"changes never certified after {self.timeout:g}s of epochs: ids {missing}"
                )
            await self._epoch(None)

    async def _purge(self, step: Purge) -> None:
        self.trace.exercised.add("rows removed under a reader (retention)")
        self._drop()
        unread = any(
            len(log) > self.model.certified_count.get(lane, 0) for lane, log in self.model.log.items()
        )
        await self.setup.make_unavailable()
        try:
            await self._open()
        except _Refused as refused:
            if not unread or not refused.error.is_a(PositionUnavailable):
                raise Divergence(UNAVAILABLE_RULE, f"open after a purge raised {refused.error}") from None
            self.trace.note(f"refused: {refused.error.kind}")
            return
        if unread:
            raise Divergence(
                UNAVAILABLE_RULE,
                "rows after the certified position were removed before they were read, and open() at that "
                "position did not raise PositionUnavailable (the removed rows are lost; the latest position "
                "must never replace an unavailable one)",
            )
        self._reset(keep_positions=True)

    async def _recreate(self, step: Recreate) -> None:
        self.trace.exercised.add("the source re-created")
        self._drop()
        await self.setup.recreate()
        self._reset(keep_positions=True)
        old = self.certified
        try:
            await self._open()
        except _Refused as refused:
            self.trace.note(f"refused: {refused.error.kind}")
            self._reset()
            return
        if old:
            raise Divergence(
                INCARNATION_RULE,
                f"the source was deleted and created again, and open() at {_positions(old)} (positions of "
                "the old incarnation) did not raise IncarnationChanged or PositionUnavailable",
            )

    def _reset(self, *, keep_positions: bool = False) -> None:
        """What was removed is gone: the model forgets it (an operator accepted the loss)."""
        self.model = _Model()
        self.pending.clear()
        if not keep_positions:
            self.certified = ()
            self._drop()


class _Refused(Exception):
    def __init__(self, failed: Failed) -> None:
        super().__init__(str(failed.error))
        self.error = failed.error


def _lineage(event: Event) -> tuple[str, str, str]:
    lineage: tuple[str, str, str] = event.domain.lineage
    return lineage


def _change_key(event: Event) -> tuple[int, str, str]:
    row = event.row
    operation = str(row.get(OPERATION_COLUMN) or "insert")
    return (int(row["id"]), operation, "" if operation == "delete" else str(row.get("name")))


def _positions(positions: Sequence[Position]) -> str:
    return ", ".join(f"{p.domain.resource}/{p.domain.partition}@{p.value}" for p in positions) or "(none)"


__all__ = ["StreamSourceDeclaration", "StreamSourceRun", "declaration", "generate"]
