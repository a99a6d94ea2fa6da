"""DDL capture at the source: what a published table's columns were at every point of the change stream.

pgoutput describes a table by the names and types of its columns (a Relation message), so from the
change stream alone a ``RENAME COLUMN b TO c`` looks like a ``DROP COLUMN b`` and an ``ADD COLUMN c``,
a column dropped and added again under its name looks like nothing, a generated column is not there
at all, and a table added to the publication arrives without the rows it held. So
:func:`install_capture` (run by ``setup_replication``) installs two event triggers in the source
database, which run inside every DDL statement's own transaction:

* ``ddl_command_end``: for each table a statement created or altered, a row of
  ``metadata_schema.faucet_cdc_ddl`` with the table's columns after it (attribute number, name, exact
  type, generated expression, identity), the statement's text and the WAL insert position; for
  ``ALTER PUBLICATION ... ADD TABLE`` (and ``SET TABLE``) also the table's rows, under a ``SHARE``
  lock, as transactional logical messages (prefix :data:`DDL_PREFIX`), so they are decoded exactly
  where the table joined the publication: the rows before that point with it, the changes after it as
  changes;
* ``sql_drop``: a row and a message for a table dropped, or one leaving a publication.

The change source reads the history (:func:`columns_at`) when a Relation message comes: the columns
valid for a transaction committing at ``L`` are those of the last history row written before ``L``
(an ``ALTER TABLE`` holds its table's lock until it commits, so a transaction writing the table
commits after it, or the ``ALTER`` waits for it), and the messages in stream order. What they give
the replica (attribute numbers that tell a rename from a drop and an add, exact types, generated
columns) travels as field and schema metadata of the change rows (:mod:`faucet_postgres.change_schema`).

Values in the messages are each type's output text under the settings the decoding session uses
(UTC, ISO dates, hex bytea, shortest exact floats), as pgoutput sends them.

The event triggers need a superuser (or, on managed services, their equivalent role) to create; a
change session refuses to open without them (:func:`check_capture`).
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from faucet_dagster.protocol import ConfigError, IntegrityError

Connection = psycopg.AsyncConnection[Any]

DDL_PREFIX = "faucet-ddl"
"""The prefix of the logical messages the DDL capture writes."""

HISTORY_TABLE = "faucet_cdc_ddl"
"""The history of published tables' columns, in ``metadata_schema``."""

ROWS_PER_MESSAGE = 2_000
"""Rows of a table joining the publication per logical message."""

_SETTINGS = (
    "SET TimeZone = 'UTC' SET DateStyle = 'ISO, YMD' SET IntervalStyle = 'postgres' "
    "SET bytea_output = 'hex' SET extra_float_digits = 1"
)
"""The capture functions' own settings: what the decoding session uses, so their texts are pgoutput's."""


def _trigger_name(schema: str) -> str:
    return f"faucet_ddl_{schema}"[:63]


