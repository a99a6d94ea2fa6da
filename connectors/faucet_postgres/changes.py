"""Change rows applied to a table by key, in commit order, with set-based SQL (the APPLY_CHANGES policy).

A change row is a row of the destination table's columns plus ``__faucet_op`` (``insert``,
``update``, ``delete``) and, optionally, ``__faucet_unchanged`` (the columns an update did not carry:
keep the destination's value there). Rows are applied in the order of their ``(position, ordinal)``
(commit LSN, then source order within the transaction), never in the order batches arrived.

How, in one transaction:

1. :func:`create_stage` makes a temporary table with the destination's column types plus the
   operation, the unchanged columns (``jsonb``), the position and the ordinal; it is dropped at the
   end of the transaction (commit or rollback).
2. :func:`stage` collects change rows and COPYs them into it in runs of at least
   :data:`COPY_ROWS` (binary where the types allow, see :func:`faucet_postgres.copy_arrow.copy_batch`):
   a source transaction is often a few rows, and a COPY per transaction would cost a round trip each.
   Nothing touches the destination yet.
3. :func:`faucet_postgres.change_apply.apply_stage` applies the stage to the destination by key
   (see there).

The key is the one configured, else the columns whose field metadata ``faucet.key`` is ``"true"``
(what the PostgreSQL change source marks: the replica identity, under FULL the primary key). The key should
be indexed in the destination (a table the sink creates gets it as primary key). Key values are
compared with ``=``: a null key is refused with :class:`DataError`.

A layout keyed by every one of its columns (a table without a primary key, which the change source
reads under FULL) is a multiset: identical rows are distinct rows, nulls are allowed, and the stage is
applied by :mod:`faucet_postgres.multiset` (an insert adds a row, a delete removes exactly one); a
table the sink creates for it has no primary key.
"""

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from faucet_dagster.protocol import (
    OPERATION_COLUMN,
    UNCHANGED_COLUMN,
    ConfigError,
    DataError,
    Operation,
    SchemaError,
)
from faucet_postgres.common import PgColumn
from faucet_postgres.copy_arrow import copy_batch
from faucet_postgres.refusals import apply_finding_refusals

KEY_METADATA = b"faucet.key"
"""The field metadata marking a key column of change rows (value ``b"true"``)."""

OPERATIONS = (
    Operation.INSERT.value,
    Operation.UPDATE.value,
    Operation.DELETE.value,
    Operation.TRUNCATE.value,
)
"""The operations a change row may carry."""

APPLIED_OPERATIONS = frozenset(Operation(value) for value in OPERATIONS)
"""What APPLY_CHANGES applies (the sinks' accepted operations for it)."""

STAGE_POSITION = "__faucet_position"
STAGE_ORDINAL = "__faucet_ordinal"
"""The stage's columns of each change row's position and ordinal (its order of application)."""
_BIGINT = PgColumn("", "int8", "bigint", -1, False)

COPY_ROWS = 32_768
"""Staged rows are held in memory until this many can be COPYed at once (or the stage is applied)."""


@dataclass(frozen=True)
class ChangeLayout:
    """The shape of one table's change rows: its data columns (batch order) and its key.

    ``whole_rows``: the change rows carry whole old rows (a source table under REPLICA IDENTITY FULL,
    schema metadata ``faucet.replica_identity`` ``f``), every update as a delete and an insert: they
    are applied as a multiset, each delete removing the row it names, since a key may hold two rows
    within a source transaction (a DEFERRABLE key: ``UPDATE t SET id = id + 1``); the key (the
    primary key) only narrows the rows looked at, through its index.
    """

    columns: tuple[str, ...]
    key: tuple[str, ...]
    whole_rows: bool = False

    @property
    def multiset(self) -> bool:
        """True when the rows are applied as a multiset (see the module docstring): every column is in
        the key, or the rows are whole (``whole_rows``)."""
        return self.whole_rows or set(self.key) == set(self.columns)

    @property
    def created_key(self) -> tuple[str, ...]:
        """The primary key of a table created for these rows: none when every column is the key."""
        return () if set(self.key) == set(self.columns) else self.key

    @property
    def others(self) -> tuple[str, ...]:
        """The data columns outside the key: what an update sets."""
        return tuple(column for column in self.columns if column not in self.key)


