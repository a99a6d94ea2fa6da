"""PostgreSQL change data capture into another PostgreSQL database (APPLY_CHANGES), end to end.

Real PostgreSQL with ``wal_level=logical``: the source is the test's database, the replica a second
database on the same server. Changes flow through the real connectors, the continuous runner and the
Dagster sensor's ticks. What holds:

* a workload of mixed transactions (multi-row, multi-table, the same keys updated and deleted, key
  changes, unchanged TOASTed values, a 100,000-row transaction) leaves the replica equal to the source,
  row by row, and every certificate ends at a source transaction's commit;
* a worker process (the fault harness's, :mod:`faucet_dagster.testing.faults`) SIGKILLed at its
  ``after_apply`` fault point in the middle of a large transaction leaves none of it visible, and the
  worker that takes over after the lease expires replicates it once;
* a slot advanced out of band, dropped, or created again is an explicit error and nothing is written;
* the snapshot mode seeds a new replica from existing rows under concurrent writes, without a gap or an
  overlap (no change reaches a key the replica lacks, no insert a key it has).
"""

import asyncio
import json
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
from dagster._core.definitions.sensor_definition import SensorExecutionData
from faucet_postgres import pgoutput
from faucet_postgres.codecs import PostgresLsnCodec
from stream_ticks import chained_ends, reported_sequences, sensor_context

from faucet_dagster.cli.main import main
from faucet_dagster.declarations.resources import FaucetConnection, FaucetEndpoint
from faucet_dagster.protocol import (
    Delivery,
    DomainCoverage,
    EpochCertificate,
    IncarnationChanged,
    OrderingDomain,
    PositionUnavailable,
    ReadLimits,
    Receipt,
    WritePolicy,
)
from faucet_dagster.runner.continuous import StreamRunner
from faucet_dagster.runner.faults import Action, Arming, Point
from faucet_dagster.state import StateStore
from faucet_dagster.streams.certificates import certificate_problems
from faucet_dagster.streams.declaration import FaucetStream
from faucet_dagster.streams.runner_cache import close_cached_streams
from faucet_dagster.streams.sensor import faucet_stream_sensor
from faucet_dagster.testing import PostgresServer
from faucet_dagster.testing.faults.spec import Endpoint, WorkerSpec
from faucet_dagster.testing.faults.worker_process import WorkerProcess

ORDERS = (
    "CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL, total numeric(10,2), meta jsonb, "
    "placed timestamptz)"
)
LINES = "CREATE TABLE lines (order_id int, line int, qty int, PRIMARY KEY (order_id, line))"
DOCS = "CREATE TABLE docs (id int PRIMARY KEY, title text, body text)"
KEYS = {"orders": "id", "lines": "order_id, line", "docs": "id"}
CATCH_UP_SECONDS = 300.0
LSN = PostgresLsnCodec()


class Replication:
    """One test's source database, slot and publication, replica database and state store."""

    def __init__(self, source_url: str, target_url: str, name: str, tmp_path: Path) -> None:
        self.source_url = source_url
        self.target_url = target_url
        self.name = name
        self.slot = name
        self.state_url = f"sqlite:///{tmp_path / 'faucet_state.db'}"
        self.store = StateStore(self.state_url)

    def source_config(self, tables: Sequence[str], **extra: Any) -> dict[str, Any]:
        return {
            "url": self.source_url,
            "slot": self.slot,
            "publication": f"{self.slot}_pub",
            "tables": [f"public.{table}" for table in tables],
            "heartbeat_interval": 0,
            "poll_interval": 0.05,
            **extra,
        }

    def sink_config(self, tables: Sequence[str]) -> dict[str, Any]:
        return {"url": self.target_url, "tables": {f"public.{table}": table for table in tables}}

    def stream(self, tables: Sequence[str], *, lease_seconds: float = 60, **source: Any) -> FaucetStream:
        return FaucetStream(
            name=self.name,
            source=FaucetEndpoint(
                FaucetConnection(connector="postgres", config=self.source_config(tables, **source))
            ),
            sink=FaucetEndpoint(FaucetConnection(connector="postgres", config=self.sink_config(tables))),
            resources=tuple(f"public.{table}" for table in tables),
            policy=WritePolicy.APPLY_CHANGES,
            limits=ReadLimits(records=20_000, idle=0.3),
            lease_seconds=lease_seconds,
            state_url=self.state_url,
        )

    def runner(self, tables: Sequence[str], worker: str) -> StreamRunner:
        return StreamRunner(self.stream(tables).build_spec(), self.store, worker_id=worker)

    def execute(self, *statements: str, url: str | None = None) -> list[tuple[Any, ...]]:
        """Run ``statements`` in one transaction of the source (or ``url``); the last one's rows."""
        with psycopg.connect(url or self.source_url) as conn:
            rows: list[tuple[Any, ...]] = []
            for statement in statements:
                cursor = conn.execute(statement)
                rows = cursor.fetchall() if cursor.description else []
            return rows

    def rows(self, table: str, url: str) -> list[tuple[Any, ...]]:
        return self.execute(f"SELECT * FROM {table} ORDER BY {KEYS[table]}", url=url)

    def identical(self, tables: Sequence[str]) -> bool:
        return all(self.rows(t, self.source_url) == self.rows(t, self.target_url) for t in tables)

    def assert_identical(self, tables: Sequence[str]) -> None:
        for table in tables:
            source, target = self.rows(table, self.source_url), self.rows(table, self.target_url)
            assert len(target) == len(source), (
                f"{table}: {len(target)} rows replicated, {len(source)} in the source"
            )
            assert target == source, f"{table} differs from the source"


