"""Change rows: what a decoded change becomes, buffered per table and written in runs of whole source
transactions."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from faucet_dagster.protocol import (
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
TRUNCATE = Operation.TRUNCATE.value
GROUP_TRANSACTIONS = 1_000
"""Complete source transactions written under one pair of transaction controls, at most."""


class Table:
    """A published table as the stream sees it: its relation, Arrow schema and whether it is read."""

    __slots__ = ("key_indexes", "relation", "resource", "schema", "selected", "where", "width")

    def __init__(
        self,
        relation: pg.Relation,
        selected: bool,
        key_indexes: tuple[int, ...],
        older_rows: Mapping[str, str | None] | None = None,
    ) -> None:
        self.relation = relation
        self.selected = selected
        self.resource = relation.qualified_name
        self.key_indexes = key_indexes
        """The columns whose change makes an update a delete and an insert (see :func:`change_rows`);
        the change rows mark them ``faucet.key`` (under REPLICA IDENTITY FULL: the primary key)."""
        self.schema = pg.relation_schema(relation, key_indexes, older_rows)
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
    """Rows of one table buffered, with their positions (commit LSNs) and ordinals."""

    positions: list[str] = field(default_factory=list)
    values: list[Sequence[str | None]] = field(default_factory=list)
    operations: list[str] = field(default_factory=list)
    unchanged: list[list[str] | None] = field(default_factory=list)
    ordinals: list[int] = field(default_factory=list)


class TransactionWriter:
    """Source transactions, one after another, buffered per table and written in pieces.

    Complete transactions are written in groups: a group's rows go to the sink between one
    ``TransactionBegin`` and one ``TransactionEnd`` at the group's last commit (each row keeps its own
    transaction's commit LSN and ordinal), so a backlog of small transactions costs one pair of
    controls and one batch per table per group, not per transaction. The group's end is a real
    transaction end: :meth:`commit` closes a transaction, :meth:`close_group` delivers the boundary
    (a group without rows of the selected tables ends as a ``ProgressBoundary``). Rows of one table
    keep their order; ordinals number all rows of a transaction in source order.
    """

    def __init__(self, domain: OrderingDomain, sink: StreamRecordSink, batch_rows: int) -> None:
        self._domain = domain
        self._sink = sink
        self._batch_rows = batch_rows
        self._pending: dict[Table, Rows] = {}
        self._buffered = 0
        self._transaction_id = ""
        self._group_id = ""
        self._grouped = 0
        self._position = -1
        self._canonical = ""
        self._ordinal = 0
        self._begun = False
        self.is_open = False
        self.rows = 0

    @property
    def position(self) -> int:
        """The commit LSN of the current (or last committed) transaction."""
        return self._position

    @property
    def grouped(self) -> int:
        """Complete transactions in the group not yet delivered."""
        return self._grouped

    def begin(self, transaction_id: str, position: int) -> None:
        if self.is_open:
            raise IntegrityError(
                f"transaction {transaction_id} began inside transaction {self._transaction_id}",
                where=str(self._domain),
            )
        if not self._grouped:
            self._group_id = transaction_id
            self._begun = False
        self._transaction_id = transaction_id
        self._position = position
        self._canonical = CODEC.canonicalize(position)
        self._ordinal = 0
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
        rows.positions.append(self._canonical)
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
            await self._sink.control(TransactionBegin(self._domain, self._group_id))
            self._begun = True
        identities = Identities(rows.positions, rows.ordinals)
        await self._sink.write(self._domain, table.batch(rows), identities, resource=table.resource)

    def commit(self, position: int) -> None:
        """Close the open transaction (its commit at ``position``); it joins the group."""
        if not self.is_open or position != self._position:
            raise IntegrityError(
                f"a commit at {CODEC.canonicalize(position)} closes no open transaction",
                where=str(self._domain),
            )
        self.is_open = False
        self._grouped += 1

    async def close_group(self) -> int | None:
        """Write the group's rows and its boundary at its last commit; return that position (None:
        no complete transaction is waiting)."""
        if self.is_open:
            raise IntegrityError(
                f"transaction {self._transaction_id} is still open: the group cannot end",
                where=str(self._domain),
            )
        if not self._grouped:
            return None
        await self.flush()
        if self._begun:
            await self._sink.control(TransactionEnd(self._domain, self._group_id, self._canonical))
        else:
            await self._sink.control(ProgressBoundary(self._domain, self._canonical))
        self._grouped = 0
        self._begun = False
        return self._position

    async def end(self) -> int:
        """Close the open transaction and deliver it (with the group); return its position."""
        self.commit(self._position)
        await self.close_group()
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
        # A key change: the old key's delete, then the new row. Columns the update left out (TOASTed,
        # unchanged) are named on the insert, and the sink carries the old row's values over.
        names = [table.relation.columns[index].name for index in missing] if missing else None
        return [(old.values, DELETE, None), (values, INSERT, names)]
    unchanged = [table.relation.columns[index].name for index in missing] if missing else None
    return [(values, UPDATE, unchanged)]
