"""The PostgreSQL bounded source and sink against the real PostgreSQL of faucet_dagster.testing."""

import asyncio
import datetime as dt
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import psycopg
import pyarrow as pa
import pytest
from faucet_postgres.common import table_columns
from faucet_postgres.copy_arrow import COPY_SLICE_ROWS, FIRST_SLICE_ROWS, copy_slices, encode_copy
from faucet_postgres.sink import PostgresSink
from psycopg import sql

from faucet_dagster.protocol import (
    AddColumn,
    CommitToken,
    ConfigError,
    ConnectionFailed,
    DataError,
    JsonValue,
    Role,
    SchemaError,
    Sink,
    Source,
    UnsupportedOperation,
    WritePolicy,
    get_connector,
)

INJECTION = 'x"; DROP TABLE victim; --'


def source(url: str, **config: Any) -> Source:
    return get_connector("postgres").source({"url": url, **config})


def sink(url: str, **config: Any) -> Sink:
    return get_connector("postgres").sink({"url": url, **config})


@pytest.fixture
def conn(postgres_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        yield connection


def rows(conn: psycopg.Connection[Any], table: str, order: str = "id") -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT * FROM {} ORDER BY {}").format(sql.Identifier(table), sql.Identifier(order))
    return conn.execute(query).fetchall()


def tables(conn: psycopg.Connection[Any]) -> set[str]:
    found = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {row[0] for row in found}


async def read_all(src: Source, batch_size: int) -> list[pa.RecordBatch]:
    pages = []
    async for page in src.stream_pages({}, batch_size):
        assert isinstance(page.records, pa.RecordBatch)
        assert batch_size == 0 or page.num_rows <= batch_size
        pages.append(page.records)
    return pages


async def write_all(dst: Sink, *batches: pa.RecordBatch) -> int:
    written = 0
    for batch in batches:
        written += await dst.write_batch(batch)
    await dst.flush()
    await dst.finish()
    await dst.close()
    return written


def test_configs_are_valid_json_schemas_and_keep_secrets_out() -> None:
    spec = get_connector("postgres")
    for role in (Role.SOURCE, Role.SINK):
        jsonschema.Draft202012Validator.check_schema(spec.roles[role].config_model.json_schema())
    with pytest.raises(ConfigError) as info:
        sink("postgresql://app:hunter2@db/x", table="t")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError, match="credentials_file"):
        sink("postgresql://db/x", table="t", auth={"type": "credentials_file", "config": {"path": "/x"}})
    with pytest.raises(ConfigError, match="key"):
        sink("postgresql://db/x", table="t", mode="delete")
    secret = sink(
        "postgresql://db.invalid:6543/shop",
        table="orders",
        schema_name="sales",
        auth={"type": "user_password", "config": {"username": "app", "password": "hunter2"}},
    )
    assert secret.dataset_uri() == "postgresql://app@db.invalid:6543/shop/sales.orders"
    assert isinstance(secret, PostgresSink)
    assert "hunter2" not in repr(secret.config) and "hunter2" not in str(secret.config.redacted())
    for mode, watermark in (("append", True), ("upsert", True), ("delete", True), ("replace", False)):
        caps = sink("postgresql://db/x", table="t", mode=mode, key=["id"]).capabilities()
        assert caps.bounded_policies == {WritePolicy(mode)}
        assert caps.atomic_watermark is watermark and caps.partial_results and caps.schema_evolution
    assert not sink("postgresql://db/x", table="t", schema_evolution=False).capabilities().schema_evolution
    assert source("postgresql://db/x", table="t", columns=["a"]).capabilities().columns == ("a",)


