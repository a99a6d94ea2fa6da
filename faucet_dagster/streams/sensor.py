"""Continuous streams as Dagster sensors: each tick reports what the stream certified since the last.

Declare a :class:`FaucetStream` (source and sink endpoints, resources, policy) and turn it into
definitions with :func:`build_stream_defs` (the sink asset, its certificate and health checks and the
sensor), or into the sensor alone with :func:`faucet_stream_sensor`. The sensor targets the sink asset
(``asset_selection``), so the asset's page lists the sensor under its automations and the sensor's
page names the asset; it never requests runs.

Between ticks, the stream's runner reads, seals, commits and certifies epochs in the background of the
code server process (:mod:`faucet_dagster.runner`). A tick:

1. reads the cursor (:mod:`.cursor`): the certificates Dagster received reports of, the health it
   last reported, a halt in progress; the state store's report marks are moved there;
2. asks the runner for its tick (:meth:`~faucet_dagster.runner.continuous.StreamRunner.tick`): a seal
   of the open epoch, waited for within a budget (:func:`tick_budget`); the first tick of a process
   starts the reader;
3. reports every certificate stored since the last report in **one** ``AssetMaterialization`` of the
   sink asset (:mod:`.reports`: coverage merged per domain, first and last sequence, rows summed, the
   newest lag, a table of the certificates) with **one** ``faucet_epoch_certificate`` evaluation,
   whatever the number of epochs; and the ``faucet_stream_health`` evaluation when the stream's health
   changed (a stall began, changed or ended);
4. says what it did in one line (:func:`tick_summary`), which Dagster shows as the tick's reason (a
   sensor that requests no run has its ticks listed as skipped, the reason in their tooltip and details,
   and in the daemon's log), writes it to the tick's log ("View logs") when the tick reported something
   or the stream is stalled, and describes the report on the asset page (the materialization's
   description).

A stream halted on an error (a server down, a record it refuses) says so on every tick until it makes
progress again: ``halted since <time> (<n> ticks): <error>. Remedy: ...``. The tick does not fail
(a failing tick would log its whole stack trace to the daemon's log on every tick); the health check
fails once with the reason and the remedy, the tick's own log says it, and the process log says it in
one line when the halt begins and then at most every five minutes (:data:`~.cursor.HALT_LOG_SECONDS`).
A stall on a lease names the real holder: another worker, or this very process when it lost its lease.

The runner (its open sessions, its open epoch and its lease) is cached per code-server process
(:mod:`.runner_cache`), behind a lock per stream: ticks run on different threads, and a tick that
finds the previous one still running reports what is certified and skips. The cache is an
optimisation: all positions, sequences and leases are read from the state store when a runner opens
its sessions. A stream marked uncertain is halted until an operator runs ``faucet streams release``.
"""

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg

from faucet_dagster.declarations.preflight import check_streams
from faucet_dagster.protocol import ConfigError, EpochCertificate, FaucetError, OwnershipLost
from faucet_dagster.runner.open_epoch import Pending
from faucet_dagster.state import StateStore, StateStoreUnavailable
from faucet_dagster.streams.cursor import PASSING, Halt, StreamCursor, parse_cursor
from faucet_dagster.streams.declaration import AssetKeyLike, FaucetStream
from faucet_dagster.streams.health import (
    Stall,
    halt_stall,
    health_evaluation,
    lease_stall,
    one_line,
    remedy_of,
)
from faucet_dagster.streams.reports import AssetTarget, Report, report_events, unreported
from faucet_dagster.streams.runner_cache import StreamHandle, cached_runner, stream_loop

logger = logging.getLogger(__name__)

SENSOR_TIMEOUT_ENV = "DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS"
DEFAULT_SENSOR_TIMEOUT = 60.0
MAX_TICK_BUDGET = 10.0
MIN_TICK_BUDGET = 2.0
TICK_OVERHEAD_SECONDS = 0.5
"""What a tick costs beyond its budget as the daemon sees it (creating the tick, the gRPC call, storing
its events and cursor): the default budget leaves it out of the stream's share of the interval."""
STARTING_TICK_BUDGET = 0.0
"""How long a tick with the default budget waits when it starts its stream's reader (a new code server:
the daemon replaces its own every 60 s). Taking the lease, opening the sessions and the first read take
seconds, which the daemon's serial sensor loop would spend waiting; the tick's seal request stands, so
the first epoch is sealed after one read and certified in the background, and the next tick reports it."""
READER_STOP_SECONDS = 60.0
"""A stream's reader stops (its open epoch sealed and certified, or rolled back only where the sink can take
its writes back; its lease released) when no tick came for this long, or four sensor intervals if longer:
the sensor was stopped, or the daemon ticks another process."""
STARTED_READING = (
    "started reading in this process: the first epoch is sealed after one read and certified in the "
    "background; the next tick reports it"
)


