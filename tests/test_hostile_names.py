"""Names the destination would change: a `%` through the SQL sink, a column of the data longer than
PostgreSQL keeps. Against SQLite files and the real PostgreSQL."""

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

from faucet_dagster.protocol import AddColumn, SchemaError, get_connector

LONG_COLUMN = "c" * 64  # one byte more than PostgreSQL keeps


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


def columns_of(engine: sa.Engine) -> dict[str, list[str]]:
    inspector = sa.inspect(engine)
    return {
        name: [column["name"] for column in inspector.get_columns(name)]
        for name in inspector.get_table_names()
    }


async def write(dst: Any, *batches: pa.RecordBatch, evolve: list[AddColumn] | None = None) -> None:
    if evolve:
        await dst.evolve_schema(evolve)
    for batch in batches:
        await dst.write_batch(batch)
    await dst.flush()
    await dst.finish()


@pytest.mark.parametrize("mode", ["append", "replace"])
def test_a_percent_in_table_and_column_names_is_kept_as_written(
    db_url: str, engine: sa.Engine, mode: str
) -> None:
    sink = get_connector("sql").sink
    asyncio.run(write(sink({"url": db_url, "table": "50%_off", "mode": mode}), pa.record_batch({"id%": [1]})))
    # ADD COLUMN through evolution, then (replace) the staging table renamed into place.
    wider = pa.record_batch({"id%": [2], "rate%": [0.5]})
    asyncio.run(write(sink({"url": db_url, "table": "50%_off", "mode": mode}), wider))
    tables = columns_of(engine)
    assert tables.pop("50%_off") == ["id%", "rate%"]
    assert set(tables) <= {"_faucet_watermarks"}  # no staging table left behind, no `%%` twin
    with engine.connect() as conn:
        rows = conn.execute(sa.text('SELECT * FROM "50%_off" ORDER BY 1')).all()
    assert rows == ([(2, 0.5)] if mode == "replace" else [(1, None), (2, 0.5)])


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
