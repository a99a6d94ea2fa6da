"""README command one: run every bounded sync of the example once, with no servers, and print what moved.

``python -m example_project`` (from ``example_project/``) materializes every faucet asset of the code
location (each partition of a partitioned one) in this process, against the Dagster instance in
``.dagster_home`` (created on first use, shared with ``dagster dev``), so each run resumes from the
bookmarks the last one stored. The first run moves the sample data; a second run moves 0 rows.
Exit status: 0 when every sync completed, 1 when one failed (its error is printed).
"""

import os
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
INSTANCE_SETTINGS = """\
telemetry:
  enabled: false
# The syncs into the DuckDB warehouse share the pool duckdb_warehouse: under `dg dev` the run queue
# starts one run of it at a time (DuckDB lets one process write the file), instead of a second run
# waiting for the file. Per run, not per step, so a run launched here in-process never waits on a slot.
concurrency:
  pools:
    granularity: run
    default_limit: 1
"""
"""The example's Dagster instance, written on first use (shared with ``dg dev``)."""
QUIET_RUN = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
"""Dagster's console log shows warnings and errors only: the table printed here says what moved."""


def main() -> int:
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(PROJECT_ROOT / ".dagster_home")))
    home.mkdir(parents=True, exist_ok=True)
    settings = home / "dagster.yaml"
    if not settings.exists():
        settings.write_text(INSTANCE_SETTINGS)

    # Imported after DAGSTER_HOME is set: the instance and the definitions read it.
    import dagster as dg

    from example_project.definitions import defs
    from faucet_dagster.syncs.partitions import refresh_partitions

    instance = dg.DagsterInstance.get()
    # What the partitions sensors do under the daemon: a partition for each new sample file.
    refresh_partitions(instance, defs)
    total = 0
    failed = False
    print(f"{'asset':<12} {'partition':<14} {'read':>8} {'written':>8} {'skipped':>8}  delivery")
    for assets_def in defs.assets or []:
        if not isinstance(assets_def, dg.AssetsDefinition):
            continue
        partitions = assets_def.partitions_def
        keys = (
            partitions.get_partition_keys(dynamic_partitions_store=instance)
            if partitions is not None
            else [None]
        )
        for partition in keys:
            result = dg.materialize(
                [assets_def],
                instance=instance,
                partition_key=partition,
                raise_on_error=False,
                run_config=QUIET_RUN,
            )
            if not result.success:
                failed = True
                print(f"{assets_def.node_def.name} {partition or ''}: failed", file=sys.stderr)
                for event in result.get_step_failure_events():
                    error = event.step_failure_data.error
                    print(error.to_string() if error else event.message, file=sys.stderr)
                continue
            for event in result.get_asset_materialization_events():
                materialization = event.materialization
                counts = {
                    name: int(materialization.metadata[f"faucet/{name}"].value)  # type: ignore[arg-type]
                    for name in ("rows_read", "rows_written", "rows_skipped")
                }
                total += counts["rows_written"]
                print(
                    f"{materialization.asset_key.to_user_string():<12} {partition or '-':<14} "
                    f"{counts['rows_read']:>8} {counts['rows_written']:>8} {counts['rows_skipped']:>8}  "
                    f"{materialization.metadata['faucet/delivery'].value}"
                )
    print(f"moved {total} rows in total (Dagster instance: {home})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
