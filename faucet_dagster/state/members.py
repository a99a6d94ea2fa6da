"""Member leases: which workers of a stream are alive, kept in the state store beside its leases.

A worker of a stream with several workers (:mod:`faucet_dagster.runner.members`) joins the stream's
membership with a short lease of its own (renewed in the background like a stream lease), and the
live members, in the order they joined, decide which partition groups each reads. A member lease only
says who is alive: a partition group is read under its own group lease (a stream lease of the store,
with its own fencing token), so two members that briefly disagree about the membership still never
read one group at the same time.

Each member lease has a fencing token that grows every time the member (re)joins after its lease
lapsed, so a member that was frozen past its lease learns it was counted out (:meth:`renew` raises
:class:`OwnershipLost`) and joins again as a new incarnation. Leases that lapsed long ago are pruned
when a member joins.
"""

import re
from dataclasses import dataclass, replace

import sqlalchemy as sa

from faucet_dagster.protocol import OwnershipLost
from faucet_dagster.state.store import StateStore
from faucet_dagster.state.tables import db_now

GROUP_STREAM = re.compile(r"(?P<stream>.+)\[(?P<group>\d+)/(?P<groups>\d+)\]")
"""How a partition group's stream is named: ``<stream>[g/groups]``."""

PRUNE_AFTER_SECONDS = 3600.0
"""A member lease that lapsed this long ago is deleted when another member joins."""

members_metadata = sa.MetaData()

members_table = sa.Table(
    "faucet_members",
    members_metadata,
    sa.Column("stream", sa.String(255), primary_key=True),
    sa.Column("member", sa.String(255), primary_key=True),
    sa.Column("fencing_token", sa.BigInteger, nullable=False),
    sa.Column("joined", sa.Float, nullable=False),
    sa.Column("expires", sa.Float, nullable=True),
)


def group_stream(stream: str, group: int, groups: int) -> str:
    """The stream name group ``group`` of ``groups`` is leased and certified under."""
    return f"{stream}[{group}/{groups}]"


def parse_group_stream(name: str) -> tuple[str, int, int] | None:
    """``(stream, group, groups)`` of a partition group's stream name; None for any other name."""
    found = GROUP_STREAM.fullmatch(name)
    if found is None:
        return None
    return found["stream"], int(found["group"]), int(found["groups"])


@dataclass(frozen=True)
class MemberLease:
    """A held member lease: ``member`` of ``stream``, its fencing token, when it joined (seconds since
    1970, the database clock) and until when it lives."""

    stream: str
    member: str
    fencing_token: int
    joined: float
    expires_at: float


@dataclass(frozen=True)
class LiveMember:
    """A member whose lease is live, with the seconds it has left."""

    member: str
    fencing_token: int
    joined: float
    seconds_left: float


class MemberRegistry:
    """The member leases of every stream, in ``store``'s database (table ``faucet_members``)."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        with store.transaction("create the members table") as conn:
            members_metadata.create_all(conn)

    def join(self, stream: str, member: str, ttl: float) -> MemberLease:
        """Join ``stream``'s membership for ``ttl`` seconds: a new member, or one whose lease lapsed
        (its fencing token grows), or a renewal of a live lease ``member`` holds (same token)."""
        with self._store.transaction("join a stream's members") as conn:
            now = float(conn.execute(sa.select(db_now())).scalar_one())
            conn.execute(
                members_table.delete().where(
                    members_table.c.stream == stream,
                    members_table.c.expires < now - PRUNE_AFTER_SECONDS,
                )
            )
            key = (members_table.c.stream == stream, members_table.c.member == member)
            row = conn.execute(sa.select(members_table).where(*key).with_for_update()).first()
            if row is None:
                conn.execute(
                    members_table.insert().values(
                        stream=stream, member=member, fencing_token=1, joined=now, expires=now + ttl
                    )
                )
                return MemberLease(stream, member, 1, now, now + ttl)
            live = row.expires is not None and row.expires > now
            token = int(row.fencing_token) if live else int(row.fencing_token) + 1
            joined = float(row.joined) if live else now
            conn.execute(
                members_table.update()
                .where(*key)
                .values(fencing_token=token, joined=joined, expires=now + ttl)
            )
            return MemberLease(stream, member, token, joined, now + ttl)

    def renew(self, lease: MemberLease, ttl: float) -> MemberLease:
        """Extend a live member lease; :class:`OwnershipLost` when it lapsed or was replaced."""
        with self._store.transaction("renew a member lease") as conn:
            now = float(conn.execute(sa.select(db_now())).scalar_one())
            updated = conn.execute(
                members_table.update()
                .where(
                    members_table.c.stream == lease.stream,
                    members_table.c.member == lease.member,
                    members_table.c.fencing_token == lease.fencing_token,
                    members_table.c.expires > now,
                )
                .values(expires=now + ttl)
            )
            if updated.rowcount != 1:
                raise OwnershipLost(
                    f"member {lease.member} of stream {lease.stream!r} (token {lease.fencing_token}) "
                    "was counted out: its lease lapsed",
                    where=lease.stream,
                )
            return replace(lease, expires_at=now + ttl)

    def leave(self, lease: MemberLease) -> bool:
        """Give the member lease up (a clean stop); False when it was no longer held."""
        with self._store.transaction("leave a stream's members") as conn:
            updated = conn.execute(
                members_table.update()
                .where(
                    members_table.c.stream == lease.stream,
                    members_table.c.member == lease.member,
                    members_table.c.fencing_token == lease.fencing_token,
                )
                .values(expires=None)
            )
            return bool(updated.rowcount)

    def live(self, stream: str) -> tuple[LiveMember, ...]:
        """``stream``'s live members, in the order they joined (ties by name): the order assignments
        are computed in."""
        with self._store.transaction("read a stream's members") as conn:
            now = float(conn.execute(sa.select(db_now())).scalar_one())
            rows = conn.execute(
                sa.select(members_table)
                .where(members_table.c.stream == stream, members_table.c.expires > now)
                .order_by(members_table.c.joined, members_table.c.member)
            )
            return tuple(
                LiveMember(row.member, int(row.fencing_token), float(row.joined), float(row.expires) - now)
                for row in rows
            )

    def lapsed(self, stream: str) -> dict[str, float | None]:
        """The members of ``stream`` that are not live, with the seconds since their lease lapsed
        (None: the member left). Rows are pruned an hour after they lapsed; a member still starting
        has none."""
        with self._store.transaction("read a stream's members") as conn:
            now = float(conn.execute(sa.select(db_now())).scalar_one())
            rows = conn.execute(
                sa.select(members_table.c.member, members_table.c.expires).where(
                    members_table.c.stream == stream,
                    sa.or_(members_table.c.expires.is_(None), members_table.c.expires <= now),
                )
            )
            return {
                str(row.member): None if row.expires is None else now - float(row.expires) for row in rows
            }
