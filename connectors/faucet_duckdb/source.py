"""The DuckDB source: one table of a DuckDB file read in ascending (cursor, key) order, in keyset pages.

Order and paging. Rows are read in ascending ``(cursor, key...)`` order, a page at a time::

    SELECT ... WHERE (cursor, key) > (last read) AND (cursor, key) <= (upper) ORDER BY cursor, key LIMIT n

so rows sharing a cursor value across a page boundary are neither skipped nor read twice: the key
orders them. ``upper`` is the last row's position when the read starts, which bounds the read on a
table that keeps growing (rows added meanwhile are read by the next run). Rows with NULL in the cursor
or key are not read: NULL has no place in the order. Without a configured key, the table's primary
key orders; a table without one is refused (ConfigError naming the fix).

Bookmark. Every page carries the position of its last row (:class:`KeysetBookmark`); resuming
continues strictly after it. An incremental read: a changed row needs a larger cursor to be read
again (see :class:`KeysetSource` for what that means for determinism).

The file. The source opens the file as the sinks do (one DuckDB database per file in a process, shared
by every connection of it): while it reads, no other process can open the file, and it waits
``lock_timeout`` seconds for a process holding the file before failing with
:class:`~faucet_duckdb.database.DatabaseLocked` naming it (DuckDB's one-writer rule, see
:mod:`faucet_duckdb.database`). Opening it read-only would let reader processes share it, but a
read-only and a read-write connection to one file cannot coexist in one process, which a DuckDB to
DuckDB sync, or a stream writing the file a sync reads, needs. Pages are DuckDB's own Arrow results,
with the table's column types; one page in memory at a time.
"""

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa

from faucet_dagster.protocol import (
    ConfigError,
    DiscoveredDataset,
    FetchContext,
    KeysetSource,
    Page,
)
from faucet_duckdb import tables
from faucet_duckdb.config import DuckDbSourceConfig
from faucet_duckdb.database import Connect, DuckDbFile, file_uri, first_row, qualified, quote


@dataclass(frozen=True)
class _ReadPlan:
    """What one read needs, looked up once at its start."""

    order: tuple[str, ...]
    select: str
    """The ``SELECT ... FROM ... WHERE <order columns not null>`` every page extends."""
    upper: tuple[Any, ...] | None
    """The position of the last row when the read began (None: the table has no row to read)."""


