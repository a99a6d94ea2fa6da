"""Two fault classes of the PostgreSQL change source: a snapshot crashed and recovered with source
changes in between, and a table without a key.

``cdc-snapshot-postgres``
    The change source with ``snapshot``: a new stream first reads the table's existing rows at one
    point. Its own fault (:func:`.scenarios.snapshot_crash`): the worker is killed after the sink
    committed the snapshot's epoch and before its certificate, then rows the snapshot read are deleted and
    updated at the source (:func:`change_existing`), and new ones written; a fresh worker recovers. A
    second snapshot is taken at another point, so the recovery must not trust re-read rows: the
    replica must equal the source.
``cdc-unkeyed-postgres``
    The table has no primary key (setup sets ``REPLICA IDENTITY FULL`` on it, as asked by the
    config's ``replica_identity_full``) and holds identical rows (:func:`duplicate_rows`): the
    replica must hold each of them, as many times as the source. Both sides are judged as multisets
    (:func:`numbered`).

Both pairs run only their own faults in the named battery (:func:`.catalog.named_faults`).

The sides themselves are in :mod:`.pairs` (a few lines each, delegating here); the snapshot crash's
runner is :func:`.scenarios.snapshot_crash`.
"""

import json
from collections.abc import Iterable
from typing import Any

import psycopg

UNKEYED_TABLE = (
    "CREATE TABLE {table} (producer text, seq bigint, id bigint NOT NULL, version int NOT NULL, "
    "note text NOT NULL)"
)
"""The change workload's table without its primary key."""

_Key = tuple[str, int]
_Row = dict[str, Any]


def _changed(url: str, *statements: tuple[str, tuple[Any, ...]]) -> int:
    """Run ``statements`` in one transaction; return the WAL insert position read just before its
    commit (at most its commit LSN, above every earlier commit's)."""
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn, conn.transaction():
        for statement, params in statements:
            conn.execute(statement, params)
        row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None  # a SELECT without FROM returns one row
    return int(row[0])


def change_existing(url: str, table: str, producer: str) -> tuple[list[int], int]:
    """Delete every fifth row of ``producer`` and update the next of each five, in one transaction;
    return the sequences touched and the transaction's position."""
    with psycopg.connect(url, connect_timeout=10) as conn:
        seqs = [row[0] for row in conn.execute(f"SELECT seq FROM {table} WHERE producer = %s", (producer,))]
    position = _changed(
        url,
        (f"DELETE FROM {table} WHERE producer = %s AND seq %% 5 = 1", (producer,)),
        (
            f"UPDATE {table} SET version = version + 1, note = 'after' WHERE producer = %s AND seq %% 5 = 2",
            (producer,),
        ),
    )
    return [seq for seq in seqs if seq % 5 in (1, 2)], position


def duplicate_rows(url: str, table: str, producer: str) -> tuple[list[int], int]:
    """Give every seventh row of ``producer`` an identical copy, delete one copy of every fourteenth
    again (a delete of one of two identical rows) and delete the row after each seventh, in one
    transaction; return the sequences touched and its position. The table keeps as many rows."""
    with psycopg.connect(url, connect_timeout=10) as conn:
        seqs = [row[0] for row in conn.execute(f"SELECT seq FROM {table} WHERE producer = %s", (producer,))]
    every_seventh = f"FROM {table} WHERE producer = %s AND seq %% 7 = 0"
    position = _changed(
        url,
        (f"INSERT INTO {table} SELECT * {every_seventh}", (producer,)),
        (f"INSERT INTO {table} SELECT DISTINCT * {every_seventh} AND seq %% 14 = 0", (producer,)),
        (
            f"DELETE FROM {table} WHERE ctid IN (SELECT min(ctid) {every_seventh} AND seq %% 14 = 0 "
            "GROUP BY seq)",
            (producer,),
        ),
        (f"DELETE FROM {table} WHERE producer = %s AND seq %% 7 = 1", (producer,)),
    )
    return [seq for seq in seqs if seq % 7 in (0, 1)], position


def numbered(rows: Iterable[tuple[_Key, _Row]]) -> list[tuple[_Key, _Row]]:
    """``rows`` keyed as a multiset: the ``n``-th row (in value order) of ``(producer, seq)`` becomes
    key ``(f"{producer}/{n}", seq)``, so identical rows are distinct keys, the same on both sides
    when both hold the same rows, and a missing copy is a missing key."""
    groups: dict[_Key, list[_Row]] = {}
    for key, row in rows:
        groups.setdefault(key, []).append(row)
    keyed: list[tuple[_Key, _Row]] = []
    for (producer, seq), group in groups.items():
        ordered = sorted(group, key=lambda row: json.dumps(row, sort_keys=True, default=str))
        keyed.extend(((f"{producer}/{n}", seq), row) for n, row in enumerate(ordered))
    return keyed


__all__ = ["UNKEYED_TABLE", "change_existing", "duplicate_rows", "numbered"]
