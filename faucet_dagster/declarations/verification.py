"""What the ``faucet_verify`` asset checks of streams and syncs share: the name, a verification report as
an ``AssetCheckResult``, and a schedule that runs checks.

A report passes when everything it checked was verified (or nothing was new); a divergence fails it
with ERROR severity; a range that could not be verified fails it with WARN severity: *not verifiable*
never reads as passed. The metadata holds the counts, a table with a row per certificate (or run) and
each aspect's outcome, the problems in full, and what the verification cost.
"""

from collections.abc import Sequence

import dagster as dg

from faucet_dagster.verify import Outcome, Report, table_rows

VERIFY_CHECK = "faucet_verify"
MAX_PROBLEMS_SHOWN = 200
"""Problems listed in full in a check's metadata (the table lists every certificate)."""
_COLUMNS = ("stream", "certificate", "outcome", "chain", "reports", "source", "destination", "what")


def verification_result(report: Report) -> dg.AssetCheckResult:
    """``report`` as the result of an executed ``faucet_verify`` check (see the module docstring)."""
    tally = report.tally()
    outcome = report.outcome
    problems = [
        f"{item.label or item.stream} #{item.sequence} {problem.describe()}"
        for item in report.verifications
        for problem in item.problems
    ]
    rows = table_rows(report)
    metadata = {
        "faucet/outcome": dg.MetadataValue.text(
            outcome.value if report.verifications else "nothing to verify"
        ),
        "faucet/verified": dg.MetadataValue.int(tally[Outcome.VERIFIED]),
        "faucet/diverged": dg.MetadataValue.int(tally[Outcome.DIVERGED]),
        "faucet/not_verifiable": dg.MetadataValue.int(tally[Outcome.NOT_VERIFIABLE]),
        "faucet/verification": dg.TableMetadataValue(
            records=[dg.TableRecord({name: row[name] for name in _COLUMNS}) for row in rows],
            schema=dg.TableSchema(columns=[dg.TableColumn(name, "string") for name in _COLUMNS]),
        ),
        "faucet/problems": dg.MetadataValue.text("\n".join(problems[:MAX_PROBLEMS_SHOWN])),
        "faucet/seconds": dg.MetadataValue.float(round(report.seconds, 3)),
        "faucet/rows_replayed": dg.MetadataValue.int(report.rows_replayed),
        "faucet/rows_compared": dg.MetadataValue.int(report.rows_compared),
        "faucet/notes": dg.MetadataValue.text("\n".join(report.notes)),
    }
    passed = outcome is Outcome.VERIFIED
    return dg.AssetCheckResult(
        passed=passed,
        severity=dg.AssetCheckSeverity.ERROR if outcome is Outcome.DIVERGED else dg.AssetCheckSeverity.WARN,
        metadata=metadata,
        description=report.describe() + ("" if passed else f": {problems[0]}" if problems else ""),
    )


def verify_schedule(
    checks: Sequence[dg.AssetChecksDefinition], cron_schedule: str, *, name: str = "faucet_verify"
) -> dg.ScheduleDefinition:
    """A schedule running ``checks`` (``faucet_verify`` checks of streams and syncs) on ``cron_schedule``:
    each run verifies what is new since the last one (a bounded number per run)."""
    job = dg.define_asset_job(f"{name}_job", selection=dg.AssetSelection.checks(*checks))
    return dg.ScheduleDefinition(name=f"{name}_schedule", job=job, cron_schedule=cron_schedule)


__all__ = ["VERIFY_CHECK", "verification_result", "verify_schedule"]
