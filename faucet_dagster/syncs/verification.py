"""The ``faucet_verify`` asset check of a bounded sync: its latest runs re-read, bookmark to bookmark,
and compared with the destination (:func:`faucet_dagster.verify.verify_sync`).

A run is one materialization of the sync's asset: it recorded the bookmark it started from
(``faucet/start_bookmark``; for a materialization written before that key existed, the previous
materialization's ``faucet/bookmark``) and the one it ended at. Each execution verifies the last
``runs`` runs (of each partition, for a partitioned sync: one shard each); verifying every run the
sync made compares the table exactly. Add the checks with :func:`faucet_sync_checks` (the component
adds them itself).
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from faucet_dagster.declarations.verification import VERIFY_CHECK, verification_result
from faucet_dagster.protocol import ConfigError, Delivery, JsonValue, Source
from faucet_dagster.runner.sync import run_sync
from faucet_dagster.syncs.assets import FaucetTranslator
from faucet_dagster.syncs.declaration import FaucetSync, FaucetSyncData
from faucet_dagster.syncs.metadata import BOOKMARK_KEY, START_BOOKMARK_KEY, bookmark_from
from faucet_dagster.syncs.shards import list_shards, shard_of
from faucet_dagster.verify import Report, SyncRun, verify_sync

DEFAULT_RUNS = 1
"""Runs (per partition) one execution verifies: the latest."""
MAX_RUNS_READ = 10_000
"""Materializations read back to number a sync's runs (beyond it, the first runs are not counted)."""


@dataclass(frozen=True)
class RecordedRun:
    """A materialization of a sync's asset, as a run to re-read."""

    partition: str | None
    start: JsonValue | None
    end: JsonValue | None
    delivery: Delivery
    run_id: str


def sync_verify_check(
    sync: FaucetSync, asset_key: dg.AssetKey, *, runs: int = DEFAULT_RUNS
) -> dg.AssetChecksDefinition:
    """The ``faucet_verify`` check of ``sync``'s asset (see the module docstring)."""
    resource_keys = {endpoint.resource_key for endpoint in sync.endpoints() if endpoint.resource_key}

    @dg.asset_check(
        asset=asset_key,
        name=VERIFY_CHECK,
        description="The sync's latest runs re-read bookmark to bookmark and compared with the destination.",
        required_resource_keys=resource_keys or None,
        blocking=False,
    )
    def _check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        recorded = recorded_runs(context.instance, asset_key)
        return verification_result(run_sync(verify_recorded(sync, context.resources, recorded, runs)))

    return _check


def faucet_sync_checks(
    syncs: Sequence[FaucetSync], *, translator: FaucetTranslator | None = None, runs: int = DEFAULT_RUNS
) -> list[dg.AssetChecksDefinition]:
    """The ``faucet_verify`` checks of ``syncs``' assets (as ``faucet_sync_assets`` names them): add them
    to the definitions beside the assets."""
    translator = translator or FaucetTranslator()
    return [
        sync_verify_check(
            sync, translator.get_asset_spec(FaucetSyncData(sync, sync.shardable())).key, runs=runs
        )
        for sync in syncs
    ]


def recorded_runs(instance: dg.DagsterInstance, key: dg.AssetKey) -> list[RecordedRun]:
    """Every materialization of ``key`` that recorded a bookmark, oldest first (at most
    ``MAX_RUNS_READ``)."""
    found: list[RecordedRun] = []
    cursor = None
    while len(found) < MAX_RUNS_READ:
        page = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=500, cursor=cursor)
        for record in page.records:
            materialization = record.asset_materialization
            if materialization is None or BOOKMARK_KEY not in materialization.metadata:
                continue
            metadata = materialization.metadata
            start = metadata.get(START_BOOKMARK_KEY)
            delivery = metadata.get("faucet/delivery")
            promised = delivery.value if isinstance(delivery, dg.TextMetadataValue) else None
            found.append(
                RecordedRun(
                    materialization.partition,
                    bookmark_from(start) if start is not None else _UNKNOWN,
                    bookmark_from(metadata[BOOKMARK_KEY]),
                    Delivery(promised or Delivery.AT_LEAST_ONCE.value),
                    record.run_id,
                )
            )
        if not page.has_more:
            break
        cursor = page.cursor
    return found[::-1]


_UNKNOWN: Any = object()
"""A start bookmark a materialization did not record (written before ``faucet/start_bookmark``)."""


async def verify_recorded(
    sync: FaucetSync, resources: Any, recorded: Sequence[RecordedRun], runs: int
) -> Report:
    """Verify the last ``runs`` of ``recorded`` per partition (a missing start bookmark: the previous
    run's end)."""
    by_partition: dict[str | None, list[RecordedRun]] = {}
    for run in recorded:
        by_partition.setdefault(run.partition, []).append(run)
    reports: list[Report] = []
    for partition, history in by_partition.items():
        shard = None if partition is None else await _shard(sync, resources, partition)
        selected: list[SyncRun] = []
        for number, run in enumerate(history, start=1):
            start = run.start
            if start is _UNKNOWN:
                start = history[number - 2].end if number > 1 else None
            label = f"run {run.run_id[:8]}" + ("" if partition is None else f" of partition {partition}")
            selected.append(SyncRun(number, start, run.end, label, shard))
        sink = sync.sink.resolve(resources).build_sink(sync.sink.config)
        try:
            reports.append(
                await verify_sync(
                    sync.name,
                    lambda: _source(sync, resources),
                    sink,
                    selected[-runs:],
                    total=len(history),
                    batch_size=sync.batch_size,
                    delivery=history[-1].delivery,
                )
            )
        finally:
            await sink.close()
    return Report(
        tuple(item for report in reports for item in report.verifications),
        sum(report.seconds for report in reports),
        sum(report.rows_replayed for report in reports),
        sum(report.rows_compared for report in reports),
    )


def verify_sync_from_home(sync: FaucetSync, runs: int = DEFAULT_RUNS) -> Report:
    """Verify ``sync``'s last ``runs`` from the instance of ``$DAGSTER_HOME`` (where its bookmarks
    are), its asset named as ``faucet_sync_assets`` names it (for ``faucet verify``)."""
    if not os.environ.get("DAGSTER_HOME"):
        raise ConfigError(
            f"sync {sync.name}: its runs' bookmarks are in Dagster's run storage: set DAGSTER_HOME",
            where="faucet verify",
        )
    key = FaucetTranslator().get_asset_spec(FaucetSyncData(sync, sync.shardable())).key
    recorded = recorded_runs(dg.DagsterInstance.get(), key)
    return run_sync(verify_recorded(sync, None, recorded, runs))


def _source(sync: FaucetSync, resources: Any) -> Source:
    return sync.source.resolve(resources).build_source(sync.source.config)


async def _shard(sync: FaucetSync, resources: Any, partition: str) -> str | None:
    return shard_of(partition, await list_shards(_source(sync, resources)))


__all__ = [
    "DEFAULT_RUNS",
    "faucet_sync_checks",
    "recorded_runs",
    "sync_verify_check",
    "verify_recorded",
    "verify_sync_from_home",
]
