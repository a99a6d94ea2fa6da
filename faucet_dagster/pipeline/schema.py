"""How rows of one resource become Arrow: a declared (or inferred) schema, keys, and the bad-row policy.

A :class:`RowConverter` turns what a source hands over (JSON objects or Arrow record batches) into one
Arrow record batch of the resource's schema, and names every row that does not fit: a value of the
wrong type, a field the schema does not have, a null in a non-nullable field or in a key column. The
caller routes those rows as :class:`ResourceSchema.on_bad_row` says; a converter never drops a row
without naming it.

The fast path converts a whole chunk with one Arrow call; only a chunk that fails is converted again
row by row to find the rows that do not fit.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.protocol import ConfigError, DataError, schema_from_columns
from faucet_dagster.protocol.json_values import json_record

_ARROW_ERRORS = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    pa.ArrowNotImplementedError,
    TypeError,
    ValueError,
    # An integer beyond int64/uint64, a value nested deeper than the interpreter's stack: a row that
    # does not fit, named like any other (never an exception that halts the stream without a position).
    OverflowError,
    RecursionError,
)


class BadRowPolicy(StrEnum):
    """Where a row that does not fit its resource's schema goes."""

    HALT = "halt"
    """Raise :class:`DataError`: the stream stops at that row and nothing after it is certified."""
    DEAD_LETTER = "dead_letter"
    """Route the row, with its identity and the reason, to the dead-letter route of the pipeline."""


@dataclass(frozen=True)
class ResourceSchema:
    """The Arrow schema of one resource's rows, its key, and what happens to rows that do not fit.

    ``schema`` ``None`` means infer it from the first chunk written to the resource; the inferred
    schema then stays fixed, so a later row with another type or an unknown field does not fit.
    ``key`` columns must exist in the schema and are never null. Rows with fields outside the schema
    do not fit it (they are not silently trimmed).
    """

    schema: pa.Schema | None = None
    key: tuple[str, ...] = ()
    on_bad_row: BadRowPolicy = BadRowPolicy.HALT

    def __post_init__(self) -> None:
        if self.schema is not None:
            missing = [column for column in self.key if self.schema.get_field_index(column) < 0]
            if missing:
                raise ConfigError(f"key column(s) {', '.join(missing)} are not in the declared schema")

    @classmethod
    def from_columns(
        cls,
        columns: Mapping[str, str] | None,
        key: Sequence[str] = (),
        on_bad_row: BadRowPolicy | str = BadRowPolicy.HALT,
    ) -> "ResourceSchema":
        """Build from plain data: ``{"id": "int64 not null", "name": "string"}`` (Arrow type aliases).

        ``None`` (no columns) infers the schema from the data. Key columns are made non-nullable.
        """
        policy = BadRowPolicy(on_bad_row)
        schema = None if columns is None else schema_from_columns(columns, key=key)
        return cls(schema, tuple(key), policy)


@dataclass(frozen=True)
class BadRow:
    """A row that does not fit: its index in the converted chunk and why."""

    index: int
    reason: str


@dataclass(frozen=True)
class Converted:
    """One converted chunk: the rows that fit, as one batch, and the rows that did not.

    ``kept`` lists the chunk indices of the rows in ``batch`` (``None``: every row, in order).
    """

    batch: pa.RecordBatch
    kept: list[int] | None = None
    bad: tuple[BadRow, ...] = ()


