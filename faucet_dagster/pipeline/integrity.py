"""Integrity of sealed batches: schema, required columns, row counts, and a digest of the encoding.

Every batch the pipeline hands to a sink passes :func:`check_batch` first, and is fed to an
:class:`EpochDigest`: blake2b over the Arrow IPC encoding of each batch (with its resource, domain and
schema), in the order the sink received them. Two epochs that handed the sink the same bytes in the
same order have the same digest, whatever the process or machine.
"""

import hashlib

import pyarrow as pa

from faucet_dagster.protocol import IntegrityError, SinkBatch

DIGEST_ALGORITHM = "blake2b-256"


def check_batch(batch: SinkBatch, schema: pa.Schema, required: frozenset[str]) -> None:
    """Refuse a batch whose schema, required columns or identity count is not what was promised.

    ``required`` names the columns that must hold no null (keys and non-nullable fields).
    """
    where = f"{batch.resource} in {batch.domain}"
    records = batch.records
    if not records.schema.equals(schema):
        raise IntegrityError(f"a batch has schema {records.schema}, expected {schema}", where=where)
    if records.num_rows != len(batch.identities):
        raise IntegrityError(
            f"a batch has {records.num_rows} rows but {len(batch.identities)} identities", where=where
        )
    ordinals = batch.identities.ordinals
    if ordinals is not None and len(ordinals) != len(batch.identities.positions):
        raise IntegrityError("a batch's ordinals and positions differ in length", where=where)
    nulls = [name for name in required if records.column(name).null_count]
    if nulls:
        raise IntegrityError(f"required column(s) {', '.join(sorted(nulls))} hold nulls", where=where)


class EpochDigest:
    """A running digest of what one epoch handed to the sink."""

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=32)
        self._schemas_seen: set[tuple[str, str]] = set()

    def add(self, batch: SinkBatch) -> None:
        """Feed ``batch``'s resource, domain, schema (once per resource and domain) and IPC encoding."""
        scope = (batch.resource, batch.domain.key())
        header = f"{scope[0]}\0{scope[1]}\0{batch.records.num_rows}\0".encode()
        self._hash.update(header)
        if scope not in self._schemas_seen:
            self._schemas_seen.add(scope)
            self._hash.update(memoryview(batch.records.schema.serialize()))
        self._hash.update(memoryview(batch.records.serialize()))

    def hexdigest(self) -> str:
        return f"{DIGEST_ALGORITHM}:{self._hash.hexdigest()}"