@pytest.fixture
def replication(
    postgres_url: str, postgres_server: PostgresServer, unique_name: Callable[..., str], tmp_path: Path
) -> Iterator[Replication]:
    replica = unique_name("replica")
    created = Replication(
        postgres_url, postgres_server.create_database(replica), unique_name("cdc"), tmp_path
    )
    yield created
    close_cached_streams()
    created.store.close()
    postgres_server.drop_database(replica)


class Ticker:
    """Sensor ticks of one stream on one Dagster instance, the cursor carried from tick to tick."""

    def __init__(self, stream: FaucetStream, instance: dg.DagsterInstance, budget: float) -> None:
        self.budget = budget
        self.sensor = faucet_stream_sensor(stream, budget_seconds=budget)
        self.instance = instance
        self.cursor: str | None = None
        self.reported: list[int] = []
        self.tables: set[str] = set()
        """The ``dagster/table_name`` of every asset a tick materialized."""

    def tick(self) -> SensorExecutionData:
        result = self.sensor.evaluate_tick(sensor_context(self.sensor, self.instance, self.cursor))
        self.cursor = result.cursor
        sequences: set[int] = set()  # a replica of several tables reports to each table's asset
        for event in result.asset_events:
            if isinstance(event, dg.AssetMaterialization):
                assert event.metadata["faucet/delivery"].value == "effectively_once"
                sequences.update(reported_sequences(event))
                name = event.metadata.get("dagster/table_name")
                assert name is not None, event.asset_key
                path = event.asset_key.path  # one asset per table when the replica has several
                assert len(path) == 1 or path[-1] == str(name.value).rsplit(".", 1)[-1]
                self.tables.add(str(name.value))
        self.reported.extend(sorted(sequences))
        return result

    def until_caught_up(self, replication: "Replication", tables: Sequence[str]) -> None:
        """Tick until the replica equals the source and every certificate is reported: epochs are
        certified in the background (a tick only reports), so how many ticks that takes depends on
        the machine's speed. A replica that never equals its source fails the wait."""
        ends = time.monotonic() + CATCH_UP_SECONDS
        while True:
            identical = replication.identical(tables)
            self.tick()
            last = replication.store.last_certificate(replication.name)
            if identical and self.reported[-1:] == [0 if last is None else last.sequence]:
                return
            assert time.monotonic() < ends, f"the replica did not catch up in {CATCH_UP_SECONDS:.0f}s"
            time.sleep(0.3)


