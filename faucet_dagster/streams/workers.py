"""A stream with ``workers: N``: N long-running Dagster runs, each a member of the stream.

:func:`build_worker_defs` gives a stream with ``workers > 1``:

* the sink asset as the worker: a ``multi_asset`` whose op runs a
  :class:`~faucet_dagster.runner.members.MemberWorker` (member id: the run id) round after round, and
  the job ``<stream>_workers`` over it. The asset's page lists that job and the sensor that keeps its
  runs. A worker run holds its member lease and the leases of its partition groups, runs their epochs
  continuously and logs every certified epoch. It ends when its sensor is stopped, or when it is
  retired (the stream's ``workers`` lowered: its slot no longer exists), both checked every
  :data:`SENSOR_CHECK_SECONDS` between rounds from Dagster's state of the sensor and of the run
  (:class:`~faucet_dagster.streams.worker_runs.SensorWatch`): the round in progress certifies its
  epochs, the groups close at those certified positions, every lease is released, and the run
  succeeds, its last log line saying why. A worker whose sensor stopped reports the certificates no
  tick will report (one materialization). A terminated run closes and releases the same way. Launched
  from the asset's Materialize button (not the job), the op only says where the stream runs;
* a sensor ``<stream>_stream`` that, each tick, reports every group's new certificates in one
  materialization of the sink asset (the cursor holds a report mark per group), keeps a run in each of
  the N worker slots (:mod:`faucet_dagster.streams.worker_runs`): a started run whose member lease
  lapsed long enough (its process died) is marked failed and replaced, a run whose slot no longer
  exists is retired (asked to leave, terminated if it has not after :data:`RETIRE_SECONDS`), and a slot
  whose runs failed :data:`~faucet_dagster.streams.worker_runs.MAX_FAILURES` times in a row is backed
  off and reported, its last error and the remedy in the tick and in the ``faucet_stream_health``
  evaluation. The runs go through the instance's run coordinator and run launcher, so the Kubernetes,
  Docker or ECS launcher places them.

The number of partition groups is fixed once the stream has certificates: ``groups`` when declared,
else the number its certificates were made under (:func:`group_count`), else ``workers``. So lowering
``workers`` from 3 to 2 keeps 3 groups and moves the retired worker's group to the others.
"""

import asyncio
import logging
import os
import time
from collections.abc import Iterator, Sequence

import dagster as dg

# What define_asset_job returns; dagster 1.13 does not export the type publicly.
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition
from sqlalchemy.exc import SQLAlchemyError

