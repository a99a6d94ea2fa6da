"""Names PostgreSQL would change: a column of the data longer than it keeps is a SchemaError naming it,
at the PostgreSQL and the SQL sinks (a `%` in names: tests/connectors/test_sql_connector.py)."""

import asyncio
from typing import Any

import pyarrow as pa
import pytest

from faucet_dagster.protocol import SchemaError, get_connector

LONG_COLUMN = "c" * 64  # one byte more than PostgreSQL keeps


async def write(dst: Any, *batches: pa.RecordBatch) -> None:
    for batch in batches:
        await dst.write_batch(batch)
    await dst.flush()
    await dst.finish()


def test_a_data_column_postgresql_would_truncate_is_a_schema_error_naming_it(postgres_url: str) -> None:
    batch = pa.record_batch({"id": [1], LONG_COLUMN: ["x"]})
    sql_sink = get_connector("sql").sink({"url": postgres_url, "table": "wide"})
    with pytest.raises(SchemaError, match=f"'{LONG_COLUMN}' is 64 bytes long"):
        asyncio.run(write(sql_sink, batch))
    pg = get_connector("postgres")
    with pytest.raises(SchemaError, match=f"'{LONG_COLUMN}' is 64 bytes long"):
        asyncio.run(write(pg.sink({"url": postgres_url, "table": "wide"}), batch))
    # An existing table, evolved with such a column (the second run used to fail misleadingly).
    asyncio.run(write(pg.sink({"url": postgres_url, "table": "narrow"}), pa.record_batch({"id": [1]})))
    with pytest.raises(SchemaError, match=f"'{LONG_COLUMN}' is 64 bytes long"):
        asyncio.run(write(pg.sink({"url": postgres_url, "table": "narrow"}), batch))
