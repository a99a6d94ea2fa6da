"""The SQL source: one table read through SQLAlchemy (any dialect) in ascending (cursor, key) order.

Order and paging. Rows are read in ascending ``(cursor, key...)`` order with keyset pagination::

    SELECT ... WHERE (cursor, key) > (:last_cursor, :last_key) AND (cursor, key) <= (:upper...)
    ORDER BY cursor, key LIMIT :batch_size

so rows that share a cursor value across a page boundary are neither skipped nor read twice: the key
orders them. Dialects without row-value comparison get the expanded form
``c > x OR (c = x AND k > y)``. ``upper`` is the last row's position when the read starts, which makes
the read bounded on a table that keeps growing (rows added during a run are read by the next run).
Rows with NULL in the cursor or key are not read: NULL has no place in the order.

Bookmark. Every page carries the position of its last row (:class:`KeysetBookmark`); resuming
continues strictly after it. This is an incremental read: a row changed later must get a larger
cursor (``updated_at``, a sequence) to be read again, and a row inserted with a cursor value below the
bookmark is never read.

Determinism. Not claimed (``capabilities().deterministic`` is False, :class:`KeysetSource`): a table
changes between reads (an update moves a row past the others, a delete removes it). Every page
carries its bookmark (``page_bookmarks``), which a sink keeping it with its watermark resumes from
exactly: a rerun then reads each row after the committed position once.

Memory and blocking. One page at a time: each page is one query run in a worker thread, converted to
an Arrow record batch with the column types reflected from the table (stable across pages).
``batch_size == 0`` runs one unbounded query and returns one page.
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any, ParamSpec, TypeVar

import pyarrow as pa
import sqlalchemy as sa

from faucet_dagster.protocol import (
    ConfigError,
    DataError,
    DiscoveredDataset,
    FetchContext,
    KeysetSource,
    Page,
    conform_values,
)
from faucet_sql.config import SqlSourceConfig
from faucet_sql.database import ROW_VALUE_DIALECTS, Converter, Database, arrow_type, converter, db_error

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class _ReadPlan:
    """What one read needs, reflected once at its start."""

    table: sa.Table
    order: tuple[sa.Column[Any], ...]
    output: tuple[str, ...]
    selected: tuple[sa.Column[Any], ...]
    schema: pa.Schema
    converters: tuple[Converter | None, ...]
    upper: tuple[Any, ...] | None
    window: tuple[sa.ColumnElement[bool], ...]
    """``start <= cursor < end`` of the config's ``cursor_window`` (empty without one)."""
    native: bool
    plain_rows: bool
    """The selected columns are the output columns, and neither SQLAlchemy nor a converter changes
    their values: pages are read as the DBAPI's tuples, and each column converted by Arrow in one call
    where that lands its values exactly (:meth:`SqlSource._typed`, :func:`conform_values`)."""
    unique_order: bool
    """The key is the table's primary key (so ``(cursor, key)`` is unique); a configured key may not
    be, and pages are then cut between positions only (:meth:`SqlSource._whole_positions`)."""

    @property
    def order_names(self) -> tuple[str, ...]:
        return tuple(column.name for column in self.order)


