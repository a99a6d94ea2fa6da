"""The state store's tables, and the statements of an epoch's path, built once.

The tables are created on first use (:class:`~faucet_dagster.state.store.StateStore`). The statements
below are the ones every epoch runs (lease renewal and check, certificate append, hand-over polls):
built once with bind parameters, so a call only binds values (SQLAlchemy compiles each once per
dialect and caches it), instead of building and hashing a new expression per call, which cost more
than SQLite's commit itself.
"""

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

metadata = sa.MetaData()

streams_table = sa.Table(
    "faucet_streams",
    metadata,
    sa.Column("stream", sa.String(255), primary_key=True),
    sa.Column("lease_owner", sa.String(255), nullable=True),
    sa.Column("fencing_token", sa.BigInteger, nullable=False),
    sa.Column("lease_expires", sa.Float, nullable=True),
    sa.Column("uncertain", sa.Boolean, nullable=False),
    sa.Column("uncertain_reason", sa.Text, nullable=True),
    sa.Column("reported_through", sa.BigInteger, nullable=False),
    # Added after the first release: _add_missing_columns adds them to an existing store.
    sa.Column("lease_started", sa.Float, nullable=True),
    sa.Column("handover_to", sa.String(255), nullable=True),
    sa.Column("handover_started", sa.Float, nullable=True),
)

ADDED_COLUMNS = {
    "faucet_streams": ("lease_started", "handover_to", "handover_started"),
    "faucet_dead_letters": ("fencing_token",),
}
"""Columns a store created by an earlier version lacks, per table: all nullable."""

certificates_table = sa.Table(
    "faucet_certificates",
    metadata,
    sa.Column("stream", sa.String(255), primary_key=True),
    sa.Column("sequence", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("fencing_token", sa.BigInteger, nullable=False),
    sa.Column("worker", sa.String(255), nullable=False),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("created_at", sa.String(40), nullable=False),
)

positions_table = sa.Table(
    "faucet_positions",
    metadata,
    sa.Column("stream", sa.String(255), primary_key=True),
    sa.Column("source", sa.String(255), primary_key=True),
    sa.Column("resource", sa.String(255), primary_key=True),
    sa.Column("partition", sa.String(255), primary_key=True),
    sa.Column("incarnation", sa.String(255), nullable=False),
    sa.Column("codec", sa.String(255), nullable=False),
    sa.Column("position", sa.String(255), nullable=False),
    sa.Column("sequence", sa.BigInteger, nullable=False),
)

dead_letters_table = sa.Table(
    "faucet_dead_letters",
    metadata,
    sa.Column("stream", sa.String(255), primary_key=True),
    sa.Column("identity", sa.String(64), primary_key=True),
    sa.Column("event", sa.Text, nullable=False),
    sa.Column("resource", sa.String(255), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("origin", sa.Text, nullable=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
    sa.Column("sequence", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.String(40), nullable=False),
    # The fencing token of the owner whose epoch routed it: a zombie's withdrawal, and the cleanup of
    # an epoch that never committed, touch only what an older owner routed.
    sa.Column("fencing_token", sa.BigInteger, nullable=True),
)


class db_now(FunctionElement[float]):
    """Seconds since 1970 on the database's clock: every worker's lease is judged by one clock."""

    type = sa.Float()
    inherit_cache = True


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: Any, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(db_now, "postgresql")
def _db_now_postgresql(element: db_now, compiler: Any, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


# -- the statements of an epoch's path (bind parameters named below) ---------------------------------

_streams = streams_table.c
_certificates = certificates_table.c
_positions = positions_table.c

HOLDS = (
    _streams.stream == sa.bindparam("held_stream"),
    _streams.lease_owner == sa.bindparam("held_owner"),
    _streams.fencing_token == sa.bindparam("held_token"),
    _streams.uncertain.is_(False),
)
"""Where a lease (``held_stream``, ``held_owner``, ``held_token``) is still held (live or not)."""

STREAM_ROW = sa.select(streams_table, db_now().label("now")).where(_streams.stream == sa.bindparam("stream"))
"""A stream's row and the database time (``stream``)."""

LOCKED_STREAM_ROW = STREAM_ROW.with_for_update()
"""The same, locked for the transaction (PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` holds the lock)."""

RENEW_LEASE = (
    streams_table.update()
    .where(*HOLDS, _streams.lease_expires > db_now())
    .values(lease_expires=db_now() + sa.bindparam("ttl", type_=sa.Float()))
    .returning(_streams.lease_expires)
)
"""Extend a held, live lease to ``ttl`` seconds from now; returns the new expiry (no row: not held)."""

CHECK_LEASE = sa.select(_streams.stream).where(*HOLDS, _streams.lease_expires > db_now())
"""A row when the lease is held and live."""

HANDOVER_TO = sa.select(_streams.handover_to).where(*HOLDS)
"""Who asked the holder of a held lease to hand the stream over (NULL: nobody)."""

LAST_CERTIFICATE = (
    sa.select(_certificates.sequence, _certificates.fingerprint)
    .where(_certificates.stream == sa.bindparam("stream"))
    .order_by(_certificates.sequence.desc())
    .limit(1)
)
"""The last certificate's sequence and fingerprint (``stream``)."""

FINGERPRINT_AT = sa.select(_certificates.fingerprint).where(
    _certificates.stream == sa.bindparam("stream"), _certificates.sequence == sa.bindparam("sequence")
)
"""The fingerprint of the certificate at ``sequence`` of ``stream``."""

POSITIONS_OF = sa.select(positions_table).where(_positions.stream == sa.bindparam("stream"))
"""Every certified position of ``stream``."""

MOVE_POSITION = (
    positions_table.update()
    .where(
        _positions.stream == sa.bindparam("at_stream"),
        _positions.source == sa.bindparam("at_source"),
        _positions.resource == sa.bindparam("at_resource"),
        _positions.partition == sa.bindparam("at_partition"),
    )
    .values(position=sa.bindparam("to_position"), sequence=sa.bindparam("to_sequence"))
)
"""Move one certified position (``at_*`` names the row, ``to_*`` the new values)."""

INSERT_POSITION = positions_table.insert()
INSERT_CERTIFICATE = certificates_table.insert()