def _install_sql(schema: str) -> "sql.Composed":
    history = sql.Identifier(schema, HISTORY_TABLE)
    columns = sql.Identifier(schema, "faucet_cdc_columns")
    named = sql.Identifier(schema, "faucet_cdc_name")
    record = sql.Identifier(schema, "faucet_cdc_record")
    rows = sql.Identifier(schema, "faucet_cdc_rows")
    on_ddl = sql.Identifier(schema, "faucet_cdc_on_ddl")
    on_drop = sql.Identifier(schema, "faucet_cdc_on_drop")
    prefix = sql.Literal(DDL_PREFIX)
    per_message = sql.Literal(ROWS_PER_MESSAGE)
    return sql.SQL(
        """
CREATE TABLE IF NOT EXISTS {history} (
    id bigserial PRIMARY KEY,
    relid oid NOT NULL,
    at_lsn pg_lsn NOT NULL,
    event text NOT NULL,
    table_name text NOT NULL,
    publication text,
    statement text NOT NULL,
    columns jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS faucet_cdc_ddl_relid ON {history} (relid, id);

CREATE OR REPLACE FUNCTION {columns}(rel oid) RETURNS jsonb LANGUAGE sql STABLE AS $f$
    SELECT coalesce(jsonb_agg(jsonb_build_object(
        'attnum', a.attnum, 'name', a.attname, 'type', format_type(a.atttypid, a.atttypmod),
        'type_oid', a.atttypid, 'typmod', a.atttypmod, 'generated', a.attgenerated,
        'expression', CASE WHEN a.attgenerated <> '' THEN pg_get_expr(d.adbin, d.adrelid) END,
        'not_null', a.attnotnull, 'has_default', a.atthasdef,
        'missing', CASE WHEN a.atthasmissing THEN (a.attmissingval::text::text[])[1] END,
        'key', c.relreplident = 'f' OR coalesce(a.attnum = ANY(i.indkey::int2[]), false)
    ) ORDER BY a.attnum), '[]'::jsonb)
    FROM pg_attribute AS a JOIN pg_class AS c ON c.oid = a.attrelid
    LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    LEFT JOIN pg_index AS i ON i.indrelid = c.oid AND ((c.relreplident = 'd' AND i.indisprimary)
        OR (c.relreplident = 'i' AND i.indisreplident))
    WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped
$f$;

CREATE OR REPLACE FUNCTION {named}(rel oid) RETURNS text LANGUAGE sql STABLE AS $f$
    SELECT n.nspname || '.' || c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = rel
$f$;

CREATE OR REPLACE FUNCTION {record}(rel oid, kind text, name text, pub text, why text DEFAULT NULL)
RETURNS void LANGUAGE plpgsql AS $f$
DECLARE
    recorded bigint;
BEGIN
    INSERT INTO {history} (relid, at_lsn, event, table_name, publication, statement, columns)
    VALUES (rel, pg_current_wal_insert_lsn(), kind, name, pub, coalesce(why, current_query(), ''),
        CASE WHEN kind IN ('drop_table', 'publication_drop') THEN NULL ELSE {columns}(rel) END)
    RETURNING id INTO recorded;
    IF kind = 'columns' THEN
        RETURN;  -- read from the history when a Relation message comes
    END IF;
    PERFORM pg_logical_emit_message(true, {prefix}, jsonb_build_object(
        'event', kind, 'id', recorded, 'relid', rel, 'table', name, 'publication', pub,
        'statement', coalesce(why, current_query(), ''),
        'columns', CASE WHEN kind IN ('drop_table', 'publication_drop') THEN NULL ELSE {columns}(rel) END
    )::text);
END
$f$;

CREATE OR REPLACE FUNCTION {rows}(rel oid, name text, pub text) RETURNS void
LANGUAGE plpgsql {settings} AS $f$
DECLARE
    names text[];
    filter text;
    query text;
    batch jsonb := '[]'::jsonb;
    taken int := 0;
    item record;
BEGIN
    SELECT pt.attnames::text[], pt.rowfilter INTO names, filter FROM pg_publication_tables AS pt
    WHERE pt.pubname = pub AND pt.schemaname = (SELECT nspname FROM pg_namespace AS n JOIN pg_class AS c
        ON c.relnamespace = n.oid WHERE c.oid = rel) AND pt.tablename = (SELECT relname FROM pg_class
        WHERE oid = rel);
    IF names IS NULL THEN
        RETURN;
    END IF;
    EXECUTE format('LOCK TABLE %s IN SHARE MODE', rel::regclass);
    SELECT format('SELECT ARRAY[%s]::text[] AS v FROM ONLY %s%s',
        string_agg(format('CASE WHEN %1$I IS NULL THEN NULL ELSE format(''%%s'', %1$I) END', n), ', '
            ORDER BY o),
        rel::regclass, CASE WHEN filter IS NULL THEN '' ELSE ' WHERE ' || filter END)
    INTO query FROM unnest(names) WITH ORDINALITY AS u(n, o);
    FOR item IN EXECUTE query LOOP
        batch := batch || jsonb_build_array(to_jsonb(item.v));
        taken := taken + 1;
        IF taken = {per_message} THEN
            PERFORM pg_logical_emit_message(true, {prefix}, jsonb_build_object(
                'event', 'rows', 'relid', rel, 'table', name, 'publication', pub, 'rows', batch)::text);
            batch := '[]'::jsonb;
            taken := 0;
        END IF;
    END LOOP;
    IF taken > 0 THEN
        PERFORM pg_logical_emit_message(true, {prefix}, jsonb_build_object(
            'event', 'rows', 'relid', rel, 'table', name, 'publication', pub, 'rows', batch)::text);
    END IF;
END
$f$;

CREATE OR REPLACE FUNCTION {on_ddl}() RETURNS event_trigger LANGUAGE plpgsql AS $f$
DECLARE
    r record;
    rel oid;
    pub text;
BEGIN
    FOR r IN SELECT DISTINCT ON (objid, object_type) * FROM pg_event_trigger_ddl_commands() LOOP
        IF r.object_type IN ('table', 'table column') AND r.classid = 'pg_class'::regclass THEN
            IF (SELECT relkind FROM pg_class WHERE oid = r.objid) IN ('r', 'p') THEN
                PERFORM {record}(r.objid, 'columns', {named}(r.objid), NULL);
            END IF;
        ELSIF r.object_type = 'publication relation' THEN
            SELECT pr.prrelid, p.pubname INTO rel, pub FROM pg_publication_rel AS pr
            JOIN pg_publication AS p ON p.oid = pr.prpubid WHERE pr.oid = r.objid;
            IF rel IS NOT NULL THEN
                PERFORM {record}(rel, 'publication_add', {named}(rel), pub);
                PERFORM {rows}(rel, {named}(rel), pub);
            END IF;
        END IF;
    END LOOP;
END
$f$;

CREATE OR REPLACE FUNCTION {on_drop}() RETURNS event_trigger LANGUAGE plpgsql AS $f$
DECLARE
    r record;
    name text;
BEGIN
    FOR r IN SELECT * FROM pg_event_trigger_dropped_objects() LOOP
        name := r.address_names[1] || '.' || r.address_names[2];
        IF r.object_type = 'table' THEN
            PERFORM {record}(r.objid, 'drop_table', name, NULL);
        ELSIF r.object_type = 'publication relation' THEN
            PERFORM {record}(
                coalesce(to_regclass(format('%I.%I', r.address_names[1], r.address_names[2]))::oid, 0),
                'publication_drop', name, r.address_args[1]);
        END IF;
    END LOOP;
END
$f$;
"""
    ).format(
        history=history,
        columns=columns,
        named=named,
        record=record,
        rows=rows,
        on_ddl=on_ddl,
        on_drop=on_drop,
        prefix=prefix,
        per_message=per_message,
        settings=sql.SQL(_SETTINGS),
    )


