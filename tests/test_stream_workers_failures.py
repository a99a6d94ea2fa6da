"""A worker run that fails at once (here: a configuration naming an environment variable that is not
set) is not relaunched on every tick: after three failed runs in a row its worker slot is backed off,
and the sensor's tick and the ``faucet_stream_health`` check name the slot, the failures and the last
run's error with the remedy. The runs are real runs of the worker job on a Dagster instance. A worker
run whose member lease lapsed is named by the check too (a warning until it is dead, then an error)."""

import time
from collections.abc import Callable
from pathlib import Path

import dagster as dg

from faucet_dagster.declarations.resources import FaucetConnection
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import MemberRegistry
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.definitions import build_stream_defs
from faucet_dagster.streams.health import HEALTH_CHECK
from faucet_dagster.streams.worker_runs import (
    MAX_FAILURES,
    SLOT_TAG,
    STREAM_TAG,
    SlotState,
    backoff_seconds,
    census,
    workers_stall,
)

Built = tuple[FaucetStream, dg.JobDefinition, dg.SensorDefinition, dict[str, dg.AssetChecksDefinition]]


def workers_defs(name: str, source: FaucetConnection, sink: FaucetConnection, tmp_path: Path) -> Built:
    """A stream on two workers, its worker job, its sensor and its checks by name."""
    stream = FaucetStream(
        name=name,
        source=source.using(topics=["events"]),
        sink=sink.using(table="events"),
        resources=("events",),
        state_url=f"sqlite:///{tmp_path / 'state.db'}",
        workers=2,
    )
    defs = build_stream_defs([stream])
    checks = {key.name: check for check in defs.asset_checks or [] for key in check.check_keys}
    return stream, defs.resolve_job_def(f"{name}_workers"), defs.resolve_sensor_def(f"{name}_stream"), checks


def test_a_worker_that_keeps_failing_is_backed_off_and_reported(
    kafka_bootstrap: str, postgres_url: str, unique_name: Callable[..., str], tmp_path: Path
) -> None:
    name, missing = unique_name("w"), unique_name("T_UNSET").upper()
    password = {"env": missing}
    warehouse = FaucetConnection(
        connector="postgres",
        config={
            "url": postgres_url,
            "auth": {"type": "user_password", "config": {"username": "faucet", "password": password}},
        },
    )
    kafka = FaucetConnection(
        connector="kafka", config={"bootstrap_servers": kafka_bootstrap, "group_id": name}
    )
    stream, job, sensor, checks = workers_defs(name, kafka, warehouse, tmp_path)
    instance = dg.DagsterInstance.ephemeral()

    def fail_once() -> None:
        result = job.execute_in_process(
            instance=instance, tags={STREAM_TAG: name, SLOT_TAG: "0"}, raise_on_error=False
        )
        assert not result.success

    def slots_requested() -> list[str]:
        tick = sensor.evaluate_tick(dg.build_sensor_context(instance=instance))
        return sorted(request.tags[SLOT_TAG] for request in tick.run_requests or [])

    for _ in range(MAX_FAILURES - 1):
        fail_once()
    assert slots_requested() == ["0", "1"], "a slot that failed fewer times is requested again at once"

    fail_once()
    tick = sensor.evaluate_tick(dg.build_sensor_context(instance=instance))
    assert sorted(request.tags[SLOT_TAG] for request in tick.run_requests or []) == ["1"]
    [health] = [e for e in tick.asset_events if isinstance(e, dg.AssetCheckEvaluation)]
    assert health.check_name == HEALTH_CHECK and not health.passed
    assert health.severity is dg.AssetCheckSeverity.ERROR
    reason = str(health.metadata["faucet/reason"].value)
    assert f"worker 0 of {name} failed {MAX_FAILURES} runs in a row" in reason
    assert missing in reason, "the last run's error names what is wrong"
    assert "not requested again for" in reason
    assert "fix what the last error names" in str(health.metadata["faucet/remedy"].value)

    with StateStore(stream.state_url) as store:
        registry = MemberRegistry(store)
        [slot, _], _ = census(
            instance,
            name,
            job.name,
            2,
            registry.live(name),
            registry.lapsed(name),
            lease_seconds=stream.lease_seconds,
        )
    assert slot.failures is not None and slot.failures.count == MAX_FAILURES
    assert slot.backing_off(slot.failures.last_ended + backoff_seconds(MAX_FAILURES) - 1)
    assert not slot.backing_off(slot.failures.retry_at + 1), "requested again once the backoff passed"
    assert backoff_seconds(MAX_FAILURES + 1) == 2 * backoff_seconds(MAX_FAILURES)

    checked = checks[HEALTH_CHECK](dg.build_asset_check_context(instance=instance))
    assert not checked.passed
    assert f"worker 0 of {name} failed {MAX_FAILURES} runs in a row" in str(checked.description)
    assert f"worker 1 of {name} has no live run" in str(checked.description)


def test_the_health_check_names_a_worker_whose_member_lease_lapsed(
    unique_name: Callable[..., str], tmp_path: Path
) -> None:
    name = unique_name("w")
    kafka = FaucetConnection(connector="kafka", config={"bootstrap_servers": "localhost:9", "group_id": name})
    warehouse = FaucetConnection(connector="postgres", config={"url": "postgresql://app@localhost:9/db"})
    stream, job, sensor, checks = workers_defs(name, kafka, warehouse, tmp_path)
    instance = dg.DagsterInstance.ephemeral()
    # A started worker run of slot 0 whose member joined and then stopped renewing (its process froze).
    run = instance.create_run_for_job(
        job, status=dg.DagsterRunStatus.STARTED, tags={STREAM_TAG: name, SLOT_TAG: "0"}
    )
    with StateStore(stream.state_url) as store:
        registry = MemberRegistry(store)
        registry.join(name, run.run_id, 0.001)
        ends = time.monotonic() + 60
        while run.run_id not in registry.lapsed(name):
            assert time.monotonic() < ends, "the member lease did not lapse"
            time.sleep(0.05)

        tick = sensor.evaluate_tick(dg.build_sensor_context(instance=instance))
        assert [request.tags[SLOT_TAG] for request in tick.run_requests or []] == ["1"]
        [health] = [e for e in tick.asset_events if isinstance(e, dg.AssetCheckEvaluation)]
        assert not health.passed and health.severity is dg.AssetCheckSeverity.WARN, "not dead yet"
        said = f"worker 0 of {name} (run {run.run_id}) has no live member lease: it lapsed"
        assert said in str(health.metadata["faucet/reason"].value)
        assert instance.get_run_by_id(run.run_id).status is dg.DagsterRunStatus.STARTED  # type: ignore[union-attr]

        checked = checks[HEALTH_CHECK](dg.build_asset_check_context(instance=instance))
        assert not checked.passed and said in str(checked.description)

        # Lapsed for longer than three leases: dead, an error; the sensor marks the run failed.
        slots, _ = census(
            instance, name, job.name, 2, (), {run.run_id: 100.0}, lease_seconds=stream.lease_seconds
        )
        assert slots[0].state is SlotState.LAPSED and slots[0].dead
        stall = workers_stall(name, slots, requested={1})
        assert stall is not None and stall.severity is dg.AssetCheckSeverity.ERROR
        assert said in stall.reason and "requests a replacement" in stall.remedy
