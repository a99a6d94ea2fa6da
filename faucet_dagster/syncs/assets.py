"""Bounded syncs as Dagster assets, with their bookmarks in Dagster's run storage.

Declare a :class:`FaucetSync` per destination table and turn syncs into assets with
:func:`faucet_sync_assets` (one ``multi_asset`` per sync, nothing else to write) or
:func:`faucet_assets` (a decorator over one ``multi_asset`` whose body you write, usually
``yield from faucet.run(context)``). A :class:`FaucetTranslator` maps each sync to its ``AssetSpec``;
``get_asset_spec`` is the one method to override.

A materialization runs :func:`faucet_dagster.runner.bounded.run_bounded_sync` and yields a
``MaterializeResult`` whose metadata carries the bookmark and commit token the sync reached. The next
run reads them back from run storage (``instance.fetch_materializations``, per partition), so a run
moves only what is new. A run that fails records nothing: the next one resumes from the last
successful run. When the plan holds the atomic watermark, the sink stays authoritative across a
crash between its commit and the Dagster event: the next run re-reads the same rows from the older
bookmark and skips every row the sink had already committed, so nothing is written twice.

Loading the definitions does no I/O: every config is parsed and every pair planned
(:mod:`faucet_dagster.declarations.preflight`), and a mistake fails the load. A source whose capabilities say
``shardable`` and whose connection is known when the definitions load (not a resource key) becomes a
partitioned asset with dynamic partitions, ``faucet_<sync>_shards``, one a shard (its path relative
to the shards' common directory), each with its own bookmark; the shards are listed by
:func:`faucet_dagster.syncs.partitions.faucet_partitions_sensor`, and by a run for its own partition. A run
over a range of partitions (``--partition-range``, a backfill: the backfill policy is ``single_run``)
moves them one after the other, each from and to its own bookmark.

Metadata of every materialization: Dagster's table metadata (``dagster/row_count``, the table's rows
after the run; ``dagster/partition_row_count``; ``dagster/table_name``, qualified;
``dagster/storage_kind``; ``dagster/column_schema``), ``faucet/bookmark``, ``faucet/commit_token``,
``faucet/delivery``, ``faucet/plan``, ``faucet/rows_read``, ``faucet/rows_written`` (this run's),
``faucet/rows_dead_lettered``, ``faucet/rows_skipped``, ``faucet/pages``, ``faucet/rows_per_second``,
``faucet/seconds``, ``faucet/source`` and ``faucet/sink`` (dataset URIs, never secrets). Each asset's
``dagster/code_references`` names the line that declared its sync.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import dagster as dg

from faucet_dagster.declarations.code_location import declaring_line, with_code_reference
from faucet_dagster.declarations.declared import DECLARED
from faucet_dagster.declarations.preflight import check_pairs
from faucet_dagster.protocol import (
    ConfigError,
    FaucetError,
    FetchContext,
    JsonValue,
    SchemaError,
    Sink,
    Source,
)
from faucet_dagster.runner.bounded import run_bounded_sync
from faucet_dagster.runner.bounded_values import PageReport
from faucet_dagster.runner.sync import run_sync
from faucet_dagster.syncs.checks import sync_check_results, sync_check_specs
from faucet_dagster.syncs.declaration import FaucetSync, FaucetSyncData, op_name, partitions_def_name
from faucet_dagster.syncs.launch_hint import install_launch_hint
from faucet_dagster.syncs.metadata import (
    SyncOutcome,
    SyncState,
    last_sync_state,
    last_table_rows,
    sync_metadata,
)
from faucet_dagster.syncs.shards import shard_of


@dataclass
class FaucetTranslator:
    """Maps a sync to its Dagster ``AssetSpec``; override ``get_asset_spec`` (the one override point).

    Defaults: key ``[sync.name]``; kinds ``{"faucet", <source connector>, <sink connector>}`` (a
    connection given by resource key is only known at run time and adds no kind); the description;
    tags ``faucet/source`` and ``faucet/sink``; no deps. A dependency on the source dataset is yours
    to declare, on an asset that exists (an external ``AssetSpec`` with its kinds and group, or the
    asset that produces the files), for example
    ``super().get_asset_spec(data).replace_attributes(deps=[raw_orders_files])``: a made-up upstream
    key would be a stub in group ``default`` that automation conditions wait on forever.
    """

    def get_asset_spec(self, data: FaucetSyncData) -> dg.AssetSpec:
        sync = data.sync
        kinds = {"faucet"} | {c for c in (sync.source.connector, sync.sink.connector) if c is not None}
        return dg.AssetSpec(
            key=dg.AssetKey([sync.name]),
            description=sync.description
            or f"Faucet bounded sync {sync.name}: {sync.source.label} to {sync.sink.label}."
            + (
                " One partition a shard of the source, each from its own bookmark: `dg launch "
                f"--assets {sync.name} --partition KEY`, or `--partition-range FIRST...LAST` (one run)."
                if data.partitioned
                else ""
            ),
            kinds=kinds,
            tags={
                "faucet/source": sync.source.label,
                "faucet/sink": sync.sink.label,
            },
        )


class FaucetSyncs:
    """The syncs of one ``multi_asset``, by asset key, ready to run inside its body.

    ``run(context)`` materializes each selected asset in declaration order and yields one
    ``MaterializeResult`` per asset, after its sync completed; over a range of partitions, one
    carrying each partition's own metadata.
    """

    def __init__(self, by_key: Mapping[dg.AssetKey, FaucetSync]) -> None:
        self.by_key = dict(by_key)

    def run(
        self, context: dg.AssetExecutionContext
    ) -> Iterator[dg.MaterializeResult[Any] | dg.AssetMaterialization]:
        """Run the selected syncs one after the other; blocks until each one completed.

        A run over a range of partitions (``dg launch --partition-range``, a backfill) moves them
        one after the other, each from its own bookmark, and records each partition's own metadata
        (see :meth:`materialize_range`).
        """
        chosen = [(key, sync) for key, sync in self.by_key.items() if key in context.selected_asset_keys]
        if context.has_partition_key_range and len(context.partition_keys) > 1:
            [(key, sync)] = chosen  # a partitioned asset holds one sync
            yield from self.materialize_range(context, key, sync)
            return
        for key, sync in chosen:
            partition = context.partition_key if context.has_partition_key else None
            metadata, checks = self.move(context, key, sync, partition)
            yield dg.MaterializeResult(asset_key=key, metadata=metadata, check_results=checks)

    def materialize_range(
        self, context: dg.AssetExecutionContext, key: dg.AssetKey, sync: FaucetSync
    ) -> Iterator[dg.MaterializeResult[Any] | dg.AssetMaterialization]:
        """Move each partition of the run's range in turn, each from its own bookmark.

        When every partition completed, one ``MaterializeResult`` carries each partition's own
        metadata (``add_asset_metadata`` per partition): Dagster records one materialization per
        partition with that partition's bookmark, never one bookmark copied over the range. When a
        partition fails, the partitions completed before it are recorded (an ``AssetMaterialization``
        each, their sinks have committed) and the run fails: the failed partition and the ones after
        it resume from their own last bookmarks.
        """
        done: list[tuple[str, dict[str, Any]]] = []
        checks: list[dg.AssetCheckResult] = []
        for partition in context.partition_keys:
            try:
                metadata, results = self.move(context, key, sync, partition)
            except BaseException:
                for completed, recorded in done:
                    yield dg.AssetMaterialization(asset_key=key, partition=completed, metadata=recorded)
                raise
            done.append((partition, metadata))
            checks = _worst_per_check([*checks, *results])
        for completed, recorded in done:
            context.add_asset_metadata(recorded, asset_key=key, partition_key=completed)
        yield dg.MaterializeResult(asset_key=key, check_results=checks)

    def move(
        self, context: dg.AssetExecutionContext, key: dg.AssetKey, sync: FaucetSync, partition: str | None
    ) -> tuple[dict[str, Any], list[dg.AssetCheckResult]]:
        """Run ``sync`` (for ``partition``) from its last bookmark; the materialization's metadata and
        the results of the checks it opted in to.

        A retryable failure (a refused connection, a server gone away) is retried as the sync's
        ``retry_policy`` says (Dagster's ``RetryRequested``, with its backoff and jitter); any other
        failure fails the run at once, a ``SchemaError`` saying which setting would accept the rows."""
        state = last_sync_state(context.instance, key, partition)
        table_rows = (
            last_table_rows(context.instance, key) if sync.checks.row_count_drop is not None else None
        )
        context.log.info(
            f"faucet sync {sync.name}: {sync.source.label} -> {sync.sink.label}"
            f"{', partition ' + partition if partition else ''}, resuming from "
            f"{'the start' if state.bookmark is None else 'the last bookmark'}"
        )

        def on_page(report: PageReport) -> None:
            context.log.debug(
                f"page {report.number}: read {report.rows_read}, wrote {report.rows_written}, "
                f"dead-lettered {report.rows_dead_lettered}, skipped {report.rows_skipped}"
            )

        ctx: dict[str, JsonValue] = {"run_id": context.run.run_id, "asset_key": key.to_user_string()}
        if partition is not None:
            ctx["partition_key"] = partition
        window = (
            None
            if sync.time_partitions is None or partition is None
            else sync.time_partitions.time_window_for_partition_key(partition)
        )
        try:
            outcome = run_sync(_execute(sync, context.resources, state, partition, ctx, on_page, window))
        except FaucetError as exc:
            _retry_or_raise(context, key, sync, exc)
            raise
        result = outcome.result
        context.log.info(
            f"faucet sync {sync.name}: read {result.rows_read}, wrote {result.rows_written}, "
            f"dead-lettered {result.rows_dead_lettered}, skipped {result.rows_skipped} in "
            f"{result.seconds:.2f}s ({result.plan.policy.value}, {result.plan.delivery.value})"
        )
        checks = sync_check_results(sync, key, outcome, state, table_rows, context.selected_asset_check_keys)
        return sync_metadata(outcome, state), checks


def _worst_per_check(results: Sequence[dg.AssetCheckResult]) -> list[dg.AssetCheckResult]:
    """One result per check over a range of partitions: the first that failed, else the last."""
    chosen: dict[str | None, dg.AssetCheckResult] = {}
    for result in results:
        held = chosen.get(result.check_name)
        if held is None or held.passed:
            chosen[result.check_name] = result
    return list(chosen.values())


def _retry_or_raise(
    context: dg.AssetExecutionContext, key: dg.AssetKey, sync: FaucetSync, exc: FaucetError
) -> None:
    """Ask Dagster to retry a retryable failure, as ``sync.retry_policy`` says, while retries are
    left; add the remedy to a ``SchemaError``. Returns when the caller should raise ``exc``."""
    policy = sync.retry_policy
    if exc.retryable and policy is not None and context.retry_number < policy.max_retries:
        attempt = context.retry_number + 1
        delay = float(policy.calculate_delay(attempt))
        context.log.warning(
            f"faucet sync {sync.name}: {type(exc).__name__}: {exc.message}; retry {attempt} of "
            f"{policy.max_retries} in {delay:.1f}s"
        )
        raise dg.RetryRequested(max_retries=policy.max_retries, seconds_to_wait=delay) from exc
    if isinstance(exc, SchemaError) and not sync.evolve_schema:
        where = declared_at(context, key)
        setting = (
            "evolve_schema: true"
            if where.endswith((".yaml", ".yml")) or ".yaml:" in where
            else "evolve_schema=True"
        )
        exc.add_note(
            f"Remedy: to add the source's new columns to the destination, set `{setting}` on sync "
            f"{sync.name} ({where}), then reload the code location and run it again."
        )


def declared_at(context: dg.AssetExecutionContext, key: dg.AssetKey) -> str:
    """Where the asset's sync was declared (``file:line``, from its ``dagster/code_references``)."""
    references = context.assets_def.specs_by_key[key].metadata.get("dagster/code_references")
    for reference in getattr(references, "code_references", ()):
        path, line = getattr(reference, "file_path", None), getattr(reference, "line_number", None)
        if path is not None:
            return f"{path}:{line}" if line else str(path)
    return "its declaration"


async def _execute(
    sync: FaucetSync,
    resources: Any,
    state: SyncState,
    partition: str | None,
    ctx: FetchContext,
    on_page: Callable[[PageReport], None],
    window: dg.TimeWindow | None = None,
) -> SyncOutcome:
    """Build the connectors for this run, run the sync, and close them whatever happens.

    A partition's shard is looked up now, among the shards the source lists (the definitions'
    load lists nothing). A time-window partition reads its ``window`` of the source's cursor
    (``cursor_window``), into a destination watermark of its own."""
    async with AsyncExitStack() as stack:
        source_config = dict(sync.source.config)
        if window is not None:
            source_config["cursor_window"] = {
                "start": window.start.isoformat(),
                "end": window.end.isoformat(),
            }
        source: Source = sync.source.resolve(resources).build_source(source_config)
        stack.push_async_callback(source.close)
        shard = None
        if partition is not None and window is None:
            shards = await source.enumerate_shards()
            shard = shard_of(partition, shards)
            if shard is None:
                raise ConfigError(
                    f"partition {partition!r} names no shard the source lists now "
                    f"({len(shards)} shard(s): was it removed?)",
                    where=f"sync {sync.name}",
                )
        sink: Sink = sync.sink.resolve(resources).build_sink(sync.sink.config)
        stack.push_async_callback(sink.close)
        scoped = window is None or partition is None or not sink.capabilities().atomic_watermark
        if not scoped and not sink.scope_watermark(f"window {partition}"):
            raise ConfigError(
                "time partitions write one table, each window with its own watermark; this sink "
                "keeps one watermark only",
                where=f"sync {sync.name}",
            )
        dead_letter: Sink | None = None
        if sync.dead_letter is not None:
            dead_letter = sync.dead_letter.resolve(resources).build_sink(sync.dead_letter.config)
            stack.push_async_callback(dead_letter.close)
        result = await run_bounded_sync(
            source,
            sink,
            sync.settings(),
            start_bookmark=state.bookmark,
            last_token=state.commit_token,
            dead_letter=dead_letter,
            shard=shard,
            context=ctx,
            on_page=on_page,
        )
        rows = await sink.row_count()
        return SyncOutcome(result, source.dataset_uri(), sink.dataset_uri(), rows, sink.commit_details())


# -- building the assets ---------------------------------------------------------------------------


FaucetBody = Callable[[dg.AssetExecutionContext, "FaucetSyncs"], Iterable[Any]]
"""The body ``@faucet_assets`` decorates: ``(context, faucet) -> the events it yields``."""


def faucet_assets(
    *,
    syncs: Sequence[FaucetSync],
    translator: FaucetTranslator | None = None,
    name: str | None = None,
    op_tags: Mapping[str, Any] | None = None,
    pool: str | None = None,
    required_resource_keys: Iterable[str] = (),
) -> Callable[[FaucetBody], dg.AssetsDefinition]:
    """Decorate ``fn(context, faucet)`` into one ``multi_asset`` holding an asset per sync.

    ``faucet`` is the :class:`FaucetSyncs` of these syncs; the usual body is
    ``yield from faucet.run(context)``. The asset can be subset: each selected asset runs its own
    sync. A sync whose source is shardable makes the asset partitioned, and must then be the only
    sync of this asset. Connections given by resource key become required resources of the asset.

    Every config is parsed and every pair planned now, without I/O (see
    :mod:`faucet_dagster.declarations.preflight`): a mistake fails the definitions' load. A partitioned
    asset's partitions are dynamic (``faucet_<sync>_shards``): nothing is listed now; the sensor of
    :func:`faucet_dagster.syncs.partitions.faucet_partitions_sensor` (or
    :func:`faucet_dagster.syncs.partitions.refresh_partitions`) adds a partition per new shard.
    """
    translator = translator or FaucetTranslator()
    declared_at = declaring_line()
    check_pairs([sync.pair_check() for sync in syncs], where=name or "faucet_assets")
    DECLARED.syncs.update((sync.name, sync) for sync in syncs)
    partitioned = _shardable(syncs)
    partitions_def = _partitions(syncs, partitioned)
    specs = [
        with_code_reference(
            translator.get_asset_spec(FaucetSyncData(sync, partitioned is not None)), declared_at
        )
        for sync in syncs
    ]
    keys = [spec.key for spec in specs]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"two syncs map to the same asset key: {keys}", where="faucet_assets")
    if partitions_def is not None:
        install_launch_hint(keys[0].to_user_string())
    pools = {sync.pool for sync in syncs if sync.pool is not None}
    if pool is None and len(pools) == 1:
        [pool] = pools
    bound = FaucetSyncs(dict(zip(keys, syncs, strict=True)))
    resource_keys = {
        endpoint.resource_key
        for sync in syncs
        for endpoint in sync.endpoints()
        if endpoint.resource_key is not None
    } | set(required_resource_keys)

    def decorator(fn: FaucetBody) -> dg.AssetsDefinition:
        @dg.multi_asset(
            name=name or fn.__name__,
            specs=[replace_partitions(spec, partitions_def) for spec in specs],
            can_subset=True,
            partitions_def=partitions_def,
            # A range of shards in one run, one after the other, each from its own bookmark
            # (``dg launch --partition-range`` needs it; see FaucetSyncs.materialize_range).
            backfill_policy=None if partitions_def is None else dg.BackfillPolicy.single_run(),
            required_resource_keys=resource_keys,
            op_tags=op_tags,
            pool=pool,
            check_specs=[
                check
                for sync, spec in zip(syncs, specs, strict=True)
                for check in sync_check_specs(sync, spec.key)
            ],
        )
        def _faucet_assets(context: dg.AssetExecutionContext) -> Iterator[Any]:
            yield from fn(context, bound)

        return _faucet_assets

    return decorator