def commit_positions(url: str, slot: str, publication: str) -> tuple[list[str], int]:
    """The commit LSNs of the transactions ``slot`` (an observer slot, never consumed) holds, and how
    many change rows they make (an update that changes the key is a delete and an insert)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
            "'publication_names', %s)",
            (slot, publication),
        ).fetchall()
    commits: list[str] = []
    changes = 0
    for (data,) in rows:
        message = pgoutput.decode(bytes(data))
        if isinstance(message, pgoutput.Commit):
            commits.append(LSN.canonicalize(message.commit_lsn))
        elif isinstance(message, pgoutput.Insert | pgoutput.Delete):
            changes += 1
        elif isinstance(message, pgoutput.Update):
            changes += 2 if message.old_kind == "K" else 1
    return commits, changes


def chained(certificates: Sequence[EpochCertificate]) -> None:
    """Sequences 1..n, each coverage starting where the previous one ended, receipts adding up."""
    assert [certificate.sequence for certificate in certificates] == list(range(1, len(certificates) + 1))
    chained_ends(certificates)
    for certificate in certificates:
        handled = sum(receipt.rows_written + receipt.rows_skipped for receipt in certificate.receipts)
        assert handled == sum(certificate.row_counts.values()), certificate.sequence


def consistent(certificates: Sequence[EpochCertificate]) -> None:
    """No receipt saw a change of a key the replica lacked or an insert of a key it had."""
    for certificate in certificates:
        for receipt in certificate.receipts:
            if receipt.rows_written:
                assert receipt.details["unexpected_inserts"] == "0", (certificate.sequence, receipt)
                assert receipt.details["unexpected_changes"] == "0", (certificate.sequence, receipt)


def random_transactions(replication: Replication, seed: int, count: int) -> None:
    """``count`` small transactions of inserts, updates, deletes and key changes over a few keys."""
    rng = random.Random(seed)
    with psycopg.connect(replication.source_url, autocommit=True) as conn:
        for _ in range(count):
            with conn.transaction():
                for _ in range(rng.randrange(1, 6)):
                    order, action = rng.randrange(1, 60), rng.random()
                    if action < 0.3:
                        conn.execute(
                            "INSERT INTO orders VALUES (%s, 'new', %s, '{\"n\": 1}', now()) ON CONFLICT (id) "
                            "DO UPDATE SET status = 'again', total = EXCLUDED.total",
                            (order, rng.randrange(10_000) / 100),
                        )
                    elif action < 0.55:
                        conn.execute(
                            "UPDATE orders SET status = %s WHERE id = %s", (f"s{rng.random():.3f}", order)
                        )
                    elif action < 0.7:
                        conn.execute("DELETE FROM orders WHERE id = %s", (order,))
                    elif action < 0.8:
                        # a key change (delete of the old key, insert of the new row), unless taken
                        conn.execute(
                            "UPDATE orders SET id = id + 1000 WHERE id = %s "
                            "AND NOT EXISTS (SELECT 1 FROM orders WHERE id = %s)",
                            (order, order + 1000),
                        )
                    else:
                        conn.execute(
                            "INSERT INTO lines VALUES (%s, %s, 1) ON CONFLICT (order_id, line) "
                            "DO UPDATE SET qty = lines.qty + 1",
                            (order, rng.randrange(4)),
                        )


def big_text(seed: int, size: int = 20_000) -> str:
    """Incompressible text, stored out of line (TOASTed) rather than compressed into the row."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(size))


# -- the workload -------------------------------------------------------------------------------------


