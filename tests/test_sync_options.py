"""A bounded sync's opt-in options, declared in a ``defs.yaml`` and run through Dagster (files and SQLite:
no server): its asset checks, an eager run of each new partition, time-window partitions of a SQL
table read by a time cursor, and the remedy a ``SchemaError`` names.
"""

import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest

from faucet_dagster.components import FaucetComponent
from faucet_dagster.protocol import SchemaError
from faucet_dagster.syncs.checks import BOOKMARK_CHECK, DEAD_LETTERS_CHECK, ROW_COUNT_CHECK


def sync_defs(yaml: str) -> dg.Definitions:
    return FaucetComponent.resolve_from_yaml(yaml).build_sync_defs()


def write_csv(path: Path, rows: range, extra: str = "") -> None:
    header = "id,amount" + (f",{extra}" if extra else "")
    body = "".join(f"{n},{n * 0.5}" + (",x" if extra else "") + "\n" for n in rows)
    path.write_text(f"{header}\n{body}")


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as created:
        yield created


def results(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def test_opt_in_checks_watch_dead_letters_a_shrinking_table_and_a_bookmark_that_stays(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    write_csv(tmp_path / "a.csv", range(100))
    warehouse = tmp_path / "w.db"
    defs = sync_defs(
        f"""
connections:
  files: {{connector: files}}
  warehouse: {{connector: sql, config: {{url: "sqlite:///{warehouse}"}}}}
syncs:
  - name: orders
    source: {{connection: files, config: {{paths: ["{tmp_path}/*.csv"]}}}}
    sink: {{connection: warehouse, config: {{table: orders, mode: append}}}}
    checks: {{no_dead_letters: true, row_count_drop: 0, bookmark_advances: true}}
"""
    )
    [asset] = list(defs.assets or [])
    assert isinstance(asset, dg.AssetsDefinition)
    assert {key.name for key in asset.check_keys} == {DEAD_LETTERS_CHECK, ROW_COUNT_CHECK, BOOKMARK_CHECK}

    first = results(dg.materialize([asset], instance=instance))
    assert all(check.passed for check in first.values()), first

    # Nothing new: the bookmark stays (a warning). Rows deleted behind the sync's back: the table shrank.
    with sqlite3.connect(warehouse) as conn:
        conn.execute("DELETE FROM orders WHERE id < 10")
    second = results(dg.materialize([asset], instance=instance))
    assert not second[BOOKMARK_CHECK].passed and second[BOOKMARK_CHECK].severity is dg.AssetCheckSeverity.WARN
    assert not second[ROW_COUNT_CHECK].passed and "90 rows, 100 after the previous run" in str(
        second[ROW_COUNT_CHECK].description
    )
    assert second[DEAD_LETTERS_CHECK].passed


def test_a_sync_without_checks_declares_none(tmp_path: Path) -> None:
    defs = sync_defs(
        f"""
syncs:
  - name: orders
    source: {{connector: files, config: {{paths: ["{tmp_path}/*.csv"]}}}}
    sink: {{connector: sql, config: {{url: "sqlite:///{tmp_path}/w.db", table: orders}}}}
"""
    )
    [asset] = list(defs.assets or [])
    assert isinstance(asset, dg.AssetsDefinition) and not asset.check_keys


def test_the_partitions_sensor_runs_each_new_partition_when_asked_and_lists_on_the_asset(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    for month in ("2024-01", "2024-02"):
        write_csv(tmp_path / f"{month}.csv", range(10))
    yaml = f"""
syncs:
  - name: orders
    source: {{connector: files, config: {{paths: ["{tmp_path}/*.csv"], shard_by_file: true}}}}
    sink: {{connector: sql, config: {{url: "sqlite:///{tmp_path}/w.db", table: orders}}}}
    run_new_partitions: RUN
"""
    for run, expected in (("true", ["2024-01.csv", "2024-02.csv"]), ("false", [])):
        defs = sync_defs(yaml.replace("RUN", run))
        [sensor] = list(defs.sensors or [])
        assert isinstance(sensor, dg.SensorDefinition)
        assert sensor.asset_selection is not None  # the asset's page lists its partitions sensor
        # As a code server evaluates the daemon's tick: with a reference to the instance.
        context = dg.build_sensor_context(instance_ref=instance.get_ref(), definitions=defs)
        result = sensor.evaluate_tick(context)
        assert [request.partition_key for request in result.run_requests or []] == expected
        [added] = result.dynamic_partitions_requests or []
        assert list(added.partition_keys or []) == ["2024-01.csv", "2024-02.csv"]


def test_time_window_partitions_read_each_window_of_a_time_cursor_from_its_own_bookmark(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    source = tmp_path / "app.db"
    start = datetime(2024, 1, 1, tzinfo=UTC)
    with sqlite3.connect(source) as conn:
        conn.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, at TIMESTAMP, amount REAL)")
        conn.executemany(
            "INSERT INTO events VALUES (?, ?, ?)",
            [(n, (start + timedelta(hours=n * 6)).strftime("%Y-%m-%d %H:%M:%S.%f"), n) for n in range(12)],
        )
    defs = sync_defs(
        f"""
syncs:
  - name: events
    source: {{connector: sql, config: {{url: "sqlite:///{source}", table: events, cursor: at}}}}
    sink: {{connector: sql, config: {{url: "sqlite:///{tmp_path}/w.db", table: events, mode: append}}}}
    partitions: {{schedule: daily, start: "2024-01-01"}}
"""
    )
    [asset] = list(defs.assets or [])
    assert isinstance(asset, dg.AssetsDefinition)
    assert isinstance(asset.partitions_def, dg.DailyPartitionsDefinition)

    def written(partition: str) -> int:
        result = dg.materialize([asset], instance=instance, partition_key=partition)
        [materialization] = result.asset_materializations_for_node(asset.node_def.name)
        return int(str(materialization.metadata["faucet/rows_written"].value))

    assert written("2024-01-02") == 4, "the four rows of the second day only"
    assert written("2024-01-02") == 0, "again: nothing new in that window"
    with sqlite3.connect(source) as conn:  # a late row of that day, with a larger key
        conn.execute("INSERT INTO events VALUES (100, '2024-01-02 23:00:00.000000', 1.0)")
    assert written("2024-01-02") == 1
    assert written("2024-01-01") == 4, "another window, from its own bookmark"
    with sqlite3.connect(tmp_path / "w.db") as conn:
        ids = sorted(row[0] for row in conn.execute("SELECT id FROM events"))
    assert ids == [0, 1, 2, 3, 4, 5, 6, 7, 100]


def test_a_new_column_fails_naming_the_setting_that_would_accept_it(tmp_path: Path) -> None:
    write_csv(tmp_path / "a.csv", range(5))
    [asset] = list(
        sync_defs(
            f"""
syncs:
  - name: orders
    source: {{connector: files, config: {{paths: ["{tmp_path}/*.csv"]}}}}
    sink: {{connector: sql, config: {{url: "sqlite:///{tmp_path}/w.db", table: orders}}}}
"""
        ).assets
        or []
    )
    with dg.instance_for_test() as instance:
        dg.materialize([asset], instance=instance)
        write_csv(tmp_path / "b.csv", range(5, 10), extra="coupon")
        with pytest.raises(SchemaError) as refused:
            dg.materialize([asset], instance=instance)
    notes = " ".join(getattr(refused.value, "__notes__", []))
    assert "Remedy:" in notes and "evolve_schema" in notes and "sync orders" in notes, notes
    assert "test_sync_options.py:" in notes, "where the sync was declared"
