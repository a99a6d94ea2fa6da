"""Bounded connector throughput: the files, SQL and PostgreSQL connectors moving the dataset into PostgreSQL.

Each scenario drives a source's ``stream_pages`` straight into the PostgreSQL sink (no runner, no
planner: the connectors' own throughput) and is compared with ``raw.pg_copy``, psycopg COPY of the same
rows into the same table shape ``(id bigint, k text, payload jsonb)``. Inputs (the CSV file, the SQLite
table, the PostgreSQL source table) are written once per run, outside the timed sections. Every scenario
checks the row count and the last row after its timed section and raises if they are wrong.
"""

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.csv as pa_csv
import sqlalchemy as sa
from faucet_postgres.common import table_columns
from faucet_postgres.copy_arrow import encode_copy
from psycopg import sql

from bench.context import BenchContext
from bench.registry import Measurement, scenario
from faucet_dagster.protocol import Sink, Source, get_connector

PAGE_ROWS = 50_000
"""Rows per page, as the bounded runner's default batch size."""


def _dataset_table(ctx: BenchContext) -> pa.Table:
    """The dataset as an Arrow table (id int64, k string, payload string), built once."""

    def build() -> pa.Table:
        ids, keys, payloads = zip(*ctx.dataset(), strict=True)
        return pa.table({"id": pa.array(ids, pa.int64()), "k": pa.array(keys), "payload": pa.array(payloads)})

    return ctx.shared("connectors.arrow", build)


def _temporary_file(ctx: BenchContext, name: str, write: Callable[[str], None]) -> str:
    """A file ``name`` in a new temporary folder, filled by ``write(path)``, removed at the end of the run."""
    folder = tempfile.mkdtemp(prefix="faucet-bench-")
    path = os.path.join(folder, name)
    ctx.on_close(lambda: shutil.rmtree(folder))
    write(path)
    return path


def csv_file(ctx: BenchContext) -> str:
    """The dataset as a CSV file with a header (``id,k,payload``), written once per run."""
    return ctx.shared(
        "connectors.csv",
        lambda: _temporary_file(ctx, "dataset.csv", lambda path: pa_csv.write_csv(_dataset_table(ctx), path)),
    )


def sqlite_file(ctx: BenchContext) -> str:
    """The dataset in table ``dataset`` (id primary key) of a SQLite file, written once per run."""

    def write(path: str) -> None:
        engine = sa.create_engine(f"sqlite:///{path}")
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE dataset (id INTEGER PRIMARY KEY, k TEXT, payload TEXT)")
            conn.exec_driver_sql("INSERT INTO dataset VALUES (?, ?, ?)", ctx.dataset())
        engine.dispose()

    return ctx.shared("connectors.sqlite", lambda: _temporary_file(ctx, "dataset.db", write))


def postgres_table(ctx: BenchContext) -> str:
    """The dataset in a PostgreSQL table (id primary key), written once per run."""

    def write() -> str:
        table = ctx.unique("source")
        with psycopg.connect(ctx.postgres_url) as conn:
            conn.execute(
                sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, k text, payload jsonb)").format(
                    sql.Identifier(table)
                )
            )
            with conn.cursor().copy(sql.SQL("COPY {} FROM STDIN").format(sql.Identifier(table))) as copy:
                for row in ctx.dataset():
                    copy.write_row(row)
        return table

    return ctx.shared("connectors.pg_table", write)


def _target(ctx: BenchContext, prefix: str, primary_key: bool = False) -> str:
    """A new, empty table shaped like ``raw.pg_copy``'s."""
    table = ctx.unique(prefix)
    key = " PRIMARY KEY" if primary_key else ""
    with psycopg.connect(ctx.postgres_url) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (id bigint{}, k text, payload jsonb)").format(
                sql.Identifier(table), sql.SQL(key)
            )
        )
    return table


def _check(ctx: BenchContext, table: str) -> None:
    with psycopg.connect(ctx.postgres_url) as conn:
        query = sql.SQL("SELECT count(*), max(id), count(DISTINCT id) FROM {}").format(sql.Identifier(table))
        found = conn.execute(query).fetchone()
    want = (ctx.rows, ctx.rows - 1, ctx.rows)
    if found != want:
        raise RuntimeError(f"{table}: (rows, max id, distinct ids) is {found}, expected {want}")


def _move(source: Source, sink: Sink) -> tuple[int, float]:
    """Stream every page of ``source`` into ``sink``; return the rows written and the seconds taken."""

    async def run() -> tuple[int, float]:
        written = 0
        start = time.perf_counter()
        async for page in source.stream_pages({}, PAGE_ROWS):
            assert isinstance(page.records, pa.RecordBatch)
            written += await sink.write_batch(page.records)
        await sink.flush()
        await sink.finish()
        seconds = time.perf_counter() - start
        await sink.close()
        await source.close()
        return written, seconds

    return asyncio.run(run())


