"""Partitions of a sharded sync, kept by a sensor: one dynamic partition a shard of its source.

Listing shards is I/O (a directory, a Kafka cluster), so the definitions never do it: a sync whose
source is shardable gets a ``DynamicPartitionsDefinition`` named ``faucet_<sync>_shards``, and the
sensor :func:`faucet_partitions_sensor` builds adds a partition for each shard the source lists that
the instance does not know yet (Dagster's ``AddDynamicPartitionsRequest``). A shard that disappears
keeps its partition and its history. Outside the daemon (a script, a test, ``python -m
example_project``, ``faucet partitions refresh -m MODULE``), :func:`refresh_partitions` evaluates
the same sensors once and applies what they request.
"""

from collections.abc import Sequence
from pathlib import Path

import dagster as dg

from faucet_dagster.declarations.code_location import import_code_location
from faucet_dagster.protocol import ConfigError
from faucet_dagster.runner.sync import run_sync
from faucet_dagster.syncs.declaration import FaucetSync, partitions_def_name
from faucet_dagster.syncs.shards import list_shards, shard_partitions

PARTITIONS_SENSOR_TAG = "faucet/partitions"
"""Tag of a partitions sensor; its value is the dynamic partitions definition it maintains."""


def faucet_partitions_sensor(
    sync: FaucetSync,
    *,
    asset_key: dg.AssetKey | str | None = None,
    run_new_partitions: bool = False,
    name: str | None = None,
    minimum_interval_seconds: int = 60,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The sensor that adds a partition of ``sync``'s asset (``asset_key``, default ``[sync.name]``)
    for each new shard of its source, and with ``run_new_partitions`` requests a run of each new
    partition at once (an eager load of a new file; each run moves its partition from the start).

    Each tick lists the shards (I/O, bounded by the connector's own timeouts) and requests the
    partition keys the instance lacks; a tick with nothing new requests nothing. The sensor targets
    the asset, so the asset's page lists it.
    """
    if isinstance(sync.source.connection, str):
        raise ConfigError(
            "partitions need a source known when the definitions load, not a resource key",
            where=f"sync {sync.name}",
        )
    partitions = partitions_def_name(sync)
    key = dg.AssetKey([sync.name]) if asset_key is None else dg.AssetKey.from_coercible(asset_key)
    then = " and runs each at once" if run_new_partitions else ""

    @dg.sensor(
        name=name or f"{partitions}_sensor",
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=f"Adds a partition of sync {sync.name} for each new shard of its source{then}.",
        tags={PARTITIONS_SENSOR_TAG: partitions},
        asset_selection=[key],
    )
    def _partitions(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        known = set(context.instance.get_dynamic_partitions(partitions))
        new = [partition for partition in shard_partition_keys(sync) if partition not in known]
        if not new:
            return dg.SensorResult(skip_reason=f"no new shard ({len(known)} partition(s))")
        runs = [
            dg.RunRequest(run_key=f"{partitions}/{partition}", partition_key=partition)
            for partition in (new if run_new_partitions else ())
        ]
        return dg.SensorResult(
            run_requests=runs, dynamic_partitions_requests=[dg.AddDynamicPartitionsRequest(partitions, new)]
        )

    return _partitions


def shard_partition_keys(sync: FaucetSync) -> list[str]:
    """The partition keys of the shards ``sync``'s source lists now (I/O)."""
    assert not isinstance(sync.source.connection, str)
    source = sync.source.connection.build_source(sync.source.config)
    return list(shard_partitions(run_sync(list_shards(source))))


def refresh_partitions(instance: dg.DagsterInstance, defs: dg.Definitions) -> dict[str, list[str]]:
    """Evaluate every faucet partitions sensor of ``defs`` once and add the partitions they request,
    as the daemon would; returns the keys added, by partitions definition."""
    added: dict[str, list[str]] = {}
    sensors: Sequence[dg.SensorDefinition] = [
        sensor
        for sensor in defs.sensors or []
        if isinstance(sensor, dg.SensorDefinition) and PARTITIONS_SENSOR_TAG in (sensor.tags or {})
    ]
    for sensor in sensors:
        with dg.build_sensor_context(instance=instance) as context:
            result = sensor(context)
        assert isinstance(result, dg.SensorResult)
        for request in result.dynamic_partitions_requests or []:
            if isinstance(request, dg.AddDynamicPartitionsRequest):
                instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
                added.setdefault(request.partitions_def_name, []).extend(request.partition_keys)
    return added


def refresh_code_location(module: str, attribute: str, directory: Path) -> dict[str, list[str]]:
    """Import the code location ``module`` from ``directory``, evaluate every faucet partitions sensor
    of its ``attribute`` (a ``Definitions``) once against the instance of ``$DAGSTER_HOME``, and add
    the partitions they request; returns the keys added, by partitions definition."""
    defs = getattr(import_code_location(module, directory), attribute, None)
    if not isinstance(defs, dg.Definitions):
        raise ConfigError(f"{module}.{attribute} is not a dagster Definitions", where=module)
    with dg.DagsterInstance.get() as instance:
        return refresh_partitions(instance, defs)


__all__ = [
    "PARTITIONS_SENSOR_TAG",
    "faucet_partitions_sensor",
    "refresh_code_location",
    "refresh_partitions",
    "shard_partition_keys",
]
