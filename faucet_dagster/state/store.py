"""The durable state of continuous streams: certificates, leases, report marks, the uncertain flag.

One store through SQLAlchemy: a SQLite file under ``$DAGSTER_HOME`` by default (``FAUCET_STATE_URL``
or an explicit URL selects another), PostgreSQL in production (``postgresql://`` URLs use psycopg 3).
Every method is one database transaction and blocks until it commits; async callers run them in a
worker thread. Tables are created on first use and are prefixed ``faucet_`` so the store can share a
database with Dagster's own storage.

What holds:

* **Certificates** are append-only. :meth:`StateStore.append_certificate` accepts sequence ``n + 1``
  only, from the current lease holder, whose coverage starts exactly where each domain's certified
  position is and never goes back (compared through the domain's position codec, so ``"007"`` and
  ``"7"`` are one position). Appending a certificate identical to a stored one is accepted (a retry);
  a different one at a stored sequence is refused.
* **Leases** are compare-and-set on the database clock: an owner, a fencing token that only grows
  (each takeover adds one; a renewal keeps it) and an expiry. A stream whose last close was
  uncertain is not leased to anyone until an operator clears it (``faucet streams release``).
* **Hand-over requests**: a worker that finds a live lease held by a worker that started before it
  (the process a deployment is replacing) records a request on the stream; the holder sees it,
  closes at a certified position and passes the lease to the requester under the next fencing
  token, so the requester takes over without waiting out the lease. A request from an older worker
  is not recorded, so two live workers never take turns.
* **Report marks** record up to which certificate Dagster confirmed receiving the reports, so a
  report lost with a timed-out tick is sent again.
* **Dead letters** are keyed by event identity, so a replayed epoch does not store a row twice.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from faucet_dagster.protocol import (
    CodecRegistry,
    EpochCertificate,
    IntegrityError,
    OwnershipLost,
    Position,
    RejectedRecord,
    UncertainOutcome,
    default_codec_registry,
)
from faucet_dagster.state import tables as q
from faucet_dagster.state.certificates import advance_positions, canonical_certificate, fingerprint_and_body
from faucet_dagster.state.database import STATE_TIMEOUT, StoreDatabase
from faucet_dagster.state.status import StreamStatus, stored_positions, stream_status
from faucet_dagster.state.tables import (
    certificates_table,
    db_now,
    dead_letters_table,
    streams_table,
)


@dataclass(frozen=True)
class Lease:
    """A held lease: who holds ``stream``, with which fencing token, until when (database clock)."""

    stream: str
    owner: str
    fencing_token: int
    expires_at: float


@dataclass(frozen=True)
class LeaseBusy:
    """Another worker's live lease: who holds it, for how many seconds more (database clock), and
    whether it was asked to hand the stream over to the worker that tried to take it."""

    stream: str
    owner: str
    seconds_left: float
    handover_requested: bool

    def describe(self) -> str:
        asked = "; it was asked to hand the stream over" if self.handover_requested else ""
        return f"stream {self.stream!r} is leased to {self.owner} for {self.seconds_left:.1f}s{asked}"


class StateStore:
    """Certificates, leases, report marks and dead letters of continuous streams, in one database.

    Every method waits on the database at most ``timeout`` seconds in total, else raises
    :class:`~faucet_dagster.state.database.StateStoreUnavailable` ("state store unreachable"); so does
    building the store when the database cannot be reached.
    """

    def __init__(
        self, url: str | None = None, *, codecs: CodecRegistry | None = None, timeout: float = STATE_TIMEOUT
    ) -> None:
        self._db = StoreDatabase(url, timeout=timeout)
        self._where = self._db.where
        self._codecs = codecs or default_codec_registry()
        self._new_stream = self._db.insert(streams_table).on_conflict_do_nothing()

    @property
    def where(self) -> str:
        """The store's URL without its password, for messages."""
        return self._where

    @contextmanager
    def transaction(self, action: str, *, read_only: bool = False) -> Iterator[Connection]:
        """One transaction on the store, its failures translated as the store's own (``action`` names
        what was being done, for the message): for tables kept beside the store's (:mod:`.members`,
        :mod:`.verifications`). ``read_only``: it writes nothing (on SQLite it then waits for no writer)."""
        with self._db.transaction(action, read_only=read_only) as conn:
            yield conn

    def close(self) -> None:
        """Release the store's connections."""
        self._db.close()

    def __enter__(self) -> "StateStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- leases ---------------------------------------------------------------------------------

    def acquire_lease(self, stream: str, owner: str, ttl: float, *, started: float | None = None) -> Lease:
        """Take (or renew) ``stream``'s lease for ``ttl`` seconds (see :meth:`try_acquire_lease`).

        Raises :class:`OwnershipLost` while another owner's lease is live, and
        :class:`UncertainOutcome` while the stream is marked uncertain.
        """
        result = self.try_acquire_lease(stream, owner, ttl, started=started)
        if isinstance(result, LeaseBusy):
            raise OwnershipLost(result.describe(), where=stream)
        return result

    def try_acquire_lease(
        self, stream: str, owner: str, ttl: float, *, started: float | None = None
    ) -> Lease | LeaseBusy:
        """Take (or renew) ``stream``'s lease for ``ttl`` seconds, or say who holds it.

        A free or expired lease is taken over with the fencing token plus one; a lease ``owner``
        already holds is renewed with its token. ``started`` is when the owner's process started
        (seconds since 1970): while another owner's lease is live, an owner that started after the
        holder records a hand-over request the holder answers (:meth:`handover_requested`); the
        returned :class:`LeaseBusy` says whether one was recorded. Raises :class:`UncertainOutcome`
        while the stream is marked uncertain.
        """
        with self._db.transaction("acquire a lease") as conn:
            row, now = self._locked_stream(conn, stream)
            if row.uncertain:
                raise UncertainOutcome(
                    f"stream {stream!r} is not taken over: its last close was uncertain "
                    f"({row.uncertain_reason}); "
                    f"check the destination, then run `faucet streams release {stream}`",
                    where=stream,
                )
            live = row.lease_owner is not None and row.lease_expires is not None and row.lease_expires > now
            if live and row.lease_owner != owner:
                # Only a newer process asks: the holder a deployment replaces hands over, while two
                # live workers of one age never take the stream from each other in turns.
                newer = started is not None and (row.lease_started is None or started > row.lease_started)
                if newer and (row.handover_started is None or started >= row.handover_started):
                    conn.execute(
                        streams_table.update()
                        .where(streams_table.c.stream == stream)
                        .values(handover_to=owner, handover_started=started)
                    )
                asked = row.handover_to == owner or newer
                return LeaseBusy(stream, row.lease_owner, row.lease_expires - now, asked)
            renewal = row.lease_owner == owner
            token = row.fencing_token if renewal else row.fencing_token + 1
            expires = now + ttl
            values: dict[str, Any] = {"lease_owner": owner, "fencing_token": token, "lease_expires": expires}
            if not renewal:
                values.update(lease_started=started, handover_to=None, handover_started=None)
            conn.execute(streams_table.update().where(streams_table.c.stream == stream).values(**values))
            return Lease(stream, owner, token, expires)

    def hand_over(self, lease: Lease, ttl: float) -> str | None:
        """Pass ``lease`` to the worker that asked for it (:meth:`handover_requested`), for ``ttl``
        seconds under the next fencing token; returns that worker, or None (nothing changed) when no
        request is pending or ``lease`` is no longer held.

        The requester finds the lease its own when it next tries to take it, while every other
        worker finds it held: the stream cannot fall back to the holder that is stopping.
        """
        with self._db.transaction("hand a lease over") as conn:
            row, now = self._locked_stream(conn, lease.stream)
            held = (
                row.lease_owner == lease.owner
                and row.fencing_token == lease.fencing_token
                and not row.uncertain
            )
            if not held or row.handover_to is None:
                return None
            conn.execute(
                streams_table.update()
                .where(streams_table.c.stream == lease.stream)
                .values(
                    lease_owner=row.handover_to,
                    fencing_token=row.fencing_token + 1,
                    lease_expires=now + ttl,
                    lease_started=row.handover_started,
                    handover_to=None,
                    handover_started=None,
                )
            )
            return str(row.handover_to)

    def handover_requested(self, lease: Lease) -> str | None:
        """The worker that asked ``lease``'s holder to hand the stream over, or None (also when the
        lease is no longer held)."""
        with self._db.transaction("read hand-over requests", read_only=True) as conn:
            requester = conn.execute(q.HANDOVER_TO, _held(lease)).scalar_one_or_none()
            return None if requester is None else str(requester)

    def renew_lease(self, lease: Lease, ttl: float) -> Lease:
        """Extend a live lease by ``ttl`` seconds from now; :class:`OwnershipLost` if it is not held."""
        with self._db.transaction("renew a lease") as conn:
            expires = conn.execute(q.RENEW_LEASE, {**_held(lease), "ttl": ttl}).scalar_one_or_none()
            if expires is None:
                raise self._lost(conn, lease)
            return replace(lease, expires_at=float(expires))

    def check_lease(self, lease: Lease) -> None:
        """Raise :class:`OwnershipLost` unless ``lease`` is still held, live and with its token."""
        with self._db.transaction("check a lease", read_only=True) as conn:
            if conn.execute(q.CHECK_LEASE, _held(lease)).first() is None:
                raise self._lost(conn, lease)

    def release_lease(self, lease: Lease) -> bool:
        """Give ``lease`` up (a clean shutdown); False when it was no longer held (nothing changed)."""
        with self._db.transaction("release a lease") as conn:
            updated = conn.execute(
                streams_table.update()
                .where(*self._holds(lease))
                .values(lease_owner=None, lease_expires=None, lease_started=None)
            )
            return bool(updated.rowcount)

    def mark_uncertain(self, stream: str, reason: str) -> None:
        """Record that ``stream``'s last close was uncertain: no lease is granted until :meth:`release`."""
        with self._db.transaction("mark a stream uncertain") as conn:
            self._locked_stream(conn, stream)
            conn.execute(
                streams_table.update()
                .where(streams_table.c.stream == stream)
                .values(uncertain=True, uncertain_reason=reason[:2000])
            )

    def release(self, stream: str, *, unless_live: bool = False) -> StreamStatus:
        """Operator action: clear the uncertain flag and the lease; returns the status before.

        The fencing token is kept, so the next owner's token is still larger than every earlier one.
        ``unless_live``: a stream that is not marked uncertain and whose lease is live is left as it is
        (in the same transaction as the look), since a worker holds it and may still be writing.
        """
        with self._db.transaction("release a stream") as conn:
            before = stream_status(conn, stream, self._where)
            if unless_live and before.held_by_live_worker:
                return before
            conn.execute(
                streams_table.update()
                .where(streams_table.c.stream == stream)
                .values(lease_owner=None, lease_expires=None, uncertain=False, uncertain_reason=None)
            )
            return before

    # -- certificates ---------------------------------------------------------------------------

    def append_certificate(self, certificate: EpochCertificate, lease: Lease) -> bool:
        """Persist ``certificate`` durably; True when stored now, False for an identical retry.

        Refuses (:class:`OwnershipLost`) a certificate whose worker and token are not ``lease``'s
        live lease, checked before everything but an identical retry; (:class:`IntegrityError`) a
        conflicting certificate at a stored sequence, a gap in the sequence, coverage that does not
        start at a domain's certified position or goes back from it; (:class:`IncarnationChanged`)
        coverage of another incarnation of a certified domain.
        """
        stream = certificate.stream
        canonical = canonical_certificate(certificate, self._codecs)
        fingerprint, body = fingerprint_and_body(canonical)
        with self._db.transaction("append a certificate") as conn:
            # The stream row, locked (a lease was taken on it, so it exists unless nothing was leased).
            row = conn.execute(q.LOCKED_STREAM_ROW, {"stream": stream}).first()
            last_row = conn.execute(q.LAST_CERTIFICATE, {"stream": stream}).first()
            last = 0 if last_row is None else int(last_row.sequence)
            if certificate.sequence > last:
                stored = None
            elif certificate.sequence == last:
                stored = last_row.fingerprint if last_row is not None else None
            else:
                stored = conn.execute(
                    q.FINGERPRINT_AT, {"stream": stream, "sequence": certificate.sequence}
                ).scalar_one_or_none()
            if stored == fingerprint:
                return False
            # Ownership before consistency: a worker that lost its lease (a zombie) is told so, not
            # that the certificates of the worker that took over conflict with its own.
            if certificate.worker != lease.owner or certificate.fencing_token != lease.fencing_token:
                raise OwnershipLost(
                    f"certificate of {certificate.worker}@{certificate.fencing_token} came with the lease "
                    f"of {lease.owner}@{lease.fencing_token}",
                    where=stream,
                )
            if row is None or not _live(row, lease):
                raise self._lost(conn, lease)
            if stored is not None:
                raise IntegrityError(
                    f"certificate {certificate.certificate_id} conflicts with the one already stored",
                    where=stream,
                )
            if certificate.sequence != last + 1:
                raise IntegrityError(
                    f"certificate {certificate.sequence} does not follow the last certified epoch {last}",
                    where=stream,
                )
            advance_positions(conn, self._codecs, stream, certificate.sequence, canonical.coverage)
            conn.execute(
                q.INSERT_CERTIFICATE,
                {
                    "stream": stream,
                    "sequence": certificate.sequence,
                    "fencing_token": certificate.fencing_token,
                    "worker": certificate.worker,
                    "fingerprint": fingerprint,
                    "body": body,
                    "created_at": certificate.created_at or _utc_now(),
                },
            )
            return True

    def certificates(
        self, stream: str, *, after: int = 0, limit: int | None = None
    ) -> list[EpochCertificate]:
        """``stream``'s certificates with a sequence above ``after``, in sequence order."""
        query = (
            sa.select(certificates_table.c.body)
            .where(certificates_table.c.stream == stream, certificates_table.c.sequence > after)
            .order_by(certificates_table.c.sequence)
        )
        if limit is not None:
            query = query.limit(limit)
        with self._db.transaction("read certificates") as conn:
            return [EpochCertificate.from_json(body) for body in conn.execute(query).scalars()]

    def last_certificate(self, stream: str) -> EpochCertificate | None:
        with self._db.transaction("read the last certificate") as conn:
            body = conn.execute(
                sa.select(certificates_table.c.body)
                .where(certificates_table.c.stream == stream)
                .order_by(certificates_table.c.sequence.desc())
                .limit(1)
            ).scalar_one_or_none()
        return None if body is None else EpochCertificate.from_json(body)

    def certified_positions(self, stream: str) -> tuple[Position, ...]:
        """The certified position of every domain ``stream`` has covered: where a session resumes."""
        with self._db.transaction("read certified positions") as conn:
            return stored_positions(conn, stream)

    # -- reports to Dagster -----------------------------------------------------------------------

    def mark_reported(self, stream: str, through: int) -> None:
        """Record that Dagster received the reports of certificates up to ``through`` (never goes back)."""
        with self._db.transaction("mark certificates reported") as conn:
            self._locked_stream(conn, stream)
            column = streams_table.c.reported_through
            conn.execute(
                streams_table.update()
                .where(streams_table.c.stream == stream)
                .values(reported_through=sa.case((column < through, through), else_=column))
            )

    def claim_reported(self, stream: str, seen: int, through: int) -> bool:
        """Move the report mark from ``seen`` to ``through`` only if it still is ``seen``: True when this
        caller claimed the reports of the certificates after ``seen`` (another caller that read the same
        mark then finds it moved, so two processes never report one certificate twice)."""
        with self._db.transaction("claim certificate reports") as conn:
            self._locked_stream(conn, stream)
            column = streams_table.c.reported_through
            moved = conn.execute(
                streams_table.update()
                .where(streams_table.c.stream == stream, sa.func.coalesce(column, 0) == seen)
                .values(reported_through=through)
            )
            return bool(moved.rowcount == 1)

    def reported_through(self, stream: str) -> int:
        with self._db.transaction("read report marks") as conn:
            value = conn.execute(
                sa.select(streams_table.c.reported_through).where(streams_table.c.stream == stream)
            ).scalar_one_or_none()
            return int(value or 0)

    # -- dead letters ---------------------------------------------------------------------------

    def record_dead_letters(
        self, stream: str, sequence: int, fencing_token: int, letters: Sequence[RejectedRecord]
    ) -> None:
        """Store records routed to the dead-letter route by epoch ``sequence`` of the owner holding
        ``fencing_token``. One already stored (same identity) is not stored twice: it is kept, or
        taken over by this epoch when an older owner routed it (its epoch never committed, or it
        is the same record routed again after a takeover).
        """
        if not letters:
            return
        rows = [
            {
                "stream": stream,
                "identity": letter.identity.digest(),
                "event": str(letter.identity),
                "resource": letter.resource or letter.identity.domain.resource,
                "reason": letter.reason,
                "origin": letter.where,
                "payload": letter.payload,
                "sequence": sequence,
                "created_at": _utc_now(),
                "fencing_token": fencing_token,
            }
            for letter in letters
        ]
        insert = self._db.insert(dead_letters_table)
        table = dead_letters_table.c
        upsert = insert.on_conflict_do_update(
            index_elements=[table.stream, table.identity],
            set_={name: insert.excluded[name] for name in ("reason", "origin", "sequence", "fencing_token")},
            where=sa.or_(table.fencing_token.is_(None), table.fencing_token < insert.excluded.fencing_token),
        )
        with self._db.transaction("record dead letters") as conn:
            conn.execute(upsert, rows)

    def withdraw_dead_letters(
        self, stream: str, fencing_token: int, letters: Sequence[RejectedRecord]
    ) -> int:
        """Remove ``letters``, routed by an epoch of the owner holding ``fencing_token`` that was then
        aborted; a letter a newer owner has taken over stays. Returns how many were removed."""
        if not letters:
            return 0
        with self._db.transaction("withdraw dead letters") as conn:
            result = conn.execute(
                sa.delete(dead_letters_table).where(
                    dead_letters_table.c.stream == stream,
                    dead_letters_table.c.fencing_token == fencing_token,
                    dead_letters_table.c.identity.in_([letter.identity.digest() for letter in letters]),
                )
            )
            return int(result.rowcount)

    def discard_uncommitted_dead_letters(
        self, stream: str, committed_through: int, fencing_token: int
    ) -> int:
        """Remove the dead letters older owners routed for epochs after ``committed_through`` (the last
        epoch the destination may hold): those epochs never committed (their owner died or was fenced
        before it could withdraw them), and their replay routes again whatever it still rejects.
        Called by a new owner, holding ``fencing_token``, before its first epoch. Returns how many."""
        table = dead_letters_table.c
        with self._db.transaction("discard the dead letters of uncommitted epochs") as conn:
            result = conn.execute(
                sa.delete(dead_letters_table).where(
                    table.stream == stream,
                    table.sequence > committed_through,
                    sa.or_(table.fencing_token.is_(None), table.fencing_token < fencing_token),
                )
            )
            return int(result.rowcount)

    def dead_letters(self, stream: str) -> list[dict[str, Any]]:
        """``stream``'s dead letters, oldest first, as plain rows."""
        with self._db.transaction("read dead letters") as conn:
            result = conn.execute(
                sa.select(dead_letters_table)
                .where(dead_letters_table.c.stream == stream)
                .order_by(dead_letters_table.c.sequence, dead_letters_table.c.event)
            )
            return [dict(row._mapping) for row in result]

    # -- status ---------------------------------------------------------------------------------

    def status(self, stream: str | None = None) -> list[StreamStatus]:
        """The status of ``stream`` (a ConfigError if unknown), or of every known stream."""
        with self._db.transaction("read stream status") as conn:
            if stream is not None:
                return [stream_status(conn, stream, self._where)]
            names = conn.execute(sa.select(streams_table.c.stream).order_by(streams_table.c.stream)).scalars()
            return [stream_status(conn, name, self._where) for name in list(names)]

    # -- internals ------------------------------------------------------------------------------

    def _locked_stream(self, conn: Connection, stream: str) -> tuple[Any, float]:
        """The stream's row (created if new), locked for this transaction, and the database time."""
        conn.execute(
            self._new_stream,
            {"stream": stream, "fencing_token": 0, "uncertain": False, "reported_through": 0},
        )
        row = conn.execute(q.LOCKED_STREAM_ROW, {"stream": stream}).one()
        return row, float(row.now)

    def _holds(self, lease: Lease) -> tuple[sa.ColumnElement[bool], ...]:
        return (
            streams_table.c.stream == lease.stream,
            streams_table.c.lease_owner == lease.owner,
            streams_table.c.fencing_token == lease.fencing_token,
            streams_table.c.uncertain.is_(False),
        )

    def _lost(self, conn: Connection, lease: Lease) -> OwnershipLost:
        row = conn.execute(
            sa.select(streams_table, db_now().label("now")).where(streams_table.c.stream == lease.stream)
        ).first()
        if row is None or row.lease_owner is None:
            state = "it is not leased"
        elif row.lease_owner != lease.owner or row.fencing_token != lease.fencing_token:
            state = f"it is leased to {row.lease_owner} with fencing token {row.fencing_token}"
        elif row.uncertain:
            state = "it is marked uncertain"
        else:
            state = f"the lease expired {row.now - row.lease_expires:.1f}s ago"
        return OwnershipLost(
            f"{lease.owner} no longer holds stream {lease.stream!r} (token {lease.fencing_token}): {state}",
            where=lease.stream,
        )


def _held(lease: Lease) -> dict[str, Any]:
    """The bind parameters of :data:`tables.HOLDS` for ``lease``."""
    return {"held_stream": lease.stream, "held_owner": lease.owner, "held_token": lease.fencing_token}


def _live(row: Any, lease: Lease) -> bool:
    """Whether a stream row (with the database time as ``now``) shows ``lease`` held and live."""
    return bool(
        row.lease_owner == lease.owner
        and row.fencing_token == lease.fencing_token
        and not row.uncertain
        and row.lease_expires is not None
        and row.lease_expires > row.now
    )


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
