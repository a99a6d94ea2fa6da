"""The PostgreSQL change source against a real server with wal_level=logical.

Every read goes into :class:`Recorder`, a StreamRecordSink that checks the contract as rows and
controls arrive (rows only inside a transaction, identities at the transaction's position, ordinals
0..n-1, boundaries strictly increasing) and keeps what it saw, so a test can replay the changes onto
a model of the replica and compare it with the source tables row by row.
"""

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

import psycopg
import pyarrow as pa
import pytest
from faucet_postgres import pgoutput
from faucet_postgres.cdc import PostgresCdcSession, PostgresCdcSource, setup_replication
from faucet_postgres.cdc_config import PostgresCdcConfig
from faucet_postgres.codecs import PostgresLsnCodec

from faucet_dagster.pipeline import Pipeline
from faucet_dagster.protocol import (
    OPERATION_COLUMN,
    UNCHANGED_COLUMN,
    CancelToken,
    ConfigError,
    ConnectionFailed,
    Control,
    Coverage,
    DataError,
    Emits,
    EpochId,
    Identities,
    IncarnationChanged,
    IntegrityError,
    Membership,
    Operation,
    Ordering,
    OrderingDomain,
    OwnershipLost,
    Position,
    PositionUnavailable,
    ProgressBoundary,
    ReadLimits,
    Receipt,
    Records,
    Replay,
    SinkBatch,
    SinkCommitState,
    StreamingSinkSession,
    StreamRecordSink,
    TransactionBegin,
    TransactionEnd,
    WorkerIdentity,
    get_connector,
)
from faucet_dagster.testing import PostgresServer

T = TypeVar("T")
LSN = PostgresLsnCodec()
WORKER = WorkerIdentity("w1", 1)
QUIET = ReadLimits(idle=0.4)


