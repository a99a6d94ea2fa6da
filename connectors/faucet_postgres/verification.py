"""What a stream's epochs left in PostgreSQL, read back for ``faucet verify`` (``StreamingSink.reader``).

The expected rows (what the epochs handed the sink, re-read from the source) are copied into a
temporary table with the destination table's column types, by the same COPY the sink writes with, so
both sides hold values converted alike; the comparison then runs inside the database, in one
REPEATABLE READ snapshot that also reads the stream's last committed epoch. Rows are compared by the
text of their compared columns (``ROW(...)::text``, hashed): the columns of the expected rows the
table has (an epoch column, columns added later, are not compared).

APPEND. With the sink's ``epoch_column`` (the epoch that wrote each row, and its stream), the rows of
each compared epoch must be exactly the expected ones: first a checksum per epoch on both sides
(count and sum of row hashes; one scan each), then, for the epochs whose checksums differ only, the two
multisets joined by hash and occurrence, which names every missing row, every row found more often
than expected (duplicated) and every row no event explains (unexpected, with the epoch that wrote
it). Without it, each expected row must be in the table at least as often as expected (a scan of the
whole table): deletions and changes are found, duplicates cannot be told from other epochs' rows,
which the diff says (``unchecked``).

UPSERT, VERSIONED_UPSERT, APPLY_CHANGES. The expected state of each key is computed from the
expected rows as the sink computes it (the last row; the newest version; the last change, a delete
meaning absent), then joined with the table by key: a row that differs is *superseded* when a later
epoch wrote it (``epoch_column``; without it, when the destination committed epochs after the
compared ones, which the diff says), else *changed*; a key that should be there and is not is
*missing* (for APPLY_CHANGES without ``epoch_column``: superseded, when a later epoch may have
deleted it); a deleted key still there is *resurrected*. A key whose last change kept values of an
earlier one (``__faucet_unchanged``) is compared on the columns it carried.

Cost: the expected rows are written once into a temporary table (unlogged, dropped at the end of the
transaction); APPEND with ``epoch_column`` reads the compared epochs' rows (an index or a BRIN index on
the column keeps that to them), without it the whole table; keyed policies look each key up (the
table's primary key). Nothing of the destination's tables is changed.
"""

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from faucet_dagster.protocol import (
    DEFAULT_DIFF_LIMIT,
    OPERATION_COLUMN,
    UNCHANGED_COLUMN,
    DestinationDiff,
    DestinationReader,
    ExpectedRows,
    FoundRow,
    SinkCommitState,
    WritePolicy,
)
from faucet_postgres.changes import KEY_METADATA
from faucet_postgres.common import PgColumn, connect, current_schema, pg_error, table_columns, table_name
from faucet_postgres.config import PostgresConnection, PostgresSinkConfig, PostgresStreamingSinkConfig
from faucet_postgres.copy_arrow import copy_batch
from faucet_postgres.stream_fence import StreamRows
from faucet_postgres.stream_tables import epoch_stamp, stamped_sequence

Connection = psycopg.AsyncConnection[Any]

_ROW = "__faucet_row"
_EPOCH = "__faucet_expected_epoch"
_KEPT = "__faucet_kept"
_INT8 = PgColumn("", "int8", "bigint", -1, False)
_TEXT = PgColumn("", "text", "text", -1, False)
_BOOL = PgColumn("", "bool", "boolean", -1, False)
_NO_EPOCH_COLUMN = (
    "duplicates, and rows no event of the range wrote: the table does not record which epoch wrote a "
    "row (set the sink's epoch_column)"
)


