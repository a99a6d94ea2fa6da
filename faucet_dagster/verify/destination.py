"""The destination side of a verification: the rows a range of certified epochs re-read from the
source, compared with what the destination holds (through the sink's
:class:`~faucet_dagster.protocol.DestinationReader`).

Per resource, the replayed batches of a run of consecutive epochs become one
:class:`~faucet_dagster.protocol.ExpectedRows` (the rows in the order the sink was handed them, each
with its epoch and event identity, less the rows the destination refused into the dead-letter route),
and the reader answers with a :class:`~faucet_dagster.protocol.DestinationDiff`. Its differences
become findings of the epoch each row belongs to: a *missing*, *changed*, *duplicated*, *unexpected*
or *resurrected* row, with its position and the rows as JSON. A missing and an unexpected row of the
same epoch are paired as a *changed* row (the destination holds a row no event explains where the
event's row should be).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from faucet_dagster.protocol import (
    DestinationDiff,
    DestinationReader,
    EventIdentity,
    ExpectedRows,
    FaucetError,
    FoundRow,
    WritePolicy,
)
from faucet_dagster.protocol.json_values import json_record
from faucet_dagster.verify.results import Aspect, Finding, Outcome


@dataclass
class Comparison:
    """The findings per epoch of one comparison, and how many rows it compared."""

    findings: dict[int, list[Finding]] = field(default_factory=dict)
    compared: int = 0

    def add(self, sequence: int, finding: Finding) -> None:
        self.findings.setdefault(sequence, []).append(finding)


@dataclass(frozen=True)
class EpochRows:
    """One epoch's rows as the sink was handed them: batches per resource, with their identities."""

    sequence: int
    batches: Sequence[tuple[str, pa.RecordBatch, Sequence[EventIdentity | None]]]


def expected_rows(
    resource: str,
    epochs: Sequence[EpochRows],
    policy: WritePolicy,
    key: Sequence[str],
    latest: int,
    receipts: Mapping[int, Any],
    refused: Mapping[int, set[str]],
) -> ExpectedRows | None:
    """The :class:`ExpectedRows` of ``resource`` over ``epochs`` (None: they handed it nothing).
    ``refused`` names, per epoch, the event identities the destination refused (dead letters)."""
    tables: list[pa.Table] = []
    sequences: list[int] = []
    identities: list[EventIdentity | None] = []
    for epoch in epochs:
        gone = refused.get(epoch.sequence, set())
        for name, records, ids in epoch.batches:
            if name != resource:
                continue
            if gone:
                keep = [index for index, identity in enumerate(ids) if str(identity) not in gone]
                records = records.take(pa.array(keep, pa.int64()))
                ids = [ids[index] for index in keep]
            if records.num_rows:
                tables.append(pa.Table.from_batches([records]))
                sequences.extend([epoch.sequence] * records.num_rows)
                identities.extend(ids)
    if not tables:
        return None
    rows = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    return ExpectedRows(
        resource=resource,
        policy=policy,
        key=tuple(key),
        rows=rows,
        epochs=sequences,
        identities=identities,
        sequences=tuple(sorted({epoch.sequence for epoch in epochs})),
        latest=latest,
        receipts=receipts,
    )


async def compare(
    reader: DestinationReader, expected: ExpectedRows, limit: int, *, duplicates_allowed: bool = False
) -> Comparison:
    """Ask ``reader`` about ``expected`` and turn its answer into findings per epoch. With
    ``duplicates_allowed`` (an at-least-once plan), a row found more than once is what the plan
    promised, not a difference: it is counted, not a divergence."""
    result = Comparison()
    try:
        diff = await reader.compare(expected, limit=limit)
    except FaucetError as exc:
        for sequence in expected.sequences:
            result.add(
                sequence,
                Finding(
                    Aspect.DESTINATION,
                    Outcome.NOT_VERIFIABLE,
                    "not read",
                    expected.resource,
                    f"the destination could not be read: {exc}",
                ),
            )
        return result
    result.compared = diff.compared
    _classify(result, expected, diff, duplicates_allowed)
    return result


def _row(expected: ExpectedRows, index: int) -> dict[str, Any]:
    row: dict[str, Any] = expected.rows.slice(index, 1).to_pylist()[0]
    return row


def _show(row: Mapping[str, Any]) -> str:
    return json_record(dict(row))


def _at(expected: ExpectedRows, index: int) -> str:
    identity = expected.identities[index]
    return f"{expected.resource} @ {identity}" if identity is not None else f"{expected.resource} row {index}"


