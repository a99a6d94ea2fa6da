"""The oracle: every record checked by its key (producer id, sequence) against what a run promised.

What must be at the destination and what may be there depend on the fault: after a recovery, every
produced record must be there; after a fault that destroys source positions (a recreated or
truncated source), exactly the records the certificates covered must be there, and nothing read
after the fault may be. Duplicates are allowed only where the planner said at-least-once, or where
its effectively-once rests on a deduplication window the run outlasted (:func:`duplicates_allowed`).
"""

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from faucet_dagster.planner import Mechanism, Plan
from faucet_dagster.protocol import Delivery, EpochCertificate
from faucet_dagster.testing.faults.pairs import Key, Produced


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


__all__ = ["Verdict", "covered", "duplicates_allowed", "foreign_incarnations", "judge"]