@dataclass(frozen=True)
class ReadTarget:
    """Where a reader looks: the tables (by resource), the columns that say who wrote a row, and the
    stream's state rows (a bounded sink keeps none)."""

    connection: PostgresConnection
    tables: Callable[[str], str]
    schema_name: str | None
    epoch_column: str | None = None
    version_column: str | None = None
    state: tuple[str | None, str, str] | None = None
    """``(state schema, epochs table, watermarks table)`` of a stream's sink."""

    @classmethod
    def of_stream(cls, config: PostgresStreamingSinkConfig) -> "ReadTarget":
        return cls(
            config,
            config.table_for,
            config.schema_name,
            config.epoch_column,
            config.version_column,
            (config.state_schema_name, config.epochs_table, config.watermarks_table),
        )

    @classmethod
    def of_table(cls, config: PostgresSinkConfig) -> "ReadTarget":
        return cls(config, lambda _: config.table, config.schema_name)


class PostgresDestinationReader(DestinationReader):
    """Reads back a stream's (or a sync's) tables and state rows; see the module docstring."""

    def __init__(self, target: ReadTarget, stream: str, policy: WritePolicy, key: Sequence[str]) -> None:
        self._target = target
        self._stream = stream
        self._policy = policy
        self._key = tuple(key)
        self._where = f"{target.connection.safe_url()} {stream}"

    async def committed(self) -> SinkCommitState | None:
        if self._target.state is None:
            return None
        conn = await connect(self._target.connection, autocommit=True)
        try:
            return await self._committed(conn)
        except psycopg.Error as exc:
            raise pg_error(exc, where=self._where, doing="reading the committed epoch") from exc
        finally:
            await conn.close()

    async def _committed(self, conn: Connection) -> SinkCommitState | None:
        if self._target.state is None:
            return None
        state_schema, epochs, watermarks = self._target.state
        schema = state_schema or self._target.schema_name or await current_schema(conn)
        found = await (await conn.execute("SELECT to_regclass(%s)", (f'"{schema}"."{epochs}"',))).fetchone()
        if found is None or found[0] is None:
            return None
        return (await StreamRows(self._stream, schema, epochs, watermarks).read(conn)).state()

    async def compare(self, expected: ExpectedRows, *, limit: int = DEFAULT_DIFF_LIMIT) -> DestinationDiff:
        conn = await connect(self._target.connection, autocommit=False)
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        table = self._target.tables(expected.resource)
        where = f"{self._where} table {table}"
        try:
            schema = self._target.schema_name or await current_schema(conn)
            columns = await table_columns(conn, schema, table)
            committed = await self._committed(conn)
            last = None if committed is None else committed.epoch.sequence
            if columns is None:
                return DestinationDiff(
                    compared=expected.rows.num_rows,
                    missing=tuple(range(min(limit, expected.rows.num_rows))),
                    totals={"missing": expected.rows.num_rows},
                )
            comparison = _Comparison(
                conn, table_name(schema, table), columns, expected, self._target, limit, self._stream
            )
            await comparison.load()
            if self._policy in (WritePolicy.APPEND, WritePolicy.REPLACE):
                diff = await comparison.append(exact=self._policy is WritePolicy.REPLACE)
            else:
                diff = await comparison.keyed(self._policy, self._key, last)
            return DestinationDiff(**diff)
        except psycopg.Error as exc:
            raise pg_error(exc, where=where, doing="comparing the rows") from exc
        finally:
            await conn.rollback()
            await conn.close()


