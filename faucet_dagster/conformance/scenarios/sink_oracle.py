"""The oracle of a streaming sink's scenario: the destination, the receipts and ``last_committed()``
against the model (:mod:`.sink_model`), each difference in words with the rule it breaks."""

from collections.abc import Mapping, Sequence
from typing import Any

from faucet_dagster.conformance.scenarios.engine import Divergence, Trace
from faucet_dagster.conformance.scenarios.runs import WorkerRun
from faucet_dagster.conformance.scenarios.sink_model import (
    NAME_RULE,
    RECEIPT_RULE,
    STATE_RULE,
    Active,
    Stream,
    column_order,
    uncommitted,
)
from faucet_dagster.conformance.scenarios.sink_steps import SinkDeclaration
from faucet_dagster.conformance.scenarios.tables import KEY, absent_columns, difference
from faucet_dagster.conformance.setup import ReadBlocked
from faucet_dagster.protocol import Receipt, SinkCommitState


class SinkOracle(WorkerRun):
    """What a run compares after each step; the run (:class:`.sink_run.SinkRun`) drives the steps."""

    def __init__(self, subject: Any, setup: Any, declared: SinkDeclaration, trace: Trace) -> None:
        super().__init__(subject, setup, trace)
        self.declared = declared
        self.caps = declared.capabilities
        self.streams: list[Stream] = []

    async def _settle_unsure(self, stream: Stream) -> None:
        """Which events of an apply a crash interrupted did land: the destination says (each event
        of the battery's source has a key of its own)."""
        if not stream.unsure:
            return
        held = {row.get(KEY) for rows in (await self._places(stream)).values() for row in rows}
        stream.stored |= {identity for identity in stream.unsure if stream.applied[identity].get(KEY) in held}
        stream.unsure.clear()

    def _judge_state(self, stream: Stream, state: SinkCommitState | None, how: str) -> None:
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
        stream: Stream,
        active: Active,
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
            found = seen.get(name)
            if found is None:
                raise Divergence(
                    RECEIPT_RULE,
                    f"commit_epoch({active.epoch}) returned no receipt for resource {name!r}, where it "
                    f"applied {written + skipped} row(s)",
                )
            receipt = found
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
                    f"written and {receipt.rows_skipped} skipped; the epoch applied {written + skipped} "
                    f"row(s) there, of which {skipped} were replays the destination held already",
                )
        self.trace.exercised.add("receipts per resource")

    async def _places(self, stream: Stream) -> dict[str, list[dict[str, Any]]]:
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

    async def _read_all(self, stream: Stream) -> dict[str, list[str]]:
        return {place: sorted(map(repr, rows)) for place, rows in (await self._places(stream)).items()}

    async def _compare(self, stream: Stream, rule: str, when: str) -> None:
        """The destination against the model: each resource of ``stream`` (or the one place where
        every resource of every stream lands)."""
        held = await self._places(stream)
        duplicates = self.declared.replay_duplicates == "at_least_once"
        transactional = self.declared.transactional
        if self.declared.per_resource:
            for resource, name in enumerate(stream.plan.resources):
                may = [] if transactional else uncommitted(stream, resource)
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
            else [row for other in self.streams for r in other.tables for row in uncommitted(other, r)]
        )
        columns = sorted(
            {c for other in self.streams for cs in other.columns.values() for c in cs}, key=column_order
        )
        renamed = absent_columns("(all resources)", held["*"], must, columns)
        if renamed:
            raise Divergence(NAME_RULE, f"{when}: {renamed}")
        problem = difference(
            "(all resources)", held["*"], must, columns, may=may, duplicates_allowed=duplicates
        )
        if problem:
            raise Divergence(rule, f"{when}: {problem}")


__all__ = ["SinkOracle"]
