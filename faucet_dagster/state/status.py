"""Reading what the state store (:mod:`.store`) knows about a stream: its lease, flags, report mark,
certified positions and dead letters, as a :class:`StreamStatus` (for ``faucet streams status``).
"""

from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from faucet_dagster.protocol import ConfigError, OrderingDomain, Position
from faucet_dagster.state.tables import (
    certificates_table,
    db_now,
    dead_letters_table,
    positions_table,
    streams_table,
)


@dataclass(frozen=True)
class StreamStatus:
    """What the store knows about one stream (for ``faucet streams status``)."""

    stream: str
    owner: str | None
    fencing_token: int
    lease_expires: float | None
    lease_seconds_left: float | None
    handover_to: str | None
    uncertain: bool
    uncertain_reason: str | None
    last_sequence: int
    reported_through: int
    positions: tuple[Position, ...]
    dead_letters: int

    @property
    def lease_live(self) -> bool:
        """True while an owner holds an unexpired lease."""
        return self.owner is not None and self.lease_seconds_left is not None and self.lease_seconds_left > 0

    @property
    def held_by_live_worker(self) -> bool:
        """True when a worker holds a live lease and the stream is not marked uncertain: a release
        would let another worker write beside it (``StateStore.release(unless_live=True)`` refuses)."""
        return self.lease_live and not self.uncertain

    def to_dict(self) -> dict[str, Any]:
        plain = asdict(self)
        plain["lease_live"] = self.lease_live
        plain["positions"] = [{"domain": str(item.domain), "position": item.value} for item in self.positions]
        return plain


def stream_status(conn: Connection, stream: str, where: str) -> StreamStatus:
    """What the store knows about ``stream``; a ConfigError (naming the store ``where``) if unknown."""
    row = conn.execute(
        sa.select(streams_table, db_now().label("now")).where(streams_table.c.stream == stream)
    ).first()
    if row is None:
        raise ConfigError(f"the state store knows no stream {stream!r}", where=where)
    dead = conn.execute(
        sa.select(sa.func.count())
        .select_from(dead_letters_table)
        .where(dead_letters_table.c.stream == stream)
    ).scalar_one()
    return StreamStatus(
        stream=stream,
        owner=row.lease_owner,
        fencing_token=row.fencing_token,
        lease_expires=row.lease_expires,
        lease_seconds_left=None if row.lease_expires is None else row.lease_expires - row.now,
        handover_to=row.handover_to,
        uncertain=bool(row.uncertain),
        uncertain_reason=row.uncertain_reason,
        last_sequence=_last_sequence(conn, stream),
        reported_through=row.reported_through,
        positions=stored_positions(conn, stream),
        dead_letters=int(dead),
    )


def stored_positions(conn: Connection, stream: str) -> tuple[Position, ...]:
    rows = conn.execute(
        sa.select(positions_table)
        .where(positions_table.c.stream == stream)
        .order_by(positions_table.c.source, positions_table.c.resource, positions_table.c.partition)
    )
    return tuple(
        Position(
            OrderingDomain(row.source, row.resource, row.partition, row.incarnation, row.codec),
            row.position,
        )
        for row in rows
    )


def _last_sequence(conn: Connection, stream: str) -> int:
    value = conn.execute(
        sa.select(sa.func.max(certificates_table.c.sequence)).where(certificates_table.c.stream == stream)
    ).scalar_one_or_none()
    return int(value or 0)
