"""What a verification says: per certificate (or bounded run) verified, diverged or not verifiable,
with the findings that decided it.

A certificate is *verified* only when every aspect was checked and held: its chain (the state store),
its source (the covered range re-read), its destination (the rows it left), and, where Dagster was
asked, its reports. One aspect that diverged makes it *diverged*; otherwise one that could not be
checked makes it *not verifiable*, never verified.
"""

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    """What one check established, worst last: the outcome of several is the worst of them."""

    VERIFIED = "verified"
    NOT_VERIFIABLE = "not_verifiable"
    DIVERGED = "diverged"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @staticmethod
    def worst(outcomes: Iterable["Outcome"]) -> "Outcome":
        return max(outcomes, key=lambda outcome: outcome.rank, default=Outcome.VERIFIED)


_RANK = {Outcome.VERIFIED: 0, Outcome.NOT_VERIFIABLE: 1, Outcome.DIVERGED: 2}


class Aspect(StrEnum):
    """What was checked."""

    CHAIN = "chain"
    """The certificates in the state store: sequences, contiguous coverage per domain, incarnations,
    fencing tokens, bodies that match their fingerprints, the certified positions."""
    REPORTS = "reports"
    """The certificates Dagster was sent (materializations) against the store."""
    SOURCE = "source"
    """The covered range re-read at the source: row counts and digests per resource."""
    DESTINATION = "destination"
    """The range's rows at the destination, as the policy promises."""


@dataclass(frozen=True)
class Finding:
    """One thing a check found: what (``kind``: ``"missing row"``, ``"gap"``, ``"not replayable"``),
    where (a domain and position, a resource, a table), and the detail a person reads (with the rows
    that differ, as JSON)."""

    aspect: Aspect
    outcome: Outcome
    kind: str
    where: str
    detail: str

    def describe(self) -> str:
        return f"{self.aspect.value}: {self.kind} at {self.where}: {self.detail}"

    def to_dict(self) -> dict[str, str]:
        return {
            "aspect": self.aspect.value,
            "outcome": self.outcome.value,
            "kind": self.kind,
            "where": self.where,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Verification:
    """The verification of one certificate (``sequence``) of one stream, or of one bounded run
    (``sequence``: the run's number among those verified; ``label`` names it).

    ``aspects`` holds the outcome of each aspect that applies; ``findings`` every finding, the
    verified ones included (a check that held says so, with what it compared).
    """

    stream: str
    sequence: int
    aspects: Mapping[Aspect, Outcome]
    findings: tuple[Finding, ...] = ()
    label: str = ""

    @property
    def outcome(self) -> Outcome:
        return Outcome.worst(self.aspects.values())

    @property
    def problems(self) -> tuple[Finding, ...]:
        """The findings that are not ``verified``: what a person must look at."""
        return tuple(item for item in self.findings if item.outcome is not Outcome.VERIFIED)

    def summary(self) -> str:
        """One line: the outcome, and the first problem (or what was checked)."""
        problems = self.problems
        if not problems:
            return "; ".join(item.detail for item in self.findings[:3]) or "nothing to check"
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return problems[0].describe() + more

    def to_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "sequence": self.sequence,
            "label": self.label,
            "outcome": self.outcome.value,
            "aspects": {aspect.value: outcome.value for aspect, outcome in self.aspects.items()},
            "findings": [item.to_dict() for item in self.findings],
        }


@dataclass(frozen=True)
class Report:
    """Every verification of one run of ``faucet verify`` (or one evaluation of ``faucet_verify``),
    and what it cost."""

    verifications: tuple[Verification, ...]
    seconds: float = 0.0
    rows_replayed: int = 0
    rows_compared: int = 0
    notes: tuple[str, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def outcome(self) -> Outcome:
        return Outcome.worst(item.outcome for item in self.verifications)

    def tally(self) -> Counter[Outcome]:
        return Counter(item.outcome for item in self.verifications)

    def describe(self) -> str:
        """``12 verified, 1 diverged, 2 not verifiable (3.1s, 6000 rows re-read, 6000 compared)``."""
        tally = self.tally()
        parts = [
            f"{tally[outcome]} {outcome.value.replace('_', ' ')}" for outcome in Outcome if tally[outcome]
        ]
        return (
            f"{', '.join(parts) or 'nothing to verify'} ({self.seconds:.1f}s, {self.rows_replayed} rows "
            f"re-read, {self.rows_compared} compared)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome.value,
            "summary": self.describe(),
            "seconds": round(self.seconds, 3),
            "rows_replayed": self.rows_replayed,
            "rows_compared": self.rows_compared,
            "notes": list(self.notes),
            "verifications": [item.to_dict() for item in self.verifications],
        }


def note_all(
    findings: dict[int, list[Finding]], sequences: Iterable[int], finding: Callable[[int], Finding]
) -> None:
    """Add ``finding(sequence)`` to the findings of each of ``sequences``."""
    for sequence in sequences:
        findings.setdefault(sequence, []).append(finding(sequence))


def table_rows(report: Report) -> list[dict[str, str]]:
    """One row per verification, for a table (the CLI's, Dagster's ``TableMetadataValue``)."""
    return [
        {
            "stream": item.label or item.stream,
            "certificate": str(item.sequence),
            "outcome": item.outcome.value,
            **{
                aspect.value: item.aspects[aspect].value if aspect in item.aspects else "-"
                for aspect in Aspect
            },
            "what": item.summary(),
        }
        for item in report.verifications
    ]


def render_table(report: Report, *, width: int = 160) -> str:
    """The report as a plain-text table, one line per verification, then its problems in full."""
    rows = table_rows(report)
    if not rows:
        return "nothing to verify"
    headers = list(rows[0])
    shown = [{**row, "what": _clip(row["what"], 60)} for row in rows]
    widths = {name: max(len(name), *(len(row[name]) for row in shown)) for name in headers}
    lines = ["  ".join(name.ljust(widths[name]) for name in headers)]
    lines += ["  ".join(row[name].ljust(widths[name]) for name in headers) for row in shown]
    for item in report.verifications:
        for problem in item.problems:
            lines.append(
                _clip(f"{item.label or item.stream} #{item.sequence} {problem.describe()}", width * 4)
            )
    lines.append(report.describe())
    return "\n".join(lines)


def rows_json(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as compact JSON for a finding's detail (values JSON cannot hold as text)."""
    return json.dumps([dict(row) for row in rows], default=str, sort_keys=True, separators=(",", ":"))


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


__all__ = [
    "Aspect",
    "Finding",
    "Outcome",
    "Report",
    "Verification",
    "note_all",
    "render_table",
    "rows_json",
    "table_rows",
]