def tick_budget(requested: float | None = None, *, interval: float = 30.0, streams: int = 1) -> float:
    """Seconds a tick may spend, its commits included: ``requested``, or by default
    ``0.8 * interval / streams - TICK_OVERHEAD_SECONDS`` between ``MIN_TICK_BUDGET`` and
    ``MAX_TICK_BUDGET`` (2 and 10 s); never more than half the sensor gRPC timeout
    (``DAGSTER_SENSOR_GRPC_TIMEOUT_SECONDS``).

    The daemon evaluates a code location's sensors one at a time by default, so the default shares
    the sensor's ``interval`` between the ``streams`` of the code location, less what each tick costs
    the daemon beyond its budget: each of them still ticks about every ``interval`` seconds.
    """
    raw = os.environ.get(SENSOR_TIMEOUT_ENV)
    try:
        timeout = float(raw) if raw else DEFAULT_SENSOR_TIMEOUT
    except ValueError:
        raise ConfigError(
            f"{SENSOR_TIMEOUT_ENV} is not a number: {raw!r}", where=SENSOR_TIMEOUT_ENV
        ) from None
    ceiling = timeout / 2
    if requested is None:
        shared = 0.8 * interval / max(1, streams) - TICK_OVERHEAD_SECONDS
        requested = max(MIN_TICK_BUDGET, min(MAX_TICK_BUDGET, shared))
    return max(0.0, min(requested, ceiling))