def test_a_mixed_workload_through_sensor_ticks_leaves_the_replica_identical(
    replication: Replication, capsys: pytest.CaptureFixture[str]
) -> None:
    tables = ("orders", "lines", "docs")
    replication.execute(ORDERS, LINES, DOCS)
    # The replica: orders and docs created like the source; lines left for the sink to create.
    replication.execute(ORDERS, DOCS, url=replication.target_url)
    publication = f"{replication.slot}_pub"
    setup = [
        "cdc", "setup", "--json",
        "--set", f"url={replication.source_url}",
        "--set", f"slot={replication.slot}",
        "--set", f"publication={publication}",
        *[arg for table in tables for arg in ("--table", f"public.{table}")],
    ]  # fmt: skip
    assert main(setup) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["slot_created"] and made["publication_created"]
    assert made["tables"] == ["public.docs", "public.lines", "public.orders"]
    observer = f"{replication.slot}_observer"
    replication.execute(f"SELECT pg_create_logical_replication_slot('{observer}', 'pgoutput')")
    body, second_body = big_text(1), big_text(2)

    def first() -> None:
        # orders and their line items in one transaction over two tables
        replication.execute(
            "INSERT INTO orders SELECT g, 'new', g * 1.25, jsonb_build_object('g', g), "
            "'2024-05-01 10:00:00+00'::timestamptz + g * interval '1 minute' FROM generate_series(1, 200) g",
            "INSERT INTO lines SELECT o, l, o * l FROM generate_series(1, 200) o, generate_series(1, 3) l",
        )
        random_transactions(replication, seed=1, count=40)
        # a TOASTed value, then an update that leaves it out: filled from the same epoch
        replication.execute(f"INSERT INTO docs VALUES (1, 'draft', '{body}'), (2, 'draft', '{second_body}')")
        replication.execute("UPDATE docs SET title = 'reviewed' WHERE id = 1")

    def second() -> None:
        # left out again: kept from the replica
        replication.execute("UPDATE docs SET title = 'final' WHERE id IN (1, 2)")
        # the 100,000-row transaction, with updates and deletes of the same keys in it
        replication.execute(
            "INSERT INTO lines SELECT 5000 + g / 100, g % 100, g FROM generate_series(0, 99999) g",
            "UPDATE lines SET qty = -qty WHERE order_id BETWEEN 5000 AND 5009",
            "DELETE FROM lines WHERE order_id = 5010",
            "UPDATE orders SET status = 'bulk' WHERE id % 5 = 0",
        )
        replication.execute(
            "UPDATE lines SET qty = qty + 1 WHERE order_id < 50",
            "DELETE FROM lines WHERE line = 2 AND order_id < 100",
            "DELETE FROM orders WHERE id % 7 = 0",
        )

    def third() -> None:
        random_transactions(replication, seed=2, count=40)
        replication.execute("DELETE FROM lines WHERE order_id BETWEEN 5100 AND 5399")
        replication.execute("DELETE FROM docs WHERE id = 2", "UPDATE docs SET body = 'short' WHERE id = 1")

    with dg.instance_for_test() as instance:
        ticker = Ticker(replication.stream(tables), instance, budget=20)
        for phase in (first, second, third):
            phase()
            ticker.until_caught_up(replication, tables)

    replication.assert_identical(tables)
    certificates = replication.store.certificates(replication.name)
    assert ticker.reported == [certificate.sequence for certificate in certificates], "each reported once"
    # One asset per replicated table (``<stream>/public/<table>``), each naming its own table.
    assert {name.rsplit(".", 1)[-1] for name in ticker.tables} == set(tables)
    chained(certificates)
    consistent(certificates)
    commits, change_rows = commit_positions(replication.source_url, observer, publication)
    ends = [certificate.coverage[0].end for certificate in certificates]
    assert set(ends) <= set(commits), "every certificate ends at a source transaction's commit"
    assert ends[-1] == commits[-1] and len(commits) > 80
    assert sum(sum(certificate.row_counts.values()) for certificate in certificates) == change_rows
    big = next(c for c in certificates if c.row_counts.get("public.lines", 0) >= 100_000)
    assert big.coverage[0].end in commits, "the 100,000-row transaction ended inside one epoch"
    (confirmed,) = replication.execute(
        f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{replication.slot}'"
    )[0]
    assert LSN.validate(confirmed) == LSN.validate(ends[-1]) + 1, "acknowledged up to the last certificate"


def test_a_buffer_filling_inside_every_few_transactions_still_replicates_each_exactly_once(
    replication: Replication,
) -> None:
    """``batch_rows=4``: small transactions fill the buffer in the middle of one again and again (the
    group before it is delivered, the open one stays buffered unless it alone fills the buffer, then
    it goes in pieces under its own controls), and a 30-row transaction comes after them in the same
    read. The replica ends identical, each epoch ends at a commit, every change row is counted once."""
    tables = ("orders", "lines")
    replication.execute(ORDERS, LINES)
    replication.execute(ORDERS, LINES, url=replication.target_url)
    FaucetConnection(connector="postgres", config=replication.source_config(tables)).setup_replication()
    observer = f"{replication.slot}_observer"
    replication.execute(f"SELECT pg_create_logical_replication_slot('{observer}', 'pgoutput')")
    random_transactions(replication, seed=3, count=60)
    replication.execute("INSERT INTO lines SELECT 9000, g, g FROM generate_series(1, 30) g")
    random_transactions(replication, seed=4, count=20)

    with dg.instance_for_test() as instance:
        ticker = Ticker(replication.stream(tables, batch_rows=4), instance, budget=20)
        ticker.until_caught_up(replication, tables)

    replication.assert_identical(tables)
    certificates = replication.store.certificates(replication.name)
    chained(certificates)
    consistent(certificates)
    commits, change_rows = commit_positions(replication.source_url, observer, f"{replication.slot}_pub")
    assert {certificate.coverage[0].end for certificate in certificates} <= set(commits)
    assert certificates[-1].coverage[0].end == commits[-1]
    assert sum(sum(certificate.row_counts.values()) for certificate in certificates) == change_rows


# -- a worker killed in the middle of a large transaction ---------------------------------------------


