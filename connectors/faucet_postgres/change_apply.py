"""APPLY_CHANGES, step 3: a stage of change rows (:mod:`faucet_postgres.changes`) applied to its
destination table by key, in commit order, with set-based SQL, in the stage's transaction.

:func:`apply_stage` keeps, per key, the last change in ``(position, ordinal)`` order
(``DISTINCT ON``), fills an unchanged column from the latest earlier change of the same key that
carried it, then deletes, updates and inserts in one statement. A key's net result is its last
change: a delete removes the row, an insert or an update leaves the row as the change carries it
(columns still unchanged keep the destination's value). Applying is lenient so a replay or a
snapshot overlap converges: an insert of a present key updates it, an update of an absent key
inserts it, a delete of an absent key does nothing. Such surprises are counted
(:class:`ChangeCounts`): a consistent replica started from nothing (or from a snapshot) has none,
and the streaming sink refuses an epoch that has any (the bounded sink, whose at-least-once reruns
rely on converging, does not).

When the destination refuses the applied stage for a row-level reason, :func:`refused_change` finds
the first key whose changes it refuses alone, by bisection over the stage's keys under savepoints.
"""

import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from faucet_dagster.protocol import OPERATION_COLUMN, UNCHANGED_COLUMN, DataError, IntegrityError, Operation
from faucet_postgres.changes import (
    STAGE_ORDINAL,
    STAGE_POSITION,
    ChangeLayout,
    ChangeStage,
    column_list,
    copy_held,
)
from faucet_postgres.multiset import multiset_statements
from faucet_postgres.refusals import apply_finding_refusals

_FIRST = "__faucet_first_op"
_PRESENT = "__faucet_present"

SURPRISE_CHARS = 200
"""The longest key text an error about a diverged replica quotes."""


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
        ).format(ranks=ranks, keys=column_list(layout.key), rank=rank, stage=staged.identifier)
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
                position=sql.Identifier(STAGE_POSITION),
                ordinal=sql.Identifier(STAGE_ORDINAL),
                keys=column_list(layout.key, "s"),
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
        layout = staged.layout
        narrowing = layout.key if set(layout.key) != set(layout.columns) else ()
        judged = sql.Identifier(f"_faucet_judged_{uuid.uuid4().hex[:12]}")
        judge, delete, insert, missed = multiset_statements(
            target, staged.identifier, judged, layout.columns, STAGE_POSITION, STAGE_ORDINAL, narrowing
        )
        await conn.execute(judge)
        deleted = max((await conn.execute(delete)).rowcount, 0)
        inserted = max((await conn.execute(insert)).rowcount, 0)
        counted = await (await conn.execute(missed)).fetchone()
        assert counted is not None  # an aggregate returns one row
        await conn.execute(sql.SQL("DROP TABLE {}").format(judged))
        return ChangeCounts(inserted, 0, deleted, 0, int(counted[0]), truncated)
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
    position, ordinal = sql.Identifier(STAGE_POSITION), sql.Identifier(STAGE_ORDINAL)
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


def _match(layout: ChangeLayout, left: str, right: str) -> sql.Composable:
    return sql.SQL(" AND ").join(
        sql.SQL("{} = {}").format(sql.Identifier(left, column), sql.Identifier(right, column))
        for column in layout.key
    )


def _newest_first(layout: ChangeLayout) -> sql.Composable:
    """Per key, the latest change first: commit position, then order within the transaction."""
    return sql.SQL("{}, s.{} DESC, s.{} DESC").format(
        column_list(layout.key, "s"), sql.Identifier(STAGE_POSITION), sql.Identifier(STAGE_ORDINAL)
    )


def _last_changes(staged: ChangeStage) -> sql.Composable:
    """Each key's last change, with the operation of its first change in this stage (one sort)."""
    layout = staged.layout
    return sql.SQL(
        "SELECT DISTINCT ON ({keys}) s.*, last_value(s.{op}) OVER (PARTITION BY {keys} "
        "ORDER BY s.{position} DESC, s.{ordinal} DESC ROWS BETWEEN UNBOUNDED PRECEDING AND "
        "UNBOUNDED FOLLOWING) AS {first} FROM {stage} AS s ORDER BY {order}"
    ).format(
        keys=column_list(layout.key, "s"),
        op=sql.Identifier(OPERATION_COLUMN),
        position=sql.Identifier(STAGE_POSITION),
        ordinal=sql.Identifier(STAGE_ORDINAL),
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
        keys=column_list(layout.key, "s"),
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
        position=sql.Identifier(STAGE_POSITION),
        ordinal=sql.Identifier(STAGE_ORDINAL),
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
            columns=column_list(layout.columns),
            values=column_list(layout.columns, "l"),
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
        keys=column_list(layout.key),
    )
    return sql.SQL("WITH {} {}").format(sql.SQL(", ").join(statements), counts)


__all__ = [
    "NO_CHANGES",
    "SURPRISE_CHARS",
    "ChangeCounts",
    "RefusedChange",
    "apply_stage",
    "refused_change",
]