class _Comparison:
    """One comparison on one connection: the expected rows loaded, then compared by policy."""

    def __init__(
        self,
        conn: Connection,
        table: sql.Identifier,
        columns: Mapping[str, PgColumn],
        expected: ExpectedRows,
        where: ReadTarget,
        limit: int,
        stream: str,
    ) -> None:
        self.conn = conn
        self.stream = stream
        self.target = table
        self.columns = columns
        self.expected = expected
        self.limit = limit
        self.stage = sql.Identifier(f"_faucet_verify_{uuid.uuid4().hex[:12]}")
        skip = {OPERATION_COLUMN, UNCHANGED_COLUMN, where.epoch_column}
        names = expected.rows.schema.names
        self.compared = [name for name in names if name not in skip and name in columns]
        self.absent = [name for name in names if name not in skip and name not in columns]
        self.epoch_column = where.epoch_column if where.epoch_column in columns else None
        self.version = where.version_column
        self.changes = OPERATION_COLUMN in names

    def stamp(self, sequence: int) -> int:
        """What the epoch column holds for this stream's epoch ``sequence``."""
        return epoch_stamp(self.stream, sequence)

    def stamps(self) -> list[int]:
        return [self.stamp(sequence) for sequence in self.expected.sequences]

    def hash_of(self, alias: str) -> sql.Composed:
        """The md5 of the compared columns of ``alias``, as text."""
        fields = sql.SQL(", ").join(
            sql.SQL("{}.{}").format(sql.Identifier(alias), sql.Identifier(n)) for n in self.compared
        )
        return sql.SQL("md5(ROW({})::text)").format(fields)

    async def load(self) -> None:
        """The expected rows into a temporary table of the destination's column types (by the sink's COPY)."""
        columns = sql.SQL(", ").join(map(sql.Identifier, self.compared))
        await self.conn.execute(
            sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                self.stage, columns, self.target
            )
        )
        extra = [(_ROW, _INT8), (_EPOCH, _INT8)] + (
            [(OPERATION_COLUMN, _TEXT), (_KEPT, _BOOL)] if self.changes else []
        )
        await self.conn.execute(
            sql.SQL("ALTER TABLE {} {}").format(
                self.stage,
                sql.SQL(", ").join(
                    sql.SQL("ADD COLUMN {} {}").format(sql.Identifier(name), sql.SQL(kind.type_sql))
                    for name, kind in extra
                ),
            )
        )
        rows = self.expected.rows
        count = rows.num_rows
        arrays = [rows.column(name) for name in self.compared]
        names = list(self.compared)
        arrays += [
            pa.chunked_array([pa.array(range(count), pa.int64())]),
            pa.chunked_array([pa.array([self.stamp(epoch) for epoch in self.expected.epochs], pa.int64())]),
        ]
        names += [_ROW, _EPOCH]
        if self.changes:
            arrays.append(rows.column(OPERATION_COLUMN).cast(pa.string()))
            names.append(OPERATION_COLUMN)
            if UNCHANGED_COLUMN in rows.schema.names:
                kept = pc.fill_null(pc.greater(pc.list_value_length(rows.column(UNCHANGED_COLUMN)), 0), False)
            else:
                kept = pa.chunked_array([pa.array([False] * count, pa.bool_())])
            arrays.append(kept)
            names.append(_KEPT)
        table = pa.Table.from_arrays(arrays, names=names).combine_chunks()
        kinds = {
            **{name: self.columns[name] for name in self.compared},
            _ROW: _INT8,
            _EPOCH: _INT8,
            OPERATION_COLUMN: _TEXT,
            _KEPT: _BOOL,
        }
        mapping = {name: kinds[name] for name in names}
        for batch in table.to_batches():
            await copy_batch(self.conn, self.stage, batch, mapping)

    # -- APPEND -------------------------------------------------------------------------------------

    async def append(self, *, exact: bool) -> dict[str, Any]:
        """Each expected row once among its epoch's rows (``epoch_column``); without it, the whole
        table equal to the expected rows when ``exact`` (a REPLACE, or every epoch from the first to
        the latest), else each expected row there at least once."""
        count = self.expected.rows.num_rows
        unchecked = self._absent_note()
        expected = self.expected
        whole = expected.sequences[0] == 1 and list(expected.sequences) == list(range(1, expected.latest + 1))
        if self.epoch_column is None and (exact or whole):
            return {"compared": count, "unchecked": unchecked, **await self._multiset_diff(None)}
        if self.epoch_column is None:
            missing = await self._not_contained()
            return {
                "compared": count,
                "missing": tuple(missing[: self.limit]),
                "unchecked": (*unchecked, _NO_EPOCH_COLUMN),
                "totals": {"missing": len(missing)},
            }
        differing = await self._differing_epochs()
        if not differing:
            return {"compared": count, "unchecked": unchecked}
        return {"compared": count, "unchecked": unchecked, **await self._multiset_diff(differing)}

    async def _differing_epochs(self) -> list[int]:
        """The compared epochs whose rows' count or hash sum differ between the two sides."""
        epoch = sql.Identifier(self.epoch_column or "")
        hashed = sql.SQL("sum(hashtextextended(ROW({})::text, 0))")
        staged = sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(n)) for n in self.compared)
        found = sql.SQL(", ").join(sql.SQL("d.{}").format(sql.Identifier(n)) for n in self.compared)
        query = sql.SQL(
            "WITH e AS (SELECT s.{ep} AS ep, count(*) AS n, {hs} AS h FROM {stage} s GROUP BY 1), "
            "d AS (SELECT d.{epoch} AS ep, count(*) AS n, {hd} AS h FROM {target} d "
            "WHERE d.{epoch} = ANY(%s) GROUP BY 1) "
            "SELECT coalesce(e.ep, d.ep) FROM e FULL JOIN d ON e.ep = d.ep "
            "WHERE e.n IS DISTINCT FROM d.n OR e.h IS DISTINCT FROM d.h"
        ).format(
            ep=sql.Identifier(_EPOCH),
            hs=hashed.format(staged),
            stage=self.stage,
            epoch=epoch,
            hd=hashed.format(found),
            target=self.target,
        )
        rows = await (await self.conn.execute(query, (self.stamps(),))).fetchall()
        return sorted(int(row[0]) for row in rows)

    async def _multiset_diff(self, epochs: list[int] | None) -> dict[str, Any]:
        """Within ``epochs`` (None: the whole table, whatever wrote it): the expected rows not there,
        and the rows there that are not expected (as often as they occur), joined by hash and
        occurrence."""
        staged: sql.Composable = sql.SQL("0::bigint")
        written: sql.Composable = sql.SQL("0::bigint")  # the whole table: one segment
        within: sql.Composable = sql.SQL("true")
        stage_within: sql.Composable = sql.SQL("true")
        if epochs is not None:
            staged = sql.SQL("s.{}").format(sql.Identifier(_EPOCH))
            written = sql.SQL("d.{}").format(sql.Identifier(self.epoch_column or ""))
            within = sql.SQL("{} = ANY(%(epochs)s)").format(written)
            stage_within = sql.SQL("{} = ANY(%(epochs)s)").format(staged)
        query = sql.SQL(
            "WITH e AS (SELECT s.{row} AS i, {staged} AS ep, {hs} AS h FROM {stage} s "
            "WHERE {stage_within}), "
            "e2 AS (SELECT i, ep, h, row_number() OVER (PARTITION BY ep, h ORDER BY i) AS n FROM e), "
            "d AS (SELECT {found} AS ep, {hd} AS h, d.ctid AS c FROM {target} d "
            "WHERE {within}), "
            "d2 AS (SELECT ep, h, c, row_number() OVER (PARTITION BY ep, h ORDER BY c) AS n FROM d), "
            "first AS (SELECT ep, h, min(i) AS i FROM e GROUP BY ep, h) "
            "SELECT e2.i, d2.c::text, d2.ep, f.i FROM e2 "
            "FULL JOIN d2 ON e2.ep = d2.ep AND e2.h = d2.h AND e2.n = d2.n "
            "LEFT JOIN first f ON f.ep = d2.ep AND f.h = d2.h "
            "WHERE e2.i IS NULL OR d2.c IS NULL ORDER BY coalesce(e2.i, f.i), d2.c"
        ).format(
            row=sql.Identifier(_ROW),
            staged=staged,
            hs=self.hash_of("s"),
            stage=self.stage,
            stage_within=stage_within,
            found=written,
            hd=self.hash_of("d"),
            target=self.target,
            within=within,
        )
        missing: list[int] = []
        copies: dict[int, int] = {}
        stray: list[tuple[str, int | None]] = []
        params = None if epochs is None else {"epochs": epochs}
        for index, ctid, epoch, twin in await (await self.conn.execute(query, params)).fetchall():
            if ctid is None:
                missing.append(int(index))
            elif twin is not None:
                copies[int(twin)] = copies.get(int(twin), 0) + 1
            else:
                stray.append((str(ctid), None if epochs is None else stamped_sequence(int(epoch))))
        found = await self._rows_at([ctid for ctid, _ in stray[: self.limit]])
        return {
            "missing": tuple(missing[: self.limit]),
            "duplicated": tuple(sorted(copies.items())[: self.limit]),
            "unexpected": tuple(
                FoundRow(found[ctid], epoch) for ctid, epoch in stray[: self.limit] if ctid in found
            ),
            "totals": {"missing": len(missing), "duplicated": len(copies), "unexpected": len(stray)},
        }

    async def _not_contained(self) -> list[int]:
        """The expected rows the table holds fewer times than expected (it records no epoch)."""
        query = sql.SQL(
            "WITH e AS (SELECT s.{row} AS i, {hs} AS h FROM {stage} s), "
            "e2 AS (SELECT i, h, row_number() OVER (PARTITION BY h ORDER BY i) AS n FROM e), "
            "d AS (SELECT h, count(*) AS k FROM (SELECT {hd} AS h FROM {target} d) x "
            "WHERE h IN (SELECT h FROM e) GROUP BY h) "
            "SELECT e2.i FROM e2 LEFT JOIN d ON d.h = e2.h WHERE e2.n > coalesce(d.k, 0) ORDER BY e2.i"
        ).format(
            row=sql.Identifier(_ROW),
            hs=self.hash_of("s"),
            stage=self.stage,
            hd=self.hash_of("d"),
            target=self.target,
        )
        return [int(row[0]) for row in await (await self.conn.execute(query)).fetchall()]

    # -- keyed policies ---------------------------------------------------------------------------

    async def keyed(self, policy: WritePolicy, key: tuple[str, ...], committed: int | None) -> dict[str, Any]:
        key = key or tuple(
            field.name
            for field in self.expected.rows.schema
            if (field.metadata or {}).get(KEY_METADATA) == b"true"
        )
        count = self.expected.rows.num_rows
        unchecked = list(self._absent_note())
        missing_key = [name for name in key if name not in self.compared]
        if not key or missing_key:
            unchecked.append(
                f"the rows by key: no key column {', '.join(missing_key) or '(none)'} to compare them by"
            )
            return {"compared": 0, "unchecked": tuple(unchecked)}
        last = self.expected.sequences[-1]
        after = max(committed or 0, self.expected.latest)
        later_unknown = self.epoch_column is None and after > last
        if later_unknown:
            unchecked.append(
                f"rows that differ: epochs after {last} (up to {after}) may have changed them, and the "
                "table does not record which epoch wrote a row (set the sink's epoch_column)"
            )
        rows = await self._keyed_rows(policy, key)
        head = last >= after
        missing: list[int] = []
        changed: list[tuple[int, dict[str, Any]]] = []
        resurrected: list[int] = []
        superseded = 0
        for index, _, deleted, present, same, later, tied, found in rows:
            if deleted:
                if present and not later:
                    resurrected.append(int(index))
                elif present:
                    superseded += 1
            elif not present:
                if policy is WritePolicy.APPLY_CHANGES and not head and self.epoch_column is None:
                    superseded += 1
                else:
                    missing.append(int(index))
            elif same or tied:
                continue
            elif later or later_unknown:
                superseded += 1
            else:
                changed.append((int(index), json.loads(found)))
        return {
            "compared": count,
            "missing": tuple(missing[: self.limit]),
            "changed": tuple(changed[: self.limit]),
            "resurrected": tuple(resurrected[: self.limit]),
            "superseded": superseded,
            "unchecked": tuple(unchecked),
            "totals": {"missing": len(missing), "changed": len(changed), "resurrected": len(resurrected)},
        }

    async def _keyed_rows(self, policy: WritePolicy, key: tuple[str, ...]) -> list[tuple[Any, ...]]:
        """Per key of the expected rows: its final expected row's index and epoch, whether it is a
        delete, whether the table has the key, whether the row is the same, whether a later epoch
        wrote it (or, VERSIONED_UPSERT, a newer version is there), whether another expected row of the
        key is what is there (a tie of versions), and the row found as JSON."""
        keys = sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(name)) for name in key)
        join = sql.SQL(" AND ").join(sql.SQL("d.{k} = f.{k}").format(k=sql.Identifier(name)) for name in key)
        order = [*[sql.SQL("s.{}").format(sql.Identifier(name)) for name in key]]
        version = (
            self.version if policy is WritePolicy.VERSIONED_UPSERT and self.version in self.compared else None
        )
        if version is not None:
            order.append(sql.SQL("s.{} DESC").format(sql.Identifier(version)))
        order.append(sql.SQL("s.{} DESC").format(sql.Identifier(_ROW)))
        deleted = (
            sql.SQL("f.{} = 'delete'").format(sql.Identifier(OPERATION_COLUMN))
            if self.changes
            else sql.SQL("false")
        )
        kept: sql.Composable = (
            sql.SQL("f.{}").format(sql.Identifier(_KEPT)) if self.changes else sql.SQL("false")
        )
        later: sql.Composable
        tied: sql.Composable
        if self.epoch_column is not None:
            later = sql.SQL("d.{e} >> 32 = f.{x} >> 32 AND d.{e} > f.{x}").format(
                e=sql.Identifier(self.epoch_column), x=sql.Identifier(_EPOCH)
            )
        else:
            later = sql.SQL("false")
        if version is not None:
            later = sql.SQL("({}) OR d.{v} > f.{v}").format(later, v=sql.Identifier(version))
            tied = sql.SQL(
                "EXISTS (SELECT 1 FROM {stage} t WHERE {tkeys} AND t.{v} = d.{v} AND {th} = {dh})"
            ).format(
                stage=self.stage,
                tkeys=sql.SQL(" AND ").join(
                    sql.SQL("t.{k} = d.{k}").format(k=sql.Identifier(n)) for n in key
                ),
                v=sql.Identifier(version),
                th=self.hash_of("t"),
                dh=self.hash_of("d"),
            )
        else:
            tied = sql.SQL("false")
        query = sql.SQL(
            "WITH f AS (SELECT DISTINCT ON ({keys}) s.* FROM {stage} s ORDER BY {order}) "
            "SELECT f.{row}, f.{ep}, {deleted}, d.ctid IS NOT NULL, "
            "d.ctid IS NOT NULL AND ({kept} OR {fh} = {dh}), "
            "d.ctid IS NOT NULL AND ({later}), d.ctid IS NOT NULL AND {tied}, "
            "CASE WHEN d.ctid IS NULL THEN NULL ELSE row_to_json(d)::text END "
            "FROM f LEFT JOIN {target} d ON {join} ORDER BY f.{row}"
        ).format(
            keys=keys,
            stage=self.stage,
            order=sql.SQL(", ").join(order),
            row=sql.Identifier(_ROW),
            ep=sql.Identifier(_EPOCH),
            deleted=deleted,
            kept=kept,
            fh=self.hash_of("f"),
            dh=self.hash_of("d"),
            later=later,
            tied=tied,
            target=self.target,
            join=join,
        )
        return list(await (await self.conn.execute(query)).fetchall())

    # -- helpers ----------------------------------------------------------------------------------

    def _absent_note(self) -> tuple[str, ...]:
        if not self.absent:
            return ()
        return (f"column(s) {', '.join(self.absent)}: the table has none, the other columns were compared",)

    async def _rows_at(self, ctids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The rows at ``ctids``, as JSON objects, by ctid."""
        if not ctids:
            return {}
        query = sql.SQL(
            "SELECT d.ctid::text, row_to_json(d)::text FROM {} d WHERE d.ctid = ANY(%s::tid[])"
        ).format(self.target)
        rows = await (await self.conn.execute(query, (list(ctids),))).fetchall()
        return {str(ctid): json.loads(text) for ctid, text in rows}


__all__ = ["PostgresDestinationReader", "ReadTarget"]
