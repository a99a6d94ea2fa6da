"""Records as they cross the protocol: Arrow record batches, or JSON objects converted to them."""

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import pyarrow as pa

from faucet_dagster.protocol.errors import ConfigError, DataError

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


def record_count(records: Records) -> int:
    return records.num_rows if isinstance(records, pa.RecordBatch) else len(records)


def as_record_batch(records: Records, schema: pa.Schema | None = None) -> pa.RecordBatch:
    """Convert ``records`` to one Arrow record batch, cast to ``schema`` when it is given.

    Raises :class:`DataError` naming the problem when the JSON objects cannot form one batch.
    """
    try:
        if isinstance(records, pa.RecordBatch):
            return records if schema is None or records.schema.equals(schema) else records.cast(schema)
        rows = [dict(row) for row in records]
        if schema is not None:
            return pa.RecordBatch.from_pylist(rows, schema=schema)
        return pa.RecordBatch.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as exc:
        raise DataError(f"records do not form an Arrow batch: {exc}") from exc


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


def schema_from_columns(
    columns: Mapping[str, str], *, key: Sequence[str] = (), where: str | None = None
) -> pa.Schema:
    """An Arrow schema from plain data, in order: ``{"id": "int64 not null", "name": "string"}``.

    Each value is an Arrow type name (:func:`arrow_type_from_name`), optionally followed by
    ``not null``; key columns are never nullable. Raises :class:`ConfigError` naming a column whose
    type is not an Arrow type name.
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
        fields.append(pa.field(column, arrow_type, nullable=nullable and column not in key))
    return pa.schema(fields)
