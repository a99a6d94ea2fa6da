"""`faucet check` on a code location: every connection connected to, every pair planned, one table."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PIPED = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
"""The environment of a command whose output goes to a pipe: no COLUMNS (a parallel test worker's
terminal would set it), so the table is not wrapped."""


def test_faucet_check_connects_to_every_connection_and_reports_a_table(
    tmp_path: Path, postgres_url: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("id\n1\n")
    missing = postgres_url.rsplit("/", 1)[0] + "/faucet_no_such_database"
    (tmp_path / "location.py").write_text(
        textwrap.dedent(
            f"""\
            import dagster as dg

            from faucet_dagster import FaucetConnection, FaucetSync, faucet_sync_assets

            files = FaucetConnection(connector="files")
            good = FaucetConnection(connector="postgres", config={{"url": {{"env": "CHECK_PG_URL"}}}})
            bad = FaucetConnection(connector="postgres", config={{"url": {missing!r}}})
            defs = dg.Definitions(
                assets=faucet_sync_assets(
                    [
                        FaucetSync("reachable", files.using(paths=["{data}/*.csv"]), good.using(table="t")),
                        FaucetSync("unreachable", files.using(paths=["{data}/*.csv"]), bad.using(table="t")),
                    ]
                )
            )
            """
        )
    )
    checked = subprocess.run(
        [str(Path(sys.executable).with_name("faucet")), "check", "-m", "location", "-d", str(tmp_path)],
        env={**PIPED, "CHECK_PG_URL": postgres_url},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = checked.stdout + checked.stderr
    assert checked.returncode == 1, output
    lines = checked.stdout.splitlines()
    assert lines[0].split() == ["declaration", "role", "connector", "dataset", "result"]
    rows = {tuple(line.split()[:4]): line for line in lines[1:-1]}
    assert rows[("sync", "reachable", "source", "files")].endswith("  ok")
    assert rows[("sync", "reachable", "sink", "postgres")].endswith("  ok")
    assert rows[("sync", "reachable", "plan", "bounded")].endswith("  accepted")
    assert "FAILED: " in rows[("sync", "unreachable", "sink", "postgres")]
    assert "faucet_no_such_database" in rows[("sync", "unreachable", "sink", "postgres")]
    assert lines[-1] == "5 passed, 1 failed"


def test_faucet_check_finds_a_missing_topic_before_a_stream_sensor_ticks(
    tmp_path: Path, postgres_url: str, kafka_bootstrap: str
) -> None:
    (tmp_path / "streams.py").write_text(
        textwrap.dedent(
            """\
            import dagster as dg

            from faucet_dagster.components import FaucetComponent

            component = FaucetComponent.resolve_from_yaml('''
            streams:
              - name: events
                source:
                  connector: kafka
                  config: {bootstrap_servers: {env: CHECK_KAFKA}, group_id: g, topics: [faucet_no_such_topic]}
                sink: {connector: postgres, config: {url: {env: CHECK_PG_URL}}}
                resources: [faucet_no_such_topic]
            ''')
            defs = component.build_stream_defs()
            """
        )
    )
    checked = subprocess.run(
        [str(Path(sys.executable).with_name("faucet")), "check", "-m", "streams", "-d", str(tmp_path)],
        env={**PIPED, "CHECK_PG_URL": postgres_url, "CHECK_KAFKA": kafka_bootstrap},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    rows = {tuple(line.split()[:4]): line for line in checked.stdout.splitlines()[1:-1]}
    assert (
        "FAILED: topic faucet_no_such_topic does not exist" in rows[("stream", "events", "source", "kafka")]
    )
    assert rows[("stream", "events", "sink", "postgres")].endswith("  ok")
