"""The DDL catalogue: every DDL statement PostgreSQL allows on a published table, on a live stream.

One change stream (PostgreSQL to a second PostgreSQL database, APPLY_CHANGES, schema evolution on)
runs through the catalogue, with writes before, between and after the statements. After each group
the replica must equal the source, schema and rows (every column's name and exact type in order, and
every row's text), or the stream must stop with a SchemaError or ConfigError naming the statement and
a remedy; the test then applies the remedy and the replica must equal the source again. Never a
certified divergence. The outcome of every statement is the table in docs/values-and-schemas.md.
"""

import asyncio
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_stream_postgres_cdc import Replication

from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.protocol import (
    ConfigError,
    EpochCertificate,
    FaucetError,
    ReadLimits,
    SchemaError,
    WritePolicy,
)
from faucet_dagster.runner.continuous import StreamRunner
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.testing import PostgresServer

ITEMS = (
    "CREATE TABLE items (id int PRIMARY KEY, qty int, note text, price numeric(10,2), amount numeric, "
    "tags text[], code char(5), doc jsonb, js json, uid uuid, at timestamptz, ts timestamp(3), day date, "
    "span interval, flag boolean, raw bytea, f4 real, f8 double precision, big bigint, small smallint, "
    "t time, tz timetz, vc varchar(20), ip inet, bits bit varying(8))"
)
"""A table of 25 column types, which a replica the sink creates must keep exactly."""

ROW = (
    "({id}, {id}, 'n{id}', {id}.25, 1234567890.123456789, ARRAY['a{id}', 'b'], 'ab', '{{\"k\": {id}}}', "
    "'[1, 2]', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd38{id:04d}', '2024-05-06 07:08:09.123456+02', "
    "'2024-05-06 07:08:09.123', '2024-05-06', '1 day 2 hours', true, '\\x00ff', 0.1, 0.1, 9007199254740993, "
    "-3, '12:34:56.789', '12:34:56+02', 'v{id}', '10.0.0.{id}', B'1010')"
)


def item(id: int) -> str:
    return ROW.format(id=id)


class Catalogue(Replication):
    """A stream whose resources change with the remedies, run by ``run_epochs`` calls."""

    def stream_of(self, tables: Sequence[str], mapping: dict[str, str]) -> FaucetStream:
        resources = tuple(table if "." in table else f"public.{table}" for table in tables)
        source = {**self.source_config(tables), "replica_identity_full": True, "tables": list(resources)}
        sink = {"url": self.target_url, "tables": mapping, "schema_evolution": True}
        return FaucetStream(
            name=self.name,
            source=FaucetEndpoint(FaucetConnection(connector="postgres", config=source)),
            sink=FaucetEndpoint(FaucetConnection(connector="postgres", config=sink)),
            resources=resources,
            policy=WritePolicy.APPLY_CHANGES,
            limits=ReadLimits(records=50_000, idle=0.2),
            lease_seconds=60,
            state_url=self.state_url,
        )

    def catch_up(
        self, tables: Sequence[str], mapping: dict[str, str] | None = None
    ) -> list[EpochCertificate]:
        """Run the stream until it has nothing new; raises what stops it."""
        names = mapping or {f"public.{table}": table for table in tables}
        runner = StreamRunner(self.stream_of(tables, names).build_spec(), self.store, worker_id="w1")

        async def scenario() -> list[EpochCertificate]:
            try:
                return await runner.run_epochs(8.0)
            finally:
                await runner.close()

        return asyncio.run(scenario())

    def stops(self, tables: Sequence[str], error: type[FaucetError], *words: str) -> FaucetError:
        with pytest.raises(error) as stopped:
            self.catch_up(tables)
        for word in words:
            assert word in str(stopped.value), (word, str(stopped.value))
        return stopped.value

    def schema_of(self, table: str, url: str) -> list[tuple[str, str, str]]:
        return [
            (str(name), str(kind), str(generated))
            for name, kind, generated in self.execute(
                "SELECT attname, format_type(atttypid, atttypmod), attgenerated FROM pg_attribute "
                f"WHERE attrelid = '{table}'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                url=url,
            )
        ]

    def table_rows(self, table: str, url: str) -> list[str]:
        return [str(row[0]) for row in self.execute(f"SELECT t::text FROM {table} AS t ORDER BY 1", url=url)]

    def assert_exact(self, source: str, replica: str | None = None) -> None:
        """The replica's table equals the source's: columns (names, exact types, generated) and rows."""
        replica = replica or source
        replica_schema = self.schema_of(replica, self.target_url)
        source_schema = self.schema_of(source, self.source_url)
        assert replica_schema == source_schema, (
            f"{replica}: schema {replica_schema} differs from the source's {source} {source_schema}"
        )
        assert self.table_rows(replica, self.target_url) == self.table_rows(source, self.source_url), (
            f"{replica}: rows differ from the source's {source}"
        )


