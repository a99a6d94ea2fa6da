"""The oracle: every record checked by its key (producer id, sequence) against what a run promised.

What must be at the destination and what may be there depend on the fault: after a recovery, every
produced record must be there; after a fault that destroys source positions (a recreated or
truncated source), exactly the records the certificates covered must be there, and nothing read
after the fault may be. Duplicates are allowed only where the planner said at-least-once, or where
its effectively-once rests on a deduplication window the run outlasted (:func:`duplicates_allowed`).

A replica fed by a change source (inserts, updates, deletes and key changes applied by key) is judged
by its state instead (:func:`judge_state`): it must equal the source table row by row, and the sink's
receipts must show no change applied to a state that already had it, nor one that found its key
missing. Record by record does not fit there: an update replaces a row, a delete removes it, and
applying a full row image again leaves the same row, so the final state, plus what the receipts
counted while applying, is what "nothing lost, nothing applied twice" means for keyed changes.
"""

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from faucet_dagster.planner import Mechanism, Plan
from faucet_dagster.protocol import Delivery, EpochCertificate
from faucet_dagster.testing.faults.pairs import Key, Produced, Row


@dataclass(frozen=True)
class Verdict:
    """What the destination holds, against what it must and may hold.

    ``records``: keys that must be there; ``found``: rows (or messages) there; ``lost``: keys that
    must be there and are not; ``duplicated``: rows beyond the first of their key; ``unexpected``:
    keys that may not be there (never produced, or read after a fault that should have halted).
    """

    records: int
    found: int
    lost: int
    duplicated: int
    unexpected: int


def judge(must: Iterable[Key], may: Iterable[Key], found: Sequence[Key]) -> Verdict:
    """Check every key of ``found`` against ``must`` (a subset of ``may``)."""
    must_set, may_set = set(must), set(may)
    counts = Counter(found)
    return Verdict(
        records=len(must_set),
        found=len(found),
        lost=len(must_set - counts.keys()),
        duplicated=sum(count - 1 for count in counts.values()),
        unexpected=len(counts.keys() - may_set - must_set),
    )


def judge_state(
    expected: Mapping[Key, Row], found: Sequence[tuple[Key, Row]], certificates: Sequence[EpochCertificate]
) -> Verdict:
    """Check a replica (``found``: its rows with their keys) against its source's rows by key.

    ``records``: the source's rows; ``found``: the replica's; ``lost``: source rows missing from the
    replica or there with other values in the source's columns (a change of the key never arrived),
    plus the changes the sink's receipts counted as reaching a key the replica lacked
    (``unexpected_changes``: an earlier change of the key was lost); ``duplicated``: rows beyond the
    first of their key, plus the inserts the receipts counted as reaching a key the replica already
    held (``unexpected_inserts``: a change applied twice); ``unexpected``: replica rows whose key the
    source does not hold (a delete lost, or a change applied after it again).
    """
    counts = Counter(key for key, _ in found)
    stale = sum(
        1
        for key, row in dict(found).items()
        if key in expected and any(row.get(column) != value for column, value in expected[key].items())
    )
    inserts = _receipt_count(certificates, "unexpected_inserts")
    changes = _receipt_count(certificates, "unexpected_changes")
    return Verdict(
        records=len(expected),
        found=len(found),
        lost=len(expected.keys() - counts.keys()) + stale + changes,
        duplicated=sum(count - 1 for count in counts.values()) + inserts,
        unexpected=len(counts.keys() - expected.keys()),
    )


def _receipt_count(certificates: Sequence[EpochCertificate], detail: str) -> int:
    """The sum of a count the receipts of ``certificates`` give in their details; a receipt that
    wrote rows must give it (KeyError otherwise), one that wrote none counts 0."""
    return sum(
        int(receipt.details[detail]) if receipt.rows_written else 0
        for certificate in certificates
        for receipt in certificate.receipts
    )


def duplicates_allowed(plan: Plan, seconds: float) -> bool:
    """Whether the plan permits duplicates in a run that lasted ``seconds``.

    Never for an effectively-once plan resting on an atomic watermark or a keyed upsert; for one
    resting only on event-identity deduplication, only when the run outlasted the window (a replay
    older than the window duplicates, as the sink documents); always for at-least-once.
    """
    if plan.delivery is Delivery.AT_LEAST_ONCE:
        return True
    if Mechanism.ATOMIC_WATERMARK in plan.mechanisms or Mechanism.KEYED_UPSERT in plan.mechanisms:
        return False
    return plan.dedup_window is not None and seconds >= plan.dedup_window.total_seconds()


def covered(certificates: Sequence[EpochCertificate], produced: Iterable[Produced]) -> set[Key]:
    """The keys of ``produced`` whose positions the certificates cover, in the first incarnation
    each domain was certified in (coverage of a later incarnation covers none of them)."""
    ends: dict[tuple[str, str], int] = {}
    incarnations: dict[tuple[str, str], str] = {}
    for certificate in certificates:
        for item in certificate.coverage:
            where = (item.domain.resource, item.domain.partition)
            if incarnations.setdefault(where, item.domain.incarnation) != item.domain.incarnation:
                continue
            ends[where] = max(ends.get(where, -1), int(item.end))
    return {item.key for item in produced if item.position <= ends.get((item.resource, item.partition), -1)}


def foreign_incarnations(certificates: Sequence[EpochCertificate]) -> list[str]:
    """Domains certified in more than one incarnation: a recreated source was read as if the same."""
    seen: dict[tuple[str, str], set[str]] = {}
    for certificate in certificates:
        for item in certificate.coverage:
            seen.setdefault((item.domain.resource, item.domain.partition), set()).add(item.domain.incarnation)
    return [f"{resource}/{partition}" for (resource, partition), found in seen.items() if len(found) > 1]


__all__ = ["Verdict", "covered", "duplicates_allowed", "foreign_incarnations", "judge", "judge_state"]
