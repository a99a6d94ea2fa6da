"""Rows of one resource from one domain waiting in an epoch's pipeline, and their conversion to one
Arrow batch (runs of JSON rows in one call, Arrow batches one by one).
"""

from collections import Counter
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from faucet_dagster.pipeline.schema import BadRow, Converted, RowConverter
from faucet_dagster.protocol import (
    Identities,
    IntegrityError,
    OrderingDomain,
    Records,
    record_count,
    split_missing,
)


class Builder:
    """Rows of one resource from one domain, waiting to become an Arrow batch."""

    __slots__ = ("chunks", "converter", "domain", "ordinals", "positions", "resource", "rows")

    def __init__(self, resource: str, domain: OrderingDomain, converter: RowConverter) -> None:
        self.resource = resource
        self.domain = domain
        self.converter = converter
        self.chunks: list[Records] = []
        self.positions: list[str] = []
        self.ordinals: list[int] | None = None
        self.rows = 0

    def add(self, rows: Records, identities: Identities) -> None:
        self.chunks.append(rows)
        if identities.ordinals is not None:
            if self.ordinals is None:
                self.ordinals = [0] * len(self.positions)
            self.ordinals.extend(identities.ordinals)
        elif self.ordinals is not None:
            self.ordinals.extend([0] * len(identities))
        self.positions.extend(identities.positions)
        self.rows += len(identities)

    def take(self) -> tuple[list[Records], list[str], list[int] | None]:
        taken = (self.chunks, self.positions, self.ordinals)
        self.chunks, self.positions, self.ordinals, self.rows = [], [], None, 0
        return taken


def convert_chunks(converter: RowConverter, chunks: list[Records]) -> Converted:
    """Convert a builder's chunks: runs of JSON rows in one Arrow call, Arrow batches one by one."""
    runs: list[pa.RecordBatch | list[Mapping[str, Any]]] = []
    for chunk in chunks:
        if isinstance(chunk, pa.RecordBatch):
            runs.append(chunk)
        elif runs and isinstance(runs[-1], list):
            runs[-1].extend(chunk)
        else:
            runs.append(list(chunk))
    parts: list[tuple[int, int, Converted]] = []
    offset = 0
    for run in runs:
        converted = (
            converter.convert_batch(run) if isinstance(run, pa.RecordBatch) else converter.convert_rows(run)
        )
        size = record_count(run)
        parts.append((offset, size, converted))
        offset += size
    if len(parts) == 1:
        return parts[0][2]
    batch = pa.concat_batches([converted.batch for _, _, converted in parts])
    missing: Counter[str] = Counter()
    for _, _, converted in parts:
        missing.update(converted.missing)
    if all(converted.kept is None for _, _, converted in parts):
        return Converted(batch, missing=dict(missing))
    kept = [
        start + index
        for start, size, converted in parts
        for index in (range(size) if converted.kept is None else converted.kept)
    ]
    bad = tuple(
        BadRow(start + row.index, row.reason) for start, _, converted in parts for row in converted.bad
    )
    return Converted(batch, kept, bad, dict(missing))


def row_at(chunks: list[Records], index: int) -> Mapping[str, Any]:
    """Row ``index`` of the concatenated chunks, as a mapping (for the dead-letter payload)."""
    for chunk in chunks:
        size = record_count(chunk)
        if index < size:
            if isinstance(chunk, pa.RecordBatch):
                row: dict[str, Any] = split_missing(chunk.slice(index, 1))[0].to_pylist()[0]
                return row
            return chunk[index]
        index -= size
    raise IntegrityError(f"row {index} is past the end of the batch")
