"""PostgreSQL change data capture under DDL, TRUNCATE, TOAST, infinities and backlogs, end to end.

Real PostgreSQL with ``wal_level=logical``: the source is the test's database, the replica a second
database on the same server, changes through the real connectors and the continuous runner
(``run_epochs``, as a sensor tick runs it). What holds:

* a column added with a constant default reaches the replica with the value the source's existing
  rows hold; a default the WAL does not carry (volatile) stops the stream with a SchemaError naming
  the column, and adding the column to the replica with the source's values lets it resume; a dropped
  column is dropped from the replica; a type change stops the stream naming the column,
  and altering the replica's column the same way lets it resume;
* a TRUNCATE empties the replica's table in the epoch's transaction, a key change of a row whose
  TOASTed value the update left out keeps that value, and ``infinity`` timestamps round-trip; none of
  them stops the stream;
* a backlog of 20,000 one-row transactions drains with a 20 s budget: every call certifies progress.
"""

import asyncio
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_stream_postgres_cdc import Replication

from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.protocol import EpochCertificate, ReadLimits, SchemaError, WritePolicy
from faucet_dagster.runner.continuous import StreamRunner
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.testing import PostgresServer


class Evolving(Replication):
    """A replication whose sink evolves the schema, driven by ``run_epochs`` calls."""

    def runner(self, tables: Sequence[str], worker: str) -> StreamRunner:
        stream = FaucetStream(
            name=self.name,
            source=FaucetEndpoint(FaucetConnection(connector="postgres", config=self.source_config(tables))),
            sink=FaucetEndpoint(
                FaucetConnection(
                    connector="postgres", config={**self.sink_config(tables), "schema_evolution": True}
                )
            ),
            resources=tuple(f"public.{table}" for table in tables),
            policy=WritePolicy.APPLY_CHANGES,
            limits=ReadLimits(records=50_000, idle=0.3),
            lease_seconds=60,
            state_url=self.state_url,
        )
        return StreamRunner(stream.build_spec(), self.store, worker_id=worker)

    def calls(self, tables: Sequence[str], budgets: Sequence[float]) -> list[list[EpochCertificate]]:
        """One ``run_epochs`` call per budget on one runner; the certificates of each call."""
        runner = self.runner(tables, "w1")

        async def scenario() -> list[list[EpochCertificate]]:
            try:
                return [await runner.run_epochs(budget) for budget in budgets]
            finally:
                await runner.close()

        return asyncio.run(scenario())

    def catch_up(self, tables: Sequence[str]) -> list[EpochCertificate]:
        return [certificate for call in self.calls(tables, [15.0]) for certificate in call]

    def rows(self, table: str, url: str) -> list[tuple[Any, ...]]:
        # As text: an infinity has no Python form, and the text is what a reader sees.
        return self.execute(f"SELECT t::text FROM {table} AS t ORDER BY 1", url=url)

    def autocommit(self, statement: str) -> None:
        with psycopg.connect(self.source_url, autocommit=True) as conn:
            conn.execute(statement)

    def columns(self, table: str, url: str) -> list[str]:
        rows = self.execute(
            f"SELECT attname::text FROM pg_attribute WHERE attrelid = '{table}'::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum",
            url=url,
        )
        return [row[0] for row in rows]

    def assert_equal_on_source_columns(self, table: str, key: str) -> None:
        """The replica holds the source's rows in the source's columns (it may keep dropped ones)."""
        names = ", ".join(self.columns(table, self.source_url))
        query = f"SELECT {names} FROM {table} ORDER BY {key}"
        source, target = self.execute(query), self.execute(query, url=self.target_url)
        assert target == source, f"{table} differs from the source"


@pytest.fixture
def replication(
    postgres_url: str, postgres_server: PostgresServer, unique_name: Callable[..., str], tmp_path: Path
) -> Iterator[Evolving]:
    replica = unique_name("replica")
    created = Evolving(postgres_url, postgres_server.create_database(replica), unique_name("cdc"), tmp_path)
    yield created
    created.store.close()
    postgres_server.drop_database(replica)


def setup(replication: Replication, tables: Sequence[str], *statements: str) -> None:
    replication.execute(*statements)
    connection = FaucetConnection(connector="postgres", config=replication.source_config(tables))
    assert connection.setup_replication()["slot_created"]


