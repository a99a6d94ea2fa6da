"""The SQL (SQLAlchemy) source and sink against SQLite files in tmp_path and the real PostgreSQL."""

import asyncio
import datetime as dt
import json
import socket
import threading
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pyarrow as pa
import pytest
import sqlalchemy as sa

from faucet_dagster.protocol import (
    AddColumn,
    CommitToken,
    ConfigError,
    ConnectionFailed,
    DataError,
    JsonValue,
    Ordering,
    Role,
    SchemaError,
    Sink,
    Source,
    UnsupportedOperation,
    WritePolicy,
    get_connector,
)

INJECTION = 'x"; DROP TABLE victim; --'


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'warehouse.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    url = sa.engine.make_url(db_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    created = sa.create_engine(url)
    yield created
    created.dispose()


def source(url: str, **config: Any) -> Source:
    return get_connector("sql").source({"url": url, **config})


def sink(url: str, **config: Any) -> Sink:
    return get_connector("sql").sink({"url": url, **config})


async def sync(src: Source, dst: Sink, batch_size: int, bookmark: JsonValue = None) -> tuple[int, JsonValue]:
    """A minimal bounded sync: every page written, the last bookmark returned."""
    if bookmark is not None:
        src.apply_start_bookmark(bookmark)
    moved = 0
    async for page in src.stream_pages({}, batch_size):
        assert isinstance(page.records, pa.RecordBatch)
        moved += await dst.write_batch(page.records)
        bookmark = page.bookmark
    await dst.flush()
    await dst.finish()
    return moved, bookmark


def create_orders(engine: sa.Engine, name: str = "orders") -> sa.Table:
    table = sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("updated", sa.BigInteger, nullable=True),
        sa.Column("name", sa.Text),
        sa.Column("amount", sa.Numeric(10, 2)),
    )
    table.create(engine)
    return table


def insert_orders(engine: sa.Engine, table: sa.Table, ids: range, updated: int | None = None) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.insert(table),
            [
                {"id": i, "updated": i if updated is None else updated, "name": f"n{i}", "amount": i / 4}
                for i in ids
            ],
        )


def rows_of(engine: sa.Engine, name: str, order_by: str = "id") -> list[tuple[Any, ...]]:
    table = sa.Table(name, sa.MetaData(), autoload_with=engine)
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(sa.select(table).order_by(table.c[order_by]))]


