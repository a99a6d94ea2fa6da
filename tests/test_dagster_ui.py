"""What a Dagster user sees of the example project's streams and syncs, asked of a real
``dagster-webserver`` through the GraphQL API its pages use, while a real ``dagster-daemon run`` ticks
the streams (the deployment: :mod:`ui_deployment`):

* the stream's sink asset lists its sensor (its page's "Automation details"), and the sensor names the
  asset; the orders sync lists its schedule, running, and its partitions sensor;
* each tick's summary is where the UI shows a tick: its reason (the tick's tooltip and details), its
  log ("View logs"), and the description of the one materialization it reported;
* a stopped server halts the stream: every tick says so (never "the source had nothing new" or
  "started reading" in between), the daemon's log gets no stack trace for it, and the health check
  fails once, with the remedy; the server back, the stream runs and the check passes again.

The screenshots of those pages in ``docs/images`` are taken by ``scripts/screenshots.py``.
"""

import asyncio
import importlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ui_deployment import BOUND, UiDeployment, sensor_selector

from faucet_dagster.testing import KafkaServer, NatsServer, PostgresServer
from faucet_dagster.testing.servers import make_unique_name

NATS_ASSET = ["order_events_nats"]
NATS_SENSOR = "order_events_nats_stream"
EVENTS = 2_000

AUTOMATIONS = """
query($path: [String!]!) {
  assetNodeOrError(assetKey: {path: $path}) {
    __typename
    ... on AssetNode { targetingInstigators { __typename ... on Sensor { name } ... on Schedule { name } } }
  }
}"""
SENSOR = """
query($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    __typename
    ... on Sensor {
      assetSelection { assetKeys { path } }
      sensorState {
        ticks(limit: 50) {
          status timestamp skipReason error { message }
          logEvents { events { message level } }
        }
      }
    }
  }
}"""
SCHEDULE = """
query($selector: ScheduleSelector!) {
  scheduleOrError(scheduleSelector: $selector) { __typename ... on Schedule { scheduleState { status } } }
}"""
MATERIALIZATIONS = """
query($path: [String!]!) {
  assetOrError(assetKey: {path: $path}) {
    ... on Asset {
      assetMaterializations(limit: 200) {
        timestamp description
        metadataEntries {
          label __typename ... on IntMetadataEntry { intValue } ... on TextMetadataEntry { text }
        }
      }
    }
  }
}"""
CHECKS = """
query($path: [String!]!, $check: String!) {
  assetCheckExecutions(assetKey: {path: $path}, checkName: $check, limit: 100) {
    status
    evaluation { success description timestamp metadataEntries { label ... on TextMetadataEntry { text } } }
  }
}"""


@pytest.fixture(scope="module")
def nats() -> Iterator[NatsServer]:
    """A NATS server of this module's own: the tests stop and restart it."""
    with NatsServer() as server:
        yield server.start()


@pytest.fixture(scope="module")
def ui(
    nats: NatsServer, postgres_server: PostgresServer, kafka_server: KafkaServer
) -> Iterator[UiDeployment]:
    postgres_server.start()
    database = make_unique_name("ui", "dagster_ui")
    with tempfile.TemporaryDirectory(prefix="faucet_ui_") as root:
        deployment = UiDeployment(
            Path(root),
            {
                "FAUCET_EXAMPLE_POSTGRES_URL": postgres_server.create_database(database),
                "FAUCET_EXAMPLE_NATS_URL": nats.url,
                "FAUCET_EXAMPLE_KAFKA_BOOTSTRAP": kafka_server.start().bootstrap,
            },
        )
        try:
            publish = _publisher(deployment)
            asyncio.run(publish.publish_nats(nats.url, publish.order_events(EVENTS)))
            publish.publish_kafka(kafka_server.bootstrap, publish.order_events(EVENTS))
            yield deployment.start()
        finally:
            deployment.stop()
            if postgres_server.is_running:
                postgres_server.drop_database(database)


def _publisher(deployment: UiDeployment) -> Any:
    sys.path.insert(0, str(deployment.project))
    try:
        return importlib.import_module("example_project.publish")
    finally:
        sys.path.remove(str(deployment.project))


def ticks(ui: UiDeployment, sensor: str) -> list[dict[str, Any]]:
    """The sensor's ticks, oldest first (the last one may still be running: ``STARTED``)."""
    found = ui.graphql(SENSOR, selector=sensor_selector(sensor))["sensorOrError"]
    assert found["__typename"] == "Sensor", found
    return sorted(found["sensorState"]["ticks"], key=lambda tick: tick["timestamp"])


def materializations(ui: UiDeployment, path: list[str]) -> list[dict[str, Any]]:
    found = ui.graphql(MATERIALIZATIONS, path=path)["assetOrError"]["assetMaterializations"]
    return sorted(found, key=lambda m: float(m["timestamp"]))


def entry(materialization: dict[str, Any], label: str) -> Any:
    [found] = [e for e in materialization["metadataEntries"] if e["label"] == label]
    return found.get("intValue", found.get("text"))


def evaluations(ui: UiDeployment, path: list[str], check: str) -> list[dict[str, Any]]:
    found = ui.graphql(CHECKS, path=path, check=check)["assetCheckExecutions"]
    return sorted((e["evaluation"] for e in found if e["evaluation"]), key=lambda e: e["timestamp"])