async def install_capture(conn: Connection, schema: str, tables: Sequence[str]) -> None:
    """Install (or replace) the DDL capture in the current transaction, and record the columns of
    ``tables`` (``schema.table``) now, so every Relation has a history row before it. psycopg errors
    propagate (``42501``: not a superuser)."""
    await conn.execute(_install_sql(schema))
    for event, function in (("ddl_command_end", "faucet_cdc_on_ddl"), ("sql_drop", "faucet_cdc_on_drop")):
        name = sql.Identifier(f"{_trigger_name(schema)}_{event}"[:63])
        await conn.execute(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(name))
        await conn.execute(
            sql.SQL("CREATE EVENT TRIGGER {} ON {} EXECUTE FUNCTION {}()").format(
                name, sql.SQL(event), sql.Identifier(schema, function)
            )
        )
    record = sql.Identifier(schema, "faucet_cdc_record")
    for table in tables:
        await conn.execute(
            sql.SQL("SELECT {}(to_regclass(%s)::oid, 'columns', %s, NULL, 'faucet cdc setup')").format(
                record
            ),
            (table, table),
        )


async def check_capture(conn: Connection, schema: str, where: str) -> None:
    """Raise :class:`ConfigError` unless the DDL capture is installed and enabled in the source."""
    names = [f"{_trigger_name(schema)}_{event}"[:63] for event in ("ddl_command_end", "sql_drop")]
    cursor = await conn.execute(
        "SELECT count(*) FROM pg_event_trigger WHERE evtname = ANY(%s) AND evtenabled <> 'D'", (names,)
    )
    row = await cursor.fetchone()
    if row is None or row[0] != len(names):
        raise ConfigError(
            "the source database has no DDL capture (its event triggers are missing or disabled): run "
            "setup_replication (faucet cdc setup) again as a superuser; without it a RENAME COLUMN, a "
            "column dropped and added again or a table joining the publication could not be told apart "
            "in the change stream",
            where=where,
        )


