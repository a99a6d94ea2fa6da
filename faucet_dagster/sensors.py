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
   reason and the operator's remedy, when the stream stalled (:mod:`faucet_dagster.stream_health`).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from faucet_dagster.assets import with_code_reference
from faucet_dagster.declared import DECLARED, declaring_line
from faucet_dagster.pipeline import ResourceSchema
from faucet_dagster.preflight import check_streams
from faucet_dagster.protocol import (
    ConfigError,
    Delivery,
    EpochCertificate,
    FaucetError,
    OwnershipLost,
    ReadLimits,
    WritePolicy,
    compare_positions,
)
from faucet_dagster.protocol.positions import Position
from faucet_dagster.resources import FaucetEndpoint
from faucet_dagster.runner.continuous import (
    DEFAULT_EPOCH_LIMITS,
    DEFAULT_LEASE_SECONDS,
    StreamSpec,
)
from faucet_dagster.runner.open_epoch import Pending
from faucet_dagster.state import StateStore
from faucet_dagster.stream_health import (
    HEALTH_CHECK,
    check_result,
    describe_certified,
    lag_metadata,
    metadata_table,
    stored_health,
    table_metadata,
    throughput_metadata,
    tick_health,
)
from faucet_dagster.stream_runners import cached_runner, close_cached_streams, stream_loop

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
CERTIFICATE_CHECK = "faucet_epoch_certificate"
MAX_REPORTS_PER_TICK = 500
CURSOR_VERSION = 1

AssetKeyLike = dg.AssetKey | str | Sequence[str]
"""What names the sink asset: an ``AssetKey``, a slash-free name, or its path segments."""


