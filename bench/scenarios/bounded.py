"""The bounded runner end to end, against raw COPY and, when installed, the Sling and dlt peers.

``bounded.*`` scenarios run :func:`faucet_dagster.runner.bounded.run_bounded_sync` (plan, check, pages
read one ahead of the write, a commit token per page in the sink's transaction, flush, finish) on the
inputs of :mod:`bench.scenarios.connectors` (the same CSV file and SQLite table, the same target
table shape) and are compared with the raw loop doing the same job: ``raw.pg_copy`` (the rows already
in memory) for the CSV file, ``raw.sqlite_to_pg_copy`` (sqlite3 read, COPY) for the SQLite table.

``peer.*`` scenarios run a peer on the same input and server and are compared with the runner
scenario that does the same job, so their ratio is peer rows/s over faucet rows/s. They are
registered only when the peer is installed (:mod:`bench.peers`): Sling in ``$SLING_VENV`` (default
``.venv-sling``), dlt with the project's ``bench`` extra, run by :mod:`bench.dlt_child` on the SQLite
table ``bounded.sql_to_pg_append`` syncs.

``bounded.rss_csv_to_pg`` measures memory: the same sync of a 1M-row and a 10M-row CSV file, each in a
fresh subprocess (:mod:`bench.rss_child`) reporting its peak RSS. It prints both and their ratio; the
targets are 300 MB for 10M rows and at most 20% growth from 1M to 10M.
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
from psycopg import sql

from bench.context import BenchContext
from bench.peers import ROOT, peer_python, run_peer, run_sling_csv, sling_binary
from bench.registry import Measurement, scenario
from bench.scenarios.connectors import _check, _pg_sink, _target, csv_file, sqlite_file
from faucet_dagster.protocol import Sink, Source, get_connector
from faucet_dagster.runner.bounded import run_bounded_sync
from faucet_dagster.runner.bounded_values import BoundedSyncResult, SyncSettings

RSS_ROWS = (1_000_000, 10_000_000)


def run_sync_timed(source: Source, sink: Sink) -> tuple[BoundedSyncResult, float]:
    """One bounded sync with the default settings; the seconds exclude closing the connectors."""

    async def run() -> tuple[BoundedSyncResult, float]:
        try:
            start = time.perf_counter()
            result = await run_bounded_sync(source, sink, SyncSettings())
            return result, time.perf_counter() - start
        finally:
            await sink.close()
            await source.close()

    return asyncio.run(run())


def csv_source(path: str) -> Source:
    return get_connector("files").source({"paths": [path], "column_types": {"id": "int64"}})


@scenario("bounded.csv_to_pg_append", baseline="raw.pg_copy")
def csv_to_pg_append(ctx: BenchContext) -> Measurement:
    """The bounded runner: CSV file (files source) into PostgreSQL, append with a commit token per page."""
    path, table = csv_file(ctx), _target(ctx, "run_csv")
    result, seconds = run_sync_timed(csv_source(path), _pg_sink(ctx, table))
    _check(ctx, table)
    if result.plan.delivery.value != "effectively_once":
        raise RuntimeError(f"expected the atomic watermark, the plan says {result.plan.delivery}")
    return Measurement(result.rows_written, seconds)


@scenario("bounded.sql_to_pg_append", baseline="raw.sqlite_to_pg_copy")
def sql_to_pg_append(ctx: BenchContext) -> Measurement:
    """The bounded runner: a SQL table (SQLite, keyset pages) into PostgreSQL, append with commit tokens."""
    path, table = sqlite_file(ctx), _target(ctx, "run_sql")
    source = get_connector("sql").source({"url": f"sqlite:///{path}", "table": "dataset"})
    result, seconds = run_sync_timed(source, _pg_sink(ctx, table))
    _check(ctx, table)
    return Measurement(result.rows_written, seconds)


# -- peers -------------------------------------------------------------------------------------------


def _libpq_url(url: str, **extra: str) -> str:
    query = "&".join(f"{key}={value}" for key, value in extra.items())
    return f"{url}{'&' if '?' in url else '?'}{query}" if query else url


def sling_csv_to_pg(ctx: BenchContext) -> Measurement:
    """Sling (Go) loading the same CSV file into PostgreSQL (full refresh), as a subprocess."""
    table = ctx.unique("sling")
    env = {**os.environ, "PG": _libpq_url(ctx.postgres_url, sslmode="disable")}
    seconds = run_sling_csv(csv_file(ctx), "PG", f"public.{table}", env)
    _check(ctx, table)
    return Measurement(ctx.rows, seconds)


DLT_CHILD = ROOT / "bench" / "dlt_child.py"


def _dlt(ctx: BenchContext, backend: str) -> Measurement:
    python = peer_python("DLT_VENV", ".venv-dlt", "dlt")
    assert python is not None
    env = {
        **os.environ,
        # dlt's credentials insist on a password field; the test server ignores it.
        "PG_DSN": ctx.postgres_url.replace("postgresql://postgres@", "postgresql://postgres:x@"),
    }
    command = [str(python), str(DLT_CHILD), "sql_to_pg", sqlite_file(ctx), ctx.unique("dlt"), backend]
    report = run_peer("dlt", command, env)
    if int(report["rows"]) != ctx.rows:
        raise RuntimeError(f"dlt loaded {report['rows']} rows, not {ctx.rows}")
    return Measurement(ctx.rows, float(report["seconds"]))


def dlt_append(ctx: BenchContext) -> Measurement:
    """dlt (``bench/dlt_child.py``: its ``sql_table`` source, default ``sqlalchemy`` backend) appending
    the same SQLite table into PostgreSQL, ``payload`` as jsonb; timed around its ``pipeline.run``."""
    return _dlt(ctx, "sqlalchemy")


def dlt_append_pyarrow(ctx: BenchContext) -> Measurement:
    """The same with dlt's fastest ``pyarrow`` backend (Arrow pages, no per-row Python objects)."""
    return _dlt(ctx, "pyarrow")


