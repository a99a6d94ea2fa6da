"""PostgreSQL change data capture of an OLTP workload: many small transactions over two tables.

The shape of a real application database: ``--rows / 4`` transactions (50,000 at the default) of one to
five change rows over an ``orders`` table and its ``lines``: a new order with up to four lines (half
the transactions), an order's status update, a line's quantity update, a line's deletion. Generated
once per round, server-side and from a fixed seed, after the round's slot was created (a slot made in
round 1 would have round 5 decode everything the scenarios of rounds 1 to 4 wrote); neither scenario
consumes the slot (each replicates from a copy of it into replicas of its own in the run's second
database, out of the source database's decoding, compared with the source at the end, table by table).

``cdc.raw_oltp_apply`` is the floor of a hand-written replicator: ``pg_logical_slot_peek_binary_changes``
through a server-side cursor, every message decoded by :func:`faucet_postgres.pgoutput.decode`, and at
the first transaction end after each 50,000 change rows, per table, the batch reduced to the last
change per key, COPYed into temporary tables, applied by ``INSERT ... ON CONFLICT DO UPDATE`` and
``DELETE ... USING``, and committed.
``cdc.oltp_apply_changes`` is the product: the continuous runner (lease, begin, read through the
pipeline, seal, the sink's APPLY_CHANGES commit, certificate, slot acknowledgement) with epochs of
50,000 change rows, timed from the first lease to the last acknowledgement
(:func:`bench.replication.replicate`: reads with ``idle=0``, and why).
"""

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from faucet_postgres import pgoutput
from faucet_postgres.cdc import setup_replication
from faucet_postgres.cdc_config import PostgresCdcConfig
from psycopg import sql

from bench.context import BenchContext
from bench.registry import Measurement, scenario
from bench.replication import EPOCH_ROWS, copied_slot, drop_slot, peek, replicate
from bench.streams import seconds_per_step

FETCH_ROWS = 5_000

# The two tables and their columns; the first column is the key.
COLUMNS = {
    "orders": ("order_id bigint PRIMARY KEY", "customer int", "status text", "total bigint"),
    "lines": ("line_id bigint PRIMARY KEY", "order_id bigint", "sku text", "qty int"),
}

WORKLOAD = """
DO $$
DECLARE
    r float8;
    k int;
    next_line bigint := 0;
BEGIN
    PERFORM setseed(0.42);
    FOR i IN 0..{last} LOOP
        r := random();
        IF r < 0.5 OR i < 10 THEN
            INSERT INTO {orders} VALUES (i, (i * 7) % 1000, 'new', 0);
            k := floor(random() * 5)::int;
            FOR j IN 1..k LOOP
                INSERT INTO {lines} VALUES (next_line, i, 'sku-' || (next_line % 100), 1);
                next_line := next_line + 1;
            END LOOP;
        ELSIF r < 0.8 THEN
            UPDATE {orders} SET status = 'paid', total = total + 1
            WHERE order_id = floor(random() * i)::bigint;
        ELSIF r < 0.9 THEN
            UPDATE {lines} SET qty = qty + 1 WHERE line_id = floor(random() * greatest(next_line, 1))::bigint;
        ELSE
            DELETE FROM {lines} WHERE line_id = floor(random() * greatest(next_line, 1))::bigint;
        END IF;
        COMMIT;
    END LOOP;
END $$
"""


@dataclass(frozen=True)
class _Workload:
    config: PostgresCdcConfig
    tables: dict[str, str]
    """Short name (``orders``, ``lines``) -> the source table's name."""
    changes: int
    transactions: int