def run(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(factory())


async def sql(url: str, *statements: str) -> list[tuple[Any, ...]]:
    """Run ``statements`` in one transaction; return the rows of the last one."""
    async with await psycopg.AsyncConnection.connect(url) as conn:
        rows: list[tuple[Any, ...]] = []
        for statement in statements:
            cursor = await conn.execute(statement)
            rows = await cursor.fetchall() if cursor.description else []
        return rows


async def slot_state(url: str, slot: str) -> tuple[str, str] | None:
    """The slot's (confirmed_flush_lsn, restart_lsn), or None when there is no such slot."""
    rows = await sql(
        url,
        "SELECT confirmed_flush_lsn::text, restart_lsn::text FROM pg_replication_slots "
        f"WHERE slot_name = '{slot}'",
    )
    return (rows[0][0], rows[0][1]) if rows else None


async def confirmed(url: str, slot: str) -> str:
    state = await slot_state(url, slot)
    assert state is not None, f"slot {slot} does not exist"
    return state[0]


def lsn(text: str) -> int:
    return LSN.validate(text)


@dataclass
class Row:
    resource: str
    ordinal: int
    values: dict[str, Any]

    @property
    def op(self) -> str:
        return str(self.values[OPERATION_COLUMN])


@dataclass
class Transaction:
    transaction_id: str
    position: str
    rows: list[Row]


@dataclass
class Recorder(StreamRecordSink):
    """Checks and records what a read hands over; optionally forwards it to ``inner`` (a pipeline)."""

    inner: StreamRecordSink | None = None
    on_write: Callable[["Recorder"], Awaitable[None]] | None = None
    transactions: list[Transaction] = field(default_factory=list)
    boundaries: list[Control] = field(default_factory=list)
    open: TransactionBegin | None = None
    open_rows: list[tuple[Row, str]] = field(default_factory=list)
    write_sizes: list[int] = field(default_factory=list)
    schemas: dict[str, pa.Schema] = field(default_factory=dict)

    async def write(
        self, domain: OrderingDomain, rows: Records, identities: Identities, *, resource: str | None = None
    ) -> None:
        assert self.open is not None, "rows outside a transaction"
        assert isinstance(rows, pa.RecordBatch) and rows.num_rows == len(identities) > 0
        assert resource is not None and identities.ordinals is not None
        self.write_sizes.append(rows.num_rows)
        self.schemas[resource] = rows.schema
        for values, position, ordinal in zip(
            rows.to_pylist(), identities.positions, identities.ordinals, strict=True
        ):
            self.open_rows.append((Row(resource, ordinal, values), position))
        if self.inner is not None:
            await self.inner.write(domain, rows, identities, resource=resource)
        if self.on_write is not None:
            await self.on_write(self)

    async def control(self, control: Control) -> None:
        if isinstance(control, TransactionBegin):
            assert self.open is None, f"{control} inside {self.open}"
            self.open, self.open_rows = control, []
        else:
            if isinstance(control, TransactionEnd):
                assert self.open is not None and self.open.transaction_id == control.transaction_id
                # A group of complete source transactions: each row carries its own commit LSN.
                end = lsn(control.position)
                floor = lsn(self.last_boundary) if self.last_boundary is not None else -1
                assert all(floor < lsn(position) <= end for _, position in self.open_rows)
                positions = sorted({position for _, position in self.open_rows}, key=lsn)
                for position in positions:
                    rows = sorted(
                        (row for row, at in self.open_rows if at == position), key=lambda row: row.ordinal
                    )
                    assert [row.ordinal for row in rows] == list(range(len(rows)))
                    self.transactions.append(Transaction(control.transaction_id, position, rows))
                self.open = None
            else:
                assert isinstance(control, ProgressBoundary) and self.open is None
            if self.boundaries:
                previous = self.boundaries[-1]
                assert isinstance(previous, TransactionEnd | ProgressBoundary)
                assert lsn(control.position) > lsn(previous.position), "boundaries must increase"
            self.boundaries.append(control)
        if self.inner is not None:
            await self.inner.control(control)

    @property
    def last_boundary(self) -> str | None:
        last = self.boundaries[-1] if self.boundaries else None
        return last.position if isinstance(last, TransactionEnd | ProgressBoundary) else None


Replica = dict[str, dict[tuple[Any, ...], dict[str, Any]]]


def apply(replica: Replica, transactions: Sequence[Transaction], keys: dict[str, tuple[str, ...]]) -> None:
    """Apply change rows in order by key, refusing an insert of a present key (an overlap) and an
    update or delete of an absent one (a gap)."""
    for transaction in transactions:
        for row in transaction.rows:
            values = dict(row.values)
            op, unchanged = values.pop(OPERATION_COLUMN), values.pop(UNCHANGED_COLUMN)
            table = replica.setdefault(row.resource, {})
            key = tuple(values[column] for column in keys[row.resource])
            if op == "insert":
                assert key not in table, f"overlap: {row.resource} {key} inserted twice"
                table[key] = values
            elif op == "update":
                assert key in table, f"gap: {row.resource} {key} updated but never inserted"
                for column in unchanged or ():
                    values[column] = table[key][column]
                table[key] = values
            else:
                assert op == "delete" and key in table, f"gap: {row.resource} {key} deleted, absent"
                del table[key]


async def table_rows(
    url: str, table: str, key: Sequence[str], columns: str = "*"
) -> dict[tuple[Any, ...], Any]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cursor = conn.cursor(row_factory=psycopg.rows.dict_row)
        await cursor.execute(f"SELECT {columns} FROM {table}")
        return {tuple(row[column] for column in key): row for row in await cursor.fetchall()}


async def allowed() -> None:
    return None


async def lost() -> None:
    raise OwnershipLost("another worker holds the lease", where="test")


def cdc_config(url: str, slot: str, **settings: Any) -> PostgresCdcConfig:
    settings.setdefault("heartbeat_interval", 0)
    return PostgresCdcConfig(url=url, slot=slot, publication=f"{slot}_pub", **settings)


async def open_session(
    config: PostgresCdcConfig, resume: Sequence[Position] = (), resources: Sequence[str] = ()
) -> PostgresCdcSession:
    return await PostgresCdcSource(config).open(resources, resume, Membership(), WORKER)


async def drain(
    session: PostgresCdcSession, recorder: Recorder, limits: ReadLimits = QUIET
) -> list[Coverage]:
    """Read (acknowledging each read) until a read covers nothing; return the coverages."""
    coverages: list[Coverage] = []
    while not (coverage := await session.read(recorder, limits, CancelToken())).empty:
        if coverages:
            assert coverage.domains[0].start == coverages[-1].domains[0].end, "reads must be contiguous"
        coverages.append(coverage)
        await session.acknowledge(coverage, allowed)
    return coverages


ORDERS = (
    "CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL, total numeric(10,2), meta jsonb, "
    "created timestamptz, photo bytea, paid bool, ref uuid, due date, score float8, small int2, big int8, "
    "at timestamp)"
)
LINES = "CREATE TABLE lines (order_id int, line int, qty int, PRIMARY KEY (order_id, line))"
KEYS = {"public.orders": ("id",), "public.lines": ("order_id", "line")}


def test_mixed_transactions_arrive_whole_and_in_commit_order(postgres_url: str, unique_name: Any) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.orders", "public.lines"))
    workload = [
        # 1: one order and its line items, in one transaction over two tables
        (
            "INSERT INTO orders VALUES (1, 'new', 12.50, '{\"a\": [1, 2]}', '2024-02-03 04:05:06.789+02', "
            "'\\x00ff10', false, 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '2024-02-29', 1.25, 7, 9000000000, "
            "'2024-01-01 00:00:00.5')",
            "INSERT INTO lines VALUES (1, 1, 10), (1, 2, 20), (1, 3, 30)",
        ),
        # 2: updates and a delete and re-insert of the same key
        (
            "UPDATE orders SET status = 'paid', paid = true WHERE id = 1",
            "UPDATE lines SET qty = qty + 1 WHERE order_id = 1 AND line = 1",
            "DELETE FROM lines WHERE order_id = 1 AND line = 2",
            "INSERT INTO lines VALUES (1, 2, 99)",
        ),
        # 3: key changes
        ("UPDATE orders SET id = 10 WHERE id = 1", "UPDATE lines SET order_id = 10 WHERE order_id = 1"),
        # 4: only an unpublished table: no transaction reaches the stream
        ("INSERT INTO audit (note) VALUES ('nothing to replicate')",),
        # 5: 100,000 line items and their order in one transaction
        (
            "INSERT INTO orders (id, status) VALUES (2, 'bulk')",
            "INSERT INTO lines SELECT 2, g, g % 97 FROM generate_series(1, 100000) AS g",
        ),
        # 6: deletes
        ("DELETE FROM lines WHERE order_id = 10", "DELETE FROM orders WHERE id = 10"),
        # 7: the same key updated three times, with nulls
        (
            "UPDATE orders SET status = 'a', total = NULL WHERE id = 2",
            "UPDATE orders SET status = 'b' WHERE id = 2",
            "UPDATE orders SET status = 'c', meta = 'null' WHERE id = 2",
        ),
    ]

    async def scenario() -> tuple[Recorder, list[Coverage], Replica, dict[str, Any]]:
        await sql(postgres_url, ORDERS, LINES, "CREATE TABLE audit (id serial PRIMARY KEY, note text)")
        await setup_replication(config)
        for statements in workload:
            await sql(postgres_url, *statements)
        session = await open_session(config)
        recorder = Recorder()
        coverages = await drain(session, recorder, ReadLimits(records=5_000, idle=0.4))
        await session.close()
        replica: Replica = {}
        apply(replica, recorder.transactions, KEYS)
        source = {name: await table_rows(postgres_url, name, KEYS[name]) for name in KEYS}
        return recorder, coverages, replica, source

    recorder, coverages, replica, source = run(scenario)

    # Every boundary is a transaction end, in commit order, one per source transaction.
    assert all(isinstance(boundary, TransactionEnd) for boundary in recorder.boundaries)
    assert len(recorder.transactions) == 6
    shapes = [[(row.op, row.resource) for row in tx.rows] for tx in recorder.transactions]
    assert shapes[0] == [("insert", "public.orders")] + [("insert", "public.lines")] * 3
    assert shapes[1] == [
        ("update", "public.orders"),
        ("update", "public.lines"),
        ("delete", "public.lines"),
        ("insert", "public.lines"),
    ]
    # A key change is a delete of the old key, then an insert of the new row.
    assert (
        shapes[2]
        == [("delete", "public.orders"), ("insert", "public.orders")]
        + [
            ("delete", "public.lines"),
            ("insert", "public.lines"),
        ]
        * 3
    )
    assert [row.values["order_id"] for row in recorder.transactions[2].rows[2:]] == [1, 10] * 3
    big = recorder.transactions[3]
    assert len(big.rows) == 100_001 and big.rows[0].resource == "public.orders"
    assert [row.values["line"] for row in big.rows[1:]] == list(range(1, 100_001))
    assert shapes[4] == [("delete", "public.lines")] * 3 + [("delete", "public.orders")]
    assert [row.values["status"] for row in recorder.transactions[5].rows] == ["a", "b", "c"]
    # A delete carries the key; the other columns are null.
    deleted_order = recorder.transactions[4].rows[-1].values
    assert deleted_order["id"] == 10 and deleted_order["status"] is None

    # The 100,000-row transaction went over the 5,000-row read limit in pieces, and no read ended
    # inside it: every coverage ends at a transaction end.
    assert {c.domains[0].end for c in coverages} <= {tx.position for tx in recorder.transactions}
    assert max(recorder.write_sizes) <= 10_000 and len(recorder.write_sizes) > 10
    assert sum(recorder.write_sizes) == sum(len(tx.rows) for tx in recorder.transactions)
    assert coverages[-1].domains[0].end == recorder.transactions[-1].position

    # Typed values, and the replica built from the changes equals the source, row by row.
    types = {field.name: field.type for field in recorder.schemas["public.orders"]}
    assert types == {
        "id": pa.int32(),
        "status": pa.string(),
        "total": pa.decimal128(10, 2),
        "meta": pa.string(),
        "created": pa.timestamp("us", tz="UTC"),
        "photo": pa.binary(),
        "paid": pa.bool_(),
        "ref": pa.string(),
        "due": pa.date32(),
        "score": pa.float64(),
        "small": pa.int16(),
        "big": pa.int64(),
        "at": pa.timestamp("us"),
        OPERATION_COLUMN: pa.string(),
        UNCHANGED_COLUMN: pa.list_(pa.string()),
    }
    first = recorder.transactions[0].rows[0].values
    assert first["total"] == Decimal("12.50") and first["photo"] == b"\x00\xff\x10"
    assert first["created"].isoformat() == "2024-02-03T02:05:06.789000+00:00"
    assert first["meta"] == '{"a": [1, 2]}' and first["ref"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert (
        replica["public.lines"] == {key: dict(row) for key, row in source["public.lines"].items()}
        and len(replica["public.lines"]) == 100_000
    )
    (order,) = replica["public.orders"].values()
    expected = dict(source["public.orders"][(2,)])
    expected["meta"] = "null"  # jsonb arrives as its text
    assert order == expected


def test_update_images_under_each_replica_identity(postgres_url: str, unique_name: Any) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.docs", "public.fulls"))
    rng = random.Random(3)
    # Incompressible, so PostgreSQL stores it out of line (TOASTed) rather than compressed in the row.
    big = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(100_000))

    async def scenario() -> tuple[Recorder, Recorder]:
        await sql(
            postgres_url,
            "CREATE TABLE docs (id int PRIMARY KEY, title text, body text)",
            "CREATE TABLE fulls (id int PRIMARY KEY, title text, body text)",
            "ALTER TABLE fulls REPLICA IDENTITY FULL",
        )
        await setup_replication(config)
        for table in ("docs", "fulls"):
            await sql(postgres_url, f"INSERT INTO {table} VALUES (1, 'draft', '{big}')")
            await sql(postgres_url, f"UPDATE {table} SET title = 'final' WHERE id = 1")
        await sql(postgres_url, "UPDATE fulls SET id = 2 WHERE id = 1")
        session = await open_session(config)
        recorder = Recorder()
        await drain(session, recorder)
        # A key change that leaves a TOASTed value out: the insert names it (the sink carries it over).
        await sql(postgres_url, "UPDATE docs SET id = 2 WHERE id = 1")
        moved = Recorder()
        await session.read(moved, QUIET, CancelToken())
        await session.close()
        return recorder, moved

    recorder, moved = run(scenario)
    rows = [row.values for tx in recorder.transactions for row in tx.rows]
    docs_update = rows[1]
    # Default identity: the unchanged TOASTed body is not sent, and named as such.
    assert docs_update[OPERATION_COLUMN] == "update" and docs_update[UNCHANGED_COLUMN] == ["body"]
    assert docs_update["body"] is None and docs_update["title"] == "final"
    # REPLICA IDENTITY FULL: every update is the delete of the whole old row and the insert of the
    # new one (applied as a multiset: a DEFERRABLE key may hold two rows within a transaction), the
    # old row filling in the value the update left out.
    assert [
        (row[OPERATION_COLUMN], row["id"], row["title"], row["body"] == big, row[UNCHANGED_COLUMN])
        for row in rows[3:]
    ] == [
        ("delete", 1, "draft", True, None),
        ("insert", 1, "final", True, None),
        ("delete", 1, "final", True, None),
        ("insert", 2, "final", True, None),
    ]
    [key_change] = moved.transactions
    assert [
        (row.values[OPERATION_COLUMN], row.values["id"], row.values["body"], row.values[UNCHANGED_COLUMN])
        for row in key_change.rows
    ] == [("delete", 1, None, None), ("insert", 2, None, ["body"])]


def test_out_of_band_advance_drop_and_recreation_are_refused(postgres_url: str, unique_name: Any) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",))

    async def certified_session() -> tuple[PostgresCdcSession, list[Position]]:
        session = await open_session(config)
        coverage = await session.read(Recorder(), QUIET, CancelToken())
        await session.acknowledge(coverage, allowed)
        return session, [Position(session.domain, coverage.domains[0].end)]

    async def refused(resume: Sequence[Position]) -> BaseException:
        recorder = Recorder()
        with pytest.raises((PositionUnavailable, IncarnationChanged, ConfigError)) as error:
            session = await open_session(config, resume)
            await session.read(recorder, QUIET, CancelToken())
        assert not recorder.boundaries and not recorder.write_sizes
        return error.value

    async def scenario() -> dict[str, BaseException]:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY)")
        await setup_replication(config)
        await sql(postgres_url, "INSERT INTO t VALUES (1)")
        session, certified = await certified_session()
        await session.close()
        await sql(postgres_url, "INSERT INTO t VALUES (2)")
        errors: dict[str, BaseException] = {}
        # Advanced out of band past the certified position: the transaction in between is gone.
        await sql(postgres_url, f"SELECT pg_replication_slot_advance('{slot}', pg_current_wal_flush_lsn())")
        errors["advanced"] = await refused(certified)
        errors["advanced, never certified"] = await refused(())
        # Dropped.
        await sql(postgres_url, f"SELECT pg_drop_replication_slot('{slot}')")
        errors["dropped"] = await refused(certified)
        errors["dropped, never certified"] = await refused(())
        # Created again out of band under the same name: it starts after the certified position.
        await sql(postgres_url, f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
        errors["recreated"] = await refused(certified)
        # Created again through setup_replication: another incarnation.
        await sql(postgres_url, f"SELECT pg_drop_replication_slot('{slot}')")
        await setup_replication(config)
        errors["set up again"] = await refused(certified)
        # Set up again while a session reads: its acknowledgement is refused, the new slot untouched.
        await sql(postgres_url, "INSERT INTO t VALUES (3)")
        session, _ = await certified_session()
        await sql(postgres_url, "INSERT INTO t VALUES (4)")
        coverage = await session.read(Recorder(), QUIET, CancelToken())
        await sql(postgres_url, f"SELECT pg_drop_replication_slot('{slot}')")
        await setup_replication(config)
        before = await slot_state(postgres_url, slot)
        with pytest.raises(IncarnationChanged) as during:
            await session.acknowledge(coverage, allowed)
        errors["set up again during a session"] = during.value
        assert await slot_state(postgres_url, slot) == before
        await session.close()
        # Advanced out of band while a session reads its copy: its acknowledgement is refused.
        await sql(postgres_url, "INSERT INTO t VALUES (5)")
        session, _ = await certified_session()
        await sql(postgres_url, "INSERT INTO t VALUES (6)")
        coverage = await session.read(Recorder(), QUIET, CancelToken())
        await sql(postgres_url, "INSERT INTO t VALUES (7)")
        await sql(postgres_url, f"SELECT pg_replication_slot_advance('{slot}', pg_current_wal_flush_lsn())")
        with pytest.raises(PositionUnavailable) as advanced:
            await session.acknowledge(coverage, allowed)
        errors["advanced during a session"] = advanced.value
        await session.close()
        return errors

    errors = run(scenario)
    assert {name: type(error) for name, error in errors.items()} == {
        "advanced": PositionUnavailable,
        "advanced, never certified": PositionUnavailable,
        "dropped": PositionUnavailable,
        "dropped, never certified": ConfigError,
        "recreated": PositionUnavailable,
        "set up again": IncarnationChanged,
        "set up again during a session": IncarnationChanged,
        "advanced during a session": PositionUnavailable,
    }
    assert "past the certified" in str(errors["advanced"]) and "dropped" in str(errors["dropped"])


async def wal_status(url: str, slot: str) -> str | None:
    """The slot's ``wal_status`` in pg_replication_slots (None when there is no such slot)."""
    rows = await sql(url, f"SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{slot}'")
    return rows[0][0] if rows else None


async def wal_status_becomes(url: str, slot: str, wanted: str, *, checkpoint: bool) -> str | None:
    """Until the slot's ``wal_status`` is ``wanted`` (a few rounds at most): with ``checkpoint``,
    checkpoint (removing the segments nothing keeps); then write WAL and switch to a new segment.
    Returns the last status seen."""
    status = None
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for _ in range(12):
            if checkpoint:
                await conn.execute("CHECKPOINT")
            status = await wal_status(url, slot)
            if status == wanted:
                break
            await conn.execute("INSERT INTO filler SELECT repeat('x', 200) FROM generate_series(1, 2000)")
            await conn.execute("SELECT pg_switch_wal()")
    return status


async def keep_slot_wal(url: str, size: str | None) -> None:
    """Set the server's ``max_slot_wal_keep_size`` (``None``: reset it to the default, unlimited)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        if size is None:
            await conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
        else:
            await conn.execute(f"ALTER SYSTEM SET max_slot_wal_keep_size = '{size}'")
        await conn.execute("SELECT pg_reload_conf()")


def test_a_slot_whose_wal_was_removed_is_refused_never_skipped(postgres_url: str, unique_name: Any) -> None:
    """PostgreSQL invalidates a slot held back past ``max_slot_wal_keep_size`` at a checkpoint
    (``wal_status`` ``lost``): its changes are gone. Before that (``unreserved``) it is read in full."""
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",))

    async def refused(resume: Sequence[Position]) -> BaseException:
        recorder = Recorder()
        with pytest.raises(PositionUnavailable) as error:
            session = await open_session(config, resume)
            await session.read(recorder, QUIET, CancelToken())
        assert not recorder.boundaries and not recorder.write_sizes
        return error.value

    async def scenario() -> dict[str, BaseException]:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY)", "CREATE TABLE filler (v text)")
        await setup_replication(config)
        await sql(postgres_url, "INSERT INTO t VALUES (1)")
        # Reads and certifies transaction 1, then stays open: its copy starts where the slot is.
        behind = await open_session(config)
        coverage = await behind.read(Recorder(), QUIET, CancelToken())
        await behind.acknowledge(coverage, allowed)
        certified = [Position(behind.domain, coverage.domains[0].end)]
        acknowledged = await confirmed(postgres_url, slot)
        await sql(postgres_url, "INSERT INTO t VALUES (2)")

        await keep_slot_wal(postgres_url, "1MB")
        # Held back past the limit but its WAL still there: unreserved, and read in full.
        status = await wal_status_becomes(postgres_url, slot, "unreserved", checkpoint=False)
        assert status == "unreserved", f"the slot is {status}, not unreserved"
        ahead = await open_session(config, certified)
        # A running-transactions record lets this session's copy move its restart point past the old
        # segments as it reads on, so the copy outlives the slot.
        await sql(postgres_url, "SELECT pg_log_standby_snapshot()")
        await sql(postgres_url, "INSERT INTO t VALUES (3)")
        unreserved = Recorder()
        read_ahead = await ahead.read(unreserved, QUIET, CancelToken())
        assert [[row.values["id"] for row in tx.rows] for tx in unreserved.transactions] == [[2], [3]]

        # The checkpoint removes the old segments and invalidates the slot (and the copy of the session
        # that read nothing since: PostgreSQL terminates its connection).
        status = await wal_status_becomes(postgres_url, slot, "lost", checkpoint=True)
        assert status == "lost", f"the slot is {status}, not lost"
        copies = await sql(
            postgres_url,
            "SELECT wal_status FROM pg_replication_slots WHERE temporary AND database = current_database()",
        )
        assert copies == [("reserved",)], "only the copy that read on survives"

        errors = {"certified": await refused(certified), "never certified": await refused(())}
        await sql(postgres_url, "INSERT INTO t VALUES (4)")
        recorder = Recorder()
        with pytest.raises(ConnectionFailed):  # the server terminated it to invalidate its copy
            await behind.read(recorder, QUIET, CancelToken())
        with pytest.raises(PositionUnavailable) as reattached:  # the next read attaches again
            await behind.read(recorder, QUIET, CancelToken())
        assert not recorder.boundaries and not recorder.write_sizes
        errors["reattached"] = reattached.value
        with pytest.raises(PositionUnavailable) as acknowledging:
            await ahead.acknowledge(read_ahead, allowed)
        errors["acknowledged"] = acknowledging.value
        await behind.close()
        await ahead.close()
        assert await confirmed(postgres_url, slot) == acknowledged, "nothing after 1 was certified"
        return errors

    try:
        errors = run(scenario)
    finally:
        # The server serves the whole test session: undo the setting, drop the slot it invalidated.
        run(lambda: keep_slot_wal(postgres_url, None))
        run(
            lambda: sql(
                postgres_url,
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                f"WHERE slot_name = '{slot}' AND active_pid IS NULL",
            )
        )
    for name in ("certified", "never certified", "reattached"):
        message = str(errors[name])
        assert f"slot {slot} on" in message and "invalidated: the WAL it needs was removed" in message, name
    assert f"slot {slot} cannot be advanced" in str(errors["acknowledged"])
    assert "wal_removed" in str(errors["acknowledged"])


def test_acknowledgement_advances_the_slot_only_after_authority(postgres_url: str, unique_name: Any) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",))

    async def scenario() -> None:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY, v int)")
        created = (await setup_replication(config)).created_lsn
        await sql(postgres_url, "INSERT INTO t VALUES (1, 1)")
        await sql(postgres_url, "UPDATE t SET v = 2 WHERE id = 1")
        session = await open_session(config)
        recorder = Recorder()
        coverage = await session.read(recorder, QUIET, CancelToken())
        end = coverage.domains[0].end
        assert end == recorder.transactions[-1].position and len(recorder.transactions) == 2
        # Reading consumed nothing: the slot is where it was created.
        assert await confirmed(postgres_url, slot) == created

        # Ownership lost: nothing moves.
        with pytest.raises(OwnershipLost):
            await session.acknowledge(coverage, lost)
        assert await confirmed(postgres_url, slot) == created

        seen: list[str] = []

        async def watching() -> None:
            seen.append(await confirmed(postgres_url, slot))

        await session.acknowledge(coverage, watching)
        advanced = await confirmed(postgres_url, slot)
        assert seen == [created], "authority is asked before the slot moves"
        assert lsn(advanced) == lsn(end) + 1
        # Idempotent, and authority is still asked for the suppressed acknowledgement.
        await session.acknowledge(coverage, watching)
        assert seen == [created, advanced]
        with pytest.raises(OwnershipLost):
            await session.acknowledge(coverage, lost)
        await session.close()

        # A new session at the certified position delivers only what came after it.
        await sql(postgres_url, "DELETE FROM t WHERE id = 1")
        session = await open_session(config, [Position(coverage.domains[0].domain, end)])
        after = Recorder()
        await drain(session, after)
        await session.close()
        assert [[row.op for row in tx.rows] for tx in after.transactions] == [["delete"]]

    run(scenario)


def test_cancellation_inside_a_large_transaction_covers_only_finished_ones(
    postgres_url: str, unique_name: Any
) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",), batch_rows=2_000)

    async def scenario() -> None:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY, v text)")
        created = (await setup_replication(config)).created_lsn
        await sql(postgres_url, "INSERT INTO t VALUES (0, 'small')")
        await sql(postgres_url, "INSERT INTO t SELECT g, 'big' FROM generate_series(1, 30000) AS g")
        session = await open_session(config)
        cancel = CancelToken()

        async def cancel_inside_the_big_one(recorder: Recorder) -> None:
            if len(recorder.transactions) == 1 and len(recorder.open_rows) >= 4_000:
                cancel.cancel()

        epoch = Pipeline().begin(EpochId("cdc", 1, 1), Collector(), ())
        first = Recorder(inner=epoch, on_write=cancel_inside_the_big_one)
        coverage = await session.read(first, ReadLimits(idle=5), cancel)
        assert cancel.cancelled and first.open is not None, "cancelled inside the big transaction"
        assert 4_000 <= len(first.open_rows) < 30_000
        assert coverage.domains[0].end == first.transactions[0].position
        assert coverage.domains[0].end == first.last_boundary
        assert await confirmed(postgres_url, slot) == created
        # The pipeline will not seal an epoch with the interrupted transaction open.
        with pytest.raises(IntegrityError, match="still open"):
            await epoch.seal(coverage)

        # The next read delivers the interrupted transaction again, whole, from its beginning.
        second = Recorder()
        again = await session.read(second, QUIET, CancelToken())
        await session.close()
        assert isinstance(second.boundaries[0], TransactionEnd)
        (big,) = second.transactions
        assert big.transaction_id == first.open.transaction_id and len(big.rows) == 30_000
        assert again.domains[0].start == coverage.domains[0].end and again.domains[0].end == big.position

    run(scenario)


def test_a_read_ends_at_a_transaction_end_inside_one_decoding_call(
    postgres_url: str, unique_name: Any
) -> None:
    """A limit reached inside one server call (here 3,000 one-row transactions in one call) ends the
    read at the next transaction end; the next read resumes there, with no gap and no overlap."""
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",), changes_per_call=100_000)

    async def scenario() -> tuple[Recorder, list[Coverage]]:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY)")
        await setup_replication(config)
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            await conn.execute(
                "DO $$ BEGIN FOR g IN 1..3000 LOOP INSERT INTO t VALUES (g); COMMIT; END LOOP; END $$"
            )
        session = await open_session(config)
        recorder = Recorder()
        # A byte limit, which no server call's message count reflects: only the decoding loop sees it.
        coverages = await drain(session, recorder, ReadLimits(bytes=30_000, idle=0.4))
        await session.close()
        return recorder, coverages

    recorder, coverages = run(scenario)
    ids = [row.values["id"] for tx in recorder.transactions for row in tx.rows]
    assert ids == list(range(1, 3001)), "every row once, in commit order"
    assert len(coverages) >= 4, f"{len(coverages)} reads: the limit did not end a read inside the call"
    ends = [coverage.domains[0].end for coverage in coverages]
    assert ends[-1] == recorder.transactions[-1].position
    # Each read ended at a transaction end at or just past its limit (the groups' ends).
    positions = {tx.position for tx in recorder.transactions}
    assert all(end in positions for end in ends)


def test_a_read_with_no_idle_wait_ends_when_caught_up_and_the_next_goes_on(
    postgres_url: str, unique_name: Any
) -> None:
    """``idle=0``: a read returns once a server call decoded all the WAL there was (no wait, and no
    further call to find nothing), and never after a call that stopped at its message count (60 here:
    15 of the 50 transactions); what commits afterwards comes whole in the next read, with no gap and
    no overlap, and a read with nothing new covers nothing."""
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",), changes_per_call=60)
    caught_up = ReadLimits(records=1_000_000, idle=0)

    async def scenario() -> tuple[Recorder, list[Coverage], Coverage]:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY, v int)")
        await setup_replication(config)
        session = await open_session(config)
        recorder = Recorder()
        coverages: list[Coverage] = []
        for round_ in range(3):
            async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
                await conn.execute(
                    f"DO $$ BEGIN FOR g IN {round_ * 50 + 1}..{round_ * 50 + 50} LOOP "
                    "INSERT INTO t VALUES (g, 0); UPDATE t SET v = 1 WHERE id = g; COMMIT; END LOOP; END $$"
                )
            coverage = await session.read(recorder, caught_up, CancelToken())
            await session.acknowledge(coverage, allowed)
            coverages.append(coverage)
        empty = await session.read(recorder, caught_up, CancelToken())
        await session.close()
        return recorder, coverages, empty

    recorder, coverages, empty = run(scenario)
    assert empty.empty, "nothing new: the read covers nothing"
    ids = [(row.values["id"], row.op) for tx in recorder.transactions for row in tx.rows]
    assert ids == [(g, op) for g in range(1, 151) for op in ("insert", "update")], "every change once"
    ends = [coverage.domains[0].end for coverage in coverages]
    assert [coverage.domains[0].start for coverage in coverages[1:]] == ends[:-1], "contiguous reads"
    # Each read ended at the last transaction committed before it.
    committed = [tx.position for tx in recorder.transactions]
    assert len(committed) == 150
    assert ends == [committed[49], committed[99], committed[149]]


def test_a_slow_sink_outlasts_the_servers_idle_and_statement_timeouts(
    postgres_url: str, unique_name: Any
) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",), batch_rows=1_000)

    async def slow(recorder: Recorder) -> None:
        await asyncio.sleep(0.4)  # the pipeline blocked on a slow sink, inside the read's transaction

    async def scenario() -> Recorder:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY)")
        await setup_replication(config)
        ((database,),) = await sql(postgres_url, "SELECT current_database()")
        await sql(
            postgres_url,
            f'ALTER DATABASE "{database}" SET idle_in_transaction_session_timeout = 300',
            f'ALTER DATABASE "{database}" SET statement_timeout = 300',
        )
        await sql(postgres_url, "INSERT INTO t SELECT generate_series(1, 4000)")
        session = await open_session(config)
        recorder = Recorder(on_write=slow)
        await session.read(recorder, QUIET, CancelToken())
        await session.close()
        return recorder

    recorder = run(scenario)
    assert [len(tx.rows) for tx in recorder.transactions] == [4_000] and len(recorder.write_sizes) == 4


def test_a_heartbeat_moves_an_idle_slot_past_unrelated_wal(postgres_url: str, unique_name: Any) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",), heartbeat_interval=0.2)

    async def scenario() -> None:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY)", "CREATE TABLE other (id int)")
        await setup_replication(config)
        before = await slot_state(postgres_url, slot)
        assert before is not None
        # WAL the publication does not carry: no transaction of it reaches the stream.
        for _ in range(5):
            await sql(postgres_url, "INSERT INTO other SELECT generate_series(1, 2000)")
        (written,) = (await sql(postgres_url, "SELECT pg_current_wal_flush_lsn()::text"))[0]
        # A running-transactions record lets the slot's restart point move once acknowledged past it.
        await sql(postgres_url, "SELECT pg_log_standby_snapshot()")
        session = await open_session(config)
        recorder = Recorder()
        coverage = await session.read(recorder, ReadLimits(idle=1.0), CancelToken())
        assert recorder.boundaries and all(isinstance(b, ProgressBoundary) for b in recorder.boundaries)
        assert not recorder.write_sizes
        await session.acknowledge(coverage, allowed)
        await session.close()
        after = await slot_state(postgres_url, slot)
        assert after is not None
        assert lsn(after[0]) > lsn(written) and lsn(after[1]) >= lsn(written) > lsn(before[1])

    run(scenario)


def test_a_read_does_not_wait_for_a_transaction_left_open_mid_record(
    postgres_url: str, unique_name: Any
) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",))

    async def scenario() -> tuple[Recorder, Coverage, bool]:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY)")
        await setup_replication(config)
        await sql(postgres_url, "INSERT INTO t VALUES (1)")
        session = await open_session(config)
        await drain(session, Recorder())
        await sql(postgres_url, "INSERT INTO t VALUES (2)")
        async with await psycopg.AsyncConnection.connect(postgres_url) as blocker:
            # One WAL record of 50 kB in a transaction that stays open: once the WAL writer flushed
            # its whole pages, the flush position lies inside it.
            (before,) = (await sql(postgres_url, "SELECT pg_current_wal_insert_lsn()::text"))[0]
            cursor = await blocker.execute(
                "SELECT pg_logical_emit_message(true, 't', repeat('x', 50000))::text"
            )
            end = await cursor.fetchone()
            assert end is not None
            for _ in range(200):
                (flushed,) = (await sql(postgres_url, "SELECT pg_current_wal_flush_lsn()::text"))[0]
                if lsn(before) + 16_384 < lsn(flushed) < lsn(end[0]):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"the flush position never moved inside the record ({flushed})")
            recorder = Recorder()
            cancel = CancelToken()
            # Only a guard: a read stuck on the open record is interrupted and covers nothing.
            guard = asyncio.get_running_loop().call_later(20, cancel.cancel)
            coverage = await session.read(recorder, QUIET, cancel)
            guard.cancel()
            await session.close()
            await blocker.rollback()
        return recorder, coverage, cancel.cancelled

    recorder, coverage, interrupted = run(scenario)
    assert not interrupted, "the read waited for the open transaction"
    assert [[row.values["id"] for row in tx.rows] for tx in recorder.transactions] == [[2]]
    assert coverage.domains[0].end == recorder.transactions[0].position


def test_snapshot_then_changes_has_no_gap_and_no_overlap_under_concurrent_writes(
    postgres_url: str, unique_name: Any
) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",), snapshot=True, batch_rows=700)

    async def write_forever(stop: asyncio.Event, seed: int, pause_inside: bool) -> int:
        rng = random.Random(seed)
        count = 0
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
            while not stop.is_set():
                key = rng.randrange(3_000)
                async with conn.transaction():
                    await conn.execute(
                        "INSERT INTO t VALUES (%s, 0) ON CONFLICT (id) DO UPDATE SET v = t.v + 1", (key,)
                    )
                    if pause_inside:
                        await asyncio.sleep(0.003)  # keep transactions open across the snapshot point
                    await conn.execute("DELETE FROM t WHERE id = %s", (rng.randrange(3_000),))
                count += 1
        return count

    async def scenario() -> tuple[Recorder, Replica, dict[tuple[Any, ...], Any], int]:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY, v int)")
        await sql(postgres_url, "INSERT INTO t SELECT g, 0 FROM generate_series(0, 2999, 2) AS g")
        await setup_replication(config)
        stop = asyncio.Event()
        writers = [asyncio.create_task(write_forever(stop, seed, seed == 1)) for seed in (1, 2)]
        await asyncio.sleep(0.5)
        session = await open_session(config)
        recorder = Recorder()
        first = await session.read(recorder, ReadLimits(records=1, idle=0.3), CancelToken())
        await asyncio.sleep(0.5)
        stop.set()
        written = sum(await asyncio.gather(*writers))
        await session.acknowledge(first, allowed)
        await drain(session, recorder)
        await session.close()
        replica: Replica = {}
        apply(replica, recorder.transactions, {"public.t": ("id",)})
        return recorder, replica, await table_rows(postgres_url, "t", ("id",)), written

    recorder, replica, source, written = run(scenario)
    snapshot = recorder.transactions[0]
    assert snapshot.transaction_id.startswith("snapshot/")
    assert lsn(snapshot.position) + 1 == lsn(snapshot.transaction_id.split("/", 1)[1])
    assert {row.op for row in snapshot.rows} == {"insert"} and len(snapshot.rows) > 1_000
    assert len(recorder.transactions) > 20 and written > 20, "changes flowed during and after the snapshot"
    assert replica["public.t"] == source


def test_snapshot_rows_and_change_rows_pass_one_pipeline(postgres_url: str, unique_name: Any) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.orders",), snapshot=True)

    async def scenario() -> tuple[list[SinkBatch], Any]:
        await sql(postgres_url, ORDERS)
        await sql(
            postgres_url,
            "INSERT INTO orders (id, status, total, created, photo) "
            "SELECT g, 's' || g, g / 4.0, now(), '\\xbeef' FROM generate_series(1, 50) AS g",
        )
        await setup_replication(config)
        session = await open_session(config)
        collector = Collector()
        pipeline = Pipeline()
        epoch = EpochId("cdc", 1, 1)
        epoch_pipeline = pipeline.begin(epoch, collector, ())
        coverage = await session.read(Recorder(inner=epoch_pipeline), QUIET, CancelToken())
        first = await epoch_pipeline.seal(coverage)
        await session.acknowledge(coverage, allowed)
        await sql(
            postgres_url, "UPDATE orders SET status = 'x' WHERE id < 5", "DELETE FROM orders WHERE id = 9"
        )
        second_epoch = EpochId("cdc", 2, 1)
        second_pipeline = pipeline.begin(
            second_epoch, collector, [Position(session.domain, coverage.domains[0].end)]
        )
        more = await session.read(Recorder(inner=second_pipeline), QUIET, CancelToken())
        sealed = await second_pipeline.seal(more)
        await session.close()
        assert first.row_counts == {"public.orders": 50} and sealed.row_counts == {"public.orders": 5}
        return collector.batches, sealed

    batches, sealed = run(scenario)
    assert len({batch.records.schema for batch in batches}) == 1, "snapshot and changes share one schema"
    ops = [op for batch in batches[1:] for op in batch.records.column(OPERATION_COLUMN).to_pylist()]
    assert ops == ["update"] * 4 + ["delete"]
    assert sealed.digest.startswith("blake2b")


@dataclass
class Collector(StreamingSinkSession):
    """Keeps the batches the pipeline applies (the sink side is not under test here)."""

    batches: list[SinkBatch] = field(default_factory=list)

    async def last_committed(self) -> SinkCommitState | None:
        return None

    async def begin_epoch(self, epoch: EpochId) -> None:
        return None

    async def apply(self, epoch: EpochId, batch: SinkBatch) -> None:
        self.batches.append(batch)

    async def commit_epoch(self, epoch: EpochId, coverage: Coverage) -> tuple[Receipt, ...]:
        return ()

    async def abort_epoch(self, epoch: EpochId) -> None:
        return None

    async def close_session(self) -> None:
        return None


def test_a_bounded_session_stops_at_what_was_committed_when_it_opened(
    postgres_url: str, unique_name: Any
) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",), stop_at_open=True)
    capabilities = PostgresCdcSource(config).capabilities()
    assert capabilities.bounded and not capabilities.continuous

    async def scenario() -> None:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY)")
        await setup_replication(config)
        await sql(postgres_url, "INSERT INTO t VALUES (1)")
        await sql(postgres_url, "INSERT INTO t VALUES (2)")
        session = await open_session(config)
        await sql(postgres_url, "INSERT INTO t VALUES (3)")
        recorder = Recorder()
        coverage = await session.read(recorder, ReadLimits(idle=30), CancelToken())
        assert session.exhausted
        assert [tx.rows[0].values["id"] for tx in recorder.transactions] == [1, 2]
        assert coverage.domains[0].end == recorder.transactions[-1].position
        assert (await session.read(Recorder(), ReadLimits(idle=30), CancelToken())).empty
        await session.close()

        # With a snapshot, the bounded read is the tables at one consistent point (taken by the first
        # read), then nothing.
        snapshot_config = cdc_config(
            postgres_url, f"{slot}_x", tables=("public.t",), snapshot=True, stop_at_open=True
        )
        await setup_replication(snapshot_config)
        session = await open_session(snapshot_config)
        await sql(postgres_url, "DELETE FROM t WHERE id = 1")
        recorder = Recorder()
        coverage = await session.read(recorder, ReadLimits(idle=30), CancelToken())
        await sql(postgres_url, "INSERT INTO t VALUES (4)")
        assert session.exhausted
        ((snapshot),) = recorder.transactions
        assert sorted(row.values["id"] for row in snapshot.rows) == [2, 3]
        assert coverage.domains[0].end == snapshot.position
        assert (await session.read(Recorder(), ReadLimits(idle=30), CancelToken())).empty
        await session.close()

    run(scenario)


def test_resources_select_tables_and_a_truncate_becomes_a_truncate_row(
    postgres_url: str, unique_name: Any
) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.a", "public.b"))

    async def scenario() -> tuple[Recorder, BaseException, Recorder]:
        await sql(postgres_url, "CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY)")
        await setup_replication(config)
        await sql(postgres_url, "INSERT INTO a VALUES (1)", "INSERT INTO b VALUES (1)")
        await sql(postgres_url, "INSERT INTO a VALUES (2)")
        with pytest.raises(ConfigError) as unpublished:
            await open_session(config, resources=["public.nope"])
        session = await open_session(config, resources=["public.b"])
        recorder = Recorder()
        await drain(session, recorder)
        await sql(postgres_url, "TRUNCATE a, b")
        truncated = Recorder()
        await session.read(truncated, QUIET, CancelToken())
        await session.close()
        return recorder, unpublished.value, truncated

    recorder, unpublished, truncated = run(scenario)
    # The transaction touching only table a is read too: the group ends at its commit, past b's row.
    assert [[row.resource for row in tx.rows] for tx in recorder.transactions] == [["public.b"]]
    assert len(recorder.boundaries) == 1 and isinstance(recorder.boundaries[0], TransactionEnd)
    assert lsn(recorder.boundaries[0].position) > lsn(recorder.transactions[0].position)
    assert "public.nope" in str(unpublished)
    # A TRUNCATE is one truncate row per selected table, every data column null.
    [truncate] = truncated.transactions
    assert [(row.resource, row.values[OPERATION_COLUMN], row.values["id"]) for row in truncate.rows] == [
        ("public.b", "truncate", None)
    ]


def test_a_worker_that_does_not_own_the_slot_reads_nothing(postgres_url: str, unique_name: Any) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot, tables=("public.t",))
    membership = Membership(member=1, members=2)
    if membership.owns(slot, ""):
        membership = Membership(member=0, members=2)

    async def scenario() -> None:
        await sql(postgres_url, "CREATE TABLE t (id int PRIMARY KEY)")
        await setup_replication(config)
        await sql(postgres_url, "INSERT INTO t VALUES (1)")
        session = await PostgresCdcSource(config).open((), (), membership, WORKER)
        recorder = Recorder()
        assert (await session.read(recorder, ReadLimits(idle=0.2), CancelToken())).empty
        await session.close()
        assert not recorder.boundaries

    run(scenario)


def test_setup_is_idempotent_and_names_what_is_wrong(postgres_url: str, unique_name: Any) -> None:
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot)

    async def scenario() -> None:
        await sql(postgres_url, "CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY)")
        with pytest.raises(ConfigError, match=r"public\.missing"):
            await setup_replication(config, ["public.a", "public.missing"])
        with pytest.raises(ConfigError, match="does not exist"):
            await open_session(config)
        first = await setup_replication(config, ["public.a"])
        again = await setup_replication(config, ["public.a", "public.b"])
        assert first.slot_created and first.publication_created
        assert not again.slot_created and not again.publication_created
        assert again.incarnation == first.incarnation and again.created_lsn == first.created_lsn
        assert again.tables == ("public.a", "public.b")
        session = await open_session(config)
        assert session.domain.incarnation == first.incarnation
        await session.close()

    run(scenario)


def test_a_table_without_a_replica_identity_is_refused_at_setup_and_at_open(
    postgres_url: str, unique_name: Any
) -> None:
    """Published, a table without a primary key or replica identity breaks the application's UPDATE
    and DELETE, and its changes have no key: setup refuses it (unless asked for FULL), and a session
    refuses one added to the publication by hand."""
    slot = unique_name("s")
    config = cdc_config(postgres_url, slot)

    async def scenario() -> None:
        await sql(
            postgres_url, "CREATE TABLE keyed (id int PRIMARY KEY)", "CREATE TABLE bare (id int, v text)"
        )
        await sql(
            postgres_url,
            "CREATE TABLE nothing (id int PRIMARY KEY)",
            "ALTER TABLE nothing REPLICA IDENTITY NOTHING",
        )
        with pytest.raises(
            ConfigError, match=r"public\.bare, public\.nothing have no replica identity.*FULL"
        ):
            await setup_replication(config, ["public.keyed", "public.bare", "public.nothing"])
        assert await sql(postgres_url, f"SELECT 1 FROM pg_publication WHERE pubname = '{slot}_pub'") == []
        await setup_replication(config, ["public.keyed"])
        await sql(postgres_url, f"ALTER PUBLICATION {slot}_pub ADD TABLE bare")
        with pytest.raises(ConfigError, match=r"public\.bare have no replica identity"):
            await open_session(config)
        session = await open_session(config, resources=["public.keyed"])  # the others are not read
        await session.close()
        await setup_replication(config.model_copy(update={"replica_identity_full": True}), ["public.bare"])
        assert await sql(postgres_url, "SELECT relreplident::text FROM pg_class WHERE relname = 'bare'") == [
            ("f",)
        ]
        await (await open_session(config)).close()

    run(scenario)


def test_setup_and_open_refuse_a_server_without_logical_wal(unique_name: Any) -> None:
    server = PostgresServer(settings={"wal_level": "replica"})
    try:
        server.start()
        url = server.create_database(unique_name("db"))
        config = cdc_config(url, unique_name("s"), tables=("public.t",))

        async def scenario() -> tuple[BaseException, BaseException]:
            await sql(url, "CREATE TABLE t (id int PRIMARY KEY)")
            with pytest.raises(ConfigError) as setup:
                await setup_replication(config)
            with pytest.raises(ConfigError) as opened:
                await open_session(config)
            return setup.value, opened.value

        setup, opened = run(scenario)
    finally:
        server.close()
    assert "wal_level is 'replica'" in str(setup) and "wal_level = logical" in str(opened)


def test_registered_as_the_postgres_stream_source_with_honest_capabilities() -> None:
    source = get_connector("postgres").stream_source(
        {"url": "postgresql://app@db.invalid/shop", "slot": "orders_cdc", "publication": "orders_pub"}
    )
    assert isinstance(source, PostgresCdcSource)
    capabilities = source.capabilities()
    assert capabilities.emits is Emits.CHANGES and capabilities.ordering is Ordering.STRICT_GLOBAL
    assert capabilities.operations == {
        Operation.INSERT,
        Operation.UPDATE,
        Operation.DELETE,
        Operation.TRUNCATE,
    }
    assert capabilities.replay is Replay.REPLAYABLE_AT_LEAST_ONCE and capabilities.continuous
    assert capabilities.transaction_boundaries and capabilities.event_identity and capabilities.deterministic
    assert [codec.name for codec in source.codecs()] == ["postgres.lsn"]
    # A snapshot is taken anew on each attempt: not deterministic (the runner never re-reads it).
    snapshot = {"url": "postgresql://app@db.invalid/shop", "slot": "s", "publication": "p", "snapshot": True}
    assert not get_connector("postgres").stream_source(snapshot).capabilities().deterministic
    with pytest.raises(ConfigError, match="slot"):
        get_connector("postgres").stream_source(
            {"url": "postgresql://app@db/shop", "slot": "Bad-Name", "publication": "p"}
        )


def test_malformed_pgoutput_messages_stop_decoding() -> None:
    for data in (b"", b"Z\x00", b"B\x00\x01", b"I\x00\x00\x40\x00X\x00\x01t\x00\x00\x00\x05ab"):
        with pytest.raises(IntegrityError):
            pgoutput.decode(data)
    column = pgoutput.Column("at", 1184, -1, False)
    with pytest.raises(DataError, match="column 'at'"):
        pgoutput.column_array(pa.array(["not a time"]), column, "table public.t")