def _pg_sink(ctx: BenchContext, table: str, **config: Any) -> Sink:
    return get_connector("postgres").sink({"url": ctx.postgres_url, "table": table, **config})


@scenario("connectors.csv_to_pg_append", baseline="raw.pg_copy")
def csv_to_pg_append(ctx: BenchContext) -> Measurement:
    """files source (CSV, pyarrow streaming reader) into the PostgreSQL sink, append (COPY)."""
    path, table = csv_file(ctx), _target(ctx, "csv_append")
    source = get_connector("files").source({"paths": [path], "column_types": {"id": "int64"}})
    written, seconds = _move(source, _pg_sink(ctx, table))
    _check(ctx, table)
    return Measurement(written, seconds, {"file_mb": round(os.path.getsize(path) / 1e6, 1)})


@scenario("connectors.csv_file_copy", baseline="raw.pg_copy")
def csv_file_copy(ctx: BenchContext) -> Measurement:
    """The CSV file's bytes streamed into COPY ... (FORMAT csv, HEADER): the ceiling for CSV input."""
    path, table = csv_file(ctx), _target(ctx, "csv_file")
    with psycopg.connect(ctx.postgres_url) as conn:
        start = time.perf_counter()
        statement = sql.SQL("COPY {} FROM STDIN (FORMAT csv, HEADER true)").format(sql.Identifier(table))
        with conn.cursor().copy(statement) as copy, open(path, "rb") as file:
            while chunk := file.read(1 << 20):
                copy.write(chunk)
        conn.commit()
        seconds = time.perf_counter() - start
    _check(ctx, table)
    return Measurement(ctx.rows, seconds)


@scenario("connectors.pg_binary_pages", baseline="raw.pg_copy")
def pg_binary_pages(ctx: BenchContext) -> Measurement:
    """The dataset's pages encoded by the PostgreSQL sink's encoder before the clock, then COPYed in
    binary one transaction per page: the ceiling for a sync that commits each page."""
    table = _target(ctx, "binary_pages")

    async def destination() -> Any:
        async with await psycopg.AsyncConnection.connect(ctx.postgres_url) as conn:
            return await table_columns(conn, "public", table)

    columns = asyncio.run(destination())
    payloads = [encode_copy(page, columns) for page in _dataset_table(ctx).to_batches(PAGE_ROWS)]
    if {payload.format for payload in payloads} != {"binary"}:
        raise RuntimeError(f"the sink's encoder chose {payloads[0].format}, not binary")
    statement = sql.SQL("COPY {} FROM STDIN (FORMAT binary)").format(sql.Identifier(table))
    with psycopg.connect(ctx.postgres_url) as conn:
        start = time.perf_counter()
        for payload in payloads:
            with conn.cursor().copy(statement) as copy:
                for chunk in payload.chunks:
                    copy.write(chunk)
            conn.commit()
        seconds = time.perf_counter() - start
    _check(ctx, table)
    return Measurement(ctx.rows, seconds)


@scenario("connectors.csv_to_pg_upsert", baseline="raw.pg_copy")
def csv_to_pg_upsert(ctx: BenchContext) -> Measurement:
    """files source (CSV) into the PostgreSQL sink, upsert by id into an empty keyed table."""
    path, table = csv_file(ctx), _target(ctx, "csv_upsert", primary_key=True)
    source = get_connector("files").source({"paths": [path], "column_types": {"id": "int64"}})
    written, seconds = _move(source, _pg_sink(ctx, table, mode="upsert", key=["id"]))
    _check(ctx, table)
    return Measurement(written, seconds)


@scenario("connectors.sqlite_to_pg_append", baseline="raw.pg_copy")
def sqlite_to_pg_append(ctx: BenchContext) -> Measurement:
    """SQL source (SQLAlchemy on SQLite, keyset pages by id) into the PostgreSQL sink, append."""
    path, table = sqlite_file(ctx), _target(ctx, "sqlite_append")
    source = get_connector("sql").source({"url": f"sqlite:///{path}", "table": "dataset"})
    written, seconds = _move(source, _pg_sink(ctx, table))
    _check(ctx, table)
    return Measurement(written, seconds)


@scenario("connectors.pg_to_pg_append", baseline="raw.pg_copy")
def pg_to_pg_append(ctx: BenchContext) -> Measurement:
    """PostgreSQL source (COPY TO in key order, parsed by pyarrow) into the PostgreSQL sink, append."""
    origin, table = postgres_table(ctx), _target(ctx, "pg_append")
    source = get_connector("postgres").source({"url": ctx.postgres_url, "table": origin})
    written, seconds = _move(source, _pg_sink(ctx, table))
    _check(ctx, table)
    return Measurement(written, seconds)