def mixed_batch() -> pa.RecordBatch:
    """Every mapped type, with NULLs, empty strings and text that needs quoting."""
    return pa.record_batch(
        {
            "id": pa.array([1, 2, 3], pa.int64()),
            "small": pa.array([-7, None, 32000], pa.int16()),
            "mid": pa.array([None, 2_000_000_000, -1], pa.int32()),
            "real": pa.array([1.5, float("inf"), None], pa.float32()),
            "double": pa.array([0.1, None, -2.5e300], pa.float64()),
            "flag": pa.array([True, False, None]),
            "text": pa.array(["", None, 'quote " comma , newline \n tab \t ünïcode'], pa.string()),
            "raw": pa.array([b"\x00\xff", b"", None], pa.binary()),
            "day": pa.array([dt.date(2024, 2, 29), None, dt.date(1900, 1, 1)], pa.date32()),
            "naive": pa.array([dt.datetime(2024, 1, 1, 12, 30, 0, 123456), None, dt.datetime(1999, 12, 31)]),
            "aware": pa.array(
                [dt.datetime(2024, 6, 1, tzinfo=dt.UTC), None, dt.datetime(1970, 1, 1, tzinfo=dt.UTC)],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )


def csv_only_batch() -> pa.RecordBatch:
    """Types without a binary encoder: the batch goes as CSV."""
    return pa.record_batch(
        {
            "id": pa.array([1, 2], pa.int64()),
            "amount": pa.array([Decimal("12.345"), None], pa.decimal128(12, 3)),
            "clock": pa.array([dt.time(23, 59, 59, 5), None], pa.time64("us")),
            "tags": pa.array([[1, 2], None], pa.list_(pa.int64())),
            "blob": pa.array([b"\x01", None], pa.binary()),
        }
    )


@pytest.mark.parametrize("copy_format", ["auto", "csv"])
def test_types_round_trip_through_copy_and_the_source(
    postgres_url: str, conn: psycopg.Connection[Any], copy_format: str
) -> None:
    batch = mixed_batch()
    assert asyncio.run(write_all(sink(postgres_url, table="mixed", copy_format=copy_format), batch)) == 3
    back = asyncio.run(read_all(source(postgres_url, table="mixed", key=["id"]), 0))
    assert len(back) == 1 and back[0].schema == batch.schema
    assert back[0].to_pylist() == batch.to_pylist()

    other = csv_only_batch()
    asyncio.run(write_all(sink(postgres_url, table="csv_only", copy_format=copy_format), other))
    stored = rows(conn, "csv_only")
    assert stored == [
        (1, Decimal("12.345"), dt.time(23, 59, 59, 5), [1, 2], b"\x01"),
        (2, None, None, None, None),
    ]
    (read,) = asyncio.run(read_all(source(postgres_url, table="csv_only", key=["id"]), 0))
    assert read.column("amount").type == pa.decimal128(12, 3)
    # Nested values are stored as jsonb and read back as its text.
    assert read.column("tags").to_pylist() == ["[1, 2]", None]


def test_binary_copy_is_used_where_every_column_has_an_encoder(
    postgres_url: str, conn: psycopg.Connection[Any]
) -> None:
    asyncio.run(write_all(sink(postgres_url, table="mixed"), mixed_batch()))
    asyncio.run(write_all(sink(postgres_url, table="csv_only"), csv_only_batch()))

    async def columns(name: str) -> Any:
        async with await psycopg.AsyncConnection.connect(postgres_url) as aconn:
            return await table_columns(aconn, "public", name)

    mixed = asyncio.run(columns("mixed"))
    assert encode_copy(mixed_batch(), mixed).format == "binary"
    assert encode_copy(mixed_batch(), None).format == "csv"
    assert encode_copy(csv_only_batch(), asyncio.run(columns("csv_only"))).format == "csv"
    # A value that does not fit the destination exactly falls back to CSV, where the server names it.
    too_big = pa.record_batch({"id": pa.array([1], pa.int64()), "small": pa.array([70_000], pa.int64())})
    assert encode_copy(too_big, mixed).format == "csv"
    with pytest.raises(DataError, match="out of range"):
        asyncio.run(write_all(sink(postgres_url, table="mixed"), too_big))


def test_a_column_of_nulls_is_copied_in_binary_whatever_its_types(
    postgres_url: str, conn: psycopg.Connection[Any]
) -> None:
    """A column with no encoder for its types (nested into jsonb) holding only NULLs keeps the batch
    binary, and its NULLs arrive as NULLs."""
    tags = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.string())]))
    with_tags = pa.record_batch(
        {"id": pa.array([1, 2], pa.int64()), "tags": pa.array([[("k", "v")], None], tags)}
    )
    no_tags = pa.record_batch({"id": pa.array([3, 4], pa.int64()), "tags": pa.nulls(2, tags)})
    asyncio.run(write_all(sink(postgres_url, table="tagged"), with_tags))

    async def columns() -> Any:
        async with await psycopg.AsyncConnection.connect(postgres_url) as aconn:
            return await table_columns(aconn, "public", "tagged")

    tagged = asyncio.run(columns())
    assert tagged["tags"].type_name == "jsonb"
    assert encode_copy(with_tags, tagged).format == "csv"
    assert encode_copy(no_tags, tagged).format == "binary"
    asyncio.run(write_all(sink(postgres_url, table="tagged"), no_tags))
    assert rows(conn, "tagged") == [(1, [{"key": "k", "value": "v"}]), (2, None), (3, None), (4, None)]


