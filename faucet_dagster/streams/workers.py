"""A stream with ``workers: N``: N long-running Dagster runs, each a member of the stream.

:func:`build_worker_defs` gives a stream with ``workers > 1``:

* a job ``<stream>_workers`` of one op that runs a :class:`~faucet_dagster.runner.members.MemberWorker`
  (member id: the run id) round after round: it holds its member lease and the leases of its
  partition groups, runs their epochs continuously and logs every certified epoch to the run's logs.
  It ends when its sensor is stopped (checked every :data:`SENSOR_CHECK_SECONDS` between rounds, from
  Dagster's state of the sensor: :class:`~faucet_dagster.streams.worker_runs.SensorWatch`): the round in
  progress certifies its epochs, the groups close at those certified positions, every lease is
  released and the run succeeds, its last log line saying why. A terminated run closes and releases
  the same way;
* a sensor ``<stream>_stream`` that, each tick, reports every group's new certificates as
  materializations of the sink asset (each once: the cursor holds a report mark per group, as the
  single-worker sensor's does for its stream) and keeps a run in each of the N worker slots
  (:mod:`faucet_dagster.streams.worker_runs`): a started run whose member lease lapsed long enough (its
  process died) is marked failed and replaced, and a slot whose runs failed
  :data:`~faucet_dagster.streams.worker_runs.MAX_FAILURES` times in a row is backed off and reported, its
  last error and the remedy in the tick and in the ``faucet_stream_health`` evaluation. The runs go
  through the instance's run coordinator and run launcher, so the Kubernetes, Docker or ECS launcher
  places them.
"""

import asyncio
import json
import logging
import os
import time
from collections.abc import Sequence

import dagster as dg
from sqlalchemy.exc import SQLAlchemyError

from faucet_dagster.protocol import ConfigError, EpochCertificate
from faucet_dagster.runner.members import MemberWorker, group_stream
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import MemberRegistry
from faucet_dagster.streams.certificates import (
    CERTIFICATE_CHECK,
    MAX_REPORTS_PER_TICK,
    certificate_events,
    certificate_problems,
    chain_problems,
)
from faucet_dagster.streams.declaration import AssetKeyLike, FaucetStream
from faucet_dagster.streams.health import HEALTH_CHECK, check_result, health_evaluation, stored_health
from faucet_dagster.streams.worker_runs import (
    SLOT_TAG,
    STREAM_TAG,
    SensorWatch,
    Slot,
    SlotState,
    census,
    workers_stall,
)

logger = logging.getLogger(__name__)

SENSOR_CHECK_SECONDS = 5.0
"""How often a worker run reads its sensor's state (between rounds: one indexed read each time)."""
CURSOR_VERSION = 1


def worker_job_name(stream: FaucetStream) -> str:
    return f"{stream.name}_workers"


def worker_job(
    stream: FaucetStream, default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED
) -> dg.JobDefinition:
    """The per-stream job: one op running a member worker until its sensor stops or the run is
    terminated (``default_status``: the sensor's, what its status is when Dagster stores none)."""
    resource_keys = {e.resource_key for e in (stream.source, stream.sink) if e.resource_key}

    @dg.op(name=f"{stream.name}_worker", required_resource_keys=resource_keys or None)
    def _worker(context: dg.OpExecutionContext) -> None:
        run_worker(context, stream, SensorWatch(context.instance, context.dagster_run, default_status))

    @dg.job(
        name=worker_job_name(stream),
        executor_def=dg.in_process_executor,
        tags={STREAM_TAG: stream.name},
        description=f"A long-running worker of faucet stream {stream.name} ({stream.workers} of them).",
    )
    def _job() -> None:
        _worker()

    return _job


def run_worker(context: dg.OpExecutionContext, stream: FaucetStream, watch: SensorWatch) -> None:
    """Run a member of ``stream`` (id: the run id) until ``watch`` says its sensor stopped or the run
    is terminated, then close its groups at certified positions and leave (see the module)."""
    spec = stream.build_spec(context.resources)
    store = StateStore(stream.state_url)
    worker = MemberWorker(spec, store, groups=stream.group_count, worker_id=context.run_id)
    member = f"faucet stream {stream.name}: member {context.run_id}"
    context.log.info(f"{member} (pid {os.getpid()}) joins")
    if not watch.watching:
        context.log.info(f"{member} was not requested by a sensor: it runs until the run is terminated")

    async def rounds() -> None:
        loop = asyncio.get_running_loop()
        checked = loop.time()
        why = "the run was terminated"
        try:
            while True:
                if watch.watching and loop.time() - checked >= SENSOR_CHECK_SECONDS:
                    checked = loop.time()
                    if await _sensor_stopped(context, watch):
                        why = f"its sensor {watch.sensor} is stopped"
                        return
                for certificate in await worker.run_round():
                    rows = sum(certificate.row_counts.values())
                    context.log.info(f"certified epoch {certificate.epoch} ({rows} rows)")
        except BaseException as exc:
            why = f"the run ends on {type(exc).__name__}"
            raise
        finally:
            await worker.close()
            context.log.info(f"{member} left ({why}): its groups closed at certified positions")

    try:
        asyncio.run(rounds())
    finally:
        store.close()


