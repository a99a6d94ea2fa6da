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

A source whose capabilities say ``shardable`` and whose connection is known when the definitions load
(not a resource key) becomes a partitioned asset: one ``StaticPartitionsDefinition`` key per shard
(the shard's path relative to the shards' common directory), each with its own bookmark.

Metadata of every materialization: ``dagster/row_count`` (rows this materialization wrote),
``dagster/table_name``, ``dagster/column_schema``, ``faucet/bookmark``, ``faucet/commit_token``,
``faucet/delivery``, ``faucet/plan``, ``faucet/rows_read``, ``faucet/rows_written``,
``faucet/rows_dead_lettered``, ``faucet/rows_skipped``, ``faucet/pages``, ``faucet/rows_per_second``,
``faucet/seconds``, ``faucet/source`` and ``faucet/sink`` (dataset URIs, never secrets).
"""

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, cast

import dagster as dg
import pyarrow as pa

from faucet_dagster.protocol import (
    CommitToken,
    ConfigError,
    Delivery,
    FetchContext,
    JsonValue,
    Sink,
    Source,
)
from faucet_dagster.resources import FaucetEndpoint
from faucet_dagster.runner.bounded import (
    DEFAULT_BATCH_SIZE,
    BoundedSyncResult,
    PageReport,
    SyncSettings,
    run_bounded_sync,
)
from faucet_dagster.runner.sync import run_sync

BOOKMARK_KEY = "faucet/bookmark"
COMMIT_TOKEN_KEY = "faucet/commit_token"


@dataclass(frozen=True)
class FaucetSync:
    """One bounded sync: read ``source`` and write ``sink`` with the mode its config chooses.

    ``delivery`` is the guarantee asked for (``None``: the best reachable; the plan says which).
    ``dead_letter`` receives the rows that cannot be converted or that the sink rejects (it rules out
    the atomic watermark). ``evolve_schema`` adds new source columns to the destination instead of
    failing the run.
    """

    name: str
    source: FaucetEndpoint
    sink: FaucetEndpoint
    delivery: Delivery | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    evolve_schema: bool = False
    dead_letter: FaucetEndpoint | None = None
    description: str | None = None

    def settings(self) -> SyncSettings:
        """The runner settings of this sync (run storage is durable state)."""
        return SyncSettings(
            delivery=self.delivery,
            batch_size=self.batch_size,
            evolve_schema=self.evolve_schema,
            durable_state=True,
        )

    def endpoints(self) -> tuple[FaucetEndpoint, ...]:
        return (
            (self.source, self.sink)
            if self.dead_letter is None
            else (self.source, self.sink, self.dead_letter)
        )


@dataclass(frozen=True)
class FaucetSyncData:
    """What a translator sees of a sync: the declaration and the partition keys it will have."""

    sync: FaucetSync
    partition_keys: tuple[str, ...] | None = None


@dataclass
class FaucetTranslator:
    """Maps a sync to its Dagster ``AssetSpec``; override ``get_asset_spec`` (the one override point).

    Defaults: key ``[sync.name]``; kinds ``{"faucet", <source connector>, <sink connector>}`` (a
    connection given by resource key is only known at run time and adds no kind); a dependency on
    the source dataset, ``[<source connector or resource key>, sync.name]``; the description;
    tags ``faucet/source`` and ``faucet/sink``. Group, owners and further tags are
    yours to add, for example ``super().get_asset_spec(data).replace_attributes(group_name="raw")``.
    """

    def get_asset_spec(self, data: FaucetSyncData) -> dg.AssetSpec:
        sync = data.sync
        kinds = {"faucet"} | {c for c in (sync.source.connector, sync.sink.connector) if c is not None}
        return dg.AssetSpec(
            key=dg.AssetKey([sync.name]),
            deps=[dg.AssetKey([sync.source.label, sync.name])],
            description=sync.description
            or f"Faucet bounded sync {sync.name}: {sync.source.label} to {sync.sink.label}.",
            kinds=kinds,
            tags={
                "faucet/source": sync.source.label,
                "faucet/sink": sync.sink.label,
            },
        )


@dataclass(frozen=True)
class SyncState:
    """What the last successful materialization of an asset (partition) recorded for the next run."""

    bookmark: JsonValue | None = None
    commit_token: CommitToken | None = None


class FaucetSyncs:
    """The syncs of one ``multi_asset``, by asset key, ready to run inside its body.

    ``run(context)`` materializes each selected asset in declaration order and yields one
    ``MaterializeResult`` per asset, after its sync completed.
    """

    def __init__(
        self,
        by_key: Mapping[dg.AssetKey, FaucetSync],
        shards: Mapping[str, str] | None = None,
    ) -> None:
        self.by_key = dict(by_key)
        self.shards = dict(shards or {})
        """Partition key -> shard, for a partitioned sync."""

    def run(self, context: dg.AssetExecutionContext) -> Iterator[dg.MaterializeResult[Any]]:
        """Run the selected syncs one after the other; blocks until each one completed."""
        selected = context.selected_asset_keys
        for key, sync in self.by_key.items():
            if key in selected:
                yield self.materialize(context, key, sync)

    def materialize(
        self, context: dg.AssetExecutionContext, key: dg.AssetKey, sync: FaucetSync
    ) -> dg.MaterializeResult[Any]:
        partition = context.partition_key if context.has_partition_key else None
        shard = None
        if partition is not None:
            try:
                shard = self.shards[partition]
            except KeyError:
                raise ConfigError(
                    f"partition {partition!r} names no shard of the source (reload the definitions to "
                    "see new files)",
                    where=key.to_user_string(),
                ) from None
        state = last_sync_state(context.instance, key, partition)
        context.log.info(
            f"faucet sync {sync.name}: {sync.source.label} -> {sync.sink.label}"
            f"{', shard ' + shard if shard else ''}, resuming from "
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
        outcome = run_sync(_execute(sync, context.resources, state, shard, ctx, on_page))
        result = outcome.result
        context.log.info(
            f"faucet sync {sync.name}: read {result.rows_read}, wrote {result.rows_written}, "
            f"dead-lettered {result.rows_dead_lettered}, skipped {result.rows_skipped} in "
            f"{result.seconds:.2f}s ({result.plan.policy.value}, {result.plan.delivery.value})"
        )
        return dg.MaterializeResult(asset_key=key, metadata=sync_metadata(outcome))


@dataclass(frozen=True)
class SyncOutcome:
    """A completed run and the URIs of what it read and wrote."""

    result: BoundedSyncResult
    source_uri: str
    sink_uri: str


async def _execute(
    sync: FaucetSync,
    resources: Any,
    state: SyncState,
    shard: str | None,
    ctx: FetchContext,
    on_page: Callable[[PageReport], None],
) -> SyncOutcome:
    """Build the connectors for this run, run the sync, and close them whatever happens."""
    async with AsyncExitStack() as stack:
        source: Source = sync.source.resolve(resources).build_source(sync.source.config)
        stack.push_async_callback(source.close)
        sink: Sink = sync.sink.resolve(resources).build_sink(sync.sink.config)
        stack.push_async_callback(sink.close)
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
        return SyncOutcome(result, source.dataset_uri(), sink.dataset_uri())


def last_sync_state(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str | None) -> SyncState:
    """The bookmark and commit token of the newest materialization of ``key`` (``partition``) that
    recorded them; an empty state when there is none (a first run).

    Materializations without faucet state (reported by hand in the UI) are passed over.
    """
    records_filter = dg.AssetRecordsFilter(
        asset_key=key, asset_partitions=None if partition is None else [partition]
    )
    cursor = None
    while True:
        page = instance.fetch_materializations(records_filter, limit=1, cursor=cursor)
        for record in page.records:
            materialization = record.asset_materialization
            if materialization is None or BOOKMARK_KEY not in materialization.metadata:
                continue
            metadata = materialization.metadata
            token = metadata.get(COMMIT_TOKEN_KEY)
            token_text = token.value if isinstance(token, dg.TextMetadataValue) else None
            return SyncState(
                bookmark=_bookmark_from(metadata[BOOKMARK_KEY]),
                commit_token=None if not token_text else CommitToken.parse(token_text),
            )
        if not page.has_more:
            return SyncState()
        cursor = page.cursor


def sync_metadata(outcome: SyncOutcome) -> dict[str, Any]:
    """The metadata of one materialization (see the module docstring); no config, no secrets."""
    result = outcome.result
    token = result.commit_token
    return {
        "dagster/row_count": dg.MetadataValue.int(result.rows_written),
        "dagster/table_name": dg.MetadataValue.text(table_name(outcome.sink_uri)),
        "dagster/column_schema": dg.MetadataValue.table_schema(_table_schema(result.schema)),
        BOOKMARK_KEY: _bookmark_value(result.bookmark),
        COMMIT_TOKEN_KEY: dg.MetadataValue.null() if token is None else dg.MetadataValue.text(str(token)),
        "faucet/delivery": dg.MetadataValue.text(result.plan.delivery.value),
        "faucet/plan": dg.MetadataValue.json(result.plan.to_dict()),
        "faucet/rows_read": dg.MetadataValue.int(result.rows_read),
        "faucet/rows_written": dg.MetadataValue.int(result.rows_written),
        "faucet/rows_dead_lettered": dg.MetadataValue.int(result.rows_dead_lettered),
        "faucet/rows_skipped": dg.MetadataValue.int(result.rows_skipped),
        "faucet/pages": dg.MetadataValue.int(result.pages),
        "faucet/rows_per_second": dg.MetadataValue.float(round(result.rows_per_second, 1)),
        "faucet/seconds": dg.MetadataValue.float(round(result.seconds, 3)),
        "faucet/source": dg.MetadataValue.text(outcome.source_uri),
        "faucet/sink": dg.MetadataValue.text(outcome.sink_uri),
    }


def table_name(uri: str) -> str:
    """A table name for ``dagster/table_name`` from a sink's dataset URI: its fragment when it has
    one (``sqlite:///w.db#orders`` -> ``orders``), else its last path segment
    (``postgresql://host/db/public.orders`` -> ``public.orders``)."""
    base, _, fragment = uri.partition("#")
    return fragment or base.rstrip("/").rsplit("/", 1)[-1] or uri


def _table_schema(schema: pa.Schema | None) -> dg.TableSchema:
    if schema is None:
        return dg.TableSchema(columns=[])
    return dg.TableSchema(
        columns=[
            dg.TableColumn(
                name=f.name,
                type=str(f.type),
                constraints=dg.TableColumnConstraints(nullable=f.nullable),
            )
            for f in schema
        ]
    )


def _bookmark_value(bookmark: JsonValue | None) -> dg.MetadataValue[Any]:
    """Objects and lists as JSON (readable in the UI); a scalar as its JSON text."""
    if bookmark is None:
        return dg.MetadataValue.null()
    if isinstance(bookmark, dict | list):
        return dg.MetadataValue.json(bookmark)
    return dg.MetadataValue.text(json.dumps(bookmark))


def _bookmark_from(value: dg.MetadataValue[Any]) -> JsonValue | None:
    if isinstance(value, dg.JsonMetadataValue):
        return cast(JsonValue, value.data)
    if isinstance(value, dg.TextMetadataValue) and value.text is not None:
        text: JsonValue = json.loads(value.text)
        return text
    return None


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

    Partitions are enumerated now, when the definitions load (the source lists its shards; no
    other I/O); new shards appear when the definitions reload.
    """
    translator = translator or FaucetTranslator()
    partition_keys, shards = _partitions(syncs)
    specs = [
        translator.get_asset_spec(FaucetSyncData(sync, partition_keys if len(syncs) == 1 else None))
        for sync in syncs
    ]
    keys = [spec.key for spec in specs]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"two syncs map to the same asset key: {keys}", where="faucet_assets")
    partitions_def = None if partition_keys is None else dg.StaticPartitionsDefinition(list(partition_keys))
    bound = FaucetSyncs(dict(zip(keys, syncs, strict=True)), shards)
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
            # One shard a run: each partition resumes from its own bookmark.
            backfill_policy=None if partitions_def is None else dg.BackfillPolicy.multi_run(1),
            required_resource_keys=resource_keys,
            op_tags=op_tags,
            pool=pool,
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

        @faucet_assets(syncs=[sync], translator=translator, name=_op_name(sync.name))
        def _sync(
            context: dg.AssetExecutionContext, faucet: FaucetSyncs
        ) -> Iterator[dg.MaterializeResult[Any]]:
            yield from faucet.run(context)

        assets.append(_sync)
    return assets


def replace_partitions(
    spec: dg.AssetSpec, partitions_def: dg.PartitionsDefinition[str] | None
) -> dg.AssetSpec:
    return spec.replace_attributes(partitions_def=partitions_def, skippable=True)


def _op_name(name: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return f"faucet_{cleaned}"


def _partitions(syncs: Sequence[FaucetSync]) -> tuple[tuple[str, ...] | None, dict[str, str]]:
    """Partition keys and the shard each names, for a sync whose shardable source is known now."""
    shardable = [
        (sync, source) for sync, source in _sources_known_now(syncs) if source.capabilities().shardable
    ]
    if not shardable:
        return None, {}
    sync, source = shardable[0]
    if len(syncs) != 1:
        raise ConfigError(
            f"a sync with a shardable source becomes a partitioned asset and must be alone in its "
            f"multi_asset: {sync.name}",
            where="faucet_assets",
        )
    shards = run_sync(_shards(source))
    by_key = dict(zip(_partition_keys(shards), shards, strict=True))
    return tuple(by_key), by_key


def _sources_known_now(syncs: Sequence[FaucetSync]) -> Iterator[tuple[FaucetSync, Source]]:
    """The sources whose connection the sync holds (built without I/O), with their syncs."""
    for sync in syncs:
        if not isinstance(sync.source.connection, str):
            yield sync, sync.source.connection.build_source(sync.source.config)


async def _shards(source: Source) -> Sequence[str]:
    try:
        return await source.enumerate_shards()
    finally:
        await source.close()


def _partition_keys(shards: Sequence[str]) -> list[str]:
    """Each shard relative to the shards' common directory (a file name, for files in one folder).

    Shards that do not share a directory, or whose relative names collide, keep their full names.
    """
    if len(shards) == 1:
        return [os.path.basename(shards[0]) or shards[0]]
    try:
        common = os.path.commonpath(shards) if shards else ""
    except ValueError:  # absolute and relative paths mixed: no common directory
        common = ""
    keys = [os.path.relpath(shard, common) if common else shard for shard in shards]
    return keys if len(set(keys)) == len(keys) else list(shards)


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
