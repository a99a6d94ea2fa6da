"""The server side of the change source: connections, what the server and slot look like, and checks.

Shared by the session (:mod:`.cdc_slot`, :mod:`.cdc_session`, :mod:`.cdc_snapshot`) and the setup
(:mod:`.cdc_setup`).
"""

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import make_conninfo

from faucet_dagster.protocol import CancelToken, ConfigError
from faucet_postgres.cdc_config import MARKER_TABLE, PostgresCdcConfig
from faucet_postgres.codecs import PostgresLsnCodec
from faucet_postgres.common import connect, pg_error

SOURCE = "postgres"
"""The ``source`` of this connector's ordering domains."""

MIN_SERVER_VERSION = 150000
"""PostgreSQL 15: publication column lists and row filters, which the snapshot honours."""

CODEC = PostgresLsnCodec()
_T = TypeVar("_T")

Connection = psycopg.AsyncConnection[tuple[Any, ...]]


@dataclass(frozen=True)
class SlotFacts:
    """What one round trip tells about the server, the slot and its incarnation marker."""

    server_version: int
    wal_level: str
    encoding: str
    system_identifier: str
    flush_lsn: int
    has_publication: bool
    has_markers: bool
    slot_type: str | None
    plugin: str | None
    slot_database: str | None
    database: str
    wal_status: str | None


async def slot_facts(conn: Connection, config: PostgresCdcConfig) -> SlotFacts:
    try:
        cursor = await conn.execute(
            "SELECT current_setting('server_version_num')::int, current_setting('wal_level'), "
            "current_setting('server_encoding'), (SELECT system_identifier::text FROM pg_control_system()), "
            "pg_current_wal_flush_lsn()::text, "
            "EXISTS (SELECT 1 FROM pg_publication WHERE pubname = %s), "
            "to_regclass(format('%%I.%%I', %s::text, %s::text)) IS NOT NULL, "
            "s.slot_type, s.plugin::text, s.database::text, current_database()::text, s.wal_status "
            "FROM (SELECT 1) AS one LEFT JOIN pg_replication_slots AS s ON s.slot_name = %s",
            (config.publication, config.metadata_schema, MARKER_TABLE, config.slot),
        )
        row = await cursor.fetchone()
    except psycopg.Error as exc:
        raise pg_error(exc, doing="reading the server and slot state", where=slot_where(config)) from exc
    assert row is not None  # one row by construction
    return SlotFacts(
        server_version=row[0],
        wal_level=row[1],
        encoding=row[2],
        system_identifier=row[3],
        flush_lsn=CODEC.validate(row[4]),
        has_publication=row[5],
        has_markers=row[6],
        slot_type=row[7],
        plugin=row[8],
        slot_database=row[9],
        database=row[10],
        wal_status=row[11],
    )


def check_server(facts: SlotFacts, where: str, *, publication: bool = True) -> None:
    """ConfigError unless the server can run logical replication for this connector."""
    if facts.server_version < MIN_SERVER_VERSION:
        raise ConfigError(f"PostgreSQL {facts.server_version} is too old: 15 or later is needed", where=where)
    if facts.wal_level != "logical":
        raise ConfigError(
            f"wal_level is {facts.wal_level!r}: logical replication needs wal_level = logical "
            "(set it in postgresql.conf and restart the server)",
            where=where,
        )
    if facts.encoding.upper() != "UTF8":
        raise ConfigError(f"the database encoding is {facts.encoding}; UTF8 is needed", where=where)
    if publication and not facts.has_publication:
        raise ConfigError("the publication does not exist; create it with setup_replication", where=where)


def check_slot(facts: SlotFacts, where: str) -> None:
    """ConfigError unless the existing slot is a logical pgoutput slot of this database."""
    if facts.slot_type != "logical" or facts.plugin != "pgoutput" or facts.slot_database != facts.database:
        raise ConfigError(
            f"the slot is a {facts.slot_type} slot of plugin {facts.plugin} on database "
            f"{facts.slot_database}; a logical pgoutput slot on {facts.database} is needed",
            where=where,
        )


async def connect_cdc(config: PostgresCdcConfig, *, replication: bool = False) -> Connection:
    """A session connection (:func:`faucet_postgres.common.connect`'s settings, which fix the texts
    :mod:`.pgoutput` parses, and no timeout that could end it while a slow sink blocks a read), or a
    replication connection (``replication=database``) for exporting a snapshot."""
    where = slot_where(config)
    if not replication:
        conn = await connect(config, autocommit=True)
        try:
            await conn.execute("SET statement_timeout = 0; SET idle_in_transaction_session_timeout = 0")
        except psycopg.Error as exc:
            await conn.close()
            raise pg_error(exc, where=where, doing="setting up the session") from exc
        return conn
    try:
        return await psycopg.AsyncConnection.connect(
            make_conninfo(config.conninfo(), replication="database"), autocommit=True
        )
    except psycopg.Error as exc:
        raise pg_error(exc, where=where, doing="opening a replication connection") from exc


def slot_where(config: PostgresCdcConfig) -> str:
    return f"slot {config.slot} on {config.safe_url()}"


async def unkeyed_tables(conn: Connection, tables: Sequence[str]) -> list[str]:
    """The tables of ``tables`` (``schema.table``) whose rows have no replica identity: no primary key
    under the default identity, a ``DEFERRABLE`` primary key (PostgreSQL cannot use a non-immediate
    index as the identity), an identity index that is gone, or ``REPLICA IDENTITY NOTHING``.

    Published, their UPDATE and DELETE fail at the source ("does not have a replica identity and
    publishes updates") and their changes carry no key to apply by. psycopg errors propagate.
    """
    cursor = await conn.execute(
        "SELECT n.nspname || '.' || c.relname FROM pg_class AS c "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname || '.' || c.relname = ANY(%s) AND (c.relreplident = 'n' "
        "OR (c.relreplident = 'd' AND NOT EXISTS (SELECT 1 FROM pg_index AS i "
        "WHERE i.indrelid = c.oid AND i.indisprimary AND i.indimmediate)) "
        "OR (c.relreplident = 'i' AND NOT EXISTS (SELECT 1 FROM pg_index AS i "
        "WHERE i.indrelid = c.oid AND i.indisreplident AND i.indimmediate))) ORDER BY 1",
        (list(tables),),
    )
    return [row[0] for row in await cursor.fetchall()]


def unkeyed_error(tables: Sequence[str], where: str) -> ConfigError:
    """The error naming tables without a replica identity and the ways out."""
    return ConfigError(
        f"table(s) {', '.join(tables)} have no replica identity (no primary key, a DEFERRABLE primary "
        "key, which PostgreSQL cannot use as one, or REPLICA IDENTITY NOTHING): published, the "
        "application's own UPDATE and DELETE on them fail, and their changes have no key to apply by. "
        "Add a primary key, or set REPLICA IDENTITY FULL on them (faucet cdc setup "
        "--replica-identity-full does; rows are then replicated as a multiset, identical rows included)",
        where=where,
    )


class Interrupted(Exception):
    """The cancel token fired while a server call was in flight."""


async def interruptible(conn: Connection, operation: Awaitable[_T], cancel: CancelToken) -> _T:
    """Await a server call on ``conn``; if ``cancel`` fires first, cancel it on the server, raise
    :class:`Interrupted`."""
    task = asyncio.ensure_future(operation)
    waiter = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    await conn.cancel_safe()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # the cancelled query's error; the session is detached by the caller
    raise Interrupted