def _classify(
    result: Comparison, expected: ExpectedRows, diff: DestinationDiff, duplicates_allowed: bool
) -> None:
    diverged: set[int] = set()

    def add(index_epoch: int, kind: str, where: str, detail: str) -> None:
        diverged.add(index_epoch)
        result.add(index_epoch, Finding(Aspect.DESTINATION, Outcome.DIVERGED, kind, where, detail))

    missing = list(diff.missing)
    unexpected = list(diff.unexpected)
    if expected.policy is WritePolicy.APPEND:
        missing, unexpected = _pair(result, expected, missing, unexpected, diverged)
    for index in missing:
        add(
            expected.epochs[index],
            "missing row",
            _at(expected, index),
            f"the destination does not hold the row this event wrote: {_show(_row(expected, index))}",
        )
    for index, found in diff.changed:
        add(
            expected.epochs[index],
            "changed row",
            _at(expected, index),
            f"expected {_show(_row(expected, index))}, the destination holds {_show(found)}",
        )
    for index, extra in [] if duplicates_allowed else diff.duplicated:
        add(
            expected.epochs[index],
            "duplicated row",
            _at(expected, index),
            f"the destination holds {extra + 1} copies of the row this event wrote: "
            f"{_show(_row(expected, index))}",
        )
    copies = diff.total("duplicated") if duplicates_allowed else 0
    for index in diff.resurrected:
        add(
            expected.epochs[index],
            "resurrected row",
            _at(expected, index),
            "the key's last change deleted it, the destination still holds it: "
            + _show(_row(expected, index)),
        )
    last = expected.sequences[-1]
    for stray in unexpected:
        epoch = stray.epoch if stray.epoch in expected.sequences else last
        written = "" if stray.epoch is None else f" (the destination says epoch {stray.epoch} wrote it)"
        add(
            epoch,
            "unexpected row",
            expected.resource,
            f"no event of the range explains {_show(stray.row)}{written}",
        )
    hidden = {
        kind: diff.total(kind) - len(getattr(diff, kind))
        for kind in ("missing", "changed", "duplicated", "unexpected", "resurrected")
        if kind != "duplicated" or not duplicates_allowed
    }
    hidden = {kind: count for kind, count in hidden.items() if count > 0}
    if hidden:
        first = min(diverged, default=last)
        add(
            first,
            "more differences",
            expected.resource,
            "and more rows than listed: " + ", ".join(f"{count} {kind}" for kind, count in hidden.items()),
        )
    for reason in diff.unchecked:
        for sequence in expected.sequences:
            result.add(
                sequence,
                Finding(Aspect.DESTINATION, Outcome.NOT_VERIFIABLE, "not checked", expected.resource, reason),
            )
    counts: dict[int, int] = {}
    for sequence in expected.epochs:
        counts[sequence] = counts.get(sequence, 0) + 1
    notes = (
        f"; {diff.superseded} keyed rows a later epoch changed were not compared" if diff.superseded else ""
    )
    if copies:
        notes += f"; {copies} rows found more than once, as the at-least-once plan allows"
    for sequence in expected.sequences:
        if sequence not in diverged:
            result.add(
                sequence,
                Finding(
                    Aspect.DESTINATION,
                    Outcome.VERIFIED,
                    "rows present",
                    expected.resource,
                    f"{counts.get(sequence, 0)} rows at the destination as the "
                    f"{expected.policy.value} policy promises{notes}",
                ),
            )


def _pair(
    result: Comparison,
    expected: ExpectedRows,
    missing: list[int],
    unexpected: list[FoundRow],
    diverged: set[int],
) -> tuple[list[int], list[FoundRow]]:
    """APPEND: a missing row and an unexpected row the same epoch wrote are one changed row."""
    spare: dict[int | None, list[FoundRow]] = {}
    for found in unexpected:
        spare.setdefault(found.epoch, []).append(found)
    left: list[int] = []
    for index in missing:
        candidates = spare.get(expected.epochs[index])
        if not candidates:
            left.append(index)
            continue
        found = candidates.pop(0)
        sequence = expected.epochs[index]
        diverged.add(sequence)
        result.add(
            sequence,
            Finding(
                Aspect.DESTINATION,
                Outcome.DIVERGED,
                "changed row",
                _at(expected, index),
                f"expected {_show(_row(expected, index))}, the destination holds {_show(found.row)} in its "
                "place (a row of the same epoch no event explains)",
            ),
        )
    return left, [found for rows in spare.values() for found in rows]


__all__ = ["Comparison", "EpochRows", "compare", "expected_rows"]
