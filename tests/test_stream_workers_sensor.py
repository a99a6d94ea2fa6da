"""The workers sensor of a stream declared with ``workers: 2`` in the component YAML, evaluated in this
process: it requests the worker runs, and reports every partition group's certificates once."""

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import dagster as dg
from kafka_topics import create_topic, produce_json

from faucet_dagster.components import FaucetComponent
from faucet_dagster.declarations.declared import DECLARED
from faucet_dagster.protocol import EpochCertificate, ReadLimits
from faucet_dagster.runner.members import MemberWorker, group_stream
from faucet_dagster.state import StateStore
from faucet_dagster.streams.certificates import CERTIFICATE_CHECK
from faucet_dagster.streams.health import HEALTH_CHECK
from faucet_dagster.streams.worker_runs import SLOT_TAG
from faucet_dagster.streams.workers import STREAM_TAG


def test_a_yaml_stream_with_two_workers_requests_two_runs_and_reports_each_group(
    kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    topic, name = unique_name("topic"), unique_name("w")
    create_topic(kafka_bootstrap, topic, 12)
    state_url = f"sqlite:///{tmp_path / 'state.db'}"
    component = FaucetComponent.resolve_from_yaml(
        f"""
connections:
  events: {{connector: kafka, config: {{bootstrap_servers: "{kafka_bootstrap}", group_id: g_{name}}}}}
  warehouse: {{connector: postgres, config: {{url: "{postgres_url}"}}}}
streams:
  - name: {name}
    source: {{connection: events, config: {{topics: [{topic}]}}}}
    sink: {{connection: warehouse, config: {{table: events}}}}
    resources: [{topic}]
    state_url: "{state_url}"
    workers: 2
"""
    )
    defs = component.build_stream_defs()
    dg.Definitions.validate_loadable(defs)
    job = defs.resolve_job_def(f"{name}_workers")
    sensor = defs.resolve_sensor_def(f"{name}_stream")
    assert sensor.job_name == job.name
    instance = dg.DagsterInstance.ephemeral()

    first = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=None))
    assert len(first.run_requests or []) == 2, "two worker runs requested"
    assert all(request.tags[STREAM_TAG] == name for request in first.run_requests or [])
    assert sorted(request.tags[SLOT_TAG] for request in first.run_requests or []) == ["0", "1"]
    assert not first.asset_events

    produce_json(kafka_bootstrap, topic, 0, 1_200, partitions=12)
    stream = DECLARED.streams[name]
    assert (stream.workers, stream.group_count) == (2, 2)
    spec = replace(stream.build_spec(), limits=ReadLimits(records=300, idle=0.3))

    async def certify() -> list[EpochCertificate]:
        store = StateStore(state_url)
        worker = MemberWorker(spec, store, groups=stream.group_count, worker_id="w1")
        certified: list[EpochCertificate] = []
        try:
            while sum(sum(c.row_counts.values()) for c in certified) < 1_200:
                certified += await worker.run_round()
        finally:
            await worker.close()
            store.close()
        return certified

    certified = asyncio.run(certify())
    groups = [group_stream(name, g, 2) for g in range(2)]
    assert {c.stream for c in certified} == set(groups), "one member runs both groups"

    second = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=first.cursor))
    materializations = [e for e in second.asset_events if isinstance(e, dg.AssetMaterialization)]
    assert len(materializations) == 1, "one materialization a tick for every group's certificates"
    [report] = materializations
    listed = [
        (r.data["stream"], int(str(r.data["sequence"])))
        for r in report.metadata["faucet/certificates"].value.records
    ]
    assert sorted(listed) == sorted((c.stream, c.sequence) for c in certified)
    assert report.metadata["faucet/rows_written"].value == 1_200
    marks = json.loads(str(second.cursor))["reported_through"]
    assert marks == {g: max(c.sequence for c in certified if c.stream == g) for g in groups}
    third = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=second.cursor))
    assert not third.asset_events, "each certificate is reported once"

    checks = {key.name: check for check in defs.asset_checks or [] for key in check.check_keys}
    result = checks[CERTIFICATE_CHECK]()
    assert result.passed and result.metadata["faucet/certificates_checked"].value == len(certified)
    health = checks[HEALTH_CHECK](dg.build_asset_check_context(instance=instance))
    # The certificates are fine, but no worker slot has a run (nothing launched the runs requested).
    assert not health.passed
    assert f"worker 0 of {name} has no live run" in str(health.description)
    assert f"worker 1 of {name} has no live run" in str(health.description)
