"""A stream with ``workers: N``: N long-running Dagster runs, each a member of the stream.

:func:`build_worker_defs` gives a stream with ``workers > 1``:

* a job ``<stream>_workers`` of one op that runs a :class:`~faucet_dagster.runner.members.MemberWorker`
  (member id: the run id) round after round until the run is terminated: it holds its member lease
  and the leases of its partition groups, runs their epochs continuously, logs every certified epoch
  to the run's logs, and on termination closes its groups at certified positions and releases every
  lease;
* a sensor ``<stream>_stream`` that, each tick, reports every group's new certificates as
  materializations of the sink asset (each once: the cursor holds a report mark per group, as the
  single-worker sensor's does for its stream) and keeps N workers: it counts the runs of the job that
  are queued, starting, or started and not dead, marks a dead one failed, and requests a run for
  each missing worker. A started run is dead when its member lease lapsed
  :data:`DEAD_AFTER_SECONDS` ago (at least three leases: its process died, a kill -9 or a lost node)
  or when it never joined within :data:`START_GRACE_SECONDS`. The runs go through the
  instance's run coordinator and run launcher, so the Kubernetes, Docker or ECS launcher places them.

Stopping the sensor stops requesting runs; the running workers are stopped by terminating their runs
(each closes and releases on termination).
"""

import asyncio
import json
import logging
import os
import time
from collections.abc import Sequence

import dagster as dg

from faucet_dagster.protocol import ConfigError
from faucet_dagster.runner.members import MemberWorker, group_stream
from faucet_dagster.sensors import (
    CERTIFICATE_CHECK,
    MAX_REPORTS_PER_TICK,
    AssetKeyLike,
    FaucetStream,
    certificate_events,
    certificate_problems,
    chain_problems,
)
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import MemberRegistry
from faucet_dagster.stream_health import HEALTH_CHECK, health_evaluation, uncertain_stall

logger = logging.getLogger(__name__)

STREAM_TAG = "faucet/stream"
START_GRACE_SECONDS = 120.0
"""How long a started worker run may take to join the membership before it is counted as dead."""
DEAD_AFTER_SECONDS = 20.0
"""How long (at least three leases) a worker run's member lease must have lapsed before the run is
counted as dead: a loaded worker that renews late, then joins again, is not replaced."""
IN_PROGRESS = (
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
)
CURSOR_VERSION = 1


def worker_job_name(stream: FaucetStream) -> str:
    return f"{stream.name}_workers"


def worker_job(stream: FaucetStream) -> dg.JobDefinition:
    """The per-stream job: one op running a member worker until the run is terminated."""
    resource_keys = {e.resource_key for e in (stream.source, stream.sink) if e.resource_key}

    @dg.op(name=f"{stream.name}_worker", required_resource_keys=resource_keys or None)
    def _worker(context: dg.OpExecutionContext) -> None:
        run_worker(context, stream)

    @dg.job(
        name=worker_job_name(stream),
        executor_def=dg.in_process_executor,
        tags={STREAM_TAG: stream.name},
        description=f"A long-running worker of faucet stream {stream.name} ({stream.workers} of them).",
    )
    def _job() -> None:
        _worker()

    return _job


def run_worker(context: dg.OpExecutionContext, stream: FaucetStream) -> None:
    """Run a member of ``stream`` (id: the run id) until the run is terminated, then close it."""
    spec = stream.build_spec(context.resources)
    store = StateStore(stream.state_url)
    worker = MemberWorker(spec, store, groups=stream.group_count, worker_id=context.run_id)
    context.log.info(f"faucet stream {stream.name}: member {context.run_id} (pid {os.getpid()}) joins")

    async def rounds() -> None:
        try:
            while True:
                for certificate in await worker.run_round():
                    rows = sum(certificate.row_counts.values())
                    context.log.info(f"certified epoch {certificate.epoch} ({rows} rows)")
        finally:
            await worker.close()
            context.log.info(f"faucet stream {stream.name}: member {context.run_id} left")

    try:
        asyncio.run(rounds())
    finally:
        store.close()


def parse_cursor(cursor: str | None) -> dict[str, int]:
    """The report mark per group stream from a workers sensor cursor (empty: no cursor)."""
    if not cursor:
        return {}
    try:
        raw = json.loads(cursor)
        marks = raw["reported_through"]
        if raw.get("version") != CURSOR_VERSION or not isinstance(marks, dict):
            raise ValueError(cursor)
        return {str(name): int(value) for name, value in marks.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"the sensor cursor {cursor!r} is not a faucet workers cursor", where="sensor cursor"
        ) from None


