"""APPLY_CHANGES on the PostgreSQL sinks, against the real PostgreSQL of the test session.

Change rows are built here as the PostgreSQL change source shapes them (``__faucet_op``,
``__faucet_unchanged``, ``faucet.key`` field metadata, one LSN per transaction and an ordinal per
row); the end-to-end path from a real slot is in ``tests/test_stream_postgres_cdc.py``. The planner
verdicts use the real connectors' declared capabilities.
"""

import asyncio
from collections.abc import Sequence
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from faucet_postgres.config import PostgresSinkConfig, PostgresStreamingSinkConfig
from faucet_postgres.sink import PostgresSink
from faucet_postgres.stream_sink import PostgresStreamingSink, PostgresStreamingSinkSession

from faucet_dagster.planner import Code, plan
from faucet_dagster.protocol import (
    OPERATION_COLUMN,
    UNCHANGED_COLUMN,
    CommitToken,
    ConfigError,
    Coverage,
    DataError,
    DomainCoverage,
    EpochId,
    Identities,
    IntegrityError,
    Mode,
    Operation,
    OrderingDomain,
    PlanError,
    SchemaError,
    SinkBatch,
    WorkerIdentity,
    WritePolicy,
    get_connector,
)

STREAM = "changes_stream"
DOMAIN = OrderingDomain("postgres", "slot", "", "7000:slot:marker", "postgres.lsn")
WORKER = WorkerIdentity("worker-a", 1)
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int32(), metadata={"faucet.key": "true"}),
        pa.field("title", pa.string(), metadata={"faucet.key": "false"}),
        pa.field("body", pa.string(), metadata={"faucet.key": "false"}),
        pa.field(OPERATION_COLUMN, pa.string()),
        pa.field(UNCHANGED_COLUMN, pa.list_(pa.string())),
    ]
)
Change = tuple[str, int | None, str | None, str | None, list[str] | None]
"""(operation, id, title, body, unchanged columns); a truncate has no id."""


def lsn(n: int) -> str:
    return f"0/{n:X}"


def changes(
    at: EpochId, transactions: Sequence[tuple[int, Sequence[Change]]], resource: str = "docs"
) -> SinkBatch:
    """One batch holding ``transactions``: (commit LSN as an int, its changes in source order)."""
    rows, positions, ordinals = [], [], []
    for commit, items in transactions:
        for ordinal, (op, key, title, body, unchanged) in enumerate(items):
            rows.append(
                {"id": key, "title": title, "body": body, OPERATION_COLUMN: op, UNCHANGED_COLUMN: unchanged}
            )
            positions.append(lsn(commit))
            ordinals.append(ordinal)
    records = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
    return SinkBatch(at, resource, DOMAIN, records, Identities(positions, ordinals))


def covering(start: int | None, end: int) -> Coverage:
    return Coverage((DomainCoverage(DOMAIN, None if start is None else lsn(start), lsn(end)),))


def sink_for(url: str, **settings: Any) -> PostgresStreamingSink:
    return PostgresStreamingSink(PostgresStreamingSinkConfig(url=url, table="docs", **settings))


