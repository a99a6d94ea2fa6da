"""The PostgreSQL source: one table read through a server-side cursor in (cursor, key) order.

Order. Rows are read in ascending ``(cursor, key...)`` order by one statement::

    SELECT ... FROM t WHERE (cursor, key) > (last cursor, last key) ORDER BY cursor, key

so rows sharing a cursor value across a page boundary are neither skipped nor read twice (the key
orders them), and the read is one consistent snapshot: rows committed while it runs are read by the
next run (the read holds one transaction open while it lasts). Rows with NULL in the cursor or the key
are not read. The semantics (and the bookmark, a :class:`KeysetBookmark`) are those of the SQL
source; this one is fast: a binary server-side cursor fetches ``fetch_rows`` rows per round trip
(psycopg builds them in C), converted column by column into Arrow with the types read from the
catalog. A ``COPY ... TO STDOUT`` stream was measured slower here: libpq hands COPY data out one row
per call, which costs more in Python than the cursor's batched fetch.

Memory. At most one fetch of Python rows and one page of Arrow data are held; pages hold exactly
``batch_size`` rows (the last one fewer), ``batch_size == 0`` one page with everything. While a page is
being consumed no fetch is outstanding, so a slow sink never makes this source buffer.

Bookmark and determinism: the contract of :mod:`faucet_sql.source`: every page carries the position of
its last row, and a resumed read starts strictly after it.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql

from faucet_dagster.protocol import (
    ConfigError,
    DataError,
    DiscoveredDataset,
    FetchContext,
    KeysetPages,
    KeysetSource,
    Page,
    PageBuilder,
)
from faucet_postgres.common import (
    PgColumn,
    arrow_type,
    connect,
    current_schema,
    pg_error,
    primary_key,
    table_columns,
    table_name,
)
from faucet_postgres.config import PostgresSourceConfig


@dataclass(frozen=True)
class _ReadPlan:
    """What one read needs, looked up in the catalog at its start."""

    schema: str
    order: tuple[str, ...]
    output: tuple[str, ...]
    selected: tuple[PgColumn, ...]
    types: dict[str, pa.DataType]


class PostgresSource(KeysetSource):
    """A bounded, incremental source over one PostgreSQL table (see the module docstring)."""

    connector_name = "postgres"
    config_model = PostgresSourceConfig

    def __init__(self, config: PostgresSourceConfig) -> None:
        super().__init__(config.cursor, config.key, config.columns)
        self.config = config

    def dataset_uri(self) -> str:
        return self.config.table_uri()

    def state_key(self) -> str:
        return f"postgres:{self.dataset_uri()}:{self.config.cursor or ''}"

    async def check(self) -> None:
        conn = await connect(self.config, autocommit=True)
        try:
            await self._plan(conn)
        finally:
            await conn.close()

    async def discover(self) -> Sequence[DiscoveredDataset]:
        conn = await connect(self.config, autocommit=True)
        try:
            schema = self.config.schema_name or await current_schema(conn)
            cursor = await conn.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm', 'f') ORDER BY c.relname",
                (schema,),
            )
            found = []
            for (name,) in await cursor.fetchall():
                columns = await table_columns(conn, schema, name) or {}
                found.append(
                    DiscoveredDataset(
                        name=f"{schema}.{name}",
                        schema=pa.schema([pa.field(c.name, arrow_type(c)) for c in columns.values()]),
                        details={
                            "primary_key": ",".join(await primary_key(conn, schema, name)),
                            "types": ",".join(c.type_sql for c in columns.values()),
                        },
                    )
                )
            return found
        except psycopg.Error as exc:
            raise pg_error(exc, where=self.dataset_uri(), doing="discovering tables") from exc
        finally:
            await conn.close()

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.connector_name)
        conn = await connect(self.config)
        try:
            plan = await self._plan(conn)
            after = self.start_after(plan.order)
            # A configured key may not be unique: pages then end between positions only.
            builder = KeysetPages(batch_size, plan.order) if self.config.key else PageBuilder(batch_size)
            async with conn.cursor(name="faucet_read", binary=True) as cursor:
                await cursor.execute(self._query(plan, after))
                while rows := await cursor.fetchmany(self.config.fetch_rows):
                    for page in builder.add(await asyncio.to_thread(self._to_arrow, plan, rows)):
                        yield self._page(plan, page)
            last = builder.finish()
            if last is not None:
                yield self._page(plan, last)
        except psycopg.Error as exc:
            raise pg_error(exc, where=self.dataset_uri(), doing="reading") from exc
        finally:
            # Closing ends the transaction and the cursor, also when the consumer stopped early.
            await conn.close()

    # -- internals --------------------------------------------------------------------------------

    async def _plan(self, conn: "psycopg.AsyncConnection[Any]") -> _ReadPlan:
        try:
            schema = self.config.schema_name or await current_schema(conn)
            columns = await table_columns(conn, schema, self.config.table)
            if columns is None:
                raise ConfigError(
                    f"table {schema}.{self.config.table} does not exist", where=self.dataset_uri()
                )
            key = self.config.key or await primary_key(conn, schema, self.config.table)
        except psycopg.Error as exc:
            raise pg_error(exc, where=self.dataset_uri(), doing="reading the catalog") from exc
        if not key:
            raise ConfigError(
                f"table {schema}.{self.config.table} has no primary key: set key to columns that are "
                "unique together with the cursor, so rows sharing a cursor value keep one order",
                where=self.dataset_uri(),
            )
        order = self.order_of(key)
        output = tuple(self.config.columns or columns)
        missing = [name for name in dict.fromkeys((*order, *output)) if name not in columns]
        if missing:
            raise ConfigError(
                f"table {schema}.{self.config.table} has no column(s) {', '.join(missing)}",
                where=self.dataset_uri(),
            )
        selected = tuple(columns[name] for name in dict.fromkeys((*output, *order)))
        return _ReadPlan(
            schema=schema,
            order=order,
            output=output,
            selected=selected,
            types={column.name: arrow_type(column) for column in selected},
        )

    def _query(self, plan: _ReadPlan, after: tuple[Any, ...] | None) -> "sql.Composed":
        def expression(column: PgColumn) -> "sql.Composable":
            name = sql.Identifier(column.name)
            if not pa.types.is_string(plan.types[column.name]):
                return name
            # Types read as strings come as their text (arrays as JSON text), so no per-type Python
            # object (dict, UUID, timedelta) is built only to be turned back into text.
            text = sql.SQL("to_json({})::text" if column.type_name.startswith("_") else "{}::text")
            return sql.SQL("{} AS {}").format(text.format(name), name)

        order = sql.SQL(", ").join(map(sql.Identifier, plan.order))
        conditions = [sql.SQL("{} IS NOT NULL").format(sql.Identifier(name)) for name in plan.order]
        if after is not None:
            conditions.append(
                sql.SQL("({}) > ({})").format(order, sql.SQL(", ").join(map(sql.Literal, after)))
            )
        return sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {}").format(
            sql.SQL(", ").join(map(expression, plan.selected)),
            table_name(plan.schema, self.config.table),
            sql.SQL(" AND ").join(conditions),
            order,
        )

    def _to_arrow(self, plan: _ReadPlan, rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
        """Fetched rows as one record batch of the selected columns, typed from the catalog."""
        columns = list(zip(*rows, strict=True))
        arrays = []
        for index, column in enumerate(plan.selected):
            try:
                arrays.append(pa.array(columns[index], type=plan.types[column.name]))
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as exc:
                raise DataError(
                    f"column {column.name!r} of {plan.schema}.{self.config.table} holds a value that is "
                    f"not {plan.types[column.name]}: {exc}",
                    where=self.dataset_uri(),
                ) from exc
        return pa.RecordBatch.from_arrays(arrays, names=[column.name for column in plan.selected])

    def _page(self, plan: _ReadPlan, batch: pa.RecordBatch) -> Page:
        last = batch.num_rows - 1
        position = tuple(batch.column(name)[last].as_py() for name in plan.order)
        return Page(batch.select(list(plan.output)), self.reached(plan.order, position))
