"""Faucet syncs as Dagster assets, materialized in process on a persistent Dagster instance.

The sinks write into the real PostgreSQL of the test session (and SQLite); bookmarks and commit
tokens go through Dagster's run storage in a temporary DAGSTER_HOME. The one fault injected is a
crash at an exact point: after the sync committed at the sink, before Dagster records the event.
"""

import inspect
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import duckdb
import psycopg
import pyarrow as pa
import pytest
import sqlalchemy as sa
from deltalake import DeltaTable, write_deltalake
from faucet_delta.sink import DeltaSink

import faucet_dagster
import faucet_dagster.syncs.assets
from faucet_dagster.components import FaucetComponent
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.protocol import CommitToken, ConfigError, JsonValue
from faucet_dagster.syncs.assets import FaucetSyncs, FaucetTranslator, faucet_assets, faucet_sync_assets
from faucet_dagster.syncs.declaration import FaucetSync, FaucetSyncData
from faucet_dagster.syncs.metadata import last_sync_state
from faucet_dagster.syncs.partitions import faucet_partitions_sensor, refresh_partitions
from faucet_dagster.syncs.schedules import faucet_schedule

METADATA_KEYS = {
    "dagster/row_count",
    "dagster/table_name",
    "dagster/column_schema",
    "faucet/bookmark",
    "faucet/commit_token",
    "faucet/delivery",
    "faucet/plan",
    "faucet/rows_read",
    "faucet/rows_written",
    "faucet/rows_dead_lettered",
    "faucet/rows_skipped",
    "faucet/rows_per_second",
}