def docs(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT id, title, body FROM docs ORDER BY id").fetchall()


async def open_session(url: str, key: Sequence[str] = ()) -> PostgresStreamingSinkSession:
    return await sink_for(url).open(STREAM, WritePolicy.APPLY_CHANGES, key, WORKER)


def test_changes_apply_by_key_in_commit_order_whatever_order_the_batches_arrive(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await open_session(postgres_url)
        try:
            first = EpochId(STREAM, 1, 1)
            await session.begin_epoch(first)
            # The later transaction's batch arrives first (another resource's builder flushed first).
            await session.apply(
                first,
                changes(
                    first,
                    [(0x30, [("update", 1, "third", "b1", None), ("delete", 2, None, None, None)])],
                    resource="docs_copy",
                ),
            )
            await session.apply(
                first,
                changes(
                    first,
                    [
                        (0x10, [("insert", 1, "first", "b1", None), ("insert", 2, "x", "b2", None)]),
                        # insert, update, delete and insert again of one key in one transaction
                        (
                            0x20,
                            [
                                ("update", 1, "second", "b1", None),
                                ("insert", 3, "a", "b3", None),
                                ("update", 3, "b", "b3", None),
                                ("delete", 3, None, None, None),
                                ("insert", 3, "c", "b3", None),
                                # a key change: delete of the old key, insert of the new row
                                ("delete", 2, None, None, None),
                                ("insert", 20, "x", "b2", None),
                            ],
                        ),
                    ],
                ),
            )
            receipts = await session.commit_epoch(first, covering(None, 0x30))
            assert sum(r.rows_written for r in receipts) == 11
            details = receipts[0].details
            assert (details["rows_inserted"], details["rows_updated"], details["rows_deleted"]) == (
                "3",
                "0",
                "0",
            )
            assert details["unexpected_inserts"] == details["unexpected_changes"] == "0"
            # The next epoch: deletes and updates of present keys, and (first) a delete of an absent one.
            second = EpochId(STREAM, 2, 1)
            present: list[Change] = [("delete", 3, None, None, None), ("update", 20, "y", "b2", None)]
            absent: list[Change] = [("delete", 99, None, None, None)]
            for extra in (absent, []):
                await session.begin_epoch(second)
                await session.apply(
                    second,
                    changes(second, [(0x40, present), (0x50, [*extra, ("insert", 4, "new", None, None)])]),
                )
                if extra:
                    # A delete of a key the replica lacks: it diverged, so nothing of the epoch is committed.
                    with pytest.raises(
                        IntegrityError, match=r"diverged.*0 insert\(s\).*1 update\(s\).*, key \(99\);"
                    ):
                        await session.commit_epoch(second, covering(0x30, 0x50))
                    await session.abort_epoch(second)
            [receipt] = await session.commit_epoch(second, covering(0x30, 0x50))
            assert receipt.details["rows_deleted"] == "1" and receipt.details["rows_updated"] == "1"
        finally:
            await session.close_session()

    run(scenario())
    assert docs(postgres_url) == [(1, "third", "b1"), (4, "new", None), (20, "y", "b2")]


def test_rows_of_a_table_without_a_key_are_applied_as_a_multiset(postgres_url: str) -> None:
    """Every column marked key (a table without a primary key under REPLICA IDENTITY FULL): identical
    rows stay distinct rows, a delete removes exactly one, nulls are values, and a delete of a row
    the replica lacks refuses the epoch."""
    schema = pa.schema(
        [
            pa.field("id", pa.int32(), metadata={"faucet.key": "true"}),
            pa.field("note", pa.string(), metadata={"faucet.key": "true"}),
            pa.field(OPERATION_COLUMN, pa.string()),
            pa.field(UNCHANGED_COLUMN, pa.list_(pa.string())),
        ]
    )

    def rows(at: EpochId, commit: int, items: Sequence[tuple[str, int, str | None]]) -> SinkBatch:
        records = pa.RecordBatch.from_pylist(
            [{"id": i, "note": note, OPERATION_COLUMN: op, UNCHANGED_COLUMN: None} for op, i, note in items],
            schema=schema,
        )
        return SinkBatch(
            at, "notes", DOMAIN, records, Identities([lsn(commit)] * len(items), range(len(items)))
        )

    async def scenario() -> None:
        sink = PostgresStreamingSink(PostgresStreamingSinkConfig(url=postgres_url, table="notes"))
        session = await sink.open(STREAM, WritePolicy.APPLY_CHANGES, (), WORKER)
        try:
            first = EpochId(STREAM, 1, 1)
            await session.begin_epoch(first)
            seed = [("insert", 1, "a"), ("insert", 1, "z"), ("insert", 2, "b"), ("insert", 2, "b")]
            await session.apply(first, rows(first, 0x10, [*seed, ("insert", 3, None), ("insert", 3, None)]))
            [receipt] = await session.commit_epoch(first, covering(None, 0x10))
            assert receipt.details["rows_inserted"] == "6"
            second = EpochId(STREAM, 2, 1)
            await session.begin_epoch(second)
            # One (2,b) deleted; (1,a) becomes (1,c) (a delete and an insert); one (3,NULL) deleted; an
            # identical row inserted and deleted again within the epoch.
            await session.apply(second, rows(second, 0x20, [("delete", 2, "b"), ("delete", 1, "a")]))
            await session.apply(second, rows(second, 0x30, [("insert", 1, "c"), ("delete", 3, None)]))
            await session.apply(second, rows(second, 0x40, [("insert", 1, "z"), ("delete", 1, "z")]))
            [receipt] = await session.commit_epoch(second, covering(0x10, 0x40))
            assert (receipt.details["rows_inserted"], receipt.details["rows_deleted"]) == ("1", "3")
            third = EpochId(STREAM, 3, 1)
            await session.begin_epoch(third)
            await session.apply(
                third, rows(third, 0x50, [("insert", 7, "x"), ("delete", 2, "b"), ("delete", 2, "b")])
            )
            with pytest.raises(
                IntegrityError,
                match=r"diverged.*0 insert\(s\).*1 update\(s\) or delete\(s\) of rows it lacked;",
            ):
                await session.commit_epoch(third, covering(0x40, 0x50))
            await session.abort_epoch(third)
        finally:
            await session.close_session()

    run(scenario())
    with psycopg.connect(postgres_url) as conn:
        stored = conn.execute("SELECT id, note FROM notes ORDER BY id, note").fetchall()
        (keys,) = conn.execute(
            "SELECT count(*) FROM pg_index WHERE indrelid = 'notes'::regclass AND indisprimary"
        ).fetchone() or (None,)
    assert stored == [(1, "c"), (1, "z"), (2, "b"), (3, None)]
    assert keys == 0, "a table created for rows without a key has no primary key"


def test_unchanged_columns_keep_the_destination_value_or_the_latest_earlier_one(postgres_url: str) -> None:
    async def scenario() -> None:
        session = await open_session(postgres_url)
        try:
            first = EpochId(STREAM, 1, 1)
            await session.begin_epoch(first)
            await session.apply(first, changes(first, [(0x10, [("insert", 1, "t", "big-1", None)])]))
            await session.commit_epoch(first, covering(None, 0x10))
            second = EpochId(STREAM, 2, 1)
            await session.begin_epoch(second)
            await session.apply(
                second,
                changes(
                    second,
                    [
                        # kept from the destination
                        (0x20, [("update", 1, "t2", None, ["body"])]),
                        # filled from an earlier change of the same epoch, across transactions...
                        (0x30, [("insert", 2, "u", "big-2", None)]),
                        (0x40, [("update", 2, "u2", None, ["body"]), ("update", 2, "u3", None, ["body"])]),
                        # ...and never from before a delete: the insert after it carries the value
                        (0x50, [("insert", 3, "v", "old", None), ("delete", 3, None, None, None)]),
                        (0x60, [("insert", 3, "w", "new", None), ("update", 3, "w2", None, ["body"])]),
                    ],
                ),
            )
            await session.commit_epoch(second, covering(0x10, 0x60))
            # An update of a key the destination lacks, with a value left out: known nowhere.
            third = EpochId(STREAM, 3, 1)
            await session.begin_epoch(third)
            await session.apply(third, changes(third, [(0x70, [("update", 9, "lost", None, ["body"])])]))
            with pytest.raises(IntegrityError, match="known nowhere"):
                await session.commit_epoch(third, covering(0x60, 0x70))
            await session.abort_epoch(third)
        finally:
            await session.close_session()

    run(scenario())
    assert docs(postgres_url) == [(1, "t2", "big-1"), (2, "u3", "big-2"), (3, "w2", "new")]


def test_a_replayed_epoch_is_skipped_below_the_watermark(postgres_url: str) -> None:
    history: list[tuple[int, list[Change]]] = [
        (0x10, [("insert", 1, "a", "x", None)]),
        (0x20, [("update", 1, "b", "x", None)]),
        (0x30, [("delete", 1, None, None, None), ("insert", 2, "c", "y", None)]),
    ]

    async def scenario() -> None:
        session = await open_session(postgres_url)
        try:
            first = EpochId(STREAM, 1, 1)
            await session.begin_epoch(first)
            await session.apply(first, changes(first, history[:2]))
            await session.commit_epoch(first, covering(None, 0x20))
            # The epoch is read again from the start (its certificate was lost) and on further.
            replay = EpochId(STREAM, 2, 1)
            await session.begin_epoch(replay)
            await session.apply(replay, changes(replay, history))
            [receipt] = await session.commit_epoch(replay, covering(None, 0x30))
            assert (receipt.rows_written, receipt.rows_skipped) == (2, 2)
            assert receipt.details["unexpected_inserts"] == receipt.details["unexpected_changes"] == "0"
        finally:
            await session.close_session()

    run(scenario())
    assert docs(postgres_url) == [(2, "c", "y")]


def test_keys_operations_and_orders_that_cannot_be_applied_are_refused(postgres_url: str) -> None:
    unkeyed = pa.schema([field.remove_metadata() for field in SCHEMA])

    def reshaped(batch: SinkBatch, schema: pa.Schema) -> SinkBatch:
        return SinkBatch(
            batch.epoch, batch.resource, batch.domain, batch.records.cast(schema), batch.identities
        )

    async def refused(*batches: SinkBatch, key: Sequence[str] = ()) -> BaseException:
        """Apply ``batches`` in one epoch: all but the last are accepted, the last is refused."""
        session = await open_session(postgres_url, key)
        at = batches[0].epoch
        try:
            await session.begin_epoch(at)
            for batch in batches[:-1]:
                await session.apply(at, batch)
            with pytest.raises((ConfigError, DataError, IntegrityError, SchemaError)) as caught:
                await session.apply(at, batches[-1])
            await session.abort_epoch(at)
            return caught.value
        finally:
            await session.close_session()

    async def scenario() -> dict[str, BaseException]:
        at = EpochId(STREAM, 1, 1)
        good = changes(at, [(0x10, [("insert", 1, "a", "x", None)])])
        sequences = OrderingDomain("nats", "s", "", "x", "nats.stream_sequence")
        return {
            "no key": await refused(reshaped(good, unkeyed)),
            "bad op": await refused(changes(at, [(0x10, [("upsert", 1, "a", "x", None)])])),
            "null key": await refused(changes(at, [(0x10, [("delete", None, None, None, None)])])),
            "configured key": await refused(reshaped(good, unkeyed), key=("id", "nope")),
            "two domains": await refused(
                good, SinkBatch(at, "docs", sequences, good.records, Identities(["5"]))
            ),
            "position past bigint": await refused(
                SinkBatch(at, "docs", DOMAIN, good.records, Identities(["FFFFFFFF/FFFFFFFF"], [0]))
            ),
        }

    errors = run(scenario())
    assert isinstance(errors["no key"], ConfigError) and "faucet.key" in str(errors["no key"])
    assert isinstance(errors["bad op"], DataError) and "'upsert'" in str(errors["bad op"])
    assert isinstance(errors["null key"], DataError) and "key column(s) id" in str(errors["null key"])
    assert "nope" in str(errors["configured key"])
    assert isinstance(errors["two domains"], IntegrityError) and "no common order" in str(
        errors["two domains"]
    )
    past = errors["position past bigint"]
    assert isinstance(past, IntegrityError) and "'FFFFFFFF/FFFFFFFF'" in str(past) and "64-bit" in str(past)
    with psycopg.connect(postgres_url) as conn:
        created = conn.execute("SELECT to_regclass('docs')").fetchone()
    assert created == (None,), "nothing of a refused epoch remains, not even the table it created"


def test_a_staged_value_the_server_refuses_names_its_lsn_and_the_epoch_commits_nothing(
    postgres_url: str,
) -> None:
    async def scenario() -> None:
        session = await open_session(postgres_url)
        try:
            at = EpochId(STREAM, 1, 1)
            await session.begin_epoch(at)
            await session.apply(
                at,
                changes(
                    at,
                    [
                        (0x10, [("insert", 1, "one", "b1", None), ("insert", 2, "two", "b2", None)]),
                        (0x20, [("insert", 3, "three", "bad\u0000body", None)]),  # NUL: refused by text
                    ],
                ),
            )
            with pytest.raises(DataError) as raised:
                await session.commit_epoch(at, covering(None, 0x20))
            error = raised.value
            assert error.where is not None and error.where.endswith(f"@{lsn(0x20)}#0"), error.where
            assert "22021" in error.message, error.message  # invalid byte sequence: 0x00
            await session.abort_epoch(at)
        finally:
            await session.close_session()

    with psycopg.connect(postgres_url) as conn:
        conn.execute("CREATE TABLE docs (id int PRIMARY KEY, title text, body text)")
    run(scenario())
    assert docs(postgres_url) == [], "the epoch is atomic"


def test_the_bounded_sink_applies_pages_of_changes_in_row_order_and_skips_replays(postgres_url: str) -> None:
    def page(items: Sequence[Change]) -> pa.RecordBatch:
        return changes(EpochId(STREAM, 1, 1), [(0x10, items)]).records

    first = page(
        [("insert", 1, "a", "x", None), ("insert", 2, "b", "y", None), ("update", 1, "a2", None, ["body"])]
    )
    second = page(
        [("delete", 2, None, None, None), ("insert", 2, "c", "z", None), ("insert", 3, "d", None, None)]
    )

    async def scenario() -> list[int]:
        sink = PostgresSink(PostgresSinkConfig(url=postgres_url, table="docs", mode="apply_changes"))
        try:
            assert sink.capabilities().bounded_policies == {WritePolicy.APPLY_CHANGES}
            return [
                await sink.write_batch_idempotent(first, CommitToken(1)),
                await sink.write_batch_idempotent(second, CommitToken(2)),
                await sink.write_batch_idempotent(first, CommitToken(1)),  # a replayed page
            ]
        finally:
            await sink.close()

    assert run(scenario()) == [3, 3, 0]
    assert docs(postgres_url) == [(1, "a2", "x"), (2, "c", "z"), (3, "d", None)]


def test_truncates_and_key_changes_that_leave_values_out_apply_in_commit_order(postgres_url: str) -> None:
    """A truncate removes what the table held before it (earlier staged changes included); the insert
    of a key change that names unchanged columns takes the old key's values: from an earlier change in
    the epoch, else the destination's row, following a chain of key changes; nowhere: refused."""

    async def scenario() -> list[Any]:
        session = await open_session(postgres_url)
        try:
            first = EpochId(STREAM, 1, 1)
            await session.begin_epoch(first)
            await session.apply(
                first,
                changes(first, [(0x10, [("insert", key, "t", f"body-{key}", None) for key in (1, 2, 3)])]),
            )
            await session.commit_epoch(first, covering(None, 0x10))
            second = EpochId(STREAM, 2, 1)
            await session.begin_epoch(second)
            moved: Sequence[tuple[int, Sequence[Change]]] = [
                # 1 -> 10 -> 11 in one epoch: the body comes from the destination's row 1.
                (0x20, [("delete", 1, None, None, None), ("insert", 10, "moved", None, ["body"])]),
                (0x30, [("delete", 10, None, None, None), ("insert", 11, "again", None, ["body"])]),
                # 4 is inserted, updated leaving the body out, then moved: the body of its insert.
                (0x40, [("insert", 4, "four", "body-4", None), ("update", 4, "four'", None, ["body"])]),
                (0x50, [("delete", 4, None, None, None), ("insert", 40, "forty", None, ["body"])]),
            ]
            await session.apply(second, changes(second, moved))
            [receipt] = await session.commit_epoch(second, covering(0x10, 0x50))
            assert receipt.details["unexpected_inserts"] == receipt.details["unexpected_changes"] == "0"
            third = EpochId(STREAM, 3, 1)
            await session.begin_epoch(third)
            truncated: Sequence[tuple[int, Sequence[Change]]] = [
                (0x60, [("update", 2, "gone", "gone", None), ("insert", 5, "gone", "gone", None)]),
                (0x70, [("truncate", None, None, None, None)]),
                (0x80, [("insert", 2, "after", "b", None)]),
            ]
            await session.apply(third, changes(third, truncated))
            [receipt] = await session.commit_epoch(third, covering(0x50, 0x80))
            assert receipt.details["rows_truncated"] == "4"  # 2, 3, 11, 40
            assert receipt.details["rows_inserted"] == "1"
            # A key change whose old key is nowhere (not in the epoch, not in the destination).
            fourth = EpochId(STREAM, 4, 1)
            await session.begin_epoch(fourth)
            lost = [(0x90, [("delete", 77, None, None, None), ("insert", 78, "x", None, ["body"])])]
            await session.apply(fourth, changes(fourth, lost))
            with pytest.raises(IntegrityError, match="known nowhere"):
                await session.commit_epoch(fourth, covering(0x80, 0x90))
            await session.abort_epoch(fourth)
            return docs(postgres_url)
        finally:
            await session.close_session()

    after_moves_and_truncate = run(scenario())
    assert after_moves_and_truncate == [(2, "after", "b")]


def test_the_planner_accepts_apply_changes_only_from_the_change_source() -> None:
    postgres = get_connector("postgres")
    sink = postgres.streaming_sink(
        {"url": "postgresql://app@db.invalid/replica", "table": "t"}
    ).capabilities()
    assert sink.continuous_policies >= {WritePolicy.APPLY_CHANGES}
    assert sink.operations_for(WritePolicy.APPLY_CHANGES) == {
        Operation.INSERT,
        Operation.UPDATE,
        Operation.DELETE,
        Operation.TRUNCATE,
    }
    cdc = postgres.stream_source(
        {"url": "postgresql://app@db.invalid/shop", "slot": "shop", "publication": "shop_pub"}
    ).capabilities()
    accepted = plan(cdc, sink, Mode.CONTINUOUS, WritePolicy.APPLY_CHANGES)
    assert accepted.delivery.value == "effectively_once" and accepted.key == ()
    kafka = get_connector("kafka").stream_source(
        {"bootstrap_servers": "kafka.invalid:9092", "topics": ["orders"], "group_id": "g"}
    )
    nats = get_connector("nats").stream_source({"servers": ["nats://nats.invalid:4222"], "stream": "ORDERS"})
    verdicts = {}
    for name, source in (("kafka", kafka), ("nats", nats)):
        with pytest.raises(PlanError) as caught:
            plan(source.capabilities(), sink, Mode.CONTINUOUS, WritePolicy.APPLY_CHANGES, ("id",))
        verdicts[name] = caught.value
    assert set(verdicts["kafka"].codes) == {Code.ORDER_DEPENDENT_POLICY, Code.CHANGES_REQUIRED}
    assert "only guarantees partition order" in str(verdicts["kafka"])
    assert verdicts["nats"].codes == (Code.CHANGES_REQUIRED,)
    assert "the source emits messages, not changes" in str(verdicts["nats"])


def run(coro: Any) -> Any:
    return asyncio.run(coro)
