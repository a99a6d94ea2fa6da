"""Faucet declarations through Dagster's own tooling: `dg check defs` on a project with mistakes,
definitions that load without a broker, and automation conditions on a sync's asset."""

import os
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from faucet_dagster.components import FaucetComponent

DG = str(Path(sys.executable).with_name("dg"))
FAUCET = str(Path(sys.executable).with_name("faucet"))


def run(cwd: Path, env: dict[str, str], *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def dg_project(root: Path, name: str, defs_yaml: str) -> Path:
    """A dg project at ``root`` (created) whose package ``name`` holds one component, ``defs_yaml``,
    in ``defs/shop``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "0.0.0"\n'
        f'[tool.dg]\ndirectory_type = "project"\n[tool.dg.project]\nroot_module = "{name}"\n'
    )
    package = root / name
    (package / "defs" / "shop").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "defs" / "__init__.py").write_text("")
    (package / "definitions.py").write_text(
        "from pathlib import Path\n\nimport dagster as dg\n\n"
        'defs = dg.load_from_defs_folder(path_within_project=Path(__file__).parent / "defs")\n'
    )
    (package / "defs" / "shop" / "defs.yaml").write_text(defs_yaml)
    return root


MISTAKES = """\
type: faucet_dagster.components.FaucetComponent
attributes:
  connections:
    warehouse: {connector: sql, config: {url: "sqlite:///{{ context.project_root }}/w.db"}}
    nourl: {connector: sql}
    secret: {connector: postgres, config: {url: {env: FAUCET_TEST_UNSET_URL}}}
  syncs:
    - name: misspelt
      source: {connector: files, config: {paths: [x/*.csv]}}
      sink: {connection: warehouse, config: {tabel: orders}}
    - name: no_url
      source: {connector: files, config: {paths: [x/*.csv]}}
      sink: {connection: nourl, config: {table: b, mode: apend}}
    - name: dialect
      source: {connector: files, config: {paths: [x/*.csv]}}
      sink: {connector: sql, config: {url: "sqlte:///w.db", table: c}}
    - name: refused
      source: {connector: files, config: {paths: [x/*.csv]}}
      sink: {connection: warehouse, config: {table: d}}
      delivery: effectively_once
      dead_letter: {connection: warehouse, config: {table: d_rejected}}
    - name: late_bound
      source: {connector: files, config: {paths: [x/*.csv]}}
      sink: {connection: secret, config: {table: e}}
  streams:
    - name: misspelt_stream
      source: {connector: kafka, config: {bootstrap_servers: "localhost:9", group_id: g, topics: [t]}}
      sink: {connector: postgres, config: {url: "postgresql://localhost/db", tabel: x}}
      resources: [t]
    - name: refused_stream
      source: {connector: kafka, config: {bootstrap_servers: "localhost:9", group_id: g, topics: [t]}}
      sink: {connector: postgres, config: {url: "postgresql://localhost/db"}}
      resources: [t]
      policy: upsert
      key: [id]
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small dg project whose one component holds a mistake of each kind (and one env secret)."""
    return dg_project(tmp_path_factory.mktemp("dg_project"), "mistakes", MISTAKES)


def test_dg_check_defs_names_the_file_the_sync_and_every_violation(project: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "FAUCET_TEST_UNSET_URL"}
    checked = run(project, env, DG, "check", "defs")
    output = checked.stdout + checked.stderr
    assert checked.returncode != 0, output
    assert "mistakes/defs/shop/defs.yaml" in output
    for expected in (
        "sync misspelt: sink: sql sink config: tabel: Extra inputs are not permitted",
        "sync misspelt: sink: sql sink config: table: Field required",
        "sync no_url: sink: sql sink config: url: Field required",
        "sync no_url: sink: sql sink config: mode: Input should be",
        "sync dialect: sink: sql sink config: url: Value error, no SQLAlchemy dialect 'sqlte'",
        "sync refused: refused by the planner: [effectively-once-unreachable]",
        "stream misspelt_stream: sink: postgres streaming_sink config: tabel: Extra inputs are not permitted",
        "stream refused_stream: refused by the planner: [order-dependent-policy]",
    ):
        assert expected in output, output
    # A secret is read when a run builds the connector: checking needs no value for it.
    assert "late_bound" not in output and "FAUCET_TEST_UNSET_URL" not in output


SECRET = "hunter2-resolution-secret"

UNRESOLVABLE = [
    (
        f"""\
  syncs:
    - name: orders
      source: {{connector: files, config: {{paths: [x/*.csv]}}}}
      sink: {{connector: sql, config: {{url: "sqlite:///w.db", table: orders}}}}
      batch_size: {SECRET}
""",
        "defs.yaml:7 - attributes.syncs.0.batch_size: Input should be a valid integer",
    ),
    (
        f"""\
  connections:
    warehouse: {{connector: sql, config: {SECRET}}}
""",
        "defs.yaml:4 - attributes.connections.warehouse.config: Input should be a valid dictionary",
    ),
    (
        f"""\
  streams:
    - name: events
      source: {{connector: kafka, config: {{bootstrap_servers: "localhost:9", group_id: g, topics: [t]}}}}
      sink: {{connector: postgres, config: {{url: "postgresql://localhost/db"}}}}
      resources: [t]
      delivery: {SECRET}
""",
        "defs.yaml:8 - attributes.streams.0.delivery: Input should be 'effectively_once' or 'at_least_once'",
    ),
    (f"  syncs: {SECRET}\n", "defs.yaml:3 - attributes.syncs: expected a mapping of SyncModel fields"),
]


@pytest.mark.parametrize(("attributes", "expected"), UNRESOLVABLE)
def test_dg_check_defs_names_the_field_and_line_dagster_cannot_resolve_never_the_value(
    tmp_path: Path, attributes: str, expected: str
) -> None:
    dg_project(
        tmp_path, "unresolved", f"type: faucet_dagster.components.FaucetComponent\nattributes:\n{attributes}"
    )
    checked = run(tmp_path, dict(os.environ), DG, "check", "defs")
    output = checked.stdout + checked.stderr
    assert checked.returncode != 0, output
    assert f"unresolved/defs/shop/{expected}" in output, output
    assert SECRET not in output, output


def test_a_bounded_kafka_sync_loads_without_a_broker() -> None:
    component = FaucetComponent.resolve_from_yaml(
        """
syncs:
  - name: events
    source: {connector: kafka, config: {bootstrap_servers: "127.0.0.1:9", group_id: g, topics: [events]}}
    sink: {connector: sql, config: {url: "sqlite:///unused.db", table: events}}
"""
    )
    started = time.monotonic()
    defs = component.build_sync_defs()
    assert time.monotonic() - started < 5  # listing partitions against no broker took 14 s
    [asset] = list(defs.assets or [])
    assert isinstance(asset, dg.AssetsDefinition)
    assert isinstance(asset.partitions_def, dg.DynamicPartitionsDefinition)
    assert [sensor.name for sensor in defs.sensors or []] == ["faucet_events_shards_sensor"]


def test_on_cron_requests_the_sync_it_declares_in_yaml(tmp_path: Path) -> None:
    component = FaucetComponent.resolve_from_yaml(
        f"""
syncs:
  - name: orders
    source: {{connector: files, config: {{paths: ["{tmp_path}/*.csv"]}}}}
    sink: {{connector: sql, config: {{url: "sqlite:///{tmp_path}/w.db", table: orders}}}}
    asset:
      group_name: raw
      code_version: "3"
      automation_condition: "{{{{ dg.AutomationCondition.on_cron('0 * * * *') }}}}"
      metadata: {{owner_note: hourly}}
"""
    )
    defs = component.build_sync_defs()
    [asset] = list(defs.assets or [])
    assert isinstance(asset, dg.AssetsDefinition)
    [spec] = asset.specs
    assert spec.group_name == "raw" and spec.code_version == "3" and list(spec.deps) == []
    assert spec.metadata["owner_note"] == "hourly"
    with dg.instance_for_test() as instance:
        start = datetime(2024, 1, 1, 0, 30, tzinfo=UTC)
        first = dg.evaluate_automation_conditions(defs=[asset], instance=instance, evaluation_time=start)
        assert first.total_requested == 0
        later = dg.evaluate_automation_conditions(
            defs=[asset], instance=instance, cursor=first.cursor, evaluation_time=start + timedelta(hours=1)
        )
        assert later.total_requested == 1


def test_every_field_of_the_component_schema_has_a_description() -> None:
    schema = FaucetComponent.get_model_cls().model_json_schema()
    models = {"FaucetComponent": schema, **schema.get("$defs", {})}
    missing = [
        f"{model}.{name}"
        for model, definition in models.items()
        for name, field in (definition.get("properties") or {}).items()
        if not field.get("description")
    ]
    assert missing == []
    assert FaucetComponent.__doc__ is not None and "\n" not in FaucetComponent.__doc__.strip()


def test_dg_launch_moves_a_partition_the_partitions_sensor_added(tmp_path: Path) -> None:
    root = tmp_path / "launch"
    data = tmp_path / "data"
    data.mkdir()
    (data / "2024-01.csv").write_text("id\n1\n2\n")
    (data / "2024-02.csv").write_text("id\n3\n")
    dg_project(
        root,
        "launched",
        textwrap.dedent(
            f"""\
            type: faucet_dagster.components.FaucetComponent
            attributes:
              syncs:
                - name: orders
                  source: {{connector: files, config: {{paths: ["{data}/*.csv"], shard_by_file: true}}}}
                  sink: {{connector: sql, config: {{url: "sqlite:///{tmp_path}/w.db", table: orders}}}}
            """
        ),
    )
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    # The sensor's work, once, from a shell (the daemon runs the sensor instead).
    refreshed = run(root, env, FAUCET, "partitions", "refresh", "-m", "launched.definitions")
    assert refreshed.returncode == 0, refreshed.stdout + refreshed.stderr
    assert refreshed.stdout == "faucet_orders_shards: added 2 partition(s): 2024-01.csv, 2024-02.csv\n"
    launched = run(root, env, DG, "launch", "--assets", "orders", "--partition", "2024-02.csv")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    engine = sa.create_engine(f"sqlite:///{tmp_path}/w.db")
    try:
        with engine.connect() as connection:
            ids = [row[0] for row in connection.execute(sa.text("SELECT id FROM orders"))]
    finally:
        engine.dispose()
    assert ids == [3]
