"""How rows of one resource become Arrow: a declared (or inferred) schema, keys, and the bad-row policy.

A :class:`RowConverter` turns what a source hands over (JSON objects or Arrow record batches) into one
Arrow record batch of the resource's schema, by the type lattice's one rule
(:mod:`faucet_dagster.protocol.lattice`), and names every row that does not fit: a value that does not
land exactly in its column's type, a field the schema does not have, a null in a non-nullable field or
in a key column, and, when the schema is strict, a field the row lacks. The caller routes those rows
as :class:`ResourceSchema.on_bad_row` says; a converter never drops a row without naming it. It also
counts, per field, the rows that lacked it (:attr:`Converted.missing`), for the epoch's certificate.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.protocol import (
    ConfigError,
    Conformed,
    DataError,
    conform_batch,
    conform_rows,
    infer_schema,
    schema_from_columns,
    split_missing,
)
from faucet_dagster.protocol.json_values import json_record


class MissingFieldPolicy(StrEnum):
    """What a row lacking a field of its resource's schema is."""

    NULL = "null"
    """It lands with null in that field (the field must be nullable), counted per field."""
    REFUSE = "refuse"
    """It does not fit: it goes where ``on_bad_row`` says (the strict schema)."""


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
    do not fit it (they are not silently trimmed). ``on_missing_field`` says what a row lacking a
    field is: null there (the default; counted per field in the epoch's certificate), or a row that
    does not fit (``refuse``: a strict schema).
    """

    schema: pa.Schema | None = None
    key: tuple[str, ...] = ()
    on_bad_row: BadRowPolicy = BadRowPolicy.HALT
    on_missing_field: MissingFieldPolicy = MissingFieldPolicy.NULL

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
        on_missing_field: MissingFieldPolicy | str = MissingFieldPolicy.NULL,
    ) -> "ResourceSchema":
        """Build from plain data: ``{"id": "int64 not null", "name": "string"}`` (Arrow type aliases
        of the lattice's column types).

        ``None`` (no columns) infers the schema from the data. Key columns are made non-nullable.
        """
        policy = BadRowPolicy(on_bad_row)
        schema = None if columns is None else schema_from_columns(columns, key=key)
        return cls(schema, tuple(key), policy, MissingFieldPolicy(on_missing_field))


@dataclass(frozen=True)
class BadRow:
    """A row that does not fit: its index in the converted chunk and why."""

    index: int
    reason: str


@dataclass(frozen=True)
class Converted:
    """One converted chunk: the rows that fit, as one batch, and the rows that did not.

    ``kept`` lists the chunk indices of the rows in ``batch`` (``None``: every row, in order);
    ``missing`` counts, per field of the schema, the chunk's rows that lacked it.
    """

    batch: pa.RecordBatch
    kept: list[int] | None = None
    bad: tuple[BadRow, ...] = ()
    missing: Mapping[str, int] = field(default_factory=dict)


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
        """Convert JSON objects by the lattice's rule; every row that does not fit is named in ``bad``.

        Without a schema yet, the chunk's values decide it (:func:`~faucet_dagster.protocol.infer_schema`;
        when a field's first value has no column type, the first row that has types decides); when no
        row has types, every row is named in ``bad`` and the schema stays to be inferred from a later
        chunk."""
        schema = self.schema if self.schema is not None else self._infer(rows)
        if schema is None:
            reason = "no schema can be inferred from it (a value no column type holds)"
            return Converted(
                _empty(pa.schema([])), [], tuple(BadRow(index, reason) for index in range(len(rows)))
            )
        return self._finish(conform_rows(rows, schema), len(rows))

    def convert_batch(self, batch: pa.RecordBatch) -> Converted:
        """Conform an Arrow batch to the schema by the lattice's rule (values of another type as the
        same values in JSON objects would land).

        An inferred schema follows the source: a batch of another schema (a column added, dropped or
        retyped at the source) becomes the schema from then on; what it means for the destination is
        the sink's decision (schema evolution, or SchemaError).
        """
        if self.spec.schema is None:
            rows, _ = split_missing(batch)
            # Metadata too: a source's schema metadata (a table's DDL) changes its meaning.
            if self.schema is None or not _nullable(rows.schema).equals(self.schema, check_metadata=True):
                self.schema = _nullable(rows.schema)
        assert self.schema is not None  # declared, or adopted just above
        return self._finish(conform_batch(batch, self.schema), batch.num_rows)

    def _infer(self, rows: Sequence[Mapping[str, Any]]) -> pa.Schema | None:
        """The schema of ``rows`` (fixed from now on), or None when no row has column types."""
        inferred = infer_schema(rows)
        if inferred is None:
            # A field's first value has no column type: the first row that has types decides, the
            # others are checked against it (and the ones that do not fit are named as bad rows).
            inferred = next((found for row in rows if (found := infer_schema([row])) is not None), None)
            if inferred is None:
                return None
        missing = [column for column in self.spec.key if column not in inferred.names]
        if missing:
            raise DataError(
                f"key column(s) {', '.join(missing)} are not in the inferred schema", where=self.resource
            )
        self.schema = _nullable(inferred)
        return self.schema

    def _finish(self, conformed: Conformed, count: int) -> Converted:
        """The strict policy, then the null checks, over what the lattice landed."""
        bad = [BadRow(index, reason) for index, reason in conformed.bad.items()]
        batch, kept = conformed.batch, conformed.kept
        if self.spec.on_missing_field is MissingFieldPolicy.REFUSE and conformed.missing:
            lacking: dict[int, list[str]] = {}
            for name, rows in conformed.missing.items():
                for row in rows:
                    lacking.setdefault(row, []).append(name)
            refused = {row for row in lacking if row not in conformed.bad}
            if refused:
                bad.extend(
                    BadRow(
                        row, f"the record lacks field(s) {', '.join(lacking[row])} (on_missing_field: refuse)"
                    )
                    for row in refused
                )
                order = range(count) if kept is None else kept
                keep = [position for position, row in enumerate(order) if row not in refused]
                batch = batch.take(pa.array(keep, pa.int64()))
                kept = [row for row in order if row not in refused]
        counts = {name: len(rows) for name, rows in conformed.missing.items()}
        checked = self._check_nulls(batch)
        if checked.kept is not None:
            positions = range(count) if kept is None else kept
            bad.extend(BadRow(positions[row.index], row.reason) for row in checked.bad)
            kept = [positions[index] for index in checked.kept]
            batch = checked.batch
        return Converted(batch, kept, tuple(sorted(bad, key=lambda row: row.index)), counts)

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
    return pa.schema([item.with_nullable(True) for item in schema], metadata=schema.metadata)


def _empty(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=schema)


def row_payload(row: Mapping[str, Any]) -> bytes:
    """A row as JSON for the dead-letter route (:func:`json_record`: values JSON cannot hold become
    strings a reader can decode)."""
    return json_record(dict(row)).encode()