def change_layout(schema: pa.Schema, key: Sequence[str], where: str) -> ChangeLayout:
    """The layout of change rows of ``schema``, keyed by ``key`` or else by their ``faucet.key`` fields.

    Raises :class:`SchemaError` when there is no operation column or a key column is missing, and
    :class:`ConfigError` when no key is configured and no field is marked as one.
    """
    if OPERATION_COLUMN not in schema.names:
        raise SchemaError(
            f"change rows need the {OPERATION_COLUMN} column; these have {', '.join(schema.names)}",
            where=where,
        )
    columns = tuple(name for name in schema.names if name not in (OPERATION_COLUMN, UNCHANGED_COLUMN))
    chosen = tuple(key) or tuple(
        item.name
        for item in schema
        if item.name in columns and (item.metadata or {}).get(KEY_METADATA) == b"true"
    )
    if not chosen:
        raise ConfigError(
            "no key: configure one, or use a change source that marks its key columns (faucet.key)",
            where=where,
        )
    missing = [column for column in chosen if column not in columns]
    if missing:
        raise SchemaError(f"the change rows have no key column(s) {', '.join(missing)}", where=where)
    whole = (schema.metadata or {}).get(b"faucet.replica_identity") == b"f"
    return ChangeLayout(columns, chosen, whole_rows=whole)


