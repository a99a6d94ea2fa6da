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
(:mod:`faucet_dagster.preflight`), and a mistake fails the load. A source whose capabilities say
``shardable`` and whose connection is known when the definitions load (not a resource key) becomes a
partitioned asset with dynamic partitions, ``faucet_<sync>_shards``, one a shard (its path relative
to the shards' common directory), each with its own bookmark; the shards are listed by
:func:`faucet_dagster.partitions.faucet_partitions_sensor`, and by a run for its own partition. A run
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

import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, cast

import dagster as dg
import pyarrow as pa
from dagster._core.definitions.metadata import TableMetadataSet

from faucet_dagster.declared import DECLARED, declaring_line
from faucet_dagster.launch_hint import install_launch_hint
from faucet_dagster.preflight import PairCheck, build_offline, check_pairs
from faucet_dagster.protocol import (
    CommitToken,
    ConfigError,
    Delivery,
    FetchContext,
    JsonValue,
    Mode,
    Role,
    Sink,
    Source,
    WritePolicy,
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
from faucet_dagster.shards import shard_of

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

    def pair_check(self) -> PairCheck:
        """What the definitions' load checks of this sync (see :mod:`faucet_dagster.preflight`)."""
        return PairCheck(
            where=f"sync {self.name}",
            mode=Mode.BOUNDED,
            source=self.source,
            sink=self.sink,
            delivery=self.delivery,
            dead_letter=self.dead_letter,
        )

    def shardable(self) -> bool:
        """Whether the source is known now and declares itself shardable (no I/O: capabilities
        come from the config, environment references unread; a source that cannot be built without
        their values is not known now)."""
        source, _ = build_offline(self.source, Role.SOURCE)
        if not isinstance(source, Source):
            return False
        try:
            return source.capabilities().shardable
        finally:
            run_sync(source.close())

    def endpoints(self) -> tuple[FaucetEndpoint, ...]:
        return (
            (self.source, self.sink)
            if self.dead_letter is None
            else (self.source, self.sink, self.dead_letter)
        )


@dataclass(frozen=True)
class FaucetSyncData:
    """What a translator sees of a sync: the declaration and whether its asset is partitioned (one
    dynamic partition a shard of its source)."""

    sync: FaucetSync
    partitioned: bool = False


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


@dataclass(frozen=True)
class SyncState:
    """What the last successful materialization of an asset (partition) recorded for the next run."""

    bookmark: JsonValue | None = None
    commit_token: CommitToken | None = None
    partition_rows: int | None = None
    """The partition's ``dagster/partition_row_count`` (0 for a first run; ``None``: not kept)."""


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
            yield dg.MaterializeResult(asset_key=key, metadata=self.move(context, key, sync, partition))

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
        for partition in context.partition_keys:
            try:
                metadata = self.move(context, key, sync, partition)
            except BaseException:
                for completed, recorded in done:
                    yield dg.AssetMaterialization(asset_key=key, partition=completed, metadata=recorded)
                raise
            done.append((partition, metadata))
        for completed, recorded in done:
            context.add_asset_metadata(recorded, asset_key=key, partition_key=completed)
        yield dg.MaterializeResult(asset_key=key)

    def move(
        self, context: dg.AssetExecutionContext, key: dg.AssetKey, sync: FaucetSync, partition: str | None
    ) -> dict[str, Any]:
        """Run ``sync`` (for ``partition``) from its last bookmark; the materialization's metadata."""
        state = last_sync_state(context.instance, key, partition)
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
        outcome = run_sync(_execute(sync, context.resources, state, partition, ctx, on_page))
        result = outcome.result
        context.log.info(
            f"faucet sync {sync.name}: read {result.rows_read}, wrote {result.rows_written}, "
            f"dead-lettered {result.rows_dead_lettered}, skipped {result.rows_skipped} in "
            f"{result.seconds:.2f}s ({result.plan.policy.value}, {result.plan.delivery.value})"
        )
        return sync_metadata(outcome, state)


@dataclass(frozen=True)
class SyncOutcome:
    """A completed run and the URIs of what it read and wrote."""

    result: BoundedSyncResult
    source_uri: str
    sink_uri: str
    table_rows: int | None = None
    """The destination table's rows after the run, when the sink can count them."""


async def _execute(
    sync: FaucetSync,
    resources: Any,
    state: SyncState,
    partition: str | None,
    ctx: FetchContext,
    on_page: Callable[[PageReport], None],
) -> SyncOutcome:
    """Build the connectors for this run, run the sync, and close them whatever happens.

    A partition's shard is looked up now, among the shards the source lists (the definitions'
    load lists nothing)."""
    async with AsyncExitStack() as stack:
        source: Source = sync.source.resolve(resources).build_source(sync.source.config)
        stack.push_async_callback(source.close)
        shard = None
        if partition is not None:
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
        return SyncOutcome(result, source.dataset_uri(), sink.dataset_uri(), rows)


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
            rows = metadata.get("dagster/partition_row_count")
            return SyncState(
                bookmark=_bookmark_from(metadata[BOOKMARK_KEY]),
                commit_token=None if not token_text else CommitToken.parse(token_text),
                partition_rows=rows.value if isinstance(rows, dg.IntMetadataValue) else None,
            )
        if not page.has_more:
            return SyncState(partition_rows=None if partition is None else 0)
        cursor = page.cursor


def sync_metadata(outcome: SyncOutcome, previous: SyncState | None = None) -> dict[str, Any]:
    """The metadata of one materialization (see the module docstring); no config, no secrets.

    Dagster's table metadata (:class:`dagster.TableMetadataSet`): ``dagster/row_count`` the
    destination table's rows after the run (when the sink can count them), ``dagster/table_name``
    fully qualified, ``dagster/storage_kind`` the sink's URI scheme, ``dagster/column_schema``; for
    a partition of an appending sync, ``dagster/partition_row_count`` the rows this partition has
    appended over all its runs (``previous`` is the state of its last run).
    """
    result = outcome.result
    token = result.commit_token
    partition_rows = None
    if (
        previous is not None
        and result.plan.policy is WritePolicy.APPEND
        and previous.partition_rows is not None
    ):
        partition_rows = previous.partition_rows + result.rows_written
    table = TableMetadataSet(
        column_schema=_table_schema(result.schema),
        row_count=outcome.table_rows,
        partition_row_count=partition_rows,
        table_name=table_name(outcome.sink_uri),
        storage_kind=storage_kind(outcome.sink_uri),
    )
    return {
        **{key: table[key] for key in list(table.keys())},  # keys(): the fields that are set
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
    """The fully qualified table name (``database.schema.table`` as far as the URI names them) for
    ``dagster/table_name``, from a sink's dataset URI: ``sqlite:///w.db#orders`` -> ``w.orders``,
    ``postgresql://host/shop#public.orders`` and ``postgresql://host/shop/public.orders`` ->
    ``shop.public.orders``."""
    base, _, fragment = uri.partition("#")
    segments = [segment for segment in base.split("://", 1)[-1].split("/")[1:] if segment]
    if fragment:
        table = fragment
        database = segments[-1] if segments else ""
    else:
        table = segments[-1] if segments else uri
        database = segments[-2] if len(segments) > 1 else ""
    database = database.split("?", 1)[0]
    for suffix in (".db", ".sqlite", ".sqlite3"):
        database = database.removesuffix(suffix)
    return f"{database}.{table}" if database else table


def storage_kind(uri: str) -> str | None:
    """The storage system of a dataset URI, its scheme without a driver (``postgresql+psycopg`` ->
    ``postgresql``)."""
    scheme, separator, _ = uri.partition("://")
    return scheme.split("+", 1)[0] or None if separator else None


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

    Every config is parsed and every pair planned now, without I/O (see
    :mod:`faucet_dagster.preflight`): a mistake fails the definitions' load. A partitioned asset's
    partitions are dynamic (``faucet_<sync>_shards``): nothing is listed now; the sensor of
    :func:`faucet_dagster.partitions.faucet_partitions_sensor` (or
    :func:`faucet_dagster.partitions.refresh_partitions`) adds a partition per new shard.
    """
    translator = translator or FaucetTranslator()
    declared_at = declaring_line()
    check_pairs([sync.pair_check() for sync in syncs], where=name or "faucet_assets")
    DECLARED.syncs.update((sync.name, sync) for sync in syncs)
    partitioned = _shardable(syncs)
    partitions_def = (
        None if partitioned is None else dg.DynamicPartitionsDefinition(name=partitions_def_name(partitioned))
    )
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
        ) -> Iterator[dg.MaterializeResult[Any] | dg.AssetMaterialization]:
            yield from faucet.run(context)

        assets.append(_sync)
    return assets


def with_code_reference(spec: dg.AssetSpec, line: tuple[str, int] | None) -> dg.AssetSpec:
    """``spec`` referencing the line that declared it (``dagster/code_references``), unless it holds
    references already (a component's ``defs.yaml`` line, a translator's own)."""
    if line is None or "dagster/code_references" in spec.metadata:
        return spec
    with warnings.catch_warnings():
        # Dagster marks code references beta; its own components attach them the same way.
        warnings.simplefilter("ignore", dg.BetaWarning)
        reference = dg.LocalFileCodeReference(file_path=line[0], line_number=line[1])
        value = dg.CodeReferencesMetadataValue(code_references=[reference])
    return spec.merge_attributes(metadata={"dagster/code_references": value})


def replace_partitions(
    spec: dg.AssetSpec, partitions_def: dg.PartitionsDefinition[str] | None
) -> dg.AssetSpec:
    return spec.replace_attributes(partitions_def=partitions_def, skippable=True)


def _op_name(name: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return f"faucet_{cleaned}"


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


def partitions_def_name(sync: FaucetSync) -> str:
    """The name of the dynamic partitions of ``sync``'s asset: ``faucet_<sync>_shards``."""
    return f"{_op_name(sync.name)}_shards"


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