def test_a_worker_killed_inside_a_large_transaction_leaves_nothing_partial_and_is_taken_over(
    replication: Replication, tmp_path: Path
) -> None:
    tables = ("orders", "lines")
    replication.execute(ORDERS, LINES)
    replication.execute(ORDERS, url=replication.target_url)
    connection = FaucetConnection(connector="postgres", config=replication.source_config(tables))
    made = connection.setup_replication()  # the Dagster resource method
    assert made["slot_created"] and made["tables"] == ("public.lines", "public.orders")
    replication.execute("INSERT INTO orders VALUES (1, 'first', 1.00, '{}', now())")
    replication.execute(
        "INSERT INTO orders VALUES (2, 'bulk', 2.00, '{}', now())",
        "INSERT INTO lines SELECT 2, g, g FROM generate_series(1, 100000) g",
    )
    # One source transaction per epoch; the second epoch's transaction reaches the sink in batches of
    # 500 rows, so the second apply of the run is the first batch of the 100,001-row transaction.
    spec = WorkerSpec(
        mode="continuous",
        stream=replication.name,
        worker_id="doomed",
        source=Endpoint("postgres", replication.source_config(tables)),
        sink=Endpoint("postgres", replication.sink_config(tables)),
        resources=tuple(f"public.{table}" for table in tables),
        policy=WritePolicy.APPLY_CHANGES.value,
        state_url=replication.state_url,
        epoch_records=1,
        batch_rows=500,
        # Longer than a tick waits for a lease about to expire (runner.lease.HANDOVER_WAIT_SECONDS),
        # with room for a loaded machine between the kill and the first tick.
        lease_seconds=25,
        # One epoch at a time: epoch 1 is certified and acknowledged before epoch 2's first apply
        # (read ahead, epoch 2 would reach the sink as soon as epoch 1 committed).
        pipelined=False,
    )
    report = tmp_path / "fault-report.jsonl"
    worker = WorkerProcess(
        spec, Arming(Point.AFTER_APPLY, 2, Action.KILL, report=str(report)), tmp_path / "w"
    )
    try:
        assert worker.wait(timeout=60) == -signal.SIGKILL, worker.tail()
    finally:
        worker.close()
    assert [json.loads(line) for line in report.read_text().splitlines()] == [
        {"point": "after_apply", "hit": 2, "action": "kill"}
    ]
    certified = [event.data["sequence"] for event in worker.events if event.event == "certified"]
    assert certified == [1], (certified, worker.tail())
    # Killed inside epoch 2: some of the 100,000 rows were staged in the open destination transaction.

    assert replication.rows("orders", replication.target_url)[0][:2] == (1, "first")
    assert len(replication.rows("orders", replication.target_url)) == 1
    (created,) = replication.execute("SELECT to_regclass('lines')", url=replication.target_url)
    assert created == (None,), "nothing of the killed transaction, not even the table it created"
    [first] = replication.store.certificates(replication.name)
    assert first.worker == "doomed"
    (confirmed,) = replication.execute(
        f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{replication.slot}'"
    )[0]
    assert LSN.validate(confirmed) == LSN.validate(first.coverage[0].end) + 1, "only epoch 1 was acknowledged"
    replication.execute(
        "UPDATE lines SET qty = 0 WHERE line <= 10", "INSERT INTO orders VALUES (3, 'after', 3, '{}', now())"
    )

    with dg.instance_for_test() as instance:
        # The killed worker's lease is still live: a short tick reports its certificate and runs
        # nothing; its reader waits for that lease (it asked the dead worker to hand over) in the
        # background and takes the stream over when it expires.
        first = Ticker(replication.stream(tables), instance, budget=2)
        first.tick()
        assert first.reported == [1] and len(replication.store.certificates(replication.name)) == 1
        deadline = time.monotonic() + 45
        while replication.store.status(replication.name)[0].owner == "doomed":
            assert time.monotonic() < deadline, "the killed worker's lease never expired"
            time.sleep(0.2)
        ticker = Ticker(replication.stream(tables), instance, budget=20)  # the same cached runner
        ticker.cursor, ticker.reported = first.cursor, first.reported
        ticker.until_caught_up(replication, tables)

    replication.assert_identical(tables)
    certificates = replication.store.certificates(replication.name)
    chained(certificates)
    consistent(certificates)
    assert [c.fencing_token for c in certificates][:2] == [1, 2], "the takeover fenced the killed worker"
    written = sum(receipt.rows_written for c in certificates for receipt in c.receipts)
    skipped_rows = sum(receipt.rows_skipped for c in certificates for receipt in c.receipts)
    assert (written, skipped_rows) == (1 + 100_001 + 10 + 1, 0), "nothing lost, nothing applied twice"


