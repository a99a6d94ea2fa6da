"""The asset checks a bounded sync opts in to (:class:`~faucet_dagster.syncs.declaration.SyncChecks`),
evaluated in the run, after the sync, from what it moved and what the previous run recorded:

* ``faucet_no_dead_letters`` (ERROR): the run dead-lettered no row;
* ``faucet_row_count_drop`` (ERROR): the destination table did not lose more than the allowed
  fraction of its rows since the previous run (``dagster/row_count`` against the newest earlier
  materialization's);
* ``faucet_bookmark_advances`` (WARN): the run found something new (its bookmark moved).
"""

from collections.abc import Collection

import dagster as dg

from faucet_dagster.syncs.declaration import FaucetSync
from faucet_dagster.syncs.metadata import SyncOutcome, SyncState

DEAD_LETTERS_CHECK = "faucet_no_dead_letters"
ROW_COUNT_CHECK = "faucet_row_count_drop"
BOOKMARK_CHECK = "faucet_bookmark_advances"


def sync_check_specs(sync: FaucetSync, key: dg.AssetKey) -> list[dg.AssetCheckSpec]:
    """The check specs ``sync`` opts in to, on its asset ``key``."""
    checks = sync.checks
    specs = []
    if checks.no_dead_letters:
        specs.append(
            dg.AssetCheckSpec(DEAD_LETTERS_CHECK, asset=key, description="The run dead-lettered no row.")
        )
    if checks.row_count_drop is not None:
        allowed = f"{checks.row_count_drop:.0%}"
        specs.append(
            dg.AssetCheckSpec(
                ROW_COUNT_CHECK,
                asset=key,
                description=f"The table lost at most {allowed} of its rows since the previous run.",
            )
        )
    if checks.bookmark_advances:
        specs.append(
            dg.AssetCheckSpec(
                BOOKMARK_CHECK, asset=key, description="The run found something new: its bookmark moved."
            )
        )
    return specs


def sync_check_results(
    sync: FaucetSync,
    key: dg.AssetKey,
    outcome: SyncOutcome,
    previous: SyncState,
    previous_table_rows: int | None,
    selected: Collection[dg.AssetCheckKey],
) -> list[dg.AssetCheckResult]:
    """The results of ``sync``'s checks that are ``selected`` for this run: ``previous`` is the
    state the run started from, ``previous_table_rows`` the destination's rows after the previous run
    (None: unknown, a first run)."""
    checks, result = sync.checks, outcome.result
    results = []
    if checks.no_dead_letters and dg.AssetCheckKey(key, DEAD_LETTERS_CHECK) in selected:
        dead = result.rows_dead_lettered
        results.append(
            dg.AssetCheckResult(
                asset_key=key,
                check_name=DEAD_LETTERS_CHECK,
                passed=dead == 0,
                severity=dg.AssetCheckSeverity.ERROR,
                description=f"{dead} row(s) dead-lettered"
                + ("" if dead == 0 else ": read them at the sync's dead_letter destination"),
                metadata={"faucet/rows_dead_lettered": dg.MetadataValue.text(str(dead))},
            )
        )
    if checks.row_count_drop is not None and dg.AssetCheckKey(key, ROW_COUNT_CHECK) in selected:
        now = outcome.table_rows
        known = now is not None and previous_table_rows is not None
        floor = 0 if previous_table_rows is None else previous_table_rows * (1 - checks.row_count_drop)
        passed = not known or (now or 0) >= floor
        results.append(
            dg.AssetCheckResult(
                asset_key=key,
                check_name=ROW_COUNT_CHECK,
                passed=passed,
                severity=dg.AssetCheckSeverity.ERROR,
                description=(
                    "no earlier row count to compare with"
                    if not known
                    else f"the table holds {now} rows, {previous_table_rows} after the previous run"
                    + ("" if passed else f" (at least {floor:.0f} expected): rows were deleted or replaced")
                ),
                metadata={
                    "faucet/table_rows": dg.MetadataValue.text("unknown" if now is None else str(now)),
                    "faucet/previous_table_rows": dg.MetadataValue.text(
                        "unknown" if previous_table_rows is None else str(previous_table_rows)
                    ),
                },
            )
        )
    if checks.bookmark_advances and dg.AssetCheckKey(key, BOOKMARK_CHECK) in selected:
        moved = result.rows_read > 0 and result.bookmark != previous.bookmark
        results.append(
            dg.AssetCheckResult(
                asset_key=key,
                check_name=BOOKMARK_CHECK,
                passed=moved,
                severity=dg.AssetCheckSeverity.WARN,
                description=(
                    f"read {result.rows_read} new row(s); the bookmark moved"
                    if moved
                    else "nothing new since the previous run: the bookmark did not move (has the source "
                    "stopped growing?)"
                ),
            )
        )
    return results


__all__ = [
    "BOOKMARK_CHECK",
    "DEAD_LETTERS_CHECK",
    "ROW_COUNT_CHECK",
    "sync_check_results",
    "sync_check_specs",
]
