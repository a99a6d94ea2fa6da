"""Change rows: what a decoded change becomes, buffered per table and written one transaction at a time."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from faucet_dagster.protocol import (
    DataError,
    Identities,
    IntegrityError,
    Operation,
    OrderingDomain,
    ProgressBoundary,
    StreamRecordSink,
    TransactionBegin,
    TransactionEnd,
)
from faucet_postgres import pgoutput as pg
from faucet_postgres.cdc_server import CODEC

INSERT, UPDATE, DELETE = Operation.INSERT.value, Operation.UPDATE.value, Operation.DELETE.value


class Table:
    """A published table as the stream sees it: its relation, Arrow schema and whether it is read."""

    __slots__ = ("key_indexes", "relation", "resource", "schema", "selected", "where", "width")

    def __init__(self, relation: pg.Relation, selected: bool, key_indexes: tuple[int, ...]) -> None:
        self.relation = relation
        self.selected = selected
        self.resource = relation.qualified_name
        self.key_indexes = key_indexes
        """The columns whose change makes an update a delete and an insert (see :func:`change_rows`);
        the change rows mark them ``faucet.key`` (under REPLICA IDENTITY FULL: the primary key)."""
        self.schema = pg.relation_schema(relation, key_indexes)
        self.where = f"table {self.resource}"
        self.width = len(relation.columns)

    def batch(self, rows: "Rows") -> pa.RecordBatch:
        """The Arrow batch of buffered rows (raises :class:`DataError` for a value with no Arrow form)."""
        columns = list(zip(*rows.values, strict=True)) if self.width else []
        arrays = [
            pg.column_array(values, column, self.where)
            for values, column in zip(columns, self.relation.columns, strict=True)
        ]
        arrays.append(pa.array(rows.operations, pa.string()))
        arrays.append(pa.array(rows.unchanged, pa.list_(pa.string())))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


@dataclass
class Rows:
    """Rows of one table buffered within a transaction, with their ordinals."""

    values: list[Sequence[str | None]] = field(default_factory=list)
    operations: list[str] = field(default_factory=list)
    unchanged: list[list[str] | None] = field(default_factory=list)
    ordinals: list[int] = field(default_factory=list)


class TransactionWriter:
    """One source transaction at a time: its rows buffered per table, written in pieces, then its end.

    ``TransactionBegin`` goes to the sink before the transaction's first rows; a transaction without
    rows of the selected tables ends as a ``ProgressBoundary``. Rows of one table keep their order;
    ordinals number all rows of the transaction in source order.
    """

    def __init__(self, domain: OrderingDomain, sink: StreamRecordSink, batch_rows: int) -> None:
        self._domain = domain
        self._sink = sink
        self._batch_rows = batch_rows
        self._pending: dict[Table, Rows] = {}
        self._buffered = 0
        self._transaction_id = ""
        self._position = -1
        self._canonical = ""
        self._ordinal = 0
        self._begun = False
        self.is_open = False
        self.rows = 0

    @property
    def position(self) -> int:
        return self._position

    def begin(self, transaction_id: str, position: int) -> None:
        if self.is_open:
            raise IntegrityError(
                f"transaction {transaction_id} began inside transaction {self._transaction_id}",
                where=str(self._domain),
            )
        self._transaction_id = transaction_id
        self._position = position
        self._canonical = CODEC.canonicalize(position)
        self._ordinal = 0
        self._begun = False
        self.is_open = True

    def add(
        self, table: Table, values: Sequence[str | None], operation: str, unchanged: list[str] | None
    ) -> bool:
        """Buffer one row; True when the buffered rows reached ``batch_rows`` (then call :meth:`flush`)."""
        if not self.is_open:
            raise IntegrityError(
                f"a change of {table.resource} came outside a transaction", where=str(self._domain)
            )
        if len(values) != table.width:
            raise IntegrityError(
                f"a row of {len(values)} values came for {table.width} columns", where=table.where
            )
        rows = self._pending.get(table)
        if rows is None:
            rows = self._pending[table] = Rows()
        rows.values.append(values)
        rows.operations.append(operation)
        rows.unchanged.append(unchanged)
        rows.ordinals.append(self._ordinal)
        self._ordinal += 1
        self._buffered += 1
        self.rows += 1
        return self._buffered >= self._batch_rows

    async def flush(self) -> None:
        """Write every buffered row to the sink (after ``TransactionBegin``, the first time)."""
        for table in list(self._pending):
            await self.flush_table(table)

    async def flush_table(self, table: Table) -> None:
        rows = self._pending.pop(table, None)
        if rows is None:
            return
        self._buffered -= len(rows.operations)
        if not self._begun:
            await self._sink.control(TransactionBegin(self._domain, self._transaction_id))
            self._begun = True
        identities = Identities([self._canonical] * len(rows.ordinals), rows.ordinals)
        await self._sink.write(self._domain, table.batch(rows), identities, resource=table.resource)

    async def end(self) -> int:
        """Write the rest and the transaction's boundary; return its position."""
        await self.flush()
        if self._begun:
            await self._sink.control(TransactionEnd(self._domain, self._transaction_id, self._canonical))
        else:
            await self._sink.control(ProgressBoundary(self._domain, self._canonical))
        self.is_open = False
        return self._position


def change_rows(
    message: pg.Update | pg.Delete, table: Table
) -> list[tuple[Sequence[str | None], str, list[str] | None]]:
    """The change rows of an update or a delete (see the module docstring for their shape)."""
    old = message.old
    if isinstance(message, pg.Delete):
        return [(message.old.values, DELETE, None)]
    values, missing = message.new.values, message.new.unchanged
    if missing and message.old_kind == "O" and old is not None:
        # REPLICA IDENTITY FULL: the old row holds the values the update left out.
        filled = list(values)
        for index in missing:
            filled[index] = old.values[index]
        values, missing = tuple(filled), ()
    if old is not None and any(
        old.values[index] != values[index] and index not in missing for index in table.key_indexes
    ):
        if missing:
            names = ", ".join(table.relation.columns[index].name for index in missing)
            raise DataError(
                f"an update changed the key and left the TOASTed column(s) {names} out; set REPLICA "
                "IDENTITY FULL on the table so their values are replicated",
                where=table.where,
            )
        return [(old.values, DELETE, None), (values, INSERT, None)]
    unchanged = [table.relation.columns[index].name for index in missing] if missing else None
    return [(values, UPDATE, unchanged)]
