"""Faucet declarations through Dagster's own tooling: `dg check defs` on a project with mistakes,
definitions that load without a broker, and automation conditions on a sync's asset."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from faucet_dagster import FaucetConnection, FaucetStream
from faucet_dagster.components import FaucetComponent
from faucet_dagster.protocol import ConfigError
from faucet_dagster.streams.definitions import build_stream_defs
from faucet_dagster.streams.sensor import faucet_stream_sensor

DG = str(Path(sys.executable).with_name("dg"))
FAUCET = str(Path(sys.executable).with_name("faucet"))
DAGSTER = str(Path(sys.executable).with_name("dagster"))


def run(cwd: Path, env: dict[str, str], *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


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
    return write_project(tmp_path_factory.mktemp("dg_project"), "mistakes", {"shop": MISTAKES})


def test_dg_check_defs_names_the_file_the_sync_and_every_violation(project: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "FAUCET_TEST_UNSET_URL"}
    checked = run(project, env, DG, "check", "defs")
    output = checked.stdout + checked.stderr
    assert checked.returncode != 0, output
    assert "mistakes/defs/shop/defs.yaml" in output
    for expected in (
        "sync misspelt: sink: sql sink config: tabel: Extra inputs are not permitted (did you mean `table`?)",
        "sync misspelt: sink: sql sink config: table: Field required",
        "sync no_url: sink: sql sink config: url: Field required",
        "sync no_url: sink: sql sink config: mode: Input should be",
        "sync dialect: sink: sql sink config: url: Value error, no SQLAlchemy dialect 'sqlte'",
        "sync refused: refused by the planner: [effectively-once-unreachable]",
        "stream misspelt_stream: sink: postgres streaming_sink config: tabel: Extra inputs are not permitted",
        "stream refused_stream: refused by the planner: [order-dependent-policy]",
    ):
        assert expected in output, output
    # Each problem starts with the line of its field; the message comes first, without Dagster's tree.
    assert re.search(r"defs\.yaml:\d+ - sync misspelt: sink: sql sink config: tabel", output), output
    assert "├──" not in output, output
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
    (
        f"""\
  syncs:
    - name: orders
      source: {{connector: files, config: {{paths: [x/*.csv]}}}}
      sink: {{connector: sql, config: {{url: "sqlite:///w.db", table: orders}}}}
      shedule: {SECRET}
""",
        "defs.yaml:7 - attributes.syncs.0.shedule: Extra inputs are not permitted (did you mean `schedule`?)",
    ),
]


@pytest.mark.parametrize(("attributes", "expected"), UNRESOLVABLE)
def test_dg_check_defs_names_the_field_and_line_dagster_cannot_resolve_never_the_value(
    tmp_path: Path, attributes: str, expected: str
) -> None:
    write_project(
        tmp_path,
        "unresolved",
        {"shop": f"type: faucet_dagster.components.FaucetComponent\nattributes:\n{attributes}"},
    )
    checked = run(tmp_path, dict(os.environ), DG, "check", "defs")
    output = checked.stdout + checked.stderr
    assert checked.returncode != 0, output
    assert f"unresolved/defs/shop/{expected}" in output, output
    assert SECRET not in output, output
    # The message first: no drawing of the component tree before it, no union branch beside it.
    assert "├──" not in output and "└──" not in output and "syncs.str" not in output, output


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


def launch_project(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """A dg project with one partitioned sync (a CSV file a partition) into SQLite, its partitions
    added as the sensor would: the project, the data directory and the environment to run it in."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "2024-01.csv").write_text("id\n1\n2\n")
    (data / "2024-02.csv").write_text("id\n3\n")
    (data / "2024-03.csv").write_text("id\n4\n5\n6\n")
    component = f"""\
        type: faucet_dagster.components.FaucetComponent
        attributes:
          syncs:
            - name: orders
              source: {{connector: files, config: {{paths: ["{data}/*.csv"], shard_by_file: true}}}}
              sink: {{connector: sql, config: {{url: "sqlite:///{tmp_path}/w.db", table: orders}}}}
        """
    root = write_project(tmp_path / "launch", "launched", {"shop": component})
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    # The sensor's work, once, from a shell (the daemon runs the sensor instead).
    refreshed = run(root, env, FAUCET, "partitions", "refresh", "-m", "launched.definitions")
    assert refreshed.returncode == 0, refreshed.stdout + refreshed.stderr
    assert refreshed.stdout == (
        "faucet_orders_shards: added 3 partition(s): 2024-01.csv, 2024-02.csv, 2024-03.csv\n"
    )
    return root, data, env


def warehouse_ids(tmp_path: Path) -> list[int]:
    engine = sa.create_engine(f"sqlite:///{tmp_path}/w.db")
    try:
        with engine.connect() as connection:
            return [row[0] for row in connection.execute(sa.text("SELECT id FROM orders ORDER BY id"))]
    finally:
        engine.dispose()


def test_dg_launch_moves_a_partition_the_partitions_sensor_added(tmp_path: Path) -> None:
    root, _, env = launch_project(tmp_path)
    launched = run(root, env, DG, "launch", "--assets", "orders", "--partition", "2024-02.csv")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert warehouse_ids(tmp_path) == [3]


def test_a_launch_without_a_partition_says_what_to_do(tmp_path: Path) -> None:
    root, _, env = launch_project(tmp_path)
    for command in (
        (DG, "launch", "--assets", "orders"),
        (DAGSTER, "asset", "materialize", "--select", "orders", "-m", "launched.definitions"),
    ):
        refused = run(root, env, *command)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "Traceback" not in refused.stderr and "CheckError" not in refused.stderr, refused.stderr
        assert "a partitioned faucet sync needs a partition (orders:" in refused.stderr
        assert "`dg launch --assets orders --partition KEY`" in refused.stderr
        assert "--partition-range FIRST...LAST" in refused.stderr
    assert not (tmp_path / "w.db").exists()


def partition_records(home: Path, partition: str) -> list[dg.AssetMaterialization]:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("orders"), asset_partitions=[partition]), limit=10
        ).records
    return [record.asset_materialization for record in records if record.asset_materialization]


def test_a_partition_range_moves_each_partition_from_its_own_bookmark(tmp_path: Path) -> None:
    root, data, env = launch_project(tmp_path)
    home = Path(env["DAGSTER_HOME"])
    # A range whose second partition fails (its file is gone): the first one is recorded.
    (data / "2024-02.csv").rename(tmp_path / "held.csv")
    whole_range = ("--partition-range", "2024-01.csv...2024-03.csv")
    failed = run(root, env, DG, "launch", "--assets", "orders", *whole_range)
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0, output
    assert "partition '2024-02.csv' names no shard the source lists now" in output
    assert warehouse_ids(tmp_path) == [1, 2]
    [first] = partition_records(home, "2024-01.csv")
    assert first.metadata["faucet/rows_written"] == dg.IntMetadataValue(2)
    assert partition_records(home, "2024-02.csv") == partition_records(home, "2024-03.csv") == []
    # The same range again, the file back: the first partition resumes from its own bookmark.
    (tmp_path / "held.csv").rename(data / "2024-02.csv")
    ranged = run(
        root,
        env,
        DAGSTER,
        "asset",
        "materialize",
        "--select",
        "orders",
        *whole_range,
        "-m",
        "launched.definitions",
    )
    assert ranged.returncode == 0, ranged.stdout + ranged.stderr
    assert warehouse_ids(tmp_path) == [1, 2, 3, 4, 5, 6]
    for partition, written, rows in (("2024-01.csv", 0, 2), ("2024-02.csv", 1, 1), ("2024-03.csv", 3, 3)):
        latest = partition_records(home, partition)[0]
        assert latest.metadata["faucet/rows_written"] == dg.IntMetadataValue(written), partition
        assert latest.metadata["dagster/partition_row_count"] == dg.IntMetadataValue(rows), partition
        bookmark = latest.metadata["faucet/bookmark"]
        assert isinstance(bookmark, dg.JsonMetadataValue)
        assert isinstance(bookmark.data, dict)
        assert list(bookmark.data["completed"]) == [str(data / partition)], partition


def write_project(root: Path, module: str, components: dict[str, str]) -> Path:
    """A dg project ``module`` under ``root`` with a component (its defs.yaml text) per folder."""
    package = root / module
    (package / "defs").mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "{module}"\nversion = "0.0.0"\n'
        f'[tool.dg]\ndirectory_type = "project"\n[tool.dg.project]\nroot_module = "{module}"\n'
    )
    (package / "__init__.py").write_text("")
    (package / "defs" / "__init__.py").write_text("")
    (package / "definitions.py").write_text(
        "from pathlib import Path\n\nimport dagster as dg\n\n"
        'defs = dg.load_from_defs_folder(path_within_project=Path(__file__).parent / "defs")\n'
    )
    for folder, text in components.items():
        (package / "defs" / folder).mkdir()
        (package / "defs" / folder / "defs.yaml").write_text(textwrap.dedent(text))
    return root


CONNECTIONS = """\
type: faucet_dagster.components.FaucetComponent
attributes:
  connections:
    lake: {{connector: files}}
    warehouse: {{connector: sql, config: {{url: "sqlite:///{db}"}}}}
    {extra}
  syncs:
    - name: {sync}
      source: {{connection: lake, config: {{paths: [x/*.csv]}}}}
      sink: {{connection: warehouse, config: {{table: {sync}}}}}
"""


KAFKA_SYNC = """\
    - name: events
      source:
        connector: kafka
        config: {{bootstrap_servers: "127.0.0.1:{port}", group_id: g, topics: [events]}}
      sink: {{connection: warehouse, config: {{table: events}}}}
"""


def test_yaml_connections_are_resources_in_dg_list_defs(tmp_path: Path) -> None:
    db = tmp_path / "w.db"
    extra = "events: {connector: postgres, config: {url: {env: FAUCET_TEST_EVENTS_URL}}}"
    # A bounded Kafka sync whose "broker" only counts connections: loading must not list partitions.
    with socket.create_server(("127.0.0.1", 0)) as broker:
        broker.setblocking(False)
        root = write_project(
            tmp_path / "listed",
            "listed",
            {
                "shop": CONNECTIONS.format(db=db, extra=extra, sync="orders"),
                # The same connections declared again by a second component: the same resources.
                "more": CONNECTIONS.format(db=db, extra="", sync="customers")
                + KAFKA_SYNC.format(port=broker.getsockname()[1]),
            },
        )
        secret = "postgresql://faucet:s3cr3t-in-env@127.0.0.1:9/db"
        env = {**os.environ, "FAUCET_TEST_EVENTS_URL": secret}
        listed = run(root, env, DG, "list", "defs", "--json")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        with pytest.raises(BlockingIOError):
            broker.accept()  # nothing connected while the definitions loaded
    listing = json.loads(listed.stdout)
    assert sorted((r["name"], r["type"]) for r in listing["resources"]) == [
        (name, "faucet_dagster.declarations.resources.FaucetConnection")
        for name in ("events", "lake", "warehouse")
    ]
    assert {"customers", "events", "orders"} <= {asset["asset_key"] for asset in listing["assets"]}
    assert "s3cr3t" not in listed.stdout + listed.stderr
    # The component's docstring is its one-line summary in `dg list components`.
    components = run(root, env, DG, "list", "components", "--json")
    assert components.returncode == 0, components.stdout + components.stderr
    [faucet] = [c for c in json.loads(components.stdout)["items"] if c["key"].startswith("faucet_dagster")]
    assert faucet == {
        "key": "faucet_dagster.components.FaucetComponent",
        "summary": "Faucet syncs and streams in YAML: an asset per sync; a sink asset, check and sensor "
        "per stream.",
    }
    # One name, two configs: Dagster refuses to merge them, naming the key.
    clash = write_project(
        tmp_path / "clash",
        "clash",
        {
            "shop": CONNECTIONS.format(db=db, extra="", sync="orders"),
            "more": CONNECTIONS.format(db=tmp_path / "other.db", extra="", sync="customers"),
        },
    )
    checked = run(clash, env, DG, "check", "defs")
    assert checked.returncode != 0
    assert "different resources with same key 'warehouse'" in checked.stdout + checked.stderr


PYTHON_STREAMS = """\
import dagster as dg

from faucet_dagster import FaucetConnection, FaucetStream, build_stream_defs
from faucet_dagster.protocol import WritePolicy

kafka = FaucetConnection(connector="kafka", config={"bootstrap_servers": "127.0.0.1:9", "group_id": "g"})
postgres = FaucetConnection(connector="postgres", config={"url": "postgresql://127.0.0.1:9/db"})
misspelt = FaucetStream(
    "misspelt", source=kafka.using(topics=["t"]), sink=postgres.using(tabel="x"), resources=("t",)
)
refused = FaucetStream(
    "refused",
    source=kafka.using(topics=["t"]),
    sink=postgres.using(table="k"),
    resources=("t",),
    policy=WritePolicy.UPSERT,
    key=("id",),
)
fine = FaucetStream(
    "fine", source=kafka.using(topics=["t"]), sink=postgres.using(table="f"), resources=("t",)
)

defs = build_stream_defs([misspelt, refused, fine])
"""


def test_dg_check_defs_checks_streams_declared_in_python(tmp_path: Path) -> None:
    root = tmp_path / "pystreams"
    package = root / "pystreams"
    package.mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        '[project]\nname = "pystreams"\nversion = "0.0.0"\n'
        '[tool.dg]\ndirectory_type = "project"\n[tool.dg.project]\nroot_module = "pystreams"\n'
    )
    (package / "__init__.py").write_text("")
    definitions = package / "definitions.py"
    definitions.write_text(PYTHON_STREAMS)
    started = time.monotonic()
    checked = run(root, dict(os.environ), DG, "check", "defs")
    output = checked.stdout + checked.stderr
    assert checked.returncode != 0, output
    line = PYTHON_STREAMS.splitlines().index("defs = build_stream_defs([misspelt, refused, fine])") + 1
    assert f"build_stream_defs at {definitions}:{line}" in output, output
    assert "2 problem(s) in the faucet declarations" in output
    assert (
        "stream misspelt: sink: postgres streaming_sink config: tabel: Extra inputs are not permitted"
        in output
    )
    assert "stream refused: refused by the planner: [order-dependent-policy]" in output
    assert "stream fine" not in output
    # Nothing connected to the (absent) broker or database while the definitions loaded.
    assert time.monotonic() - started < 120
    # With the mistakes fixed, the same definitions pass.
    definitions.write_text(
        PYTHON_STREAMS.replace('tabel="x"', 'table="x"').replace(
            "policy=WritePolicy.UPSERT", "policy=WritePolicy.APPEND"
        )
    )
    fixed = run(root, dict(os.environ), DG, "check", "defs")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_a_stream_sensor_built_alone_is_checked_too() -> None:
    kafka = FaucetConnection(connector="kafka", config={"bootstrap_servers": "127.0.0.1:9", "group_id": "g"})
    stream = FaucetStream(
        "alone",
        source=kafka.using(topics=["t"]),
        sink=FaucetConnection(connector="postgres").using(url="postgresql://127.0.0.1:9/db", tabel="x"),
        resources=("t",),
    )
    with pytest.raises(ConfigError) as raised:
        faucet_stream_sensor(stream)
    assert "stream alone: sink: postgres streaming_sink config: tabel: Extra inputs" in raised.value.message
    assert raised.value.where is not None and raised.value.where.startswith(
        f"faucet_stream_sensor at {__file__}:"
    )


def test_a_stream_declared_in_python_references_its_line() -> None:
    kafka = FaucetConnection(connector="kafka", config={"bootstrap_servers": "127.0.0.1:9", "group_id": "g"})
    stream = FaucetStream(
        "referenced",
        source=kafka.using(topics=["t"]),
        sink=FaucetConnection(connector="postgres", config={"url": "postgresql://127.0.0.1:9/db"}).using(),
        resources=("t",),
    )
    line = sys._getframe().f_lineno + 1
    defs = build_stream_defs([stream])
    [spec] = [asset for asset in defs.assets or [] if isinstance(asset, dg.AssetSpec)]
    [reference] = spec.metadata["dagster/code_references"].code_references
    assert (reference.file_path, reference.line_number) == (__file__, line)
