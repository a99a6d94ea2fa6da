"""The ``pgoutput`` logical replication protocol, version 1: messages decoded, text values made Arrow.

PostgreSQL's built-in output plugin ``pgoutput`` writes one binary message per call of its callbacks
(PostgreSQL documentation, "Logical Replication Message Formats"). With ``proto_version '1'`` and no
``streaming`` option, a decoded transaction always arrives whole and in commit order::

    Begin, (Relation | Type | Origin | Insert | Update | Delete | Truncate | Message)*, Commit

A Relation message describes a table (its columns, their type OIDs and which columns form the replica
identity) before the first change of that table in a decoding session, and again after the table
changes. Tuple data is in the text format of each type's output function (the ``binary`` option is
not used), so :func:`column_array` turns a column of such texts into a typed Arrow array (a table's
change messages are cut into such columns in bulk by :mod:`faucet_postgres.pgoutput_columns`). The texts
depend on the decoding session's settings: the ones :func:`faucet_postgres.common.connect` sets (ISO
dates, UTC, hex bytea).

This module does no I/O. A message it cannot decode raises :class:`IntegrityError`: skipping it would
skip source input without proof, so decoding stops instead.
"""

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from struct import Struct
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.protocol import OPERATION_COLUMN, UNCHANGED_COLUMN, DataError, IntegrityError
from faucet_postgres import common
from faucet_postgres.cdc_ddl import SourceColumn, TableHistory
from faucet_postgres.change_schema import (
    ATTNUM_METADATA,
    ATTNUMS_METADATA,
    DDL_METADATA,
    GENERATED_METADATA,
    MISSING_METADATA,
    RELID_METADATA,
    TYPE_METADATA,
    UNLOGGED_DEFAULT_METADATA,
)
from faucet_postgres.changes import KEY_METADATA
from faucet_postgres.common import PgColumn
from faucet_postgres.copy_arrow import INFINITE, INFINITE_DATES

_U32 = Struct(">I")
_U64 = Struct(">Q")
BEGIN_FIELDS = Struct(">QqI")
"""A Begin message after its type byte: final LSN, commit time, xid."""
COMMIT_FIELDS = Struct(">BQQq")
"""A Commit message after its type byte: flags, commit LSN, end LSN, commit time."""
_COLUMN_TAIL = Struct(">Ii")
_CHANGE_HEAD = Struct(">IB")


@dataclass(frozen=True, slots=True)
class Column:
    """A column of a published table as a Relation message describes it."""

    name: str
    type_oid: int
    type_modifier: int
    key: bool
    """True when the column is part of the replica identity (every column for REPLICA IDENTITY FULL)."""


@dataclass(frozen=True, slots=True)
class Relation:
    """A published table: its OID, name, replica identity setting (d, n, f, i) and columns."""

    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]

    @property
    def qualified_name(self) -> str:
        """``schema.table``: the resource name of this table's rows."""
        return f"{self.namespace}.{self.name}"


class TupleData(NamedTuple):
    """One row image: a text value or ``None`` (SQL null) per column, in relation order.

    ``unchanged`` lists the columns whose value PostgreSQL did not send because it is a TOASTed value
    the update left unchanged; their entry in ``values`` is ``None`` and does not mean null.
    """

    values: tuple[str | None, ...]
    unchanged: tuple[int, ...] = ()
    # A NamedTuple, like the change messages: one is built per row, and frozen dataclasses are slow to build.


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    """The LSN of the transaction's commit record: the transaction's commit LSN."""
    commit_time: int
    """Microseconds since 2000-01-01 UTC."""
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    """The LSN just past the commit record."""
    commit_time: int


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """A non-built-in type (an enum, a domain, ...) that a following Relation message refers to."""

    oid: int
    namespace: str
    name: str


class Insert(NamedTuple):
    relation_oid: int
    new: TupleData


class Update(NamedTuple):
    """An update. ``old_kind`` is ``"K"`` (``old`` holds the old replica identity key: the key changed),
    ``"O"`` (``old`` is the whole old row: REPLICA IDENTITY FULL) or ``""`` (no old image)."""

    relation_oid: int
    old_kind: str
    old: TupleData | None
    new: TupleData


class Delete(NamedTuple):
    """A delete; ``old`` holds the key (``old_kind == "K"``) or the whole old row (``"O"``)."""

    relation_oid: int
    old_kind: str
    old: TupleData