def table_names(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_config_schemas_are_valid_and_configs_are_checked_offline() -> None:
    spec = get_connector("sql")
    for role in (Role.SOURCE, Role.SINK):
        jsonschema.Draft202012Validator.check_schema(spec.roles[role].config_model.json_schema())
    with pytest.raises(ConfigError) as info:
        sink("postgresql://app:hunter2@db/x", table="t")
    assert "hunter2" not in str(info.value) and "auth" in str(info.value)
    with pytest.raises(ConfigError, match="key"):
        sink("sqlite:///x.db", table="t", mode="upsert")
    with pytest.raises(ConfigError, match="replace"):
        sink("mssql+pyodbc://app@db/x", table="t", mode="replace")
    built = sink(
        "postgresql://app@db.invalid/x",
        table="t",
        auth={"type": "user_password", "config": {"username": "app", "password": "hunter2"}},
    )
    assert "hunter2" not in built.dataset_uri()
    assert built.capabilities().bounded_policies == {WritePolicy.APPEND}
    upsert = sink("sqlite:///x.db", table="t", mode="upsert", key=["id"])
    caps = upsert.capabilities()
    assert caps.bounded_policies == {WritePolicy.UPSERT} and caps.atomic_watermark and caps.partial_results
    assert upsert.dedups_by_key()
    replace = sink("sqlite:///x.db", table="t", mode="replace")
    assert not replace.capabilities().atomic_watermark
    with pytest.raises(UnsupportedOperation):
        asyncio.run(replace.last_committed_token())
    src = source("sqlite:///x.db", table="t", cursor="u", columns=["id", "u"])
    assert src.capabilities().ordering is Ordering.STRICT_GLOBAL
    assert src.capabilities().columns == ("id", "u") and not src.capabilities().deterministic


@pytest.mark.parametrize("row_values", ["auto", "expanded"])
def test_ten_thousand_rows_sharing_one_cursor_value_arrive_exactly_once(
    db_url: str, engine: sa.Engine, row_values: str
) -> None:
    orders = create_orders(engine)
    insert_orders(engine, orders, range(10_000), updated=7)
    insert_orders(engine, orders, range(10_000, 10_010), updated=3)
    src = source(db_url, table="orders", cursor="updated", row_values=row_values)
    seen: list[int] = []

    async def read() -> None:
        async for page in src.stream_pages({}, 999):
            assert isinstance(page.records, pa.RecordBatch) and page.num_rows <= 999
            seen.extend(page.records.column("id").to_pylist())

    asyncio.run(read())
    assert seen == list(range(10_000, 10_010)) + list(range(10_000))


def test_append_then_resume_moves_only_new_rows(db_url: str, engine: sa.Engine) -> None:
    orders = create_orders(engine)
    insert_orders(engine, orders, range(1, 26))
    moved, bookmark = asyncio.run(
        sync(source(db_url, table="orders", cursor="updated"), sink(db_url, table="copy"), 10)
    )
    assert moved == 25 and bookmark is not None
    insert_orders(engine, orders, range(26, 31))
    moved, bookmark = asyncio.run(
        sync(source(db_url, table="orders", cursor="updated"), sink(db_url, table="copy"), 10, bookmark)
    )
    assert moved == 5
    assert [row[0] for row in rows_of(engine, "copy")] == list(range(1, 31))
    moved, _ = asyncio.run(
        sync(source(db_url, table="orders", cursor="updated"), sink(db_url, table="copy"), 10, bookmark)
    )
    assert moved == 0
    copy_schema = asyncio.run(sink(db_url, table="copy").current_schema())
    assert copy_schema is not None and copy_schema.field("amount").type == pa.decimal128(10, 2)


def test_upsert_converges_when_pages_are_replayed(db_url: str, engine: sa.Engine) -> None:
    dst = sink(db_url, table="people", mode="upsert", key=["id"])
    first = pa.record_batch({"id": [1, 2, 3, 2], "name": ["a", "b", "c", "b2"]})
    second = pa.record_batch({"id": [3, 4], "name": ["c2", "d"]})

    async def run() -> None:
        for batch in (first, second, first, second):
            await dst.write_batch(batch)

    asyncio.run(run())
    assert rows_of(engine, "people") == [(1, "a"), (2, "b2"), (3, "c2"), (4, "d")]


def test_watermark_skips_replayed_tokens_and_is_scoped_by_sync_id(db_url: str, engine: sa.Engine) -> None:
    one = sink(db_url, table="events")
    other = sink(db_url, table="events", sync_id="second-sync")
    batch = pa.record_batch({"id": [1, 2, 3]})

    async def run() -> list[Any]:
        return [
            await one.last_committed_token(),
            await one.write_batch_idempotent(batch, CommitToken(3)),
            await one.write_batch_idempotent(batch, CommitToken(3)),
            await one.write_batch_idempotent(batch, CommitToken(2)),
            await one.last_committed_token(),
            await other.last_committed_token(),
            await other.write_batch_idempotent(batch, CommitToken(1)),
            await other.last_committed_token(),
        ]

    assert asyncio.run(run()) == [None, 3, 0, 0, CommitToken(3), None, 3, CommitToken(1)]
    assert len(rows_of(engine, "events")) == 6


def test_replace_swaps_atomically_while_a_reader_polls(db_url: str, engine: sa.Engine) -> None:
    old = sink(db_url, table="snapshot", mode="replace")
    asyncio.run(old.write_batch(pa.record_batch({"id": list(range(300))})))
    asyncio.run(old.finish())
    assert len(rows_of(engine, "snapshot")) == 300

    counts: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        with engine.connect() as conn:
            while not stop.is_set():
                counts.append(conn.execute(sa.text("SELECT count(*) FROM snapshot")).scalar_one())
                conn.rollback()

    reader = threading.Thread(target=poll)
    reader.start()
    new = sink(db_url, table="snapshot", mode="replace")

    async def load() -> None:
        for start in range(0, 500, 50):
            await new.write_batch(pa.record_batch({"id": list(range(start, start + 50))}))
            await asyncio.sleep(0.01)
        await new.finish()
        await asyncio.sleep(0.1)

    try:
        asyncio.run(load())
    finally:
        stop.set()
        reader.join()
    assert set(counts) <= {300, 500}, sorted(set(counts))
    assert counts[0] == 300 and counts[-1] == 500
    assert [row[0] for row in rows_of(engine, "snapshot")] == list(range(500))
    assert table_names(engine) == {"snapshot"}


def test_replace_re_creates_the_targets_indexes(db_url: str, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE indexed (id BIGINT PRIMARY KEY, email TEXT, city TEXT, zip TEXT)"))
        conn.execute(sa.text("CREATE UNIQUE INDEX indexed_email ON indexed (email)"))
        conn.execute(sa.text("CREATE INDEX indexed_place ON indexed (city, zip)"))
    batch = pa.record_batch({"id": [1, 2], "email": ["a@x", "b@x"], "city": ["c", "c"], "zip": ["1", "2"]})
    dst = sink(db_url, table="indexed", mode="replace")
    asyncio.run(dst.write_batch(batch))
    asyncio.run(dst.finish())
    indexes = {
        index["name"]: (index["column_names"], bool(index["unique"]))
        for index in sa.inspect(engine).get_indexes("indexed")
    }
    assert indexes == {"indexed_email": (["email"], True), "indexed_place": (["city", "zip"], False)}
    assert table_names(engine) == {"indexed"}
    with engine.begin() as conn, pytest.raises(sa.exc.IntegrityError):
        conn.execute(sa.text("INSERT INTO indexed (id, email) VALUES (3, 'a@x')"))


def test_replace_refuses_a_target_index_on_an_expression_before_writing(
    db_url: str, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE lowered (id BIGINT PRIMARY KEY, email TEXT)"))
        conn.execute(sa.text("INSERT INTO lowered VALUES (1, 'kept')"))
        conn.execute(sa.text("CREATE INDEX lowered_email ON lowered (lower(email))"))
    dst = sink(db_url, table="lowered", mode="replace")
    with pytest.raises(SchemaError, match="lowered_email"):
        asyncio.run(dst.write_batch(pa.record_batch({"id": [2], "email": ["new"]})))
    assert rows_of(engine, "lowered") == [(1, "kept")]
    assert table_names(engine) == {"lowered"}


def test_partial_results_name_bad_rows_and_good_rows_land(db_url: str, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE checked (id BIGINT NOT NULL, qty BIGINT CHECK (qty >= 0))"))
    dst = sink(db_url, table="checked")
    ids = list(range(100))
    qty = [(-1 if i in (7, 60) else i) for i in ids]
    batch = pa.record_batch({"id": [None if i == 33 else i for i in ids], "qty": qty})
    result = asyncio.run(dst.write_batch_partial(batch))
    assert [row.index for row in result.rejected] == [7, 33, 60]
    assert result.written == 97
    reasons = {row.index: row.reason.lower() for row in result.rejected}
    assert "check" in reasons[7] and "null" in reasons[33]
    landed = [row[0] for row in rows_of(engine, "checked")]
    assert landed == [i for i in ids if i not in (7, 33, 60)]


def test_schema_evolution_adds_a_column_or_refuses_it(db_url: str, engine: sa.Engine) -> None:
    asyncio.run(sink(db_url, table="evolving").write_batch(pa.record_batch({"id": [1]})))
    wider = pa.record_batch({"id": [2], "note": ["new"]})
    frozen = sink(db_url, table="evolving", schema_evolution=False)
    assert not frozen.capabilities().schema_evolution
    with pytest.raises(SchemaError, match="note"):
        asyncio.run(frozen.write_batch(wider))
    with pytest.raises(SchemaError):
        asyncio.run(frozen.evolve_schema([AddColumn("note", pa.string())]))
    assert rows_of(engine, "evolving") == [(1,)]

    evolving = sink(db_url, table="evolving")
    asyncio.run(evolving.evolve_schema([AddColumn("score", pa.float64())]))
    asyncio.run(evolving.evolve_schema([AddColumn("score", pa.float64())]))  # idempotent
    asyncio.run(evolving.write_batch(wider))
    assert rows_of(engine, "evolving") == [(1, None, None), (2, None, "new")]


def test_hostile_table_and_column_names_create_nothing_else(db_url: str, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE victim (id INTEGER)"))
    column = 'a "quoted"; col; DROP TABLE victim; --'
    dst = sink(db_url, table=INJECTION, mode="upsert", key=["my key"])
    batch = pa.record_batch({"my key": [1, 2], column: ["x", "y"]})
    asyncio.run(dst.write_batch(batch))
    asyncio.run(dst.write_batch_idempotent(pa.record_batch({"my key": [2], column: ["z"]}), CommitToken(1)))
    assert table_names(engine) == {"victim", INJECTION, "_faucet_watermarks"}
    assert rows_of(engine, INJECTION, order_by="my key") == [(1, "x"), (2, "z")]
    src = source(db_url, table=INJECTION, cursor="my key", columns=[column])
    pages = asyncio.run(_collect(src, 1))
    assert [page.records.column(column).to_pylist() for page in pages] == [["x"], ["z"]]


@pytest.mark.parametrize("mode", ["append", "replace"])
def test_a_percent_in_table_and_column_names_is_kept_as_written(
    db_url: str, engine: sa.Engine, mode: str
) -> None:
    # psycopg's paramstyle is %-based: SQLAlchemy's preparer doubles a `%` in a name, the driver undoes
    # it; escaping once more made ADD COLUMN and RENAME create `%%` names (and REPLACE fail).
    asyncio.run(sync_batches(sink(db_url, table="50%_off", mode=mode), pa.record_batch({"id%": [1]})))
    wider = pa.record_batch({"id%": [2], "rate%": [0.5]})  # ADD COLUMN, then (replace) the swap
    asyncio.run(sync_batches(sink(db_url, table="50%_off", mode=mode), wider))
    assert table_names(engine) == {"50%_off", "_faucet_watermarks"} - (
        {"_faucet_watermarks"} - table_names(engine)
    )
    columns = [column["name"] for column in sa.inspect(engine).get_columns("50%_off")]
    assert columns == ["id%", "rate%"]
    expected = [(2, 0.5)] if mode == "replace" else [(1, None), (2, 0.5)]
    assert rows_of(engine, "50%_off", order_by="id%") == expected


def test_nested_values_are_written_as_json_a_reader_decodes_and_a_nan_is_a_bad_row(
    db_url: str, engine: sa.Engine
) -> None:
    """Bytes as \\x hex (Python's ``str`` wrote ``b'...'``), a timestamp in ISO 8601, a decimal's
    exact digits; a NaN, which JSON cannot hold, rejects its row by index and the others land."""
    doc = pa.struct(
        [
            pa.field("raw", pa.binary()),
            pa.field("at", pa.timestamp("us", tz="UTC")),
            pa.field("amount", pa.decimal128(12, 3)),
            pa.field("scores", pa.list_(pa.float64())),
        ]
    )
    good = {"raw": b"\x00\xff", "at": dt.datetime(2024, 6, 1, tzinfo=dt.UTC), "amount": Decimal("1.250")}
    batch = pa.record_batch(
        {
            "id": pa.array([1, 2, 3], pa.int64()),
            "doc": pa.array(
                [{**good, "scores": [0.5]}, {**good, "scores": [float("nan")]}, {**good, "scores": []}], doc
            ),
        }
    )
    result = asyncio.run(sink(db_url, table="documents").write_batch_partial(batch))
    assert [row.index for row in result.rejected] == [1]
    assert "no JSON form: a NaN" in result.rejected[0].reason
    stored = {
        key: json.loads(value) if isinstance(value, str) else value
        for key, value in rows_of(engine, "documents")
    }
    expected = {"raw": "\\x00ff", "at": "2024-06-01T00:00:00+00:00", "amount": "1.250"}
    assert stored == {1: {**expected, "scores": [0.5]}, 3: {**expected, "scores": []}}


async def sync_batches(dst: Sink, *batches: pa.RecordBatch) -> None:
    for batch in batches:
        await dst.write_batch(batch)
    await dst.flush()
    await dst.finish()


async def _collect(src: Source, batch_size: int) -> list[Any]:
    return [page async for page in src.stream_pages({}, batch_size)]


def test_discover_lists_tables_and_columns(db_url: str, engine: sa.Engine) -> None:
    create_orders(engine)
    found = {dataset.name: dataset for dataset in asyncio.run(source(db_url, table="orders").discover())}
    assert "orders" in found
    schema = found["orders"].schema
    assert schema is not None and schema.names == ["id", "updated", "name", "amount"]
    assert schema.field("id").type == pa.int64() and schema.field("amount").type == pa.decimal128(10, 2)
    assert found["orders"].details["primary_key"] == "id"


def test_a_bookmark_for_another_cursor_is_refused(db_url: str, engine: sa.Engine) -> None:
    orders = create_orders(engine)
    insert_orders(engine, orders, range(3))
    _, bookmark = asyncio.run(
        sync(source(db_url, table="orders", cursor="updated"), sink(db_url, table="c"), 2)
    )
    other = source(db_url, table="orders")
    other.apply_start_bookmark(bookmark)
    with pytest.raises(ConfigError, match="cursor or key changed"):
        asyncio.run(_collect(other, 2))


def test_missing_sqlite_file_table_and_dead_host_raise_faucet_errors(tmp_path: Path) -> None:
    missing = tmp_path / "absent.db"
    with pytest.raises(ConfigError) as info:
        asyncio.run(source(f"sqlite:///{missing}", table="t").check())
    assert str(missing) in str(info.value)
    assert not missing.exists()

    asyncio.run(sink(f"sqlite:///{tmp_path / 'made.db'}", table="t").write_batch(pa.record_batch({"a": [1]})))
    with pytest.raises(ConfigError, match="nope"):
        asyncio.run(source(f"sqlite:///{tmp_path / 'made.db'}", table="nope").check())

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dead = f"postgresql://postgres@127.0.0.1:{port}/db"
    with pytest.raises(ConnectionFailed) as failed:
        asyncio.run(source(dead, table="t").check())
    assert f"127.0.0.1:{port}" in str(failed.value)
    with pytest.raises(ConnectionFailed):
        asyncio.run(sink(dead, table="t").write_batch(pa.record_batch({"a": [1]})))


def test_a_duckdb_url_is_refused_naming_the_duckdb_connector(tmp_path: Path) -> None:
    for url in (f"duckdb:///{tmp_path / 'w.duckdb'}", "duckdb:///:memory:"):
        with pytest.raises(ConfigError, match="use the duckdb connector"):
            sink(url, table="orders")
        with pytest.raises(ConfigError, match="use the duckdb connector"):
            source(url, table="orders")


def test_a_sqlite_sink_under_an_unusable_folder_raises_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError) as info:
        unusable = sink(f"sqlite:///{blocker / 'orders.db'}", table="t")
        asyncio.run(unusable.write_batch(pa.record_batch({"a": [1]})))
    assert str(blocker) in str(info.value)


def run_sql(url: str, *statements: str) -> None:
    """Run ``statements`` in one transaction on the database at ``url``."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)
    engine.dispose()


async def pages_of(url: str, table: str, batch_size: int) -> list[pa.RecordBatch]:
    """Every page of ``table`` read by the SQL source in pages of ``batch_size`` rows."""
    src = source(url, table=table)
    try:
        return [page.records async for page in src.stream_pages({}, batch_size)]
    finally:
        await src.close()


def test_sqlite_pages_keep_their_values_and_a_mistyped_value_is_named(tmp_path: Path) -> None:
    """SQLite pages are built from its own tuples (no SQLAlchemy type changes a value): the values
    arrive as stored, and a text stored in an INTEGER column (SQLite allows it) is a DataError naming
    the column, not an Arrow error."""
    url = f"sqlite:///{tmp_path / 'typed.db'}"
    run_sql(
        url,
        "CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER, note TEXT)",
        "INSERT INTO t VALUES (1, 10, 'a'), (2, NULL, NULL), (3, -3, '')",
    )

    read = asyncio.run(pages_of(url, "t", 2))
    assert [batch.to_pylist() for batch in read] == [
        [{"id": 1, "n": 10, "note": "a"}, {"id": 2, "n": None, "note": None}],
        [{"id": 3, "n": -3, "note": ""}],
    ]
    assert read[0].schema == pa.schema([("id", pa.int64()), ("n", pa.int64()), ("note", pa.string())])
    run_sql(url, "INSERT INTO t VALUES (4, 'four', 'x')")
    with pytest.raises(DataError, match="column 'n'"):
        asyncio.run(pages_of(url, "t", 0))


def test_sqlite_values_sqlalchemy_converts_still_arrive_converted(tmp_path: Path) -> None:
    """SQLite hands timestamps back as text and booleans as integers; SQLAlchemy's types convert
    them, so such a table is not read from SQLite's own tuples."""
    url = f"sqlite:///{tmp_path / 'converted.db'}"
    run_sql(
        url,
        "CREATE TABLE t (id INTEGER PRIMARY KEY, at TIMESTAMP, ok BOOLEAN)",
        "INSERT INTO t VALUES (1, '2024-05-06 07:08:09.000000', 1), (2, NULL, 0)",
    )

    (page,) = asyncio.run(pages_of(url, "t", 10))
    assert page.to_pylist() == [
        {"id": 1, "at": dt.datetime(2024, 5, 6, 7, 8, 9), "ok": True},
        {"id": 2, "at": None, "ok": False},
    ]