# -- the slot changed behind the stream's back ----------------------------------------------------------


def test_a_slot_advanced_dropped_or_recreated_is_an_explicit_error_and_nothing_is_written(
    replication: Replication,
) -> None:
    tables = ("orders",)
    replication.execute(ORDERS)
    replication.execute(ORDERS, url=replication.target_url)
    connection = FaucetConnection(connector="postgres", config=replication.source_config(tables))
    connection.setup_replication()
    replication.execute("INSERT INTO orders VALUES (1, 'certified', 1, '{}', now())")

    def one_epoch(worker: str) -> EpochCertificate | None:
        runner = replication.runner(tables, worker)

        async def scenario() -> EpochCertificate | None:
            try:
                return await runner.run_epoch()
            finally:
                await runner.close()

        return asyncio.run(scenario())

    assert one_epoch("w1") is not None
    before = replication.rows("orders", replication.target_url)
    slot = replication.slot
    errors: dict[str, BaseException] = {}
    cases: list[tuple[str, str, type[BaseException]]] = [
        (
            "advanced",
            f"SELECT pg_replication_slot_advance('{slot}', pg_current_wal_flush_lsn())",
            PositionUnavailable,
        ),
        ("dropped", f"SELECT pg_drop_replication_slot('{slot}')", PositionUnavailable),
    ]
    for name, statement, expected in cases:
        replication.execute(f"INSERT INTO orders VALUES ({len(errors) + 10}, 'lost', 1, '{{}}', now())")
        replication.execute(statement)
        with pytest.raises(expected) as caught:
            one_epoch(f"after-{name}")
        errors[name] = caught.value
    # Set up again (a new slot and marker): another incarnation, through sensor ticks this time.
    connection.setup_replication()
    replication.execute("INSERT INTO orders VALUES (20, 'new incarnation', 1, '{}', now())")
    with dg.instance_for_test() as instance:
        ticker = Ticker(replication.stream(tables), instance, budget=10)
        # The first tick reports the certified epoch before failing; the next one says the stream halted.
        assert ticker.tick().asset_events and ticker.reported == [1]
        halted = str(ticker.tick().skip_message)
        assert halted.startswith("halted since ") and IncarnationChanged.__name__ in halted
        assert "belongs to incarnation" in halted
    assert "advanced out of band" in str(errors["advanced"]) and "dropped" in str(errors["dropped"])
    assert replication.rows("orders", replication.target_url) == before, "nothing was written"
    assert len(replication.store.certificates(replication.name)) == 1


# -- the snapshot seeds a new replica -------------------------------------------------------------------


def test_the_snapshot_mode_seeds_a_new_replica_without_gap_or_overlap(replication: Replication) -> None:
    tables = ("orders",)
    replication.execute(ORDERS)
    replication.execute(ORDERS, url=replication.target_url)
    replication.execute(
        "INSERT INTO orders SELECT g, 'old', g / 10.0, '{}', now() FROM generate_series(1, 20000, 2) g"
    )
    FaucetConnection(connector="postgres", config=replication.source_config(tables)).setup_replication()
    stop = threading.Event()
    written = {"transactions": 0}

    def write_until_stopped() -> None:
        rng = random.Random(5)
        with psycopg.connect(replication.source_url, autocommit=True) as conn:
            while not stop.is_set():
                with conn.transaction():
                    key = rng.randrange(1, 20_000)
                    conn.execute(
                        "INSERT INTO orders VALUES (%s, 'w', 1, '{}', now()) "
                        "ON CONFLICT (id) DO UPDATE SET total = orders.total + 1, status = 'upd'",
                        (key,),
                    )
                    conn.execute("DELETE FROM orders WHERE id = %s", (rng.randrange(1, 20_000),))
                written["transactions"] += 1
                # Gaps between transactions: the snapshot's slot becomes consistent at a moment when
                # none is running, which a writer without pauses might postpone for seconds.
                time.sleep(0.003)

    writer = threading.Thread(target=write_until_stopped)
    with dg.instance_for_test() as instance:
        ticker = Ticker(replication.stream(tables, snapshot=True), instance, budget=10)
        writer.start()
        # The writer runs before, during and after the snapshot: the first tick starts the reader,
        # whose first read takes it, and its epoch is certified in the background.
        try:
            time.sleep(0.3)
            ticker.tick()
            ends = time.monotonic() + CATCH_UP_SECONDS
            while not replication.store.certificates(replication.name):
                assert time.monotonic() < ends, "the snapshot was not certified"
                time.sleep(0.1)
            time.sleep(1.0)
        finally:
            stop.set()
            writer.join()
        ticker.until_caught_up(replication, tables)

    replication.assert_identical(tables)
    certificates = replication.store.certificates(replication.name)
    chained(certificates)
    consistent(certificates)
    first, last = certificates[0], certificates[-1]
    assert first.coverage[0].start is None and first.row_counts["public.orders"] >= 9_000
    # The snapshot is one source transaction at its point P - 1; the writer's changes follow it.
    snapshot_position = LSN.validate(first.receipts[0].details["first_position"])
    assert LSN.validate(last.coverage[0].end) > snapshot_position
    assert written["transactions"] > 20, "changes flowed during and after the snapshot"


