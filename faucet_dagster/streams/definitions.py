"""Definitions for continuous streams: each sink asset (one per replicated table for a change-data-capture
stream of several tables), its certificate and health checks, and the sensor that runs it (or, for
``workers > 1``, the sensor and the job of its worker runs)."""

from collections.abc import Callable, Mapping, Sequence

import dagster as dg

# What define_asset_job returns; dagster 1.13 does not export the type publicly.
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from faucet_dagster.declarations.code_location import declaring_line, with_code_reference
from faucet_dagster.declarations.declared import DECLARED
from faucet_dagster.declarations.preflight import check_streams
from faucet_dagster.streams.certificates import certificate_check
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.health import health_check
from faucet_dagster.streams.reports import AssetTarget
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
    """Definitions for ``streams``: each sink asset (``asset_specs[name]`` or the default spec; one per
    resource with :attr:`FaucetStream.assets_per_resource`), its certificate and health checks and its
    sensor, which targets the asset(s). The sensors' default budget shares the interval between
    ``streams_sharing`` stream sensors (default: these streams; see
    :func:`faucet_dagster.streams.sensor.tick_budget`).

    Every stream is checked first, without I/O
    (:func:`faucet_dagster.declarations.preflight.check_streams`): a mistake fails the definitions'
    load. Each sink asset references the line that called this (``dagster/code_references``) unless
    its spec holds references already."""
    check_streams(streams, declared_by="build_stream_defs")
    DECLARED.streams.update((stream.name, stream) for stream in streams)
    declared_at = declaring_line()
    specs = dict(asset_specs or {})
    assets: list[dg.AssetSpec | dg.AssetsDefinition] = []
    checks: list[dg.AssetChecksDefinition] = []
    sensors: list[dg.SensorDefinition] = []
    jobs: list[UnresolvedAssetJobDefinition] = []
    for stream in streams:
        spec = with_code_reference(specs.get(stream.name) or stream.asset_spec(), declared_at)
        targets = stream.asset_targets(spec)
        # One verification per stream: the first of its sink assets carries it.
        checks.append(verify_check(stream, targets[0][0].key))
        if stream.workers > 1:
            worker_assets, worker_checks, sensor, job = build_worker_defs(
                stream, spec, minimum_interval_seconds=minimum_interval_seconds, default_status=default_status
            )
            assets.append(worker_assets)
            checks.extend(worker_checks)
            sensors.append(sensor)
            jobs.append(job)
            continue
        names = [stream.name]
        for target, _ in targets:
            assets.append(target)
            checks.append(certificate_check(stream.state_url, _constant(names), target.key))
            checks.append(health_check(stream.state_url, [stream.name], target.key))
        sensors.append(
            faucet_stream_sensor(
                stream,
                minimum_interval_seconds=minimum_interval_seconds,
                budget_seconds=budget_seconds,
                default_status=default_status,
                streams_sharing=len(streams) if streams_sharing is None else streams_sharing,
                targets=[AssetTarget(target.key, resources) for target, resources in targets],
            )
        )
    return dg.Definitions(assets=assets, asset_checks=checks, sensors=sensors, jobs=jobs)


def _constant(names: Sequence[str]) -> Callable[[object], Sequence[str]]:
    return lambda _: names


__all__ = ["build_stream_defs"]