async def _sensor_stopped(context: dg.OpExecutionContext, watch: SensorWatch) -> bool:
    """Whether the run's sensor is stopped; a read of the instance that fails counts as not stopped
    (it is read again next time): a storage hiccup never ends a healthy worker."""
    try:
        return await asyncio.to_thread(watch.stopped)
    except (SQLAlchemyError, dg.DagsterError, OSError) as exc:
        # The type only: a storage error's text may hold the instance's connection string.
        context.log.warning(
            f"could not read the state of sensor {watch.sensor} ({type(exc).__name__}); "
            f"reading it again in {SENSOR_CHECK_SECONDS:.0f}s"
        )
        return False


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
    """The sensor reporting every group's certificates and keeping a run in each worker slot."""
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
            events, cursor, newest = _reports(store, stream, key, parse_cursor(context.cursor))
            slots = _census(context.instance, store, stream)
        now = time.time()
        requests = _keep_workers(context, stream, slots, now)
        requested = {int(request.tags[SLOT_TAG]) for request in requests}
        stall = workers_stall(stream.name, slots, now, requested)
        if stall is not None:
            context.log.warning(f"stream {stream.name} {stall.describe()}")
        if stall is not None or events:
            events.append(health_evaluation(key, stall, newest))
        # Dagster shows a tick without run requests by its skip reason: a stall says what is wrong.
        skip = stall.describe() if stall else None if events else "no new certified epoch; every worker runs"
        return dg.SensorResult(
            run_requests=requests, asset_events=events, cursor=cursor, skip_reason=None if requests else skip
        )

    return _sensor


def _census(instance: dg.DagsterInstance, store: StateStore, stream: FaucetStream) -> tuple[Slot, ...]:
    registry = MemberRegistry(store)
    return census(
        instance,
        stream.name,
        worker_job_name(stream),
        stream.workers,
        registry.live(stream.name),
        registry.lapsed(stream.name),
        lease_seconds=stream.lease_seconds,
    )


def _reports(
    store: StateStore, stream: FaucetStream, key: dg.AssetKey, confirmed: dict[str, int]
) -> tuple[list[dg.AssetMaterialization | dg.AssetCheckEvaluation], str, EpochCertificate | None]:
    """Every group's certificates after its report mark, as events; the next cursor; the newest one."""
    events: list[dg.AssetMaterialization | dg.AssetCheckEvaluation] = []
    marks: dict[str, int] = {}
    newest: EpochCertificate | None = None
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
            if newest is None or certificate.created_at > newest.created_at:
                newest = certificate
        marks[name] = certificates[-1].sequence if certificates else reported
    return events, json.dumps({"version": CURSOR_VERSION, "reported_through": marks}), newest


def _keep_workers(
    context: dg.SensorEvaluationContext, stream: FaucetStream, slots: Sequence[Slot], now: float
) -> list[dg.RunRequest]:
    """Mark dead runs failed; a run request for each slot without a run that is not backing off."""
    requests = []
    for slot in slots:
        if slot.dead and slot.run is not None:
            context.log.warning(f"worker run {slot.run.run_id} of {stream.name} has no live member: failed")
            context.instance.report_run_failed(
                slot.run, f"the faucet member lease of this worker of {stream.name} lapsed: its process died"
            )
        elif slot.state is not SlotState.EMPTY:
            continue
        if slot.backing_off(now):
            continue
        requests.append(dg.RunRequest(tags={STREAM_TAG: stream.name, SLOT_TAG: str(slot.slot)}))
    return requests


def build_worker_defs(
    stream: FaucetStream,
    spec: dg.AssetSpec,
    *,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> tuple[dg.AssetSpec, Sequence[dg.AssetChecksDefinition], dg.SensorDefinition, dg.JobDefinition]:
    """The sink asset, its checks, the workers sensor and the worker job of a stream with workers."""
    job = worker_job(stream, default_status)
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
    """The ``faucet_stream_health`` check of a stream on workers: failing while a worker slot has no
    live worker (its run's member lease lapsed, its runs keep failing, or it has no run), naming the
    slot, or while a partition group is marked uncertain; else passing with the lag of the newest
    certificate of any group."""

    @dg.asset_check(
        asset=asset_key,
        name=HEALTH_CHECK,
        description="Every worker of the stream is live and no partition group is marked uncertain.",
    )
    def _check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        with StateStore(stream.state_url) as store:
            stall = workers_stall(stream.name, _census(context.instance, store, stream))
            return check_result(stored_health(store, asset_key, _groups(stream), stall))

    return _check
