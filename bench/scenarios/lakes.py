"""DuckDB and Delta Lake: the bounded runner writing a DuckDB file or a Delta table, against the raw
loop doing the same job.

``bounded.csv_to_duckdb`` runs :func:`faucet_dagster.runner.bounded.run_bounded_sync` on the shared CSV
file (:func:`bench.scenarios.connectors.csv_file`) into a new DuckDB file (the files source's pages, a
commit token per page in the page's transaction). Its baseline ``raw.duckdb_arrow_insert`` does the
same job with no faucet in between: the same CSV file read whole by pyarrow (multithreaded), inserted
from Arrow in one statement (``INSERT INTO ... SELECT * FROM <arrow>``, its own transaction). Both
create their table in a new file of their own and are checked by counting it.

Its peers, when installed (:mod:`bench.peers`), load the same CSV file into a new DuckDB file and
are compared with it: ``peer.sling_csv_to_duckdb`` (Sling's DuckDB target, full refresh, its default
copy method; a subprocess, timed around it) and ``peer.dlt_csv_to_duckdb`` (dlt's DuckDB
destination fed Arrow pages, :mod:`bench.dlt_child`, timed around ``pipeline.run``).

``bounded.csv_to_delta`` does the same into a new Delta table (a commit per page, with its transaction
identifier); its baseline ``raw.delta_write_pages`` reads the CSV file with pyarrow and appends it with
``write_deltalake`` in pages of the runner's default size, one commit each, as the sync commits.
"""

import os
import shutil
import tempfile
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from bench.context import BenchContext
from bench.peers import peer_python, run_peer, run_sling_csv, sling_duckdb_cli, sling_duckdb_env
from bench.registry import Measurement, scenario
from bench.scenarios.bounded import DLT_CHILD, csv_source, run_sync_timed
from bench.scenarios.connectors import csv_file
from faucet_dagster.protocol import get_connector
from faucet_dagster.runner.bounded_values import SyncSettings

SCHEMA = pa.schema([("id", pa.int64()), ("k", pa.string()), ("payload", pa.string())])


def _new_file(ctx: BenchContext, prefix: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"faucet-bench-{prefix}-")
    ctx.on_close(lambda: shutil.rmtree(folder))
    return os.path.join(folder, "warehouse.duckdb")


def _check(ctx: BenchContext, path: str) -> None:
    with duckdb.connect(path) as conn:
        found = conn.execute("SELECT count(*), max(id), count(DISTINCT id) FROM main.dataset").fetchall()[0]
    want = (ctx.rows, ctx.rows - 1, ctx.rows)
    if found != want:
        raise RuntimeError(f"{path}: (rows, max id, distinct ids) is {found}, expected {want}")


@scenario("raw.duckdb_arrow_insert")
def duckdb_arrow_insert(ctx: BenchContext) -> Measurement:
    """A new DuckDB file, pyarrow's CSV reader on the whole file, inserted from Arrow in one statement."""
    source, path = csv_file(ctx), _new_file(ctx, "duckdb-raw")
    start = time.perf_counter()
    with duckdb.connect(path) as conn:
        conn.execute("CREATE TABLE dataset (id BIGINT, k VARCHAR, payload VARCHAR)")
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


def sling_csv_to_duckdb(ctx: BenchContext) -> Measurement:
    """Sling (Go, driving the DuckDB command line) loading the same CSV file into a new DuckDB file."""
    path = _new_file(ctx, "duckdb-sling")
    env = {**sling_duckdb_env(Path(path).parent / "home"), "DUCKDB": f"duckdb://{path}"}
    seconds = run_sling_csv(csv_file(ctx), "DUCKDB", "main.dataset", env)
    _check(ctx, path)
    return Measurement(ctx.rows, seconds)


def dlt_csv_to_duckdb(ctx: BenchContext) -> Measurement:
    """dlt's DuckDB destination appending the same CSV file's rows, fed as Arrow pages of 50,000."""
    python, path = peer_python("DLT_VENV", ".venv-dlt", "dlt"), _new_file(ctx, "duckdb-dlt")
    assert python is not None
    report = run_peer("dlt", [str(python), str(DLT_CHILD), "csv_to_duckdb", csv_file(ctx), path])
    _check(ctx, path)
    return Measurement(int(report["rows"]), float(report["seconds"]))


if sling_duckdb_cli() is not None:
    scenario("peer.sling_csv_to_duckdb", baseline="bounded.csv_to_duckdb")(sling_csv_to_duckdb)
if peer_python("DLT_VENV", ".venv-dlt", "dlt") is not None:
    scenario("peer.dlt_csv_to_duckdb", baseline="bounded.csv_to_duckdb")(dlt_csv_to_duckdb)


# -- Delta Lake ----------------------------------------------------------------------------------------


def _new_table(ctx: BenchContext, prefix: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"faucet-bench-{prefix}-")
    ctx.on_close(lambda: shutil.rmtree(folder))
    return os.path.join(folder, "dataset")


def _check_delta(ctx: BenchContext, path: str) -> None:
    from deltalake import DeltaTable

    ids = DeltaTable(path).to_pyarrow_table(columns=["id"]).column("id")
    found = (len(ids), pc.max(ids).as_py(), pc.count_distinct(ids).as_py())
    want = (ctx.rows, ctx.rows - 1, ctx.rows)
    if found != want:
        raise RuntimeError(f"{path}: (rows, max id, distinct ids) is {found}, expected {want}")


@scenario("raw.delta_write_pages")
def delta_write_pages(ctx: BenchContext) -> Measurement:
    """The CSV file read by pyarrow in the runner's page size, each page one ``write_deltalake`` append."""
    from deltalake import write_deltalake

    source, path = csv_file(ctx), _new_table(ctx, "delta-raw")
    start = time.perf_counter()
    rows = pa_csv.read_csv(source, convert_options=pa_csv.ConvertOptions(column_types=SCHEMA))
    for page in rows.to_batches(max_chunksize=SyncSettings().batch_size):
        write_deltalake(path, pa.Table.from_batches([page]), mode="append")
    seconds = time.perf_counter() - start
    _check_delta(ctx, path)
    return Measurement(ctx.rows, seconds)


@scenario("bounded.csv_to_delta", baseline="raw.delta_write_pages")
def csv_to_delta(ctx: BenchContext) -> Measurement:
    """The bounded runner: CSV file (files source) into a Delta table, each page one commit with its
    transaction identifier."""
    path = _new_table(ctx, "delta-run")
    sink = get_connector("delta").sink({"uri": path})
    result, seconds = run_sync_timed(csv_source(csv_file(ctx)), sink)
    _check_delta(ctx, path)
    if result.plan.delivery.value != "effectively_once":
        raise RuntimeError(f"expected the atomic watermark, the plan says {result.plan.delivery}")
    return Measurement(result.rows_written, seconds)
