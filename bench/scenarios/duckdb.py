"""DuckDB: the bounded runner writing a DuckDB file, against the raw loop doing the same job.

``bounded.csv_to_duckdb`` runs :func:`faucet_dagster.runner.bounded.run_bounded_sync` on the shared CSV
file (:func:`bench.scenarios.connectors.csv_file`) into a new DuckDB file (the files source's pages, a
commit token per page in the page's transaction). Its baseline ``raw.duckdb_arrow_insert`` does the
same job with no faucet in between: the same CSV file read whole by pyarrow (multithreaded), inserted
from Arrow in one statement (``INSERT INTO ... SELECT * FROM <arrow>``, its own transaction). Both
create their table in a new file of their own and are checked by counting it.
"""

import os
import shutil
import tempfile
import time

import duckdb
import pyarrow as pa
import pyarrow.csv as pa_csv

from bench.context import BenchContext
from bench.registry import Measurement, scenario
from bench.scenarios.bounded import csv_source, run_sync_timed
from bench.scenarios.connectors import csv_file
from faucet_dagster.protocol import get_connector

SCHEMA = pa.schema([("id", pa.int64()), ("k", pa.string()), ("payload", pa.string())])


def _new_file(ctx: BenchContext, prefix: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"faucet-bench-{prefix}-")
    ctx.on_close(lambda: shutil.rmtree(folder))
    return os.path.join(folder, "warehouse.duckdb")


def _check(ctx: BenchContext, path: str) -> None:
    with duckdb.connect(path) as conn:
        found = conn.execute("SELECT count(*), max(id), count(DISTINCT id) FROM dataset").fetchall()[0]
    want = (ctx.rows, ctx.rows - 1, ctx.rows)
    if found != want:
        raise RuntimeError(f"{path}: (rows, max id, distinct ids) is {found}, expected {want}")


@scenario("raw.duckdb_arrow_insert")
def duckdb_arrow_insert(ctx: BenchContext) -> Measurement:
    """pyarrow's CSV reader on the whole file, the table inserted from Arrow into DuckDB in one statement."""
    source, path = csv_file(ctx), _new_file(ctx, "duckdb-raw")
    with duckdb.connect(path) as conn:
        conn.execute("CREATE TABLE dataset (id BIGINT, k VARCHAR, payload VARCHAR)")
        start = time.perf_counter()
        rows = pa_csv.read_csv(source, convert_options=pa_csv.ConvertOptions(column_types=SCHEMA))
        conn.register("rows", rows)
        conn.execute("INSERT INTO dataset SELECT * FROM rows")
        conn.unregister("rows")
        seconds = time.perf_counter() - start
    _check(ctx, path)
    return Measurement(ctx.rows, seconds)


@scenario("bounded.csv_to_duckdb", baseline="raw.duckdb_arrow_insert")
def csv_to_duckdb(ctx: BenchContext) -> Measurement:
    """The bounded runner: CSV file (files source) into a DuckDB file, append with a commit token per page."""
    path = _new_file(ctx, "duckdb-run")
    sink = get_connector("duckdb").sink({"path": path, "table": "dataset"})
    result, seconds = run_sync_timed(csv_source(csv_file(ctx)), sink)
    _check(ctx, path)
    if result.plan.delivery.value != "effectively_once":
        raise RuntimeError(f"expected the atomic watermark, the plan says {result.plan.delivery}")
    return Measurement(result.rows_written, seconds)