NESTED = pa.struct(
    [
        pa.field("raw", pa.binary()),
        pa.field("at", pa.timestamp("us", tz="UTC")),
        pa.field("amount", pa.decimal128(12, 3)),
        pa.field("took", pa.duration("us")),
        pa.field("scores", pa.list_(pa.float64())),
    ]
)


def nested_batch(score: float) -> pa.RecordBatch:
    value = {
        "raw": b"\x00\xff",
        "at": dt.datetime(2024, 6, 1, 12, 30, tzinfo=dt.UTC),
        "amount": Decimal("12.345"),
        "took": dt.timedelta(seconds=1, microseconds=5),
        "scores": [0.5, score],
    }
    return pa.record_batch({"id": pa.array([1], pa.int64()), "doc": pa.array([value], NESTED)})


def test_nested_values_land_in_jsonb_as_postgresql_reads_them_or_are_refused_by_name(
    postgres_url: str, conn: psycopg.Connection[Any]
) -> None:
    """Bytes as \\x hex (not Python's b'...'), a timestamp in ISO 8601, a decimal's exact digits, a
    duration as an interval's text; a NaN, which JSON cannot hold, is a DataError naming the column
    and the row, and nothing of the batch lands."""
    asyncio.run(write_all(sink(postgres_url, table="documents"), nested_batch(1.5)))
    ((doc,),) = conn.execute("SELECT doc FROM documents").fetchall()
    assert doc == {
        "raw": "\\x00ff",
        "at": "2024-06-01T12:30:00+00:00",
        "amount": "12.345",
        "took": "1000005 microseconds",
        "scores": [0.5, 1.5],
    }
    assert conn.execute(
        "SELECT decode(substr(doc->>'raw', 3), 'hex'), (doc->>'at')::timestamptz, (doc->>'took')::interval "
        "FROM documents"
    ).fetchone() == (
        b"\x00\xff",
        dt.datetime(2024, 6, 1, 12, 30, tzinfo=dt.UTC),
        dt.timedelta(seconds=1, microseconds=5),
    )

    with pytest.raises(DataError, match=r"no JSON form: a NaN .*column 'doc', row 0 of the batch"):
        asyncio.run(write_all(sink(postgres_url, table="documents"), nested_batch(float("nan"))))
    assert conn.execute("SELECT count(*) FROM documents").fetchone() == (1,)

    # Written for the dead-letter route, the NaN's row is refused by index and the others land.
    mixed = pa.concat_batches([nested_batch(2.5), nested_batch(float("nan")), nested_batch(3.5)])
    mixed = mixed.set_column(0, "id", pa.array([2, 3, 4], pa.int64()))
    result = asyncio.run(sink(postgres_url, table="documents").write_batch_partial(mixed))
    assert [row.index for row in result.rejected] == [1] and "no JSON form: a NaN" in result.rejected[
        0
    ].reason
    landed = conn.execute("SELECT id, doc->'scores' FROM documents ORDER BY id").fetchall()
    assert landed == [(1, [0.5, 1.5]), (2, [0.5, 2.5]), (4, [0.5, 3.5])]


