"""The README's delivery table says what the planner says: each row is checked against `faucet plan`
on the pairs of docs/*-pairs.yaml that it stands for (offline: nothing connects)."""

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import yaml

from faucet_dagster.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
PAIR_FILES = ("delivery-pairs.yaml", "duckdb-pairs.yaml", "delta-pairs.yaml")

ROWS: dict[str, tuple[str, ...]] = {
    # The row's first cell -> the pairs it stands for (a `+dead_letter` suffix plans it with a route).
    "files -> SQLite, PostgreSQL|append": ("files_to_sqlite_bounded_append",),
    "files -> SQLite, PostgreSQL|upsert by key / replace": ("files_to_postgres_bounded_replace",),
    "SQL or PostgreSQL table -> SQLite, PostgreSQL|append": ("sql_table_to_postgres_bounded_append",),
    "NATS -> SQLite, PostgreSQL|append": ("nats_to_sqlite_bounded_append",),
    "Kafka -> SQLite|append": ("kafka_to_sqlite_bounded_append",),
    "Kafka -> PostgreSQL|append, versioned upsert": (
        "kafka_to_postgres_append",
        "kafka_to_postgres_versioned_upsert",
    ),
    "Kafka -> PostgreSQL|upsert": ("kafka_to_postgres_upsert",),
    "NATS -> PostgreSQL|append, upsert": ("nats_to_postgres_append", "nats_to_postgres_upsert"),
    "Kafka, NATS -> NATS|append": ("kafka_to_nats_append", "nats_to_nats_append"),
    "PostgreSQL CDC -> PostgreSQL|apply changes": ("postgres_cdc_to_postgres_apply_changes",),
    "files, DuckDB, SQL or PostgreSQL table -> DuckDB|append": (
        "files_to_duckdb_bounded_append",
        "duckdb_to_duckdb_bounded_append",
    ),
    "files -> DuckDB|upsert by key / replace": (
        "files_to_duckdb_bounded_upsert",
        "files_to_duckdb_bounded_replace",
    ),
    "NATS, Kafka -> DuckDB|append; upsert from NATS": (
        "nats_to_duckdb_append",
        "nats_to_duckdb_upsert",
        "kafka_to_duckdb_append",
    ),
    "files -> Delta Lake|append": ("files_to_delta_bounded_append",),
    "files -> Delta Lake|upsert by key / replace": (
        "files_to_delta_bounded_upsert",
        "files_to_delta_bounded_replace",
    ),
    "NATS, Kafka -> Delta Lake|append; upsert from NATS": (
        "nats_to_delta_append",
        "nats_to_delta_upsert",
        "kafka_to_delta_append",
    ),
    "any, with a dead-letter route|append": ("files_to_sqlite_bounded_append+dead_letter",),
}
SINKS = {
    "sql": ("SQLite", "PostgreSQL"),
    "postgres": ("PostgreSQL",),
    "nats": ("NATS",),
    "duckdb": ("DuckDB",),
    "delta": ("Delta Lake",),
}
"""How the table names each sink connector."""
VERDICTS = {"effectively_once": "effectively-once", "at_least_once": "at-least-once"}


def readme_rows() -> list[list[str]]:
    """The rows of the README's table under "Delivery in one screen", as lists of cells."""
    section = (ROOT / "README.md").read_text().split("## Delivery in one screen", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| source -> sink | mode | policy | delivery |"), lines[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def documented_pairs() -> dict[str, dict[str, Any]]:
    return {
        pair["name"]: pair
        for file in PAIR_FILES
        for pair in yaml.safe_load((ROOT / "docs" / file).read_text())["pairs"]
    }


def faucet_plan(pair: dict[str, Any], folder: Path) -> dict[str, Any]:
    """What `faucet plan -f PAIR.yaml --json` prints for ``pair``."""
    written = folder / f"{pair['name']}.yaml"
    written.write_text(yaml.safe_dump(pair))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["plan", "-f", str(written), "--json"])
    result: dict[str, Any] = json.loads(printed.getvalue())
    return result


def test_every_row_of_the_readmes_delivery_table_is_what_the_planner_says(tmp_path: Path) -> None:
    rows = readme_rows()
    keys = [f"{row[0]}|{row[2]}" for row in rows]
    assert sorted(keys) == sorted(ROWS), "a row of the README's delivery table is not checked here"
    pairs = documented_pairs()
    for (pair_cell, mode, policy, delivery, _mechanism), key in zip(rows, keys, strict=True):
        for named in ROWS[key]:
            name, _, dead_letter = named.partition("+")
            pair = {**pairs[name], "dead_letter": bool(dead_letter)}
            result = faucet_plan(pair, tmp_path)
            where = f"README row {key!r}, pair {named}"
            if not result["accepted"]:
                assert delivery.startswith("refused"), where
                continue
            plan = result["plan"]
            assert delivery.startswith(VERDICTS[plan["delivery"]]), where
            assert mode in ("both", plan["mode"]), where
            assert plan["policy"].replace("_", " ") in policy, where
            if not dead_letter:
                sinks = pair_cell.split("->")[1]
                assert any(shown in sinks for shown in SINKS[pair["sink"]["connector"]]), where
