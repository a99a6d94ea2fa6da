"""The reference model of a destination: what each write policy must leave in a resource.

A :class:`Change` is one source event as a sink receives it (an operation, a key, a row); a
:class:`TableModel` applies changes as a policy promises to (APPEND keeps every row, UPSERT the last
row per key, VERSIONED_UPSERT the row of the highest version per key, APPLY_CHANGES inserts, updates,
deletes and truncates by key, REPLACE the rows of the last complete run). :func:`difference` puts
the gap between what a destination holds and what the model holds in words, by key.
"""

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from faucet_dagster.protocol import Operation, WritePolicy

KEY = "id"
"""The key column of the battery's rows."""
VERSION = "version"
"""The version column VERSIONED_UPSERT compares (a sink's setup configures it under this name)."""
MISSING = "<missing column>"

FrozenRow = tuple[tuple[str, Any], ...]


def freeze(row: Mapping[str, Any], columns: Sequence[str]) -> FrozenRow:
    """``row`` projected on ``columns``; a column the row lacks, or holds null in, is :data:`MISSING`
    (a message without the key, a table row with NULL: the same absence of a value)."""
    return tuple((column, MISSING if row.get(column) is None else row[column]) for column in columns)


@dataclass(frozen=True)
class Change:
    """One event for a resource: ``operation`` on the row whose key is ``row["id"]``."""

    operation: Operation
    row: Mapping[str, Any]

    @property
    def key(self) -> int:
        return int(self.row[KEY])


class TableModel:
    """What ``policy`` leaves in one resource after the changes applied so far, in order."""

    def __init__(self, policy: WritePolicy) -> None:
        self.policy = policy
        self.appended: list[Mapping[str, Any]] = []
        self.keyed: dict[int, Mapping[str, Any]] = {}

    def copy(self) -> "TableModel":
        twin = TableModel(self.policy)
        twin.appended = list(self.appended)
        twin.keyed = dict(self.keyed)
        return twin

    def apply(self, change: Change) -> None:
        if self.policy in (WritePolicy.APPEND, WritePolicy.REPLACE):
            self.appended.append(change.row)
            return
        if change.operation is Operation.TRUNCATE:
            self.keyed.clear()
        elif change.operation is Operation.DELETE:
            self.keyed.pop(change.key, None)
        elif self.policy is WritePolicy.VERSIONED_UPSERT:
            held = self.keyed.get(change.key)
            if held is None or int(change.row[VERSION]) > int(held[VERSION]):
                self.keyed[change.key] = change.row
        else:
            self.keyed[change.key] = change.row

    def rows(self) -> list[Mapping[str, Any]]:
        return list(self.appended) if not self.policy.keyed else list(self.keyed.values())

    def keys(self) -> list[int]:
        return sorted(self.keyed)


def difference(
    resource: str,
    held: Iterable[Mapping[str, Any]],
    must: Iterable[Mapping[str, Any]],
    columns: Sequence[str],
    *,
    may: Iterable[Mapping[str, Any]] = (),
    duplicates_allowed: bool = False,
) -> str | None:
    """None when the destination's rows ``held`` are what the model allows; else the gap in words.

    The destination must hold every row of ``must``; it may also hold rows of ``may`` (effects a
    destination accepted before a commit, which no abort undoes), each at most as often as the two
    together hold it; with ``duplicates_allowed`` (an at-least-once replay) any row may repeat.
    """
    have = Counter(freeze(row, columns) for row in held)
    need = Counter(freeze(row, columns) for row in must)
    allowed = need + Counter(freeze(row, columns) for row in may)
    problems: list[str] = []
    for row, count in sorted(need.items(), key=_by_key):
        if have[row] < count:
            problems.append(_lacks(resource, row, have, columns))
    for row, count in sorted(have.items(), key=_by_key):
        limit = allowed[row]
        if count > limit and not (duplicates_allowed and limit):
            problems.append(_extra(resource, row, count, limit, need, columns))
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more differences)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def absent_columns(
    resource: str,
    held: Iterable[Mapping[str, Any]],
    must: Iterable[Mapping[str, Any]],
    columns: Sequence[str],
) -> str | None:
    """A column the model holds values in that no row of the destination has (renamed, folded,
    truncated or dropped), in words; None when every such column is there."""
    rows = list(held)
    if not rows:
        return None
    present = {name for row in rows for name in row}
    valued = {column for row in must for column in columns if row.get(column) is not None}
    missing = [column for column in columns if column in valued and column not in present]
    if not missing:
        return None
    others = sorted(present - set(columns))
    return (
        f"resource {resource!r} has no column {', '.join(repr(c) for c in missing)}"
        + (f" (it has {', '.join(repr(c) for c in others)})" if others else "")
        + ": a name must land exactly as given, or be refused"
    )


def _by_key(item: tuple[FrozenRow, int]) -> tuple[str, str]:
    row = dict(item[0])
    return (str(row.get(KEY)), repr(item[0]))


def _show(row: FrozenRow) -> str:
    return "{" + ", ".join(f"{column!r}: {value!r}" for column, value in row) + "}"


def _lacks(resource: str, row: FrozenRow, have: Counter[FrozenRow], columns: Sequence[str]) -> str:
    key = dict(row).get(KEY)
    other = [held for held in have if dict(held).get(KEY) == key]
    if other:
        return f"resource {resource!r} holds id {key} as {_show(other[0])}; the model holds {_show(row)}"
    return f"resource {resource!r} lacks id {key} {_show(row)}; the model holds it"


def _extra(
    resource: str, row: FrozenRow, count: int, limit: int, need: Counter[FrozenRow], columns: Sequence[str]
) -> str:
    key = dict(row).get(KEY)
    if limit:
        return f"resource {resource!r} holds id {key} {_times(count)}; the model holds it {_times(limit)}"
    if any(dict(wanted).get(KEY) == key for wanted in need):
        return f"resource {resource!r} holds a stale row {_show(row)} for id {key}"
    return f"resource {resource!r} holds id {key} {_show(row)}, which the model never committed there"


def _times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


__all__ = ["KEY", "MISSING", "VERSION", "Change", "TableModel", "absent_columns", "difference", "freeze"]
