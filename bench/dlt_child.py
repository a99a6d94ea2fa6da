"""The dlt peers, run as a child process by a Python that has dlt (the project's ``bench`` extra).

Usage, one of:

- ``python dlt_child.py sql_to_pg SQLITE_PATH DATASET BACKEND`` with ``PG_DSN`` in the environment:
  dlt's own ``sql_table`` source reads table ``dataset`` with ``BACKEND``: ``sqlalchemy`` (dlt's
  default: rows as Python dicts, normalized row by row) or ``pyarrow`` (its fastest: pages of Arrow
  tables), its ``payload`` column hinted as JSON so that PostgreSQL gets the ``jsonb`` column faucet's
  sync writes too, and the pipeline appends it to a new dataset.
- ``python dlt_child.py csv_to_duckdb CSV_PATH DUCKDB_PATH``: a dlt resource yielding the CSV file's
  rows as Arrow tables of 50,000 rows (pyarrow's streaming CSV reader, the page size faucet's sync
  uses; Arrow is dlt's fastest path: no per-row Python objects), appended by dlt's DuckDB destination
  to table ``dataset`` of a new DuckDB file.

The clock runs from just before ``pipeline.run`` to its return (extract, normalize and load: dlt's
whole job). Prints one JSON object: ``rows`` loaded (read back from the destination) and ``seconds``.
"""

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("DLT_DATA_DIR", tempfile.mkdtemp())
os.environ.setdefault("RUNTIME__DLTHUB_TELEMETRY", "false")

# dlt reads the environment above when it is imported.
import dlt
import pyarrow as pa
import pyarrow.csv as pa_csv
from dlt.destinations import duckdb, postgres
from dlt.sources.sql_database import sql_table

PAGE_ROWS = 50_000


def _timed_run(pipeline: Any, data: Any) -> float:
    start = time.perf_counter()
    pipeline.run(data, write_disposition="append")
    return time.perf_counter() - start


def sql_to_pg(sqlite_path: str, dataset: str, backend: str) -> dict[str, Any]:
    table = sql_table(
        credentials=f"sqlite:///{sqlite_path}",
        table="dataset",
        backend=backend,
        chunk_size=PAGE_ROWS,
    )
    table.apply_hints(columns={"payload": {"data_type": "json"}})
    pipeline = dlt.pipeline(
        pipeline_name=dataset,
        destination=postgres(credentials=os.environ["PG_DSN"]),
        dataset_name=dataset,
        pipelines_dir=tempfile.mkdtemp(),
    )
    seconds = _timed_run(pipeline, table)
    with pipeline.sql_client() as client:
        rows = client.execute_sql("SELECT count(*) FROM dataset")[0][0]
        kind = client.execute_sql(
            "SELECT data_type FROM information_schema.columns WHERE table_schema = %s "
            "AND table_name = 'dataset' AND column_name = 'payload'",
            dataset,
        )[0][0]
    if kind != "jsonb":
        raise SystemExit(f"dlt wrote payload as {kind}, not jsonb")
    return {"rows": int(rows), "seconds": seconds}


def csv_to_duckdb(csv_path: str, duckdb_path: str) -> dict[str, Any]:
    types = {"id": pa.int64(), "k": pa.string(), "payload": pa.string()}

    @dlt.resource(name="dataset")
    def rows() -> Iterator[pa.Table]:
        reader = pa_csv.open_csv(csv_path, convert_options=pa_csv.ConvertOptions(column_types=types))
        pending: list[pa.RecordBatch] = []
        held = 0
        for batch in reader:
            pending.append(batch)
            held += batch.num_rows
            if held >= PAGE_ROWS:
                yield pa.Table.from_batches(pending)
                pending, held = [], 0
        if pending:
            yield pa.Table.from_batches(pending)

    pipeline = dlt.pipeline(
        pipeline_name="csv_to_duckdb",
        destination=duckdb(credentials=duckdb_path),
        dataset_name="main",
        pipelines_dir=tempfile.mkdtemp(),
    )
    seconds = _timed_run(pipeline, rows())
    with pipeline.sql_client() as client:
        loaded = client.execute_sql("SELECT count(*) FROM dataset")[0][0]
    return {"rows": int(loaded), "seconds": seconds}


if __name__ == "__main__":
    job, *arguments = sys.argv[1:]
    report = sql_to_pg(*arguments) if job == "sql_to_pg" else csv_to_duckdb(*arguments)
    print(json.dumps(report))
