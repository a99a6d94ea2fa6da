"""Definitions for continuous streams: each sink asset, its certificate and health checks, and the
sensor that runs it (or, for ``workers > 1``, the sensor and the job of its worker runs)."""

from collections.abc import Mapping, Sequence

import dagster as dg

from faucet_dagster.declarations.code_location import declaring_line, with_code_reference
from faucet_dagster.declarations.declared import DECLARED
from faucet_dagster.declarations.preflight import check_streams
from faucet_dagster.streams.certificates import certificate_check
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.health import health_check
from faucet_dagster.streams.sensor import faucet_stream_sensor
from faucet_dagster.streams.verification import verify_check
from faucet_dagster.streams.workers import build_worker_defs


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
    between ``streams_sharing`` stream sensors (default: these streams; see
    :func:`faucet_dagster.streams.sensor.tick_budget`).

    Every stream is checked first, without I/O
    (:func:`faucet_dagster.declarations.preflight.check_streams`): a mistake fails the definitions'
    load. Each sink asset references the line that called this (``dagster/code_references``) unless
    its spec holds references already."""
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
        checks.append(verify_check(stream, spec.key))
        if stream.workers > 1:
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


__all__ = ["build_stream_defs"]