def test_a_sliced_copy_starts_with_a_small_slice_and_doubles_up_to_the_slice_size() -> None:
    """The server gets rows after the first small slice is encoded, not after a full slice."""
    count = 3 * COPY_SLICE_ROWS + 5
    slices = list(copy_slices(count))
    lengths = [length for _, length in slices]
    assert lengths[0] == FIRST_SLICE_ROWS < COPY_SLICE_ROWS
    assert lengths[1:-1] == [
        min(FIRST_SLICE_ROWS * 2**i, COPY_SLICE_ROWS) for i in range(1, len(lengths) - 1)
    ]
    assert [start for start, _ in slices] == list(itertools.accumulate(lengths[:-1], initial=0))
    assert sum(lengths) == count and max(lengths) == COPY_SLICE_ROWS


@pytest.mark.parametrize("bad_row", [None, 5, FIRST_SLICE_ROWS + 3, 2 * COPY_SLICE_ROWS + 3])
def test_a_batch_copied_in_slices_lands_whole_or_names_the_value_that_does_not_fit(
    postgres_url: str, conn: psycopg.Connection[Any], bad_row: int | None
) -> None:
    """A batch of several COPY slices: every row lands in order, or, with a value too big for smallint in
    the first or a later slice (binary slices already sent), the server's out-of-range error and no
    row; write_batch_partial then refuses that row alone."""
    conn.execute("CREATE TABLE sliced (id bigint, small smallint, note text)")
    count = 3 * COPY_SLICE_ROWS + 5
    small = [i % 30_000 for i in range(count)]
    if bad_row is not None:
        small[bad_row] = 70_000
    batch = pa.record_batch(
        {
            "id": pa.array(range(count), pa.int64()),
            "small": pa.array(small, pa.int64()),
            "note": ["n"] * count,
        }
    )
    if bad_row is None:
        assert asyncio.run(write_all(sink(postgres_url, table="sliced"), batch)) == count
        landed = rows(conn, "sliced")
        assert len(landed) == count and landed[-1] == (count - 1, (count - 1) % 30_000, "n")
        return
    with pytest.raises(DataError, match="out of range"):
        asyncio.run(write_all(sink(postgres_url, table="sliced"), batch))
    assert rows(conn, "sliced") == []
    dst = sink(postgres_url, table="sliced")
    result = asyncio.run(dst.write_batch_partial(batch))
    asyncio.run(dst.close())
    assert [row.index for row in result.rejected] == [bad_row]
    assert result.written == count - 1
    assert [row[0] for row in rows(conn, "sliced")] == [i for i in range(count) if i != bad_row]