class SqlSource(KeysetSource):
    """A bounded, incremental source over one table of any SQLAlchemy database (module docstring)."""

    connector_name = "sql"
    config_model = SqlSourceConfig

    def __init__(self, config: SqlSourceConfig) -> None:
        super().__init__(config.cursor, config.key, config.columns)
        self.config = config
        self.db = Database(config, writer=False)

    def dataset_uri(self) -> str:
        return self.db.where()

    def state_key(self) -> str:
        return f"sql:{self.db.where()}:{self.config.cursor or ''}"

    async def check(self) -> None:
        await self._run(self._plan)

    async def close(self) -> None:
        await asyncio.to_thread(self.db.dispose)

    async def discover(self) -> Sequence[DiscoveredDataset]:
        return await self._run(self._discover)

    async def stream_pages(self, ctx: FetchContext, batch_size: int) -> AsyncIterator[Page]:
        if batch_size < 0:
            raise ConfigError(f"batch_size must be >= 0, got {batch_size}", where=self.connector_name)
        plan = await self._run(self._plan)
        position = self.start_after(plan.order_names)
        if plan.upper is None:
            return
        while True:
            batch, last, fetched = await self._run(self._read_page, plan, position, batch_size)
            if last is None:
                return
            position = last
            yield Page(batch, self.reached(plan.order_names, last))
            if batch_size == 0 or fetched < batch_size:
                return

    # -- blocking parts, run in a worker thread ---------------------------------------------------

    async def _run(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await asyncio.to_thread(function, *args, **kwargs)
        except sa.exc.SQLAlchemyError as exc:
            raise db_error(exc, where=self.dataset_uri(), doing="reading") from exc

    def _plan(self) -> _ReadPlan:
        with self.db.engine.connect() as conn:
            try:
                table = sa.Table(
                    self.config.table, sa.MetaData(), schema=self.config.schema_name, autoload_with=conn
                )
            except sa.exc.NoSuchTableError:
                raise ConfigError(
                    f"table {self.db.qualified()!r} does not exist", where=self.dataset_uri()
                ) from None
            key = self.config.key or [column.name for column in table.primary_key.columns]
            if not key:
                raise ConfigError(
                    f"table {self.db.qualified()!r} has no primary key: set key to columns that are "
                    "unique together with the cursor, so rows sharing a cursor value keep one order",
                    where=self.dataset_uri(),
                )
            order_names = list(self.order_of(key))
            output = list(self.config.columns or [column.name for column in table.columns])
            missing = [name for name in dict.fromkeys([*order_names, *output]) if name not in table.c]
            if missing:
                raise ConfigError(
                    f"table {self.db.qualified()!r} has no column(s) {', '.join(missing)}",
                    where=self.dataset_uri(),
                )
            order = tuple(table.c[name] for name in order_names)
            selected = tuple(table.c[name] for name in dict.fromkeys([*output, *order_names]))
            types = [arrow_type(table.c[name].type) for name in output]
            window = self._window(table)
            upper_row = conn.execute(
                sa.select(*order)
                .where(*(column.is_not(None) for column in order))
                .where(*window)
                .order_by(*(column.desc() for column in order))
                .limit(1)
            ).first()
        native = {"auto": self.db.dialect in ROW_VALUE_DIALECTS, "native": True, "expanded": False}
        converters = tuple(
            converter(table.c[name].type, kind) for name, kind in zip(output, types, strict=True)
        )
        dialect = self.db.engine.dialect
        plain = (
            tuple(column.name for column in selected) == tuple(output)
            and all(convert is None for convert in converters)
            and all(
                column.type.dialect_impl(dialect).result_processor(dialect, None) is None
                for column in selected
            )
        )
        return _ReadPlan(
            table=table,
            order=order,
            output=tuple(output),
            selected=selected,
            schema=pa.schema([pa.field(name, kind) for name, kind in zip(output, types, strict=True)]),
            converters=converters,
            upper=None if upper_row is None else tuple(upper_row),
            window=window,
            native=native[self.config.row_values],
            plain_rows=plain,
            unique_order=not self.config.key,
        )

    def _window(self, table: sa.Table) -> tuple[sa.ColumnElement[bool], ...]:
        window = self.config.cursor_window
        if window is None or self.config.cursor is None:
            return ()
        column = table.c[self.config.cursor]
        return (column >= _bound(column, window.start), column < _bound(column, window.end))

    def _read_page(
        self, plan: _ReadPlan, after: tuple[Any, ...] | None, batch_size: int
    ) -> tuple[pa.RecordBatch, tuple[Any, ...] | None, int]:
        """One page after ``after`` (up to the plan's upper bound), the position of its last row, and
        how many rows the query fetched (fewer than ``batch_size``: the read is done)."""
        assert plan.upper is not None
        query = (
            sa.select(*plan.selected)
            .where(*(column.is_not(None) for column in plan.order))
            .where(_compare(plan.order, plan.upper, "<=", plan.native))
            .where(*plan.window)
            .order_by(*plan.order)
        )
        if after is not None:
            query = query.where(_compare(plan.order, after, ">", plan.native))
        if batch_size:
            query = query.limit(batch_size)
        with self.db.engine.connect() as conn:
            result = conn.execute(query)
            # SQLAlchemy's Row objects cost as much as the fetch itself; when they would not change a
            # value, the DBAPI's own tuples are the same rows.
            rows: Sequence[Sequence[Any]] = result.cursor.fetchall() if plan.plain_rows else result.all()
            result.close()
        if not rows:
            return _empty(plan.schema), None, 0
        names = [column.name for column in plan.selected]
        at = [names.index(name) for name in plan.order_names]
        fetched = len(rows)
        if not plan.unique_order and batch_size and fetched == batch_size:
            rows = self._whole_positions(plan, rows, at)
        last = tuple(rows[-1][index] for index in at)
        # Column by column through an itemgetter, never a transposed page: a transpose allocates an
        # iterator per row, and the garbage collections those allocations set off cost more than the
        # fetch.
        arrays = []
        for field, convert in zip(plan.schema, plan.converters, strict=True):
            values = list(map(itemgetter(names.index(field.name)), rows))
            if convert is not None:
                values = convert(values)
            array = self._typed(values, field.type) if plan.plain_rows else None
            if array is None:
                array, unfit = conform_values(values, field.type, field.name)
                if unfit:
                    index = min(unfit)
                    row = ", ".join(f"{name}={rows[index][names.index(name)]!r}" for name in plan.order_names)
                    raise DataError(
                        f"{self.db.qualified()!r} row ({row}): {unfit[index]}",
                        where=f"{self.dataset_uri()} @ {row}",
                    )
            arrays.append(array)
        return pa.RecordBatch.from_arrays(arrays, schema=plan.schema), last, fetched

    def _typed(self, values: list[Any], kind: pa.DataType) -> pa.Array | None:
        """``values`` of a column converted in one Arrow call, trusting the DBAPI's types; None when
        the lattice must conform them (:func:`conform_values`, which names a value that does not fit).
        SQLite keeps any value in any column (a REAL in an INTEGER one), and the one call would
        truncate 1.5 to 1: there the lattice always decides (it takes the one call itself when every
        value is of the column's own kind)."""
        if self.db.dialect == "sqlite":
            return None
        try:
            return pa.array(values, kind)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
            return None

    def _whole_positions(
        self, plan: _ReadPlan, rows: Sequence[Sequence[Any]], at: Sequence[int]
    ) -> Sequence[Sequence[Any]]:
        """A full page of a read whose key may not be unique, cut before the rows sharing its last
        position (the next page, read ``> position``, reads them whole), or, when the whole page is
        one position, every row of that position (one longer page): a page never ends between two
        rows of one position, so no resume skips one."""
        last = tuple(rows[-1][index] for index in at)
        cut = len(rows)
        while cut and tuple(rows[cut - 1][index] for index in at) == last:
            cut -= 1
        if cut:
            return rows[:cut]
        query = (
            sa.select(*plan.selected)
            .where(*(column == value for column, value in zip(plan.order, last, strict=True)))
            .order_by(*plan.order)
        )
        with self.db.engine.connect() as conn:
            result = conn.execute(query)
            whole: Sequence[Sequence[Any]] = result.cursor.fetchall() if plan.plain_rows else result.all()
            result.close()
        return whole

    def _discover(self) -> list[DiscoveredDataset]:
        found = []
        with self.db.engine.connect() as conn:
            inspector = sa.inspect(conn)
            schema = self.config.schema_name
            for name in sorted(inspector.get_table_names(schema=schema)):
                columns = inspector.get_columns(name, schema=schema)
                primary_key = (
                    inspector.get_pk_constraint(name, schema=schema).get("constrained_columns") or []
                )
                found.append(
                    DiscoveredDataset(
                        name=name if schema is None else f"{schema}.{name}",
                        schema=pa.schema([pa.field(c["name"], arrow_type(c["type"])) for c in columns]),
                        details={"primary_key": ",".join(primary_key)},
                    )
                )
        return found


def _bound(column: sa.Column[Any], moment: datetime) -> Any:
    """``moment`` as the cursor column compares it: a date for a DATE column, naive UTC for a
    timestamp without time zone, else as is."""
    kind = column.type
    if isinstance(kind, sa.DateTime):
        return moment if kind.timezone else moment.astimezone(UTC).replace(tzinfo=None)
    if isinstance(kind, sa.Date):
        return moment.astimezone(UTC).date()
    return moment


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], type=field.type) for field in schema], schema=schema)


def _compare(
    columns: tuple[sa.Column[Any], ...], values: tuple[Any, ...], op: str, native: bool
) -> sa.ColumnElement[bool]:
    """``(columns) > (values)`` (``op`` ``">"``) or ``(columns) <= (values)`` (``op`` ``"<="``), in
    row-value form when ``native`` and expanded into ANDs and ORs otherwise."""
    bound = [sa.literal(value, type_=column.type) for column, value in zip(columns, values, strict=True)]
    if len(columns) == 1 or native:
        left: Any = columns[0] if len(columns) == 1 else sa.tuple_(*columns)
        right: Any = bound[0] if len(columns) == 1 else sa.tuple_(*bound)
        return sa.and_(left > right) if op == ">" else sa.and_(left <= right)
    strict = [
        sa.and_(
            *(columns[j] == bound[j] for j in range(i)),
            columns[i] > bound[i] if op == ">" else columns[i] < bound[i],
        )
        for i in range(len(columns))
    ]
    if op == "<=":
        strict.append(sa.and_(*(column == value for column, value in zip(columns, bound, strict=True))))
    return sa.or_(*strict)