@dataclass(frozen=True)
class FaucetStream:
    """One continuous stream: read ``resources`` from ``source``, write them to ``sink`` with ``policy``.

    ``schemas`` declares resources' schemas (others are inferred). ``limits.records`` and
    ``limits.bytes`` bound an epoch (by default it is sealed at the first safe boundary after 50,000
    records, without waiting for a tick). ``state_url`` selects the state store
    (default: ``$FAUCET_STATE_URL``, else a SQLite file under ``$DAGSTER_HOME``). ``lease_seconds`` is
    how long a worker that died without releasing the stream holds it up (a live one renews its lease
    in the background). ``workers`` above 1 runs the stream in that many long-running Dagster runs
    (:mod:`faucet_dagster.stream_workers`), its partitions divided into ``groups`` partition groups
    (default: ``workers``; fixed once certified).
    """

    name: str
    source: FaucetEndpoint
    sink: FaucetEndpoint
    resources: tuple[str, ...]
    policy: WritePolicy = WritePolicy.APPEND
    key: tuple[str, ...] = ()
    delivery: Delivery | None = None
    schemas: Mapping[str, ResourceSchema] = field(default_factory=dict)
    limits: ReadLimits = DEFAULT_EPOCH_LIMITS
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    state_url: str | None = None
    description: str | None = None
    workers: int = 1
    groups: int | None = None

    def __post_init__(self) -> None:
        if self.workers < 1 or (self.groups is not None and self.groups < 1):
            raise ConfigError(
                f"stream {self.name}: workers ({self.workers}) and groups ({self.groups}) must be at least 1",
                where=self.name,
            )

    @property
    def group_count(self) -> int:
        """How many partition groups the stream's workers divide its partitions into."""
        return self.groups or self.workers

    def build_spec(self, resources: Any = None) -> StreamSpec:
        """The runner's spec: connectors built from the endpoints (no I/O; secrets read now)."""
        source = self.source.resolve(resources)
        sink = self.sink.resolve(resources)
        return StreamSpec(
            name=self.name,
            source=source.spec().stream_source(source.resolved_config(self.source.config)),
            sink=sink.spec().streaming_sink(sink.resolved_config(self.sink.config)),
            resources=self.resources,
            policy=self.policy,
            key=self.key,
            schemas=self.schemas,
            delivery=self.delivery,
            limits=self.limits,
            lease_seconds=self.lease_seconds,
        )

    def asset_spec(self, key: AssetKeyLike | None = None) -> dg.AssetSpec:
        """The sink asset the stream's certificates materialize (key ``[name]`` unless given)."""
        kinds = {"faucet"} | {c for c in (self.source.connector, self.sink.connector) if c is not None}
        return dg.AssetSpec(
            key=dg.AssetKey.from_coercible(key) if key is not None else dg.AssetKey([self.name]),
            description=self.description
            or f"Faucet continuous stream {self.name}: {self.source.label} to {self.sink.label}.",
            kinds=kinds,
            tags={
                "faucet/source": self.source.label,
                "faucet/sink": self.sink.label,
                "faucet/mode": "continuous",
            },
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


def certificate_check(
    stream: FaucetStream, asset_key: AssetKeyLike | None = None
) -> dg.AssetChecksDefinition:
    """The ``faucet_epoch_certificate`` check: the stored certificates chain and add up.

    Evaluated by the sensor for every certificate it reports; executed on demand, it re-checks the
    last ``MAX_REPORTS_PER_TICK`` certificates of the stream in the state store.
    """
    key = stream.asset_spec(asset_key).key

    @dg.asset_check(asset=key, name=CERTIFICATE_CHECK, description="Epoch certificates chain and add up.")
    def _check() -> dg.AssetCheckResult:
        with StateStore(stream.state_url) as store:
            last = store.last_certificate(stream.name)
            after = 0 if last is None else max(0, last.sequence - MAX_REPORTS_PER_TICK)
            certificates = store.certificates(stream.name, after=after)
        problems = [problem for certificate in certificates for problem in certificate_problems(certificate)]
        problems.extend(chain_problems(certificates))
        return dg.AssetCheckResult(
            passed=not problems,
            metadata={
                "faucet/certificates_checked": len(certificates),
                "faucet/problems": "\n".join(problems),
            },
        )

    return _check


def build_stream_defs(
    streams: Sequence[FaucetStream],
    *,
    asset_specs: Mapping[str, dg.AssetSpec] | None = None,
    minimum_interval_seconds: int = 30,
    budget_seconds: float | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    streams_sharing: int | None = None,
) -> dg.Definitions:
    """Definitions for ``streams``: each sink asset (``asset_specs[name]`` or the default spec), its
    certificate and health checks and its sensor. The sensors' default budget shares the interval
    between ``streams_sharing`` stream sensors (default: these streams; see :func:`tick_budget`).

    Every stream is checked first, without I/O (:func:`faucet_dagster.preflight.check_streams`): a
    mistake fails the definitions' load. Each sink asset references the line that called this
    (``dagster/code_references``) unless its spec holds references already."""
    check_streams(streams, declared_by="build_stream_defs")
    DECLARED.streams.update((stream.name, stream) for stream in streams)
    declared_at = declaring_line()
    specs = dict(asset_specs or {})
    assets: list[dg.AssetSpec] = []
    checks: list[dg.AssetChecksDefinition] = []
    sensors: list[dg.SensorDefinition] = []
    jobs: list[dg.JobDefinition] = []
    for stream in streams:
        spec = with_code_reference(specs.get(stream.name) or stream.asset_spec(), declared_at)
        assets.append(spec)
        if stream.workers > 1:
            from faucet_dagster.stream_workers import build_worker_defs  # it builds on this module

            _, worker_checks, sensor, job = build_worker_defs(
                stream, spec, minimum_interval_seconds=minimum_interval_seconds, default_status=default_status
            )
            checks.extend(worker_checks)
            sensors.append(sensor)
            jobs.append(job)
            continue
        checks.extend((certificate_check(stream, spec.key), health_check(stream, spec.key)))
        sensors.append(
            faucet_stream_sensor(
                stream,
                asset_key=spec.key,
                minimum_interval_seconds=minimum_interval_seconds,
                budget_seconds=budget_seconds,
                default_status=default_status,
                streams_sharing=len(streams) if streams_sharing is None else streams_sharing,
            )
        )
    return dg.Definitions(assets=assets, asset_checks=checks, sensors=sensors, jobs=jobs)


def health_check(stream: FaucetStream, asset_key: AssetKeyLike | None = None) -> dg.AssetChecksDefinition:
    """The ``faucet_stream_health`` check: the stream certifies epochs and is not stalled.

    Evaluated by the sensor on every tick that certifies (passing, with the lag) or stalls (failing
    with the reason and the remedy). Executed on demand, it reads the state store: failing while the
    stream is marked uncertain, else passing with the lag of the last certificate.
    """
    key = stream.asset_spec(asset_key).key

    @dg.asset_check(
        asset=key,
        name=HEALTH_CHECK,
        description="The stream certifies epochs: not halted, uncertain or waiting on a lease.",
    )
    def _check() -> dg.AssetCheckResult:
        with StateStore(stream.state_url) as store:
            return check_result(stored_health(store, key, [stream.name]))

    return _check


# -- certificates as Dagster events ------------------------------------------------------------


def certificate_problems(certificate: EpochCertificate) -> list[str]:
    """What is wrong with one certificate on its own: no coverage, or receipts that do not add up."""
    problems = []
    if not certificate.coverage:
        problems.append(f"certificate {certificate.certificate_id} covers nothing")
    handled = sum(receipt.rows_written + receipt.rows_skipped for receipt in certificate.receipts)
    sealed = sum(certificate.row_counts.values())
    if handled != sealed:
        problems.append(
            f"certificate {certificate.certificate_id}: the sink handled {handled} rows "
            f"(written + skipped), the pipeline sealed {sealed}"
        )
    for receipt in certificate.receipts:
        # A replica that met rows it did not expect diverged from its source: not effectively-once.
        surprises = {
            name: receipt.details.get(name, "0") for name in ("unexpected_inserts", "unexpected_changes")
        }
        if any(value != "0" for value in surprises.values()):
            problems.append(
                f"certificate {certificate.certificate_id}: {receipt.resource} diverged from its source ("
                + ", ".join(f"{name} {value}" for name, value in surprises.items())
                + ")"
            )
    return problems


def chain_problems(certificates: Sequence[EpochCertificate]) -> list[str]:
    """Where consecutive certificates do not chain: a gap in sequence or coverage between them."""
    problems = []
    ends: dict[tuple[str, str, str], Position] = {}
    previous: EpochCertificate | None = None
    for certificate in certificates:
        if previous is not None and certificate.sequence != previous.sequence + 1:
            problems.append(f"certificate {certificate.sequence} follows {previous.sequence}")
        for item in certificate.coverage:
            end = ends.get(item.domain.lineage)
            start = None if item.start is None else Position(item.domain, item.start)
            if end is not None and (start is None or compare_positions(start, end) != 0):
                problems.append(
                    f"certificate {certificate.sequence} starts at {item.start} in {item.domain}, "
                    f"the previous one ended at {end.value}"
                )
            ends[item.domain.lineage] = Position(item.domain, item.end)
        previous = certificate
    return problems


def certificate_metadata(certificate: EpochCertificate) -> dict[str, Any]:
    """The certificate as asset metadata: epoch, coverage and receipts tables, counts, digest, token,
    and the numbers Dagster plots (throughput, lag)."""
    coverage = metadata_table(
        dict.fromkeys(("source", "resource", "partition", "incarnation", "start", "end"), "string"),
        [
            {
                "source": item.domain.source,
                "resource": item.domain.resource,
                "partition": item.domain.partition,
                "incarnation": item.domain.incarnation,
                "start": item.start or "",
                "end": item.end,
            }
            for item in certificate.coverage
        ],
    )
    receipts = metadata_table(
        {"resource": "string", "rows_written": "int", "rows_skipped": "int", "details": "string"},
        [
            {
                "resource": receipt.resource,
                "rows_written": receipt.rows_written,
                "rows_skipped": receipt.rows_skipped,
                "details": json.dumps(dict(receipt.details), sort_keys=True),
            }
            for receipt in certificate.receipts
        ],
    )
    return {
        "faucet/epoch": str(certificate.epoch),
        "faucet/sequence": certificate.sequence,
        "faucet/coverage": coverage,
        "faucet/receipts": receipts,
        "faucet/rows_written": sum(receipt.rows_written for receipt in certificate.receipts),
        "faucet/row_counts": dict(certificate.row_counts),
        "faucet/rows_dead_lettered": sum(certificate.dead_lettered.values()),
        "faucet/digest": certificate.digest,
        "faucet/fencing_token": certificate.fencing_token,
        "faucet/worker": certificate.worker,
        "faucet/delivery": certificate.delivery.value,
        "faucet/timings": dict(certificate.timings),
        "faucet/certified_at": certificate.created_at,
        "faucet/certificate": dg.MetadataValue.json(json.loads(certificate.to_json())),
        **throughput_metadata(certificate),
        **lag_metadata(certificate.lag),
        **table_metadata(certificate),
    }


def certificate_events(
    certificate: EpochCertificate, asset_key: dg.AssetKey
) -> tuple[dg.AssetMaterialization, dg.AssetCheckEvaluation]:
    """The materialization of the sink asset for ``certificate`` and its check evaluation."""
    problems = certificate_problems(certificate)
    materialization = dg.AssetMaterialization(
        asset_key=asset_key,
        description=f"certified epoch {certificate.epoch}",
        metadata=certificate_metadata(certificate),
    )
    evaluation = dg.AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=CERTIFICATE_CHECK,
        passed=not problems,
        metadata={"faucet/epoch": str(certificate.epoch), "faucet/problems": "\n".join(problems)},
        severity=dg.AssetCheckSeverity.ERROR,
        description="the certificate's receipts add up to its sealed rows" if not problems else problems[0],
    )
    return materialization, evaluation


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
    "CERTIFICATE_CHECK",
    "HEALTH_CHECK",
    "FaucetStream",
    "build_stream_defs",
    "certificate_check",
    "certificate_events",
    "certificate_metadata",
    "close_cached_streams",
    "faucet_stream_sensor",
    "health_check",
    "tick_budget",
]
