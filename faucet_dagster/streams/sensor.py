"""Continuous streams as Dagster sensors: each tick seals the open epoch, certifies it, reports it.

Declare a :class:`FaucetStream` (source and sink endpoints, resources, policy) and turn it into
definitions with :func:`build_stream_defs` (the sink asset, its certificate check and the sensor), or
into the sensor alone with :func:`faucet_stream_sensor`.

Between ticks, the stream's runner reads into its open epoch in the background of the code server
process (:mod:`faucet_dagster.runner.open_epoch`). A tick:

1. reads the cursor (``{"reported_through": N}``): Dagster received the reports of certificates up
   to ``N``; the state store's report mark is moved there (a fresh cursor starts from that mark);
2. asks the runner to seal the open epoch at its next safe boundary and waits, within a budget
   (:func:`tick_budget`), until it is committed, certified and acknowledged (and the next ones too
   while the epochs sealed are full: a backlog); the first tick of a process starts the reader (with
   the default budget it does not wait: the first epoch is certified in the background and the next
   tick reports it). An epoch inside a source transaction stays open until the transaction ends,
   over as many ticks as that takes;
3. returns one ``AssetMaterialization`` of the sink asset per certificate after ``N`` (the ones
   certified now, and any a timed-out tick lost, since its cursor never advanced) with the certificate
   as metadata, plus an ``AssetCheckEvaluation`` of the ``faucet_epoch_certificate`` check, and the
   new cursor. Dagster stores the events and the cursor together, so each certificate is reported
   once. The tick's reason (Dagster shows a tick without run requests by it) says what it did:
   ``certified 3 epochs (12 to 14), 13500 rows; lag ...``, what is still open, or why the stream
   stalled. The tick's ``faucet_stream_health`` evaluation passes when it certified and fails, with the
   reason and the operator's remedy, when the stream stalled (:mod:`faucet_dagster.streams.health`).

The runner (its open source and sink sessions, its open epoch and its lease) is cached per code-server
process, behind a lock per stream: ticks run on different threads, and a tick that finds the previous
one still running reports what is certified and skips. The cache is an optimisation: all positions,
sequences and leases are read from the state store when a runner opens its sessions, and an open epoch
lost with its process is rolled back and read again by the next owner.

The runner's lease is short (15 s by default) and renewed in the background on the process's event
loop while the process lives. A process that stops (the daemon replacing its code server, a reload,
SIGTERM, Ctrl-C, a normal exit) closes its runners before the interpreter's thread pools shut down, so
each lease is released; a newer process that finds a live lease asks its holder to hand over (the
holder seals its open epoch if it can, within seconds) and takes the stream. Another worker holding
the stream's live lease otherwise makes a tick skip (that worker runs the stream). A reader no tick
reached for ``READER_STOP_SECONDS`` (or four intervals) stops and releases its lease. A stream marked
uncertain fails every tick until an operator runs ``faucet streams release``.
"""

import json
import logging
import os
import time

import dagster as dg

from faucet_dagster.declarations.preflight import check_streams
from faucet_dagster.protocol import ConfigError, FaucetError, OwnershipLost
from faucet_dagster.runner.open_epoch import Pending
from faucet_dagster.state import StateStoreUnavailable
from faucet_dagster.streams.certificates import MAX_REPORTS_PER_TICK, certificate_events
from faucet_dagster.streams.declaration import AssetKeyLike, FaucetStream
from faucet_dagster.streams.health import describe_certified, tick_health
from faucet_dagster.streams.runner_cache import cached_runner, stream_loop

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
EXIT_CLOSE_SECONDS = 10.0
"""How long a stopping process waits for its streams to close before it exits anyway."""
READER_STOP_SECONDS = 60.0
"""A stream's reader stops (rolling its open epoch back, releasing its lease) when no tick came for this
long, or four sensor intervals if longer: the sensor was stopped, or the daemon ticks another process."""
STARTED_READING = (
    "started reading in this process: the first epoch is sealed after one read and certified in the "
    "background; the next tick reports it"
)
CURSOR_VERSION = 1


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
) -> dg.SensorDefinition:
    """A sensor running ``stream``'s epochs on each tick and reporting each certificate once.

    ``budget_seconds`` caps the time a tick spends running epochs, commits included (default: see
    :func:`tick_budget`, the interval shared between the ``streams_sharing`` stream sensors of the
    code location; a default tick that starts the stream's reader waits ``STARTING_TICK_BUDGET``).
    Endpoints given by resource key become the sensor's required resources.
    """
    check_streams([stream], declared_by="faucet_stream_sensor")
    key = stream.asset_spec(asset_key).key
    resource_keys = {
        endpoint.resource_key for endpoint in (stream.source, stream.sink) if endpoint.resource_key
    }

    @dg.sensor(
        name=name or f"{stream.name}_stream",
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys=resource_keys or None,
        description=f"Runs the epochs of faucet stream {stream.name} and reports their certificates.",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        budget = tick_budget(budget_seconds, interval=minimum_interval_seconds, streams=streams_sharing)
        stop_after = max(READER_STOP_SECONDS, 4.0 * minimum_interval_seconds)
        starting = STARTING_TICK_BUDGET if budget_seconds is None else None
        return _tick(
            context,
            stream,
            key,
            budget,
            stop_after,
            starting_budget=starting,
            interval=minimum_interval_seconds,
        )

    return _sensor


# -- certificates as Dagster events ------------------------------------------------------------


# -- the tick ----------------------------------------------------------------------------------


def parse_cursor(cursor: str | None) -> int | None:
    """The certificate sequence Dagster received reports up to, from a tick cursor (None: no cursor)."""
    if not cursor:
        return None
    try:
        raw = json.loads(cursor)
        value = raw["reported_through"]
        if raw.get("version") != CURSOR_VERSION or isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(cursor)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"the sensor cursor {cursor!r} is not a faucet stream cursor", where="sensor cursor"
        ) from None
    return value


