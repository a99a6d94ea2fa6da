"""What ``faucet verify`` reads of the state store and keeps in it, beside the store's own tables.

It reads certificates as they are stored (the body and the fingerprint computed when it was stored,
so a body changed since is found), the certified position of each domain (with the certificate that
moved it there), and the dead letters an epoch routed. It keeps, in ``faucet_verifications``, the
outcome of every certificate it verified, so a verification without a range starts after the last
certificate verified.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa

from faucet_dagster.protocol import OrderingDomain
from faucet_dagster.state.store import StateStore
from faucet_dagster.state.tables import certificates_table, dead_letters_table, positions_table

verifications_metadata = sa.MetaData()

verifications_table = sa.Table(
    "faucet_verifications",
    verifications_metadata,
    sa.Column("stream", sa.String(255), primary_key=True),
    sa.Column("sequence", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("summary", sa.Text, nullable=False),
    sa.Column("verified_at", sa.String(40), nullable=False),
)

DESTINATION_REFUSED = "the destination refused the row"
"""How a dead letter of a row the destination refused begins its reason (the pipeline's wording):
such a row was handed to the sink (it is in the epoch's digest) but is not in its row count."""


@dataclass(frozen=True)
class StoredCertificate:
    """A certificate row as stored: its columns, the fingerprint written with it, and its body."""

    stream: str
    sequence: int
    fencing_token: int
    worker: str
    fingerprint: str
    body: str


@dataclass(frozen=True)
class CertifiedPosition:
    """A domain's certified position in the store, and the certificate that last moved it."""

    domain: OrderingDomain
    position: str
    sequence: int


@dataclass(frozen=True)
class VerificationMark:
    """The recorded outcome of a verified certificate."""

    sequence: int
    outcome: str
    summary: str
    verified_at: str


class VerificationLog:
    """The certificates of the store as ``faucet verify`` reads them, and its own records."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        with store.transaction("create the verifications table") as conn:
            verifications_metadata.create_all(conn)

    # -- reading the store ------------------------------------------------------------------------

    def certificates(
        self, stream: str, *, after: int = 0, through: int | None = None, limit: int | None = None
    ) -> list[StoredCertificate]:
        """``stream``'s stored certificates with a sequence above ``after`` (and at most ``through``),
        in sequence order, at most ``limit``."""
        table = certificates_table.c
        query = sa.select(certificates_table).where(table.stream == stream, table.sequence > after)
        if through is not None:
            query = query.where(table.sequence <= through)
        query = query.order_by(table.sequence)
        if limit is not None:
            query = query.limit(limit)
        return self._stored(query)

    def before(self, stream: str, sequence: int, limit: int) -> list[StoredCertificate]:
        """Up to ``limit`` certificates just before ``sequence``, newest first (the chain's history)."""
        table = certificates_table.c
        query = (
            sa.select(certificates_table)
            .where(table.stream == stream, table.sequence < sequence)
            .order_by(table.sequence.desc())
            .limit(limit)
        )
        return self._stored(query)

    def last_sequence(self, stream: str) -> int:
        """``stream``'s highest certificate sequence in the store (0: none)."""
        return self._highest(certificates_table, stream, "read the last certificate")

    def positions(self, stream: str) -> list[CertifiedPosition]:
        """Every certified position of ``stream``, with the certificate that moved it there."""
        with self.store.transaction("read certified positions", read_only=True) as conn:
            rows = conn.execute(sa.select(positions_table).where(positions_table.c.stream == stream))
            return [
                CertifiedPosition(
                    OrderingDomain(row.source, row.resource, row.partition, row.incarnation, row.codec),
                    row.position,
                    int(row.sequence),
                )
                for row in rows
            ]

    def refused_rows(self, stream: str, sequences: Sequence[int]) -> dict[int, dict[str, set[str]]]:
        """The rows the destination refused in epochs ``sequences`` (dead-lettered by the pipeline):
        ``{sequence: {resource: {event identity, ...}}}``."""
        found: dict[int, dict[str, set[str]]] = {}
        if not sequences:
            return found
        table = dead_letters_table.c
        with self.store.transaction("read dead letters", read_only=True) as conn:
            rows = conn.execute(
                sa.select(table.sequence, table.resource, table.event).where(
                    table.stream == stream,
                    table.sequence.in_(list(sequences)),
                    table.reason.startswith(DESTINATION_REFUSED),
                )
            )
            for row in rows:
                found.setdefault(int(row.sequence), {}).setdefault(row.resource, set()).add(row.event)
        return found

    # -- what verify keeps --------------------------------------------------------------------------

    def verified_through(self, stream: str) -> int:
        """The highest certificate sequence of ``stream`` with a recorded outcome (0: none)."""
        return self._highest(verifications_table, stream, "read verification marks")

    def _highest(self, table: sa.Table, stream: str, action: str) -> int:
        with self.store.transaction(action, read_only=True) as conn:
            found = conn.execute(
                sa.select(sa.func.max(table.c.sequence)).where(table.c.stream == stream)
            ).scalar_one_or_none()
        return int(found or 0)

    def record(self, stream: str, outcomes: Mapping[int, tuple[str, str]]) -> None:
        """Record ``{sequence: (outcome, summary)}`` for ``stream`` (a later verification replaces an
        earlier one's record of the same certificate)."""
        if not outcomes:
            return
        now = datetime.now(UTC).isoformat(timespec="microseconds")
        table = verifications_table.c
        with self.store.transaction("record verifications") as conn:
            conn.execute(
                sa.delete(verifications_table).where(
                    table.stream == stream, table.sequence.in_(list(outcomes))
                )
            )
            conn.execute(
                verifications_table.insert(),
                [
                    {
                        "stream": stream,
                        "sequence": sequence,
                        "outcome": outcome,
                        "summary": summary[:4000],
                        "verified_at": now,
                    }
                    for sequence, (outcome, summary) in outcomes.items()
                ],
            )

    def marks(self, stream: str, *, outcome: str | None = None) -> list[VerificationMark]:
        """The recorded outcomes of ``stream`` (only ``outcome`` ones when given), in sequence order."""
        table = verifications_table.c
        query = sa.select(verifications_table).where(table.stream == stream)
        if outcome is not None:
            query = query.where(table.outcome == outcome)
        with self.store.transaction("read verification marks", read_only=True) as conn:
            return [
                VerificationMark(int(row.sequence), row.outcome, row.summary, row.verified_at)
                for row in conn.execute(query.order_by(table.sequence))
            ]

    def _stored(self, query: sa.Select[tuple[object, ...]]) -> list[StoredCertificate]:
        with self.store.transaction("read certificates", read_only=True) as conn:
            return [
                StoredCertificate(
                    row.stream,
                    int(row.sequence),
                    int(row.fencing_token),
                    row.worker,
                    row.fingerprint,
                    row.body,
                )
                for row in conn.execute(query)
            ]


__all__ = [
    "DESTINATION_REFUSED",
    "CertifiedPosition",
    "StoredCertificate",
    "VerificationLog",
    "VerificationMark",
    "verifications_table",
]
