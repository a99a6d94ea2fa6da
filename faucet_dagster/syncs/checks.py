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

    def check(
        name: str, passed: bool, severity: dg.AssetCheckSeverity, description: str, **metadata: str
    ) -> None:
        if dg.AssetCheckKey(key, name) in selected:
            results.append(
                dg.AssetCheckResult(
                    asset_key=key,
                    check_name=name,
                    passed=passed,
                    severity=severity,
                    description=description,
                    metadata={
                        f"faucet/{label}": dg.MetadataValue.text(value) for label, value in metadata.items()
                    },
                )
            )

    if checks.no_dead_letters:
        dead = result.rows_dead_lettered
        check(
            DEAD_LETTERS_CHECK,
            dead == 0,
            dg.AssetCheckSeverity.ERROR,
            f"{dead} row(s) dead-lettered"
            + ("" if dead == 0 else ": read them at the sync's dead_letter destination"),
            rows_dead_lettered=str(dead),
        )
    if checks.row_count_drop is not None:
        now = outcome.table_rows
        known = now is not None and previous_table_rows is not None
        floor = 0 if previous_table_rows is None else previous_table_rows * (1 - checks.row_count_drop)
        passed = not known or (now or 0) >= floor
        check(
            ROW_COUNT_CHECK,
            passed,
            dg.AssetCheckSeverity.ERROR,
            "no earlier row count to compare with"
            if not known
            else f"the table holds {now} rows, {previous_table_rows} after the previous run"
            + ("" if passed else f" (at least {floor:.0f} expected): rows were deleted or replaced"),
            table_rows="unknown" if now is None else str(now),
            previous_table_rows="unknown" if previous_table_rows is None else str(previous_table_rows),
        )
    if checks.bookmark_advances:
        moved = result.rows_read > 0 and result.bookmark != previous.bookmark
        check(
            BOOKMARK_CHECK,
            moved,
            dg.AssetCheckSeverity.WARN,
            f"read {result.rows_read} new row(s); the bookmark moved"
            if moved
            else "nothing new since the previous run: the bookmark did not move (has the source "
            "stopped growing?)",
        )
    return results


__all__ = [
    "BOOKMARK_CHECK",
    "DEAD_LETTERS_CHECK",
    "ROW_COUNT_CHECK",
    "sync_check_results",
    "sync_check_specs",
]