def format_cursor(reported_through: int) -> str:
    return json.dumps({"version": CURSOR_VERSION, "reported_through": reported_through})


def _tick(
    context: dg.SensorEvaluationContext,
    stream: FaucetStream,
    asset_key: dg.AssetKey,
    budget: float,
    stop_after: float | None = None,
    *,
    starting_budget: float | None = None,
    interval: float | None = None,
) -> dg.SensorResult:
    began = time.perf_counter()
    handle = cached_runner(stream.name, stream.state_url, lambda: stream.build_spec(context.resources))
    store = handle.store
    confirmed = parse_cursor(context.cursor)
    if confirmed is None:
        reported = store.reported_through(stream.name)
    else:
        store.mark_reported(stream.name, confirmed)
        reported = confirmed
    failure: FaucetError | None = None
    lost: OwnershipLost | None = None
    skip = "no new certified epoch: the source had nothing new"
    pending: Pending | None = None
    if handle.lock.acquire(blocking=False):
        try:
            pending = stream_loop().run(
                handle.runner.tick(
                    budget, stop_after=stop_after, starting_budget=starting_budget, interval=interval
                )
            )
        except OwnershipLost as exc:
            lost = exc
            skip = f"another worker runs this stream: {exc}"
        except FaucetError as exc:
            failure = exc
        else:
            if pending is not None:
                skip = pending.describe()
                if handle.runner.started and pending.lease_wait is None and pending.epoch is None:
                    skip = STARTED_READING
                if pending.lease_wait is not None:  # stalled on a lease, as a refused one is
                    lost = OwnershipLost(pending.lease_wait, where=stream.name)
        finally:
            handle.lock.release()
    else:
        skip = "a previous tick is still running this stream's epochs"
    ran = time.perf_counter() - began
    if isinstance(failure, StateStoreUnavailable):
        raise failure  # "state store unreachable": asking it for certificates would wait its timeout again
    certificates = store.certificates(stream.name, after=reported, limit=MAX_REPORTS_PER_TICK)
    health = tick_health(
        context,
        stream.name,
        stream.lease_seconds,
        asset_key,
        certificates,
        failure=failure,
        lost=lost,
    )
    if failure is not None:
        if not certificates:
            raise failure
        # Report what is certified first; the next tick runs the stream again and raises if it still fails.
        context.log.error(
            f"stream {stream.name} failed after certifying epochs; reporting them first: {failure}"
        )
    events: list[dg.AssetMaterialization | dg.AssetCheckEvaluation] = []
    for certificate in certificates:
        events.extend(certificate_events(certificate, asset_key))
    events.extend(health.events)
    logger.debug(
        "stream %s: tick of %.3fs (%.3fs running epochs), %d certificates reported",
        stream.name,
        time.perf_counter() - began,
        ran,
        len(certificates),
    )
    cursor = format_cursor(certificates[-1].sequence if certificates else reported)
    if certificates:  # Dagster shows a tick without run requests by its skip reason: say what it did
        skip = describe_certified(certificates) + ("" if pending is None else f"; {skip}")
    return dg.SensorResult(asset_events=events, cursor=cursor, skip_reason=health.skip or skip)


__all__ = [
    "SENSOR_TIMEOUT_ENV",
    "STARTED_READING",
    "faucet_stream_sensor",
    "format_cursor",
    "parse_cursor",
    "tick_budget",
]