def workers_sensor(
    stream: FaucetStream,
    job: dg.JobDefinition,
    *,
    asset_key: AssetKeyLike | None = None,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """The sensor reporting every group's certificates and keeping ``stream.workers`` runs."""
    key = stream.asset_spec(asset_key).key

    @dg.sensor(
        name=f"{stream.name}_stream",
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            f"Keeps {stream.workers} worker runs of faucet stream {stream.name} and reports their "
            "certificates."
        ),
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        with StateStore(stream.state_url) as store:
            events, cursor = _reports(store, stream, key, parse_cursor(context.cursor))
            registry = MemberRegistry(store)
            live = {member.member for member in registry.live(stream.name)}
            lapsed = registry.lapsed(stream.name)
        requests = _missing_workers(context, stream, job, live, lapsed)
        return dg.SensorResult(
            run_requests=requests,
            asset_events=events,
            cursor=cursor,
            skip_reason=None if events or requests else "no new certified epoch; every worker runs",
        )

    return _sensor


def _reports(
    store: StateStore, stream: FaucetStream, key: dg.AssetKey, confirmed: dict[str, int]
) -> tuple[list[dg.AssetMaterialization | dg.AssetCheckEvaluation], str]:
    """Every group's certificates after its report mark, as events; the next cursor."""
    events: list[dg.AssetMaterialization | dg.AssetCheckEvaluation] = []
    marks: dict[str, int] = {}
    per_group = max(1, MAX_REPORTS_PER_TICK // stream.group_count)
    for group in range(stream.group_count):
        name = group_stream(stream.name, group, stream.group_count)
        if name in confirmed:
            store.mark_reported(name, confirmed[name])
            reported = confirmed[name]
        else:
            reported = store.reported_through(name)
        certificates = store.certificates(name, after=reported, limit=per_group)
        for certificate in certificates:
            events.extend(certificate_events(certificate, key))
        marks[name] = certificates[-1].sequence if certificates else reported
    return events, json.dumps({"version": CURSOR_VERSION, "reported_through": marks})


def _missing_workers(
    context: dg.SensorEvaluationContext,
    stream: FaucetStream,
    job: dg.JobDefinition,
    live: set[str],
    lapsed: dict[str, float | None],
) -> list[dg.RunRequest]:
    """Run requests for the workers missing; a started run whose member lapsed is marked failed."""
    runs = context.instance.get_runs(
        filters=dg.RunsFilter(job_name=job.name, statuses=list(IN_PROGRESS), tags={STREAM_TAG: stream.name})
    )
    now = time.time()
    counted = 0
    for run in runs:
        if run.run_id in live:
            counted += 1
            continue
        record = context.instance.get_run_record_by_id(run.run_id)
        started = None if record is None else record.start_time or record.create_timestamp.timestamp()
        since = lapsed.get(run.run_id)
        dead = since is not None and since > max(DEAD_AFTER_SECONDS, 3 * stream.lease_seconds)
        stale = run.run_id not in lapsed and started is not None and now - started > START_GRACE_SECONDS
        if run.status is dg.DagsterRunStatus.STARTED and (dead or stale):
            context.log.warning(f"worker run {run.run_id} of {stream.name} has no live member: failed")
            context.instance.report_run_failed(
                run, f"the faucet member lease of this worker of {stream.name} lapsed: its process died"
            )
            continue
        counted += 1
    return [dg.RunRequest(tags={STREAM_TAG: stream.name}) for _ in range(max(0, stream.workers - counted))]


def build_worker_defs(
    stream: FaucetStream,
    spec: dg.AssetSpec,
    *,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> tuple[dg.AssetSpec, Sequence[dg.AssetChecksDefinition], dg.SensorDefinition, dg.JobDefinition]:
    """The sink asset, its checks, the workers sensor and the worker job of a stream with workers."""
    job = worker_job(stream)
    sensor = workers_sensor(
        stream,
        job,
        asset_key=spec.key,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
    )
    checks = (worker_certificate_check(stream, spec.key), worker_health_check(stream, spec.key))
    return spec, checks, sensor, job


def _groups(stream: FaucetStream) -> list[str]:
    return [group_stream(stream.name, group, stream.group_count) for group in range(stream.group_count)]


def worker_certificate_check(stream: FaucetStream, asset_key: dg.AssetKey) -> dg.AssetChecksDefinition:
    """The ``faucet_epoch_certificate`` check of a stream on workers: each partition group's recent
    certificates (``MAX_REPORTS_PER_TICK`` in all) chain and add up."""
    per_group = max(1, MAX_REPORTS_PER_TICK // stream.group_count)

    @dg.asset_check(
        asset=asset_key,
        name=CERTIFICATE_CHECK,
        description="Every partition group's epoch certificates chain and add up.",
    )
    def _check() -> dg.AssetCheckResult:
        problems: list[str] = []
        checked = 0
        with StateStore(stream.state_url) as store:
            for name in _groups(stream):
                last = store.last_certificate(name)
                after = 0 if last is None else max(0, last.sequence - per_group)
                certificates = store.certificates(name, after=after)
                checked += len(certificates)
                problems.extend(p for c in certificates for p in certificate_problems(c))
                problems.extend(f"{name}: {problem}" for problem in chain_problems(certificates))
        return dg.AssetCheckResult(
            passed=not problems,
            metadata={"faucet/certificates_checked": checked, "faucet/problems": "\n".join(problems)},
        )

    return _check


def worker_health_check(stream: FaucetStream, asset_key: dg.AssetKey) -> dg.AssetChecksDefinition:
    """The ``faucet_stream_health`` check of a stream on workers: failing while a partition group is
    marked uncertain, else passing with the lag of the newest certificate of any group."""

    @dg.asset_check(
        asset=asset_key,
        name=HEALTH_CHECK,
        description="No partition group of the stream is marked uncertain; the lag of the newest epoch.",
    )
    def _check() -> dg.AssetCheckResult:
        names = set(_groups(stream))
        with StateStore(stream.state_url) as store:
            statuses = [status for status in store.status() if status.stream in names]
            lasts = [store.last_certificate(status.stream) for status in statuses]
        stuck = next((status for status in statuses if status.uncertain), None)
        stall = None if stuck is None else uncertain_stall(stuck.stream, stuck.uncertain_reason)
        newest = max((c for c in lasts if c is not None), key=lambda c: c.created_at, default=None)
        evaluation = health_evaluation(asset_key, stall, newest)
        return dg.AssetCheckResult(
            passed=evaluation.passed,
            metadata=evaluation.metadata,
            severity=evaluation.severity,
            description=evaluation.description,
        )

    return _check