@dataclass(frozen=True, slots=True)
class Truncate:
    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """A message written with ``pg_logical_emit_message`` (sent with the ``messages`` option)."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = Begin | Commit | Origin | Relation | TypeInfo | Insert | Update | Delete | Truncate | LogicalMessage


def decode(data: bytes) -> Message:
    """Decode one pgoutput message; raises :class:`IntegrityError` for anything malformed or unknown."""
    try:
        decoder = _DECODERS[data[0]]
    except (IndexError, KeyError):
        kind = repr(data[:1]) if data else "an empty message"
        raise IntegrityError(f"pgoutput message type {kind} is not known", where="pgoutput") from None
    try:
        return decoder(data)
    except (IndexError, ValueError, UnicodeDecodeError, struct.error) as exc:
        raise IntegrityError(
            f"a pgoutput {chr(data[0])!r} message of {len(data)} bytes is malformed: {exc}", where="pgoutput"
        ) from exc


def _cstring(data: bytes, pos: int) -> tuple[str, int]:
    end = data.index(0, pos)
    return data[pos:end].decode(), end + 1


def _tuple(data: bytes, pos: int) -> tuple[TupleData, int]:
    """Tuple data at ``pos``: Int16 column count, then per column 'n', 'u', or 't' Int32 length bytes.

    The hot loop of decoding: kept to the fewest Python operations per column.
    """
    count = (data[pos] << 8) | data[pos + 1]
    pos += 2
    values: list[str | None] = []
    append = values.append
    unpack = _U32.unpack_from
    unchanged: list[int] | None = None
    for index in range(count):
        kind = data[pos]
        if kind == 0x74:  # 't': text value
            (length,) = unpack(data, pos + 1)
            pos += 5
            end = pos + length
            append(data[pos:end].decode())
            pos = end
        elif kind == 0x6E:  # 'n': null
            append(None)
            pos += 1
        elif kind == 0x75:  # 'u': unchanged TOASTed value, not sent
            append(None)
            unchanged = [index] if unchanged is None else [*unchanged, index]
            pos += 1
        else:  # 'b' (binary) only comes with the binary option, which is never set
            raise ValueError(f"tuple column kind {chr(kind)!r} is not expected")
    if pos > len(data):
        raise ValueError("tuple data runs past the end of the message")
    return TupleData(tuple(values), () if unchanged is None else tuple(unchanged)), pos


def _begin(data: bytes) -> Begin:
    final_lsn, commit_time, xid = BEGIN_FIELDS.unpack_from(data, 1)
    return Begin(final_lsn, commit_time, xid)


def _commit(data: bytes) -> Commit:
    flags, commit_lsn, end_lsn, commit_time = COMMIT_FIELDS.unpack_from(data, 1)
    return Commit(flags, commit_lsn, end_lsn, commit_time)


def _origin(data: bytes) -> Origin:
    (lsn,) = _U64.unpack_from(data, 1)
    name, _ = _cstring(data, 9)
    return Origin(lsn, name)


def _relation(data: bytes) -> Relation:
    (oid,) = _U32.unpack_from(data, 1)
    namespace, pos = _cstring(data, 5)
    name, pos = _cstring(data, pos)
    identity = chr(data[pos])
    count = (data[pos + 1] << 8) | data[pos + 2]
    pos += 3
    columns: list[Column] = []
    for _ in range(count):
        flags = data[pos]
        column, pos = _cstring(data, pos + 1)
        type_oid, modifier = _COLUMN_TAIL.unpack_from(data, pos)
        pos += 8
        columns.append(Column(column, type_oid, modifier, bool(flags & 1)))
    # pgoutput names the catalog namespace with an empty string (the "pg_catalog" shorthand).
    return Relation(oid, namespace or "pg_catalog", name, identity, tuple(columns))


def _type(data: bytes) -> TypeInfo:
    (oid,) = _U32.unpack_from(data, 1)
    namespace, pos = _cstring(data, 5)
    name, _ = _cstring(data, pos)
    return TypeInfo(oid, namespace or "pg_catalog", name)


def _insert(data: bytes) -> Insert:
    oid, kind = _CHANGE_HEAD.unpack_from(data, 1)
    if kind != 0x4E:  # 'N'
        raise ValueError(f"an insert carries tuple {chr(kind)!r}, expected 'N'")
    new, _ = _tuple(data, 6)
    return Insert(oid, new)


def _update(data: bytes) -> Update:
    oid, kind = _CHANGE_HEAD.unpack_from(data, 1)
    old: TupleData | None = None
    old_kind = ""
    pos = 6
    if kind in (0x4B, 0x4F):  # 'K' old key, 'O' old row
        old_kind = chr(kind)
        old, pos = _tuple(data, pos)
        kind = data[pos]
        pos += 1
    if kind != 0x4E:
        raise ValueError(f"an update carries tuple {chr(kind)!r} where 'N' was expected")
    new, _ = _tuple(data, pos)
    return Update(oid, old_kind, old, new)


def _delete(data: bytes) -> Delete:
    oid, kind = _CHANGE_HEAD.unpack_from(data, 1)
    if kind not in (0x4B, 0x4F):
        raise ValueError(f"a delete carries tuple {chr(kind)!r}, expected 'K' or 'O'")
    old, _ = _tuple(data, 6)
    return Delete(oid, chr(kind), old)


def _truncate(data: bytes) -> Truncate:
    (count,) = _U32.unpack_from(data, 1)
    options = data[5]
    oids = tuple(_U32.unpack_from(data, 6 + 4 * index)[0] for index in range(count))
    return Truncate(oids, bool(options & 1), bool(options & 2))


def _message(data: bytes) -> LogicalMessage:
    flags = data[1]
    (lsn,) = _U64.unpack_from(data, 2)
    prefix, pos = _cstring(data, 10)
    (length,) = _U32.unpack_from(data, pos)
    content = data[pos + 4 : pos + 4 + length]
    if len(content) != length:
        raise ValueError("the message content runs past the end of the message")
    return LogicalMessage(bool(flags & 1), lsn, prefix, content)


_DECODERS: dict[int, Callable[[bytes], Message]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("O"): _origin,
    ord("R"): _relation,
    ord("Y"): _type,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("M"): _message,
}


# --------------------------------------------------------------------------------------------------
# text values to Arrow

_TYPE_NAMES: dict[int, str] = {
    16: "bool",
    17: "bytea",
    18: "char",
    19: "name",
    20: "int8",
    21: "int2",
    23: "int4",
    25: "text",
    26: "oid",
    114: "json",
    700: "float4",
    701: "float8",
    1042: "bpchar",
    1043: "varchar",
    1082: "date",
    1083: "time",
    1114: "timestamp",
    1184: "timestamptz",
    1700: "numeric",
    2950: "uuid",
    3802: "jsonb",
}
"""Built-in types by OID (pgoutput sends OIDs; the connector's type mapping is by name)."""


def type_name(column: Column) -> str:
    """The column type's ``pg_type.typname`` (``oid:N`` for a type not listed here, read as text)."""
    return _TYPE_NAMES.get(column.type_oid, f"oid:{column.type_oid}")


def arrow_type(column: Column) -> pa.DataType:
    """The Arrow type of a column's values, by the connector's one mapping (:func:`.common.arrow_type`)."""
    return common.arrow_type(PgColumn(column.name, type_name(column), "", column.type_modifier, False))


def relation_schema(
    relation: Relation,
    keys: Sequence[int] | None = None,
    older_rows: Mapping[str, str | None] | None = None,
    history: TableHistory | None = None,
) -> pa.Schema:
    """The Arrow schema of a table's change rows: its columns, then the operation and unchanged columns.

    Every field is nullable (a delete carries only the key). Field metadata names the PostgreSQL type
    (``faucet.pg_type``) and marks the columns that identify a row (``faucet.key``): the columns at
    ``keys``, by default the replica identity columns. ``older_rows`` tells, per column with a
    default, what rows older than the column hold: the missing value's text (``faucet.missing``), or
    ``None`` when that is not known (``faucet.unlogged_default``; see :mod:`faucet_postgres.change_schema`).
    With the DDL capture's ``history`` of the table, each field also carries its attribute number
    (``faucet.attnum``: what tells a renamed column from a new one) and exact type (``faucet.type``),
    and the schema the generated columns the change rows do not carry (``faucet.generated``), the
    table's OID and the statement that last changed its columns (``faucet.ddl``).
    The schema metadata names the table and its replica identity setting.
    """
    older = older_rows or {}
    identifying = (
        {index for index, column in enumerate(relation.columns) if column.key} if keys is None else set(keys)
    )
    recorded = {} if history is None else {column.name: column for column in history.columns}
    fields = [
        pa.field(
            column.name,
            arrow_type(column),
            metadata=_field_metadata(column, index in identifying, older, recorded.get(column.name)),
        )
        for index, column in enumerate(relation.columns)
    ]
    fields.append(pa.field(OPERATION_COLUMN, pa.string()))
    fields.append(pa.field(UNCHANGED_COLUMN, pa.list_(pa.string())))
    metadata = {
        "faucet.table": relation.qualified_name,
        "faucet.replica_identity": relation.replica_identity,
    }
    if history is not None:
        names = {column.name for column in relation.columns}
        generated = [
            {
                "name": column.name,
                "attnum": column.attnum,
                "type": column.type,
                "expression": column.expression,
            }
            for column in history.columns
            if column.generated == "s" and column.name not in names
        ]
        metadata |= {
            ATTNUMS_METADATA.decode(): json.dumps([column.attnum for column in history.columns]),
            GENERATED_METADATA.decode(): json.dumps(generated),
            RELID_METADATA.decode(): str(relation.oid),
            DDL_METADATA.decode(): history.statement,
        }
    return pa.schema(fields, metadata=metadata)


def _field_metadata(
    column: Column, key: bool, older: Mapping[str, str | None], recorded: SourceColumn | None
) -> dict[bytes, bytes]:
    metadata = {b"faucet.pg_type": type_name(column).encode(), KEY_METADATA: b"true" if key else b"false"}
    if recorded is not None and recorded.type_oid == column.type_oid:
        metadata[ATTNUM_METADATA] = str(recorded.attnum).encode()
        metadata[TYPE_METADATA] = recorded.type.encode()
    if column.name in older:
        missing = older[column.name]
        if missing is None:
            metadata[UNLOGGED_DEFAULT_METADATA] = b"true"
        else:
            metadata[MISSING_METADATA] = missing.encode()
    return metadata


def column_array(text: pa.Array, column: Column, where: str) -> pa.Array:
    """Parse a column of output-function texts (an Arrow string array, null for SQL null) into an
    Arrow array of its type.

    ``infinity`` and ``-infinity`` of a timestamp, timestamptz or date become the largest and the
    smallest value of the Arrow type (int64, int32 for dates), which the sinks write back as
    PostgreSQL's infinities (:mod:`faucet_postgres.common`). Raises :class:`DataError` naming the
    column and ``where`` (the table) when a value has no Arrow form (BC dates, ``NaN`` in a
    ``numeric(p, s)``).
    """
    target = arrow_type(column)
    try:
        if pa.types.is_timestamp(target) or pa.types.is_date(target):
            return _with_infinities(text, target)
        if pa.types.is_string(target):
            return text
        if pa.types.is_boolean(target):
            return pc.equal(text, "t")
        if pa.types.is_binary(target):
            values = text.to_pylist()
            return pa.array([None if value is None else bytes.fromhex(value[2:]) for value in values], target)
        if pa.types.is_time(target):
            # Arrow parses a time only as part of a timestamp.
            return pc.binary_join_element_wise("1970-01-01 ", text, "").cast(pa.timestamp("us")).cast(target)
        return text.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise DataError(
            f"a value of column {column.name!r} ({type_name(column)}) has no {target} form: {exc}",
            where=where,
        ) from exc


def _with_infinities(text: pa.Array, target: pa.DataType) -> pa.Array:
    """Timestamps or dates parsed, ``infinity`` and ``-infinity`` as the type's extreme values."""
    later, earlier = pc.equal(text, "infinity"), pc.equal(text, "-infinity")
    if not (pc.any(later).as_py() or pc.any(earlier).as_py()):
        return text.cast(target)
    storage, (low, high) = (
        (pa.int32(), INFINITE_DATES) if pa.types.is_date(target) else (pa.int64(), INFINITE)
    )
    finite = pc.if_else(pc.or_(later, earlier), pa.scalar(None, pa.string()), text).cast(target)
    values = pc.if_else(
        later, pa.scalar(high, storage), pc.if_else(earlier, pa.scalar(low, storage), finite.cast(storage))
    )
    return values.cast(target)
