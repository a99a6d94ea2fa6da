"""Schedules for faucet assets: a cron schedule that materializes syncs, every partition of them.

``faucet_schedule(assets, "0 * * * *")`` builds an asset job over ``assets`` and a schedule for it.
For partitioned assets (a shardable source) each tick requests one run per partition, so every
shard moves what is new since its own bookmark; an unpartitioned asset gets one run per tick.
"""

from collections.abc import Iterator, Sequence

import dagster as dg

from faucet_dagster.protocol import ConfigError


def faucet_schedule(
    assets: dg.AssetsDefinition | Sequence[dg.AssetsDefinition],
    cron_schedule: str,
    *,
    name: str | None = None,
    execution_timezone: str | None = None,
    default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.STOPPED,
) -> dg.ScheduleDefinition:
    """A schedule (and its asset job) that materializes ``assets`` on ``cron_schedule``.

    Every asset must share one partitioning (or none): a job runs one partitions definition. Run
    keys are the tick time (and the partition), so a tick evaluated twice never launches twice.
    """
    chosen = [assets] if isinstance(assets, dg.AssetsDefinition) else list(assets)
    if not chosen:
        raise ConfigError("faucet_schedule needs at least one asset", where="faucet_schedule")
    name = name or f"{chosen[0].node_def.name}_schedule"
    partitionings = {asset.partitions_def for asset in chosen}
    if len(partitionings) != 1:
        raise ConfigError(
            "the assets of one schedule must share one partitioning (or none)", where=f"schedule {name}"
        )
    partitions_def = partitionings.pop()
    job = dg.define_asset_job(f"{name}_job", selection=dg.AssetSelection.assets(*chosen))
    if partitions_def is None:
        return dg.ScheduleDefinition(
            name=name,
            job=job,
            cron_schedule=cron_schedule,
            execution_timezone=execution_timezone,
            default_status=default_status,
        )

    @dg.schedule(
        name=name,
        job=job,
        cron_schedule=cron_schedule,
        execution_timezone=execution_timezone,
        default_status=default_status,
    )
    def _every_partition(context: dg.ScheduleEvaluationContext) -> Iterator[dg.RunRequest]:
        tick = context.scheduled_execution_time.isoformat()
        for partition_key in partitions_def.get_partition_keys(dynamic_partitions_store=context.instance):
            yield dg.RunRequest(run_key=f"{tick}/{partition_key}", partition_key=partition_key)

    return _every_partition


__all__ = ["faucet_schedule"]