@dataclass(frozen=True)
class SourceColumn:
    """A column of a source table as the DDL capture recorded it."""

    attnum: int
    name: str
    type: str
    """``format_type``: the exact type as SQL (``numeric(10,2)``, ``character(5)``, ``integer[]``)."""
    type_oid: int
    typmod: int
    generated: str
    """``s`` for a stored generated column, ``v`` virtual, ``""`` otherwise."""
    expression: str | None
    key: bool
    has_default: bool = False
    missing: str | None = None
    """The value rows older than the column hold (its constant default's text, ``attmissingval``)."""


def parse_columns(raw: Any) -> tuple[SourceColumn, ...]:
    """The columns of a history row or message (``None``: none recorded)."""
    if raw is None:
        return ()
    items = json.loads(raw) if isinstance(raw, str) else raw
    return tuple(
        SourceColumn(
            int(item["attnum"]),
            str(item["name"]),
            str(item["type"]),
            int(item["type_oid"]),
            int(item["typmod"]),
            str(item.get("generated") or ""),
            item.get("expression"),
            bool(item.get("key")),
            bool(item.get("has_default")),
            item.get("missing"),
        )
        for item in items
    )


@dataclass(frozen=True)
class TableHistory:
    """What the history says of one table for a transaction: its columns then, and the statement that
    made them (``""`` for the columns recorded at setup)."""

    columns: tuple[SourceColumn, ...]
    statement: str


async def columns_at(conn: Connection, schema: str, relid: int, commit_lsn: int) -> TableHistory | None:
    """The table's columns for a transaction committing at ``commit_lsn`` (None: no history row
    before it). psycopg errors propagate."""
    cursor = await conn.execute(
        sql.SQL(
            "SELECT columns, statement FROM {} WHERE relid = %s AND event IN ('columns', 'publication_add') "
            "AND at_lsn < %s::pg_lsn ORDER BY id DESC LIMIT 1"
        ).format(sql.Identifier(schema, HISTORY_TABLE)),
        (relid, f"{commit_lsn >> 32:X}/{commit_lsn & 0xFFFFFFFF:X}"),
    )
    row = await cursor.fetchone()
    if row is None:
        return None
    return TableHistory(parse_columns(row[0]), str(row[1]))


async def publication_added_after(
    conn: Connection, schema: str, table: str, publication: str, *, lsn: int | None = None, event: int = 0
) -> bool:
    """Whether ``table`` joined ``publication`` (again) after the point ``lsn`` of the stream, or after
    the history row ``event`` (its rows then come with it)."""
    after = sql.SQL("at_lsn > %s::pg_lsn") if lsn is not None else sql.SQL("id > %s")
    point = event if lsn is None else f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
    cursor = await conn.execute(
        sql.SQL(
            "SELECT 1 FROM {} WHERE event = 'publication_add' AND table_name = %s AND publication = %s "
            "AND {} LIMIT 1"
        ).format(sql.Identifier(schema, HISTORY_TABLE), after),
        (table, publication, point),
    )
    return await cursor.fetchone() is not None


@dataclass(frozen=True)
class DdlMessage:
    """One logical message of the DDL capture."""

    event: str
    """``publication_add``, ``rows``, ``publication_drop`` or ``drop_table``."""
    id: int
    """The history row it was written with (0 for rows)."""
    relid: int
    table: str
    publication: str | None
    statement: str
    columns: tuple[SourceColumn, ...]
    rows: tuple[tuple[str | None, ...], ...]


def parse_message(content: bytes, where: str) -> DdlMessage:
    """Decode a :data:`DDL_PREFIX` message; anything malformed is an IntegrityError (never skipped)."""
    try:
        raw: Mapping[str, Any] = json.loads(content)
        return DdlMessage(
            str(raw["event"]),
            int(raw.get("id") or 0),
            int(raw.get("relid") or 0),
            str(raw["table"]),
            None if raw.get("publication") is None else str(raw["publication"]),
            str(raw.get("statement") or ""),
            parse_columns(raw.get("columns")),
            tuple(tuple(row) for row in raw.get("rows") or ()),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"a DDL capture message is malformed: {exc}", where=where) from exc


__all__ = [
    "DDL_PREFIX",
    "HISTORY_TABLE",
    "DdlMessage",
    "SourceColumn",
    "TableHistory",
    "check_capture",
    "columns_at",
    "install_capture",
    "parse_columns",
    "parse_message",
    "publication_added_after",
]
