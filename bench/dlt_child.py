"""The dlt peer, run inside dlt's own virtual environment: the bench's SQLite table into PostgreSQL.

Usage: ``python dlt_child.py SQLITE_PATH DATASET BACKEND`` with ``PG_DSN`` in the environment. dlt's
own ``sql_table`` source reads table ``dataset`` with ``BACKEND``: ``sqlalchemy`` (dlt's default: rows
as Python dicts, normalized row by row) or ``pyarrow`` (its fastest: pages of Arrow tables), its
``payload`` column hinted as JSON so that PostgreSQL gets the ``jsonb`` column faucet's sync writes
too, and the pipeline appends it to a new dataset. The clock runs
from just before ``pipeline.run`` to its return (extract, normalize and load: dlt's whole job). Prints
one JSON object: ``rows`` loaded (read back from PostgreSQL) and ``seconds``.
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("DLT_DATA_DIR", tempfile.mkdtemp())
os.environ.setdefault("RUNTIME__DLTHUB_TELEMETRY", "false")

# dlt reads the environment above when it is imported.
import dlt
from dlt.destinations import postgres
from dlt.sources.sql_database import sql_table


def main(sqlite_path: str, dataset: str, backend: str) -> None:
    table = sql_table(
        credentials=f"sqlite:///{sqlite_path}",
        table="dataset",
        backend=backend,
        chunk_size=50_000,
    )
    table.apply_hints(columns={"payload": {"data_type": "json"}})
    pipeline = dlt.pipeline(
        pipeline_name=dataset,
        destination=postgres(credentials=os.environ["PG_DSN"]),
        dataset_name=dataset,
        pipelines_dir=tempfile.mkdtemp(),
    )
    start = time.perf_counter()
    pipeline.run(table, write_disposition="append")
    seconds = time.perf_counter() - start
    with pipeline.sql_client() as client:
        rows = client.execute_sql("SELECT count(*) FROM dataset")[0][0]
        kind = client.execute_sql(
            "SELECT data_type FROM information_schema.columns WHERE table_schema = %s "
            "AND table_name = 'dataset' AND column_name = 'payload'",
            dataset,
        )[0][0]
    if kind != "jsonb":
        raise SystemExit(f"dlt wrote payload as {kind}, not jsonb")
    print(json.dumps({"rows": int(rows), "seconds": seconds}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
