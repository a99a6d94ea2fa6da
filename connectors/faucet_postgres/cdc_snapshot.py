"""The snapshot of the change source: every selected table read at one exported snapshot, as inserts
of one source transaction just before the snapshot's consistent point (see :mod:`faucet_postgres.cdc`).
"""

from collections.abc import Awaitable, Callable, Sequence

import psycopg
from psycopg import sql
from psycopg.types.string import TextLoader

from faucet_dagster.protocol import CancelToken, IntegrityError
from faucet_postgres import pgoutput as pg
from faucet_postgres.cdc_config import PostgresCdcConfig, qualified_name
from faucet_postgres.cdc_rows import INSERT, Table, TransactionWriter
from faucet_postgres.cdc_server import CODEC, Connection, connect_cdc, interruptible
from faucet_postgres.cdc_slot import Published
from faucet_postgres.common import pg_error

Remember = Callable[[pg.Relation, TransactionWriter], Awaitable[Table]]
"""The session's relation cache: the :class:`Table` of a relation (rows of an older one written first)."""


async def read_snapshot(
    conn: Connection,
    config: PostgresCdcConfig,
    temp_slot: str,
    tables: Sequence[Published],
    writer: TransactionWriter,
    remember: Remember,
    cancel: CancelToken,
    where: str,
) -> int:
    """Write every table of ``tables`` at one exported snapshot into ``writer``, as one transaction
    begun here at ``P - 1`` and left open; return the snapshot's consistent point ``P``."""
    export = await connect_cdc(config, replication=True)
    try:
        try:
            cursor = export.cursor()
            await cursor.execute(
                sql.SQL("CREATE_REPLICATION_SLOT {} TEMPORARY LOGICAL pgoutput EXPORT_SNAPSHOT").format(
                    sql.Identifier(f"{temp_slot}_x")
                )
            )
            created = await cursor.fetchone()
        except psycopg.Error as exc:
            raise pg_error(exc, doing="exporting a snapshot", where=where) from exc
        if created is None:
            raise IntegrityError("CREATE_REPLICATION_SLOT returned nothing", where=where)
        point = CODEC.validate(created[1])
        try:
            async with conn.transaction():
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                await conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(created[2])))
                await export.close()  # the imported snapshot stays valid in this transaction
                writer.begin(f"snapshot/{CODEC.canonicalize(point)}", point - 1)
                for published in tables:
                    await _snapshot_table(conn, published, writer, remember, config.batch_rows, cancel)
        except psycopg.Error as exc:
            raise pg_error(exc, doing="reading the snapshot", where=where) from exc
    finally:
        await export.close()
    return point


async def _snapshot_table(
    conn: Connection,
    published: Published,
    writer: TransactionWriter,
    remember: Remember,
    batch_rows: int,
    cancel: CancelToken,
) -> None:
    relation = await catalog_relation(conn, published)
    table = await remember(relation, writer)
    schema, name = qualified_name(published.name)
    query = sql.SQL("SELECT {columns} FROM {only}{table}{where}").format(
        columns=sql.SQL(", ").join(sql.Identifier(column.name) for column in relation.columns),
        only=sql.SQL("" if published.partitioned else "ONLY "),
        table=sql.Identifier(schema, name),
        where=sql.SQL(f" WHERE {published.row_filter}" if published.row_filter else ""),
    )
    cursor = conn.cursor("faucet_cdc_snapshot")
    for column in relation.columns:
        # The output function's text, as pgoutput sends it: one parser for snapshot and changes.
        cursor.adapters.register_loader(column.type_oid, TextLoader)
    await cursor.execute(query)
    while rows := await interruptible(conn, cursor.fetchmany(batch_rows), cancel):
        for row in rows:
            if writer.add(table, row, INSERT, None):
                await writer.flush()
    await cursor.close()


async def catalog_relation(conn: Connection, published: Published) -> pg.Relation:
    """The Relation message pgoutput would send for ``published``, built from the catalog."""
    cursor = await conn.execute(
        "SELECT a.attname::text, a.atttypid::int8, a.atttypmod, "
        "c.relreplident = 'f' OR coalesce(a.attnum = ANY(i.indkey::int2[]), false), c.relreplident::text "
        "FROM pg_attribute AS a JOIN pg_class AS c ON c.oid = a.attrelid "
        "LEFT JOIN pg_index AS i ON i.indrelid = c.oid AND ((c.relreplident = 'd' AND i.indisprimary) "
        "OR (c.relreplident = 'i' AND i.indisreplident)) "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY(%s::name[]) "
        "ORDER BY a.attnum",
        (published.oid, list(published.columns)),
    )
    rows = await cursor.fetchall()
    schema, name = qualified_name(published.name)
    identity = rows[0][4] if rows else "d"
    return pg.Relation(
        published.oid,
        schema,
        name,
        identity,
        tuple(pg.Column(row[0], row[1], row[2], row[3]) for row in rows),
    )
