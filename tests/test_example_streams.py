"""The example project's streams (``defs/streams/defs.yaml``): order events from NATS JetStream and from
Kafka into PostgreSQL, declared only when their servers' variables are set.

The code location is loaded in-process as ``dagster dev`` loads it (``example_project.definitions``,
from a fresh copy of the example), the events are published with the example's own publisher, and one
tick of each stream's sensor runs against the real servers; its events are stored in a Dagster
instance the way the sensor daemon stores them.
"""

import asyncio
import importlib
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import nats
import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from kafka_topics import delete_topic
from nats.js.errors import NotFoundError

from faucet_dagster.streams.certificates import CERTIFICATE_CHECK
from faucet_dagster.streams.runner_cache import close_cached_streams

EXAMPLE = Path(__file__).resolve().parents[1] / "example_project"
POSTGRES = "FAUCET_EXAMPLE_POSTGRES_URL"
NATS = "FAUCET_EXAMPLE_NATS_URL"
KAFKA = "FAUCET_EXAMPLE_KAFKA_BOOTSTRAP"
EVENTS = 2_000


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the example as a fresh clone has it (its sample data is generated on first load)."""
    copy = tmp_path_factory.mktemp("example") / "example_project"
    shutil.copytree(
        EXAMPLE,
        copy,
        ignore=shutil.ignore_patterns(".faucet_data", ".dagster_home", "__pycache__", ".mypy_cache"),
    )
    return copy


@pytest.fixture
def load(project: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., dg.Definitions]]:
    """``load(**variables)``: the example's definitions, imported afresh with exactly these of the
    stream variables set; the imported modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(project))

    def forget() -> None:
        for name in [n for n in sys.modules if n == "example_project" or n.startswith("example_project.")]:
            del sys.modules[name]

    def load(**variables: str) -> dg.Definitions:
        for name in (POSTGRES, NATS, KAFKA):
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        forget()
        defs: dg.Definitions = importlib.import_module("example_project.definitions").defs
        return defs

    forget()
    yield load
    forget()


PARTITIONS_SENSOR = "faucet_orders_shards_sensor"
"""The orders sync's partitions sensor: declared whatever the variables say."""


def sensor_names(defs: dg.Definitions) -> set[str]:
    """The stream sensors of ``defs`` (the partitions sensor of the bounded orders sync aside)."""
    return {sensor.name for sensor in defs.sensors or []} - {PARTITIONS_SENSOR}


def asset_keys(defs: dg.Definitions) -> set[str]:
    return {
        key.to_user_string()
        for item in defs.assets or []
        for key in (item.keys if isinstance(item, dg.AssetsDefinition) else [item.key])  # type: ignore[union-attr]
    }


def test_without_the_variables_the_example_loads_without_its_streams(
    load: Callable[..., dg.Definitions],
) -> None:
    defs = load()
    dg.Definitions.validate_loadable(defs)
    assert sensor_names(defs) == set()
    assert PARTITIONS_SENSOR in {sensor.name for sensor in defs.sensors or []}
    assert {"customers", "orders"} <= asset_keys(defs)
    assert not {"order_events_nats", "order_events_kafka"} & asset_keys(defs)

    # Each stream needs its own source and the warehouse: one is declared without the other.
    only_nats = load(**{POSTGRES: "postgresql://unused/db", NATS: "nats://unused:4222"})
    assert sensor_names(only_nats) == {"order_events_nats_stream"}
    assert not sensor_names(load(**{NATS: "nats://unused:4222", KAFKA: "unused:9092"}))