def write_csv(path: Path, first: int, count: int) -> None:
    lines = ["id,name,amount"] + [f"{i},name {i},{i * 0.25}" for i in range(first, first + count)]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    """A Dagster instance whose run storage lives in a directory that outlives each run."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.DagsterInstance.local_temp(str(home), overrides={"telemetry": {"enabled": False}}) as created:
        yield created


def files(directory: Path, **config: Any) -> FaucetEndpoint:
    return FaucetConnection(connector="files").using(paths=[str(directory / "*.csv")], **config)


def postgres_ids(url: str, table: str) -> list[int]:
    with psycopg.connect(url) as connection:
        return [row[0] for row in connection.execute(f'SELECT id FROM "{table}" ORDER BY id')]


def materialization(result: dg.ExecuteInProcessResult, key: str) -> dg.AssetMaterialization:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key == dg.AssetKey(key)]
    return event.materialization


def value(found: dg.AssetMaterialization, key: str) -> Any:
    return found.metadata[key].value


def test_two_runs_resume_from_the_bookmark_in_run_storage(
    tmp_path: Path, postgres_url: str, instance: dg.DagsterInstance
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "2024-01.csv", 1, 1200)
    warehouse = FaucetConnection(connector="sql", config={"url": postgres_url})
    orders = FaucetSync("orders", source=files(data), sink=warehouse.using(table="orders"), batch_size=500)
    assets = faucet_sync_assets([orders])

    first = materialization(dg.materialize(assets, instance=instance), "orders")
    assert set(first.metadata) >= METADATA_KEYS
    assert value(first, "faucet/rows_read") == value(first, "faucet/rows_written") == 1200
    assert value(first, "dagster/row_count") == 1200
    assert value(first, "faucet/rows_skipped") == 0 and value(first, "faucet/rows_dead_lettered") == "0"
    assert value(first, "faucet/delivery") == "effectively_once"
    assert value(first, "faucet/commit_token") == str(CommitToken(1200))
    assert value(first, "faucet/plan")["mechanisms"] == ["atomic_watermark"]
    database = postgres_url.rsplit("/", 1)[-1].split("?", 1)[0]
    assert value(first, "dagster/table_name") == f"{database}.orders"
    assert value(first, "dagster/storage_kind") == "postgresql"
    columns = [column.name for column in value(first, "dagster/column_schema").columns]
    assert columns[:3] == ["id", "name", "amount"]
    assert value(first, "faucet/rows_per_second") > 0

    write_csv(data / "2024-02.csv", 1201, 300)
    second = materialization(dg.materialize(assets, instance=instance), "orders")
    assert value(second, "faucet/rows_read") == value(second, "faucet/rows_written") == 300
    assert value(second, "dagster/row_count") == 1500  # the table's rows, not this run's
    assert value(second, "faucet/commit_token") == str(CommitToken(1500))
    assert postgres_ids(postgres_url, "orders") == list(range(1, 1501))

    # What the next run will read back is what the last materialization stored.
    state = last_sync_state(instance, dg.AssetKey("orders"), None)
    assert state.commit_token == CommitToken(1500)
    assert state.bookmark == value(second, "faucet/bookmark")
    third = materialization(dg.materialize(assets, instance=instance), "orders")
    assert value(third, "faucet/rows_read") == 0
    assert postgres_ids(postgres_url, "orders") == list(range(1, 1501))


def test_a_sync_into_duckdb_reports_dagsters_table_metadata_and_moves_nothing_twice(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "2024-01.csv", 1, 700)
    path = tmp_path / "warehouse.duckdb"
    warehouse = FaucetConnection(connector="duckdb", config={"path": str(path)})
    orders = FaucetSync("orders", source=files(data), sink=warehouse.using(table="orders"), batch_size=300)
    assets = faucet_sync_assets([orders])

    first = materialization(dg.materialize(assets, instance=instance), "orders")
    assert value(first, "dagster/storage_kind") == "duckdb"
    assert value(first, "dagster/table_name") == "warehouse.main.orders"
    assert value(first, "dagster/row_count") == 700
    assert value(first, "faucet/delivery") == "effectively_once"
    columns = [column.name for column in value(first, "dagster/column_schema").columns]
    assert columns == ["id", "name", "amount"]
    again = materialization(dg.materialize(assets, instance=instance), "orders")
    assert (value(again, "faucet/rows_read"), value(again, "faucet/rows_written")) == (0, 0)
    with duckdb.connect(str(path)) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT id) FROM orders").fetchall() == [(700, 700)]


def test_a_sync_into_a_delta_table_reports_its_table_and_the_version_it_committed(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "2024-01.csv", 1, 400)
    table = tmp_path / "lake" / "orders"
    lake = FaucetConnection(connector="delta", config={})
    orders = FaucetSync("orders", source=files(data), sink=lake.using(uri=str(table)), batch_size=150)
    assets = faucet_sync_assets([orders])
    # Another writer commits right after the sync's last commit: the version reported is the sync's.
    finish = DeltaSink.finish

    async def finish_then_another_writer_commits(sink: DeltaSink) -> None:
        await finish(sink)
        write_deltalake(str(table), pa.table({"id": [0], "name": ["other"], "amount": [0.0]}), mode="append")

    monkeypatch.setattr(DeltaSink, "finish", finish_then_another_writer_commits)
    first = materialization(dg.materialize(assets, instance=instance), "orders")
    history = {entry["version"]: entry["operation"] for entry in DeltaTable(str(table)).history()}
    # CREATE TABLE, three pages of 150, 150 and 100 rows, the other writer's commit.
    assert sorted(history) == [0, 1, 2, 3, 4] and history[0] == "CREATE TABLE"
    assert value(first, "delta/table_version") == 3
    assert value(first, "dagster/storage_kind") == "delta"
    assert value(first, "dagster/table_name") == "lake.orders"
    assert value(first, "dagster/row_count") == 401
    columns = [column.name for column in value(first, "dagster/column_schema").columns]
    assert columns == ["id", "name", "amount"]
    assert value(first, "faucet/delivery") == "effectively_once"
    monkeypatch.setattr(DeltaSink, "finish", finish)
    again = materialization(dg.materialize(assets, instance=instance), "orders")
    assert value(again, "faucet/rows_written") == 0 and value(again, "dagster/row_count") == 401
    assert "delta/table_version" not in again.metadata  # nothing committed: no version to report


def completed_files(bookmark: JsonValue | None) -> list[str]:
    """The files a files-source bookmark records as read to their end."""
    assert isinstance(bookmark, dict)
    completed = bookmark["completed"]
    assert isinstance(completed, dict)
    return list(completed)


class Crash(Exception):
    """The run dying after the sink committed, before Dagster stored the materialization."""


def test_crash_between_the_sink_commit_and_the_dagster_event_leaves_no_duplicate(
    tmp_path: Path, postgres_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "a.csv", 1, 400)
    warehouse = FaucetConnection(connector="sql", config={"url": postgres_url})
    assets = faucet_sync_assets(
        [FaucetSync("orders", source=files(data), sink=warehouse.using(table="orders"), batch_size=150)]
    )
    dg.materialize(assets, instance=instance)
    write_csv(data / "b.csv", 401, 500)

    def crash(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise Crash("the process died before Dagster stored the materialization")

    # The exact point: the sync returned (every page committed with its token), no event yet.
    monkeypatch.setattr(faucet_dagster.syncs.assets, "sync_metadata", crash)
    failed = dg.materialize(assets, instance=instance, raise_on_error=False)
    assert not failed.success
    assert postgres_ids(postgres_url, "orders") == list(range(1, 901))
    assert last_sync_state(instance, dg.AssetKey("orders"), None).commit_token == CommitToken(400)
    monkeypatch.undo()

    # The sink keeps the bookmark of its last page with the token: the rerun resumes from it (every
    # file read), with nothing to read again.
    rerun = materialization(dg.materialize(assets, instance=instance), "orders")
    assert value(rerun, "faucet/rows_read") == 0
    assert value(rerun, "faucet/rows_skipped") == 0
    assert value(rerun, "faucet/rows_written") == 0
    assert value(rerun, "faucet/commit_token") == str(CommitToken(900))
    assert postgres_ids(postgres_url, "orders") == list(range(1, 901))


def test_a_partitioned_file_source_materializes_per_partition(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "2024-01.csv", 1, 100)
    write_csv(data / "2024-02.csv", 101, 60)
    db = tmp_path / "warehouse.db"
    warehouse = FaucetConnection(connector="sql", config={"url": f"sqlite:///{db}"})
    sync = FaucetSync("orders", source=files(data, shard_by_file=True), sink=warehouse.using(table="orders"))
    [asset] = faucet_sync_assets([sync])
    # Nothing is listed while the definitions load: the partitions sensor adds one a shard.
    assert isinstance(asset.partitions_def, dg.DynamicPartitionsDefinition)
    defs = dg.Definitions(
        assets=[asset],
        schedules=[faucet_schedule(asset, "0 * * * *")],
        sensors=[faucet_partitions_sensor(sync)],
    )
    assert refresh_partitions(instance, defs) == {"faucet_orders_shards": ["2024-01.csv", "2024-02.csv"]}
    assert refresh_partitions(instance, defs) == {}

    january = materialization(
        dg.materialize([asset], instance=instance, partition_key="2024-01.csv"), "orders"
    )
    assert value(january, "faucet/rows_written") == 100
    assert value(january, "dagster/partition_row_count") == 100
    assert value(january, "dagster/row_count") == 100
    february = materialization(
        dg.materialize([asset], instance=instance, partition_key="2024-02.csv"), "orders"
    )
    assert value(february, "faucet/rows_written") == 60
    # The table's rows (both shards), not this run's; the partition's own rows.
    assert value(february, "dagster/row_count") == 160
    assert value(february, "dagster/partition_row_count") == 60
    assert value(february, "dagster/table_name") == "warehouse.orders"
    assert value(february, "dagster/storage_kind") == "sqlite"
    again = materialization(dg.materialize([asset], instance=instance, partition_key="2024-01.csv"), "orders")
    assert value(again, "faucet/rows_read") == 0
    assert value(again, "dagster/partition_row_count") == 100

    key = dg.AssetKey("orders")
    january_state = last_sync_state(instance, key, "2024-01.csv")
    february_state = last_sync_state(instance, key, "2024-02.csv")
    assert completed_files(january_state.bookmark) == [str(data / "2024-01.csv")]
    assert completed_files(february_state.bookmark) == [str(data / "2024-02.csv")]
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.connect() as connection:
        ids = [row[0] for row in connection.execute(sa.text("SELECT id FROM orders ORDER BY id"))]
    engine.dispose()
    assert ids == list(range(1, 161))

    schedule = defs.resolve_schedule_def("faucet_orders_schedule")
    tick = datetime(2024, 3, 1, 12, tzinfo=UTC)
    with dg.build_schedule_context(
        instance=instance, scheduled_execution_time=tick, repository_def=defs.get_repository_def()
    ) as context:
        requests = list(schedule.evaluate_tick(context).run_requests or [])
    assert sorted(request.partition_key or "" for request in requests) == ["2024-01.csv", "2024-02.csv"]
    assert {request.run_key for request in requests} == {
        f"{tick.isoformat()}/2024-01.csv",
        f"{tick.isoformat()}/2024-02.csv",
    }


def test_secrets_come_from_envvar_and_never_reach_metadata_or_logs(
    tmp_path: Path, postgres_url: str, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t-do-not-leak-4711"
    monkeypatch.setenv("FAUCET_TEST_PG_PASSWORD", secret)
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "a.csv", 1, 10)
    warehouse = FaucetConnection(
        connector="sql",
        config={
            "url": postgres_url,
            "auth": {
                "type": "user_password",
                "config": {"username": "postgres", "password": dg.EnvVar("FAUCET_TEST_PG_PASSWORD")},
            },
        },
    )
    sync = FaucetSync("orders", source=files(data), sink=FaucetEndpoint("warehouse", {"table": "orders"}))
    assets = faucet_sync_assets([sync])
    result = dg.materialize(assets, instance=instance, resources={"warehouse": warehouse})
    assert result.success
    assert postgres_ids(postgres_url, "orders") == list(range(1, 11))
    logged = [record for record in instance.all_logs(result.run_id)]
    assert logged
    assert not [record for record in logged if secret in dg.serialize_value(record)]

    monkeypatch.delenv("FAUCET_TEST_PG_PASSWORD")
    with pytest.raises(ConfigError, match="FAUCET_TEST_PG_PASSWORD is not set"):
        dg.materialize(assets, instance=instance, resources={"warehouse": warehouse})


def test_the_decorator_runs_only_the_selected_syncs_with_the_translator_spec(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "a.csv", 1, 20)
    db = tmp_path / "warehouse.db"
    warehouse = FaucetConnection(connector="sql", config={"url": f"sqlite:///{db}"})

    class RawTranslator(FaucetTranslator):
        def get_asset_spec(self, data: FaucetSyncData) -> dg.AssetSpec:
            spec = super().get_asset_spec(data)
            return spec.replace_attributes(
                key=spec.key.with_prefix("raw"), group_name="raw", owners=["team:data"]
            )

    syncs = [
        FaucetSync("orders", source=files(data), sink=warehouse.using(table="orders")),
        FaucetSync("orders_copy", source=files(data), sink=warehouse.using(table="orders_copy")),
    ]

    @faucet_assets(syncs=syncs, translator=RawTranslator())
    def shop(context: dg.AssetExecutionContext, faucet: FaucetSyncs) -> Iterator[Any]:
        yield from faucet.run(context)

    specs = {spec.key: spec for spec in shop.specs}
    assert set(specs) == {dg.AssetKey(["raw", "orders"]), dg.AssetKey(["raw", "orders_copy"])}
    spec = specs[dg.AssetKey(["raw", "orders"])]
    assert spec.group_name == "raw" and spec.owners == ["team:data"]
    assert spec.kinds == {"faucet", "files", "sql"}
    assert list(spec.deps) == []  # no invented upstream asset

    result = dg.materialize([shop], instance=instance, selection=[dg.AssetKey(["raw", "orders"])])
    assert [e.asset_key for e in result.get_asset_materialization_events()] == [
        dg.AssetKey(["raw", "orders"])
    ]
    engine = sa.create_engine(f"sqlite:///{db}")
    tables = sa.inspect(engine).get_table_names()
    engine.dispose()
    assert "orders" in tables and "orders_copy" not in tables


def test_the_component_builds_syncs_schedules_and_dead_letter_routes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "a.csv", 1, 5)
    component = FaucetComponent.resolve_from_yaml(
        f"""