def data_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` without the operation and unchanged columns: the destination table's columns."""
    return pa.schema(
        [item for item in schema if item.name not in (OPERATION_COLUMN, UNCHANGED_COLUMN)],
        metadata=schema.metadata,
    )


@dataclass(frozen=True)
class StagedRows:
    """Change rows checked and shaped for the stage, and the columns some of them left unchanged."""

    batch: pa.RecordBatch
    unchanged: frozenset[str]
    truncated: bool = False


def staged_rows(
    records: pa.RecordBatch, layout: ChangeLayout, positions: pa.Array, ordinals: pa.Array, where: str
) -> StagedRows:
    """Check change rows and add their order: ``positions`` and ``ordinals`` are int64, one per row.

    Raises :class:`DataError` for an unknown or null operation, a null key value, or an unchanged
    column that is not a data column.
    """
    ops = records.column(OPERATION_COLUMN)
    known = pc.is_in(ops, value_set=pa.array(OPERATIONS))
    if not pc.all(known).as_py():
        bad = ops.filter(pc.invert(pc.fill_null(known, False)))[0].as_py()
        raise DataError(
            f"a change row has operation {bad!r}; expected one of {', '.join(OPERATIONS)}", where=where
        )
    truncates = pc.equal(ops, Operation.TRUNCATE.value)
    truncated = bool(pc.any(truncates).as_py())
    keyed = records.filter(pc.invert(truncates)) if truncated else records  # a truncate row has no key
    nulls = [column for column in layout.key if keyed.column(column).null_count]
    if nulls and not layout.multiset:
        raise DataError(f"a change row has a null in key column(s) {', '.join(nulls)}", where=where)
    unchanged, names = _unchanged_json(records, where)
    stray = sorted(names - set(layout.columns))
    if stray:
        raise DataError(f"a change row leaves out column(s) {', '.join(stray)} it does not have", where=where)
    arrays = [records.column(column) for column in layout.columns]
    batch = pa.RecordBatch.from_arrays(
        [*arrays, ops.cast(pa.string()), unchanged, positions, ordinals],
        names=[*layout.columns, OPERATION_COLUMN, UNCHANGED_COLUMN, STAGE_POSITION, STAGE_ORDINAL],
    )
    return StagedRows(batch, frozenset(names), truncated)


def _unchanged_json(records: pa.RecordBatch, where: str) -> tuple[pa.Array, set[str]]:
    """The unchanged column as JSON text (null when a row is complete) and every name it holds."""
    if UNCHANGED_COLUMN not in records.schema.names:
        return pa.nulls(records.num_rows, pa.string()), set()
    values = records.column(UNCHANGED_COLUMN)
    if not pa.types.is_list(values.type) and not pa.types.is_large_list(values.type):
        raise DataError(f"{UNCHANGED_COLUMN} must be a list of column names, not {values.type}", where=where)
    if values.null_count == len(values) or len(pc.list_flatten(values)) == 0:
        return pa.nulls(records.num_rows, pa.string()), set()
    # Rare (only updates that left a TOASTed value out): a Python pass is fine here.
    texts = [json.dumps(names) if names else None for names in values.to_pylist()]
    return pa.array(texts, pa.string()), {
        str(name) for name in pc.unique(pc.list_flatten(values)).to_pylist()
    }


@dataclass
class ChangeStage:
    """A temporary table holding one destination table's staged changes in the current transaction.

    ``rows`` counts every row staged; ``held`` the batches not yet COPYed, ``held_rows`` their rows
    (fewer than :data:`COPY_ROWS`); ``truncated`` is true once a truncate row was staged.
    """

    identifier: sql.Identifier
    layout: ChangeLayout
    columns: dict[str, PgColumn]
    unchanged: set[str] = field(default_factory=set)
    rows: int = 0
    held: list[pa.RecordBatch] = field(default_factory=list)
    held_rows: int = 0
    truncated: bool = False
    name_refused: bool = False
    """Find the rows the server refuses when held rows are COPYed (:func:`copy_held`)."""


async def create_stage(
    conn: "psycopg.AsyncConnection[Any]",
    target: sql.Composable,
    target_columns: Mapping[str, PgColumn],
    layout: ChangeLayout,
) -> ChangeStage:
    """A temporary table (dropped at commit or rollback) with ``layout``'s columns typed as in ``target``."""
    missing = [column for column in layout.columns if column not in target_columns]
    if missing:
        raise SchemaError(f"the table has no column(s) {', '.join(missing)}", where=str(target))
    identifier = sql.Identifier(f"_faucet_changes_{uuid.uuid4().hex[:12]}")
    await conn.execute(
        sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
            identifier, column_list(layout.columns), target
        )
    )
    await conn.execute(
        sql.SQL(
            "ALTER TABLE {} ADD COLUMN {} text, ADD COLUMN {} jsonb, ADD COLUMN {} bigint, "
            "ADD COLUMN {} bigint"
        ).format(
            identifier,
            *map(sql.Identifier, (OPERATION_COLUMN, UNCHANGED_COLUMN, STAGE_POSITION, STAGE_ORDINAL)),
        )
    )
    columns = {column: target_columns[column] for column in layout.columns}
    columns[OPERATION_COLUMN] = PgColumn(OPERATION_COLUMN, "text", "text", -1, False)
    columns[UNCHANGED_COLUMN] = PgColumn(UNCHANGED_COLUMN, "jsonb", "jsonb", -1, False)
    columns[STAGE_POSITION] = columns[STAGE_ORDINAL] = _BIGINT
    return ChangeStage(identifier, layout, columns)


async def stage(conn: "psycopg.AsyncConnection[Any]", target: ChangeStage, rows: StagedRows) -> int:
    """Stage ``rows``: held, and COPYed with the held ones once they reach :data:`COPY_ROWS`. Returns
    how many rows were staged. psycopg errors propagate (the caller wraps them), here or from a later
    :func:`stage` or :func:`apply_stage` that COPYs these rows."""
    if target.held and not target.held[0].schema.equals(rows.batch.schema):
        await copy_held(conn, target)
    target.held.append(rows.batch)
    # A running count: summing the held batches on every call made a backlog of small transactions
    # (one batch each) quadratic.
    target.held_rows += rows.batch.num_rows
    target.rows += rows.batch.num_rows
    target.unchanged |= rows.unchanged
    target.truncated |= rows.truncated
    if target.held_rows >= COPY_ROWS:
        await copy_held(conn, target)
    return int(rows.batch.num_rows)


async def copy_held(conn: "psycopg.AsyncConnection[Any]", target: ChangeStage) -> None:
    """COPY the held rows into the stage. With ``name_refused``, bisecting under savepoints when the
    server refuses values (a NUL in a text column): raises :class:`DataError` naming the first
    refused row, whose ``details`` hold its ``position`` and ``ordinal``; without, psycopg's error
    propagates (the bounded sink bisects its pages itself)."""
    held, target.held, target.held_rows = target.held, [], 0
    if not held:
        return
    batch = pa.concat_batches(held)
    if not target.name_refused:
        await copy_batch(conn, target.identifier, batch, target.columns)
        return

    async def write(start: int, stop: int) -> int:
        return await copy_batch(conn, target.identifier, batch.slice(start, stop - start), target.columns)

    _, refused = await apply_finding_refusals(conn, batch.num_rows, write)
    if refused:
        first = refused[0].index
        more = f" ({len(refused) - 1} more change(s) refused)" if len(refused) > 1 else ""
        raise DataError(
            f"the destination refused the change: {refused[0].reason}{more}",
            where=str(target.identifier),
            details={
                "position": str(batch.column(STAGE_POSITION)[first].as_py()),
                "ordinal": str(batch.column(STAGE_ORDINAL)[first].as_py()),
            },
        )


def column_list(columns: Sequence[str], alias: str | None = None) -> sql.Composable:
    """``columns`` as a comma-separated list of identifiers, qualified by ``alias`` if given."""
    if alias is None:
        return sql.SQL(", ").join(map(sql.Identifier, columns))
    return sql.SQL(", ").join(sql.Identifier(alias, column) for column in columns)


__all__ = [
    "APPLIED_OPERATIONS",
    "KEY_METADATA",
    "OPERATIONS",
    "STAGE_ORDINAL",
    "STAGE_POSITION",
    "ChangeLayout",
    "ChangeStage",
    "StagedRows",
    "change_layout",
    "column_list",
    "copy_held",
    "create_stage",
    "data_schema",
    "stage",
    "staged_rows",
]