def test_ten_thousand_rows_sharing_one_cursor_value_arrive_exactly_once(
    postgres_url: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute("CREATE TABLE events (id bigint PRIMARY KEY, at timestamptz, note text)")
    conn.execute(
        "INSERT INTO events SELECT i, '2024-01-01 00:00:00+00', 'line ' || i || E'\\n\"quoted\"' "
        "FROM generate_series(1, 10000) AS i"
    )
    conn.execute("INSERT INTO events SELECT i, '2023-01-01', 'early' FROM generate_series(20001, 20010) AS i")
    conn.execute("INSERT INTO events VALUES (30000, NULL, 'no cursor')")
    config = {"table": "events", "cursor": "at", "fetch_rows": 700}
    pages = asyncio.run(read_all(source(postgres_url, **config), 999))
    seen = [i for page in pages for i in page.column("id").to_pylist()]
    assert seen == list(range(20001, 20011)) + list(range(1, 10001))
    assert pages[1].column("note")[0].as_py() == 'line 990\n"quoted"'

    # Resume after the third page: exactly the rest, even though every row shares the cursor value.
    src = source(postgres_url, **config)
    src.apply_start_bookmark(_bookmark_after(postgres_url, config, pages=3))
    rest = [i for page in asyncio.run(read_all(src, 999)) for i in page.column("id").to_pylist()]
    assert rest == seen[3 * 999 :]


def _bookmark_after(url: str, config: dict[str, Any], pages: int) -> JsonValue:
    async def run() -> JsonValue:
        taken = 0
        async for page in source(url, **config).stream_pages({}, 999):
            taken += 1
            if taken == pages:
                return page.bookmark
        raise AssertionError("not enough pages")

    return asyncio.run(run())


def test_append_then_resume_moves_only_new_rows(postgres_url: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, amount numeric(10,2), updated bigint)")
    conn.execute("INSERT INTO orders SELECT i, i / 4.0, i FROM generate_series(1, 2500) AS i")

    async def sync(bookmark: JsonValue) -> tuple[int, JsonValue]:
        src = source(postgres_url, table="orders", cursor="updated")
        if bookmark is not None:
            src.apply_start_bookmark(bookmark)
        dst = sink(postgres_url, table="orders_copy")
        moved = 0
        async for page in src.stream_pages({}, 1000):
            assert isinstance(page.records, pa.RecordBatch)
            moved += await dst.write_batch(page.records)
            bookmark = page.bookmark
        await dst.close()
        return moved, bookmark

    moved, bookmark = asyncio.run(sync(None))
    assert moved == 2500
    conn.execute("INSERT INTO orders SELECT i, i / 4.0, i FROM generate_series(2501, 2600) AS i")
    moved, bookmark = asyncio.run(sync(bookmark))
    assert moved == 100
    assert asyncio.run(sync(bookmark))[0] == 0
    assert rows(conn, "orders_copy") == rows(conn, "orders")


def test_upsert_converges_when_pages_are_replayed(postgres_url: str, conn: psycopg.Connection[Any]) -> None:
    first = pa.record_batch({"id": [1, 2, 3, 2], "name": ["a", "b", "c", "b2"]})
    second = pa.record_batch({"id": [3, 4], "name": ["c2", "d"]})
    dst = sink(postgres_url, table="people", mode="upsert", key=["id"])
    asyncio.run(write_all(dst, first, second))
    once = rows(conn, "people")
    replay = sink(postgres_url, table="people", mode="upsert", key=["id"])
    asyncio.run(write_all(replay, first, second, first, second))
    assert rows(conn, "people") == once == [(1, "a"), (2, "b2"), (3, "c2"), (4, "d")]
    keys_only = sink(postgres_url, table="people", mode="upsert", key=["id"])
    asyncio.run(write_all(keys_only, pa.record_batch({"id": [4, 5]})))
    assert rows(conn, "people")[-2:] == [(4, "d"), (5, None)]


def test_delete_by_key(postgres_url: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE items (shop text, id int, name text, PRIMARY KEY (shop, id))")
    conn.execute("INSERT INTO items VALUES ('a', 1, 'x'), ('a', 2, 'y'), ('b', 1, 'z')")
    dst = sink(postgres_url, table="items", mode="delete", key=["shop", "id"])
    assert dst.dedups_by_key()
    batch = pa.record_batch(
        {"shop": ["a", "b", "c"], "id": pa.array([2, 1, 9], pa.int32()), "name": ["", "", ""]}
    )
    assert asyncio.run(write_all(dst, batch)) == 3
    assert rows(conn, "items") == [("a", 1, "x")]
    with pytest.raises(ConfigError, match="does not exist"):
        asyncio.run(write_all(sink(postgres_url, table="absent", mode="delete", key=["id"]), batch))


def test_replace_swaps_atomically_while_a_reader_polls(
    postgres_url: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute("CREATE TABLE snapshot (id bigint PRIMARY KEY, v text)")
    conn.execute("INSERT INTO snapshot SELECT i, 'old' FROM generate_series(1, 3000) AS i")
    counts: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def poll() -> None:
        try:
            with psycopg.connect(postgres_url, autocommit=True) as reader:
                while not stop.is_set():
                    counts.append(reader.execute("SELECT count(*) FROM snapshot").fetchone()[0])  # type: ignore[index]
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=poll)
    thread.start()
    dst = sink(postgres_url, table="snapshot", mode="replace")

    async def load() -> None:
        for start in range(0, 5000, 500):
            batch = pa.record_batch({"id": list(range(start, start + 500)), "v": ["new"] * 500})
            await dst.write_batch(batch)
            await asyncio.sleep(0.02)
        assert (await dst.current_schema()) is not None
        await dst.finish()
        await asyncio.sleep(0.2)
        await dst.close()

    try:
        asyncio.run(load())
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert set(counts) == {3000, 5000}, sorted(set(counts))
    assert counts[0] == 3000 and counts[-1] == 5000
    assert conn.execute("SELECT count(*), min(v), max(v) FROM snapshot").fetchone() == (5000, "new", "new")
    assert tables(conn) == {"snapshot"}
    # The new table kept the old one's primary key.
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("INSERT INTO snapshot VALUES (1, 'dup')")


def test_replace_keeps_the_owner_and_who_may_read_and_write_the_table(
    postgres_url: str, conn: psycopg.Connection[Any], unique_name: Callable[..., str]
) -> None:
    reader, owner = unique_name("reader"), unique_name("owner")
    conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(reader)))
    conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(owner)))
    try:
        conn.execute("CREATE TABLE shared (id bigint PRIMARY KEY, v text)")
        conn.execute(sql.SQL("ALTER TABLE shared OWNER TO {}").format(sql.Identifier(owner)))
        conn.execute(sql.SQL("GRANT SELECT ON shared TO {} WITH GRANT OPTION").format(sql.Identifier(reader)))
        conn.execute("GRANT INSERT ON shared TO PUBLIC")
        before = conn.execute("SELECT oid FROM pg_class WHERE relname = 'shared'").fetchone()
        asyncio.run(
            write_all(
                sink(postgres_url, table="shared", mode="replace"),
                pa.record_batch({"id": [1, 2], "v": ["a", "b"]}),
            )
        )
        assert conn.execute("SELECT oid FROM pg_class WHERE relname = 'shared'").fetchone() != before
        assert rows(conn, "shared") == [(1, "a"), (2, "b")]
        privileges = conn.execute(
            "SELECT pg_get_userbyid(c.relowner), "
            "has_table_privilege(%s, 'shared', 'SELECT'), "
            "has_table_privilege(%s, 'shared', 'SELECT WITH GRANT OPTION'), "
            "has_table_privilege(%s, 'shared', 'UPDATE'), has_table_privilege('public', 'shared', 'INSERT'), "
            "has_table_privilege('public', 'shared', 'SELECT') FROM pg_class c WHERE c.relname = 'shared'",
            (reader, reader, reader),
        ).fetchone()
        assert privileges == (owner, True, True, False, True, False)
    finally:
        conn.execute("DROP TABLE IF EXISTS shared")
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(reader)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(owner)))


