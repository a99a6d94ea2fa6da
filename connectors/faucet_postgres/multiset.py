"""Change rows of a table without a key, applied as a multiset (the APPLY_CHANGES policy).

A table without a primary key (the PostgreSQL change source reads it under ``REPLICA IDENTITY FULL``
and marks every column ``faucet.key``) may hold identical rows, and each of them counts: a source
``(1,a),(2,b),(2,b)`` must stay three rows in the replica. Such change rows are keyed by the whole
row, so applying them by key would collapse the duplicates. Here a row's value (every column, nulls
equal) is its identity, and each value has a count:

* an ``insert`` adds one row of its value, a ``delete`` removes exactly one (an ``update`` that keeps
  every column changes nothing; one that changes a column arrives as a delete and an insert);
* in ``(position, ordinal)`` order a value's count never goes below zero: a delete of a value the
  replica does not hold (at that point) removes nothing and is counted in ``unexpected_changes``;
* a value's net result is computed once per epoch and applied: the surplus rows are deleted by
  ``ctid`` (any of the identical rows, they cannot be told apart), then the missing ones inserted.

Values are compared by their row text (``ROW(...)::text``), which is equal exactly when every column is
``IS NOT DISTINCT FROM`` equal for the columns' types (the stage has the destination's types), and
can be hashed: applying costs one scan of the destination per epoch, with no index needed. The
destination must not be a partitioned table (a ``ctid`` names a row of one partition only).
"""

from collections.abc import Sequence

from psycopg import sql

from faucet_dagster.protocol import OPERATION_COLUMN, Operation

_INTERNAL = ("v", "d", "run", "delta", "low", "held", "missed", "rank")
"""The statement's own columns, named ``__faucet_<name>`` so they never meet a table's column."""


def _value(columns: Sequence[str], alias: str) -> sql.Composable:
    """The row text of ``columns`` of ``alias``: the identity of a row of a multiset."""
    return sql.SQL("ROW({})::text").format(
        sql.SQL(", ").join(sql.Identifier(alias, name) for name in columns)
    )


def multiset_statements(
    target: sql.Composable,
    stage: sql.Composable,
    judged: sql.Identifier,
    columns: Sequence[str],
    position: str,
    ordinal: str,
    key: Sequence[str] = (),
) -> tuple[sql.Composed, sql.Composed, sql.Composed, sql.Composed]:
    """The statements applying ``stage`` (change rows with ``position`` and ``ordinal``) to ``target``
    as a multiset, to run in this order: judge each value's net change into the temporary table
    ``judged``; delete the surplus rows; insert the missing ones (deletes first: a value that takes
    another's key, ``UPDATE t SET id = id + 1``, lands once the row holding it is gone); the one row
    of the last: deletes that found no row (a row's values are never returned: without a key, they
    are the whole row). With ``key`` (columns an index of ``target`` covers) only the destination
    rows of the stage's keys are looked at."""
    names = sql.SQL(", ").join(map(sql.Identifier, columns))
    op = sql.Identifier(OPERATION_COLUMN)
    step = sql.SQL("CASE s.{op} WHEN {insert} THEN 1 WHEN {delete} THEN -1 ELSE 0 END").format(
        op=op, insert=sql.Literal(Operation.INSERT.value), delete=sql.Literal(Operation.DELETE.value)
    )
    narrow = (
        sql.SQL("({}) IN (SELECT {} FROM {}) AND ").format(
            sql.SQL(", ").join(sql.Identifier("t", name) for name in key),
            sql.SQL(", ").join(map(sql.Identifier, key)),
            stage,
        )
        if key
        else sql.SQL("")
    )
    parts = {
        "stage_value": _value(columns, "s"),
        "stage_names": sql.SQL(", ").join(sql.Identifier("s", name) for name in columns),
        "step": step,
        "position": sql.Identifier(position),
        "ordinal": sql.Identifier(ordinal),
        "stage": stage,
        "names": names,
        "target_value": _value(columns, "t"),
        "target": target,
        "judged": judged,
        "judged_names": sql.SQL(", ").join(sql.Identifier("j", name) for name in columns),
        "narrow": narrow,
        **{name: sql.Identifier(f"__faucet_{name}") for name in _INTERNAL},
    }
    judge = sql.SQL(
        "CREATE TEMP TABLE {judged} ON COMMIT DROP AS "
        "WITH running AS (SELECT {stage_value} AS {v}, {stage_names}, {step} AS {d}, "
        "sum({step}) OVER (PARTITION BY {stage_value} ORDER BY s.{position}, s.{ordinal} "
        "ROWS UNBOUNDED PRECEDING) AS {run} FROM {stage} AS s), "
        "net AS (SELECT DISTINCT ON ({v}) {v}, {names}, sum({d}) OVER w AS {delta}, "
        "least(0, min({run}) OVER w) AS {low} FROM running WINDOW w AS (PARTITION BY {v})), "
        "held AS (SELECT {target_value} AS {v}, count(*) AS {held} FROM {target} AS t "
        "WHERE {narrow}{target_value} IN (SELECT {v} FROM net) GROUP BY 1) "
        # A delete that would take the count below zero found no row: it removes nothing, so the
        # value's net change is its delta plus those deletes.
        "SELECT net.*, greatest(0, -(coalesce(held.{held}, 0) + net.{low})) AS {missed} "
        "FROM net LEFT JOIN held USING ({v})"
    ).format(**parts)
    delete = sql.SQL(
        "DELETE FROM {target} AS t WHERE t.ctid = ANY (ARRAY(SELECT x.ctid FROM (SELECT t.ctid, "
        "{target_value} AS {v}, row_number() OVER (PARTITION BY {target_value}) AS {rank} FROM {target} AS t "
        "WHERE {narrow}{target_value} IN (SELECT {v} FROM {judged} WHERE {delta} + {missed} < 0)) AS x "
        "JOIN {judged} AS j USING ({v}) WHERE x.{rank} <= -(j.{delta} + j.{missed})))"
    ).format(**parts)
    insert = sql.SQL(
        "INSERT INTO {target} ({names}) SELECT {judged_names} FROM {judged} AS j "
        "CROSS JOIN LATERAL generate_series(1, j.{delta} + j.{missed}) WHERE j.{delta} + j.{missed} > 0"
    ).format(**parts)
    missed = sql.SQL("SELECT coalesce(sum({missed}), 0) FROM {judged}").format(**parts)
    return judge, delete, insert, missed


__all__ = ["multiset_statements"]