from faucet_dagster.runner.members import MemberWorker, group_stream
from faucet_dagster.state import StateStore
from faucet_dagster.state.members import MemberRegistry, parse_group_stream
from faucet_dagster.streams.certificates import certificate_check
from faucet_dagster.streams.cursor import PASSING, StreamCursor, parse_cursor
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.health import HEALTH_CHECK, check_result, health_evaluation, stored_health
from faucet_dagster.streams.reports import AssetTarget, Report, report_events, unreported
from faucet_dagster.streams.worker_runs import (
    RETIRE_TAG,
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
"""How often a worker run reads its sensor's and its own state (between rounds: two indexed reads)."""
RETIRE_SECONDS = 120.0
"""How long a retired worker run may take to leave on its own before the sensor terminates it."""


def worker_job_name(stream: FaucetStream) -> str:
    return f"{stream.name}_workers"


def group_count(store: StateStore, stream: FaucetStream) -> int:
    """The partition groups ``stream`` runs as: ``groups`` when declared, else the number its
    certificates were made under, else ``workers`` (a stream not certified yet)."""
    if stream.groups is not None:
        return stream.groups
    for status in store.status():
        found = parse_group_stream(status.stream)
        if found is not None and found[0] == stream.name and status.last_sequence > 0:
            return found[2]
    return stream.workers


def group_names(stream: FaucetStream, groups: int) -> list[str]:
    return [group_stream(stream.name, group, groups) for group in range(groups)]


def worker_assets(
    stream: FaucetStream,
    specs: Sequence[dg.AssetSpec],
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.AssetsDefinition:
    """The sink asset(s) of a stream on workers, materialized by its worker runs: the op runs a member
    until its sensor stops, the run is retired or terminated (``default_status``: the sensor's, what
    its status is when Dagster stores none). The runs report nothing themselves while the sensor runs;
    the sensor reports their certificates."""
    resource_keys = {e.resource_key for e in (stream.source, stream.sink) if e.resource_key}

    @dg.multi_asset(
        name=f"{stream.name}_worker",
        specs=[spec.replace_attributes(skippable=True) for spec in specs],
        required_resource_keys=resource_keys,
        can_subset=True,
    )
    def _worker(context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult[None]]:
        if context.job_name != worker_job_name(stream):
            context.log.info(
                f"faucet stream {stream.name} runs in the runs of job {worker_job_name(stream)}, which its "
                f"sensor {stream.name}_stream keeps ({stream.workers} of them) and whose certificates it "
                "reports as materializations of this asset: start that sensor. This run did nothing."
            )
            return
        run_worker(context, stream, SensorWatch(context.instance, context.run, default_status), specs)
        yield from ()

    return _worker


def worker_job(stream: FaucetStream, assets: dg.AssetsDefinition) -> UnresolvedAssetJobDefinition:
    """The per-stream job of worker runs: the worker asset's op, without the asset's checks."""
    return dg.define_asset_job(
        name=worker_job_name(stream),
        selection=dg.AssetSelection.assets(*assets.keys).without_checks(),
        executor_def=dg.in_process_executor,
        tags={STREAM_TAG: stream.name},
        description=f"A long-running worker of faucet stream {stream.name} ({stream.workers} of them).",
    )


def run_worker(
    context: dg.AssetExecutionContext, stream: FaucetStream, watch: SensorWatch, specs: Sequence[dg.AssetSpec]
) -> None:
    """Run a member of ``stream`` (id: the run id) until ``watch`` says its sensor stopped or the run
    was retired, or the run is terminated; then close its groups at certified positions and leave. A
    member whose sensor stopped reports what no tick will (see the module)."""
    spec = stream.build_spec(context.resources)
    store = StateStore(stream.state_url)
    groups = group_count(store, stream)
    worker = MemberWorker(spec, store, groups=groups, worker_id=context.run_id)
    member = f"faucet stream {stream.name}: member {context.run_id}"
    context.log.info(f"{member} (pid {os.getpid()}) joins, {groups} partition groups")
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
                    leave = await _leave_reason(context, watch)
                    if leave is not None:
                        why = leave
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
            if why.startswith("its sensor"):
                await asyncio.to_thread(_report_at_leave, context, watch, store, stream, groups, specs)

    try:
        asyncio.run(rounds())
    finally:
        store.close()


async def _leave_reason(context: dg.AssetExecutionContext, watch: SensorWatch) -> str | None:
    """Why the run should leave now (its sensor is stopped, or it was retired), or None. A read of the
    instance that fails counts as no reason (it is read again next time): a storage hiccup never ends
    a healthy worker."""
    try:
        if await asyncio.to_thread(watch.stopped):
            return f"its sensor {watch.sensor} is stopped"
        retired = await asyncio.to_thread(watch.retired)
    except (SQLAlchemyError, dg.DagsterError, OSError) as exc:
        # The type only: a storage error's text may hold the instance's connection string.
        context.log.warning(
            f"could not read the state of sensor {watch.sensor} ({type(exc).__name__}); "
            f"reading it again in {SENSOR_CHECK_SECONDS:.0f}s"
        )
        return None
    return None if retired is None else f"it was retired: {retired}"


def _report_at_leave(
    context: dg.AssetExecutionContext,
    watch: SensorWatch,
    store: StateStore,
    stream: FaucetStream,
    groups: int,
    specs: Sequence[dg.AssetSpec],
) -> None:
    """Report the certificates of every group no tick reported (the sensor is stopped, so none will):
    one materialization per asset. What the sensor's last tick reported is in its cursor (the store's
    marks learn it at the next tick, which will not come); each group's range is claimed in the store
    before it is reported, so members that leave together report each certificate once (a member
    killed between its claim and its report leaves that range unreported in Dagster; the certificates
    stay in the store: ``faucet streams status``, ``faucet verify``)."""
    confirmed = parse_cursor(watch.cursor(), stream.name).reported_through
    found = unreported(store, group_names(stream, groups), confirmed)
    claimed = {
        name
        for name, mark in found.marks.items()
        if mark > found.after[name] and store.claim_reported(name, found.after[name], mark)
    }
    certificates = [certificate for certificate in found.certificates if certificate.stream in claimed]
    targets = [AssetTarget(target.key, resources) for target, resources in _targets(stream, specs)]
    previous = {name: certificate for name, certificate in found.previous.items() if name in claimed}
    for event in report_events(certificates, targets, previous):
        context.instance.report_runless_asset_event(event)
    if certificates:
        context.log.info(f"reported {Report(tuple(certificates)).describe()} (its sensor is stopped)")


def _targets(
    stream: FaucetStream, specs: Sequence[dg.AssetSpec]
) -> list[tuple[dg.AssetSpec, frozenset[str] | None]]:
    if not stream.assets_per_resource:
        return [(spec, None) for spec in specs]
    return list(zip(specs, (frozenset([resource]) for resource in stream.resources), strict=True))


def workers_sensor(
    stream: FaucetStream,
    job: UnresolvedAssetJobDefinition,
    targets: Sequence[AssetTarget],
    *,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """The sensor reporting every group's certificates and keeping a run in each worker slot."""

    @dg.sensor(
        name=f"{stream.name}_stream",
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            f"Keeps {stream.workers} worker runs of faucet stream {stream.name} and reports their "
            "certificates: one materialization a tick."
        ),
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        cursor = parse_cursor(context.cursor, stream.name)
        with StateStore(stream.state_url) as store:
            groups = group_count(store, stream)
            found = unreported(store, group_names(stream, groups), cursor.reported_through)
            slots, extra = _census(context.instance, store, stream)
            newest = found.certificates[-1] if found.certificates else None
        now = time.time()
        requests = _keep_workers(context, stream, slots, now)
        _retire(context, stream, extra, now)
        requested = {int(request.tags[SLOT_TAG]) for request in requests}
        stall = workers_stall(stream.name, slots, now, requested)
        events = report_events(found.certificates, targets, found.previous)
        health = stall.key if stall is not None else PASSING if found.certificates else None
        if health is not None and health != cursor.health:
            events.extend(health_evaluation(target.key, stall, newest) for target in targets)
        report = Report(found.certificates).describe() if found.certificates else None
        state = stall.describe() if stall else None if report else "no new certified epoch; every worker runs"
        summary = "; ".join(part for part in (report, state) if part)
        if stall is not None:
            context.log.warning(f"stream {stream.name} {stall.describe()}")
        elif report is not None:
            context.log.info(summary)
        next_cursor = StreamCursor(found.marks, health=health if health is not None else cursor.health)
        return dg.SensorResult(
            run_requests=requests,
            asset_events=events,
            cursor=next_cursor.format(),
            skip_reason=None if requests else summary,
        )

    return _sensor


def _census(
    instance: dg.DagsterInstance, store: StateStore, stream: FaucetStream
) -> tuple[tuple[Slot, ...], tuple[dg.DagsterRun, ...]]:
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


def _retire(
    context: dg.SensorEvaluationContext, stream: FaucetStream, extra: Sequence[dg.DagsterRun], now: float
) -> None:
    """Ask each run whose slot no longer exists (``workers`` lowered) to leave: it closes its groups
    at certified positions, releases its leases and succeeds. One that has not left after
    ``RETIRE_SECONDS`` is terminated through the run launcher (it closes and releases the same way)."""
    for run in extra:
        asked = run.tags.get(RETIRE_TAG)
        if asked is None:
            slot = run.tags.get(SLOT_TAG)
            reason = f"stream {stream.name} now has {stream.workers} workers; slot {slot} is gone"
            context.instance.add_run_tags(run.run_id, {RETIRE_TAG: f"{now:.0f} {reason}"})
            context.log.info(f"worker run {run.run_id} of {stream.name} is retired: {reason}")
        elif (
            now - float(asked.split(" ", 1)[0]) > RETIRE_SECONDS and run.status is dg.DagsterRunStatus.STARTED
        ):
            context.log.warning(
                f"worker run {run.run_id} of {stream.name} did not leave within {RETIRE_SECONDS:.0f}s of its "
                "retirement: terminating it"
            )
            context.instance.run_launcher.terminate(run.run_id)


def build_worker_defs(
    stream: FaucetStream,
    spec: dg.AssetSpec,
    *,
    minimum_interval_seconds: int = 30,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> tuple[
    dg.AssetsDefinition,
    Sequence[dg.AssetChecksDefinition],
    dg.SensorDefinition,
    UnresolvedAssetJobDefinition,
]:
    """The worker asset(s), their checks, the workers sensor and the worker job of a stream with
    workers."""
    targets = stream.asset_targets(spec)
    specs = [target for target, _ in targets]
    assets = worker_assets(stream, specs, default_status)
    job = worker_job(stream, assets)
    sensor = workers_sensor(
        stream,
        job,
        [AssetTarget(target.key, resources) for target, resources in targets],
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
    )
    checks = [
        check
        for target in specs
        for check in (worker_certificate_check(stream, target.key), worker_health_check(stream, target.key))
    ]
    return assets, checks, sensor, job


def worker_certificate_check(stream: FaucetStream, asset_key: dg.AssetKey) -> dg.AssetChecksDefinition:
    """The ``faucet_epoch_certificate`` check of a stream on workers: each partition group's recent
    certificates chain and add up."""
    return certificate_check(
        stream.state_url, lambda store: group_names(stream, group_count(store, stream)), asset_key
    )


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
            slots, _ = _census(context.instance, store, stream)
            stall = workers_stall(stream.name, slots)
            names = group_names(stream, group_count(store, stream))
            return check_result(stored_health(store, asset_key, names, stall))

    return _check
