"""APPLY_CHANGES in an epoch of the PostgreSQL streaming sink (:mod:`faucet_postgres.stream_sink`).

APPLY_CHANGES applies change rows (``__faucet_op`` insert/update/delete, ``__faucet_unchanged``) by key
in commit order, whatever order the batches of the epoch arrived in: every row is staged with its
position (which must be an integer position: an LSN, an offset, a sequence) and ordinal, and at commit
each table gets its keys' last changes in one set-based statement (:mod:`faucet_postgres.changes`).
Tables are applied one after another in the epoch's transaction, so foreign keys between replicated
tables must be ``DEFERRABLE INITIALLY DEFERRED`` in the destination. The key is the stream's key, else
each table's ``faucet.key`` columns (the PostgreSQL change source marks its replica identity). A table
is fed from one ordering domain only: changes of two domains have no common order.

APPLY_CHANGES judges the destination at commit: a refused change is found by bisection over the
stage's keys and named by its position, key and constraint, never dead-lettered (a replica missing
one change diverges from its source).
"""

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from faucet_dagster.protocol import (
    DataError,
    EventIdentity,
    FaucetError,
    Identities,
    IntegrityError,
    OrderingDomain,
    default_codec_registry,
)
from faucet_postgres import change_apply, changes, refusals
from faucet_postgres.common import is_row_error, row_error_reason
from faucet_postgres.stream_state import Epoch, PendingChanges, Target
from faucet_postgres.stream_tables import Tables

Connection = psycopg.AsyncConnection[Any]
Failure = Callable[..., Awaitable[FaucetError]]
"""``failure(exc, where=..., doing=...)``: the session's FaucetError for a psycopg error."""

_MAX_BIGINT = 2**63 - 1


class ChangeApplier:
    """APPLY_CHANGES for one session: stages each batch's change rows per table (:meth:`stage`) and
    applies every table's stage first thing in the commit (:meth:`apply_all`)."""

    def __init__(self, key: tuple[str, ...], where: str, tables: Tables, failure: Failure) -> None:
        self._key = key
        self._where = where
        self._tables = tables
        self._failure = failure

    async def stage(
        self,
        conn: Connection,
        state: Epoch,
        table: str,
        domain: OrderingDomain,
        records: pa.RecordBatch,
        identities: Identities,
    ) -> tuple[Target, int]:
        """APPLY_CHANGES: stage change rows with their commit order (see ``changes.stage``)."""
        where = f"{self._where} table {table}"
        layout = changes.change_layout(records.schema, self._key, where)
        pending = state.changes.get(table)
        if pending is not None and pending.domain != domain.lineage:
            raise IntegrityError(
                f"changes from {'/'.join(domain.lineage)} and {'/'.join(pending.domain)} go to one table: "
                "two ordering domains have no common order to apply them in",
                where=where,
            )
        positions = _integer_positions(domain, identities, where)
        if pending is None or pending.stage.layout != layout or pending.schema != records.schema:
            counts = change_apply.NO_CHANGES
            if pending is not None:
                # The source table's columns changed (DDL) within the epoch: the changes before it are
                # applied now, so the new columns' backfill reaches exactly their rows. That needs
                # them to precede every row of the new schema (one resource per table does).
                first = pc.min(positions).as_py()
                if first is not None and first < pending.last_position:
                    raise IntegrityError(
                        f"changes of another schema of table {table} came before changes already staged "
                        "(two resources write this table?): they cannot be applied in commit order",
                        where=where,
                    )
                counts = await self._apply_pending(conn, state, table, pending)
            data = changes.data_schema(records.schema)
            target = await self._tables.target(conn, table, data, layout.created_key, change_rows=True)
            stage = await changes.create_stage(conn, target.identifier, target.columns, layout)
            stage.name_refused = True
            pending = state.changes[table] = PendingChanges(
                target, stage, domain.lineage, records.schema, domain, counts
            )
        rows = changes.staged_rows(records, layout, positions, _ordinals(identities), where)
        pending.last_position = max(pending.last_position, pc.max(positions).as_py() or 0)
        try:
            return pending.target, await changes.stage(conn, pending.stage, rows)
        except DataError as exc:
            raise _refused_change(exc, where, pending.ordering) from exc

    async def apply_all(self, conn: Connection, state: Epoch) -> None:
        """APPLY_CHANGES: apply every table's staged changes (first step of the commit)."""
        for table, pending in state.changes.items():
            pending.counts = await self._apply_pending(conn, state, table, pending)

    async def _apply_pending(
        self, conn: Connection, state: Epoch, table: str, pending: PendingChanges
    ) -> change_apply.ChangeCounts:
        """Apply one table's stage; the counts so far plus this stage's."""
        where = f"{self._where} table {table}"
        try:
            counts = await self._apply_stage(conn, pending, where)
            if counts.unexpected_inserts or counts.unexpected_changes:
                # The replica is not what the stream made it (written by something else, or a change was
                # lost or applied twice): committing would certify a diverged replica.
                example = "" if counts.surprise is None else f", key {counts.surprise}"
                raise IntegrityError(
                    f"the replica diverged from the change stream: {counts.unexpected_inserts} insert(s) "
                    f"of rows it held, {counts.unexpected_changes} update(s) or delete(s) of rows it "
                    f"lacked{example}; nothing of the epoch is committed",
                    where=where,
                )
            return pending.counts + counts
        except BaseException as exc:
            state.failed = True
            if isinstance(exc, psycopg.Error):
                raise await self._failure(exc, where=where, doing="applying the epoch's changes") from exc
            if isinstance(exc, pa.ArrowException):
                raise DataError(f"the changes cannot be encoded for COPY: {exc}", where=where) from exc
            raise

    async def _apply_stage(
        self, conn: Connection, pending: PendingChanges, where: str
    ) -> change_apply.ChangeCounts:
        """Apply one table's stage under a savepoint. A change the destination refuses (a constraint,
        SQLSTATE class 22 or 23) raises DataError naming its position in the source (an LSN, an offset),
        its key and the constraint, found by bisection over the stage's keys. APPLY_CHANGES never
        dead-letters it: a replica missing one change diverges from its source."""
        target = pending.target.identifier
        try:
            await changes.copy_held(conn, pending.stage)
        except DataError as exc:
            raise _refused_change(exc, where, pending.ordering) from exc
        try:
            async with refusals.savepoint(conn):
                return await change_apply.apply_stage(conn, target, pending.stage, where)
        except psycopg.Error as exc:
            if not is_row_error(exc):
                raise
            found = await change_apply.refused_change(conn, target, pending.stage, where)
            if found is None:
                raise DataError(
                    f"the destination refused the epoch's changes: {row_error_reason(exc)} (no single "
                    "key's changes are refused alone)",
                    where=where,
                ) from exc
            codec = default_codec_registry().get(pending.ordering.codec)
            identity = EventIdentity(pending.ordering, codec.canonicalize(found.position), found.ordinal)
            raise DataError(
                f"the destination refused the change of key {found.key}: {found.reason}",
                where=f"{where} @ {identity}",
            ) from exc


