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
   :data:`COPY_ROWS` (binary where the types allow, see :func:`faucet_postgres.common.copy_batch`):
   a source transaction is often a few rows, and a COPY per transaction would cost a round trip each.
   Nothing touches the destination yet.
3. :func:`apply_stage` keeps, per key, the last change in ``(position, ordinal)`` order
   (``DISTINCT ON``), fills an unchanged column from the latest earlier change of the same key that
   carried it, then deletes, updates and inserts in one statement. A key's net result is its last
   change: a delete removes the row, an insert or an update leaves the row as the change carries it
   (columns still unchanged keep the destination's value). Applying is lenient so a replay or a
   snapshot overlap converges: an insert of a present key updates it, an update of an absent key
   inserts it, a delete of an absent key does nothing. Such surprises are counted
   (:class:`ChangeCounts`): a consistent replica started from nothing (or from a snapshot) has none,
   and the streaming sink refuses an epoch that has any (the bounded sink, whose at-least-once reruns
   rely on converging, does not).

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
    IntegrityError,
    Operation,
    SchemaError,
)
from faucet_postgres.common import PgColumn, copy_batch
from faucet_postgres.multiset import multiset_statement
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

_POSITION = "__faucet_position"
_ORDINAL = "__faucet_ordinal"
_FIRST = "__faucet_first_op"
_PRESENT = "__faucet_present"
_BIGINT = PgColumn("", "int8", "bigint", -1, False)

SURPRISE_CHARS = 200
"""The longest key text an error about a diverged replica quotes."""

COPY_ROWS = 32_768
"""Staged rows are held in memory until this many can be COPYed at once (or the stage is applied)."""


@dataclass(frozen=True)
class ChangeLayout:
    """The shape of one table's change rows: its data columns (batch order) and its key."""

    columns: tuple[str, ...]
    key: tuple[str, ...]

    @property
    def multiset(self) -> bool:
        """True when every column is in the key: the rows are a multiset (see the module docstring)."""
        return set(self.key) == set(self.columns)

    @property
    def created_key(self) -> tuple[str, ...]:
        """The primary key of a table created for these rows: none for a multiset."""
        return () if self.multiset else self.key

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
    return ChangeLayout(columns, chosen)


