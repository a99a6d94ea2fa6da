"""Integrity of sealed batches: schema, required columns, row counts, and digests of the encoding.

Every batch the pipeline hands to a sink passes :func:`check_batch` first, and is fed to two digests:

* an :class:`EpochDigest`: blake2b over the Arrow IPC encoding of each batch (with its resource, domain
  and schema), in the order the sink received them. Two epochs that handed the sink the same bytes in
  the same order have the same digest, whatever the process or machine;
* :class:`RowDigests`: per resource, a digest of the same rows that does not depend on how they were
  batched, nor on how the domains' rows were interleaved, so a replay of the epoch's coverage
  (``faucet verify``), which batches and interleaves as its own reads fall, recomputes it. Each
  domain's rows are hashed in their order in fixed chunks of :data:`ROW_DIGEST_CHUNK` rows (the IPC
  encoding of a chunk concatenated afresh, which is canonical: slices and batch boundaries leave no
  trace in it), and the domains' hashes are combined in the order of their keys.
"""

import hashlib

import pyarrow as pa

from faucet_dagster.protocol import IntegrityError, SinkBatch

DIGEST_ALGORITHM = "blake2b-256"
ROW_DIGEST_ALGORITHM = "rows-blake2b-256"
ROW_DIGEST_CHUNK = 4096
"""Rows per hashed chunk of one domain's rows: what a row digest holds back at most, per domain."""


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


class _DomainRows:
    """The running hash of one resource's rows from one domain, in canonical chunks."""

    __slots__ = ("carry", "carry_rows", "hash", "rows", "schema")

    def __init__(self) -> None:
        self.hash = hashlib.blake2b(digest_size=32)
        self.carry: list[pa.RecordBatch] = []
        self.carry_rows = 0
        self.rows = 0
        self.schema: pa.Schema | None = None

    def add(self, records: pa.RecordBatch) -> None:
        if self.schema is None or not records.schema.equals(self.schema, check_metadata=True):
            self._flush()
            self.schema = records.schema
            self.hash.update(b"schema\0" + memoryview(records.schema.serialize()).tobytes())
        self.carry.append(records)
        self.carry_rows += records.num_rows
        self.rows += records.num_rows
        while self.carry_rows >= ROW_DIGEST_CHUNK:
            joined = self.carry[0] if len(self.carry) == 1 else pa.concat_batches(self.carry)
            self._chunk(joined.slice(0, ROW_DIGEST_CHUNK))
            rest = joined.slice(ROW_DIGEST_CHUNK)
            self.carry = [rest] if rest.num_rows else []
            self.carry_rows = rest.num_rows

    def hexdigest(self) -> str:
        self._flush()
        return self.hash.hexdigest()

    def _flush(self) -> None:
        if self.carry_rows:
            self._chunk(pa.concat_batches(self.carry))
        self.carry, self.carry_rows = [], 0

    def _chunk(self, records: pa.RecordBatch) -> None:
        canonical = pa.concat_batches([records])  # fresh buffers: a slice encodes its parent's offsets
        self.hash.update(f"{canonical.num_rows}\0".encode())
        self.hash.update(memoryview(canonical.serialize()))


class RowDigests:
    """Per resource, a digest of the rows handed to the sink, whatever their batches (module doc).

    Holds back at most :data:`ROW_DIGEST_CHUNK` rows per (resource, domain) until :meth:`digests`.
    """

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], _DomainRows] = {}

    def add(self, batch: SinkBatch) -> None:
        """Feed ``batch``'s rows (after the rows of its resource and domain fed before)."""
        scope = (batch.resource, batch.domain.key())
        rows = self._rows.get(scope)
        if rows is None:
            rows = self._rows[scope] = _DomainRows()
        rows.add(batch.records)

    def digests(self) -> dict[str, str]:
        """``{resource: "rows-blake2b-256:<hex>"}``; call once, after the last :meth:`add`."""
        combined: dict[str, hashlib.blake2b] = {}
        for (resource, domain), rows in sorted(self._rows.items()):
            digest = combined.get(resource)
            if digest is None:
                digest = combined[resource] = hashlib.blake2b(digest_size=32)
            digest.update(f"{domain}\0{rows.rows}\0{rows.hexdigest()}\0".encode())
        return {
            resource: f"{ROW_DIGEST_ALGORITHM}:{digest.hexdigest()}" for resource, digest in combined.items()
        }

    def schemas(self) -> dict[str, str]:
        """``{resource: fingerprint}`` of the Arrow schemas (field names, types and metadata) its rows
        had, in order of their first appearance: a replay that converts with another schema (an
        inferred one) is told apart from one that found other rows."""
        found: dict[str, list[bytes]] = {}
        for (resource, _), rows in self._rows.items():
            if rows.schema is not None:
                encoded = rows.schema.serialize().to_pybytes()
                mine = found.setdefault(resource, [])
                if encoded not in mine:
                    mine.append(encoded)
        return {
            resource: hashlib.blake2b(b"\0".join(encodings), digest_size=8).hexdigest()
            for resource, encodings in found.items()
        }
