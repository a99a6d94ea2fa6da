"""The scenarios of a bounded sink: runs of a sync, crashed and rerun, judged after each.

The battery plays a deterministic source (pages of rows, the same on every read) and the bounded
runner: a *run* writes the pages the sink has not committed (asking ``last_committed_token()`` when
the sink keeps an atomic watermark; else from the last completed run: at-least-once), one
``write_batch_idempotent`` (or ``write_batch``) per page, then ``flush``, ``finish`` and ``close``,
in a worker process of its own. A run may die at any effect (:mod:`.effects`): between two commits
made inside one synchronous call too. After each run a second process reads the commit token, and
the destination is read back and compared with the model (:mod:`.tables`): for a watermark sink,
every page exactly once, the rows of a page present exactly when its token is; keyed policies
converge; REPLACE shows the last finished snapshot. A replayed page (a token not newer than the
stored one) writes nothing. Each policy the sink's configs declare gets a lane of its own (a table
named with a hostile identifier), and columns with hostile names are added where the sink declares
schema evolution.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from faucet_dagster.conformance.scenarios import identifiers
from faucet_dagster.conformance.scenarios.agent import Handle
from faucet_dagster.conformance.scenarios.bounded_sink_steps import (
    NAME_RULE,
    POLICY_RULE,
    REPLAY_RULE,
    TOKEN_RULE,
    WORKS_RULE,
    BoundedSinkDeclaration,
    Cast,
    Evolve,
    LanePlan,
    Produce,
    ReadToken,
    Replay,
    Run,
    Sweep,
)
from faucet_dagster.conformance.scenarios.engine import Divergence, Trace
from faucet_dagster.conformance.scenarios.runs import WorkerRun
from faucet_dagster.conformance.scenarios.tables import KEY, Change, TableModel, absent_columns, difference
from faucet_dagster.conformance.scenarios.workers import Crashed, Failed
from faucet_dagster.protocol import (
    OPERATION_COLUMN,
    AddColumn,
    CommitToken,
    Operation,
    Role,
    WritePolicy,
)


@dataclass
class _Lane:
    plan: LanePlan
    pages: list[list[Change]] = field(default_factory=list)
    committed: int = 0
    """Pages committed (for a watermark lane: the token's page; else the last finished run's)."""
    table: TableModel = field(init=False)
    snapshot: TableModel = field(init=False)
    """REPLACE: the snapshot the last finished run swapped in."""
    columns: list[str] = field(default_factory=lambda: [KEY, "name"])
    keys: list[int] = field(default_factory=list)
    duplicates: bool = False

    config: Mapping[str, Any] = field(default_factory=dict)
    """The lane's config against this run's setup."""
    feeder: Mapping[str, Any] | None = None
    """DELETE: the config that writes the rows its pages delete (an APPEND into the same table)."""

    def __post_init__(self) -> None:
        keyed = self.plan.dedups or self.plan.policy is WritePolicy.DELETE
        self.table = TableModel(WritePolicy.UPSERT if keyed else self.plan.policy)
        self.snapshot = TableModel(WritePolicy.APPEND)


class BoundedSinkRun(WorkerRun):
    role = Role.SINK
    works_rule = WORKS_RULE

    def __init__(self, subject: Any, setup: Any, declared: BoundedSinkDeclaration, trace: Trace) -> None:
        super().__init__(subject, setup, trace)
        self.declared = declared
        self.lanes: list[_Lane] = []
        self.next_key = 0

    async def _cast(self, step: Cast) -> None:
        write_to = self.setup.write_to
        self.lanes = [
            _Lane(
                plan,
                config=dict(
                    self.setup.config if write_to is None else write_to(plan.resource, plan.policy, plan.key)
                ),
                feeder=None
                if write_to is None or plan.policy is not WritePolicy.DELETE
                else dict(write_to(plan.resource, WritePolicy.APPEND, ())),
            )
            for plan in step.lanes
        ]
        for plan in step.lanes:
            self.trace.exercised.add(f"bounded policy {plan.policy.value}")
            if plan.idempotent:
                self.trace.exercised.add("atomic_watermark")

    async def _produce(self, step: Produce) -> None:
        lane = self.lanes[step.lane]
        if lane.plan.policy is WritePolicy.DELETE:
            await self._produce_deletes(lane, step.sizes)
            return
        keyed = lane.plan.policy.keyed or lane.plan.dedups
        for size in step.sizes:
            page: list[Change] = []
            for number in range(size):
                operation = Operation.INSERT
                if keyed and lane.keys and number % 2 == 1:
                    key = lane.keys[(number * 5 + len(lane.pages)) % len(lane.keys)]
                    if lane.plan.policy is WritePolicy.APPLY_CHANGES:
                        operation = Operation.UPDATE
                else:
                    self.next_key += 1
                    key = self.next_key
                    lane.keys.append(key)
                row: dict[str, Any] = {KEY: key, "name": f"p{len(lane.pages)}r{number}k{key}"}
                for column in lane.columns[2:]:
                    row[column] = f"{len(column)}:{key}"
                page.append(Change(operation, row))
            lane.pages.append(page)

    async def _produce_deletes(self, lane: _Lane, sizes: Sequence[int]) -> None:
        """DELETE: rows are written into the table first (through an APPEND config, in a process of
        its own), then pages of the keys to delete: every other row written, and a key never written."""
        assert lane.feeder is not None
        rows: list[dict[str, Any]] = []
        for size in sizes:
            page: list[Change] = []
            for number in range(size):
                self.next_key += 1
                row = {KEY: self.next_key, "name": f"d{self.next_key}"}
                rows.append(row)
                lane.table.apply(Change(Operation.INSERT, row))
                if number % 2 == 0:
                    page.append(Change(Operation.DELETE, row))
            self.next_key += 1
            page.append(Change(Operation.DELETE, {KEY: self.next_key, "name": "never written"}))
            lane.pages.append(page)
        worker = self._worker("bounded-sink", crashable=False)
        try:
            feeder = await worker.build(lane.feeder)
            await worker.call(
                feeder, "write_batch", self._batch(lane, [Change(Operation.INSERT, row) for row in rows])
            )
            await worker.call(feeder, "close")
        except Failed as failed:
            raise Divergence(
                WORKS_RULE, f"writing the rows to delete (append) raised {failed.error}"
            ) from None
        finally:
            await worker.stop()

    def _batch(self, lane: _Lane, page: Sequence[Change]) -> pa.RecordBatch:
        fields = [pa.field(KEY, pa.int64(), nullable=False), pa.field("name", pa.string())]
        fields += [pa.field(column, pa.string()) for column in lane.columns[2:]]
        rows = [dict(change.row) for change in page]
        if lane.plan.policy is WritePolicy.APPLY_CHANGES:
            fields.append(pa.field(OPERATION_COLUMN, pa.string()))
            for row, change in zip(rows, page, strict=True):
                row[OPERATION_COLUMN] = change.operation.value
        return pa.RecordBatch.from_pylist(rows, schema=pa.schema(fields))

    async def _run(self, step: Run) -> None:
        lane = self.lanes[step.lane]
        if step.crash_at is not None or step.before_close:
            self.trace.exercised.add("crashes in a worker process")
        finished = await self._one_run(lane, step.crash_at, before_close=step.before_close)
        if not finished:
            self.trace.note("the process died")
        await self._judge(lane, after_crash=not finished)

    async def _one_run(
        self, lane: _Lane, crash_at: int | None, *, before_close: bool = False, recovering: bool = False
    ) -> bool:
        """One run of the sync; False when its process died. The model follows what it committed.

        ``crash_at`` counts the effects of the page writes (what must be atomic with the token).
        ``recovering``: the previous run died; this one (a new process) judges the token it reads
        and the destination before it writes anything."""
        worker = self._worker("bounded-sink")
        made = 0

        async def call(handle: Handle, method: str, *args: Any) -> Any:
            nonlocal made
            armed = None
            if crash_at is not None and method in ("write_batch_idempotent", "write_batch"):
                armed = crash_at - made
            try:
                value = await worker.call(handle, method, *args, crash_at=armed)
            except Failed as failed:
                raise Divergence(WORKS_RULE, f"{method} raised {failed.error}") from None
            made += len(worker.effects) if armed is not None else 0
            return value

        plan = lane.plan
        try:
            try:
                sink = await worker.build(lane.config)
            except Failed as failed:
                raise Divergence(WORKS_RULE, f"building the sink raised {failed.error}") from None
            if plan.policy is WritePolicy.REPLACE:
                start = 0
            elif plan.idempotent:
                token = await call(sink, "last_committed_token")
                if recovering:
                    await self._judge_token(lane, token, after_crash=True)
                    await self._compare(lane, REPLAY_RULE, "after the crash")
                start = 0 if token is None else int(token.sequence)
            else:
                start = lane.committed
            for number in range(start, len(lane.pages)):
                batch = self._batch(lane, lane.pages[number])
                if plan.idempotent:
                    written = await call(sink, "write_batch_idempotent", batch, CommitToken(number + 1))
                    if written != batch.num_rows:
                        raise Divergence(
                            REPLAY_RULE,
                            f"write_batch_idempotent of page {number + 1} (token {number + 1}, newer than "
                            f"the stored one) wrote {written} of {batch.num_rows} rows",
                        )
                    self._commit_pages(lane, number + 1)
                else:
                    await call(sink, "write_batch", batch)
            await call(sink, "flush")
            await call(sink, "finish")
            if before_close:
                worker.kill()
                raise Crashed()
            await call(sink, "close")
        except Crashed:
            if not plan.idempotent and plan.policy is WritePolicy.APPEND:
                lane.duplicates = True  # at-least-once: the rerun writes again what the dead run wrote
            return False
        finally:
            await worker.stop()
        if not plan.idempotent:
            self._commit_pages(lane, len(lane.pages))
        return True

    def _commit_pages(self, lane: _Lane, through: int) -> None:
        """The model commits pages up to ``through`` (1-based)."""
        if lane.plan.policy is WritePolicy.REPLACE:
            lane.snapshot = TableModel(WritePolicy.APPEND)
            for page in lane.pages[:through]:
                for change in page:
                    lane.snapshot.apply(change)
            lane.committed = through
            return
        for page in lane.pages[lane.committed : through]:
            for change in page:
                lane.table.apply(change)
        lane.committed = max(lane.committed, through)

    async def _judge(self, lane: _Lane, *, after_crash: bool) -> None:
        """The token (read by another process) and the destination against the model."""
        plan = lane.plan
        if plan.idempotent and after_crash:
            await self._judge_token(lane, await self._read_token(lane), after_crash=True)
        if after_crash and not plan.idempotent:
            return  # at-least-once: what a dead run wrote shows after the rerun
        await self._compare(
            lane,
            REPLAY_RULE if after_crash else POLICY_RULE,
            "after the crash" if after_crash else "after the run",
        )

    async def _judge_token(self, lane: _Lane, token: CommitToken | None, *, after_crash: bool) -> None:
        """The token another process read against the model; after a crash the page whose write it
        interrupted may have committed, with its token (the destination must then hold it whole)."""
        stored = 0 if token is None else int(token.sequence)
        if after_crash and stored > lane.committed:
            self._commit_pages(lane, stored)
            self.trace.note(f"the token says page {stored} committed")
        if stored != lane.committed:
            raise Divergence(
                TOKEN_RULE if not after_crash else REPLAY_RULE,
                f"last_committed_token() read by another process is {token}; the pages committed end at "
                f"token {lane.committed}",
            )

    async def _compare(self, lane: _Lane, rule: str, when: str) -> None:
        held = await self._held(lane)
        must = lane.snapshot.rows() if lane.plan.policy is WritePolicy.REPLACE else lane.table.rows()
        renamed = absent_columns(lane.plan.resource, held, must, lane.columns)
        if renamed:
            raise Divergence(NAME_RULE, f"{when}: {renamed}")
        problem = difference(
            lane.plan.resource,
            held,
            must,
            lane.columns,
            duplicates_allowed=lane.duplicates and not lane.plan.dedups,
        )
        if problem:
            raise Divergence(rule, f"{when}: {problem}")

    async def _held(self, lane: _Lane) -> list[dict[str, Any]]:
        if self.declared.per_resource:
            return list(await self.setup.read_resource(lane.plan.resource))
        return list(await self.setup.read_back())

    async def _read_token(self, lane: _Lane) -> CommitToken | None:
        worker = self._worker("bounded-sink", crashable=False)
        try:
            sink = await worker.build(lane.config)
            token = await worker.call(sink, "last_committed_token")
            await worker.call(sink, "close")
        except Failed as failed:
            raise Divergence(TOKEN_RULE, f"last_committed_token() raised {failed.error}") from None
        finally:
            await worker.stop()
        assert token is None or isinstance(token, CommitToken)
        return token

    async def _readtoken(self, step: ReadToken) -> None:
        lane = self.lanes[step.lane]
        if not lane.plan.idempotent:
            self.trace.note("skipped: the lane has no watermark")
            return
        self.trace.exercised.add("last_committed_token() read by another process")
        token = await self._read_token(lane)
        if (0 if token is None else token.sequence) != lane.committed:
            raise Divergence(
                TOKEN_RULE,
                f"last_committed_token() read by another process is {token}; the last page committed "
                f"was written with token {lane.committed}",
            )

    async def _replay(self, step: Replay) -> None:
        lane = self.lanes[step.lane]
        if not lane.plan.idempotent or not lane.committed:
            self.trace.note("skipped: nothing committed with a token")
            return
        self.trace.exercised.add("replayed pages")
        page = self._batch(lane, lane.pages[lane.committed - 1])
        worker = self._worker("bounded-sink", crashable=False)
        try:
            sink = await worker.build(lane.config)
            for token in (lane.committed, lane.committed - 1):
                if token < 1:
                    continue
                written = await worker.call(sink, "write_batch_idempotent", page, CommitToken(token))
                if written:
                    raise Divergence(
                        REPLAY_RULE,
                        f"write_batch_idempotent of page {lane.committed} again with token {token} (not "
                        f"newer than the stored {lane.committed}) wrote {written} row(s): the commit token "
                        "must make "
                        "the replay a no-op",
                    )
            await worker.call(sink, "close")
        except Failed as failed:
            raise Divergence(WORKS_RULE, f"a replayed page raised {failed.error}") from None
        finally:
            await worker.stop()
        await self._compare(lane, REPLAY_RULE, "after the replayed page")

    async def _sweep(self, step: Sweep) -> None:
        """Runs killed before effect 0, 1, 2... of their page writes; each run after a crash is the
        recovery of the one before: it reads the token (a new process) and judges the destination
        before it writes the page again. Ends with a run that made fewer effects than its point."""
        lane = self.lanes[step.lane]
        self.trace.exercised.add("a crash at every effect of a run")
        crashed = False
        for point in range(256):
            if lane.committed == len(lane.pages):
                await self._produce(Produce(step.lane, (2,)))
            if await self._one_run(lane, point, recovering=crashed):
                await self._compare(lane, POLICY_RULE, "after the run")
                self.trace.note(f"{point} crash points, then it completed")
                return
            crashed = True
        raise Divergence(WORKS_RULE, "a run of one page made more than 256 effects")

    async def _evolve(self, step: Evolve) -> None:
        lane = self.lanes[step.lane]
        self.trace.exercised.add("schema_evolution (hostile column names)")
        worker = self._worker("bounded-sink", crashable=False)
        try:
            sink = await worker.build(lane.config)
            for _ in range(2):  # ADD COLUMN IF NOT EXISTS: repeating it is harmless
                await worker.call(sink, "evolve_schema", [AddColumn(step.column, pa.string())])
            await worker.call(sink, "close")
        except Failed as failed:
            if step.column == identifiers.TOO_LONG and failed.error.faucet:
                self.trace.note(f"refused ({failed.error.kind}): a name past the destination's limit")
                return
            raise Divergence(
                NAME_RULE,
                f"schema evolution is declared, but evolve_schema([{step.column!r}]) raised {failed.error}",
            ) from None
        finally:
            await worker.stop()
        lane.columns.append(step.column)


__all__ = ["BoundedSinkRun"]