class DuckDbSource(KeysetSource):
    """A bounded, incremental source over one table of a DuckDB file (see the module docstring)."""

    connector_name = "duckdb"
    config_model = DuckDbSourceConfig

    def __init__(self, config: DuckDbSourceConfig, *, connect: Connect = duckdb.connect) -> None:
        super().__init__(config.cursor, config.key, config.columns)
        self.config = config
        self.file = DuckDbFile(config, writer=False, where=self.dataset_uri(), connect=connect)

    @property
    def label(self) -> str:
        return f"{self.config.schema_name}.{self.config.table}"

    def dataset_uri(self) -> str:
        return f"{file_uri(self.config)}#{self.label}"

    def state_key(self) -> str:
        return f"duckdb:{self.dataset_uri()}:{self.config.cursor or ''}"

    async def check(self) -> None:
        await self.file.call("reading the table", self._plan)

    async def close(self) -> None:
        await self.file.close()

    async def discover(self) -> Sequence[DiscoveredDataset]:
        return await self.file.call("listing the tables", self._discover)

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.dataset_uri())
        plan = await self.file.call("reading the table", self._plan)
        position = self.start_after(plan.order)
        if plan.upper is None:
            return
        while True:
            batch, last = await self.file.call("reading a page", self._read_page, plan, position, batch_size)
            if last is None:
                return
            position = last
            yield Page(batch, self.reached(plan.order, last))
            if batch_size == 0 or batch.num_rows < batch_size:
                return

    # -- blocking parts, run on the file's worker thread ------------------------------------------

    def _plan(self, conn: duckdb.DuckDBPyConnection) -> _ReadPlan:
        schema, table = self.config.schema_name, self.config.table
        columns = tables.columns_of(conn, schema, table)
        if columns is None:
            raise ConfigError(f"table {self.label!r} does not exist", where=self.dataset_uri())
        key = self.config.key or tables.primary_key(conn, schema, table)
        if not key:
            raise ConfigError(
                f"table {self.label!r} has no primary key: set key to columns that are unique together "
                "with the cursor, so rows sharing a cursor value keep one order",
                where=self.dataset_uri(),
            )
        order = self.order_of(key)
        output = list(self.config.columns or columns)
        missing = [name for name in dict.fromkeys([*order, *output]) if name not in columns]
        if missing:
            raise ConfigError(
                f"table {self.label!r} has no column(s) {', '.join(missing)}", where=self.dataset_uri()
            )
        # The ordering columns follow the output columns (which may not include them), under names
        # of their own: the page's last row gives the position.
        aliases = [f"{quote(name)} AS {quote(f'{_ORDER}{i}')}" for i, name in enumerate(order)]
        select = (
            f"SELECT {', '.join([*(quote(name) for name in output), *aliases])} "
            f"FROM {qualified(schema, table)} "
            f"WHERE {' AND '.join(f'{quote(name)} IS NOT NULL' for name in order)}"
        )
        descending = ", ".join(f"{quote(name)} DESC" for name in order)
        found = first_row(
            conn,
            f"SELECT {_row(order)} FROM {qualified(schema, table)} "
            f"WHERE {' AND '.join(f'{quote(name)} IS NOT NULL' for name in order)} "
            f"ORDER BY {descending} LIMIT 1",
        )
        return _ReadPlan(order, select, None if found is None else tuple(found))

    def _read_page(
        self,
        conn: duckdb.DuckDBPyConnection,
        plan: _ReadPlan,
        after: tuple[Any, ...] | None,
        batch_size: int,
    ) -> tuple[pa.RecordBatch, tuple[Any, ...] | None]:
        """One page after ``after`` (up to the plan's upper bound) and the position of its last row."""
        assert plan.upper is not None
        width = len(plan.order)
        query = f"{plan.select} AND ({_row(plan.order)}) <= ({_marks(width)})"
        parameters = list(plan.upper)
        if after is not None:
            query += f" AND ({_row(plan.order)}) > ({_marks(width)})"
            parameters += list(after)
        query += f" ORDER BY {_row(plan.order)}"
        if batch_size:
            query += f" LIMIT {int(batch_size)}"
        found = conn.sql(query, params=parameters).to_arrow_table()
        if found.num_rows == 0:
            return pa.RecordBatch.from_pylist([], schema=found.schema), None
        names = [f"{_ORDER}{i}" for i in range(width)]
        last = tuple(found.column(name)[found.num_rows - 1].as_py() for name in names)
        page = found.drop_columns(names).combine_chunks()
        batches = page.to_batches()
        batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=page.schema)
        return batch, last

    def _discover(self, conn: duckdb.DuckDBPyConnection) -> list[DiscoveredDataset]:
        schema = self.config.schema_name
        names = conn.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = ? ORDER BY table_name",
            [schema],
        ).fetchall()
        found = []
        for (name,) in names:
            columns = tables.columns_of(conn, schema, str(name))
            assert columns is not None
            arrow = tables.arrow_schema(conn, tables.Target(schema, str(name), columns))
            key = tables.primary_key(conn, schema, str(name))
            found.append(
                DiscoveredDataset(
                    name=f"{schema}.{name}", schema=arrow, details={"primary_key": ",".join(key)}
                )
            )
        return found


_ORDER = "__faucet_order_"
"""The prefix of the ordering columns a page query adds after the output columns (dropped after)."""


def _row(names: Sequence[str]) -> str:
    return ", ".join(quote(name) for name in names)


def _marks(count: int) -> str:
    return ", ".join("?" * count)


__all__ = ["DuckDbSource"]