def test_replace_refuses_to_drop_a_dependent_view_and_keeps_the_old_table(
    postgres_url: str, conn: psycopg.Connection[Any]
) -> None:
    conn.execute("CREATE TABLE base (id int)")
    conn.execute("INSERT INTO base VALUES (1)")
    conn.execute("CREATE VIEW base_view AS SELECT id FROM base")
    dst = sink(postgres_url, table="base", mode="replace")
    with pytest.raises(SchemaError, match="depend"):
        asyncio.run(write_all(dst, pa.record_batch({"id": pa.array([5, 6], pa.int32())})))
    assert rows(conn, "base") == [(1,)]


def test_watermark_skips_replayed_tokens_and_is_scoped_by_sync_id(
    postgres_url: str, conn: psycopg.Connection[Any]
) -> None:
    one = sink(postgres_url, table="events")
    other = sink(postgres_url, table="events", sync_id="second-sync")
    batch = pa.record_batch({"id": [1, 2, 3]})

    async def run() -> list[Any]:
        results = [
            await one.last_committed_token(),
            await one.write_batch_idempotent(batch, CommitToken(3)),
            await one.write_batch_idempotent(batch, CommitToken(3)),
            await one.write_batch_idempotent(batch, CommitToken(2)),
            await one.last_committed_token(),
            await other.last_committed_token(),
            await other.write_batch_idempotent(batch, CommitToken(1)),
            await other.last_committed_token(),
            await one.write_batch_idempotent(batch, CommitToken(10)),
        ]
        await one.close()
        await other.close()
        return results

    assert asyncio.run(run()) == [None, 3, 0, 0, CommitToken(3), None, 3, CommitToken(1), 3]
    assert len(rows(conn, "events")) == 9
    stored = conn.execute("SELECT sync_id, token FROM _faucet_watermarks ORDER BY sync_id").fetchall()
    assert stored == [("public.events", str(CommitToken(10))), ("second-sync", str(CommitToken(1)))]
    with pytest.raises(UnsupportedOperation):
        asyncio.run(
            sink(postgres_url, table="events", mode="replace").write_batch_idempotent(batch, CommitToken(99))
        )


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_partial_results_name_bad_rows_and_good_rows_land(
    postgres_url: str, conn: psycopg.Connection[Any], mode: str
) -> None:
    conn.execute(
        "CREATE TABLE checked (id bigint PRIMARY KEY, qty integer NOT NULL CHECK (qty >= 0), note text)"
    )
    ids = list(range(1000))
    bad = {17: "check", 400: "null", 401: "null", 998: "range"}
    qty = [-1 if i == 17 else None if bad.get(i) == "null" else 3_000_000_000 if i == 998 else i for i in ids]
    batch = pa.record_batch({"id": ids, "qty": pa.array(qty, pa.int64()), "note": ["n"] * 1000})
    dst = sink(postgres_url, table="checked", mode=mode, key=["id"])
    result = asyncio.run(dst.write_batch_partial(batch))
    asyncio.run(dst.close())
    assert [row.index for row in result.rejected] == sorted(bad)
    assert result.written == 1000 - len(bad)
    reasons = {row.index: row.reason for row in result.rejected}
    assert reasons[17].startswith("23514") and "checked_qty_check" in reasons[17]
    assert reasons[400].startswith("23502") and "not-null" in reasons[400]
    assert reasons[998].startswith("22003") and "out of range" in reasons[998]
    assert [row[0] for row in rows(conn, "checked")] == [i for i in ids if i not in bad]


