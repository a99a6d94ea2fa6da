"""Cursor resumes of the PostgreSQL and SQL bounded sources when cursor values repeat.

A keyset read orders rows by ``(cursor, key)`` and a page's bookmark is its last row's position;
resuming reads ``> position``. When the key is unique with the cursor (the primary key, the default),
no two rows share a position. A configured key need not be unique: a page then never ends between two
rows of one position (a longer page instead), so no resume and no next page skips one. Every resume
point is tried: a run "dies" after each page and the next run resumes from that page's bookmark.
"""

import asyncio
import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
import sqlalchemy as sa

from faucet_dagster.protocol import KeysetPages, Source, get_connector, tie_start

ROWS = 240
PAGE = 7


def rows(seed: int) -> list[tuple[int, int, int]]:
    """(id, cursor, grp): cursor values repeat in runs (5 distinct), grp repeats within a cursor value
    (a key that is not unique: 3 rows share each (cursor, grp))."""
    shuffled = random.Random(seed).sample(range(1, ROWS + 1), ROWS)
    return [(i, i % 5, (i // 5) % (ROWS // 15)) for i in shuffled]


def read_every_resume(make: Callable[[], Source]) -> list[int]:
    """Ids delivered when a run dies after every page and the next resumes from its bookmark."""

    async def run() -> list[int]:
        delivered: list[int] = []
        bookmark: Any = None
        while True:
            source = make()
            if bookmark is not None:
                source.apply_start_bookmark(bookmark)
            try:
                pages = source.stream_pages({}, PAGE)
                page = await anext(pages, None)
                await pages.aclose()
            finally:
                await source.close()
            if page is None:
                return delivered
            assert page.num_rows <= PAGE or len(set(page.records.column("grp").to_pylist())) == 1
            delivered.extend(page.records.column("id").to_pylist())
            bookmark = page.bookmark

    return asyncio.run(run())


@pytest.mark.parametrize("key", [None, ["grp"]], ids=["primary-key", "non-unique-key"])
def test_postgres_source_resumes_after_every_page_when_cursor_values_repeat(
    postgres_url: str, key: list[str] | None
) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE events (id bigint PRIMARY KEY, at int NOT NULL, grp int NOT NULL)")
        with conn.cursor() as cursor:
            cursor.executemany("INSERT INTO events VALUES (%s, %s, %s)", rows(1))
    config: dict[str, Any] = {"url": postgres_url, "table": "events", "cursor": "at", "fetch_rows": 5}
    if key:
        config["key"] = key
    delivered = read_every_resume(lambda: get_connector("postgres").source(config))
    assert sorted(delivered) == list(range(1, ROWS + 1)), "every row once"


@pytest.mark.parametrize("key", [None, ["grp"]], ids=["primary-key", "non-unique-key"])
def test_sql_source_resumes_after_every_page_when_cursor_values_repeat(
    tmp_path: Path, key: list[str] | None
) -> None:
    url = f"sqlite:///{tmp_path / 'events.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE events (id INTEGER PRIMARY KEY, at INTEGER NOT NULL, grp INTEGER NOT NULL)"
        )
        conn.exec_driver_sql("INSERT INTO events VALUES " + ",".join(map(str, rows(2))))
    engine.dispose()
    config: dict[str, Any] = {"url": url, "table": "events", "cursor": "at"}
    if key:
        config["key"] = key
    delivered = read_every_resume(lambda: get_connector("sql").source(config))
    assert sorted(delivered) == list(range(1, ROWS + 1)), "every row once"
    # One read of every page (no resume) delivers every row once too.

    async def whole() -> list[int]:
        source = get_connector("sql").source(config)
        try:
            return [
                i
                async for page in source.stream_pages({}, PAGE)
                for i in page.records.column("id").to_pylist()
            ]
        finally:
            await source.close()

    assert sorted(asyncio.run(whole())) == list(range(1, ROWS + 1))


def test_keyset_pages_never_end_between_two_rows_of_one_position() -> None:
    values = sorted(random.Random(3).choices(range(6), k=100))
    batch = pa.RecordBatch.from_pydict({"c": values, "n": list(range(100))})
    assert tie_start(batch.slice(0, 10), ["c"]) == values[:10].index(values[9])
    pages = KeysetPages(4, ["c"])
    cut = [page for chunk in range(0, 100, 9) for page in pages.add(batch.slice(chunk, 9))]
    last = pages.finish()
    cut += [last] if last is not None else []
    assert sum(page.num_rows for page in cut) == 100
    for before, after in itertools.pairwise(cut):
        assert before.column("c")[-1].as_py() < after.column("c")[0].as_py()