def _refused_change(exc: DataError, where: str, domain: OrderingDomain) -> DataError:
    """``exc`` (a staged row the server refused, :func:`changes.copy_held`) naming the row's event
    identity in ``domain``; ``exc`` itself for another DataError."""
    position = exc.details.get("position")
    if position is None:
        return exc
    codec = default_codec_registry().get(domain.codec)
    identity = EventIdentity(domain, codec.canonicalize(int(position)), int(exc.details.get("ordinal", 0)))
    return DataError(exc.message, where=f"{where} @ {identity}")


def _integer_positions(domain: OrderingDomain, identities: Identities, where: str) -> pa.Array:
    """The rows' positions as int64 (validated through the domain's codec), to order changes by."""
    codec = default_codec_registry().get(domain.codec)
    encoded = pa.array(identities.positions, pa.string()).dictionary_encode()
    texts = encoded.dictionary.to_pylist()
    values = list(map(codec.validate, texts))  # once per distinct position: per source transaction
    if all(_is_integer(value) for value in values):
        try:
            array = pa.array(values, pa.int64())
        except (OverflowError, pa.ArrowException):
            pass  # above the bigint range: named below
        else:
            if not values or (pc.min(array).as_py() or 0) >= 0:
                return pc.take(array, encoded.indices)
    text = next(
        text
        for text, value in zip(texts, values, strict=True)
        if not _is_integer(value) or not 0 <= value <= _MAX_BIGINT
    )
    raise IntegrityError(
        f"apply_changes orders changes by position, and {codec.name} position {text!r} is not "
        "a non-negative 64-bit integer",
        where=where,
    )


def _is_integer(value: object) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def _ordinals(identities: Identities) -> pa.Array:
    ordinals = identities.ordinals
    return pa.array([0] * len(identities) if ordinals is None else ordinals, pa.int64())
