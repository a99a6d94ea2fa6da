"""Keyed batches: the last row of every key (last write wins within a batch) and rows without a key.

A sink that upserts a batch by a key applies one row per key: the batch's last one, as applying the
rows one after the other would leave (:func:`upsert_rows` also refuses a row without its key). Pure
Arrow, no I/O.
"""

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.protocol.errors import DataError, SchemaError

_ROW = "__faucet_row"


def last_row_per_key(batch: pa.RecordBatch, key: Sequence[str]) -> pa.RecordBatch:
    """``batch`` with only the last row of every key, in batch order (last write wins)."""
    if batch.num_rows < 2:
        return batch
    table = pa.Table.from_batches([batch]).select(list(key))
    table = table.append_column(_ROW, pa.array(range(batch.num_rows), pa.int64()))
    last = table.group_by(list(key), use_threads=False).aggregate([(_ROW, "max")])
    rows = last.column(f"{_ROW}_max").combine_chunks()
    if len(rows) == batch.num_rows:
        return batch
    return batch.take(pc.take(rows, pc.sort_indices(rows)))


def first_row_without_key(batch: pa.RecordBatch, key: Sequence[str]) -> int | None:
    """The index of the first row whose key has a null column (None: every row has its key)."""
    missing = [pc.is_null(batch.column(name)) for name in key if batch.column(name).null_count]
    if not missing:
        return None
    anywhere = missing[0]
    for more in missing[1:]:
        anywhere = pc.or_(anywhere, more)
    return int(pc.index(anywhere, True).as_py())


def upsert_rows(batch: pa.RecordBatch, key: Sequence[str], where: str) -> pa.RecordBatch:
    """``batch`` ready to upsert by ``key``: its last row per key. A missing key column raises
    SchemaError, a row without its key DataError (naming the row), both at ``where``."""
    missing = [name for name in key if name not in batch.schema.names]
    if missing:
        raise SchemaError(f"the records lack key column(s) {', '.join(missing)}", where=where)
    row = first_row_without_key(batch, key)
    if row is not None:
        raise DataError(
            f"row {row} of the batch has no value in a key column ({', '.join(key)})", where=where
        )
    return last_row_per_key(batch, key)


__all__ = ["first_row_without_key", "last_row_per_key", "upsert_rows"]
