"""A sync's materialization metadata, and reading the last one back: bookmarks live in Dagster's run
storage.

Every materialization carries Dagster's table metadata (``dagster/row_count``, the table's rows after
the run; ``dagster/partition_row_count``; ``dagster/table_name``, qualified; ``dagster/storage_kind``;
``dagster/column_schema``), ``faucet/bookmark`` (and ``faucet/start_bookmark``, where the run
started: the range ``faucet verify`` re-reads), ``faucet/commit_token``, ``faucet/delivery``,
``faucet/plan``, ``faucet/rows_read``, ``faucet/rows_written`` (this run's),
``faucet/rows_dead_lettered``, ``faucet/rows_skipped``, ``faucet/pages``, ``faucet/rows_per_second``,
``faucet/seconds``, ``faucet/source`` and ``faucet/sink`` (dataset URIs, never secrets), and what the
sink's commits returned (``delta/table_version``: the Delta table version the run's last commit
created). The next run reads the bookmark and commit token back with :func:`last_sync_state`.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import dagster as dg
import pyarrow as pa
from dagster._core.definitions.metadata import TableMetadataSet

from faucet_dagster.protocol import CommitToken, JsonValue, WritePolicy
from faucet_dagster.runner.bounded_values import BoundedSyncResult

BOOKMARK_KEY = "faucet/bookmark"


COMMIT_TOKEN_KEY = "faucet/commit_token"

START_BOOKMARK_KEY = "faucet/start_bookmark"
"""The bookmark the run started from: with ``faucet/bookmark``, the range ``faucet verify`` re-reads."""


@dataclass(frozen=True)
class SyncState:
    """What the last successful materialization of an asset (partition) recorded for the next run."""

    bookmark: JsonValue | None = None
    commit_token: CommitToken | None = None
    partition_rows: int | None = None
    """The partition's ``dagster/partition_row_count`` (0 for a first run; ``None``: not kept)."""


@dataclass(frozen=True)
class SyncOutcome:
    """A completed run and the URIs of what it read and wrote."""

    result: BoundedSyncResult
    source_uri: str
    sink_uri: str
    table_rows: int | None = None
    """The destination table's rows after the run, when the sink can count them."""
    sink_details: Mapping[str, int | str] = field(default_factory=dict)
    """What the sink's commits of this run returned (``Sink.commit_details``: a Delta table's version)."""


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


def last_table_rows(instance: dg.DagsterInstance, key: dg.AssetKey) -> int | None:
    """The destination table's rows after the newest materialization of ``key`` (any partition) that
    counted them (None: none did)."""
    page = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=1)
    for record in page.records:
        materialization = record.asset_materialization
        rows = None if materialization is None else materialization.metadata.get("dagster/row_count")
        if isinstance(rows, dg.IntMetadataValue):
            return rows.value
    return None


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
        START_BOOKMARK_KEY: _bookmark_value(None if previous is None else previous.bookmark),
        COMMIT_TOKEN_KEY: dg.MetadataValue.null() if token is None else dg.MetadataValue.text(str(token)),
        "faucet/delivery": dg.MetadataValue.text(result.plan.delivery.value),
        "faucet/plan": dg.MetadataValue.json(result.plan.to_dict()),
        "faucet/rows_read": dg.MetadataValue.int(result.rows_read),
        "faucet/rows_written": dg.MetadataValue.int(result.rows_written),
        # A count no plot should draw (almost always 0); the opt-in check watches it.
        "faucet/rows_dead_lettered": dg.MetadataValue.text(str(result.rows_dead_lettered)),
        "faucet/rows_skipped": dg.MetadataValue.int(result.rows_skipped),
        "faucet/rows_missing_fields": dg.MetadataValue.json(dict(result.missing_fields)),
        "faucet/pages": dg.MetadataValue.int(result.pages),
        "faucet/rows_per_second": dg.MetadataValue.float(round(result.rows_per_second, 1)),
        "faucet/seconds": dg.MetadataValue.float(round(result.seconds, 3)),
        "faucet/source": dg.MetadataValue.text(outcome.source_uri),
        "faucet/sink": dg.MetadataValue.text(outcome.sink_uri),
        **{
            key: dg.MetadataValue.int(detail) if isinstance(detail, int) else dg.MetadataValue.text(detail)
            for key, detail in outcome.sink_details.items()
        },
    }


def table_name(uri: str) -> str:
    """The fully qualified table name (``database.schema.table`` as far as the URI names them) for
    ``dagster/table_name``, from a sink's dataset URI: ``sqlite:///w.db#orders`` -> ``w.orders``,
    ``postgresql://host/shop#public.orders`` and ``postgresql://host/shop/public.orders`` ->
    ``shop.public.orders``, ``duckdb:///data/w.duckdb#main.orders`` -> ``w.main.orders`` (DuckDB's
    own name for it: a file's catalog is named after the file)."""
    base, _, fragment = uri.partition("#")
    segments = [segment for segment in base.split("://", 1)[-1].split("/")[1:] if segment]
    if fragment:
        table = fragment
        database = segments[-1] if segments else ""
    else:
        table = segments[-1] if segments else uri
        database = segments[-2] if len(segments) > 1 else ""
    database = database.split("?", 1)[0]
    for suffix in (".db", ".sqlite", ".sqlite3", ".duckdb"):
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


def bookmark_from(value: dg.MetadataValue[Any]) -> JsonValue | None:
    """A bookmark as :func:`sync_metadata` recorded it (``None``: none)."""
    return _bookmark_from(value)


def _bookmark_from(value: dg.MetadataValue[Any]) -> JsonValue | None:
    if isinstance(value, dg.JsonMetadataValue):
        return cast(JsonValue, value.data)
    if isinstance(value, dg.TextMetadataValue) and value.text is not None:
        text: JsonValue = json.loads(value.text)
        return text
    return None


__all__ = [
    "BOOKMARK_KEY",
    "COMMIT_TOKEN_KEY",
    "START_BOOKMARK_KEY",
    "SyncOutcome",
    "SyncState",
    "bookmark_from",
    "last_sync_state",
    "last_table_rows",
    "storage_kind",
    "sync_metadata",
    "table_name",
]