def faucet_stream_sensor(
    stream: FaucetStream,
    *,
    asset_key: AssetKeyLike | None = None,
    name: str | None = None,
    minimum_interval_seconds: int = 30,
    budget_seconds: float | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    streams_sharing: int = 1,
    targets: Sequence[AssetTarget] | None = None,
) -> dg.SensorDefinition:
    """A sensor running ``stream`` and reporting what it certified, one materialization a tick.

    ``budget_seconds`` caps the time a tick spends waiting for its seal, commits included (default: see
    :func:`tick_budget`, the interval shared between the ``streams_sharing`` stream sensors of the
    code location; a default tick that starts the stream's reader waits ``STARTING_TICK_BUDGET``).
    ``targets`` are the assets the reports materialize (default: the sink asset, ``asset_key``, or one
    per resource: :meth:`FaucetStream.asset_targets`); the sensor's ``asset_selection``. Endpoints given
    by resource key become its required resources.
    """
    check_streams([stream], declared_by="faucet_stream_sensor")
    chosen = tuple(
        targets
        or (
            AssetTarget(spec.key, resources)
            for spec, resources in stream.asset_targets(stream.asset_spec(asset_key))
        )
    )
    resource_keys = {
        endpoint.resource_key for endpoint in (stream.source, stream.sink) if endpoint.resource_key
    }

    @dg.sensor(
        name=name or f"{stream.name}_stream",
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys=resource_keys or None,
        asset_selection=[target.key for target in chosen],
        description=(
            f"Runs faucet stream {stream.name} ({stream.source.label} to {stream.sink.label}) and reports "
            "what it certified since the last tick: one materialization a tick. It requests no runs: "
            "each tick is listed as skipped, its reason saying what it did."
        ),
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        budget = tick_budget(budget_seconds, interval=minimum_interval_seconds, streams=streams_sharing)
        stop_after = max(READER_STOP_SECONDS, 4.0 * minimum_interval_seconds)
        starting = STARTING_TICK_BUDGET if budget_seconds is None else None
        return _tick(
            context,
            stream,
            chosen,
            budget,
            stop_after,
            starting_budget=starting,
            interval=minimum_interval_seconds,
        )

    return _sensor


# -- the tick ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunnerOutcome:
    """What the runner's part of a tick came to."""

    failure: FaucetError | None = None
    lost: OwnershipLost | None = None
    pending: Pending | None = None
    busy: bool = False
    """A previous tick still runs the stream's epochs (this one only reports)."""
    started: bool = False
    """This tick started the reader."""

    def progressed(self) -> bool:
        """Whether the runner showed it works: its seal was served, or an epoch is open (its sessions
        opened). A reader just started, or still taking the lease, shows nothing yet."""
        if self.failure is not None or self.lost is not None or self.busy:
            return False
        return self.pending is None or self.pending.epoch is not None

    def describe(self) -> str:
        if self.busy:
            return "a previous tick is still running this stream's epochs"
        if self.started and self.pending is not None and self.pending.epoch is None:
            return STARTED_READING
        if self.pending is not None:
            return self.pending.describe()
        return "no new certified epoch: the source had nothing new"


def _run_runner(
    handle: StreamHandle,
    stream: FaucetStream,
    budget: float,
    stop_after: float | None,
    starting_budget: float | None,
    interval: float | None,
) -> RunnerOutcome:
    if not handle.lock.acquire(blocking=False):
        return RunnerOutcome(busy=True)
    try:
        pending = stream_loop().run(
            handle.runner.tick(
                budget, stop_after=stop_after, starting_budget=starting_budget, interval=interval
            )
        )
    except OwnershipLost as exc:
        return RunnerOutcome(lost=exc)
    except FaucetError as exc:
        return RunnerOutcome(failure=exc)
    finally:
        handle.lock.release()
    if pending is not None and pending.lease_wait is not None:  # stalled on a lease, as a refused one is
        return RunnerOutcome(lost=OwnershipLost(pending.lease_wait, where=stream.name), pending=pending)
    return RunnerOutcome(pending=pending, started=handle.runner.started is True)


def _tick(
    context: dg.SensorEvaluationContext,
    stream: FaucetStream,
    targets: Sequence[AssetTarget],
    budget: float,
    stop_after: float | None = None,
    *,
    starting_budget: float | None = None,
    interval: float | None = None,
) -> dg.SensorResult:
    began = time.perf_counter()
    cursor = parse_cursor(context.cursor, stream.name)
    handle = cached_runner(stream.name, stream.state_url, lambda: stream.build_spec(context.resources))
    store = handle.store
    outcome = _run_runner(handle, stream, budget, stop_after, starting_budget, interval)
    if isinstance(outcome.failure, StateStoreUnavailable):
        raise outcome.failure  # "state store unreachable": asking it again would wait its timeout again
    found = unreported(store, [stream.name], cursor.reported_through)
    certificates = found.certificates
    now = time.time()
    stall, halt = _judge(stream, store, handle.runner.worker_id, outcome, cursor, bool(certificates), now)
    events = report_events(certificates, targets, found.previous)
    health = stall.key if stall is not None else PASSING if (certificates or outcome.progressed()) else None
    if health is not None and health != cursor.health:
        newest = certificates[-1] if certificates else store.last_certificate(stream.name)
        events.extend(health_evaluation(target.key, stall, newest) for target in targets)
    summary = tick_summary(outcome, certificates, stall, halt)
    if halt is not None and (cursor.halt is None or halt.log_due(now)):
        still = "" if cursor.halt is None else "still "
        logger.error("faucet stream %s %s%s", stream.name, still, summary)
        halt = Halt(halt.reason, halt.remedy, halt.since, halt.ticks, logged=now)
    elif halt is None and cursor.halt is not None:
        logger.warning("faucet stream %s runs again after %d halted ticks", stream.name, cursor.halt.ticks)
    if stall is not None:
        context.log.warning(summary)
    elif certificates or (health is not None and health != cursor.health):
        context.log.info(summary)
    logger.debug(
        "stream %s: tick of %.3fs, %d certificates reported",
        stream.name,
        time.perf_counter() - began,
        len(certificates),
    )
    next_cursor = StreamCursor(found.marks, health=health if health is not None else cursor.health, halt=halt)
    return dg.SensorResult(asset_events=events, cursor=next_cursor.format(), skip_reason=summary)


def _judge(
    stream: FaucetStream,
    store: StateStore,
    worker_id: str,
    outcome: RunnerOutcome,
    cursor: StreamCursor,
    reported: bool,
    now: float,
) -> tuple[Stall | None, Halt | None]:
    """The stall this tick found (None: the stream works, or is idle) and the halt it carries on.

    A failure halts the stream (since when the cursor says it already was). A halted stream stays
    halted until the runner shows progress (:meth:`RunnerOutcome.progressed`, or new certificates
    without a failure), so a tick that merely restarted the reader still says halted."""
    if outcome.failure is not None:
        failure = outcome.failure
        reason, remedy = (
            f"{type(failure).__name__}: {one_line(str(failure))}",
            remedy_of(stream.name, failure),
        )
        before = cursor.halt
        halt = (
            Halt(reason, remedy, now)
            if before is None
            else Halt(reason, remedy, before.since, before.ticks + 1, before.logged)
        )
        return halt_stall(halt), halt
    if outcome.lost is not None:
        return _lease_stall(stream, store, worker_id, outcome.lost), cursor.halt
    if cursor.halt is not None and not (reported or outcome.progressed()):
        halt = cursor.halt.again()
        return halt_stall(halt), halt
    return None, None


def _lease_stall(stream: FaucetStream, store: StateStore, worker_id: str, lost: OwnershipLost) -> Stall:
    """The stall of a tick that does not hold the lease, naming its real holder from the store."""
    try:
        [status] = store.status(stream.name)
    except FaucetError:
        holder = None
    else:
        holder = status.owner if status.lease_live else None
    return lease_stall(
        stream.name,
        stream.lease_seconds,
        holder,
        mine=holder is not None and holder == worker_id,
        detail=one_line(str(lost)),
    )


def tick_summary(
    outcome: RunnerOutcome,
    certificates: Sequence[EpochCertificate],
    stall: Stall | None,
    halt: Halt | None,
) -> str:
    """The tick in one line, for people: what it reported, what the stream is doing or why it stalled."""
    reported = Report(tuple(certificates)).describe() if certificates else None
    state: str | None
    if halt is not None:
        state = halt.describe(None if outcome.failure is not None else "the runner retries")
    elif stall is not None:
        state = stall.describe()
    else:
        state = None if reported and outcome.pending is None else outcome.describe()
    return "; ".join(part for part in (reported, state) if part)


__all__ = [
    "SENSOR_TIMEOUT_ENV",
    "STARTED_READING",
    "faucet_stream_sensor",
    "tick_budget",
]