connections:
  warehouse: {{connector: sql, config: {{url: "sqlite:///{tmp_path}/w.db"}}}}
syncs:
  - name: orders
    source: {{connector: files, config: {{paths: ["{data}/*.csv"]}}}}
    sink: {{connection: warehouse, config: {{table: orders}}}}
    dead_letter: {{connection: warehouse, config: {{table: orders_rejected}}}}
    schedule: "*/5 * * * *"
    asset: {{key: raw/orders, group_name: raw, tags: {{tier: bronze}}}}
"""
    )
    defs = component.build_sync_defs()
    [asset] = list(defs.assets or [])
    assert isinstance(asset, dg.AssetsDefinition)
    [spec] = asset.specs
    assert spec.key == dg.AssetKey(["raw", "orders"]) and spec.group_name == "raw"
    assert spec.tags["tier"] == "bronze" and spec.kinds == {"faucet", "files", "sql"}
    [schedule] = list(defs.schedules or [])
    assert isinstance(schedule, dg.ScheduleDefinition) and schedule.cron_schedule == "*/5 * * * *"

    broken = FaucetComponent.resolve_from_yaml(
        """
syncs:
  - name: orders
    source: {connector: files, config: {paths: [x.csv]}}
    sink: {connection: nowhere}
"""
    )
    with pytest.raises(ConfigError, match="no connection named 'nowhere'"):
        broken.build_sync_defs()


def test_the_package_exposes_the_dagster_names_lazily() -> None:
    assert faucet_dagster.FaucetComponent is FaucetComponent
    assert faucet_dagster.faucet_sync_assets is faucet_sync_assets
    assert faucet_dagster.faucet_schedule is faucet_schedule


def test_a_sync_asset_references_the_python_line_that_declared_it(tmp_path: Path) -> None:
    sync = FaucetSync(
        "orders",
        source=files(tmp_path),
        sink=FaucetConnection(connector="sql", config={"url": f"sqlite:///{tmp_path}/w.db"}).using(table="o"),
    )
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    [asset] = faucet_sync_assets([sync])
    [spec] = asset.specs
    references = spec.metadata["dagster/code_references"].code_references
    assert [(ref.file_path, ref.line_number) for ref in references] == [(__file__, line)]