def test_the_stream_asset_lists_its_sensor_and_the_sync_its_running_schedule(ui: UiDeployment) -> None:
    for path, sensor in ((NATS_ASSET, NATS_SENSOR), (["order_events_kafka"], "order_events_kafka_stream")):
        node = ui.graphql(AUTOMATIONS, path=path)["assetNodeOrError"]
        assert {"__typename": "Sensor", "name": sensor} in node["targetingInstigators"]
        selection = ui.graphql(SENSOR, selector=sensor_selector(sensor))["sensorOrError"]["assetSelection"]
        assert {"path": path} in selection["assetKeys"]
    orders = ui.graphql(AUTOMATIONS, path=["orders"])["assetNodeOrError"]["targetingInstigators"]
    assert {"__typename": "Sensor", "name": "faucet_orders_shards_sensor"} in orders
    assert {"__typename": "Schedule", "name": "faucet_orders_schedule"} in orders
    schedule = ui.graphql(
        SCHEDULE,
        selector={
            "repositoryLocationName": "example_project",
            "repositoryName": "__repository__",
            "scheduleName": "faucet_orders_schedule",
        },
    )["scheduleOrError"]
    assert schedule["scheduleState"]["status"] == "RUNNING", (
        "the orders sync is scheduled hourly from the start"
    )


def test_each_tick_says_what_it_did_where_the_ui_shows_a_tick(ui: UiDeployment) -> None:
    for path in (NATS_ASSET, ["order_events_kafka"]):
        ui.wait_for(
            f"{EVENTS} events of {path[0]} reported",
            lambda path=path: (
                sum(entry(m, "faucet/rows_written") for m in materializations(ui, path)) >= EVENTS
            ),
        )

    def reporting_ticks() -> list[dict[str, Any]]:
        return [tick for tick in ticks(ui, NATS_SENSOR) if str(tick["skipReason"]).startswith("certified ")]

    # The daemon stores a tick's reports before it ends the tick with its reason: wait for the reason.
    ui.wait_for("a tick that reported the certified epochs in its reason", lambda: bool(reporting_ticks()))
    reported = reporting_ticks()
    assert reported, "a tick reported the certified epochs in its reason"
    tick = reported[-1]
    # "View logs": the tick's own log holds its summary too.
    assert tick["skipReason"] in [event["message"] for event in tick["logEvents"]["events"]]
    # On the asset's page: the report's description is the tick's summary, its numbers typed.
    reports = materializations(ui, NATS_ASSET)
    assert all(str(m["description"]).startswith("certified ") for m in reports)
    assert any(m["description"] == tick["skipReason"] for m in reports) or tick["skipReason"].startswith(
        str(reports[-1]["description"])
    )
    kinds = {e["label"]: e["__typename"] for e in reports[-1]["metadataEntries"]}
    assert kinds["faucet/rows_written"] == "IntMetadataEntry"
    assert kinds["faucet/rows_per_second"] == "FloatMetadataEntry"
    for identifier in ("faucet/last_sequence", "faucet/fencing_token", "faucet/rows_dead_lettered"):
        assert kinds[identifier] == "TextMetadataEntry", f"{identifier} is not a measure to plot"
    # One materialization and one certificate evaluation a tick, whatever the number of epochs.
    certified = evaluations(ui, NATS_ASSET, "faucet_epoch_certificate")
    assert len(certified) == len(reports) <= len(ticks(ui, NATS_SENSOR))


def test_a_stopped_server_halts_the_stream_on_every_tick_and_fails_its_health_once(
    ui: UiDeployment, nats: NatsServer
) -> None:
    ui.wait_for(
        "the stream healthy",
        lambda: [e["success"] for e in evaluations(ui, NATS_ASSET, "faucet_stream_health")][-1:] == [True],
    )
    nats.stop()
    stopped = time.time()
    failing: list[dict[str, Any]] = []

    def failed() -> bool:
        failing[:] = [e for e in evaluations(ui, NATS_ASSET, "faucet_stream_health") if not e["success"]]
        return bool(failing)

    ui.wait_for("the health check failing", failed)
    first_halted = failing[0]["timestamp"]
    # Three more ticks, each of which must still say the stream is halted.
    ui.wait_for(
        "three ticks after the halt",
        lambda: len([t for t in ticks(ui, NATS_SENSOR) if t["timestamp"] > first_halted]) >= 3,
    )
    since = [t for t in ticks(ui, NATS_SENSOR) if t["timestamp"] >= stopped and t["status"] != "STARTED"]
    halted = [t for t in since if str(t["skipReason"]).startswith("halted since ")]
    assert halted, [t["skipReason"] for t in since]
    assert all(t["status"] == "SKIPPED" and t["error"] is None for t in since), [
        (t["status"], t["error"], t["skipReason"]) for t in since
    ]
    after = [t for t in since if t["timestamp"] >= halted[0]["timestamp"]]
    assert [t["skipReason"].split(": ", 1)[0][:12] for t in after] == ["halted since"] * len(after), [
        t["skipReason"] for t in after
    ]
    assert all("Remedy:" in t["skipReason"] for t in after)
    [failure] = failing  # once, not once a tick
    remedy = [e["text"] for e in failure["metadataEntries"] if e["label"] == "faucet/remedy"]
    assert remedy and "reachable" in remedy[0]

    daemon_log = next(log for log in ui.logs if log.name == "daemon.log").read_text(errors="replace")
    assert "Traceback" not in daemon_log, "a halted stream's ticks write no stack trace to the daemon's log"

    nats.start()
    ui.wait_for(
        "the health check passing again",
        lambda: [e["success"] for e in evaluations(ui, NATS_ASSET, "faucet_stream_health")][-1:] == [True],
        bound=BOUND,
    )
    assert len([e for e in evaluations(ui, NATS_ASSET, "faucet_stream_health") if not e["success"]]) == 1
