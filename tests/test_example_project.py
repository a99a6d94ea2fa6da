"""README command one on a fresh copy of the example project: no servers, twice, then `dg list defs`."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import duckdb
import psycopg
import pytest
from dagster._core.instance.config import PoolGranularity

EXAMPLE = Path(__file__).resolve().parents[1] / "example_project"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the example as a fresh clone has it: no generated data, no Dagster home."""
    copy = tmp_path / "example_project"
    shutil.copytree(
        EXAMPLE, copy, ignore=shutil.ignore_patterns(".faucet_data", ".dagster_home", "__pycache__")
    )
    return copy


def run(project: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "DAGSTER_HOME"}
    return subprocess.run(
        command, cwd=project, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def moved(output: str) -> int:
    found = re.search(r"^moved (\d+) rows in total", output, re.MULTILINE)
    assert found, output
    return int(found.group(1))


def test_command_one_moves_the_samples_once_then_nothing(project: Path) -> None:
    first = run(project, sys.executable, "-m", "example_project")
    assert first.returncode == 0, first.stdout + first.stderr
    assert moved(first.stdout) == 290_000
    assert re.search(r"^customers\s+-\s+50000\s+50000\s+0\s+effectively_once$", first.stdout, re.MULTILINE)
    assert len(re.findall(r"^orders\s+2024-\d\d\.csv\s+20000\s+20000\s", first.stdout, re.MULTILINE)) == 12
    with duckdb.connect(str(project / ".faucet_data" / "warehouse.duckdb"), read_only=True) as warehouse:
        counts = [
            warehouse.execute(f"SELECT count(*), count(DISTINCT {key}) FROM {table}").fetchone()
            for table, key in (("customers", "customer_id"), ("orders", "order_id"))
        ]
    assert counts == [(50_000, 50_000), (240_000, 240_000)]
    instance = dg.DagsterInstance.from_config(str(project / ".dagster_home"))
    # One run of the warehouse's pool at a time under the run queue (DuckDB: one writer per file).
    pools = instance.get_concurrency_config().pool_config
    assert (pools.pool_granularity, pools.default_pool_limit) == (PoolGranularity.RUN, 1)
    instance.dispose()

    second = run(project, sys.executable, "-m", "example_project")
    assert second.returncode == 0, second.stdout + second.stderr
    assert moved(second.stdout) == 0


def test_the_component_loads_from_defs_yaml_through_dg(project: Path) -> None:
    dg = Path(sys.executable).with_name("dg")
    listed = run(project, str(dg), "list", "defs", "--json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    defs = json.loads(listed.stdout)
    assets = {asset["asset_key"]: asset for asset in defs["assets"]}
    yaml_lines = (project / "example_project" / "defs" / "shop" / "defs.yaml").read_text().splitlines()
    for name in ("customers", "orders"):
        assert set(assets[name]["kinds"]) == {"faucet", "files", "duckdb"}
        assert assets[name]["group_name"] == "shop"
        assert not assets[name].get("deps")  # no invented upstream asset
        # The code reference is the line that declares the sync.
        line = yaml_lines.index(f"    - name: {name}") + 1
        assert assets[name]["source"].endswith(f"defs/shop/defs.yaml:{line}")
    assert [schedule["name"] for schedule in defs["schedules"]] == ["faucet_orders_schedule"]
    assert [sensor["name"] for sensor in defs["sensors"]] == ["faucet_orders_shards_sensor"]
    assert "warning" not in listed.stderr.lower(), listed.stderr


def test_the_same_assets_pointed_at_postgresql(project: Path, postgres_url: str) -> None:
    # What docs/syncs.md says: replace the warehouse connection in defs.yaml.
    defs_yaml = project / "example_project" / "defs" / "shop" / "defs.yaml"
    duckdb_warehouse = (
        "connector: duckdb\n      config:\n"
        '        path: "{{ context.project_root }}/.faucet_data/warehouse.duckdb"'
    )
    text = defs_yaml.read_text()
    assert duckdb_warehouse in text
    defs_yaml.write_text(
        text.replace(duckdb_warehouse, f"connector: postgres\n      config:\n        url: {postgres_url}")
    )
    first = run(project, sys.executable, "-m", "example_project")
    assert first.returncode == 0, first.stdout + first.stderr
    assert moved(first.stdout) == 290_000
    with psycopg.connect(postgres_url) as connection:
        counts = [
            connection.execute(f"SELECT count(*), count(DISTINCT {key}) FROM {table}").fetchone()
            for table, key in (("customers", "customer_id"), ("orders", "order_id"))
        ]
    assert counts == [(50_000, 50_000), (240_000, 240_000)]


def test_code_servers_starting_together_generate_the_samples_once(tmp_path: Path) -> None:
    # `dg dev` starts the webserver's and the daemon's code servers at once: each generates the
    # samples it finds missing (smaller ones here), and none may fail on another's partial file.
    script = (
        "import sys; from pathlib import Path; import example_project.sample_data as s; "
        "s.CUSTOMERS = 2000; s.ORDERS_PER_MONTH = 2000; s.ensure_sample_data(Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE)}
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outcomes = [(process.wait(timeout=300), process.communicate()[1]) for process in starts]
    assert [code for code, _ in outcomes] == [0, 0, 0, 0], outcomes
    orders = tmp_path / ".faucet_data" / "samples" / "orders"
    assert sorted(path.name for path in orders.iterdir()) == [f"2024-{m:02d}.csv" for m in range(1, 13)]