def _workload(ctx: BenchContext) -> _Workload:
    """The slot, publication and tables, and the workload committed after the slot (once per round)."""

    def prepare() -> _Workload:
        slot = ctx.unique("oltp_slot")
        tables = {name: ctx.unique(f"oltp_{name}") for name in COLUMNS}
        config = PostgresCdcConfig(
            url=ctx.postgres_url,
            slot=slot,
            publication=f"{slot}_pub",
            tables=tuple(f"public.{table}" for table in tables.values()),
            heartbeat_interval=0,
        )
        with psycopg.connect(ctx.postgres_url, autocommit=True) as conn:
            for name, table in tables.items():
                conn.execute(
                    sql.SQL("CREATE TABLE {} ({})").format(
                        sql.Identifier(table), sql.SQL(", ".join(COLUMNS[name]))
                    )
                )
        asyncio.run(setup_replication(config))
        transactions = max(10, ctx.rows // 4)
        with psycopg.connect(ctx.postgres_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL(WORKLOAD.replace("{last}", str(transactions - 1))).format(
                    orders=sql.Identifier(tables["orders"]), lines=sql.Identifier(tables["lines"])
                )
            )
        changes = asyncio.run(_count_changes(ctx, config))
        return _Workload(config, tables, changes, transactions)

    return ctx.per_round("cdc_oltp", prepare, lambda earlier: drop_slot(ctx, earlier.config.slot))


async def _count_changes(ctx: BenchContext, config: PostgresCdcConfig) -> int:
    changes = 0
    async with await psycopg.AsyncConnection.connect(ctx.postgres_url) as conn:
        cursor = await peek(conn, config)
        while batch := await cursor.fetchmany(FETCH_ROWS):
            for (data,) in batch:
                if isinstance(pgoutput.decode(data), pgoutput.Insert | pgoutput.Update | pgoutput.Delete):
                    changes += 1
    return changes


def _replicas(ctx: BenchContext) -> dict[str, str]:
    """New, empty replica tables in the replica database (short name -> replica name), not timed."""
    replicas = {name: ctx.unique(f"oltp_{name}_replica") for name in COLUMNS}
    with psycopg.connect(ctx.replica_url, autocommit=True) as conn:
        for name, table in replicas.items():
            conn.execute(
                sql.SQL("CREATE TABLE {} ({})").format(
                    sql.Identifier(table), sql.SQL(", ".join(COLUMNS[name]))
                )
            )
    return replicas


def _check_replicas(ctx: BenchContext, workload: _Workload, replicas: dict[str, str]) -> None:
    """Each replica holds exactly its source table's rows (an ordered digest of every row)."""
    digest = sql.SQL(
        "SELECT count(*), md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM {} t"
    )
    with psycopg.connect(ctx.postgres_url) as primary, psycopg.connect(ctx.replica_url) as replica:
        for name, source in workload.tables.items():
            want = primary.execute(digest.format(sql.Identifier(source))).fetchone()
            got = replica.execute(digest.format(sql.Identifier(replicas[name]))).fetchone()
            if want != got:
                raise RuntimeError(f"replica of {name} differs from its source: {got} != {want}")


@scenario("cdc.raw_oltp_apply")
def raw_oltp_apply(ctx: BenchContext) -> Measurement:
    """Peek, decode small transactions; per 50,000 changes and table: last change per key, COPY, apply."""
    workload, replicas = _workload(ctx), _replicas(ctx)

    async def apply(
        writer: psycopg.AsyncConnection[Any],
        relations: dict[int, pgoutput.Relation],
        pending: dict[int, dict[str, tuple[str, tuple[str | None, ...]]]],
    ) -> None:
        async with writer.transaction():
            for oid, changes in pending.items():
                relation = relations[oid]
                short = next(name for name, table in workload.tables.items() if table == relation.name)
                target = sql.Identifier(replicas[short])
                names = [column.name for column in relation.columns]
                key = names[0]
                upserts = [values for op, values in changes.values() if op != "delete"]
                deletes = [(k,) for k, (op, _) in changes.items() if op == "delete"]
                await writer.execute(
                    sql.SQL("CREATE TEMP TABLE up ON COMMIT DROP AS SELECT * FROM {} WITH NO DATA").format(
                        target
                    )
                )
                await writer.execute(
                    sql.SQL("CREATE TEMP TABLE del ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                        sql.Identifier(key), target
                    )
                )
                async with writer.cursor() as cursor:
                    async with cursor.copy("COPY up FROM STDIN") as copy:
                        for row in upserts:
                            await copy.write_row(row)
                    async with cursor.copy("COPY del FROM STDIN") as copy:
                        for row in deletes:
                            await copy.write_row(row)
                await writer.execute(
                    sql.SQL("DELETE FROM {} t USING del WHERE t.{} = del.{}").format(
                        target, sql.Identifier(key), sql.Identifier(key)
                    )
                )
                await writer.execute(
                    sql.SQL("INSERT INTO {} SELECT * FROM up ON CONFLICT ({}) DO UPDATE SET {}").format(
                        target,
                        sql.Identifier(key),
                        sql.SQL(", ").join(
                            sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(n), sql.Identifier(n))
                            for n in names[1:]
                        ),
                    )
                )
                await writer.execute("DROP TABLE up, del")

    async def run() -> tuple[int, float]:
        applied = 0
        relations: dict[int, pgoutput.Relation] = {}
        pending: dict[int, dict[str, tuple[str, tuple[str | None, ...]]]] = {}
        count = 0
        async with (
            await psycopg.AsyncConnection.connect(ctx.postgres_url) as reader,
            await psycopg.AsyncConnection.connect(ctx.replica_url) as writer,
        ):
            start = time.perf_counter()
            cursor = await peek(reader, copy)
            while batch := await cursor.fetchmany(FETCH_ROWS):
                for (data,) in batch:
                    message = pgoutput.decode(data)
                    if isinstance(message, pgoutput.Relation):
                        relations[message.oid] = message
                    elif isinstance(message, pgoutput.Insert | pgoutput.Update):
                        values = message.new.values
                        pending.setdefault(message.relation_oid, {})[values[0] or ""] = ("upsert", values)
                        count += 1
                    elif isinstance(message, pgoutput.Delete):
                        old = message.old.values
                        pending.setdefault(message.relation_oid, {})[old[0] or ""] = ("delete", old)
                        count += 1
                    elif isinstance(message, pgoutput.Commit) and count >= EPOCH_ROWS:
                        await apply(writer, relations, pending)
                        applied, count, pending = applied + count, 0, {}
            if pending:
                await apply(writer, relations, pending)
                applied += count
            return applied, time.perf_counter() - start

    with copied_slot(ctx, workload.config, "oltp_copy") as copy:
        applied, seconds = asyncio.run(run())
    if applied != workload.changes:
        raise RuntimeError(f"applied {applied} changes, the workload made {workload.changes}")
    _check_replicas(ctx, workload, replicas)
    return Measurement(applied, seconds, {"transactions": workload.transactions})


@scenario("cdc.oltp_apply_changes", baseline="cdc.raw_oltp_apply")
def oltp_apply_changes(ctx: BenchContext) -> Measurement:
    """The continuous runner, small CDC transactions to PostgreSQL APPLY_CHANGES, epochs of 50,000 changes."""
    workload, replicas = _workload(ctx), _replicas(ctx)
    tables = {f"public.{workload.tables[name]}": replicas[name] for name in COLUMNS}
    seconds, certificates = replicate(ctx, workload.config, tables, workload.changes)
    _check_replicas(ctx, workload, replicas)
    details = {
        "epochs": len(certificates),
        "transactions": workload.transactions,
        "seconds_per_step": seconds_per_step(certificates),
    }
    return Measurement(workload.changes, seconds, details)