@dataclass
class RowConverter:
    """Converts one resource's chunks to its schema; infers the schema on the first chunk if needed."""

    resource: str
    spec: ResourceSchema
    schema: pa.Schema | None = field(init=False)

    def __post_init__(self) -> None:
        self.schema = self.spec.schema

    @property
    def required(self) -> frozenset[str]:
        """The columns that never hold a null: the key and the schema's non-nullable fields."""
        if self.schema is None:
            return frozenset(self.spec.key)
        return frozenset(self.spec.key) | {item.name for item in self.schema if not item.nullable}

    def convert_rows(self, rows: Sequence[Mapping[str, Any]]) -> Converted:
        """Convert JSON objects; every row that does not fit is named in ``bad``.

        Without a schema yet, the first row that converts decides it; when none does, every row is
        named in ``bad`` and the schema stays to be inferred from a later chunk."""
        schema = self.schema if self.schema is not None else self._infer(rows)
        if schema is None:
            reason = "no schema can be inferred from it (a value Arrow cannot hold)"
            return Converted(
                _empty(pa.schema([])), [], tuple(BadRow(index, reason) for index in range(len(rows)))
            )
        names = frozenset(schema.names)
        # One C-level pass over the rows: a field outside the schema makes a row not fit.
        if all(map(names.issuperset, rows)):
            try:
                return self._check_nulls(pa.RecordBatch.from_pylist(rows, schema=schema))
            except _ARROW_ERRORS:
                pass  # the slow path below names the rows that fail
        kept: list[int] = []
        good: list[Mapping[str, Any]] = []
        bad: list[BadRow] = []
        for index, row in enumerate(rows):
            extra = set(row) - names
            if extra:
                bad.append(BadRow(index, f"field(s) {', '.join(sorted(extra))} are not in the schema"))
                continue
            try:
                pa.RecordBatch.from_pylist([row], schema=schema)
            except _ARROW_ERRORS as exc:
                bad.append(BadRow(index, f"does not fit the schema: {exc}"))
                continue
            kept.append(index)
            good.append(row)
        return self._then_check_nulls(pa.RecordBatch.from_pylist(good, schema=schema), kept, bad)

    def convert_batch(self, batch: pa.RecordBatch) -> Converted:
        """Conform an Arrow batch to the schema (the same field names, safely castable types).

        An inferred schema follows the source: a batch of another schema (a column added, dropped or
        retyped at the source) becomes the schema from then on; what it means for the destination is
        the sink's decision (schema evolution, or SchemaError).
        """
        if self.schema is None or (
            self.spec.schema is None and not _nullable(batch.schema).equals(self.schema)
        ):
            self.schema = _nullable(batch.schema)
        schema = self.schema
        if batch.schema.equals(schema):
            return self._check_nulls(batch)
        if sorted(batch.schema.names) != sorted(schema.names):
            reason = f"columns {batch.schema.names} do not match the schema's {schema.names}"
            return Converted(
                _empty(schema), [], tuple(BadRow(index, reason) for index in range(batch.num_rows))
            )
        ordered = batch.select(schema.names)
        try:
            return self._check_nulls(ordered.cast(schema))
        except _ARROW_ERRORS:
            pass  # the slow path below names the rows that do not cast
        kept: list[int] = []
        parts: list[pa.RecordBatch] = []
        bad: list[BadRow] = []
        for index in range(ordered.num_rows):
            try:
                parts.append(ordered.slice(index, 1).cast(schema))
            except _ARROW_ERRORS as exc:
                bad.append(BadRow(index, f"does not fit the schema: {exc}"))
                continue
            kept.append(index)
        return self._then_check_nulls(pa.concat_batches(parts) if parts else _empty(schema), kept, bad)

    def _infer(self, rows: Sequence[Mapping[str, Any]]) -> pa.Schema | None:
        """The schema of ``rows`` (fixed from now on), or None when no row converts on its own."""
        try:
            inferred = pa.RecordBatch.from_pylist(list(rows)).schema
        except _ARROW_ERRORS:
            # The chunk disagrees with itself: the first row that converts decides, the others are
            # checked against it (and the ones that do not fit are named as bad rows).
            for row in rows:
                try:
                    inferred = pa.RecordBatch.from_pylist([dict(row)]).schema
                    break
                except _ARROW_ERRORS:
                    continue
            else:
                return None
        missing = [column for column in self.spec.key if column not in inferred.names]
        if missing:
            raise DataError(
                f"key column(s) {', '.join(missing)} are not in the inferred schema", where=self.resource
            )
        self.schema = _nullable(inferred)
        return self.schema

    def _then_check_nulls(self, batch: pa.RecordBatch, kept: list[int], bad: list[BadRow]) -> Converted:
        """Null-check ``batch`` (whose rows are the chunk rows ``kept``) and merge both stages' bad rows."""
        checked = self._check_nulls(batch)
        if checked.kept is not None:
            bad.extend(BadRow(kept[row.index], row.reason) for row in checked.bad)
            kept = [kept[index] for index in checked.kept]
        return Converted(checked.batch, kept, tuple(sorted(bad, key=lambda row: row.index)))

    def _check_nulls(self, batch: pa.RecordBatch) -> Converted:
        """Name the rows with a null in a key column or a non-nullable field; keep the others."""
        schema = batch.schema
        offending = [
            name
            for name in schema.names
            if (name in self.spec.key or not schema.field(name).nullable) and batch.column(name).null_count
        ]
        if not offending:
            return Converted(batch)
        null_mask = pc.is_null(batch.column(offending[0]))
        for name in offending[1:]:
            null_mask = pc.or_(null_mask, pc.is_null(batch.column(name)))
        reason = f"null in required column(s) {', '.join(offending)}"
        bad = tuple(BadRow(index, reason) for index in pc.indices_nonzero(null_mask).to_pylist())
        keep_mask = pc.invert(null_mask)
        return Converted(batch.filter(keep_mask), pc.indices_nonzero(keep_mask).to_pylist(), bad)


def _nullable(schema: pa.Schema) -> pa.Schema:
    return pa.schema([item.with_nullable(True) for item in schema])


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=schema)


def row_payload(row: Mapping[str, Any]) -> bytes:
    """A row as JSON for the dead-letter route (:func:`json_record`: values JSON cannot hold become
    strings a reader can decode)."""
    return json_record(dict(row)).encode()