def faucet_sync_assets(
    syncs: Sequence[FaucetSync], *, translator: FaucetTranslator | None = None
) -> list[dg.AssetsDefinition]:
    """One ``multi_asset`` per sync, each running its sync: the assets of ``syncs``, ready to use."""
    assets = []
    for sync in syncs:

        @faucet_assets(syncs=[sync], translator=translator, name=op_name(sync.name))
        def _sync(
            context: dg.AssetExecutionContext, faucet: FaucetSyncs
        ) -> Iterator[dg.MaterializeResult[Any] | dg.AssetMaterialization]:
            yield from faucet.run(context)

        assets.append(_sync)
    return assets


def replace_partitions(
    spec: dg.AssetSpec, partitions_def: dg.PartitionsDefinition[str] | None
) -> dg.AssetSpec:
    return spec.replace_attributes(partitions_def=partitions_def, skippable=True)


def _partitions(
    syncs: Sequence[FaucetSync], sharded: FaucetSync | None
) -> dg.PartitionsDefinition[str] | None:
    """The asset's partitions: one dynamic partition a shard, or the time windows a sync declares
    (alone in its asset, and never with a shardable source)."""
    timed = [sync for sync in syncs if sync.time_partitions is not None]
    if not timed:
        return None if sharded is None else dg.DynamicPartitionsDefinition(name=partitions_def_name(sharded))
    if len(syncs) != 1 or sharded is not None:
        raise ConfigError(
            f"sync {timed[0].name}: time partitions need a sync alone in its asset whose source is not "
            "sharded (one partition scheme an asset)",
            where="faucet_assets",
        )
    return timed[0].time_partitions


def _shardable(syncs: Sequence[FaucetSync]) -> FaucetSync | None:
    """The sync whose source is known now and shardable (its capabilities, read without I/O)."""
    shardable = [sync for sync in syncs if sync.shardable()]
    if not shardable:
        return None
    if len(syncs) != 1:
        raise ConfigError(
            f"a sync with a shardable source becomes a partitioned asset and must be alone in its "
            f"multi_asset: {shardable[0].name}",
            where="faucet_assets",
        )
    return shardable[0]


__all__ = [
    "FaucetSync",
    "FaucetSyncData",
    "FaucetSyncs",
    "FaucetTranslator",
    "SyncState",
    "faucet_assets",
    "faucet_sync_assets",
    "last_sync_state",
    "sync_metadata",
]