@pytest.fixture
def fresh_sources(nats_url: str, kafka_bootstrap: str) -> Iterator[None]:
    """The example's fixed JetStream stream and Kafka topic, absent before the test and removed after
    it (the sensors' cached sessions are closed first), so an external server may hold old ones."""

    async def delete_stream() -> None:
        client = await nats.connect(nats_url)
        try:
            await client.jetstream().delete_stream("ORDER_EVENTS")
        except NotFoundError:
            pass  # absent already: what we want
        finally:
            await client.close()

    def delete_topic_if_present() -> None:
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        if "order_events" in admin.list_topics(timeout=10).topics:
            delete_topic(kafka_bootstrap, "order_events")

    asyncio.run(delete_stream())
    delete_topic_if_present()
    try:
        yield
    finally:
        close_cached_streams()
        asyncio.run(delete_stream())
        delete_topic_if_present()


def stored_events(url: str, table: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as connection:
        return connection.execute(f"SELECT event_id, order_id, status, amount FROM {table}").fetchall()


def test_with_the_variables_each_stream_certifies_its_events_in_one_sensor_tick(
    load: Callable[..., dg.Definitions],
    fresh_sources: None,
    nats_url: str,
    kafka_bootstrap: str,
    postgres_url: str,
    tmp_path: Path,
) -> None:
    defs = load(**{POSTGRES: postgres_url, NATS: nats_url, KAFKA: kafka_bootstrap})
    dg.Definitions.validate_loadable(defs)
    assert sensor_names(defs) == {"order_events_nats_stream", "order_events_kafka_stream"}
    publish = importlib.import_module("example_project.publish")
    published = {
        "nats": publish.order_events(EVENTS),
        "kafka": publish.order_events(EVENTS),
    }
    asyncio.run(publish.publish_nats(nats_url, published["nats"]))
    publish.publish_kafka(kafka_bootstrap, published["kafka"])

    # The instance's folder becomes DAGSTER_HOME, where the streams keep their state store, as with
    # `dagster dev`; it outlives the instance, for the sessions closed after the test.
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        for source in ("nats", "kafka"):
            name = f"order_events_{source}"
            sensor = defs.resolve_sensor_def(f"{name}_stream")
            assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
            # The first tick starts the reader (its first epoch certified in the background); the
            # ticks after it report certificates, each once, until every event is reported.
            key = dg.AssetKey([name])
            cursor, reported, ends = None, 0, time.monotonic() + 300
            while reported < EVENTS:
                assert time.monotonic() < ends, f"{name}: {reported} of {EVENTS} events reported"
                result = sensor.evaluate_tick(
                    dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs)
                )
                cursor = result.cursor
                for event in result.asset_events:
                    instance.report_runless_asset_event(event)
                    if isinstance(event, dg.AssetMaterialization):
                        reported += int(str(event.metadata["faucet/rows_written"].value))
                if reported < EVENTS:
                    time.sleep(0.5)

            records = instance.fetch_materializations(key, limit=100).records
            materializations = [record.asset_materialization for record in reversed(records)]
            assert materializations, f"{name}: no certificate materialization"
            assert all(m is not None for m in materializations)
            metadata = [m.metadata for m in materializations if m is not None]
            sequences = [
                int(str(r.data["sequence"])) for m in metadata for r in m["faucet/certificates"].value.records
            ]
            assert sequences == list(range(1, len(sequences) + 1))
            assert sum(int(str(m["faucet/rows_written"].value)) for m in metadata) == EVENTS
            assert {m["faucet/delivery"].value for m in metadata} == {"effectively_once"}
            coverage = metadata[-1]["faucet/coverage"].value
            assert isinstance(coverage, dg.TableMetadataValue)
            assert {row.data["domain"].split("/")[0] for row in coverage.records} == {source}
            checks = instance.event_log_storage.get_asset_check_execution_history(
                dg.AssetCheckKey(key, CERTIFICATE_CHECK), limit=100
            )
            assert len(checks) == len(metadata)

            rows = stored_events(postgres_url, name)
            expected = [(e["event_id"], e["order_id"], e["status"], e["amount"]) for e in published[source]]
            assert sorted(rows) == sorted(expected), f"{name}: every event exactly once"
