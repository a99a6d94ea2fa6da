"""Change rows: what a decoded change becomes, buffered per table and written in runs of whole source
transactions."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import cast

import numpy as np
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
from faucet_postgres.cdc_ddl import DdlMessage, TableHistory
from faucet_postgres.cdc_server import CODEC
from faucet_postgres.pgoutput_columns import tuple_columns, tuple_width

INSERT, UPDATE, DELETE = Operation.INSERT.value, Operation.UPDATE.value, Operation.DELETE.value
TRUNCATE = Operation.TRUNCATE.value
GROUP_TRANSACTIONS = 10_000
"""Complete source transactions written under one pair of transaction controls, at most."""


RowValues = Sequence[str | None] | bytes
"""A buffered row's values: texts (or null), or the change message that holds them, kept encoded until
its batch (:data:`faucet_postgres.pgoutput_columns.TUPLE_START`: its tuple's place)."""


class Table:
    """A published table as the stream sees it: its relation, Arrow schema and whether it is read."""

    __slots__ = ("key_indexes", "relation", "resource", "schema", "selected", "where", "width")

    def __init__(
        self,
        relation: pg.Relation,
        selected: bool,
        key_indexes: tuple[int, ...],
        older_rows: Mapping[str, str | None] | None = None,
        history: TableHistory | None = None,
    ) -> None:
        self.relation = relation
        self.selected = selected
        self.resource = relation.qualified_name
        self.key_indexes = key_indexes
        """The columns whose change makes an update a delete and an insert (see :func:`change_rows`);
        the change rows mark them ``faucet.key`` (under REPLICA IDENTITY FULL: the primary key)."""
        self.schema = pg.relation_schema(relation, key_indexes, older_rows, history)
        self.where = f"table {self.resource}"
        self.width = len(relation.columns)

    def batch(self, rows: "Rows") -> pa.RecordBatch:
        """The Arrow batch of buffered rows (raises :class:`DataError` for a value with no Arrow form,
        :class:`IntegrityError` for a change message kept encoded that does not decode)."""
        texts, unchanged = self._texts(rows.values, rows.unchanged)
        arrays = [
            pg.column_array(text, column, self.where)
            for text, column in zip(texts, self.relation.columns, strict=True)
        ]
        arrays.append(pa.array(rows.operations, pa.string()))
        arrays.append(pa.array(unchanged, pa.list_(pa.string())))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _texts(
        self, values: Sequence[RowValues], unchanged: list[list[str] | None]
    ) -> tuple[list[pa.Array], list[list[str] | None]]:
        """Each column's texts in row order, and the rows' unchanged columns: messages kept encoded
        are decoded in bulk (:mod:`faucet_postgres.pgoutput_columns`), decoded rows are transposed,
        and the two merged. A message bulk decoding leaves out is decoded on its own (which raises the
        decoder's error for a malformed one, and names an update's unchanged columns); when it
        declines the whole batch, every message is."""
        kept = np.fromiter(map(isinstance, values, repeat(bytes)), dtype=np.bool_, count=len(values))
        encoded = cast(list[bytes], list(compress(values, kept)))
        found = tuple_columns(encoded, self.width) if encoded else None
        columns, bulk = ([], np.zeros(len(encoded), dtype=np.bool_)) if found is None else found
        if not bool(bulk.all()):
            values, unchanged = list(values), list(unchanged)
            for index in np.flatnonzero(kept)[~bulk].tolist():
                values[index], unchanged[index] = self._decoded(cast(bytes, values[index]))
                kept[index] = False
        in_bulk = int(np.count_nonzero(kept))
        if in_bulk == len(values) or not self.width:
            return columns, unchanged
        rest = compress(values, ~kept)
        decoded = [pa.array(column, pa.string()) for column in zip(*rest, strict=True)]
        if not in_bulk:
            return decoded, unchanged
        # Where each row lands in the rows decoded in bulk followed by the others.
        indices = pa.array(np.where(kept, np.cumsum(kept) - 1, in_bulk + np.cumsum(~kept) - 1))
        merged = [
            pa.concat_arrays([bulk_column, one]).take(indices)
            for bulk_column, one in zip(columns, decoded, strict=True)
        ]
        return merged, unchanged

    def _decoded(self, message: bytes) -> tuple[Sequence[str | None], list[str] | None]:
        """A change message kept encoded, decoded: its row's values and unchanged columns, by the
        same rule as a change decoded in the read (:func:`change_rows`: one row for these)."""
        decoded = pg.decode(message)
        if isinstance(decoded, pg.Insert):
            return decoded.new.values, None
        if isinstance(decoded, pg.Update | pg.Delete):
            [(values, _, missing)] = change_rows(decoded, self)
            return values, missing
        raise IntegrityError(
            "a change kept encoded is not an insert, an update or a delete", where="pgoutput"
        )


@dataclass
class Rows:
    """Rows of one table buffered, with their positions (commit LSNs) and ordinals."""

    positions: list[str] = field(default_factory=list)
    values: list[RowValues] = field(default_factory=list)
    operations: list[str] = field(default_factory=list)
    unchanged: list[list[str] | None] = field(default_factory=list)
    ordinals: list[int] = field(default_factory=list)

    def split(self, position: str) -> "Rows":
        """Remove and return the rows at ``position`` (the last ones: positions only grow)."""
        start = len(self.positions)
        while start and self.positions[start - 1] == position:
            start -= 1
        tail = Rows(
            self.positions[start:],
            self.values[start:],
            self.operations[start:],
            self.unchanged[start:],
            self.ordinals[start:],
        )
        for column in (self.positions, self.values, self.operations, self.unchanged, self.ordinals):
            del column[start:]
        return tail


class TransactionWriter:
    """Source transactions, one after another, buffered per table and written in pieces.

    Complete transactions are delivered in groups: a group's rows go to the sink between one
    ``TransactionBegin`` and one ``TransactionEnd`` at the group's last commit (each row keeps its own
    transaction's commit LSN and ordinal), so a backlog of small transactions costs one pair of
    controls and one batch per table per group, not per transaction. :meth:`commit` closes a
    transaction into the group; :meth:`close_group` delivers the group (without rows of the selected
    tables: a ``ProgressBoundary``). A transaction too large for the buffer is written in pieces under
    its own controls, after the group before it was delivered, so every complete transaction read has
    a boundary even while a large one is still being read. Rows of one table keep their order;
    ordinals number the rows of a transaction in source order.

    Positions only grow from one transaction to the next (the caller checks), so the open
    transaction's rows are the buffers' tails at its position: committing one into the group moves
    nothing, and a row costs a few appends.
    """

    def __init__(
        self,
        domain: OrderingDomain,
        sink: StreamRecordSink,
        batch_rows: int,
        on_boundary: Callable[[int], None] = lambda position: None,
    ) -> None:
        self._domain = domain
        self._sink = sink
        self._batch_rows = batch_rows
        self._on_boundary = on_boundary
        """Called with the position of every boundary delivered, once the sink accepted it."""
        self._buffers: dict[Table, Rows] = {}
        """Per table: the group's rows, then the open transaction's."""
        self._buffered = 0
        self._transaction: str | int = ""
        self._group_first: tuple[str | int, int] = ("", -1)
        self._grouped = 0
        self._group_end = -1
        self._position = -1
        self._canonical = ""
        self._ordinal = 0
        self._begun = False
        self.is_open = False
        self.rows = 0

    @property
    def position(self) -> int:
        """The commit LSN of the open (or else the last committed) transaction."""
        return self._position

    @property
    def grouped(self) -> int:
        """Complete transactions in the group, not yet delivered."""
        return self._grouped

    def begin(self, transaction_id: str | int, position: int) -> None:
        """Open a transaction committing at ``position``; an integer ``transaction_id`` is the source's
        xid, and the transaction's id is then ``<xid>/<position>`` (an xid alone wraps around)."""
        if self.is_open:
            raise IntegrityError(
                f"transaction {_transaction_id(transaction_id, position)} began inside transaction "
                f"{_transaction_id(self._transaction, self._position)}",
                where=str(self._domain),
            )
        if not self._grouped:
            self._group_first = (transaction_id, position)
        self._transaction = transaction_id
        self._position = position
        self._canonical = CODEC.canonicalize(position)
        self._ordinal = 0
        self._begun = False
        self.is_open = True

    def add(self, table: Table, values: RowValues, operation: str, unchanged: list[str] | None) -> bool:
        """Buffer one row (its values, or the change message that holds them, kept encoded: an insert,
        an update without an old image, a delete; decoded with its batch, see :meth:`Table.batch`);
        True when the buffered rows reached ``batch_rows`` (then call :meth:`flush`)."""
        if not self.is_open:
            raise IntegrityError(
                f"a change of {table.resource} came outside a transaction", where=str(self._domain)
            )
        width = tuple_width(values) if type(values) is bytes else len(values)
        if width != table.width:
            raise IntegrityError(f"a row of {width} values came for {table.width} columns", where=table.where)
        rows = self._buffers.get(table)
        if rows is None:
            rows = self._buffers[table] = Rows()
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
        """The buffer is full: deliver the group before the open transaction, and when the open
        transaction's rows alone fill the buffer, write them (it continues under its own
        ``TransactionBegin``)."""
        if self._grouped:
            position = self._canonical
            current = {table: rows.split(position) for table, rows in self._buffers.items()}
            self._buffers = {table: rows for table, rows in self._buffers.items() if rows.positions}
            await self.close_group()
            self._buffers = {table: rows for table, rows in current.items() if rows.positions}
            if self._buffered < self._batch_rows:
                return
        if not self._begun:
            transaction_id = _transaction_id(self._transaction, self._position)
            await self._sink.control(TransactionBegin(self._domain, transaction_id))
            self._begun = True
        await self._write()

    async def commit(self, position: int) -> int | None:
        """Close the open transaction (its commit at ``position``). A transaction written in pieces
        is delivered now (its position returned); any other joins the group (None returned)."""
        if not self.is_open or position != self._position:
            raise IntegrityError(
                f"a commit at {CODEC.canonicalize(position)} closes no open transaction",
                where=str(self._domain),
            )
        self.is_open = False
        if self._begun:
            await self._write()
            transaction_id = _transaction_id(self._transaction, position)
            await self._sink.control(TransactionEnd(self._domain, transaction_id, self._canonical))
            self._begun = False
            self._on_boundary(position)
            return position
        self._grouped += 1
        self._group_end = position
        return None

    async def close_group(self) -> int | None:
        """Deliver the group: its rows and its boundary at its last commit; return that position
        (None: no complete transaction is waiting)."""
        if not self._grouped:
            return None
        end = CODEC.canonicalize(self._group_end)
        if self._buffers:
            group_id = _transaction_id(*self._group_first)
            await self._sink.control(TransactionBegin(self._domain, group_id))
            await self._write()
            await self._sink.control(TransactionEnd(self._domain, group_id, end))
        else:
            await self._sink.control(ProgressBoundary(self._domain, end))
        self._grouped = 0
        self._on_boundary(self._group_end)
        return self._group_end

    async def end(self) -> int:
        """Close the open transaction and deliver it (with the group before it); return its position."""
        position = self._position
        if await self.commit(position) is None:
            await self.close_group()
        return position

    async def _write(self) -> None:
        # In insertion order: rows under an older Relation of a table before those under the newer.
        tables = list(self._buffers.items())
        self._buffers = {}
        # Every batch built before the first is written: one that fails to build writes nothing.
        batches = [
            (table, table.batch(rows), Identities(rows.positions, rows.ordinals), len(rows.operations))
            for table, rows in tables
        ]
        for table, batch, identities, count in batches:
            self._buffered -= count
            await self._sink.write(self._domain, batch, identities, resource=table.resource)


def _transaction_id(transaction_id: str | int, position: int) -> str:
    """A source xid as ``<xid>/<commit LSN>`` (an xid alone wraps around); any other id as it is."""
    if isinstance(transaction_id, int):
        return f"{transaction_id}/{CODEC.canonicalize(position)}"
    return transaction_id


def joining_relation(ddl: DdlMessage) -> pg.Relation:
    """The Relation message pgoutput would send for a table joining the publication, from the DDL
    capture's record of its columns (the published ones: not generated)."""
    schema, _, name = ddl.table.rpartition(".")
    columns = [column for column in ddl.columns if not column.generated]
    identity = "f" if columns and all(column.key for column in columns) else "d"
    return pg.Relation(
        ddl.relid,
        schema.strip('"') or "public",
        name.strip('"'),
        identity,
        tuple(pg.Column(column.name, column.type_oid, column.typmod, column.key) for column in columns),
    )


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
    if message.old_kind == "O" and old is not None:
        # REPLICA IDENTITY FULL: the whole old row is known, so the update is the delete of that row
        # and the insert of the new one, which the sink applies as a multiset: a key may hold two rows
        # within a transaction (a DEFERRABLE key: UPDATE t SET id = id + 1), and the delete removes
        # the row it names, never the one inserted before it under the same key.
        return [(old.values, DELETE, None), (values, INSERT, None)]
    if old is not None and any(
        old.values[index] != values[index] and index not in missing for index in table.key_indexes
    ):
        # A key change: the old key's delete, then the new row. Columns the update left out (TOASTed,
        # unchanged) are named on the insert, and the sink carries the old row's values over.
        names = [table.relation.columns[index].name for index in missing] if missing else None
        return [(old.values, DELETE, None), (values, INSERT, names)]
    unchanged = [table.relation.columns[index].name for index in missing] if missing else None
    return [(values, UPDATE, unchanged)]