if sling_binary() is not None:
    scenario("peer.sling_csv_to_pg", baseline="bounded.csv_to_pg_append")(sling_csv_to_pg)
if peer_python("DLT_VENV", ".venv-dlt", "dlt") is not None:
    scenario("peer.dlt_append", baseline="bounded.sql_to_pg_append")(dlt_append)
    scenario("peer.dlt_append_pyarrow", baseline="bounded.sql_to_pg_append")(dlt_append_pyarrow)


# -- memory ------------------------------------------------------------------------------------------


def _big_csv(rows: int, folder: str) -> str:
    """A CSV file of ``rows`` dataset-shaped rows, written in chunks (the parent stays small)."""
    path = os.path.join(folder, f"rss_{rows}.csv")
    chunk = 500_000
    with pa_csv.CSVWriter(
        path, pa.schema([("id", pa.int64()), ("k", pa.string()), ("payload", pa.string())])
    ) as out:
        for first in range(0, rows, chunk):
            ids = pa.array(range(first, min(rows, first + chunk)), pa.int64())
            text = pc.cast(ids, pa.string())
            keys = pc.binary_join_element_wise("k", pc.cast(pc.bit_wise_and(ids, 1023), pa.string()), "")
            payload = pc.binary_join_element_wise(
                '{"i": ', text, ', "name": "user-', text, '", "score": ', text, ".5}", ""
            )
            out.write_table(pa.table({"id": ids, "k": keys, "payload": payload}))
    return path


@scenario("bounded.rss_csv_to_pg")
def rss_csv_to_pg(ctx: BenchContext) -> Measurement:
    """Peak RSS of the bounded runner syncing a 1M-row and a 10M-row CSV file, each in a fresh process."""
    peaks: dict[int, float] = {}
    seconds = 0.0
    with tempfile.TemporaryDirectory(prefix="faucet-bench-rss-") as folder:
        for rows in RSS_ROWS:
            path, table = _big_csv(rows, folder), _target(ctx, f"rss_{rows}")
            done = subprocess.run(
                [sys.executable, "-m", "bench.rss_child", path, ctx.postgres_url, table],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=3600,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"the {rows}-row sync failed: {done.stderr[-2000:]}")
            report = json.loads(done.stdout.strip().splitlines()[-1])
            if report["rows_written"] != rows:
                raise RuntimeError(f"{table}: wrote {report['rows_written']} rows, expected {rows}")
            peaks[rows] = report["peak_rss_mb"]
            seconds = report["seconds"]
            with psycopg.connect(ctx.postgres_url) as conn:
                conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    small, large = (peaks[rows] for rows in RSS_ROWS)
    print(
        f"peak RSS: {small:.0f} MB at {RSS_ROWS[0]:,} rows, {large:.0f} MB at {RSS_ROWS[1]:,} rows "
        f"({large / small - 1:+.0%}); targets: <= 300 MB and <= +20%",
        flush=True,
    )
    return Measurement(RSS_ROWS[1], seconds, {"peak_rss_mb": peaks})