def test_a_snapshot_epoch_committed_before_its_certificate_recovers_to_the_source_after_a_delete(
    replication: Replication, tmp_path: Path
) -> None:
    """Killed after the sink committed the snapshot's epoch and before its certificate; a row deleted at
    the source before anyone recovers. A new snapshot cannot re-read the first one (the source is not
    deterministic with ``snapshot``), so the recovery certifies the committed epoch from the replica's
    own watermark and decodes the delete from there: the replica equals the source."""
    tables = ("orders",)
    replication.execute(ORDERS)
    replication.execute(ORDERS, url=replication.target_url)
    replication.execute(
        "INSERT INTO orders SELECT g, 'old', g, '{}', '2026-01-01' FROM generate_series(1, 100) g"
    )
    config = replication.source_config(tables, snapshot=True)
    FaucetConnection(connector="postgres", config=config).setup_replication()
    spec = WorkerSpec(
        mode="continuous",
        stream=replication.name,
        worker_id="doomed",
        source=Endpoint("postgres", config),
        sink=Endpoint("postgres", replication.sink_config(tables)),
        resources=tuple(f"public.{table}" for table in tables),
        policy=WritePolicy.APPLY_CHANGES.value,
        state_url=replication.state_url,
        lease_seconds=5,
    )
    worker = WorkerProcess(spec, Arming(Point.AFTER_SINK_COMMIT, 1, Action.KILL), tmp_path / "w")
    try:
        assert worker.wait(timeout=60) == -signal.SIGKILL, worker.tail()
    finally:
        worker.close()
    assert len(replication.rows("orders", replication.target_url)) == 100, "the snapshot was committed"
    assert replication.store.certificates(replication.name) == [], "and not certified"
    replication.execute("DELETE FROM orders WHERE id = 7", "UPDATE orders SET status = 'new' WHERE id = 8")
    replication.store.release(replication.name)  # the killed worker's lease, without waiting for it

    async def recover() -> list[EpochCertificate]:
        runner = StreamRunner(replication.stream(tables, snapshot=True).build_spec(), replication.store)
        try:
            return await runner.run_epochs(20)
        finally:
            await runner.close()

    certificates = asyncio.run(recover())
    replication.assert_identical(tables)
    assert [c.sequence for c in certificates] == [1, 2], certificates
    adopted = certificates[0]
    assert adopted.coverage[0].start is None and adopted.receipts == () and adopted.row_counts == {}
    chained(replication.store.certificates(replication.name))
    consistent(certificates)
    (confirmed,) = replication.execute(
        f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{replication.slot}'"
    )[0]
    assert LSN.validate(confirmed) == LSN.validate(certificates[-1].coverage[0].end) + 1


# -- faucet cdc setup -------------------------------------------------------------------------------------


def test_cdc_setup_is_idempotent_and_names_what_is_wrong(
    replication: Replication, capsys: pytest.CaptureFixture[str]
) -> None:
    replication.execute(ORDERS)
    base = ["cdc", "setup", "--set", f"url={replication.source_url}", "--set", f"slot={replication.slot}"]
    base += ["--set", f"publication={replication.slot}_pub"]
    assert main([*base, "--table", "public.orders", "--table", "public.missing"]) == 2
    assert "public.missing do not exist" in capsys.readouterr().err
    assert main([*base, "--table", "public.orders"]) == 0
    created = capsys.readouterr().out
    assert main([*base, "--table", "public.orders"]) == 0
    again = capsys.readouterr().out
    assert "slot_created: True" in created and "slot_created: False" in again
    incarnation = [line for line in created.splitlines() if line.startswith("incarnation:")]
    assert incarnation and incarnation[0] in again, "running it again keeps the slot's incarnation"
    assert main(["cdc", "setup", "--connector", "nats", "--set", "stream=ORDERS"]) == 2
    assert "has no replication setup" in capsys.readouterr().err


