"""The table of checks by connector that ``faucet conformance`` and the pytest plugin print.

Standard library only: the pytest plugin imports this at start-up.
"""

from collections.abc import Sequence
from dataclasses import dataclass

PROPERTY = "faucet_conformance"
"""The ``user_properties`` key under which each conformance test reports its subject, check and outcome."""

COLUMNS: tuple[tuple[str, str], ...] = (
    ("config_schema", "1"),
    ("bounded_memory", "2"),
    ("capabilities", "5"),
    ("no_panic", "6"),
    ("scenarios", "G"),
    ("slow_sink", "S1"),
    ("cancel_during_read", "S2"),
    ("failed_writes", "K1"),
    ("uncertain_commit", "K2"),
    ("lifecycle_order", "K3"),
    ("shutdown_with_outstanding_work", "K4"),
)
"""Each check id and its column heading, in table order."""

LEGEND = (
    "1 config schema  2 bounded memory  5 capabilities  6 no panic | "
    "G generated scenarios (FCP 3 resume and 4 idempotent replay, replays, acknowledgements, "
    "ownership, positions, transactions, crashes, streams, domains, resources, identifiers) | "
    "S1 slow sink  S2 cancel during read | K1 failed writes  K2 uncertain commit  "
    "K3 lifecycle order  K4 shutdown with outstanding work | . not a check of the role"
)


@dataclass(frozen=True)
class Result:
    """One check of one connector role: ``status`` is ``pass``, ``fail`` or ``n/a``."""

    subject: str
    check: str
    status: str
    detail: str
    exercised: tuple[str, ...] = ()
    """The declared capabilities and policies the check exercised."""


def format_table(results: Sequence[Result]) -> str:
    """Rows are connector roles (in first-seen order), columns the checks; then what each check
    exercised of what the connector declares, every n/a reason and every failure message."""
    subjects = list(dict.fromkeys(result.subject for result in results))
    cells = {(result.subject, result.check): result for result in results}
    width = max([len("connector role"), *map(len, subjects)])
    head = "connector role".ljust(width) + " | " + " | ".join(code.center(4) for _, code in COLUMNS)
    lines = [head, "-" * len(head)]
    for subject in subjects:
        row = []
        for check, _ in COLUMNS:
            found = cells.get((subject, check))
            row.append((found.status.upper() if found.status == "fail" else found.status) if found else ".")
        lines.append(subject.ljust(width) + " | " + " | ".join(cell.center(4) for cell in row))
    lines += ["", LEGEND]
    codes = dict(COLUMNS)
    exercised = [result for result in results if result.exercised]
    if exercised:
        lines.append("")
        lines.append("declared capabilities and policies each check exercised:")
        lines += [
            f"{r.subject} {codes.get(r.check, r.check)}: {', '.join(r.exercised)}"
            + (f" ({r.detail})" if r.status == "pass" else "")
            for r in exercised
        ]
    notes = [result for result in results if result.status != "pass"]
    if notes:
        lines.append("")
        lines += [f"{r.subject} {codes.get(r.check, r.check)} {r.status}: {r.detail}" for r in notes]
    passed = sum(result.status == "pass" for result in results)
    failed = sum(result.status == "fail" for result in results)
    lines += ["", f"{passed} passed, {failed} failed, {len(results) - passed - failed} n/a"]
    return "\n".join(lines)
