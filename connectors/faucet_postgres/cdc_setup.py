"""Setting up replication: the publication, the slot and its incarnation marker (``faucet cdc setup``)."""

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from faucet_dagster.protocol import ConfigError
from faucet_postgres.cdc_config import MARKER_TABLE, PostgresCdcConfig, qualified_name
from faucet_postgres.cdc_ddl import install_capture
from faucet_postgres.cdc_server import (
    CODEC,
    Connection,
    check_server,
    check_slot,
    connect_cdc,
    slot_facts,
    slot_where,
    unkeyed_error,
    unkeyed_tables,
)
from faucet_postgres.common import pg_error


@dataclass(frozen=True)
class ReplicationSetup:
    """What :func:`setup_replication` found or made."""

    slot: str
    publication: str
    tables: tuple[str, ...]
    incarnation: str
    created_lsn: str
    slot_created: bool
    publication_created: bool


async def setup_replication(config: PostgresCdcConfig, tables: Sequence[str] = ()) -> ReplicationSetup:
    """Create (or complete) the publication, the incarnation marker and the slot of ``config``, and
    install the DDL capture (:mod:`faucet_postgres.cdc_ddl`; needs a superuser).

    Idempotent: an existing publication gets the tables it lacks (none is removed); an existing slot
    is kept, and given a marker if it has none (its current position becomes its beginning). A new
    slot gets a new marker, so positions certified on a dropped slot of the same name fail with
    :class:`IncarnationChanged`. ``tables`` (``schema.table``) default to ``config.tables``. Raises
    :class:`ConfigError` when ``wal_level`` is not ``logical``, a table does not exist, a table has no
    replica identity (no primary key; unless ``config.replica_identity_full``, which sets REPLICA
    IDENTITY FULL on such tables), or the slot exists with another plugin or database;
    :class:`AuthError` without the needed privileges. Nothing is changed when it raises.
    """
    wanted = tuple(tables) or config.tables
    for table in wanted:
        try:
            qualified_name(table)
        except ValueError as exc:
            raise ConfigError(str(exc), where=f"publication {config.publication}") from None
    where = slot_where(config)
    conn = await connect_cdc(config)
    try:
        facts = await slot_facts(conn, config)
        check_server(facts, where, publication=False)
        if facts.slot_type is not None:
            check_slot(facts, where)
        if not wanted and not facts.has_publication:
            raise ConfigError("name the tables of the new publication", where=where)
        try:
            publication_created = await _ensure_publication(conn, config, wanted, facts.has_publication)
            marker_table = sql.Identifier(config.metadata_schema, MARKER_TABLE)
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (slot_name text PRIMARY KEY, incarnation uuid NOT NULL, "
                    "created_lsn pg_lsn NOT NULL, publication text NOT NULL, "
                    "created_at timestamptz NOT NULL DEFAULT now())"
                ).format(marker_table)
            )
            # The tables a stream of the slot selected up to its certified position (see cdc_slot).
            await conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS selected_relids oid[]").format(marker_table)
            )
            cursor = await conn.execute(
                sql.SQL("SELECT incarnation::text, created_lsn::text FROM {} WHERE slot_name = %s").format(
                    marker_table
                ),
                (config.slot,),
            )
            marker = await cursor.fetchone()
            slot_created = facts.slot_type is None
            if slot_created:
                cursor = await conn.execute(
                    "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (config.slot,)
                )
                created = await cursor.fetchone()
                assert created is not None  # the function returns one row
                marker = None  # a new slot is a new incarnation
                created_lsn = created[0]
            else:
                cursor = await conn.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                    (config.slot,),
                )
                current = await cursor.fetchone()
                if current is None or current[0] is None:
                    raise ConfigError("the slot disappeared during the setup", where=where)
                created_lsn = current[0] if marker is None else marker[1]
            if marker is None:
                incarnation = str(uuid.uuid4())
                await conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (slot_name, incarnation, created_lsn, publication) "
                        "VALUES (%s, %s, %s::pg_lsn, %s) ON CONFLICT (slot_name) DO UPDATE SET "
                        "incarnation = EXCLUDED.incarnation, created_lsn = EXCLUDED.created_lsn, "
                        "publication = EXCLUDED.publication, created_at = now()"
                    ).format(marker_table),
                    (config.slot, incarnation, created_lsn, config.publication),
                )
            else:
                incarnation = marker[0]
            cursor = await conn.execute(
                "SELECT schemaname || '.' || tablename FROM pg_publication_tables "
                "WHERE pubname = %s ORDER BY 1",
                (config.publication,),
            )
            published = tuple(row[0] for row in await cursor.fetchall())
        except psycopg.Error as exc:
            raise pg_error(exc, doing="setting up replication", where=where) from exc
    finally:
        await conn.close()
    return ReplicationSetup(
        slot=config.slot,
        publication=config.publication,
        tables=published,
        incarnation=f"{facts.system_identifier}:{config.slot}:{incarnation}",
        created_lsn=CODEC.canonicalize(CODEC.validate(created_lsn)),
        slot_created=slot_created,
        publication_created=publication_created,
    )


async def _ensure_publication(
    conn: Connection, config: PostgresCdcConfig, tables: Sequence[str], exists: bool
) -> bool:
    """Create the publication for ``tables``, or add the ones it lacks; True when it was created. The
    DDL capture is installed first (once the tables are checked), so a table added to a running
    stream's publication arrives with its rows."""
    if not tables:
        await install_capture(conn, config.metadata_schema, ())
        return False
    where = f"publication {config.publication}"
    cursor = await conn.execute(
        "SELECT n.nspname || '.' || c.relname FROM pg_class AS c "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p') AND n.nspname || '.' || c.relname = ANY(%s)",
        (list(tables),),
    )
    found = {row[0] for row in await cursor.fetchall()}
    missing = [table for table in tables if table not in found]
    if missing:
        raise ConfigError(f"table(s) {', '.join(missing)} do not exist", where=where)
    unkeyed = await unkeyed_tables(conn, tables)
    if unkeyed and not config.replica_identity_full:
        raise unkeyed_error(unkeyed, where)
    await install_capture(conn, config.metadata_schema, tables)
    for table in unkeyed:
        # Asked for: FULL makes the application's UPDATE and DELETE work and logs whole old rows.
        await conn.execute(
            sql.SQL("ALTER TABLE {} REPLICA IDENTITY FULL").format(sql.Identifier(*qualified_name(table)))
        )
    identifiers = [sql.Identifier(*qualified_name(table)) for table in tables]
    name = sql.Identifier(config.publication)
    if not exists:
        await conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(name, sql.SQL(", ").join(identifiers))
        )
        return True
    cursor = await conn.execute(
        "SELECT puballtables, ARRAY(SELECT schemaname || '.' || tablename FROM pg_publication_tables "
        "WHERE pubname = %s) FROM pg_publication WHERE pubname = %s",
        (config.publication, config.publication),
    )
    row = await cursor.fetchone()
    assert row is not None  # the publication exists
    absent = [
        identifier for table, identifier in zip(tables, identifiers, strict=True) if table not in row[1]
    ]
    if absent and not row[0]:
        await conn.execute(
            sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(name, sql.SQL(", ").join(absent))
        )
    return False