# -- tables without a primary key ---------------------------------------------------------------------


def test_a_table_without_a_key_is_refused_at_setup_and_replicated_as_a_multiset_under_full(
    replication: Replication, capsys: pytest.CaptureFixture[str]
) -> None:
    """Setup refuses a table without a primary key or replica identity (published, the application's
    own UPDATE and DELETE would fail), unless asked to set REPLICA IDENTITY FULL; then identical rows
    are replicated as distinct rows, through the snapshot and the changes after it."""
    tables = ("notes",)
    replication.execute("CREATE TABLE notes (id int, note text)")
    replication.execute("INSERT INTO notes VALUES (1, 'a'), (1, 'z'), (2, 'b'), (2, 'b'), (3, NULL)")
    base = ["cdc", "setup", "--set", f"url={replication.source_url}", "--set", f"slot={replication.slot}"]
    base += ["--set", f"publication={replication.slot}_pub", "--table", "public.notes"]
    assert main(base) == 2
    refused = capsys.readouterr().err
    assert "public.notes have no replica identity" in refused, refused
    assert "--replica-identity-full" in refused
    (published,) = replication.execute(
        f"SELECT count(*) FROM pg_publication WHERE pubname = '{replication.slot}_pub'"
    )
    assert published == (0,), "nothing was set up"
    replication.execute("UPDATE notes SET note = 'b' WHERE id = 2")  # the application still works

    assert main([*base, "--replica-identity-full"]) == 0, capsys.readouterr().err
    assert replication.execute("SELECT relreplident::text FROM pg_class WHERE relname = 'notes'") == [("f",)]

    def multiset(url: str) -> list[tuple[Any, ...]]:
        return replication.execute("SELECT id, note FROM notes ORDER BY id, note NULLS FIRST", url=url)

    async def run_stream() -> list[EpochCertificate]:
        runner = StreamRunner(replication.stream(tables, snapshot=True).build_spec(), replication.store)
        try:
            return await runner.run_epochs(20)
        finally:
            await runner.close()

    asyncio.run(run_stream())  # the snapshot
    assert multiset(replication.target_url) == multiset(replication.source_url)
    replication.execute(
        "DELETE FROM notes WHERE ctid = (SELECT min(ctid) FROM notes WHERE id = 2)",
        "UPDATE notes SET note = 'c' WHERE id = 1 AND note = 'a'",
        "INSERT INTO notes VALUES (3, NULL), (4, 'd'), (4, 'd')",
        "UPDATE notes SET id = 5 WHERE id = 3 AND ctid = (SELECT min(ctid) FROM notes WHERE id = 3)",
    )
    replication.execute(
        "DELETE FROM notes WHERE id = 4 AND ctid = (SELECT max(ctid) FROM notes WHERE id = 4)"
    )
    asyncio.run(run_stream())
    assert multiset(replication.target_url) == multiset(replication.source_url)
    assert multiset(replication.target_url) == [(1, "c"), (1, "z"), (2, "b"), (3, None), (4, "d"), (5, None)]
    certificates = replication.store.certificates(replication.name)
    chained(certificates)
    consistent(certificates)


def test_a_certificate_whose_receipt_reports_divergence_fails_the_certificate_check() -> None:
    domain = OrderingDomain("postgres", "s", "", "1:s:m", "postgres.lsn")

    def certificate(details: dict[str, str]) -> EpochCertificate:
        return EpochCertificate(
            stream="s",
            sequence=1,
            fencing_token=1,
            worker="w",
            coverage=(DomainCoverage(domain, None, "0/10"),),
            receipts=(Receipt("public.orders", 1, 0, details),),
            row_counts={"public.orders": 1},
            digest="d",
            delivery=Delivery.EFFECTIVELY_ONCE,
        )

    assert certificate_problems(certificate({"unexpected_inserts": "0", "unexpected_changes": "0"})) == []
    [problem] = certificate_problems(certificate({"unexpected_inserts": "1", "unexpected_changes": "0"}))
    assert "public.orders diverged from its source (unexpected_inserts 1" in problem
