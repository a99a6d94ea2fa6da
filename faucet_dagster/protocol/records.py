"""Records as they cross the protocol: Arrow record batches, or JSON objects converted to them."""

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import pyarrow as pa

from faucet_dagster.protocol.errors import ConfigError

JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None
"""A JSON document: what bookmarks, contexts and JSON records are made of."""

Records: TypeAlias = pa.RecordBatch | Sequence[Mapping[str, Any]]
"""What a source hands over: an Arrow record batch, or a list of JSON objects."""

OPERATION_COLUMN = "__faucet_op"
"""In CHANGES records, the column holding the operation (``insert``, ``update``, ``delete``,
``truncate``).

A ``truncate`` row removes every row its table held before it (in commit order); its data columns
are null. An ``insert`` that names columns in :data:`UNCHANGED_COLUMN` is the new row of a key change
whose old row is the ``delete`` just before it (same position, previous ordinal): the columns it
names keep the old row's values.
"""

UNCHANGED_COLUMN = "__faucet_unchanged"
"""In CHANGES records, the columns an ``update`` did not carry (a list of column names, or null).

A source that cannot send every value of an updated row (PostgreSQL leaves a TOASTed value that the
update did not change out of the change) names those columns here; their values in the row are null
and mean "keep the destination's value", never SQL null. Null or empty when the row is complete.
On an ``insert`` (a key change, see :data:`OPERATION_COLUMN`) the value kept is the old key's.
"""


MISSING_COLUMN = "__faucet_missing"
"""In a batch of rows, the fields of the schema each row's record lacked (a list of names, or null).

A source that parses records into declared columns (a JSON payload without one of them) reads a field
its record lacks as null; it names that field here so the pipeline can tell it from a null the record
held: it counts such rows per field in the epoch's certificate, and refuses them when the resource's
schema is strict. The column is present only when some row lacked a field; the pipeline removes it
before the rows reach a sink.
"""


def split_missing(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, dict[str, list[int]]]:
    """``batch`` without its :data:`MISSING_COLUMN`, and the rows it names per field."""
    index = batch.schema.get_field_index(MISSING_COLUMN)
    if index < 0:
        return batch, {}
    missing: dict[str, list[int]] = {}
    for row, names in enumerate(batch.column(index).to_pylist()):
        for name in names or ():
            missing.setdefault(name, []).append(row)
    return batch.remove_column(index), missing


def record_count(records: Records) -> int:
    return records.num_rows if isinstance(records, pa.RecordBatch) else len(records)


def slice_records(records: Records, start: int, stop: int) -> Records:
    """Rows ``start`` to ``stop`` (exclusive) of ``records``, without copying Arrow data."""
    if isinstance(records, pa.RecordBatch):
        return records.slice(start, max(0, stop - start))
    return records[start:stop]


_TIMESTAMP_WITH_ZONE = re.compile(r"timestamp\[(s|ms|us|ns),\s*tz=([^\]]+)\]")
_DECIMAL = re.compile(r"decimal(128|256)?\((\d+),\s*(-?\d+)\)")


def arrow_type_from_name(name: str) -> pa.DataType:
    """An Arrow type from its name: an alias of ``pa.type_for_alias`` (``int64``, ``string``,
    ``timestamp[us]``), ``timestamp[us, tz=UTC]`` or ``decimal128(12, 2)``. Raises ``ValueError``."""
    text = name.strip()
    zoned = _TIMESTAMP_WITH_ZONE.fullmatch(text)
    if zoned:
        return pa.timestamp(zoned.group(1), tz=zoned.group(2).strip())
    decimal = _DECIMAL.fullmatch(text)
    if decimal:
        build = pa.decimal256 if decimal.group(1) == "256" else pa.decimal128
        return build(int(decimal.group(2)), int(decimal.group(3)))
    return pa.type_for_alias(text)


def lattice_type_problem(kind: pa.DataType) -> str:
    """Why ``kind`` is not a column type of the lattice (``""`` when it is): a declared column must be
    one, so every value's outcome in it is known (:mod:`faucet_dagster.protocol.lattice`)."""
    if (
        pa.types.is_integer(kind)
        or pa.types.is_float32(kind)
        or pa.types.is_float64(kind)
        or pa.types.is_decimal128(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_date32(kind)
        or pa.types.is_timestamp(kind)
        or pa.types.is_null(kind)
    ):
        return ""
    if pa.types.is_struct(kind):
        return next(
            (
                problem
                for i in range(kind.num_fields)
                if (problem := lattice_type_problem(kind.field(i).type))
            ),
            "",
        )
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return lattice_type_problem(kind.value_type)
    return (
        f"{kind} is not a column type values land in exactly (use integers, float32/float64, "
        "decimal128(p, s), bool, string, binary, date32, timestamp[unit(, tz=...)], or structs and "
        "lists of these)"
    )


def check_lattice_schema(schema: pa.Schema, where: str) -> None:
    """Raise :class:`ConfigError` naming the first column whose type is not one of the lattice's."""
    for item in schema:
        problem = lattice_type_problem(item.type)
        if problem:
            raise ConfigError(f"column {item.name!r}: {problem}", where=where)


def schema_from_columns(
    columns: Mapping[str, str], *, key: Sequence[str] = (), where: str | None = None
) -> pa.Schema:
    """An Arrow schema from plain data, in order: ``{"id": "int64 not null", "name": "string"}``.

    Each value is an Arrow type name (:func:`arrow_type_from_name`) of a lattice column type
    (:func:`lattice_type_problem`), optionally followed by ``not null``; key columns are never nullable.
    Raises :class:`ConfigError` naming a column whose type is not one.
    """
    fields = []
    for column, spec in columns.items():
        text = spec.strip()
        nullable = not text.lower().endswith(" not null")
        alias = text if nullable else text[: -len(" not null")]
        try:
            arrow_type = arrow_type_from_name(alias)
        except (ValueError, pa.ArrowInvalid):
            raise ConfigError(
                f"column {column!r}: {alias.strip()!r} is not an Arrow type name", where=where or column
            ) from None
        problem = lattice_type_problem(arrow_type)
        if problem:
            raise ConfigError(f"column {column!r}: {problem}", where=where or column)
        fields.append(pa.field(column, arrow_type, nullable=nullable and column not in key))
    return pa.schema(fields)