@pytest.fixture
def catalogue(
    postgres_url: str, postgres_server: PostgresServer, unique_name: Callable[..., str], tmp_path: Path
) -> Iterator[Catalogue]:
    replica = unique_name("replica")
    created = Catalogue(postgres_url, postgres_server.create_database(replica), unique_name("cdc"), tmp_path)
    yield created
    created.store.close()
    postgres_server.drop_database(replica)


def setup(catalogue: Catalogue, tables: Sequence[str]) -> dict[str, Any]:
    config = {**catalogue.source_config(tables), "replica_identity_full": True}
    return dict(FaucetConnection(connector="postgres", config=config).setup_replication())


def test_every_ddl_statement_on_a_published_table_is_followed_exactly_or_stops_naming_it(
    catalogue: Catalogue,
) -> None:
    c = catalogue
    tables = ["items", "pairs", "bag"]
    c.execute(
        ITEMS,
        "CREATE TABLE pairs (id int PRIMARY KEY DEFERRABLE INITIALLY DEFERRED, v text)",
        "CREATE TABLE bag (a int, b text)",
        "CREATE TABLE plain_deferred (id int PRIMARY KEY DEFERRABLE, v text)",
    )
    # A DEFERRABLE primary key cannot be the replica identity: refused by name without FULL, whose
    # setup sets FULL (the application's own UPDATE and DELETE then work).
    plain = {**c.source_config(["plain_deferred"]), "slot": f"{c.slot}_x", "publication": f"{c.slot}_x_pub"}
    with pytest.raises(ConfigError, match=r"plain_deferred.*DEFERRABLE"):
        FaucetConnection(connector="postgres", config=plain).setup_replication()
    assert setup(c, tables)["slot_created"]
    c.execute("UPDATE pairs SET v = 'x' WHERE false")  # FULL: the application's UPDATE works

    # -- writes, and a replica created with the source's 25 exact types ----------------------------
    c.execute(
        "INSERT INTO items VALUES " + ", ".join(item(i) for i in range(1, 9)),
        "INSERT INTO pairs SELECT g, 'p' || g FROM generate_series(1, 5) g",
        "INSERT INTO bag VALUES (1, 'x'), (1, 'x'), (2, 'y')",
    )
    c.execute("UPDATE items SET qty = 0 WHERE id = 2", "DELETE FROM items WHERE id = 3")
    assert c.catch_up(tables)
    for table in tables:
        c.assert_exact(table)

    # -- columns added, defaults set and dropped, renamed, dropped, added again ---------------------
    c.execute("ALTER TABLE items ADD COLUMN extra1 text")
    c.execute("INSERT INTO items (id, qty, extra1) VALUES (20, 20, 'e20')")
    c.execute("ALTER TABLE items ADD COLUMN prio int DEFAULT 7")
    c.execute("UPDATE items SET prio = 1 WHERE id = 4")
    c.execute("ALTER TABLE items ALTER COLUMN note SET DEFAULT 'n/a'", "INSERT INTO items (id) VALUES (21)")
    c.execute("ALTER TABLE items ALTER COLUMN prio SET DEFAULT (random() * 10)::int")
    c.execute("ALTER TABLE items ALTER COLUMN note DROP DEFAULT", "INSERT INTO items (id) VALUES (22)")
    c.execute("ALTER TABLE items RENAME COLUMN note TO memo")
    c.execute(
        "UPDATE items SET memo = 'renamed' WHERE id = 5", "INSERT INTO items (id, memo) VALUES (23, 'm')"
    )
    c.execute("ALTER TABLE items DROP COLUMN extra1")
    c.execute("INSERT INTO items (id) VALUES (24)")
    c.execute("ALTER TABLE items DROP COLUMN memo, ADD COLUMN memo text DEFAULT 'fresh'")
    c.execute("UPDATE items SET memo = 'later' WHERE id = 6")
    c.execute("UPDATE items SET qty = 1 WHERE qty IS NULL", "ALTER TABLE items ALTER COLUMN qty SET NOT NULL")
    c.execute("ALTER TABLE items ALTER COLUMN qty DROP NOT NULL")
    c.execute(
        "ALTER TABLE items ADD CONSTRAINT qty_positive CHECK (qty >= 0)",
        "CREATE INDEX items_qty ON items (qty)",
    )
    c.execute("ALTER TABLE items DROP CONSTRAINT qty_positive", "DROP INDEX items_qty")
    c.execute("INSERT INTO items (id, qty) VALUES (25, 25)")
    assert c.catch_up(tables)
    c.assert_exact("items")

    # -- a volatile default: the values the rewrite gave are not in the stream ---------------------
    c.execute("ALTER TABLE items ADD COLUMN stamp float8 DEFAULT random()")
    c.execute("INSERT INTO items (id) VALUES (26)")
    c.stops(tables, SchemaError, "stamp", "yourself with the source's values")
    stamps = c.execute("SELECT id, stamp FROM items WHERE id <> 26")
    c.execute(
        "ALTER TABLE items ADD COLUMN stamp float8",
        *(f"UPDATE items SET stamp = {stamp!r} WHERE id = {key}" for key, stamp in stamps),
        url=c.target_url,
    )
    assert c.catch_up(tables)
    c.assert_exact("items")

    # -- a type changed at the source: the rows it rewrote are not in the stream ------------------
    c.execute("ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty * 10")
    c.execute("UPDATE items SET qty = 99999999999 WHERE id = 4")
    c.stops(
        tables,
        SchemaError,
        "ALTER TABLE items ALTER COLUMN qty TYPE bigint",
        "ALTER COLUMN qty TYPE bigint USING",
    )
    c.execute("ALTER TABLE items ALTER COLUMN qty TYPE bigint USING qty * 10", url=c.target_url)
    assert c.catch_up(tables)
    c.assert_exact("items")

    # -- replica identity changes, key changes, a DEFERRABLE key, a multiset, TRUNCATE ---------------
    c.execute("ALTER TABLE items REPLICA IDENTITY FULL")
    c.execute("UPDATE items SET id = id + 1000 WHERE id < 10", "UPDATE items SET memo = 'full' WHERE id = 20")
    c.execute("ALTER TABLE items REPLICA IDENTITY DEFAULT")
    c.execute("UPDATE items SET id = id - 1000 WHERE id > 1000")
    c.execute("UPDATE pairs SET id = id + 1")  # a key holds two rows until the commit
    c.execute(
        "INSERT INTO bag VALUES (2, 'y'), (3, NULL)",
        "DELETE FROM bag WHERE a = 1 AND ctid IN (SELECT ctid FROM bag WHERE a = 1 LIMIT 1)",
    )
    c.execute("UPDATE bag SET b = 'z' WHERE a = 2")
    assert c.catch_up(tables)
    for table in tables:
        c.assert_exact(table)
    c.execute(
        "UPDATE pairs SET id = id + 1", "UPDATE pairs SET v = v || '!'"
    )  # replicated before: no false divergence
    c.execute("TRUNCATE bag")
    c.execute("INSERT INTO bag VALUES (9, 'after')", "TRUNCATE pairs RESTART IDENTITY")
    c.execute("INSERT INTO pairs VALUES (1, 'again')")
    assert c.catch_up(tables)
    for table in tables:
        c.assert_exact(table)

    # -- a generated column: kept, generated by the same expression --------------------------------
    c.execute("ALTER TABLE items ADD COLUMN twice bigint GENERATED ALWAYS AS (qty * 2) STORED")
    c.execute("UPDATE items SET qty = 7 WHERE id = 5", "INSERT INTO items (id, qty) VALUES (27, 27)")
    assert c.catch_up(tables)
    c.assert_exact("items")

    # -- a table joining the publication after the stream's position: refused until resynced -------
    c.execute(
        "CREATE TABLE extra (id int PRIMARY KEY, v text)",
        "INSERT INTO extra VALUES (1, 'before'), (2, 'before')",
    )
    setup(c, [*tables, "extra"])  # ALTER PUBLICATION ... ADD TABLE extra
    c.execute("INSERT INTO extra VALUES (3, 'after')")
    assert c.catch_up(tables)  # certified past the join, extra not read yet
    with_extra = [*tables, "extra"]
    c.stops(with_extra, ConfigError, "extra", "Resync")
    c.execute(
        f"ALTER PUBLICATION {c.slot}_pub DROP TABLE extra", f"ALTER PUBLICATION {c.slot}_pub ADD TABLE extra"
    )
    c.execute("UPDATE extra SET v = 'changed' WHERE id = 1")
    assert c.catch_up(with_extra)
    c.assert_exact("extra")

    # -- a table leaving the publication: the stream stops naming it ---------------------------------
    c.execute(f"ALTER PUBLICATION {c.slot}_pub DROP TABLE extra")
    c.execute("INSERT INTO extra VALUES (4, 'unpublished')", "INSERT INTO items (id) VALUES (40)")
    c.stops(with_extra, SchemaError, "left publication", f"ALTER PUBLICATION {c.slot}_pub DROP TABLE extra")
    # The way back: into the publication again, arriving with its rows.
    c.execute(f"ALTER PUBLICATION {c.slot}_pub ADD TABLE extra")
    assert c.catch_up(with_extra)
    c.assert_exact("extra")
    c.assert_exact("items")

    # -- DROP TABLE and CREATE TABLE again, then a new setup: the new table's rows, exactly ----------
    c.execute("DROP TABLE extra")
    c.execute(
        "CREATE TABLE extra (id int PRIMARY KEY, v text, w int)", "INSERT INTO extra VALUES (7, 'new', 7)"
    )
    setup(c, with_extra)
    c.execute("INSERT INTO extra VALUES (8, 'newer', 8)")
    assert c.catch_up(with_extra)
    c.assert_exact("extra")

    # -- the table renamed, and moved to another schema: stops naming it, until the stream follows ---
    c.execute("ALTER TABLE items RENAME TO goods")
    c.execute("INSERT INTO goods (id, qty) VALUES (50, 50)")
    c.stops(with_extra, SchemaError, "renamed to public.goods", "ALTER TABLE items RENAME TO goods")
    renamed = ["goods", "pairs", "bag", "extra"]
    mapping = {"public.goods": "items", "public.pairs": "pairs", "public.bag": "bag", "public.extra": "extra"}
    assert c.catch_up(renamed, mapping)
    c.assert_exact("goods", "items")
    for table in ("pairs", "bag", "extra"):
        c.assert_exact(table)
    c.execute("CREATE SCHEMA shop", "ALTER TABLE goods SET SCHEMA shop")
    c.execute("UPDATE shop.goods SET qty = 51 WHERE id = 50")
    c.stops(renamed, SchemaError, "renamed to shop.goods", "ALTER TABLE goods SET SCHEMA shop")
    moved = ["shop.goods", "pairs", "bag", "extra"]
    assert c.catch_up(moved, {**mapping, "shop.goods": "items"})
    c.assert_exact("shop.goods", "items")