def test_schema_evolution_adds_a_column_or_refuses_it(
    postgres_url: str, conn: psycopg.Connection[Any]
) -> None:
    asyncio.run(write_all(sink(postgres_url, table="evolving"), pa.record_batch({"id": [1]})))
    wider = pa.record_batch({"id": [2], "note": ["new"]})
    frozen = sink(postgres_url, table="evolving", schema_evolution=False)
    with pytest.raises(SchemaError, match="note"):
        asyncio.run(write_all(frozen, wider))
    with pytest.raises(SchemaError):
        asyncio.run(frozen.evolve_schema([AddColumn("note", pa.string())]))
    assert rows(conn, "evolving") == [(1,)]

    evolving = sink(postgres_url, table="evolving")

    async def evolve() -> pa.Schema | None:
        await evolving.evolve_schema([AddColumn("score", pa.float64())])
        await evolving.evolve_schema([AddColumn("score", pa.float64())])  # ADD COLUMN IF NOT EXISTS
        await evolving.write_batch(wider)
        schema = await evolving.current_schema()
        await evolving.close()
        return schema

    schema = asyncio.run(evolve())
    assert schema is not None and schema.names == ["id", "score", "note"]
    assert schema.field("score").type == pa.float64()
    assert rows(conn, "evolving") == [(1, None, None), (2, None, "new")]