def data_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` without the operation and unchanged columns: the destination table's columns."""
    return pa.schema([item for item in schema if item.name not in (OPERATION_COLUMN, UNCHANGED_COLUMN)])


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
        names=[*layout.columns, OPERATION_COLUMN, UNCHANGED_COLUMN, _POSITION, _ORDINAL],
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
            identifier, _names(layout.columns), target
        )
    )
    await conn.execute(
        sql.SQL(
            "ALTER TABLE {} ADD COLUMN {} text, ADD COLUMN {} jsonb, ADD COLUMN {} bigint, "
            "ADD COLUMN {} bigint"
        ).format(identifier, *map(sql.Identifier, (OPERATION_COLUMN, UNCHANGED_COLUMN, _POSITION, _ORDINAL)))
    )
    columns = {column: target_columns[column] for column in layout.columns}
    columns[OPERATION_COLUMN] = PgColumn(OPERATION_COLUMN, "text", "text", -1, False)
    columns[UNCHANGED_COLUMN] = PgColumn(UNCHANGED_COLUMN, "jsonb", "jsonb", -1, False)
    columns[_POSITION] = columns[_ORDINAL] = _BIGINT
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
                "position": str(batch.column(_POSITION)[first].as_py()),
                "ordinal": str(batch.column(_ORDINAL)[first].as_py()),
            },
        )


@dataclass(frozen=True)
class RefusedChange:
    """A key whose net change the destination refuses alone: its last change's position and
    ordinal, the key as row text (at most :data:`SURPRISE_CHARS`), and the server's reason."""

    position: int
    ordinal: int
    key: str
    reason: str


async def refused_change(
    conn: "psycopg.AsyncConnection[Any]", target: sql.Composable, staged: ChangeStage, where: str
) -> RefusedChange | None:
    """After :func:`apply_stage` failed for a row-level reason (rolled back to its savepoint, the
    stage COPYed and intact): the first key, in key order, whose changes ``target`` refuses when
    applied alone, by bisection over the stage's keys under savepoints. ``None`` when no key alone
    is refused (the refusal needs several keys together) or the stage holds a truncate."""
    if staged.truncated or staged.rows == 0:
        return None
    layout = staged.layout
    ranks = sql.Identifier(f"_faucet_keys_{uuid.uuid4().hex[:12]}")
    rank = sql.Identifier("__faucet_rank")
    await conn.execute(
        sql.SQL(
            "CREATE TEMP TABLE {ranks} ON COMMIT DROP AS SELECT {keys}, row_number() OVER (ORDER BY {keys}) "
            "AS {rank} FROM (SELECT DISTINCT {keys} FROM {stage}) AS k"
        ).format(ranks=ranks, keys=_names(layout.key), rank=rank, stage=staged.identifier)
    )
    row = await (await conn.execute(sql.SQL("SELECT count(*) FROM {}").format(ranks))).fetchone()
    count = 0 if row is None else int(row[0])
    same = sql.SQL(" AND ").join(
        sql.SQL("s.{0} IS NOT DISTINCT FROM k.{0}").format(sql.Identifier(column)) for column in layout.key
    )

    async def attempt(start: int, stop: int) -> int:
        part = sql.Identifier(f"_faucet_part_{uuid.uuid4().hex[:12]}")
        cursor = await conn.execute(
            sql.SQL(
                "CREATE TEMP TABLE {part} ON COMMIT DROP AS SELECT s.* FROM {stage} AS s JOIN {ranks} AS k "
                "ON {same} WHERE k.{rank} > %s AND k.{rank} <= %s"
            ).format(part=part, stage=staged.identifier, ranks=ranks, same=same, rank=rank),
            (start, stop),
        )
        subset = ChangeStage(part, layout, staged.columns, set(staged.unchanged), max(cursor.rowcount, 0))
        await apply_stage(conn, target, subset, where)
        return stop - start

    _, refused = await apply_finding_refusals(conn, count, attempt)
    if not refused:
        return None
    found = await (
        await conn.execute(
            sql.SQL(
                "SELECT s.{position}, s.{ordinal}, ROW({keys})::text FROM {stage} AS s JOIN {ranks} AS k "
                "ON {same} WHERE k.{rank} = %s ORDER BY s.{position} DESC, s.{ordinal} DESC LIMIT 1"
            ).format(
                position=sql.Identifier(_POSITION),
                ordinal=sql.Identifier(_ORDINAL),
                keys=_names(layout.key, "s"),
                stage=staged.identifier,
                ranks=ranks,
                same=same,
                rank=rank,
            ),
            (refused[0].index + 1,),
        )
    ).fetchone()
    if found is None:
        return None
    return RefusedChange(int(found[0]), int(found[1]), str(found[2])[:SURPRISE_CHARS], refused[0].reason)


@dataclass(frozen=True)
class ChangeCounts:
    """What applying a stage did to its table, counted per key (each key's net change).

    ``unexpected_inserts``: keys whose first change was an insert but which were present (a replay
    or an overlap); ``unexpected_changes``: keys whose first change was an update or a delete but
    which were absent (a gap, or a replica not seeded; a multiset: deletes that found no row). Both
    are 0 for a consistent replica. ``truncated``: rows a truncate removed (not counted in
    ``deleted``). ``surprise``: one unexpected key as row text, at most :data:`SURPRISE_CHARS`
    characters (never for a multiset, whose key is the whole row).
    """

    inserted: int
    updated: int
    deleted: int
    unexpected_inserts: int
    unexpected_changes: int
    truncated: int = 0
    surprise: str | None = None

    def details(self) -> dict[str, str]:
        return {
            "rows_inserted": str(self.inserted),
            "rows_updated": str(self.updated),
            "rows_deleted": str(self.deleted),
            "rows_truncated": str(self.truncated),
            "unexpected_inserts": str(self.unexpected_inserts),
            "unexpected_changes": str(self.unexpected_changes),
        }

    def __add__(self, other: "ChangeCounts") -> "ChangeCounts":
        return ChangeCounts(
            self.inserted + other.inserted,
            self.updated + other.updated,
            self.deleted + other.deleted,
            self.unexpected_inserts + other.unexpected_inserts,
            self.unexpected_changes + other.unexpected_changes,
            self.truncated + other.truncated,
            self.surprise or other.surprise,
        )


NO_CHANGES = ChangeCounts(0, 0, 0, 0, 0)


async def apply_stage(
    conn: "psycopg.AsyncConnection[Any]", target: sql.Composable, staged: ChangeStage, where: str
) -> ChangeCounts:
    """Apply the stage's changes to ``target`` in its transaction; see the module docstring.

    Raises :class:`IntegrityError` when an update of a key absent from ``target`` left a column
    unchanged (its value is known nowhere); the caller rolls the transaction back. psycopg errors
    propagate.
    """
    if staged.rows == 0:
        return NO_CHANGES
    await copy_held(conn, staged)
    truncated = await _truncate(conn, target, staged) if staged.truncated else 0
    if staged.layout.multiset:
        if staged.unchanged:
            raise DataError("a change row of a table without a key left a column out", where=where)
        statement = multiset_statement(target, staged.identifier, staged.layout.columns, _POSITION, _ORDINAL)
        cursor = await conn.execute(statement)
        counted = await cursor.fetchone()
        assert counted is not None  # the statement returns one row
        return ChangeCounts(int(counted[0]), 0, int(counted[1]), 0, int(counted[2]), truncated)
    if staged.unchanged:
        await _carry_key_changes(conn, target, staged)
    last: sql.Composable = _last_changes(staged)
    filled: sql.Identifier | None = None
    if staged.unchanged:
        filled = sql.Identifier(f"_faucet_last_{uuid.uuid4().hex[:12]}")
        await conn.execute(sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS {}").format(filled, last))
        for column in sorted(staged.unchanged):
            await conn.execute(_fill(filled, staged, column))
        last = sql.SQL("SELECT * FROM {}").format(filled)
    cursor = await conn.execute(_apply(target, staged, last))
    row = await cursor.fetchone()
    if filled is not None:
        await conn.execute(sql.SQL("DROP TABLE {}").format(filled))
    assert row is not None  # an aggregate returns one row
    inserted, updated, deleted, unexpected_inserts, unexpected_changes, unknown = (int(n) for n in row[:6])
    if unknown:
        raise IntegrityError(
            f"{unknown} update(s) of key(s) absent from the destination left column(s) "
            f"{', '.join(sorted(staged.unchanged))} out: their values are known nowhere (seed the replica "
            "with a snapshot, or set REPLICA IDENTITY FULL on the source table)",
            where=where,
        )
    surprise = None if row[6] is None else str(row[6])[:SURPRISE_CHARS]
    return ChangeCounts(
        inserted, updated, deleted, unexpected_inserts, unexpected_changes, truncated, surprise
    )


async def _truncate(conn: "psycopg.AsyncConnection[Any]", target: sql.Composable, staged: ChangeStage) -> int:
    """Apply the stage's last truncate: every destination row deleted (in the epoch's transaction),
    and every staged change up to it dropped (the truncate removed what they made). Returns how many
    rows were deleted."""
    position, ordinal = sql.Identifier(_POSITION), sql.Identifier(_ORDINAL)
    await conn.execute(
        sql.SQL(
            "DELETE FROM {stage} WHERE ({position}, {ordinal}) <= (SELECT {position}, {ordinal} FROM "
            "{stage} WHERE {op} = {truncate} ORDER BY {position} DESC, {ordinal} DESC LIMIT 1)"
        ).format(
            stage=staged.identifier,
            position=position,
            ordinal=ordinal,
            op=sql.Identifier(OPERATION_COLUMN),
            truncate=sql.Literal(Operation.TRUNCATE.value),
        )
    )
    cursor = await conn.execute(sql.SQL("DELETE FROM {}").format(target))
    return max(cursor.rowcount, 0)


async def _carry_key_changes(
    conn: "psycopg.AsyncConnection[Any]", target: sql.Composable, staged: ChangeStage
) -> None:
    """Fill the columns a key change's insert left out with the old key's values.

    Such an insert follows the delete of the old key (same position, previous ordinal). The old row's
    value of a column is the latest earlier staged change of the old key that carried it, else the
    destination's row. One statement per column and pass; a pass resolves every insert whose source
    is resolved (a chain of key changes in one epoch takes one pass per link). What stays unresolved
    (the old key is nowhere) is refused by :func:`apply_stage`.
    """
    for column in sorted(staged.unchanged):
        while True:
            cursor = await conn.execute(_carry(target, staged, column))
            if cursor.rowcount <= 0:
                break


def _names(columns: Sequence[str], alias: str | None = None) -> sql.Composable:
    if alias is None:
        return sql.SQL(", ").join(map(sql.Identifier, columns))
    return sql.SQL(", ").join(sql.Identifier(alias, column) for column in columns)


def _match(layout: ChangeLayout, left: str, right: str) -> sql.Composable:
    return sql.SQL(" AND ").join(
        sql.SQL("{} = {}").format(sql.Identifier(left, column), sql.Identifier(right, column))
        for column in layout.key
    )


def _newest_first(layout: ChangeLayout) -> sql.Composable:
    """Per key, the latest change first: commit position, then order within the transaction."""
    return sql.SQL("{}, s.{} DESC, s.{} DESC").format(
        _names(layout.key, "s"), sql.Identifier(_POSITION), sql.Identifier(_ORDINAL)
    )


def _last_changes(staged: ChangeStage) -> sql.Composable:
    """Each key's last change, with the operation of its first change in this stage (one sort)."""
    layout = staged.layout
    return sql.SQL(
        "SELECT DISTINCT ON ({keys}) s.*, last_value(s.{op}) OVER (PARTITION BY {keys} "
        "ORDER BY s.{position} DESC, s.{ordinal} DESC ROWS BETWEEN UNBOUNDED PRECEDING AND "
        "UNBOUNDED FOLLOWING) AS {first} FROM {stage} AS s ORDER BY {order}"
    ).format(
        keys=_names(layout.key, "s"),
        op=sql.Identifier(OPERATION_COLUMN),
        position=sql.Identifier(_POSITION),
        ordinal=sql.Identifier(_ORDINAL),
        first=sql.Identifier(_FIRST),
        stage=staged.identifier,
        order=_newest_first(layout),
    )


def _fill(filled: sql.Identifier, staged: ChangeStage, column: str) -> sql.Composed:
    """Fill ``column`` where a key's last change left it out, from the latest earlier change that
    carried it (an insert always does, so nothing before the key's last delete is ever used)."""
    layout = staged.layout
    name = sql.Literal(column)
    unchanged = sql.Identifier(UNCHANGED_COLUMN)
    return sql.SQL(
        "UPDATE {filled} AS l SET {column} = f.{column}, {unchanged} = l.{unchanged} - {name} FROM "
        "(SELECT DISTINCT ON ({keys}) {keys}, s.{column} FROM {stage} AS s WHERE s.{op} <> {delete} "
        "AND NOT coalesce(s.{unchanged} ? {name}, false) ORDER BY {order}) AS f "
        "WHERE l.{unchanged} ? {name} AND {match}"
    ).format(
        filled=filled,
        column=sql.Identifier(column),
        unchanged=unchanged,
        name=name,
        keys=_names(layout.key, "s"),
        stage=staged.identifier,
        op=sql.Identifier(OPERATION_COLUMN),
        delete=sql.Literal(Operation.DELETE.value),
        order=_newest_first(layout),
        match=_match(layout, "l", "f"),
    )


def _carry(target: sql.Composable, staged: ChangeStage, column: str) -> sql.Composed:
    """One pass of :func:`_carry_key_changes` for ``column``."""
    layout = staged.layout
    name = sql.Literal(column)
    old = [(sql.Identifier(key), sql.Identifier(f"__old_{key}")) for key in layout.key]
    old_key = sql.SQL(", ").join(sql.SQL("d.{} AS {}").format(key, alias) for key, alias in old)

    def matching(table: str) -> sql.Composable:
        return sql.SQL(" AND ").join(
            sql.SQL("{}.{} = m.{}").format(sql.Identifier(table), key, alias) for key, alias in old
        )

    same_old, in_target = matching("e"), matching("t")
    first_key = sql.Identifier(layout.key[0])
    return sql.SQL(
        "WITH moved AS (SELECT m.{position}, m.{ordinal}, {old_key} FROM {stage} AS m JOIN {stage} AS d "
        "ON d.{position} = m.{position} AND d.{ordinal} = m.{ordinal} - 1 AND d.{op} = {delete} "
        "WHERE m.{op} = {insert} AND coalesce(m.{unchanged} ? {name}, false)), "
        "found AS (SELECT m.{position}, m.{ordinal}, src.{column} AS value, src.pending, "
        "src.{position} IS NOT NULL AS staged, t.{first_key} IS NOT NULL AS kept, t.{column} AS kept_value "
        "FROM moved AS m LEFT JOIN LATERAL (SELECT e.{position}, e.{column}, "
        "coalesce(e.{unchanged} ? {name}, false) AS pending FROM {stage} AS e WHERE {same_old} "
        "AND e.{op} <> {delete} AND (e.{position}, e.{ordinal}) < (m.{position}, m.{ordinal}) "
        "AND NOT (e.{op} <> {insert} AND coalesce(e.{unchanged} ? {name}, false)) "
        "ORDER BY e.{position} DESC, e.{ordinal} DESC LIMIT 1) AS src ON true "
        "LEFT JOIN {target} AS t ON {in_target}) "
        "UPDATE {stage} AS s SET {column} = CASE WHEN f.staged THEN f.value ELSE f.kept_value END, "
        "{unchanged} = s.{unchanged} - {name} FROM found AS f "
        "WHERE s.{position} = f.{position} AND s.{ordinal} = f.{ordinal} "
        "AND ((f.staged AND NOT f.pending) OR (NOT f.staged AND f.kept))"
    ).format(
        position=sql.Identifier(_POSITION),
        ordinal=sql.Identifier(_ORDINAL),
        old_key=old_key,
        stage=staged.identifier,
        op=sql.Identifier(OPERATION_COLUMN),
        delete=sql.Literal(Operation.DELETE.value),
        insert=sql.Literal(Operation.INSERT.value),
        unchanged=sql.Identifier(UNCHANGED_COLUMN),
        name=name,
        column=sql.Identifier(column),
        same_old=same_old,
        first_key=first_key,
        target=target,
        in_target=in_target,
    )


def _apply(target: sql.Composable, staged: ChangeStage, last: sql.Composable) -> sql.Composed:
    """One statement: judge each key's presence once, then delete, update and insert; count them."""
    layout = staged.layout
    op, present, first = (sql.Identifier(name) for name in (OPERATION_COLUMN, _PRESENT, _FIRST))
    unchanged = sql.Identifier(UNCHANGED_COLUMN)
    delete, insert = sql.Literal(Operation.DELETE.value), sql.Literal(Operation.INSERT.value)
    statements = [
        sql.SQL(
            "judged AS MATERIALIZED (SELECT l.*, EXISTS (SELECT 1 FROM {target} AS t WHERE {match}) "
            "AS {present} FROM ({last}) AS l)"
        ).format(target=target, match=_match(layout, "t", "l"), present=present, last=last),
        sql.SQL(
            "deleted AS (DELETE FROM {target} AS t USING judged AS l WHERE l.{op} = {delete} "
            "AND l.{present} AND {match})"
        ).format(target=target, op=op, delete=delete, present=present, match=_match(layout, "t", "l")),
    ]
    if layout.others:
        sets = sql.SQL(", ").join(
            sql.SQL("{0} = CASE WHEN l.{1} ? {2} THEN t.{0} ELSE l.{0} END").format(
                sql.Identifier(column), unchanged, sql.Literal(column)
            )
            if column in staged.unchanged
            else sql.SQL("{0} = l.{0}").format(sql.Identifier(column))
            for column in layout.others
        )
        statements.append(
            sql.SQL(
                "updated AS (UPDATE {target} AS t SET {sets} FROM judged AS l WHERE l.{op} <> {delete} "
                "AND l.{present} AND {match})"
            ).format(
                target=target,
                sets=sets,
                op=op,
                delete=delete,
                present=present,
                match=_match(layout, "t", "l"),
            )
        )
    statements.append(
        sql.SQL(
            "inserted AS (INSERT INTO {target} ({columns}) SELECT {values} FROM judged AS l "
            "WHERE l.{op} <> {delete} AND NOT l.{present})"
        ).format(
            target=target,
            columns=_names(layout.columns),
            values=_names(layout.columns, "l"),
            op=op,
            delete=delete,
            present=present,
        )
    )
    counts = sql.SQL(
        "SELECT count(*) FILTER (WHERE {op} <> {delete} AND NOT {present}), "
        "count(*) FILTER (WHERE {op} <> {delete} AND {present}), "
        "count(*) FILTER (WHERE {op} = {delete} AND {present}), "
        "count(*) FILTER (WHERE {first} = {insert} AND {present}), "
        "count(*) FILTER (WHERE {first} <> {insert} AND NOT {present}), "
        "count(*) FILTER (WHERE {op} <> {delete} AND NOT {present} AND {unchanged} IS NOT NULL "
        "AND {unchanged} <> '[]'::jsonb), "
        "min(ROW({keys})::text) FILTER (WHERE ({first} = {insert}) = {present}) FROM judged"
    ).format(
        op=op,
        delete=delete,
        present=present,
        first=first,
        insert=insert,
        unchanged=unchanged,
        keys=_names(layout.key),
    )
    return sql.SQL("WITH {} {}").format(sql.SQL(", ").join(statements), counts)


__all__ = [
    "APPLIED_OPERATIONS",
    "KEY_METADATA",
    "NO_CHANGES",
    "OPERATIONS",
    "ChangeCounts",
    "ChangeLayout",
    "ChangeStage",
    "RefusedChange",
    "StagedRows",
    "apply_stage",
    "change_layout",
    "copy_held",
    "create_stage",
    "data_schema",
    "refused_change",
    "stage",
    "staged_rows",
]
