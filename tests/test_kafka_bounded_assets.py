"""Kafka to SQLite, bounded, through the Dagster assets: the real broker, a persistent instance.

Each materialization reads from the bookmark the previous one stored in Dagster's run storage up to
the high watermarks captured when it starts; messages produced later wait for the next run.
"""

from collections.abc import Callable, Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa
from kafka_topics import create_topic, produce_json

from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster.syncs.assets import faucet_sync_assets
from faucet_dagster.syncs.declaration import FaucetSync


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.DagsterInstance.local_temp(str(home), overrides={"telemetry": {"enabled": False}}) as created:
        yield created


def test_kafka_to_sqlite_materializations_resume_from_the_bookmark(
    kafka_bootstrap: str, unique_name: Callable[..., str], tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    topic = unique_name("topic")
    create_topic(kafka_bootstrap, topic, 4)
    produce_json(kafka_bootstrap, topic, 0, 1000)
    database = tmp_path / "warehouse.db"
    kafka = FaucetConnection(
        connector="kafka", config={"bootstrap_servers": kafka_bootstrap, "group_id": unique_name("group")}
    )
    warehouse = FaucetConnection(connector="sql", config={"url": f"sqlite:///{database}"})
    assets = faucet_sync_assets(
        [
            FaucetSync(
                "orders",
                source=kafka.using(topics=[topic]),
                sink=warehouse.using(table="orders"),
                batch_size=300,
            )
        ]
    )

    def materialize() -> dg.AssetMaterialization:
        result = dg.materialize(assets, instance=instance)
        [event] = result.get_asset_materialization_events()
        return event.materialization

    first = materialize()
    assert first.metadata["faucet/rows_written"].value == 1000
    # Pages interleave partitions differently on every run: at-least-once, and the plan says why.
    assert first.metadata["faucet/delivery"].value == "at_least_once"
    bookmark = first.metadata["faucet/bookmark"].value
    assert isinstance(bookmark, dict)
    assert sorted((item["partition"], item["offset"]) for item in bookmark["positions"]) == [
        (p, 249) for p in range(4)
    ]

    produce_json(kafka_bootstrap, topic, 1000, 200)
    second = materialize()
    assert second.metadata["faucet/rows_read"].value == 200
    third = materialize()
    assert third.metadata["faucet/rows_read"].value == 0

    engine = sa.create_engine(f"sqlite:///{database}")
    try:
        with engine.connect() as connection:
            ids = [row[0] for row in connection.execute(sa.text("SELECT id FROM orders ORDER BY id"))]
    finally:
        engine.dispose()
    assert ids == list(range(1200))