@pytest.mark.parametrize("mode", ["append", "upsert", "replace"])
def test_hostile_table_and_column_names_create_nothing_else(
    postgres_url: str, conn: psycopg.Connection[Any], mode: str
) -> None:
    conn.execute("CREATE TABLE victim (id int)")
    column = 'a "quoted"; col; DROP TABLE victim; --'
    key = 'my key"; --'
    dst = sink(
        postgres_url, table=INJECTION, mode=mode, key=[key], watermark_table='wm"; DROP TABLE victim; --'
    )
    batches = [pa.record_batch({key: [1, 2], column: ["x", "y"]}), pa.record_batch({key: [3], column: ["z"]})]
    asyncio.run(write_all(dst, *batches))
    if mode != "replace":
        again = sink(
            postgres_url, table=INJECTION, mode=mode, key=[key], watermark_table='wm"; DROP TABLE victim; --'
        )
        asyncio.run(again.write_batch_idempotent(pa.record_batch({key: [4], column: ["w"]}), CommitToken(1)))
        asyncio.run(again.close())
    expected = {"victim", INJECTION} | ({'wm"; DROP TABLE victim; --'} if mode != "replace" else set())
    assert tables(conn) == expected
    (page,) = asyncio.run(read_all(source(postgres_url, table=INJECTION, key=[key], columns=[column]), 0))
    assert page.schema.names == [column]
    assert page.column(column).to_pylist() == (["x", "y", "z", "w"] if mode != "replace" else ["x", "y", "z"])


def test_discover_lists_tables_and_columns(postgres_url: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE a (id bigint PRIMARY KEY, amount numeric(8,2), at timestamptz, tags int[])")
    conn.execute("CREATE TABLE b (k text)")
    found = {dataset.name: dataset for dataset in asyncio.run(source(postgres_url, table="a").discover())}
    assert set(found) == {"public.a", "public.b"}
    schema = found["public.a"].schema
    assert schema is not None
    assert schema.types == [pa.int64(), pa.decimal128(8, 2), pa.timestamp("us", tz="UTC"), pa.string()]
    assert found["public.a"].details["primary_key"] == "id"
    assert found["public.b"].details["primary_key"] == ""


def test_a_consumer_may_stop_early(postgres_url: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "CREATE TABLE big AS SELECT i AS id, repeat('x', 200) AS pad FROM generate_series(1, 200000) AS i"
    )
    conn.execute("ALTER TABLE big ADD PRIMARY KEY (id)")

    async def first_page() -> int:
        async for page in source(postgres_url, table="big").stream_pages({}, 100):
            return page.num_rows
        return 0

    started = time.monotonic()
    assert asyncio.run(first_page()) == 100
    assert time.monotonic() - started < 10
    active = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchone()
    assert active == (0,)


def test_missing_table_database_and_dead_host_raise_faucet_errors_naming_them(postgres_url: str) -> None:
    with pytest.raises(ConfigError, match="nope"):
        asyncio.run(read_all(source(postgres_url, table="nope"), 10))
    with pytest.raises(ConfigError, match="primary key"):
        with psycopg.connect(postgres_url, autocommit=True) as setup:
            setup.execute("CREATE TABLE keyless (a int)")
        asyncio.run(read_all(source(postgres_url, table="keyless"), 10))

    missing_database = postgres_url.rsplit("/", 1)[0] + "/no_such_database"
    with pytest.raises(ConfigError, match="no_such_database") as absent:
        asyncio.run(source(missing_database, table="t").check())
    assert not absent.value.retryable

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dead = f"postgresql://postgres@127.0.0.1:{port}/db"
    with pytest.raises(ConnectionFailed) as failed:
        asyncio.run(read_all(source(dead, table="t"), 10))
    assert f"127.0.0.1:{port}" in str(failed.value) and failed.value.retryable
    with pytest.raises(ConnectionFailed, match=str(port)):
        asyncio.run(sink(dead, table="t").write_batch(pa.record_batch({"a": [1]})))