def test_source_ddl_mid_stream_keeps_the_replica_equal_or_stops_naming_the_column_and_the_way_out(
    replication: Evolving,
) -> None:
    tables = ("orders",)
    setup(replication, tables, "CREATE TABLE orders (id int PRIMARY KEY, qty int, note text)")
    replication.execute("INSERT INTO orders SELECT g, g, 'n' || g FROM generate_series(1, 50) g")
    assert replication.catch_up(tables)

    # A constant default: PostgreSQL keeps it once (attmissingval) for the 50 existing rows, whose
    # change rows never carry it. An insert and an update in the same epoch as the ALTER.
    replication.execute(
        "UPDATE orders SET qty = 0 WHERE id = 1",
        "ALTER TABLE orders ADD COLUMN priority int DEFAULT 7",
        "INSERT INTO orders VALUES (51, 51, 'n51', 3)",
    )
    replication.execute("UPDATE orders SET note = 'changed' WHERE id = 2")
    assert replication.catch_up(tables)
    replication.assert_identical(tables)
    assert replication.execute(
        "SELECT count(*) FROM orders WHERE priority = 7", url=replication.target_url
    ) == [(50,)]

    # A volatile default rewrote the table: the values the existing rows got are not in the WAL.
    replication.execute("ALTER TABLE orders ADD COLUMN stamp float8 DEFAULT random()")
    replication.execute("INSERT INTO orders (id, qty, note) VALUES (52, 52, 'n52')")
    for _ in range(2):  # the same error on every call, with nothing written
        with pytest.raises(SchemaError, match="stamp") as stopped:
            replication.calls(tables, [10.0])
    assert "yourself with the source's values" in str(stopped.value)
    assert "stamp" not in replication.columns("orders", replication.target_url)
    # The way out: the column added to the replica with the source's values; the stream resumes.
    values = replication.execute("SELECT id, stamp FROM orders WHERE id <= 51")
    replication.execute(
        "ALTER TABLE orders ADD COLUMN stamp float8",
        *(f"UPDATE orders SET stamp = {stamp!r} WHERE id = {key}" for key, stamp in values),
        url=replication.target_url,
    )
    assert replication.catch_up(tables)
    replication.assert_identical(tables)

    # A dropped column is dropped from the replica too (the DDL capture tells it from a rename).
    replication.execute("ALTER TABLE orders DROP COLUMN note")
    replication.execute(
        "INSERT INTO orders (id, qty) VALUES (53, 53)", "UPDATE orders SET qty = 5 WHERE id = 3"
    )
    assert replication.catch_up(tables)
    replication.assert_equal_on_source_columns("orders", "id")
    assert "note" not in replication.columns("orders", replication.target_url)

    # A type change rewrote every row at the source, outside the change stream: the stream stops,
    # naming the column, until the replica's column is altered the same way.
    replication.execute("ALTER TABLE orders ALTER COLUMN qty TYPE bigint USING qty * 10")
    replication.execute("UPDATE orders SET qty = 99999999999 WHERE id = 5")
    with pytest.raises(SchemaError, match="qty") as retyped:
        replication.calls(tables, [10.0])
    assert "ALTER COLUMN qty TYPE" in str(retyped.value)
    replication.execute(
        "ALTER TABLE orders ALTER COLUMN qty TYPE bigint USING qty * 10", url=replication.target_url
    )
    assert replication.catch_up(tables)
    replication.assert_equal_on_source_columns("orders", "id")


def big_text(seed: int, size: int = 20_000) -> str:
    """Incompressible text: PostgreSQL stores it out of line (TOASTed)."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(size))


def test_truncate_toasted_key_changes_and_infinity_are_applied_and_never_stop_the_stream(
    replication: Evolving,
) -> None:
    tables = ("docs", "events")
    setup(
        replication,
        tables,
        "CREATE TABLE docs (id int PRIMARY KEY, title text, body text)",
        "CREATE TABLE events (id int PRIMARY KEY, at timestamptz, day date)",
    )
    body = big_text(1)
    replication.execute(
        f"INSERT INTO docs VALUES (1, 'one', '{body}'), (2, 'two', '{body[::-1]}')",
        "INSERT INTO events SELECT g, now(), current_date FROM generate_series(1, 20) g",
    )
    assert replication.catch_up(tables)
    # A key change that leaves the TOASTed body out (default replica identity), then another one of
    # the moved row in the same epoch; the body is carried over from the old key's row.
    replication.execute("UPDATE docs SET id = 10 WHERE id = 1")
    replication.execute("UPDATE docs SET id = 11, title = 'eleven' WHERE id = 10")
    replication.execute(
        "INSERT INTO docs VALUES (3, 'three', 'short')", "UPDATE docs SET id = 30 WHERE id = 3"
    )
    # A TRUNCATE, with changes before it in the same epoch and rows after it.
    replication.execute("UPDATE events SET at = now() WHERE id = 1")
    replication.execute("TRUNCATE events")
    replication.execute(
        "INSERT INTO events VALUES (1, 'infinity', 'infinity'), (2, '-infinity', '-infinity'), "
        "(3, '2024-02-29 12:00:00+00', '2024-02-29')"
    )
    certificates = replication.catch_up(tables)
    assert certificates, "the stream moved on"
    replication.assert_identical(tables)
    [infinite] = replication.execute(
        "SELECT count(*) FROM events WHERE at = 'infinity' AND day = 'infinity'", url=replication.target_url
    )
    assert infinite == (1,)
    assert replication.execute("SELECT body FROM docs WHERE id = 11", url=replication.target_url) == [(body,)]
    truncated = [
        receipt.details.get("rows_truncated")
        for certificate in certificates
        for receipt in certificate.receipts
        if receipt.resource == "public.events"
    ]
    assert "20" in truncated


def test_a_backlog_of_small_transactions_drains_with_every_call_certifying_progress(
    replication: Evolving,
) -> None:
    tables = ("lines",)
    setup(replication, tables, "CREATE TABLE lines (id int PRIMARY KEY, qty int)")
    replication.execute("INSERT INTO lines VALUES (0, 0)")
    assert replication.catch_up(tables)
    # 20,000 one-row transactions queued behind the slot.
    replication.autocommit(
        "DO $$ BEGIN FOR g IN 1..20000 LOOP INSERT INTO lines VALUES (g, g); COMMIT; END LOOP; END $$"
    )
    calls = replication.calls(tables, [20.0] * 3)
    rows = [sum(certificate.row_counts.get("public.lines", 0) for certificate in call) for call in calls]
    assert rows[0] > 0, f"the first 20 s call certified nothing: {rows}"
    assert sum(rows) == 20_000, f"rows certified per call: {rows}"
    replication.assert_identical(tables)
